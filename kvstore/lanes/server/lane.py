"""``ServerLane``: the server side of one lane (its identity, its secret, what it holds); the registry expires it.

- ``check_token(token)``: constant-time comparison with the lane's secret.
- ``touch()``: mark the lane used (the reaper closes lanes idle for too long).
- ``expire(now) -> int``: take back grants whose lease ran out.
- ``close()``: abort outstanding grants and free what the lane holds (idempotent).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from abc import ABC, abstractmethod

from kvstore.lanes.base import TOKEN_BYTES
from kvstore.lanes.server.access import OPEN_ACCESS


class ServerLane(ABC):
    """Server side of one lane: its identity, its secret, and what it holds."""

    kind: str = ""

    def __init__(self, lane_id: str | None = None):
        self.access = OPEN_ACCESS  # the tenant that opened the lane (set by OpenLane)
        self.lane_id = lane_id or secrets.token_hex(8)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.last_used = time.monotonic()
        self.closed = threading.Event()

    def check_token(self, token: bytes) -> bool:
        return hmac.compare_digest(self.token, bytes(token))

    def touch(self) -> None:
        self.last_used = time.monotonic()

    @abstractmethod
    def expire(self, now: float) -> int:
        """Take back grants whose lease ran out; returns how many expired."""

    @abstractmethod
    def close(self) -> None:
        """Abort outstanding grants and free what the lane holds (idempotent)."""
