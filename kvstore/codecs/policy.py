"""Which namespaces may hold lossy KV: the server's per-namespace codec policy (DESIGN 5).

Lossy codecs (``fp8``, ``fp8+zstd``) change the bytes of KV, so they are a
constraint of the namespace, never a trade the controller makes on cost.

- ``LossyPolicy.from_spec("draft-*,scratch")``: namespaces matching any of the
  comma-separated shell patterns (``fnmatch``, case-sensitive) allow lossy
  codecs; every other namespace is lossless only. The empty spec (the
  default of ``kvstore serve --lossy-namespaces``) allows lossy nowhere.
- ``allows(namespace) -> bool``: whether blocks of ``namespace`` may be stored
  or served under a lossy codec. A Put of a lossy block into a namespace that
  does not allow it is refused with INVALID_ARGUMENT (``server/validate.py``);
  the server's Get controller never picks a lossy codec there.
- ``is_lossy(codec_id) -> bool``: whether a wire codec id names a lossy codec.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from .registry import get_codec


@dataclass(frozen=True, slots=True)
class LossyPolicy:
    """Namespaces (shell patterns) whose KV may be stored and sent under lossy codecs."""

    patterns: tuple[str, ...] = ()

    @classmethod
    def from_spec(cls, spec: str | None) -> LossyPolicy:
        """A policy from ``"pattern,pattern,..."``; blank entries are ignored."""
        return cls(tuple(p.strip() for p in (spec or "").split(",") if p.strip()))

    def allows(self, namespace: str) -> bool:
        return any(fnmatchcase(namespace, pattern) for pattern in self.patterns)


def is_lossy(codec: int | str) -> bool:
    """True for a lossy codec; False for a lossless or unknown one (unknown ids are refused elsewhere)."""
    try:
        return get_codec(codec).lossy
    except ValueError:
        return False
