"""Engine hints: what a Put may say about a block's future, for the eviction policy.

``ReuseHint`` is a small value object (every field optional):
- ``reuse``: True when the engine expects the block back (the conversation or
  agent loop continues), False when it does not (the conversation ended, a
  one-shot document); None: no opinion;
- ``priority``: 0 (default) to ``MAX_PRIORITY``: how many extra tier turnovers
  the block should outlive others by while it is resident;
- ``ttl_s``: keep the block ahead of unhinted ones for this many seconds
  (until its next access or the deadline, whichever comes first).

Policies take it through ``policy.hint(entry, hint)`` (a no-op in the plain
ones; ``adaptive`` uses it, kvstore.store.adaptive) and a store through
``BlockStore.hint(namespace, hashes, hint)``.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PRIORITY = 3


@dataclass(frozen=True)
class ReuseHint:
    reuse: bool | None = None
    priority: int = 0
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in 0..{MAX_PRIORITY}")
        if self.ttl_s is not None and self.ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")

    @property
    def empty(self) -> bool:
        return self.reuse is None and not self.priority and self.ttl_s is None
