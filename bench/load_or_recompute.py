"""Load or recompute: TTFT of always loading the cached prefix, always recomputing it, and the planner's decision.

    python -m bench.load_or_recompute [--quick] [--out bench/results/load_or_recompute.json] [--model smollm2]

SmolLM2-135M (the built-in runtime, fp32: 46,080 bytes of KV per token) serves
prompts of 500-4,000 tokens (``--quick``: 250 and 500, regimes dram_shm and tcp_0.1gbit) whose first L - 32
tokens are a prefix already in the store, through the decode worker's engine
(``decode_node.engine.DecodeEngine``; TTFT = request submitted to first token).
Regimes, all in one run:

- ``dram_shm``: the prefix in a store's DRAM, over the shared-memory lane;
- ``nvme``: the prefix only on NVMe (Put, SIGTERM flushes it to NVMe, the
  store restarts with an empty DRAM and ``--promote-on-hit false``);
- ``tcp_10gbit``, ``tcp_1gbit``, ``tcp_0.1gbit``: the TCP lane across two
  network namespaces joined by a veth pair shaped with ``tc tbf``
  (bench/netns.py; needs root);
- ``loaded``: the DRAM store while two other client processes Get 16-block
  windows of the prefix over shm in a loop.

Modes (``StoreLink`` policies): ``load`` (every cached block), ``recompute``
(none), ``decide`` (the planner, kvstore/loadplan). Every mode runs through
the same code path; the planner learns online from every request it serves
(the fixed modes' too), with a fresh load-cost model per regime and four
warm-up requests. ``decide_serial`` (decide, overlap off) runs too, to
measure what computing early blocks while later ones load saves; its figures
are in the decide rows (``ttft_p50_serial_s``), not rows of their own.

Rows: ``{"regime", "prompt_tokens", "mode", "ttft_p50_s", "predicted_s", ...}``
(``predicted_s``: the p50 of the planner's predicted TTFT for that mode's plans).
Targets: decide's p50 <= 1.05 x the better fixed mode in every regime, below
both in at least one. The plot (TTFT against prefix length, three modes, two
regimes) goes beside ``--out`` (same name, ``.png``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.common import Row, parse_args, report
from bench.netns import Link, available, veth_link
from kvstore.server.process import store_process

ROOT = Path(__file__).resolve().parent.parent
MODES = ("load", "recompute", "decide")
REGIMES = ("dram_shm", "nvme", "tcp_10gbit", "tcp_1gbit", "tcp_0.1gbit", "loaded")
RATES = {"tcp_10gbit": 10.0, "tcp_1gbit": 1.0, "tcp_0.1gbit": 0.1}
QUICK_REGIMES = ("dram_shm", "tcp_0.1gbit")  # the two ends: loading wins, overlapping wins
PORT = 7070
BACKGROUND_CLIENTS = 2


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument(
        "--regimes",
        default=None,
        help=f"comma list of {', '.join(REGIMES)} (default all; quick {','.join(QUICK_REGIMES)})",
    )
    p.add_argument("--lengths", default=None, help="prompt lengths (default 500,1000,2000,4000; quick 250,500)")
    p.add_argument("--reps", type=int, default=None, help="rounds per case (default 3, quick 1)")
    p.add_argument("--plot-regimes", default="tcp_1gbit,tcp_0.1gbit")


class WorkerProc:
    """The measured decode worker in a subprocess (``bench.load_or_recompute_worker``), in a netns or not."""

    def __init__(self, model: str, wrap: Sequence[str] = ()):
        argv = [*wrap, sys.executable, "-m", "bench.load_or_recompute_worker", "--model", model]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                reply: dict[str, Any] = json.loads(line[3:])
                if "error" in reply:
                    raise RuntimeError(f"worker: {reply['error']}")
                return reply
            sys.stdout.write(line)
        raise RuntimeError(f"worker exited ({self.proc.wait()})")

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(60)


def run_spec(args: argparse.Namespace) -> dict[str, Any]:
    lengths = (
        [int(x) for x in args.lengths.split(",")]
        if args.lengths
        else ([250, 500] if args.quick else [500, 1000, 2000, 4000])
    )
    return {
        "lengths": lengths,
        "reps": args.reps or (1 if args.quick else 3),
        "modes": [*MODES, "decide_serial"],
        "fast_reps": 3 if args.quick else 7,
        "fast_s": 1.0,
        "warmup": ["load", "recompute"] if args.quick else ["load", "recompute", "decide", "load"],
    }


def local_regimes(args: argparse.Namespace, regimes: list[str], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """dram_shm, loaded and nvme: stores on loopback, the worker in this network namespace."""
    out: list[dict[str, Any]] = []
    top = max(spec["lengths"])
    with ExitStack() as stack:
        worker = WorkerProc(args.model)
        stack.callback(worker.close)
        if "dram_shm" in regimes or "loaded" in regimes:
            target, _ = stack.enter_context(store_process("--dram", "1GiB", "--lanes", "shm"))
            worker.call("connect", target=target, lane="shm")
            hashes = worker.call("populate", tokens=top)["hashes_file"]
            stack.callback(Path(hashes).unlink, missing_ok=True)
            if "dram_shm" in regimes:
                out.append(worker.call("run", regime="dram_shm", **spec))
            if "loaded" in regimes:
                bg = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bench.load_or_recompute_worker",
                            "--background",
                            target,
                            "--hashes",
                            hashes,
                        ],
                        cwd=ROOT,
                    )
                    for _ in range(BACKGROUND_CLIENTS)
                ]
                try:
                    time.sleep(2.0)
                    worker.call("connect", target=target, lane="shm")
                    out.append(worker.call("run", regime="loaded", **spec))
                finally:
                    for p in bg:
                        p.kill()
                        p.wait()
        if "nvme" in regimes:
            nvme_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="lor-nvme-"))
            flags = ["--dram", "512MiB", "--nvme-dir", nvme_dir, "--nvme", "2GiB", "--promote-on-hit", "false"]
            flags += ["--share-nvme", "false"]  # the store reads them, as when this regime was first measured
            flags += ["--lanes", "shm"]
            with store_process(*flags) as (target, _):
                worker.call("connect", target=target, lane="shm")
                Path(worker.call("populate", tokens=top)["hashes_file"]).unlink(missing_ok=True)
            # the graceful stop copied every block to NVMe; the restarted store starts with an empty DRAM
            with store_process(*flags) as (target, _):
                worker.call("connect", target=target, lane="shm")
                out.append(worker.call("run", regime="nvme", **spec))
    return out


def start_server(link: Link) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kvstore", "serve", "--listen", f"{link.server_ip}:{PORT}"]
    argv += ["--insecure-plaintext", "1", "--lanes", "tcp", "--metrics-port", "0", "--dram", "1GiB"]
    argv += ["--log-level", "warning"]
    server = subprocess.Popen(link.run_in(link.server_ns, argv), cwd=ROOT)
    health = [sys.executable, "-m", "kvstore", "health", "--target", f"{link.server_ip}:{PORT}", "--timeout", "1"]
    deadline = time.monotonic() + 60
    while subprocess.run(link.run_in(link.client_ns, health), cwd=ROOT, capture_output=True).returncode != 0:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("kvstore serve did not become healthy in the server namespace")
        time.sleep(0.3)
    return server


def tcp_regimes(args: argparse.Namespace, regimes: list[str], spec: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with veth_link("lr") as link:
        server = start_server(link)
        worker = WorkerProc(args.model, link.run_in(link.client_ns, []))
        try:
            target = f"{link.server_ip}:{PORT}"
            worker.call("connect", target=target, lane="tcp")
            worker.call("populate", tokens=max(spec["lengths"]))  # unshaped: the Puts are not what is measured
            for regime in regimes:
                link.shape(RATES[regime])
                worker.call("connect", target=target, lane="tcp")
                result = worker.call("run", regime=regime, **spec)
                result["qdisc"] = link.qdisc().strip()
                out.append(result)
        finally:
            worker.close()
            server.terminate()
            server.wait(30)
    return out


def summarize(results: list[dict[str, Any]]) -> list[Row]:
    rows: list[Row] = []
    for res in results:
        trials = res["trials"]
        lengths = sorted({t["prompt_tokens"] for t in trials})
        for length in lengths:
            by_mode = {
                m: [t for t in trials if t["prompt_tokens"] == length and t["mode"] == m]
                for m in (*MODES, "decide_serial")
            }
            p50 = {m: statistics.median(t["ttft_s"] for t in ts) for m, ts in by_mode.items() if ts}
            first_tokens: dict[int, set[int]] = {}  # per round (one prompt): the first token of every mode
            for ts in by_mode.values():
                for t in ts:
                    first_tokens.setdefault(t["rep"], set()).add(t["token"])
            same = all(len(v) == 1 for v in first_tokens.values())
            best_fixed = min(p50["load"], p50["recompute"])
            for mode in MODES:
                ts = by_mode[mode]
                row: Row = {
                    "regime": res["regime"],
                    "prompt_tokens": length,
                    "mode": mode,
                    "ttft_p50_s": round(p50[mode], 4),
                    "predicted_s": round(statistics.median(t["predicted_s"] for t in ts), 4),
                    "runs": len(ts),
                    "ttft_runs_s": [round(t["ttft_s"], 4) for t in ts],
                    "choices": dict(
                        sorted({c: sum(t["choice"] == c for t in ts) for c in {t["choice"] for t in ts}}.items())
                    ),
                    "loaded_blocks": statistics.median(t["loaded_blocks"] for t in ts),
                    "head_blocks": statistics.median(t["head_blocks"] for t in ts),
                    "ratio_to_best_fixed": round(p50[mode] / best_fixed, 3),
                    "same_first_token": same,
                }
                if mode == "decide" and by_mode["decide_serial"]:
                    row["ttft_p50_serial_s"] = round(p50["decide_serial"], 4)
                    row["predicted_serial_s"] = round(
                        statistics.median(t["predicted_s"] for t in by_mode["decide_serial"]), 4
                    )
                    row["overlap_saves_s"] = round(p50["decide_serial"] - p50["decide"], 4)
                rows.append(row)
    return rows


def verdict(rows: list[Row]) -> list[Row]:
    """Per regime: decide's worst ratio to the better fixed mode, and its ratio on the regime's total."""
    out: list[Row] = []
    for regime in dict.fromkeys(r["regime"] for r in rows):
        rs = [r for r in rows if r["regime"] == regime]
        decide = [r for r in rs if r["mode"] == "decide"]
        total = {m: sum(r["ttft_p50_s"] for r in rs if r["mode"] == m) for m in MODES}
        out.append(
            {
                "regime": regime,
                "worst_ratio": max(r["ratio_to_best_fixed"] for r in decide),
                "rows_below_both": sum(r["ratio_to_best_fixed"] < 1.0 for r in decide),
                "total_ratio": round(total["decide"] / min(total["load"], total["recompute"]), 3),
                "target_1.05": max(r["ratio_to_best_fixed"] for r in decide) <= 1.05,
            }
        )
    return out


def plot(rows: list[Row], regimes: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    regimes = [g for g in regimes if any(r["regime"] == g for r in rows)]
    if not regimes:
        return
    fig, axes = plt.subplots(1, len(regimes), figsize=(5.5 * len(regimes), 4), squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        for mode, style in zip(MODES, ("o-", "s-", "^-")):
            rs = sorted(
                (r for r in rows if r["regime"] == regime and r["mode"] == mode), key=lambda r: r["prompt_tokens"]
            )
            xs = [r["prompt_tokens"] - 32 for r in rs]
            ax.plot(xs, [r["ttft_p50_s"] for r in rs], style, label=f"{mode} (measured)")
            if mode == "decide":
                ax.plot(xs, [r["predicted_s"] for r in rs], "^:", color="gray", label="decide (predicted)")
        ax.set_yscale("log")
        ax.set_title(regime), ax.set_xlabel("cached prefix (tokens)"), ax.set_ylabel("TTFT p50 (s, log)")
        ax.grid(alpha=0.3), ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__ or "", argv, configure)
    regimes = [r for r in (args.regimes or ",".join(QUICK_REGIMES if args.quick else REGIMES)).split(",") if r]
    unknown = set(regimes) - set(REGIMES)
    if unknown:
        raise SystemExit(f"unknown regimes {sorted(unknown)}; choose from {REGIMES}")
    spec = run_spec(args)
    results = local_regimes(args, regimes, spec)
    tcp = [r for r in REGIMES if r in RATES and r in regimes]
    if tcp:
        if available():
            results += tcp_regimes(args, tcp, spec)
        else:
            print("no root or no ip/tc: skipping the shaped TCP regimes")
    results.sort(key=lambda r: REGIMES.index(r["regime"]))
    rows = summarize(results)
    cols = ["regime", "prompt_tokens", "mode", "ttft_p50_s", "predicted_s", "ratio_to_best_fixed", "choices"]
    cols += ["loaded_blocks", "head_blocks", "ttft_p50_serial_s", "overlap_saves_s"]
    report(rows, args, title="TTFT p50 per regime, prompt length and mode", columns=cols, bench="load_or_recompute")
    summary = verdict(rows)
    from bench.common import format_table

    print("\nper regime (decide against the better fixed mode)")
    print(format_table(summary))
    below = [s["regime"] for s in summary if s["rows_below_both"]]
    print(
        f"target <= 1.05x everywhere: {all(s['target_1.05'] for s in summary)}; regimes with decide below both: {below}"
    )
    if args.out:
        doc = json.loads(args.out.read_text())
        doc["summary"] = summary
        doc["regimes"] = [{k: v for k, v in r.items() if k != "trials"} for r in results]
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        plot(rows, [g for g in args.plot_regimes.split(",") if g], args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
