"""`kvstore serve` as a process: flags, env vars, YAML config, health, stats, SIGTERM drain, metrics."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvstore import config
from kvstore.client import Client
from kvstore.free_port import free_port
from kvstore.server.app import dram_allocation_error, nvme_room_shortfall
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.conftest import ROOT


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_help_lists_every_option_with_default():
    out = run_cli("serve", "--help").stdout
    for flag in (
        "--listen",
        "--dram",
        "--nvme-dir",
        "--nvme",
        "--metrics-port",
        "--config",
        "--redis",
        "--advertise",
        "--tls-cert",
        "--tls-key",
        "--tls-client-ca",
        "--tenants",
        "--max-message",
        "--log-level",
    ):
        assert flag in out
    assert "default: 1GiB" in out and "KVSTORE_DRAM" in out


def test_precedence_flag_env_file(tmp_path):
    cfg_file = tmp_path / "kv.yaml"
    cfg_file.write_text("dram: 64MiB\nmax-hashes: 7\nlisten: 127.0.0.1:1\n")
    parser = __import__("argparse").ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--config", str(cfg_file), "--listen", "127.0.0.1:3"])
    cfg = config.load(args, env={"KVSTORE_DRAM": "32MiB", "KVSTORE_LISTEN": "127.0.0.1:2"})
    assert (cfg.listen, cfg.dram, cfg.max_hashes) == ("127.0.0.1:3", 32 << 20, 7)


def test_bad_config_is_reported(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dramm: 1GiB\n")
    result = run_cli("serve", "--config", str(bad))
    assert result.returncode == 2 and "unknown options ['dramm']" in result.stderr
    result = run_cli("serve", "--dram", "lots")
    assert result.returncode == 2 and "--dram" in result.stderr
    result = run_cli("serve", "--max-message", "10")  # it would start, then fail every Get and Put
    assert result.returncode == 2 and "--max-message: at least 64KiB" in result.stderr
    for flag in ("--dram", "--max-block", "--max-stream", "--max-hashes", "--workers"):
        result = run_cli("serve", flag, "0")
        assert result.returncode == 2 and f"option {flag}: 1 or more" in result.stderr, (flag, result.stderr)
    (tmp_path / "file").write_text("")
    result = run_cli(  # an NVMe directory that cannot be made: its error, not a traceback
        "serve", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--dram", "64MiB", "--nvme-dir",
        str(tmp_path / "file" / "nvme"), "--nvme", "1GiB",
    )  # fmt: skip
    assert result.returncode == 1 and "kvstore: [Errno" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(
    open("/proc/sys/vm/overcommit_memory").read().strip() == "1", reason="the kernel grants any mapping"
)
def test_a_dram_tier_larger_than_the_host_is_refused_by_name():
    result = run_cli("serve", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--dram", "64TiB")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--dram 64TiB: the DRAM arena cannot be allocated (" in result.stderr
    assert "available on this host); lower --dram" in result.stderr


def test_a_shared_dram_tier_larger_than_its_tmpfs_is_explained(tmp_path):
    err = dram_allocation_error(OSError(errno.ENOSPC, "No space left on device"), 1 << 40, str(tmp_path))
    assert err.errno == errno.ENOSPC
    assert re.fullmatch(
        rf"--dram 1TiB: {tmp_path} has [0-9.]+[KMGT]iB free for the shared DRAM arena \(--share-dram\); lower "
        r"--dram, or pass --shm-dir on a larger tmpfs",
        err.strerror,
    )
    other = OSError(errno.EACCES, "Permission denied")
    assert dram_allocation_error(other, 1 << 30, None) is other  # not a matter of size: as it was


def test_an_nvme_tier_larger_than_its_disk_is_warned_of(tmp_path):
    (tmp_path / "segment").write_bytes(b"x" * 8192)
    room = nvme_room_shortfall(str(tmp_path), 1 << 60)
    assert room is not None and room.held >= 8192 and 0 < room.free < 1 << 60
    assert nvme_room_shortfall(str(tmp_path), room.free) is None  # what is free, and what the tier holds, fit


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--listen", "bogus"], "option --listen: not HOST:PORT"),
        (["--listen", "127.0.0.1:99999"], "option --listen: not HOST:PORT"),  # gRPC would bind port 34463
        (["--tcp-lane-listen", "127.0.0.1:x"], "option --tcp-lane-listen: not HOST:PORT"),
        (["--metrics-port", "-1"], "option --metrics-port: 0-65535"),
        (["--lane-max", "0"], "option --lane-max: 1 or more"),
        (["--dram", "512"], "option --dram: at least 4KiB (one page); got 512 bytes: give a unit, as in 512MiB"),
        (["--cuda-lane-bytes", "0"], "option --cuda-lane-bytes: 1 or more"),
        (["--lane-lease", "0"], "option --lane-lease: seconds above 0"),
        (["--cluster-ttl", "nan"], "option --cluster-ttl: seconds above 0"),
        (["--drain-seconds", "-1"], "option --drain-seconds: 0 or more"),
        (["--max-rpc-seconds", "inf"], "option --max-rpc-seconds: 0 or more"),
        (["--tenant-streams", "-1"], "option --tenant-streams: 0 or more"),
        (["--log-level", "loud"], "option --log-level: debug, info"),
        (["--nvme-sync", "never"], "option --nvme-sync: direct or fdatasync"),
        (["--nvme", "100GiB"], "option --nvme needs --nvme-dir"),  # else: a store with no NVMe tier, silently
        (["--share-nvme", "true"], "option --share-nvme needs --nvme-dir"),
        (["--share-nvme", "maybe"], "option --share-nvme: auto, true or false; got 'maybe'"),
        (["--nvme", "16GiB"], "option --nvme needs --nvme-dir"),  # the default's size, but asked for
    ],
)
def test_serve_refuses_options_that_start_a_broken_store(flags, says):
    parser = __import__("argparse").ArgumentParser()
    config.add_arguments(parser)
    with pytest.raises(ValueError, match=re.escape(says)):
        config.load(parser.parse_args(flags), env={})


def test_options_at_their_limits_and_defaults_are_taken(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    config.add_arguments(parser)
    flags = ["--listen", "7070", "--tcp-lane-listen", "[::1]:0", "--metrics-port", "65535", "--drain-seconds", "0"]
    cfg = config.load(parser.parse_args(flags), env={})
    assert (cfg.listen, cfg.tcp_lane_listen, cfg.metrics_port) == ("7070", "[::1]:0", 65535)
    example = tmp_path / "example.yaml"  # every option at its default, the NVMe ones without a directory
    example.write_text(config.example_yaml())
    assert config.load(parser.parse_args(["--config", str(example)]), env={}) == config.ServeConfig(config=str(example))
    nvme = config.load(parser.parse_args(["--nvme-dir", str(tmp_path), "--nvme", "1GiB", "--share-nvme", "1"]), env={})
    assert (nvme.nvme, nvme.share_nvme, nvme.nvme_shared) == (1 << 30, "true", True)


@pytest.mark.parametrize(
    "flags, shared",
    [
        ([], False),  # no NVMe tier: nothing to share
        (["--nvme-dir", "D"], True),  # auto, no tenants: any client may read any block anyway
        (["--nvme-dir", "D", "--tenants", "T"], False),  # auto with tenants: a client would read every tenant's
        (["--nvme-dir", "D", "--tenants", "T", "--share-nvme", "true"], True),  # one trust domain, said so
        (["--nvme-dir", "D", "--share-nvme", "off"], False),
        (["--nvme-dir", "D", "--share-nvme", "AUTO"], True),
    ],
)
def test_share_nvme_auto_shares_the_files_only_without_tenants(tmp_path, flags, shared):
    (tmp_path / "T").write_text("- {name: a, token: aaaaaaaaaaaaaaaa, namespaces: [a]}\n")
    parser = __import__("argparse").ArgumentParser()
    config.add_arguments(parser)
    args = [str(tmp_path / a) if a in ("D", "T") else a for a in flags]
    assert config.load(parser.parse_args(args), env={}).nvme_shared is shared


def test_serve_env_health_stats_metrics_and_sigterm(spawn_server):
    metrics_port = free_port()
    proc = spawn_server(env={"KVSTORE_DRAM": "64MiB", "KVSTORE_METRICS_PORT": str(metrics_port)})
    # the fixture passes --metrics-port 0 as a flag, which wins over the env var
    assert run_cli("health", "--target", proc.target).returncode == 0
    with Client(proc.target) as kv:
        kv.put("ns", [b"k" * 16], [b"v" * 1000])
    stats = json.loads(run_cli("stats", "--target", proc.target, "--json").stdout)
    assert stats["blocks"] == 1 and stats["tiers"][0]["capacity_bytes"] == 64 << 20
    table = run_cli("stats", "--target", proc.target).stdout
    assert "dram" in table and "64MiB" in table
    assert proc.terminate() == 0
    assert run_cli("health", "--target", proc.target, "--timeout", "1").returncode != 0


def test_sigusr1_dumps_every_threads_stack_and_keeps_serving(spawn_server):
    """Three dumps at start-up, while the warm-up thread compiles: faulthandler's dump (used before) walked the
    other threads' frames as they ran and killed the node about 1 time in 10."""
    proc = spawn_server("--dram", "16MiB")
    for n in range(1, 4):
        os.kill(proc.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while proc.output().count("in serve_forever") < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.proc.poll() is None, proc.output()[-5000:]
        assert proc.output().count("in serve_forever") == n and "kvstore-rpc_0" in proc.output()
    assert run_cli("health", "--target", proc.target).returncode == 0
    assert proc.terminate() == 0, proc.output()[-5000:]


def test_metrics_endpoint(spawn_server):
    port = free_port()
    proc = spawn_server("--metrics-port", str(port))
    with Client(proc.target, lane="grpc") as kv:  # the RPC histogram below is for the gRPC path
        kv.put("ns", [b"k" * 16], [b"v" * 1000])
        kv.get("ns", [b"k" * 16])
        kv.lookup("ns", [b"k" * 16, b"j" * 16])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        'kvstore_tier_used_bytes{tier="dram"}',
        'kvstore_tier_hits_total{tier="dram"} 1.0',
        "kvstore_lookup_misses_total 1.0",
        "kvstore_bytes_in_total 1000.0",
        "kvstore_bytes_out_total 1000.0",
        'kvstore_rpc_seconds_bucket{code="OK",le="0.005",method="Put"}',
        "kvstore_tier_evictions_total",
        "kvstore_tier_not_admitted_total",
    ):
        assert name in text, name


