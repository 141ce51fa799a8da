"""Runs of NVMe record payloads read straight into page-aligned memory, compiled (``payload_run_kernels.py``):
``ready()`` (the first call starts compiling, or loading numba's cache, on a daemon thread; False until done, and
always without numba or a CPU with SSE4.2 and PCLMULQDQ), ``kernels()`` (the module, once ready) and ``COMPILED``,
the ``BackgroundCompile`` behind both (``warm_up()`` compiles on the calling thread: a store's start, tests).

One loader for both callers (the ``--share-nvme`` client and the NVMe tier), so a process that is both compiles
once. Imports no numba itself.

``GATHER_BLOCK_BYTES``: runs of blocks this small or smaller are read into one piece of scratch memory and copied
out with their checks (``payload_run_kernels.read_run``), which beat reading each payload straight into its own
destination on this project's virtual disk at 64 KiB (0.61 against 0.68 ms for 32 blocks alone, 0.79-0.82 against
0.69-0.72 of the raw read in a client's Get loop) and came out even at 128 and 256 KiB in that loop: 128 KiB is
where it stops. Where the disk takes scattered memory at no cost (a bare-metal NVMe drive may), the copy is all
that is left of it: ``KVSTORE_GATHER_BLOCK_BYTES=0`` turns it off, another size (``256KiB``) moves the line (a
process reads it once, at import).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvstore import memops_jit
from kvstore.background_compile import BackgroundCompile
from kvstore.sizes import parse_size

log = logging.getLogger(__name__)

GATHER_BLOCK_DEFAULT = 128 << 10


def gather_block_bytes(text: str | None) -> int:
    """``KVSTORE_GATHER_BLOCK_BYTES`` read: a size (``0``, ``65536``, ``128KiB``), the default when unset or not a
    size (which is logged)."""
    if not text:
        return GATHER_BLOCK_DEFAULT
    try:
        return max(0, parse_size(text))
    except ValueError as err:
        log.warning("KVSTORE_GATHER_BLOCK_BYTES: %s; reads gather blocks up to %d bytes", err, GATHER_BLOCK_DEFAULT)
        return GATHER_BLOCK_DEFAULT


GATHER_BLOCK_BYTES = gather_block_bytes(os.environ.get("KVSTORE_GATHER_BLOCK_BYTES"))
GATHER_SPAN_BYTES = 4 << 20  # the scratch a reader keeps for such runs: 32 x 64 KiB span 2.1 MiB


def kernels() -> Any:
    from kvstore import payload_run_kernels

    return payload_run_kernels


def _compile() -> None:
    kernels().warm_up()


COMPILED = BackgroundCompile("kvstore-payload-runs-jit", memops_jit.AVAILABLE, _compile)


def ready() -> bool:
    return COMPILED.ready()
