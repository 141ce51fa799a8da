"""``free_port()``: a loopback TCP port free now, for a server about to be started on it (tests, benches, demos).

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``net.ipv4.ip_local_port_range``), the range every outgoing connection's local port is drawn from too: between
the pick and the server's own bind, a client connecting anywhere can take it, and the server fails to start. So
ports are drawn below that range, where only other explicit binds land, and each is checked free by binding it.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10_000  # above the well-known and the usual fixed service ports
DEFAULT_EPHEMERAL_START = 32_768
TRIES = 100
# not the random module's shared generator: pytest-randomly seeds it alike in every xdist worker before each test, so
# two workers starting a server at once would draw the same port
_draw = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    low, high = LOWEST, _ephemeral_start()
    for _ in range(TRIES if high - low > 1000 else 0):
        port = _draw.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: take what the kernel gives
        s.bind((host, 0))
        picked: int = s.getsockname()[1]
        return picked


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START
