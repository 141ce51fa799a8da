"""Compiled kernels that are never waited for: ``BackgroundCompile(name, available, compile)``.

- ``ready() -> bool``: ``compile`` has run. The first call starts it (numba compiling, or loading from its
  on-disk cache) on a daemon thread and says False until it is done, so callers take their uncompiled path
  meanwhile and no request waits for a compiler. Always False when not ``available``.
- ``warm_up()``: run ``compile`` now, on the calling thread (a store's start, a client's ``warm_up``, tests);
  nothing once it has run.

``warm_up_logged(warm_up, what)``: run a warm-up at a client's start, where a failure (a broken numba) is logged,
not raised: an engine must start anyway, and the uncompiled paths serve as they do before the kernels are ready.

Used by ``kvstore.memops_jit`` (copies and CRC32Cs) and ``kvstore.arena_index`` (the DRAM index probe).
Imports no numba itself: an engine process that never wants the kernels never loads it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundCompile:
    def __init__(self, name: str, available: bool, compile: Callable[[], None]):
        self.name, self.available, self._compile = name, available, compile
        self._ready = False
        self._started = False
        self._lock = threading.Lock()

    def ready(self) -> bool:
        if self._ready or not self.available:
            return self._ready
        with self._lock:
            if not self._started:
                self._started = True
                threading.Thread(target=self.warm_up, name=self.name, daemon=True).start()
        return self._ready

    def warm_up(self) -> None:
        if self._ready or not self.available:
            return
        self._compile()
        self._ready = True


def warm_up_logged(warm_up: Callable[[], None], what: str) -> None:
    """See the module docstring."""
    try:
        warm_up()
    except Exception as err:  # noqa: BLE001 - a broken numba must not stop an engine's start
        log.warning("%s: not warmed up (%s); the first Gets set up the rest, on slower paths meanwhile", what, err)
