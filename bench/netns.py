"""A real, rate-limited link on one host: two network namespaces joined by a veth pair, shaped with tc tbf.

    with veth_link() as link:                       # creates the namespaces; always removes them
        link.shape(1.0)                             # 1 Gbit/s on both ends (tbf); None: unshaped
        server = subprocess.Popen(link.run_in(link.server_ns, [...]))
        ...                                         # a client in link.client_ns talks to link.server_ip
        link.shape(0.3)                             # re-shape during a run (tc qdisc change)

Verbs and promises:

- ``veth_link(tag)``: namespaces ``kvb-<tag>-s`` and ``kvb-<tag>-c`` with a
  veth pair ``kvb<tag>s``/``kvb<tag>c`` between them, addressed
  ``10.99.0.1/24`` (server) and ``10.99.0.2/24`` (client), loopback up in
  both. Leftovers of an earlier run with the same tag are removed first;
  on exit (an exception included) both namespaces are deleted, which
  deletes the veth pair and its qdiscs with them. Nothing outside the two
  namespaces is touched; traffic goes only to those two addresses.
- ``shape(gbit)``: ``tc qdisc replace dev ... root tbf rate R burst B latency L``
  on both ends (``replace`` adds the qdisc or changes the one in place
  while traffic flows); ``shape(None)`` deletes it: the bare veth, about as
  fast as loopback. The burst is 4 ms of traffic at the rate (at least
  64 KiB, so a GSO super-packet always fits); ``latency`` bounds the queue.
- ``run_in(ns, argv) -> argv``: the command line that runs ``argv`` inside
  a namespace (``ip netns exec``).

Needs root (CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools; ``available()``
says whether this host can make one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

SERVER_IP = "10.99.0.1"
CLIENT_IP = "10.99.0.2"
PREFIX = 24
LATENCY_MS = 20
MIN_BURST = 64 << 10
BURST_SECONDS = 0.004


def available() -> bool:
    """Root, ``ip`` and ``tc``: what ``veth_link`` needs."""
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def tbf_args(gbit: float) -> list[str]:
    """``tbf`` parameters for ``gbit`` Gbit/s: rate, a burst of 4 ms of traffic, a bounded queue."""
    rate_bytes = gbit * 1e9 / 8
    burst = max(MIN_BURST, int(rate_bytes * BURST_SECONDS))
    return ["tbf", "rate", f"{gbit * 1000:g}mbit", "burst", str(burst), "latency", f"{LATENCY_MS}ms"]


@dataclass
class Link:
    """Two namespaces and the veth pair between them; see the module docstring."""

    server_ns: str
    client_ns: str
    server_dev: str
    client_dev: str
    server_ip: str = SERVER_IP
    client_ip: str = CLIENT_IP
    shaped: bool = False

    def create(self) -> None:
        self.remove()
        _run("ip", "netns", "add", self.server_ns)
        _run("ip", "netns", "add", self.client_ns)
        _run("ip", "link", "add", self.server_dev, "type", "veth", "peer", "name", self.client_dev)
        for dev, ns, ip in (
            (self.server_dev, self.server_ns, self.server_ip),
            (self.client_dev, self.client_ns, self.client_ip),
        ):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{ip}/{PREFIX}", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        """Delete both namespaces (and so the veth pair and qdiscs); quiet when they do not exist."""
        for ns in (self.server_ns, self.client_ns):
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.server_dev, check=False)  # a pair left in the root namespace

    def shape(self, gbit: float | None) -> None:
        for dev, ns in ((self.server_dev, self.server_ns), (self.client_dev, self.client_ns)):
            if gbit is None:
                if self.shaped:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(gbit))
        self.shaped = gbit is not None

    def qdisc(self) -> str:
        """``tc qdisc show`` of the client end (what the link is shaped to now)."""
        return _run("ip", "netns", "exec", self.client_ns, "tc", "qdisc", "show", "dev", self.client_dev).stdout

    @staticmethod
    def run_in(ns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]


@contextmanager
def veth_link(tag: str = "0") -> Iterator[Link]:
    """A fresh link (see the module docstring); removed on exit, whatever happened."""
    link = Link(f"kvb-{tag}-s", f"kvb-{tag}-c", f"kvb{tag}s", f"kvb{tag}c")
    try:
        link.create()
        yield link
    finally:
        link.remove()
