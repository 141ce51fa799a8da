"""bench.bandit's bookkeeping and bench.netns's shaped link (the link test needs root, ip and tc)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import netns
from bench.bandit import best_of, plan_runs, summarize


def test_plan_measures_lossless_codecs_once_per_regime():
    runs = plan_runs(["1gbit", "changing"])
    assert len(runs) == 14
    lossy = [r["codec"] for r in runs if r["regime"] == "1gbit" and r["policy"] == "lossy"]
    assert lossy == ["fp8", "fp8+zstd", "bandit"]


def test_repetitions_are_interleaved_and_the_fastest_kept():
    runs = plan_runs(["10gbit"], {"10gbit": 2})
    assert [r["rep"] for r in runs] == [0] * 7 + [1] * 7
    rows = [{**r, "seconds": 1.0 + r["rep"] if r["codec"] != "zstd" else 2.0 - r["rep"]} for r in runs]
    best = {(r["policy"], r["codec"]): r for r in best_of(rows)}
    assert len(best) == 7 and best[("lossless", "none")]["seconds"] == 1.0
    assert best[("lossless", "zstd")]["seconds"] == 1.0 and best[("lossless", "zstd")]["seconds_runs"] == [2.0, 1.0]
    assert "rep" not in best[("lossless", "none")]


def row(regime: str, policy: str, codec: str, seconds: float) -> dict:
    return {"regime": regime, "policy": policy, "codec": codec, "seconds": seconds}


def test_summary_compares_the_bandit_with_the_best_fixed_codec():
    rows = [
        row("1gbit", "lossless", "none", 2.0),
        row("1gbit", "lossless", "byteplane", 1.0),
        row("1gbit", "lossless", "bandit", 1.08),
        row("1gbit", "lossy", "fp8", 0.8),
        row("1gbit", "lossy", "bandit", 0.95),
        row("changing", "lossless", "none", 3.0),
        row("changing", "lossless", "byteplane", 2.0),
        row("changing", "lossless", "bandit", 2.05),
    ]
    out = summarize(rows)
    bandits = {(r["regime"], r["policy"]): r for r in out if r["codec"] == "bandit"}
    assert bandits[("1gbit", "lossless")]["ratio_to_best"] == pytest.approx(1.08)
    assert bandits[("1gbit", "lossless")]["target_met"]
    assert bandits[("1gbit", "lossy")]["best_fixed_codec"] == "fp8" and not bandits[("1gbit", "lossy")]["target_met"]
    assert not bandits[("changing", "lossless")]["target_met"]  # must beat every fixed codec there
    copied = [r for r in out if r.get("measured_in") == "lossless"]
    assert {r["codec"] for r in copied} == {"none", "byteplane"} and all(r["policy"] == "lossy" for r in copied)


def test_tbf_parameters():
    slow = netns.tbf_args(0.1)
    assert slow[:2] == ["tbf", "rate"] and slow[2] == "100mbit" and int(slow[4]) == netns.MIN_BURST
    fast = netns.tbf_args(10.0)
    assert fast[2] == "10000mbit" and int(fast[4]) == int(10e9 / 8 * netns.BURST_SECONDS)


SINK = (
    "import socket,sys;s=socket.create_server((sys.argv[1],9999));print('ready',flush=True);c,_=s.accept();n=0\n"
    "while (d:=c.recv(1<<20)): n+=len(d)\nprint(n)"
)
SOURCE = (
    "import socket,sys,time;s=socket.create_connection((sys.argv[1],9999));b=bytes(1<<20);t=time.time()\n"
    "for _ in range(12): s.sendall(b)\ns.shutdown(1);s.recv(1);print(12*8*(1<<20)/(time.time()-t)/1e9)"
)


@pytest.mark.skipif(not netns.available(), reason="needs root, ip and tc")
def test_shaped_link_between_namespaces_is_made_used_and_removed():
    with netns.veth_link("t") as link:
        link.shape(0.5)
        assert "rate 500Mbit" in link.qdisc()
        sink = subprocess.Popen(
            link.run_in(link.server_ns, [sys.executable, "-c", SINK, link.server_ip]), stdout=subprocess.PIPE, text=True
        )
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"  # listening
        gbit = float(
            subprocess.run(
                link.run_in(link.client_ns, [sys.executable, "-c", SOURCE, link.server_ip]),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert int(sink.communicate(timeout=10)[0]) == 12 << 20
        # tbf holds the link near 0.5 Gbit/s (the source's clock also counts the sink's exit: a loose lower bound)
        assert 0.1 < gbit < 0.6
        link.shape(None)
        assert "tbf" not in link.qdisc()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert link.server_ns not in names and link.client_ns not in names
