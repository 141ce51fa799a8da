"""Eviction policies beyond plain leaf-first LRU, selectable by name.

Every policy keeps the ``LeafLRU`` interface and its rule: only a *leaf* of a
tier (no child holding a copy there) is ever a victim, so a parent always
outlives its children. What a policy changes is ``priority(e)``.

``adaptive`` (``AdaptiveLeafPolicy``, kvstore/store/adaptive.py, the default): the classes below with
how long reused blocks are protected chosen online by shadow caches, between leaf-first LRU (P = 0) and
``freq`` (P = 4) and beyond; on the shared trace and five ``bench.tracegen`` traces it stays within 0.005 of
the better of LRU and ``freq`` at every capacity from 2% to 50% (bench/results/replay_suite.json).

``freq`` (``FrequencyLeafLRU``, the default before ``adaptive``): LRU in which a block
seen at least twice is *protected* for a while. Its priority is the logical
clock of its last access plus ``protect x N`` ticks when an aging frequency
sketch has seen it at least ``reuse_threshold`` times (N: blocks resident in
the tier), so a block that was reused outlives roughly ``protect`` turnovers of
blocks seen once. Rationale: in the Mooncake synthetic trace 58% of the
distinct blocks are used once; a block seen once comes back in 42% of cases,
one seen twice in 84% (counted over the whole trace). Under LRU the one-off
requests push the shared documents out. On that trace (``python -m
bench.replay``) it lifts the prefix hit rate at 5/10/20% capacity from
0.157/0.262/0.393 (leaf-first LRU) to 0.165/0.278/0.416; Belady reaches
0.396/0.506/0.608. The counts live in a count-min sketch keyed by the block
hash (TinyLFU-style: 4 rows of 8-bit counters, conservative update, all
counters halved after ``halve_after x N`` additions) so they survive eviction
in bounded memory, and stale popularity fades. All tiers of one store share
one sketch; an access is counted once, by the highest tier holding a copy.

``make_policy(name)`` builds one policy; ``policy_factory(name)`` gives what
``BlockStore(policy_factory=...)`` takes; ``POLICY_NAMES`` lists the names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.store.adaptive import AdaptiveLeafPolicy
from kvstore.store.frequency import FrequencyLeafLRU, FrequencySketch, shared_sketch
from kvstore.store.policy import LeafLRU

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "POLICY_NAMES",
    "FrequencyLeafLRU",
    "FrequencySketch",
    "PolicySpec",
    "make_policy",
    "policy_factory",
    "shared_sketch",
]

DEFAULT_POLICY = "adaptive"


@dataclass(frozen=True)
class PolicySpec:
    """A named policy: what it does in one line and how to build one."""

    name: str
    summary: str
    build: Callable[..., LeafLRU]


POLICIES: dict[str, PolicySpec] = {
    "lru": PolicySpec("lru", "leaf-first LRU (the store's base policy)", LeafLRU),
    "freq": PolicySpec("freq", "leaf-first LRU; blocks seen twice are protected for a few turnovers", FrequencyLeafLRU),
    "adaptive": PolicySpec(
        "adaptive",
        "leaf-first; how long reused blocks are protected is chosen online by shadow caches",
        AdaptiveLeafPolicy,
    ),
}
POLICY_NAMES = tuple(POLICIES)


def make_policy(name: str = DEFAULT_POLICY, **params: Any) -> LeafLRU:
    """One policy instance by name (``params`` go to its constructor)."""
    try:
        spec = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return spec.build(**params)


def policy_factory(name: str = DEFAULT_POLICY, **params: Any) -> Callable[[], LeafLRU]:
    """What ``BlockStore(policy_factory=...)`` takes: one fresh policy per tier."""
    make_policy(name, **params)  # fail now on a bad name or parameter, not inside the store
    return lambda: make_policy(name, **params)
