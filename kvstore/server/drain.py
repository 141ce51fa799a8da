"""Draining the gRPC server on SIGTERM without cutting the last bytes of its replies.

grpc's ``server.stop(grace)`` closes a connection as soon as its last call has handed its final frames to
the kernel. Bytes still in that socket's send queue then reach the client only if the client sends nothing
more: a WINDOW_UPDATE or PING ack arriving at the closed socket makes the kernel answer with a reset and drop
them (seen in CI as a Get stream ending UNAVAILABLE, "Stream removed", during a drain). So the node drains in
three steps before grpc's stop: refuse new calls (``CallsInFlight``, an interceptor), wait for the calls in
flight, then wait until the port's connections hold no unacknowledged bytes (``wait_sent``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # grpc-stubs make these generic; at run time they are plain classes
    _Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor

log = logging.getLogger(__name__)

# Health must keep answering (NOT_SERVING) while the node drains, and a Watch of it lives as long as its caller.
NOT_COUNTED = ("/grpc.health.v1.Health/",)
_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
_HELD_STATES = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT: sockets the process still holds open
_POLL_SECONDS = 0.01


class CallsInFlight(_Interceptor):
    """Counts the RPCs in flight until each terminates; once ``drain`` starts, new ones get UNAVAILABLE."""

    def __init__(self) -> None:
        self._calls: Counter[str] = Counter()  # method -> calls of it in flight
        self._draining = False
        self._idle = threading.Condition()

    def in_flight(self) -> dict[str, int]:
        with self._idle:
            return {method: n for method, n in self._calls.items() if n}

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or details.method.startswith(NOT_COUNTED):
            return handler
        kind = next(k for k in _KINDS if getattr(handler, k) is not None)
        behavior = getattr(handler, kind)
        method = details.method

        def ended() -> None:
            with self._idle:
                self._calls[method] -= 1
                if not self._calls[method]:
                    self._idle.notify_all()

        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            with self._idle:
                if self._draining:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "this node is shutting down; retry on another node")
                self._calls[method] += 1
            if not context.add_callback(ended):
                ended()
            return behavior(request, context)

        return handler._replace(**{kind: counted})  # grpc's handlers are namedtuples; grpc-stubs leave it out

    def drain(self, deadline: float) -> bool:
        """Refuse new calls and wait (until ``deadline``, monotonic) for those in flight; True if none is left."""
        with self._idle:
            self._draining = True
            left = max(0.0, deadline - time.monotonic())
            return self._idle.wait_for(lambda: not any(self._calls.values()), timeout=left)


def port_unsent(port: int, proc_net: Path = Path("/proc/net")) -> int:
    """Bytes that the open TCP connections on local ``port`` sent and their peers have not acknowledged yet.

    Read from ``/proc/net/tcp`` and ``tcp6`` (the tx_queue column); 0 where they cannot be read.
    """
    total = 0
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 5 or fields[3] not in _HELD_STATES:
                continue
            if int(fields[1].rpartition(":")[2], 16) == port:
                total += int(fields[4].partition(":")[0], 16)
    return total


def wait_sent(unsent: Callable[[], int], deadline: float) -> int:
    """Poll ``unsent()`` until it is 0 or ``deadline`` (monotonic) passes; returns what is left."""
    while (left := unsent()) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    return left
