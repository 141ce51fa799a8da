"""Wire time of a stream, for the codec controller's bandwidth estimate (DESIGN 5).

The sender cannot see the link: it sees the transport take bytes (into
socket buffers, HTTP/2 windows, a qdisc queue; several MiB) and, for a Put,
the reply once the receiver has them all. ``SendClock`` turns that into
``observe(bytes, seconds)`` samples of the link's rate:

- ``begin()``: the first bytes are about to go to the transport.
- ``sent(n)``: the transport took ``n`` more bytes. Every ``window_bytes``
  a sample is reported.
- ``stalled(seconds)``: the sender had nothing to send for ``seconds`` (it
  waited for the encoder, or for the store) and the stall just ended.
- ``finish(drained=True)``: the end of the stream; ``drained`` when the
  receiver just confirmed every byte (a Put's reply), so the last window ends
  now rather than when the last bytes were handed over (they were only
  buffered then).

A window's wall time ``T`` (``begin`` to its end) bounds the link's rate
from below: ``bytes / T`` (the link moved them all in that time). Less the
time the sender stalled, ``T - S``, it bounds it from above, as far as the
sender can tell: during a stall the link may still have been draining
buffered bytes. Buffers of several MiB make the gap wide exactly when the
encoder is slower than the transport takes bytes, early in a stream or on a
fast link. When the receiver's confirmation came long after the last bytes
were handed over (``finish(drained=True)`` more than ``DRAINED`` of the
window later), the buffers were full at the end: the link was the
bottleneck, busy all along, and the lower bound is the rate. (At 25% a
1 Gbit/s link behind fp8+zstd, whose encoder nearly keeps pace with it,
drained for 20-24% of each Put and read 1.3-1.7 Gbit/s; at 10% it reads
1.0-1.2. Fast links drain a few percent: the receiver's last block.) Otherwise a
sample is the geometric mean of the two bounds, exact when the sender never
stalled: counting every stall as idle (the upper bound)
overestimated a 1 Gbit/s link behind deep buffers by 35% here; counting
none (the lower bound) left a fast link looking as slow as the encoder that
fed it, so the controller never learned that raw bytes now go faster.

A transport that had no idle core to run on was CPU-bound, not link-bound
(Python gRPC moves about 0.5 GB/s per core): its rate says the link is at
least that fast, nothing more. When the host's cores were busy for more
than ``SATURATED`` of a window (``/proc/stat``; never on hosts without it),
the sample only raises the estimate (``estimate()``; 0 until a sample
came, so a guess is never the bar), never lowers it. Else a codec that took
a core from the transport would make the link look slower, which makes
coding look better still: on two shared cores the controller talked itself
into zstd on an unshaped link where raw bytes were 40% faster. A link-bound
window (the long drain above) counts whatever the cores did: the bytes were
waiting for the link, not for a core. Without that exception a host busy
with other work kept only the windows faster than the estimate, and the
estimate crept up to 1.5x a 1 Gbit/s link.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_BYTES = 8 << 20  # bytes per bandwidth sample
DRAINED = 0.1  # a drain this long (fraction of the window) shows a link-bound stream
SATURATED = 0.9  # busy fraction of the host's cores past which a window was CPU-bound


def host_cpu() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every core since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


@dataclass
class SendClock:
    """See the module docstring."""

    observe: Callable[[int, float], None]
    estimate: Callable[[], float] = lambda: 0.0
    window_bytes: int = WINDOW_BYTES
    _cpu: tuple[int, int] | None = None
    _bytes: int = 0
    _stalled: float = 0.0
    _began: float | None = None
    _last_sent: float | None = None

    def begin(self) -> None:
        """Bytes are about to go to the transport (a no-op while a window runs)."""
        if self._began is None:
            self._began = time.perf_counter()
            self._cpu = host_cpu()

    def sent(self, nbytes: int) -> None:
        now = time.perf_counter()
        self._bytes += nbytes
        self._last_sent = now
        if self._bytes >= self.window_bytes:
            self._flush(now)

    def stalled(self, seconds: float) -> None:
        if self._began is not None and seconds > 0.0:
            self._stalled += seconds

    def finish(self, drained: bool = False) -> None:
        end = time.perf_counter() if drained else self._last_sent
        if end is not None and self._last_sent is not None:
            link_bound = self._began is not None and end - self._last_sent > DRAINED * (end - self._began)
            self._flush(end, link_bound)
        self._began = self._last_sent = None

    def _flush(self, end: float, link_bound: bool = False) -> None:
        cpu = host_cpu()
        if self._began is not None and self._bytes > 0:
            wall = end - self._began
            busy = min(max(wall - self._stalled, wall * 0.01), wall)
            seconds = wall if link_bound else math.sqrt(wall * busy)
            cpu_bound = _busy_fraction(self._cpu, cpu) > SATURATED
            if wall > 0.0 and (link_bound or not (cpu_bound and self._bytes / seconds < self.estimate())):
                self.observe(self._bytes, seconds)
        self._bytes, self._stalled, self._began, self._cpu = 0, 0.0, end, cpu


def _busy_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return (after[0] - before[0]) / (after[1] - before[1])
