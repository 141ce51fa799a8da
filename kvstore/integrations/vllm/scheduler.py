"""Scheduler side of the connector: runs in vLLM's scheduler (engine core) process, moves no KV bytes.

Verbs and promises (vLLM calls them in this order for a request):

- ``matched_tokens(request, num_computed) -> int`` (vLLM's ``get_num_new_matched_tokens``): one batched
  Lookup of the prompt's full blocks (an engine of several workers: one per rank's layout, each asking only
  for what the ranks before it hold, as every rank's part must be there); returns how many tokens beyond ``num_computed`` (vLLM's own,
  block-aligned prefix hit) will be loaded from the store. It leaves at least one prompt token to compute,
  never changes the store, and counts a failed Lookup (store down, timeout, denied) as 0 hits. vLLM may call
  it several times for a request; each call replaces the previous answer. A ``LoadPlanner`` may cap the
  number of blocks loaded, given each block's tier: ``planning.CostPlanner`` from measured costs by default
  (extra config ``load_planner="cost"``), every hit (``"all"``), or any ``module:name``.
- ``after_alloc(request, block_ids, num_external)`` (``update_state_after_alloc``): binds the blocks vLLM
  allocated to the planned load.
- ``step_plan(scheduler_output) -> StepPlan`` (``build_connector_meta``): this step's loads, and (for a
  producer) the prompt's full blocks this step completes that the store did not already report, each block
  planned for saving once. Loaded blocks are taken out of ``new_block_ids_to_zero`` (they are overwritten
  whole before the forward pass; a failed load zeroes its blocks itself).
- ``report(step_report)`` (``update_connector_output``): what the worker measured in a step, for a planner
  that learns (``Learner``).
- ``finished(request) -> bool`` (``request_finished``): True iff some step planned a save for the request,
  so vLLM keeps its blocks until the worker reports the save finished.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvstore.integrations.vllm.identity import EngineShape, lora_adapter_id, prompt_hashes, request_namespace
from kvstore.integrations.vllm.plan import BlockRun, Span, StepPlan, StepReport
from kvstore.integrations.vllm.stats import StatsFile

log = logging.getLogger(__name__)

Lookup = Callable[[str, Sequence[bytes]], tuple[int, list[str]]]


@dataclass(frozen=True)
class LoadQuery:
    """What a load planner sees for one request: the store's leading hits and the tier of each."""

    prompt_tokens: int
    block_size: int
    block_bytes: int
    computed_blocks: int  # already in vLLM's own cache: never loaded
    hit_blocks: int  # leading blocks the store holds, at most all but the prompt's last token
    tiers: tuple[str, ...]  # tier of each hit block ("hbm", "dram", "nvme"), from block 0
    request_id: str = ""


class LoadPlanner(Protocol):
    def __call__(self, query: LoadQuery) -> int:
        """How many leading blocks to take from the store (``computed_blocks..hit_blocks``); the rest is
        recomputed. Returning ``computed_blocks`` or less loads nothing."""
        ...


@runtime_checkable
class Learner(Protocol):
    """A load planner that learns from what the worker side measured (``planning.CostPlanner``)."""

    def observe(self, report: StepReport) -> None: ...

    def forget(self, req_id: str) -> None: ...

    def snapshot(self) -> dict[str, float]: ...


def load_every_hit(query: LoadQuery) -> int:
    return query.hit_blocks


def planner_from_spec(spec: str | None) -> LoadPlanner:
    """``all`` (or nothing): every hit; ``module:name``: a function, or a class built with no arguments (a
    ``Learner`` too when it has the verbs, such as a ``planning.CostPlanner`` subclass)."""
    if not spec or spec == "all":
        return load_every_hit
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"load_planner {spec!r} is not all, cost or module:name")
    found = getattr(importlib.import_module(module), name)
    planner: LoadPlanner = found() if isinstance(found, type) else found
    return planner


