"""kvstore.loadplan as pure logic: the decaying fit, the cost models, the planner's choices, partial Gets (fakes)."""

from __future__ import annotations

import math
import random

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.client import KVStoreError
from kvstore.loadplan import ComputeCosts, LoadCosts, Outcome, Planner, PlannerConfig, get_leading
from kvstore.loadplan.costs import position_sum
from kvstore.loadplan.fit import DecayedFit

BS, BLOCK = 16, 737_280  # SmolLM2-135M fp32: 46,080 bytes of KV per token


# -- the fit ------------------------------------------------------------------------------------------
def test_fit_recovers_coefficients_and_keeps_them_non_negative():
    fit = DecayedFit([1.0, 1.0], [1.0, 1.0], decay=1.0, prior_weight=1e-6)
    rng = random.Random(0)
    for _ in range(50):
        x = rng.uniform(0, 10)
        fit.observe([1.0, x], 0.5 + 2.0 * x)
    assert fit.coefficients() == pytest.approx((0.5, 2.0), rel=1e-4)
    falling = DecayedFit([1.0, 1.0], [1.0, 1.0], decay=1.0, prior_weight=1e-6)
    for x in range(1, 20):
        falling.observe([1.0, float(x)], 10.0 - 0.1 * x)  # a cost that falls as work grows: clamp at 0
    c, slope = falling.coefficients()
    assert slope == 0.0 and c == pytest.approx(9.0, rel=0.05)


def test_fit_follows_a_change_and_starts_at_its_prior():
    fit = DecayedFit([3.0], [1.0], decay=0.8, prior_weight=0.05)
    assert fit.coefficients() == pytest.approx((3.0,))
    for _ in range(20):
        fit.observe([1.0], 1.0)
    assert fit.coefficients()[0] == pytest.approx(1.0, rel=0.03)  # the prior keeps about 1% of the weight
    for _ in range(20):
        fit.observe([1.0], 10.0)
    assert fit.coefficients()[0] == pytest.approx(10.0, rel=0.03)


@given(st.integers(0, 5000), st.integers(0, 5000))
def test_position_sum_is_the_sum_of_positions(a, b):
    s, e = min(a, b), max(a, b)
    assert position_sum(s, e) == sum(range(s, e))
    assert int(position_sum(np.array([s]), np.array([e]))[0]) == sum(range(s, e))


def test_compute_costs_fit_attention_growing_with_position():
    costs = ComputeCosts()
    truth = lambda s, e: 0.01 + 1.2e-3 * (e - s) + 4e-7 * sum(range(s, e))  # noqa: E731
    for n in (200, 700, 1500, 2500, 4000, 300, 3200):
        costs.observe(0, n, truth(0, n))
        costs.observe(n - 40, n, truth(n - 40, n))
    for s, e in ((0, 3000), (2000, 4000), (3968, 4000)):
        assert float(costs.predict(s, e)) == pytest.approx(truth(s, e), rel=0.05)
    # the same number of tokens costs more late in a prompt than early
    assert float(costs.predict(3000, 4000)) > 1.5 * float(costs.predict(0, 1000))


