"""Time to first token with and without the store, on a real model (SmolLM2-135M by default).

    python -m bench.ttft [--quick] [--out FILE.json] [--plot FILE.png (default: beside --out)]
                         [--prefill HOST:PORT --decode HOST:PORT --store HOST:PORT]
                         [--workload chat|trace] [--trace FILE] [--rate R] [--nvme [--dir DIR] [--share-dram auto|true|false]]
                         [--shared-pool auto|always|never]

Without addresses it starts a store, a prefill worker and a decode worker on
loopback ports. Workloads:

- ``chat``: multi-turn conversations over a shared system prompt of real
  English text (prompts of 2,000-4,000 tokens; ``--quick`` shorter). Every
  prompt is served three ways: ``recompute`` (decode worker computes it all),
  ``disaggregated`` (prefill worker computes what the store lacks and stores
  it, then the decode worker fetches it) and ``store`` (decode worker, prefix
  already in the store: a later turn, a retry, another decode replica).
  With ``--nvme`` also ``store_nvme``: the same, with the prefix only on NVMe
  (a second stack whose store's DRAM is too small; ``bench/ttft_nvme.py``).
- ``trace``: the Mooncake trace (``--trace``) scaled down: each hash id becomes
  a deterministic run of 16 tokens, so equal ids mean equal tokens; requests
  go down the disaggregated path at ``--rate`` requests/s (open loop).

Reported: TTFT p50/p99 per mode, time per output token, the TTFT split
(lookup, transfer, load, compute), the floor (compute of the uncached tail +
moving the KV bytes at memcpy speed; ``ttft_over_floor_p50``: the median of each
request's TTFT over its own floor), transfer GB/s, hit rate and the store's
tiers. JSON rows carry ``mode``, ``ttft_p50_s``, ``ttft_p99_s``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import plot_path, positive
from kvstore.router import Result, Router, local_stack


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def chat_prompts(quick: bool, tokenizer_model: str) -> list[list[int]]:
    from kvstore.model import load_model
    from kvstore.model.real_kv import english_tokens

    model, tok = load_model(tokenizer_model)
    vocab = model.config.vocab
    turn: Callable[[int, int], list[int]]
    if tok is None:  # random-init models: synthetic ids, same shape of workload
        system = [(i * 7919) % (vocab - 10) + 10 for i in range(600 if quick else 2000)]
        turn = lambda c, t: [(c * 131 + t * 17 + i) % (vocab - 10) + 10 for i in range(200 if quick else 600)]  # noqa: E731
    else:
        system = english_tokens(tok, 600 if quick else 2000, seed=1)
        turn = lambda c, t: english_tokens(tok, 200 if quick else 600, seed=100 + 10 * c + t)  # noqa: E731
    prompts = []
    for c in range(2 if quick else 3):
        history = list(system)
        for t in range(2 if quick else 3):
            history = history + turn(c, t)
            prompts.append(list(history))
    return prompts


def trace_prompts(path: Path, n: int, max_blocks: int, vocab: int) -> list[list[int]]:
    prompts = []
    with path.open() as f:
        for line, _ in zip(f, range(n)):
            ids = json.loads(line)["hash_ids"][:max_blocks]
            prompts.append([t for hid in ids for t in random.Random(hid).choices(range(10, vocab), k=16)] + [3, 4, 5])
    return prompts


def run_chat(router: Router, prompts: list[list[int]], new_tokens: int) -> list[Result]:
    results = []
    for i, prompt in enumerate(tqdm(prompts, desc="chat prompts", unit="prompt")):
        results.append(router.run("recompute", prompt, "chat", new_tokens))
        results.append(router.run("disaggregated", prompt, "chat", new_tokens))
        results.append(router.run("store", prompt, "chat", new_tokens))
        ref, dis, hit = results[-3:]
        assert dis.tokens == ref.tokens == hit.tokens, f"prompt {i}: tokens differ from recomputing"
    return results


def run_trace(router: Router, prompts: list[list[int]], new_tokens: int, rate: float) -> list[Result]:
    results: list[Result] = []
    lock = threading.Lock()
    threads = []
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="trace requests", unit="req")
    rng = random.Random(0)

    def one(prompt: list[int]) -> None:
        r = router.run("disaggregated", prompt, "trace", new_tokens)
        r.arrived_s = time.perf_counter() - start
        with lock:
            results.append(r)
            bar.update()

    for prompt in prompts:
        if rate > 0:
            time.sleep(rng.expovariate(rate))
            t = threading.Thread(target=one, args=(prompt,))
            t.start()
            threads.append(t)
        else:
            one(prompt)
    for t in threads:
        t.join()
    bar.close()
    return sorted(results, key=lambda r: r.arrived_s)


def summarize(results: list[Result], memcpy_gbps: float, block_tokens: int = 16) -> list[dict[str, Any]]:
    rows = []
    for mode in ("recompute", "disaggregated", "store", "store_nvme"):
        rs = [r for r in results if r.mode == mode]
        if not rs:
            continue
        ttft = [r.ttft_s for r in rs]
        moved = sum(r.transfer_bytes for r in rs)
        transfer = sum(r.transfer_s for r in rs)
        blocks = sum(r.prompt_tokens // block_tokens for r in rs)
        rows.append(
            {
                "mode": mode,
                "requests": len(rs),
                "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in rs),
                "ttft_p50_s": round(pct(ttft, 0.5), 4),
                "ttft_p99_s": round(pct(ttft, 0.99), 4),
                "tpot_s": round(statistics.mean(r.tpot_s for r in rs), 4),
                "prefill_s": round(statistics.mean(r.prefill_s for r in rs), 4),
                "lookup_s": round(statistics.mean(r.lookup_s for r in rs), 4),
                "transfer_s": round(statistics.mean(r.transfer_s for r in rs), 4),
                "transfer_p50_s": round(pct([r.transfer_s for r in rs], 0.5), 4),  # a first request's lane set-up
                # moves the mean: 0.027-0.036 s against 0.007-0.010 (forty-seventh session)
                "load_s": round(statistics.mean(r.load_s for r in rs), 4),
                "compute_s": round(statistics.mean(r.compute_s for r in rs), 4),
                "floor_s": round(statistics.mean(r.compute_s + r.transfer_bytes / (memcpy_gbps * 1e9) for r in rs), 4),
                # each request's TTFT over its own floor: the p50 and the mean floor above mix requests
                "ttft_over_floor_p50": round(
                    statistics.median(
                        r.ttft_s / max(r.compute_s + r.transfer_bytes / (memcpy_gbps * 1e9), 1e-9) for r in rs
                    ),
                    3,
                ),
                "transfer_gbps": round(moved / transfer / 1e9, 3) if transfer else 0.0,
                "hit_rate": round(sum(r.cached_blocks for r in rs) / blocks, 3) if blocks else 0.0,
                "prefill_hit_rate": round(sum(r.prefill_cached_blocks for r in rs) / blocks, 3) if blocks else 0.0,
                "recomputed": sum(r.recomputed for r in rs),
            }
        )
    return rows


def plot(results: list[Result], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("recompute", "disaggregated", "store"):
        xs = sorted(r.ttft_s for r in results if r.mode == mode)
        if xs:
            a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=mode, drawstyle="steps-post")
    a.set_xscale("log"), a.set_xlabel("TTFT (s)"), a.set_ylabel("CDF"), a.legend(), a.set_title("TTFT")
    served = [r for r in results if r.mode == "disaggregated"]
    hits, total, xs, ys, per = 0, 0, [], [], []
    for i, r in enumerate(served):
        blocks = max(1, r.prompt_tokens // 16)
        hits += r.prefill_cached_blocks
        total += blocks
        xs.append(i + 1)
        ys.append(hits / total)
        per.append(r.prefill_cached_blocks / blocks)
    b.plot(xs, ys, label="cumulative"), b.plot(xs, per, "o", label="per request")
    b.set_ylim(0, 1.05), b.legend()
    b.set_xlabel("request (disaggregated path)"), b.set_ylabel("prefix blocks found in the store by prefill")
    b.set_title("Hit rate over time")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests on the same path")
    p.add_argument("--out", type=Path, default=None, metavar="FILE.json", help="write the rows as JSON here")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="the figure (default: beside --out)")
    p.add_argument("--model", default="smollm2", help="model the local stack runs (smollm2, tiny, bench, ...)")
    p.add_argument("--prefill", default=None, help="prefill worker HOST:PORT (default: start a local stack)")
    p.add_argument("--decode", default=None, help="decode worker HOST:PORT")
    p.add_argument("--store", default=None, help="store HOST:PORT, for its stats")
    p.add_argument("--workload", choices=("chat", "trace"), default="chat")
    p.add_argument("--trace", type=Path, default=Path("../shared/traces/synthetic_trace.jsonl"))
    p.add_argument("--requests", type=positive(int), default=40, help="trace requests to replay")
    p.add_argument(
        "--max-blocks", type=positive(int), default=48, help="trace: hash ids per request kept (16 tokens each)"
    )
    p.add_argument("--rate", type=float, default=0.0, help="trace: open-loop arrivals per second (0: one at a time)")
    p.add_argument("--new-tokens", type=positive(int), default=8, help="tokens generated per request")
    p.add_argument(
        "--nvme", action="store_true", help="chat: also a mode with the prefix only on NVMe (bench/ttft_nvme)"
    )
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="--nvme: where its store keeps its NVMe tier")
    p.add_argument(
        "--share-nvme",
        choices=["true", "false"],
        default="true",
        help="--nvme: the store runs with --share-nvme (the decode worker reads the NVMe blocks from its files)",
    )
    p.add_argument(
        "--share-dram",
        choices=["auto", "true", "false"],
        default="auto",
        help="--nvme: the store's --share-dram (auto: its default). Shared, its DRAM index names the NVMe-only blocks "
        "too; otherwise (with --share-nvme true) an index of those alone does; the decode worker reads them "
        "without asking the store either way",
    )
    p.add_argument(
        "--shared-pool",
        choices=["auto", "always", "never"],
        default="auto",
        help="the local stack's workers lay their KV pools in memory shared with the store (their --shared-pool)",
    )
    args = p.parse_args(argv)
    worker_args = ("--shared-pool", args.shared_pool)
    nvme_results: list[Result] = []  # --nvme (bench/ttft_nvme.py)

    from bench.baselines import memcpy_gbps

    with ExitStack() as stack:
        if args.decode:
            store, prefill, decode = args.store, args.prefill, args.decode
        else:
            store, prefill, decode = stack.enter_context(local_stack(args.model, worker_args=worker_args))
        router = Router(prefill, decode)
        stack.callback(router.close)
        if args.workload == "chat":
            prompts = chat_prompts(args.quick, args.model)
            results = run_chat(router, prompts, args.new_tokens)
            if args.nvme:
                from bench.ttft_nvme import run_nvme

                nvme_results, disk_speeds = run_nvme(
                    args.model,
                    prompts,
                    args.new_tokens,
                    args.dir,
                    args.share_nvme == "true",
                    args.share_dram,
                    worker_args,
                )
                results += nvme_results
        else:
            n = min(args.requests, 12) if args.quick else args.requests
            from kvstore.model import load_model

            vocab = load_model(args.model)[0].config.vocab
            results = run_trace(
                router, trace_prompts(args.trace, n, args.max_blocks, vocab), args.new_tokens, args.rate
            )
        stats = None
        if store:
            from kvstore.client import Client

            with Client(store) as kv:
                stats = kv.stats()
    rows = summarize(results, memcpy_gbps(256 << 20))
    if nvme_results:
        from bench.ttft_nvme import nvme_row

        nvme_row(rows, nvme_results, disk_speeds)
    base = next((r for r in rows if r["mode"] == "recompute"), None)
    print(
        f"\n{'mode':14} {'n':>3} {'tokens':>7} {'TTFT p50':>9} {'p99':>8} {'speedup':>8} {'lookup':>7} "
        f"{'transfer':>8} {'xfer p50':>8} {'compute':>8} {'floor':>7} {'/floor':>6} {'GB/s':>6} {'hit':>5}"
    )
    for r in rows:
        speed = base["ttft_p50_s"] / r["ttft_p50_s"] if base and r["ttft_p50_s"] else 0.0
        r["speedup_vs_recompute_p50"] = round(speed, 2)
        print(
            f"{r['mode']:14} {r['requests']:>3} {r['prompt_tokens_mean']:>7.0f} {r['ttft_p50_s']:>9.3f} "
            f"{r['ttft_p99_s']:>8.3f} {speed:>7.1f}x {r['lookup_s']:>7.3f} {r['transfer_s']:>8.3f} "
            f"{r.get('transfer_p50_s', 0.0):>8.3f} {r['compute_s']:>8.3f} {r['floor_s']:>7.3f} "
            f"{r['ttft_over_floor_p50']:>6.2f} "
            f"{r['transfer_gbps']:>6.2f} {r['hit_rate']:>5.2f}"
        )
    if stats:
        for t in stats["tiers"]:
            print(f"store tier {t['name']}: {t['blocks']} blocks, {t['used_bytes'] / 2**20:.0f} MiB, {t['hits']} hits")
    sample = next((r.text for r in results if r.text), "")
    for r in rows:
        r.update(workload=args.workload, model=args.model, shared_pool=args.shared_pool)
        if stats:
            r["store_tiers"] = {
                t["name"]: {"blocks": t["blocks"], "used_bytes": t["used_bytes"], "hits": t["hits"]}
                for t in stats["tiers"]
            }
    if sample:
        print(f"sample generation: {sample!r}")
        rows[-1]["sample_text"] = sample
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {args.out}")
    figure = plot_path(args.out, args.plot)
    if figure:
        plot(results, figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
