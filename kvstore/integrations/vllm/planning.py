"""Load or recompute inside vLLM: the connector's cost-aware load planner (extra config ``load_planner="cost"``).

The scheduler side asks ``CostPlanner`` how many of a request's store hits to load; it answers with the
shared planner of issue 17 (``kvstore.loadplan.Planner``, the one the built-in workers use), restricted to
plans vLLM can run: a leading prefix loaded, the rest computed (``overlap=False``; vLLM loads before the
forward pass). The planner learns from what the worker side measured, which vLLM carries back in each
step's ``StepReport``: every load run's blocks, seconds and Get calls (the load cost of its lane, per tier)
and the forward pass's seconds over the tokens the step computed (the compute cost as a function of
position; only steps that computed one request's tokens teach it, a batched step's time is not split).

Verbs and promises:

- ``CostPlanner(lane=...)(query) -> int``: blocks to load (``query.computed_blocks`` or less: none). The
  plan is kept by request id until its first step is reported (vLLM may ask again for a request whose
  allocation failed; a repeated query for the same blocks gets the same plan, not a second one).
- ``observe(report)``: loads and forward passes of a step, given to the planner: a failed or partial load
  counts as such (the leading intact blocks used), predicted against measured TTFT (load plus forward
  pass) for a request computed alone in its first step.
- ``forget(req_id)``: a finished request's plan, if it was never reported.
- ``snapshot()``: the planner's ``loadplan.*`` counters and estimates.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.integrations.vllm.plan import LoadReport, StepReport
from kvstore.integrations.vllm.scheduler import LoadQuery
from kvstore.loadplan import Outcome, Plan, Planner


@dataclass(frozen=True)
class _Pending:
    key: tuple[int, int, int]  # (computed_blocks, hit_blocks, prompt_tokens): a repeated query reuses the plan
    plan: Plan


class CostPlanner:
    def __init__(self, planner: Planner | None = None, *, lane: str = "shm"):
        self.planner = planner or Planner()
        self.lane = lane  # the lane the worker's loads use; replaced by what its reports say
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def __call__(self, query: LoadQuery) -> int:
        key = (query.computed_blocks, query.hit_blocks, query.prompt_tokens)
        with self._lock:
            known = self._pending.get(query.request_id)
        if known is not None and known.key == key:
            plan = known.plan
        else:
            plan = self.planner.plan(
                query.tiers[query.computed_blocks : query.hit_blocks],
                query.prompt_tokens,
                block_size=query.block_size,
                block_bytes=query.block_bytes,
                lane=self.lane,
                overlap=False,
                computed_tokens=query.computed_blocks * query.block_size,
            )
            with self._lock:
                self._pending[query.request_id] = _Pending(key, plan)
        return query.computed_blocks + plan.load_until

    def observe(self, report: StepReport) -> None:
        loads: dict[str, LoadReport] = {}
        for part in report.loads:  # tensor-parallel ranks each report their part: the slowest, the least intact
            seen = loads.get(part.req_id)
            loads[part.req_id] = part if seen is None else _worse(seen, part)
        alone = report.spans[0] if len(report.spans) == 1 and report.forward_s > 0 else None
        if alone is not None:
            self.planner.observe_compute(alone.start, alone.end, report.forward_s)
        started = {s.req_id for s in report.spans} | set(loads)
        with self._lock:
            plans = {r: self._pending.pop(r).plan for r in started if r in self._pending}
        for req_id, plan in plans.items():
            load = loads.get(req_id)
            if load is not None and load.lane:
                self.lane = load.lane
            ttft = 0.0
            if alone is not None and alone.req_id == req_id:
                ttft = report.forward_s + (load.seconds if load is not None else 0.0)
            self.planner.observe(plan, _outcome(plan, load, ttft))

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._pending.pop(req_id, None)

    def snapshot(self) -> dict[str, float]:
        return self.planner.snapshot()


def _worse(a: LoadReport, b: LoadReport) -> LoadReport:
    return LoadReport(a.req_id, a.planned, min(a.loaded, b.loaded), max(a.seconds, b.seconds), a.calls, a.lane)


def _outcome(plan: Plan, load: LoadReport | None, ttft_s: float) -> Outcome:
    if load is None:  # nothing loaded (the plan loads nothing, or vLLM's own cache covered it meanwhile)
        return Outcome(loaded=0, ttft_s=ttft_s if plan.load_blocks == 0 else 0.0)
    failed = "" if load.loaded >= load.planned else f"{load.planned - load.loaded} of {load.planned} blocks failed"
    return Outcome(
        loaded=load.loaded,
        load_s=load.seconds,
        load_calls=load.calls,
        load_failed=failed,
        ttft_s=ttft_s,
        lane=load.lane,
    )