# -- planning -----------------------------------------------------------------------------------------
def planner_for(link_gbps: float, *, compute_s_per_1k: float = 1.2, nvme_gbps: float | None = None, **cfg) -> Planner:
    """A planner whose estimates are set by observations of a known world (what a warm worker has learned)."""
    p = Planner(PlannerConfig(**cfg), compute=ComputeCosts(decay=1.0), loads=LoadCosts(decay=1.0))
    for n in (300, 1000, 2000, 4000):
        for s in (0, n // 2, n - 32):
            p.compute.observe(s, n, compute_s_per_1k * (n - s) / 1e3 + 3e-7 * sum(range(s, n)) + 0.01)
    for blocks in (4, 32, 128):
        nbytes = blocks * BLOCK
        p.loads.observe("tcp", [0, nbytes, 0], 1, 0.002 + nbytes / (link_gbps * 1.25e8))
        if nvme_gbps:
            p.loads.observe(
                "tcp", [0, 0, nbytes], 1, 0.002 + nbytes / (link_gbps * 1.25e8) + nbytes / (nvme_gbps * 1e9)
            )
    return p


def test_fast_link_loads_everything_slow_link_without_overlap_recomputes():
    fast = planner_for(10.0).plan(["dram"] * 249, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp")
    assert fast.choice == "load" and (fast.compute_first, fast.load_until) == (0, 249)
    slow = planner_for(0.05).plan(["dram"] * 249, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp", overlap=False)
    assert slow.choice == "recompute" and slow.load_until == 0
    assert slow.predicted_s == pytest.approx(slow.predicted_fixed["recompute"])


def test_comparable_link_and_cpu_overlap_and_beat_both_fixed_modes():
    plan = planner_for(0.1).plan(["dram"] * 249, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp")
    assert plan.choice == "overlap" and 0 < plan.compute_first < plan.load_until == 249
    assert plan.predicted_s < 0.9 * min(plan.predicted_fixed.values())
    # head and load are balanced: neither waits long for the other
    assert abs(plan.predicted_head_s - plan.predicted_load_s) < 0.1 * plan.predicted_s


def test_slow_nvme_tail_behind_a_dram_head_loads_only_the_head():
    p = planner_for(10.0, nvme_gbps=0.01)
    plan = p.plan(["dram"] * 100 + ["nvme"] * 149, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp", overlap=False)
    assert plan.choice == "partial" and plan.load_until == 100 and plan.compute_first == 0
    assert plan.tokens_to_load == 1600


def test_the_last_prompt_token_is_always_computed():
    plan = planner_for(10.0).plan(["dram"] * 10, 160, block_size=BS, block_bytes=BLOCK, lane="tcp")
    assert plan.cached == 9 and plan.load_until == 9  # 160 tokens: block 9 would leave nothing to compute


@settings(max_examples=60, deadline=None)
@given(
    gbps=st.floats(0.01, 20.0),
    n=st.integers(17, 4000),
    nvme_frac=st.floats(0.0, 1.0),
    overlap=st.booleans(),
)
def test_decide_is_never_predicted_worse_than_a_fixed_mode_and_finds_the_optimum(gbps, n, nvme_frac, overlap):
    p = planner_for(gbps, nvme_gbps=0.5)
    cached = (n - 1) // BS
    tiers = ["dram"] * int(cached * (1 - nvme_frac)) + ["nvme"] * (cached - int(cached * (1 - nvme_frac)))
    plan = p.plan(tiers, n, block_size=BS, block_bytes=BLOCK, lane="tcp", overlap=overlap)
    assert 0 <= plan.compute_first <= plan.load_until <= cached
    assert plan.predicted_s <= min(plan.predicted_fixed.values()) + 1e-9
    # brute force over every (m, k) with the planner's own cost models
    per = p.loads.per_byte("tcp")
    block_s = [per[t] * BLOCK for t in tiers]
    call = p.loads.call_s("tcp")
    best = float(p.compute.predict(0, n))
    for k in range(1, cached + 1):
        tail = float(p.compute.predict(k * BS, n))
        for m in range(0, k if overlap else 1):
            head = float(p.compute.predict(0, m * BS)) if m else 0.0
            best = min(best, max(head, sum(block_s[m:k]) + call) + tail)
    cfg = p.config
    assert plan.predicted_s >= best - 1e-9
    if plan.predicted_s > best + 1e-9:  # only the margin may keep a fixed mode over a better mixed plan
        assert best > min(plan.predicted_fixed.values()) * (1 - cfg.margin) - cfg.margin_s - 1e-9


def test_a_lane_without_loads_gets_probed():
    p = planner_for(0.01, probe_every=3, probe_blocks=2)
    choices = [p.plan(["dram"] * 60, 1000, block_size=BS, block_bytes=BLOCK, lane="tcp").choice for _ in range(4)]
    assert choices == ["recompute", "recompute", "recompute", "probe"]
    probe = p.plan(["dram"] * 60, 1000, block_size=BS, block_bytes=BLOCK, lane="tcp")
    assert probe.choice == "probe" and (probe.compute_first, probe.load_until) == (58, 60)
    p.observe(probe, Outcome(loaded=2, load_s=0.2, load_calls=1, head_s=1.0, tail_start=960, tail_s=0.1))
    assert p.plan(["dram"] * 60, 1000, block_size=BS, block_bytes=BLOCK, lane="tcp").choice == "recompute"


def test_observe_counts_partial_loads_and_learns_only_from_intact_ones():
    p = planner_for(1.0)
    before = p.loads.samples("tcp")
    plan = p.plan(["dram"] * 100, 2000, block_size=BS, block_bytes=BLOCK, lane="tcp", policy="load")
    p.observe(plan, Outcome(loaded=40, load_s=9.0, load_calls=3, load_failed="block 40: DATA_LOSS", ttft_s=9.5))
    snap = p.snapshot()
    assert snap["loadplan.partial_loads"] == 1 and snap["loadplan.partial_blocks_used"] == 40
    assert snap["loadplan.blocks_discarded"] == 60 and snap["loadplan.failed_loads"] == 1
    assert p.loads.samples("tcp") == before  # a failed load says nothing about the link's speed
    p.observe(plan, Outcome(loaded=100, load_s=0.6, load_calls=2, tail_start=1600, tail_s=0.4, ttft_s=1.0))
    assert p.loads.samples("tcp") > before
    assert p.history()[-1] == ("load", plan.predicted_s, 1.0)
    assert p.snapshot()["loadplan.choices.load"] == 1 and p.snapshot()["loadplan.policy.load"] == 1


def test_learning_online_in_a_simulated_world_ends_near_the_best_fixed_mode():
    """A world with known true costs that change halfway (a link falls from 10 to 0.1 Gbit/s); the planner
    starts from its priors and learns only from what its own plans show it."""
    rng = random.Random(1)

    def true_compute(s: int, e: int) -> float:
        return 0.01 + 1.5e-3 * (e - s) + 2e-7 * sum(range(s, e)) if e > s else 0.0

    def world(plan, gbps: float) -> Outcome:
        m, k, n = plan.compute_first, plan.load_until, plan.prompt_tokens
        load = 0.002 + (k - m) * BLOCK / (gbps * 1.25e8) if k > m else 0.0
        head = true_compute(0, m * BS)
        tail = true_compute(k * BS, n)
        noise = rng.uniform(0.97, 1.03)
        return Outcome(loaded=k - m, load_s=load * noise, load_calls=1, head_s=head * noise,
                       tail_start=k * BS, tail_s=tail * noise, ttft_s=(max(head, load) + tail) * noise)  # fmt: skip

    p = Planner()
    for gbps in (10.0, 0.1):
        regrets = []
        for i in range(40):
            n = rng.choice([500, 1000, 2000, 4000])
            plan = p.plan(["dram"] * ((n - 33) // BS), n, block_size=BS, block_bytes=BLOCK, lane="tcp")
            out = world(plan, gbps)
            p.observe(plan, out)
            fixed = min(world(p.plan(plan.tiers, n, block_size=BS, block_bytes=BLOCK, lane="tcp", policy=pol), gbps).ttft_s
                        for pol in ("load", "recompute"))  # fmt: skip
            if i >= 20:
                regrets.append(out.ttft_s / fixed)
        assert float(np.median(regrets)) <= 1.05, (gbps, regrets)
    assert p.snapshot()["loadplan.choices.overlap"] > 0  # at 0.1 Gbit/s computing the head while loading wins


# -- partial Gets against a fake client ---------------------------------------------------------------
class FakeClient:
    """Blocks are bytes; ``bad`` raises DATA_LOSS for any Get that includes it, ``gone_after`` calls succeed
    before every later call raises UNAVAILABLE; ``missing`` comes back as None."""

    def __init__(self, blocks: dict[bytes, bytes], bad=(), missing=(), gone_after: int | None = None):
        self.blocks, self.bad, self.missing, self.gone_after = blocks, set(bad), set(missing), gone_after
        self.calls = 0

    def get(self, namespace, hashes, *, out, allow_missing=False):
        self.calls += 1
        if self.gone_after is not None and self.calls > self.gone_after:
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, "connection reset")
        result = []
        for h, buf in zip(hashes, out):
            if h in self.missing:
                result.append(None)
                continue
            data = self.blocks[h]
            buf[:] = np.frombuffer(data if h not in self.bad else bytes(len(data)), dtype=np.uint8)
            if h in self.bad:
                raise KVStoreError(grpc.StatusCode.DATA_LOSS, "failed its CRC32C check")
            result.append(buf)
        return result


def blocks_and_bufs(n: int):
    keys = [bytes([i]) * 16 for i in range(n)]
    blocks = {k: random.Random(k).randbytes(64) for k in keys}
    return keys, blocks, [np.zeros(64, np.uint8) for _ in keys]


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 40), piece=st.integers(1, 12), bad=st.integers(0, 45), kind=st.sampled_from(["crc", "missing"]))
def test_leading_blocks_are_exactly_those_before_the_first_bad_one(n, piece, bad, kind):
    keys, blocks, bufs = blocks_and_bufs(n)
    faults = {keys[bad]} if bad < n else set()
    client = FakeClient(blocks, bad=faults if kind == "crc" else (), missing=faults if kind == "missing" else ())
    got = get_leading(client, "ns", keys, bufs, piece_blocks=piece)
    assert got.blocks == min(bad, n) and bool(got.failure) == (bad < n)
    assert all(bytes(bufs[i]) == blocks[keys[i]] for i in range(got.blocks))


def test_node_gone_mid_get_keeps_the_pieces_that_completed():
    keys, blocks, bufs = blocks_and_bufs(20)
    got = get_leading(FakeClient(blocks, gone_after=2), "ns", keys, bufs, piece_blocks=6)
    assert got.blocks == 12 and "UNAVAILABLE" in got.failure and got.calls == 3
    assert all(bytes(bufs[i]) == blocks[keys[i]] for i in range(12))


def test_pieces_follow_the_predicted_load_time():
    p = planner_for(1.0, piece_seconds=0.05, min_piece_blocks=4, max_pieces=16)
    plan = p.plan(["dram"] * 249, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp", policy="load")
    assert plan.piece_blocks == math.ceil(249 / 16)  # a 1.5 s load: the most pieces
    fast = planner_for(40.0).plan(["dram"] * 20, 400, block_size=BS, block_bytes=BLOCK, lane="tcp", policy="load")
    assert fast.piece_blocks == 20  # a short load is one Get


def test_tokens_the_engine_already_holds_are_not_planned():
    p = planner_for(0.1)
    whole = p.plan(["dram"] * 249, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp", overlap=False)
    rest = p.plan(
        ["dram"] * 149, 4000, block_size=BS, block_bytes=BLOCK, lane="tcp", overlap=False, computed_tokens=1600
    )
    assert rest.computed_tokens == 1600 and rest.cached == 149
    # the 1,600 tokens the engine holds are not recomputed: recomputing the rest costs less than all of it
    assert rest.predicted_fixed["recompute"] < whole.predicted_fixed["recompute"]
    assert rest.predicted_fixed["recompute"] == pytest.approx(float(p.compute.predict(1600, 4000)))
    with pytest.raises(ValueError):
        p.plan(["dram"], 100, block_size=BS, block_bytes=BLOCK, lane="tcp", computed_tokens=5)
