"""A prompt's prefill as the load planner says: compute, load, or both at once (issue 17).

``prefill_planned(link, model, pool, seq, tokens, namespace, hashes, max_blocks=..., tail=...)``:

1. Lookup (with tiers) of the prompt's leading cached blocks, at most ``max_blocks``.
2. ``link.planner.plan(...)`` picks ``(m, k)``: compute blocks ``[0, m)`` here
   while the store sends blocks ``[m, k)`` (``kvstore.loadplan.planner``).
3. The load (``loadplan.partial.get_leading``, on the link's loader thread when
   ``m > 0``) writes into pool blocks reserved for it, outside the sequence:
   the computation never sees them. Meanwhile the head ``[0, m)`` is computed.
4. Only after the load returns are its **leading intact** blocks (bytes in,
   CRC32C checked) appended to the sequence; the rest go back to the pool.
   A block after a failed one is never used: the tail is computed from the
   first block that did not arrive.
5. ``tail(start_token, store_holds)`` computes the rest (the decode worker: one
   prefill with logits; the prefill worker: chunks, and Puts of the blocks
   past the ``store_holds`` leading blocks the store already has) and its
   result is returned.
6. ``link.planner.observe(plan, Outcome)`` learns from the measured times.

Any store failure before the load (unreachable, Lookup refused) recomputes
everything (``link.counters.recompute_fallbacks``); wrong KV is never used.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvstore.client import KVStoreError
from kvstore.loadplan import Leading, Outcome, Plan, get_leading
from kvstore.model.block_manager import SeqId
from kvstore.model.llama import LlamaModel
from kvstore.model.paged import PagedKVPool
from kvstore.model.store_link import StoreLink

log = logging.getLogger(__name__)


@dataclass
class PlannedPrefill:
    result: Any = None  # what ``tail`` returned
    plan: Plan | None = None  # None: no store, no cached block asked for, or the Lookup failed
    cached: int = 0  # leading blocks the store holds that the plan could use
    head_blocks: int = 0  # blocks computed here while the load ran
    loaded: int = 0  # blocks loaded from the store and used
    tail_start: int = 0  # first token computed after the load
    bytes: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    head_s: float = 0.0
    tail_s: float = 0.0
    total_s: float = 0.0
    failed: str = ""  # why the store's blocks were (partly) not used


def prefill_planned(
    link: StoreLink,
    model: LlamaModel,
    pool: PagedKVPool,
    seq: SeqId,
    tokens: Sequence[int],
    namespace: str,
    hashes: Sequence[bytes],
    *,
    max_blocks: int,
    tail: Callable[[int, int], Any],
    policy: str | None = None,
    overlap: bool | None = None,
    chunk_tokens: int | None = None,
    started: float | None = None,
) -> PlannedPrefill:
    """See the module docstring. ``seq`` must be a fresh, empty sequence of ``pool``."""
    t0 = time.perf_counter() if started is None else started
    bs = pool.block_size
    client = link.client
    if client is None or not hashes or max_blocks <= 0:
        return _tail_only(tail, t0, len(tokens), chunk_tokens, link, None)
    link.seed_planner()
    if started is None:  # Stats (once per 64 requests) is not this request's time
        t0 = time.perf_counter()
    try:
        n, tiers = client.lookup_tiers(namespace, hashes[:max_blocks])
    except KVStoreError as err:
        link.record_fallback(f"lookup: {err}")
        link.planner.count_lookup_failure()
        return _tail_only(tail, t0, len(tokens), chunk_tokens, link, None, failed=f"lookup: {err}")
    lookup_s = time.perf_counter() - t0
    plan = link.planner.plan(
        tiers[: min(n, max_blocks)],
        len(tokens),
        block_size=bs,
        block_bytes=pool.block_nbytes,
        lane=link.lane_kind(),
        policy=policy or link.policy,
        overlap=overlap,
        elapsed_s=lookup_s,
    )
    m, k = plan.compute_first, plan.load_until
    out = PlannedPrefill(plan=plan, cached=plan.cached, lookup_s=lookup_s)
    leading = Leading(0, 0, 0, 0.0)
    if k > m:
        ids = pool.reserve_blocks(k - m)
        views = [pool.block_bytes_view(b).numpy() for b in ids]

        def load() -> Leading:
            return get_leading(client, namespace, hashes[m:k], views, piece_blocks=plan.piece_blocks)

        try:
            pending: Future[Leading] | None = link.loader.submit(load) if m > 0 else None
            if m > 0:
                h0 = time.perf_counter()
                try:
                    model.prefill(pool, seq, tokens[: m * bs], logits="none")
                finally:
                    out.head_s = time.perf_counter() - h0
                    assert pending is not None
                    leading = pending.result()  # the load is over before anything else happens
            else:
                leading = load()
        except BaseException:
            pool.release_blocks(ids)
            raise
        used = leading.blocks
        pool.attach_full(seq, ids[:used])  # intact leading blocks only; nothing after a failed one
        pool.release_blocks(ids[used:])
        out.head_blocks, out.loaded, out.load_s, out.failed = m, used, leading.seconds, leading.failure
        out.bytes = used * pool.block_nbytes
        link.count_fetched(used, out.bytes)
        if leading.failure:
            log.warning(
                "load of blocks %d-%d stopped after %d: %s; computing from there", m, k - 1, used, leading.failure
            )
            link.record_fallback(f"partial load ({used} of {k - m} blocks): {leading.failure}")
    elif m > 0:
        raise AssertionError("a plan computes ahead only while it loads")
    if m + out.loaded:
        pool.add_hashes(seq, hashes[: m + out.loaded])
    out.tail_start = (m + out.loaded) * bs
    t1 = time.perf_counter()
    out.result = tail(out.tail_start, plan.cached)
    now = time.perf_counter()
    out.tail_s, out.total_s = now - t1, now - t0
    link.planner.observe(
        plan,
        Outcome(
            loaded=out.loaded,
            load_s=out.load_s,
            load_calls=leading.calls,
            load_failed=out.failed,
            head_s=out.head_s,
            tail_start=out.tail_start,
            tail_s=out.tail_s,
            tail_calls=_calls(len(tokens) - out.tail_start, chunk_tokens),
            ttft_s=out.total_s,
            lane=link.lane_kind(),
        ),
    )
    return out


def _calls(tokens: int, chunk_tokens: int | None) -> int:
    return max(math.ceil(tokens / chunk_tokens), 1) if chunk_tokens else 1


def _tail_only(
    tail: Callable[[int, int], Any],
    t0: float,
    n: int,
    chunk_tokens: int | None,
    link: StoreLink,
    plan: Plan | None,
    failed: str = "",
) -> PlannedPrefill:
    t1 = time.perf_counter()
    result = tail(0, 0)
    now = time.perf_counter()
    link.planner.observe_compute(0, n, now - t1, _calls(n, chunk_tokens))  # it learns from every request
    return PlannedPrefill(result=result, plan=plan, tail_s=now - t1, total_s=now - t0, failed=failed)
