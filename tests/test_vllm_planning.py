"""The connector's cost planner without vLLM: plans from a LoadQuery, learning from StepReports."""

from __future__ import annotations

from kvstore.integrations.vllm.plan import LoadReport, Span, StepReport
from kvstore.integrations.vllm.planning import CostPlanner
from kvstore.integrations.vllm.scheduler import Learner, LoadQuery, planner_from_spec
from kvstore.loadplan import Planner

BS, BLOCK_BYTES = 32, 1_474_560


def query(req: str, hits: int, prompt: int = 2000, computed: int = 0, tier: str = "dram") -> LoadQuery:
    return LoadQuery(prompt, BS, BLOCK_BYTES, computed, hits, (tier,) * hits, req)


def test_plans_count_from_the_engines_own_hit_and_are_kept_per_request() -> None:
    cp = CostPlanner()
    assert isinstance(cp, Learner)
    first = cp(query("a", 40, computed=10))
    assert 10 < first <= 40  # a DRAM hit over shm: loads, after the blocks vLLM holds itself
    assert cp(query("a", 40, computed=10)) == first  # asked again (allocation retried): the same plan
    assert cp.snapshot()["loadplan.choices.load"] == 1
    cp.forget("a")
    assert cp.snapshot()["loadplan.choices.load"] == 1


def test_a_slow_link_teaches_it_to_recompute() -> None:
    cp = CostPlanner(Planner())
    for i in range(12):  # every load took 30 s; 2,000 tokens compute in 1.5 s
        req = f"r{i}"
        planned = cp(query(req, 40))
        loaded = planned
        loads = [LoadReport(req, loaded, loaded, 30.0 * loaded / 40, 3, "tcp")] if loaded else []
        cp.observe(StepReport(loads, (Span(req, loaded * BS, 2000),), 1.5 * (2000 - loaded * BS) / 2000))
    assert cp.lane == "tcp"
    assert cp(query("late", 40)) == 0
    snap = cp.snapshot()
    assert snap["loadplan.choices.recompute"] >= 1 and snap["loadplan.compared"] >= 10


def test_a_failed_load_keeps_its_leading_blocks_and_teaches_no_speed() -> None:
    cp = CostPlanner()
    planned = cp(query("f", 20, prompt=1000))
    cp.observe(StepReport([LoadReport("f", planned, 5, 0.01, 1, "shm")], (Span("f", 5 * BS, 1000),), 0.5))
    snap = cp.snapshot()
    assert snap["loadplan.failed_loads"] == 1 and snap["loadplan.partial_loads"] == 1
    assert snap["loadplan.partial_blocks_used"] == 5


def test_batched_steps_teach_no_compute_cost() -> None:
    cp = CostPlanner()
    before = cp.snapshot()
    cp.observe(StepReport([], (Span("x", 0, 500), Span("y", 0, 700)), 9.0))
    assert cp.snapshot() == before


def test_planner_specs() -> None:
    assert planner_from_spec("all")(query("q", 7)) == 7
    built = planner_from_spec("kvstore.integrations.vllm.planning:CostPlanner")
    assert isinstance(built, CostPlanner) and isinstance(built, Learner)
