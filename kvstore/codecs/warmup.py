"""Warm codecs and calibrate the controller before a transfer codes its first batch.

A controller's first observation of an arm weighs as much as a hundred
later ones until it is chosen again, and an arm that looks three times worse
than the best is never explored again (``ControllerConfig.explore_within``).
A first batch coded cold (lazy imports, tables, the codecs' per-thread
scratch buffers page-faulted in) or on a core shared with the connection
set-up can look five times slower than the same codec in steady state, and
keep a codec that would win out of reach for good. Verbs and promises:

- ``warm_up(arms, dtype, nbytes)``: encode and decode one block of
  ``nbytes`` under each arm on the calling thread, once per thread and size
  (the scratch buffers only grow). Costs nothing the second time.
- ``calibrated(controller, arms, dtype) -> bool``: whether it has.
- ``calibrate(controller, arms, dtype, blocks, context)``: once per
  controller and (arm, dtype), encode ``blocks`` (a transfer's first batch)
  under the arm and decode them here, timing both in thread CPU time, and
  report it as an observation: the arm's ratio on this very data and its
  coding cost on this host, warm, before any transfer depends on it. The
  local decode time stands in for the receiver's until its reports arrive.
  An arm this thread has not coded at that size yet is coded once more
  first, untimed (that round is its warm-up, so ``warm_up`` has nothing
  left to do for it). A process's workers are long-lived, so a fresh
  client's controller usually costs one coding of one batch per arm
  (about 4 ms for SmolLM2's 360 KiB blocks and the five codecs).
  It also marks the arms observed, so the controller does not try each
  one on the wire first.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from .base import DEFAULT_OPTIONS
from .buffers import BufferLike, as_u8
from .controller import Context, Controller
from .registry import decode_into, get_codec

cost_clock = time.thread_time  # what coding costs: this thread's CPU seconds (see transfer.prepare)
_warm = threading.local()  # per thread: (arm, dtype) -> largest block size coded in warm-up
_calibrated: weakref.WeakKeyDictionary[Controller, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
_calibrated_lock = threading.Lock()


def synthetic_block(dtype: str, nbytes: int) -> np.ndarray:
    """``nbytes`` (rounded down to whole elements) of KV-like values of ``dtype``, as uint8."""
    itemsize = 4 if dtype == "float32" else 2
    values = np.random.default_rng(0).standard_normal(max(nbytes // itemsize, 1)).astype(np.float32) * 0.1
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return values.astype(dtype).view(np.uint8)


def _done() -> dict[tuple[str, str], int]:
    done: dict[tuple[str, str], int] | None = getattr(_warm, "done", None)
    if done is None:
        done = _warm.done = {}
    return done


def warm_up(arms: Iterable[str], dtype: str, nbytes: int) -> None:
    """Code one ``nbytes`` block of ``dtype`` under each arm on this thread, unless it already has."""
    done = _done()
    todo = [a for a in arms if done.get((a, dtype), 0) < nbytes]
    if not todo or nbytes <= 0:
        return
    block = synthetic_block(dtype, nbytes)
    out = np.empty(block.nbytes, dtype=np.uint8)
    for arm in todo:
        decode_into(arm, get_codec(arm).encode(block, dtype), dtype, block.nbytes, out)
        done[(arm, dtype)] = nbytes


def calibrated(controller: Controller, arms: Iterable[str], dtype: str) -> bool:
    """Whether ``calibrate`` has run for every one of ``arms`` and ``dtype`` on ``controller``."""
    with _calibrated_lock:
        seen = _calibrated.get(controller, ())
        return all((a, dtype) in seen for a in arms)


def calibrate(
    controller: Controller, arms: Iterable[str], dtype: str, blocks: Sequence[BufferLike], context: Context
) -> None:
    """Observe each not yet calibrated arm coding ``blocks`` here (see the module docstring)."""
    with _calibrated_lock:
        seen = _calibrated.setdefault(controller, set())
        todo = [a for a in arms if (a, dtype) not in seen]
        seen.update((a, dtype) for a in todo)
    views = [as_u8(b) for b in blocks]
    raw = sum(v.nbytes for v in views)
    if not todo or raw == 0:
        return
    outs = [np.ones(v.nbytes, dtype=np.uint8) for v in views]  # touched: a page fault is not a decode cost
    largest = max(v.nbytes for v in views)
    done = _done()
    for arm in todo:
        codec = get_codec(arm)
        for timed in (done.get((arm, dtype), 0) >= largest, True):
            began = cost_clock()
            if codec.lossy:  # a lossy sender decodes for the CRC, as transfer.prepare does
                payloads = [codec.encode_decoded(v, dtype, DEFAULT_OPTIONS, out) for v, out in zip(views, outs)]
            else:
                payloads = [codec.encode(v, dtype) for v in views]
            encoded = cost_clock()
            for payload, out in zip(payloads, outs):
                decode_into(arm, payload, dtype, out.nbytes, out)
            if not timed:  # the warm-up round: this thread's first coding at this size
                done[(arm, dtype)] = max(done.get((arm, dtype), 0), largest)
                continue
            decode_s = cost_clock() - encoded
            encode_s = encoded - began
            controller.observe(arm, context, raw, sum(len(p) for p in payloads), encode_s, decode_s)
            break
