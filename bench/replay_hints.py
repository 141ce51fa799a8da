"""Engine hints derived from a trace's future: the most each hint type can be worth to the policy.

An engine knows some of a block's future (whether the conversation goes on,
how popular a system prompt is, how long a session lives); the replay gives
the policy the *exact* value each hint would carry, read from the rest of the
trace, as the lifetime oracle does. What the policy gains with it bounds what
an engine's estimate of that hint can earn.

``future_hints(trace, kind) -> [[ReuseHint per block] per request]``, kinds:
- ``reuse``: True when the block is used again later in the trace, else
  False (the conversation ended / the document was one-shot);
- ``priority``: the block's remaining uses, bucketed: 0 (none), 1 (1-2),
  2 (3-8), 3 (more);
- ``ttl``: seconds until the block's last use in the trace (0 when this is
  its last use): kept ahead of unhinted blocks until then;
- ``all``: the three together.
"""

from __future__ import annotations

from typing import Any

from kvstore.store.hints import ReuseHint

HINT_KINDS = ("reuse", "priority", "ttl", "all")


def _bucket(remaining: int) -> int:
    return 0 if remaining == 0 else 1 if remaining <= 2 else 2 if remaining <= 8 else 3


def future_hints(trace: Any, kind: str) -> list[list[ReuseHint]]:
    if kind not in HINT_KINDS:
        raise ValueError(f"unknown hint kind {kind!r}; choose one of {', '.join(HINT_KINDS)}")
    times = trace.times or tuple(float(i) for i in range(len(trace.requests)))
    remaining: dict[int, int] = {}  # uses after the current one, filled walking backwards
    last_time: dict[int, float] = {}
    out: list[list[ReuseHint]] = [[] for _ in trace.requests]
    for r in range(len(trace.requests) - 1, -1, -1):
        row = []
        for b in trace.requests[r]:
            left = remaining.get(b, 0)
            reuse = left > 0 if kind in ("reuse", "all") else None
            priority = _bucket(left) if kind in ("priority", "all") else 0
            ttl = max(last_time.get(b, times[r]) - times[r], 0.0) if kind in ("ttl", "all") else None
            row.append(ReuseHint(reuse, priority, ttl))
        out[r] = row
        for b in trace.requests[r]:
            remaining[b] = remaining.get(b, 0) + 1
            last_time.setdefault(b, times[r])
    return out
