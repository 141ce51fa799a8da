"""The adaptive policy's shadows when sampled, and its switching rule (kvstore.store.adaptive)."""

from __future__ import annotations

from kvstore.store.adaptive import AdaptiveLeafPolicy


def test_a_sampled_block_hangs_from_its_nearest_sampled_ancestor() -> None:
    policy = AdaptiveLeafPolicy()
    parents = {e: e - 1 for e in range(1, 40)}  # one chain 0 <- 1 <- ... <- 39; unbound: fingerprint = entry
    policy.parent_of = parents.get
    policy._sample = 4
    assert policy._sampled_ancestor(12) == 8  # 11, 10, 9 are not sampled
    assert policy._sampled_ancestor(9) == 8
    assert policy._sampled_ancestor(3) == 0
    assert policy._sampled_ancestor(0) is None  # a root
    policy.parent_of = {e: e + 100 for e in range(1000)}.get  # ancestors never sampled: a root after the walk
    policy._sample = 2
    policy._fingerprint = lambda e: 2 * e + 1  # type: ignore[method-assign]
    assert policy._sampled_ancestor(5) is None


def test_the_scores_carry_over_when_the_sample_coarsens() -> None:
    policy = AdaptiveLeafPolicy(max_shadow=64, ladder=(0.0, 4.0))
    for rnd in range(3):  # reuse, so the shadows score
        for e in range(60):
            if rnd:
                policy.touch(e)
            else:
                policy.insert(e)
    before = [s.score for s in policy._shadows]
    assert min(before) > 0 and policy._sample == 1
    for e in range(60, 65):
        policy.insert(e)  # the 65th resident: the shadows now see every other block
    assert policy._sample == 2
    assert [s.score for s in policy._shadows] == [b / 2 for b in before]
    assert all(len(s) <= 1 for s in policy._shadows)  # restarted (only 64, the one sampled access since)


def test_it_switches_only_on_a_lead_that_noise_does_not_explain() -> None:
    policy = AdaptiveLeafPolicy(ladder=(0.0, 4.0), margin=0.0, confidence=3.0)
    policy.P = 4.0
    lru, freq = policy._shadows
    capacity = 1 << 40  # no decay to speak of
    freq.score, lru.score = 1000.0, 1040.0
    policy._disagree = [[0.0, 400.0], [400.0, 0.0]]  # 40 ahead over 400 disagreements: 2 sigma, noise
    policy._choose(capacity)
    assert policy.P == 4.0 and policy.switches == 0
    policy._disagree = [[0.0, 100.0], [100.0, 0.0]]  # the same lead over 100 disagreements: 4 sigma
    policy._choose(capacity)
    assert policy.P == 0.0 and policy.switches == 1
