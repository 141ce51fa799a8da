"""Time to first token of a real vLLM engine whose prompt prefix comes from elsewhere (issue 16).

    python -m bench.vllm_pd [--quick] [--out bench/results/vllm_pd.json]

Every mode runs SmolLM2-135M (``kvstore export-model``, fp32, block size 32, eager) in an engine process of its
own, one phase at a time (memory), each prompt a fresh random one:

- ``recompute``: an engine without a connector, prompt never seen.
- ``local_prefix_hit``: the same engine, the same prompt again: vLLM's own prefix cache, the floor.
- ``example_connector``: vLLM's ``ExampleConnector`` (kv_both): the prompt is run once (it writes one
  safetensors file per layer), vLLM's own cache is dropped (``reset_prefix_cache``) and the prompt runs again,
  loading the files from the page cache; ``example_connector_evicted``: the same after ``fsync`` and
  ``posix_fadvise(DONTNEED)`` of every file, so they come from the disk.
- ``kvstore_shm`` / ``kvstore_tcp``: ``KVStoreConnector`` (kv_both) on that lane: the prompt is run once
  (its blocks saved in the background), vLLM's cache dropped, the prompt run again, loading from the store.
- ``kvstore_nvme``: as ``kvstore_shm``, after filler blocks pushed the prompt's blocks out of the store's
  DRAM onto its NVMe tier (``--promote-on-hit false``; ``nvme_fraction`` says how many were there).
- ``multi_turn:*``: chats over one shared system prompt, each turn on a dropped vLLM cache (as if another
  replica served it); its prefix can come only from the connector. ``hit_rate``: cached / prompt tokens.

Rows: ``mode``, ``prompt_tokens``, ``ttft_p50_s``, ``ttft_p99_s`` (of ``n`` samples: with few samples p99 is
the slowest), ``ratio_to_local`` (p50 over ``local_prefix_hit``'s p50 at that size, in this run),
``tokens_match`` (the first token equals the cold run's), ``bytes_per_block``, ``copies_per_block``,
``load_s_p50`` (the kvstore worker's own load time per request).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import Row, parse_args, report
from kvstore.integrations.vllm.identity import EngineShape, prompt_hashes
from kvstore.integrations.vllm_engine import EngineProcess, EngineSpec
from kvstore.server.process import free_port

BLOCK = 32
ROOT = Path(__file__).resolve().parents[1]
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 1000, 120, 24


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@contextmanager
def _store(nvme_dir: Path, dram: str) -> Iterator[str]:
    target = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "kvstore", "serve", "--listen", target, "--metrics-port", "0", "--log-level",
           "error", "--dram", dram, "--nvme-dir", str(nvme_dir), "--nvme", "8GiB", "--promote-on-hit", "false"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        while subprocess.run(
            [sys.executable, "-m", "kvstore", "health", "--target", target, "--timeout", "1"],
            capture_output=True,
            cwd=ROOT,
        ).returncode:
            if proc.poll() is not None:
                raise RuntimeError("kvstore serve exited")
            time.sleep(0.2)
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _evict(directory: Path) -> int:
    """fsync then drop every file under ``directory`` from the page cache; the number of bytes dropped."""
    dropped = 0
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return dropped


class Samples:
    def __init__(self) -> None:
        self.ttft: dict[tuple[str, int], list[float]] = {}
        self.match: dict[tuple[str, int], bool] = {}
        self.extra: dict[tuple[str, int], dict[str, Any]] = {}

    def add(self, mode: str, size: int, seconds: float, match: bool | None = None, **extra: Any) -> None:
        self.ttft.setdefault((mode, size), []).append(seconds)
        if match is not None:
            self.match[(mode, size)] = self.match.get((mode, size), True) and match
        for k, v in extra.items():
            self.extra.setdefault((mode, size), {}).setdefault(k, []).append(v)

    def rows(self) -> list[Row]:
        local = {size: statistics.median(v) for (mode, size), v in self.ttft.items() if mode == "local_prefix_hit"}
        rows: list[Row] = []
        for (mode, size), values in self.ttft.items():
            p50 = statistics.median(values)
            row: Row = {
                "mode": mode,
                "prompt_tokens": size,
                "n": len(values),
                "ttft_p50_s": round(p50, 4),
                "ttft_p99_s": round(_p(values, 0.99), 4),
                "ratio_to_local": round(p50 / local[size], 2) if size in local else None,
                "tokens_match": self.match.get((mode, size)),
            }
            for k, v in self.extra.get((mode, size), {}).items():
                nums = [x for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
                row[k] = round(statistics.median(nums), 4) if len(nums) == len(v) else v[-1]
            if "prompt_len" in row:  # multi-turn rows: the median prompt of the turns measured
                row["prompt_tokens"] = int(row.pop("prompt_len"))
            rows.append(row)
        return rows


def _warm(engine: EngineProcess, rng: random.Random, sizes: list[int]) -> None:
    for size in sizes:  # first requests of each size allocate and tune; keep them out of the figures
        engine.generate([_prompt(rng, size)], 1)


def phase_local(model: str, sizes: list[int], reps: int, out: Samples, rng: random.Random) -> dict[str, Any]:
    with EngineProcess(EngineSpec(model)) as engine:
        _warm(engine, rng, sizes)
        for size in sizes:
            for _ in range(reps):
                prompt = _prompt(rng, size)
                cold = engine.generate([prompt], 1)
                out.add("recompute", size, cold["seconds"])
                hit = engine.generate([prompt], 1)
                out.add(
                    "local_prefix_hit",
                    size,
                    hit["seconds"],
                    hit["outputs"][0]["tokens"] == cold["outputs"][0]["tokens"],
                )
        return {"start_s": engine.start_seconds}


def phase_example(model: str, sizes: list[int], reps: int, out: Samples, rng: random.Random, tmp: Path) -> None:
    storage = tmp / "example"
    storage.mkdir()
    spec = EngineSpec(model, "example", "kv_both", {"shared_storage_path": str(storage)})
    with EngineProcess(spec) as engine:
        _warm(engine, rng, sizes)
        for size in sizes:
            for _ in range(reps):
                prompt = _prompt(rng, size)
                cold = engine.generate([prompt], 1)["outputs"][0]
                engine.reset_prefix_cache()
                warm = engine.generate([prompt], 1)
                same = warm["outputs"][0]["tokens"] == cold["tokens"]
                out.add("example_connector", size, warm["seconds"], same, cached=warm["outputs"][0]["cached"])
                engine.reset_prefix_cache()
                dropped = _evict(storage)
                evicted = engine.generate([prompt], 1)
                same = evicted["outputs"][0]["tokens"] == cold["tokens"]
                out.add("example_connector_evicted", size, evicted["seconds"], same, evicted_bytes=dropped)
        multi_turn(engine, "multi_turn:example_connector", out, rng)


def _fill(target: str, nbytes: int, block_bytes: int) -> None:
    """Put ``nbytes`` of filler blocks so older blocks leave DRAM for NVMe."""
    from kvstore.client import Client

    payload = bytes(block_bytes)
    keys = [os.urandom(16) for _ in range(nbytes // block_bytes + 1)]
    with Client(target) as client:
        for i in range(0, len(keys), 16):
            client.put("bench-filler", keys[i : i + 16], [payload] * len(keys[i : i + 16]), chained=False)


def phase_kvstore(
    model: str, target: str, lane: str, sizes: list[int], reps: int, out: Samples, rng: random.Random, tmp: Path,
    *, nvme: bool, dram_bytes: int,
) -> None:  # fmt: skip
    from kvstore.client import Client

    stats = tmp / f"stats-{lane}"
    spec = EngineSpec(model, "kvstore", "kv_both", {"target": target, "lane": lane, "stats_path": str(stats)})
    shape = EngineShape(model, "", "float32", 30, 3, 64, BLOCK, "vllm-LBHNC-tp1")
    with EngineProcess(spec) as engine, Client(target) as probe:

        def loaded(mode: str, size: int, prompt: list[int], cold: list[int], **extra: Any) -> None:
            before = engine.worker_stats()
            engine.reset_prefix_cache()
            warm = engine.generate([prompt], 1)
            after = engine.worker_stats()
            blocks = after["load_blocks"] - before.get("load_blocks", 0)
            out.add(
                mode,
                size,
                warm["seconds"],
                warm["outputs"][0]["tokens"] == cold,
                cached=warm["outputs"][0]["cached"],
                loaded_blocks=blocks,
                load_s=after["load_seconds"] - before.get("load_seconds", 0.0),
                bytes_per_block=after["block_bytes"],
                copies_per_block=after["copies_per_block_load"],
                lane=after["lane"],
                **extra,
            )

        _warm(engine, rng, sizes)
        for size in sizes:  # a warm-up save and load: lanes negotiated, staging buffers touched
            p = _prompt(rng, size)
            engine.generate([p], 1)
            engine.wait_saves()
            engine.reset_prefix_cache()
            engine.generate([p], 1)
        for size in sizes:
            for _ in range(reps):
                prompt = _prompt(rng, size)
                cold = engine.generate([prompt], 1)["outputs"][0]["tokens"]
                engine.wait_saves()
                loaded(f"kvstore_{lane}", size, prompt, cold)
                if nvme:
                    _fill(target, dram_bytes + (256 << 20), engine.worker_stats()["block_bytes"])
                    hashes = prompt_hashes(prompt, shape, "vllm")[: (size - 1) // BLOCK]
                    _, tiers = probe.lookup_tiers("vllm", hashes)
                    frac = sum(t == "nvme" for t in tiers) / max(len(hashes), 1)
                    loaded("kvstore_nvme", size, prompt, cold, nvme_fraction=round(frac, 3))
                if lane == "shm":
                    hit = engine.generate([prompt], 1)
                    out.add("kvstore_phase_local_hit", size, hit["seconds"], hit["outputs"][0]["tokens"] == cold)
        if lane == "shm":
            multi_turn(engine, "multi_turn:kvstore_shm", out, rng, wait=engine.wait_saves)


def multi_turn(
    engine: EngineProcess,
    mode: str,
    out: Samples,
    rng: random.Random,
    *,
    chats: int = 2,
    turns: int = 3,
    wait: Callable[[], Any] | None = None,
) -> None:
    system = _prompt(random.Random(99), SYSTEM_TOKENS)  # the same system prompt in every chat and every engine
    cached = total = 0
    for _ in range(chats):
        prompt = system + _prompt(rng, USER_TOKENS)
        for turn in range(turns):
            engine.reset_prefix_cache()  # this turn lands on a replica without the chat in its own cache
            first = engine.generate([prompt], 1)
            if turn:  # the first turn of the first chat has nothing to reuse anywhere
                out.add(mode, 0, first["seconds"], prompt_len=len(prompt))
                cached += first["outputs"][0]["cached"]
                total += len(prompt)
            answer = engine.generate([prompt], ANSWER_TOKENS)["outputs"][0]["tokens"]
            if wait is not None:
                wait()
            prompt = prompt + answer + _prompt(rng, USER_TOKENS)
    out.extra.setdefault((mode, 0), {})["hit_rate"] = [round(cached / max(total, 1), 3)]


def phase_multi_turn_recompute(model: str, out: Samples, rng: random.Random) -> None:
    with EngineProcess(EngineSpec(model)) as engine:
        _warm(engine, rng, [1000])
        multi_turn(engine, "multi_turn:recompute", out, rng)


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument(
            "--sizes", default="", help="prompt tokens, comma list (default 1000,2000,3500; quick 1000,2000)"
        )
        p.add_argument("--reps", type=int, default=0, help="prompts per size and mode (default 5; quick 2)")
        p.add_argument("--modes", default="local,example,shm,tcp,turns", help="phases to run")

    args = parse_args("vLLM TTFT with the prompt prefix from kvstore, ExampleConnector or vLLM itself", argv, configure)
    sizes = (
        [int(s) for s in args.sizes.split(",")] if args.sizes else ([1000, 2000] if args.quick else [1000, 2000, 3500])
    )
    reps = args.reps or (2 if args.quick else 5)
    phases = set(args.modes.split(","))
    from kvstore.model.hf_export import exported_smollm2

    model = str(exported_smollm2())
    rng = random.Random(16)
    out = Samples()
    dram = "1GiB"
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_BENCH_DIR", "/var/tmp")) as d:
        tmp = Path(d)
        if "local" in phases:
            info = phase_local(model, sizes, reps, out, rng)
        if "example" in phases:
            phase_example(model, sizes, reps, out, rng, tmp)
        with _store(tmp / "nvme", dram) as target:
            if "shm" in phases:
                phase_kvstore(model, target, "shm", sizes, reps, out, rng, tmp, nvme=True, dram_bytes=1 << 30)
            if "tcp" in phases:
                phase_kvstore(model, target, "tcp", sizes, reps, out, rng, tmp, nvme=False, dram_bytes=1 << 30)
        if "turns" in phases:
            phase_multi_turn_recompute(model, out, rng)
    rows = out.rows()
    rows.sort(key=lambda r: (r["mode"].startswith("multi_turn"), r["prompt_tokens"], r["mode"]))
    columns = ["mode", "prompt_tokens", "n", "ttft_p50_s", "ttft_p99_s", "ratio_to_local", "tokens_match", "cached",
               "load_s", "copies_per_block", "bytes_per_block", "nvme_fraction", "hit_rate"]  # fmt: skip
    report(rows, args, title=f"vLLM TTFT (SmolLM2-135M fp32, block 32; engine start {info.get('start_s', 0):.0f} s)",
           columns=columns, bench="vllm_pd")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
