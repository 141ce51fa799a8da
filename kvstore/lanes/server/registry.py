"""The lanes open on a node: lookup by id and token, expiry of grants and idle lanes.

Verbs of ``LaneRegistry`` (thread-safe):

- ``add(lane)``: a lane joins (RESOURCE_EXHAUSTED past ``max_lanes``).
- ``get(lane_id, token, kind) -> lane``: an unknown id (closed, expired, or
  from before a restart) is FAILED_PRECONDITION, so the client opens a new
  lane; a known id with the wrong token or kind is PERMISSION_DENIED.
- ``close(lane_id, token)`` / ``close_all()``.
- ``start()`` / ``stop()``: the reaper, which every ``lease/4`` seconds (at
  most 1 s) takes back expired grants and closes lanes idle for ``idle``
  seconds.

Gauges ``lane_<kind>_open`` and the counter ``lane_grants_expired`` show in
Stats.counters and on /metrics.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from kvstore.lanes.base import LaneError
from kvstore.lanes.server.lane import ServerLane
from kvstore.server.metrics import Metrics

log = logging.getLogger(__name__)


class LaneRegistry:
    def __init__(self, metrics: Metrics, *, lease_seconds: float, idle_seconds: float, max_lanes: int):
        self.metrics = metrics
        self.lease, self.idle, self.max_lanes = lease_seconds, idle_seconds, max_lanes
        self._lanes: dict[str, ServerLane] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def add(self, lane: ServerLane) -> None:
        with self._lock:
            if len(self._lanes) >= self.max_lanes:
                raise LaneError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{len(self._lanes)} lanes are open, the limit of this node; use the gRPC path",
                )
            self._lanes[lane.lane_id] = lane
        self._gauges()

    def kind_of(self, lane_id: str) -> str:
        """The kind of an open lane ("" when none): for servicers that speak for several kinds."""
        with self._lock:
            lane = self._lanes.get(lane_id)
        return lane.kind if lane is not None else ""

    def get(self, lane_id: str, token: bytes, kind: str) -> ServerLane:
        with self._lock:
            lane = self._lanes.get(lane_id)
        if lane is None or lane.closed.is_set():
            raise LaneError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lane {lane_id!r} is not open (closed, idle too long, or the node restarted); open a new lane",
            )
        if not lane.check_token(token) or lane.kind != kind:
            raise LaneError(grpc.StatusCode.PERMISSION_DENIED, f"wrong token for {kind} lane {lane_id!r}")
        lane.touch()
        return lane

    def close(self, lane_id: str, token: bytes) -> None:
        with self._lock:
            lane = self._lanes.get(lane_id)
            if lane is None:
                return
            if not lane.check_token(token):
                raise LaneError(grpc.StatusCode.PERMISSION_DENIED, f"wrong token for lane {lane_id!r}")
            del self._lanes[lane_id]
        lane.close()
        self._gauges()

    def close_all(self) -> None:
        with self._lock:
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.close()
        self._gauges()

    # -- expiry -----------------------------------------------------------------------
    def reap(self, now: float | None = None) -> int:
        """One reaper pass; returns the number of grants taken back."""
        now = time.monotonic() if now is None else now
        with self._lock:
            lanes = list(self._lanes.values())
        expired = 0
        idle: list[ServerLane] = []
        for lane in lanes:
            expired += lane.expire(now)
            if now - lane.last_used > self.idle:
                idle.append(lane)
        if idle:
            with self._lock:
                for lane in idle:
                    self._lanes.pop(lane.lane_id, None)
            for lane in idle:
                log.info("closing %s lane %s: idle for more than %.0fs", lane.kind, lane.lane_id, self.idle)
                lane.close()
            self._gauges()
        if expired:
            self.metrics.add("lane_grants_expired", expired)
        return expired

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._loop, name="kvstore-lane-reaper", daemon=True)
            self._reaper.start()

    def _loop(self) -> None:
        interval = min(1.0, self.lease / 4)
        while not self._stop.wait(interval):
            try:
                self.reap()
            except Exception:  # keep reaping; a failed pass is retried next interval
                log.exception("lane reaper pass failed")

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        self.close_all()

    def _gauges(self) -> None:
        with self._lock:
            counts: dict[str, int] = {"shm": 0, "tcp": 0, "cuda_ipc": 0}
            for lane in self._lanes.values():
                counts[lane.kind] = counts.get(lane.kind, 0) + 1
        for kind, n in counts.items():
            self.metrics.set(f"lane_{kind}_open", n)
