"""``kill -USR1 <pid>``: every thread's stack, with its name, to stderr; the node keeps serving.

A Python-level handler: the main thread runs it between bytecodes, holding the GIL, so the frames it walks
cannot change under it. ``faulthandler.register(SIGUSR1, all_threads=True)``, used before, walks the other
threads' frames from inside the signal while they run, and now and then crashed the node it was asked to
diagnose (seen as a test's store process dead halfway through the dump, about 1 run in 10 at start-up).
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from types import FrameType


def format_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    lines: list[str] = []
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread 0x{ident:016x} {names.get(ident, '(not a Python thread)')} (most recent call last):")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        lines.append("")
    return "\n".join(lines)


def dump_stacks() -> None:
    sys.stderr.write(format_stacks() + "\n")
    sys.stderr.flush()


def install(signum: int = signal.SIGUSR1) -> None:
    """From the main thread (the only one that may set a signal handler)."""

    def handler(_signum: int, _frame: FrameType | None) -> None:
        dump_stacks()

    signal.signal(signum, handler)
