"""Runs of NVMe record payloads read straight into page-aligned memory, compiled (``payload_run_kernels.py``):
``ready()`` (the first call starts compiling, or loading numba's cache, on a daemon thread; False until done, and
always without numba or a CPU with SSE4.2 and PCLMULQDQ), ``kernels()`` (the module, once ready) and ``COMPILED``,
the ``BackgroundCompile`` behind both (``warm_up()`` compiles on the calling thread: a store's start, tests).

One loader for both callers (the ``--share-nvme`` client and the NVMe tier), so a process that is both compiles
once. Imports no numba itself.
"""

from __future__ import annotations

from typing import Any

from kvstore import memops_jit
from kvstore.background_compile import BackgroundCompile


def kernels() -> Any:
    from kvstore import payload_run_kernels

    return payload_run_kernels


def _compile() -> None:
    kernels().warm_up()


COMPILED = BackgroundCompile("kvstore-payload-runs-jit", memops_jit.AVAILABLE, _compile)


def ready() -> bool:
    return COMPILED.ready()