@dataclass
class _Tracked:
    namespace: str
    hashes: list[bytes]  # rank 0's
    prompt_len: int
    rank_hashes: list[list[bytes]] = field(default_factory=list)  # every rank's, with several workers
    store_hits: int = 0  # leading blocks the store reported at the last Lookup
    load_from: int = 0
    load_to: int = 0
    pending_load: BlockRun | None = None
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) are in the store or planned for saving
    has_saves: bool = False


@dataclass
class SchedulerCounters:
    lookups: int = 0
    lookup_failures: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    planned_load_blocks: int = 0
    planned_save_blocks: int = 0
    skipped_save_blocks: int = 0  # full blocks not saved because the store already had them


class SchedulerSide:
    def __init__(
        self,
        shape: EngineShape,
        namespace: str,
        lookup: Lookup,
        *,
        loads: bool,
        saves: bool,
        block_bytes: int,
        planner: LoadPlanner = load_every_hit,
        learner: Learner | None = None,
        stats: StatsFile | None = None,
    ):
        self.shape, self.namespace, self._lookup = shape, namespace, lookup
        self.loads, self.saves, self.block_bytes, self._planner = loads, saves, block_bytes, planner
        self._learner = learner
        self.counters = SchedulerCounters()
        self._stats = stats
        self._requests: dict[str, _Tracked] = {}

    # -- get_num_new_matched_tokens ------------------------------------------------------------------
    def _track(self, request: Any) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tokens = list(request.prompt_token_ids or [])
            namespace = request_namespace(self.namespace, getattr(request, "cache_salt", None))
            adapter = lora_adapter_id(getattr(request, "lora_request", None))
            chains: list[list[bytes]] = []
            by_layout: dict[str, list[bytes]] = {}  # ranks of one layout (MLA's TP ranks) share one chain
            for rank in range(self.shape.world):
                shape = self.shape.for_rank(rank)
                if shape.layout not in by_layout:
                    by_layout[shape.layout] = prompt_hashes(tokens, shape, namespace, adapter)
                chains.append(by_layout[shape.layout])
            tracked = _Tracked(namespace, chains[0], len(tokens), chains if len(chains) > 1 else [])
            self._requests[request.request_id] = tracked
        return tracked

    def matched_tokens(self, request: Any, num_computed: int) -> int:
        tracked = self._track(request)
        tracked.pending_load = None
        block = self.shape.block_size
        computed_blocks = num_computed // block
        hits, tiers = self._store_prefix(tracked)
        tracked.store_hits = hits
        if not self.loads:
            return 0
        usable = min(hits, max(tracked.prompt_len - 1, 0) // block)  # at least one token left to compute
        query = LoadQuery(
            tracked.prompt_len,
            block,
            self.block_bytes,
            computed_blocks,
            usable,
            tuple(tiers[:usable]),
            request.request_id,
        )
        wanted = min(usable, int(self._planner(query))) if usable > computed_blocks else 0
        if wanted <= computed_blocks:
            tracked.load_from = tracked.load_to = 0
            return 0
        tracked.load_from, tracked.load_to = computed_blocks, wanted
        return wanted * block - num_computed

    def _store_prefix(self, tracked: _Tracked) -> tuple[int, list[str]]:
        if not tracked.hashes:
            return 0, []
        self.counters.lookups += 1
        self.counters.lookup_blocks += len(tracked.hashes)
        try:
            hits, tiers = self._lookup(tracked.namespace, tracked.hashes)
            for chain in _distinct(tracked.rank_hashes)[1:]:  # a block loads only if every rank's part is there
                if hits <= 0:
                    break
                self.counters.lookups += 1
                hits = min(int(hits), int(self._lookup(tracked.namespace, chain[:hits])[0]))
        except Exception as err:  # store down or refusing: recompute, never fail the request
            self.counters.lookup_failures += 1
            log.warning("kvstore Lookup failed (counted as 0 hits): %s", err)
            self._write_stats()
            return 0, []
        hits = max(0, min(int(hits), len(tracked.hashes)))
        self.counters.hit_blocks += hits
        return hits, list(tiers)

    # -- update_state_after_alloc ----------------------------------------------------------------------
    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        if num_external <= 0 or tracked.load_to <= tracked.load_from:
            tracked.pending_load = None
            return
        first = tracked.load_from
        last = min(first - (-num_external // self.shape.block_size), tracked.load_to, len(tracked.block_ids))
        tracked.pending_load = _run(request.request_id, tracked, first, last)
        self.counters.planned_load_blocks += last - first

    # -- build_connector_meta ------------------------------------------------------------------------
    def step_plan(self, so: Any) -> StepPlan:
        plan = StepPlan(preempted=frozenset(getattr(so, "preempted_req_ids", None) or ()), spans=_spans(so))
        for tracked in self._requests.values():
            if tracked.pending_load is not None:
                plan.loads.append(tracked.pending_load)
                tracked.pending_load = None
        if self.saves:
            self._plan_saves(so, plan)
        zero = getattr(so, "new_block_ids_to_zero", None)
        if plan.loads and zero:
            loaded = plan.load_block_ids
            zero[:] = [b for b in zero if b not in loaded]
        if plan.loads or plan.saves:
            self._write_stats()
        return plan

    def _plan_saves(self, so: Any, plan: StepPlan) -> None:
        scheduled: dict[str, int] = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0), plan)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan)

    def _plan_save(self, req_id: str, tracked: _Tracked, computed_after: int, plan: StepPlan) -> None:
        full = min(min(computed_after, tracked.prompt_len) // self.shape.block_size, len(tracked.hashes))
        full = min(full, len(tracked.block_ids))
        start = max(tracked.saved_upto, min(tracked.store_hits, full))
        if tracked.saved_upto < start:
            self.counters.skipped_save_blocks += start - tracked.saved_upto
            tracked.saved_upto = start
        if full <= start:
            return
        plan.saves.append(_run(req_id, tracked, start, full))
        tracked.saved_upto = full
        tracked.has_saves = True
        self.counters.planned_save_blocks += full - start

    # -- update_connector_output ---------------------------------------------------------------------
    def report(self, step_report: Any) -> None:
        if self._learner is not None and isinstance(step_report, StepReport):
            self._learner.observe(step_report)
            if step_report.loads:
                self._write_stats()

    # -- request_finished ----------------------------------------------------------------------------
    def finished(self, request: Any) -> bool:
        if self._learner is not None:
            self._learner.forget(request.request_id)
        tracked = self._requests.pop(request.request_id, None)
        return bool(tracked is not None and tracked.has_saves)

    def _write_stats(self) -> None:
        if self._stats is not None:
            self._stats.write(self.counters, **(self._learner.snapshot() if self._learner is not None else {}))


def _distinct(chains: list[list[bytes]]) -> list[list[bytes]]:
    """Each rank layout's chain once, in rank order (ranks of one layout share one list: MLA's TP ranks)."""
    return list({id(chain): chain for chain in chains}.values())


def _run(req_id: str, tracked: _Tracked, start: int, end: int) -> BlockRun:
    """Blocks [start, end) of a tracked request, with every rank's hashes when there are several."""

    def parent(chain: list[bytes]) -> bytes:
        return chain[start - 1] if start else b""

    return BlockRun(
        req_id,
        tracked.namespace,
        tuple(tracked.hashes[start:end]),
        tuple(tracked.block_ids[start:end]),
        parent(tracked.hashes),
        tuple(tuple(chain[start:end]) for chain in tracked.rank_hashes),
        tuple(parent(chain) for chain in tracked.rank_hashes),
    )


def _spans(so: Any) -> tuple[Span, ...]:
    """The tokens each scheduled request computes in this step (vLLM's SchedulerOutput)."""
    scheduled: dict[str, int] = getattr(so, "num_scheduled_tokens", None) or {}
    spans = [
        Span(new.req_id, new.num_computed_tokens, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        for new in getattr(so, "scheduled_new_reqs", None) or ()
    ]
    cached = getattr(so, "scheduled_cached_reqs", None)
    if cached is not None:
        for i, req_id in enumerate(cached.req_ids):
            start = cached.num_computed_tokens[i]
            spans.append(Span(req_id, start, start + scheduled.get(req_id, 0)))
    return tuple(s for s in spans if s.end > s.start)