def test_metrics_token_is_required_when_configured(make_server, tmp_path):
    token_file = tmp_path / "metrics-token"
    token_file.write_text("scrape-secret-0123456789\n")
    port = free_port()
    make_server(metrics_port=port, metrics_token_file=str(token_file))
    url = f"http://127.0.0.1:{port}/metrics"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "scrape-secret-0123456789"}):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
        assert err.value.code == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
    ok = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-secret-0123456789"})
    assert 'kvstore_tier_used_bytes{tier="dram"}' in urllib.request.urlopen(ok, timeout=5).read().decode()


def test_empty_metrics_token_file_is_refused(make_server, tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        make_server(metrics_port=free_port(), metrics_token_file=str(tmp_path / "empty"))


def test_sigterm_drains_an_in_flight_stream(spawn_server):
    """SIGTERM while a Get stream is half read: the stream still completes, then the server exits 0."""
    proc = spawn_server("--drain-seconds", "20")
    keys = [bytes([i]) * 16 for i in range(64)]
    payloads = [bytes([i]) * (1 << 20) for i in range(64)]
    with Client(proc.target) as kv:
        kv.put("ns", keys, payloads)
    channel = grpc.insecure_channel(proc.target)
    stream = pb_grpc.KVStoreStub(channel).Get(pb.GetRequest(namespace="ns", hashes=keys), timeout=60)
    first = next(stream)  # the server is now streaming this request
    proc.proc.send_signal(signal.SIGTERM)
    data = first.data + b"".join(m.data for m in stream)
    channel.close()
    assert proc.wait_exit(30) == 0
    assert data == b"".join(payloads)


@pytest.mark.parametrize("size", ["512MiB", "2GiB", "1.5G", "4096"])
def test_sizes(size):
    from kvstore.sizes import parse_size

    assert parse_size(size) > 0


def test_example_config_lists_every_option():
    """Regenerate with: python -c "from kvstore.config import example_yaml; print(example_yaml())" > docs/config.example.yaml"""
    assert (ROOT / "docs" / "config.example.yaml").read_text() == config.example_yaml() + "\n"
