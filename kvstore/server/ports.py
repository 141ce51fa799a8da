"""The listening ports of ``kvstore serve``, checked before anything starts.

Verbs:

- ``preflight(cfg)``: tries to bind every fixed port the config names (``--listen``, ``--metrics-port``,
  ``--tcp-lane-listen``; port 0 means "any free port" and is not checked) and raises ``PortError`` for the first
  one that cannot be bound or that an earlier flag also asks for, before the store is built, NVMe recovered or a
  cluster joined. The probe sockets are closed at once, so a port taken in the moment between the check and the
  real bind still fails there:
- ``PortError(flag, address, err)``: a ``ValueError`` whose text is one line naming the flag, the address and
  what to do (``kvstore.cli`` prints it and exits 2, no traceback). ``StoreServer.start`` raises it too when the
  real bind fails.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from kvstore.config import ServeConfig


class PortError(ValueError):
    def __init__(self, flag: str, address: str, reason: str):
        hint = "pick another port" + (" or 0 to turn metrics off" if flag == "--metrics-port" else "")
        super().__init__(f"{flag} {address}: cannot listen there ({reason}); {hint}")
        self.flag, self.address = flag, address


@dataclass(frozen=True)
class Listener:
    flag: str
    host: str
    port: int

    @property
    def shown(self) -> str:
        """The flag's value as the user wrote it (a port number for --metrics-port)."""
        if self.flag == "--metrics-port":
            return str(self.port)
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def listeners(cfg: ServeConfig) -> list[Listener]:
    """The fixed ports ``cfg`` asks for (port 0 picks a free one and cannot collide)."""
    out: list[Listener] = []
    for flag, hostport in (("--listen", cfg.listen), ("--tcp-lane-listen", cfg.tcp_lane_listen)):
        if hostport:
            host, _, port = hostport.rpartition(":")
            if port.isdigit() and int(port):
                out.append(Listener(flag, host.strip("[]") or "0.0.0.0", int(port)))
    if cfg.metrics_port:
        out.append(Listener("--metrics-port", "0.0.0.0", cfg.metrics_port))  # what Metrics.start_http binds
    return out


def preflight(cfg: ServeConfig) -> None:
    taken: list[Listener] = []
    for listener in listeners(cfg):
        clash = next((t for t in taken if t.port == listener.port and _overlap(t.host, listener.host)), None)
        if clash is not None:  # each probe alone would pass; the second real bind would fail on the first
            raise PortError(listener.flag, listener.shown, f"{clash.flag} asks for the same port")
        probe(listener)
        taken.append(listener)


def _overlap(a: str, b: str) -> bool:
    anywhere = ("0.0.0.0", "::", "")
    return a == b or a in anywhere or b in anywhere


def probe(listener: Listener) -> None:
    """Bind (and close) a socket the way the real server will; PortError when the port is taken or forbidden."""
    try:
        infos = socket.getaddrinfo(listener.host, listener.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # an unresolvable host: the real bind reports it in its own words
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and http.server do: TIME_WAIT is fine
        try:
            sock.bind(sockaddr)
        except OSError as err:
            raise PortError(listener.flag, listener.shown, describe(err)) from None


def describe(err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return "the port is in use, by another kvstore serve or another program"
    if err.errno == errno.EACCES:
        return "permission denied: ports below 1024 need privileges"
    if err.errno == errno.EADDRNOTAVAIL:
        return "no interface of this host has that address"
    return err.strerror or str(err)
