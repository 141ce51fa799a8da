"""Time to first token of a real vLLM engine whose prompt prefix comes from elsewhere (issue 16).

    python -m bench.vllm_pd [--quick] [--out bench/results/vllm_pd.json] [--sizes 1000,2000] [--reps N]
                            [--phases local,example,nixl,kvstore,turns]

Every mode runs SmolLM2-135M (``kvstore export-model``, fp32, block size 32, eager) in an engine process of its
own, one phase at a time (memory), each prompt a fresh random one:

- ``recompute``: an engine without a connector, prompt never seen.
- ``local_prefix_hit``: the same engine, the same prompt again: vLLM's own prefix cache, the floor.
- ``example_connector``: vLLM's ``ExampleConnector`` (kv_both): the prompt is run once (it writes one
  safetensors file per layer), vLLM's own cache is dropped (``reset_prefix_cache``) and the prompt runs again,
  loading the files from the page cache; ``example_connector_evicted``: the same after ``fsync`` and
  ``posix_fadvise(DONTNEED)`` of every file, so they come from the disk.
- ``kvstore_shm`` / ``kvstore_tcp``: ``KVStoreConnector`` (kv_both), two engines side by side, one per lane:
  the shm engine runs the prompt once (its blocks saved in the background); each engine drops vLLM's cache
  and runs the prompt, loading its prefix from the store's DRAM (``--share-dram true``, the default: the shm
  engine copies it from the store's mapped arena; ``false``: the store writes it into the engine's cache).
- ``kvstore_nvme``: as ``kvstore_shm``, after the store restarted: a graceful stop writes every block to its
  NVMe tier, DRAM starts empty and ``--promote-on-hit false`` keeps the blocks on NVMe (``nvme_fraction``
  says how many were there: 1.0); with ``--share-nvme true`` (the default) the engine reads them from the
  store's segment files itself.
- ``nixl_connector``: vLLM's ``NixlConnector`` (kv_both, ``kv_buffer_device`` cpu), disaggregated the way it
  is built to be: a prefill engine computes the prompt (``do_remote_decode``) and keeps its blocks, a decode
  engine in another process pulls them with NIXL (UCX over shared memory on one host) and computes the first
  token; its paired local hit is the decode engine's. The first prompt of each size is not measured (a new
  size's first pull and first local hit took 1.2-1.4 s at 3.5k tokens, the next ones 0.3; vLLM counts no
  pulled token in ``num_cached_tokens``, so ``cached`` stays empty). ``idle_cores``: CPU the two
  engines burn while idle (each NIXL agent's progress thread polls a core; with it turned off, a NIXL agent option
  vLLM does not expose, a pull never completed here), which the rest of the phase runs beside. Needs the
  ``nixl`` package (``make nixl``); without it the phase is skipped with a note.
- ``multi_turn:*``: chats over one shared system prompt, each turn on a dropped vLLM cache (as if another
  replica served it); its prefix can come only from the connector. ``hit_rate``: cached / prompt tokens.

Rows: ``mode``, ``prompt_tokens``, ``ttft_p50_s``, ``ttft_p99_s`` (of ``n`` samples: with few samples p99 is
the slowest), ``ratio_to_local`` (the median over samples of the TTFT over vLLM's own prefix hit of the same prompt, measured
in the same engine right after: this VM's load moves 2-10x within minutes, a paired ratio much less),
``local_p50_s`` (those local hits),
``tokens_match`` (the first token equals the cold run's), ``bytes_per_block``, ``copies_per_block``,
``load_s`` (the kvstore worker's own load time per request), ``memcpy_s`` (one ``np.copyto`` of the bytes
loaded, in this process into a buffer whose pages are made, best of 3, the engines idle) and
``copy_floor_ratio``: (local hit + memcpy_s) / local hit, what a load of one copy that does not overlap the
forward pass could reach at best.
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

import numpy as np

from bench.common import Row, best_seconds, parse_args, report
from kvstore.free_port import free_port
from kvstore.integrations.vllm.identity import EngineShape, prompt_hashes
from kvstore.integrations.vllm_engine import EngineProcess, EngineSpec

BLOCK = 32
ROOT = Path(__file__).resolve().parents[1]
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 1000, 120, 24


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class StoreProc:
    """A ``kvstore serve`` on a loopback port; ``restart()`` stops it gracefully (DRAM's blocks go to NVMe) and
    starts it again on the same port and NVMe directory, with an empty DRAM."""

    def __init__(
        self, nvme_dir: Path, dram: str, share_dram: bool = True, share_nvme: bool = True, dram_index: bool = True
    ):
        self.target = f"127.0.0.1:{free_port()}"
        self.cmd = [sys.executable, "-m", "kvstore", "serve", "--listen", self.target, "--metrics-port", "0",
                    "--log-level", "error", "--dram", dram, "--nvme-dir", str(nvme_dir), "--nvme", "8GiB",
                    "--promote-on-hit", "false", "--share-dram", str(share_dram).lower(),
                    "--share-nvme", str(share_nvme).lower(), "--dram-index", str(dram_index).lower()]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT)
        deadline = time.monotonic() + 300  # recovery of the NVMe index included
        while subprocess.run(
            [sys.executable, "-m", "kvstore", "health", "--target", self.target, "--timeout", "1"],
            capture_output=True,
            cwd=ROOT,
        ).returncode:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvstore serve exited or did not become healthy")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(180)  # a graceful stop writes DRAM's blocks to NVMe
        except subprocess.TimeoutExpired:
            print("[vllm_pd] kvstore serve did not stop in 180 s: killed", file=sys.stderr)
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def _store(nvme_dir: Path, dram: str, share_dram: bool, share_nvme: bool, dram_index: bool) -> Iterator[StoreProc]:
    store = StoreProc(nvme_dir, dram, share_dram, share_nvme, dram_index)
    store.start()
    try:
        yield store
    finally:
        store.stop()


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
        n = len(self.ttft[(mode, size)])
        print(
            f"[vllm_pd {time.strftime('%H:%M:%S')}] {mode} {size}: {seconds:.3f} s (#{n})", file=sys.stderr, flush=True
        )
        if match is not None:
            self.match[(mode, size)] = self.match.get((mode, size), True) and match
        for k, v in extra.items():
            self.extra.setdefault((mode, size), {}).setdefault(k, []).append(v)

    def rows(self) -> list[Row]:
        rows: list[Row] = []
        for (mode, size), values in self.ttft.items():
            p50 = statistics.median(values)
            pairs = self.extra.get((mode, size), {}).pop("local_s", None)
            row: Row = {
                "mode": mode,
                "prompt_tokens": size,
                "n": len(values),
                "ttft_p50_s": round(p50, 4),
                "ttft_p99_s": round(_p(values, 0.99), 4),
                # each sample over vLLM's own prefix hit of the same prompt in the same engine, right after
                "ratio_to_local": round(statistics.median([v / h for v, h in zip(values, pairs)]), 2)
                if pairs
                else None,
                "local_p50_s": round(statistics.median(pairs), 4) if pairs else None,
                "tokens_match": self.match.get((mode, size)),
            }
            for k, v in self.extra.get((mode, size), {}).items():
                nums = [x for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
                row[k] = round(statistics.median(nums), 4) if len(nums) == len(v) else v[-1]
            if "prompt_len" in row:  # multi-turn rows: the median prompt of the turns measured
                row["prompt_tokens"] = int(row.pop("prompt_len"))
            rows.append(row)
        return rows


class Memcpy:
    """Seconds of one plain copy of ``n`` bytes between two buffers whose pages are already made (best of 3)."""

    def __init__(self) -> None:
        self._src = self._dst = np.zeros(0, np.uint8)

    def seconds(self, n: int) -> float:
        if n > self._src.size:
            self._src, self._dst = np.ones(n, np.uint8), np.ones(n, np.uint8)
        src, dst = self._src[:n], self._dst[:n]
        return best_seconds(lambda: np.copyto(dst, src), 3, warmup=0)


MEMCPY = Memcpy()


def _warm(engine: EngineProcess, rng: random.Random) -> None:
    engine.generate([_prompt(rng, 500)], 1)  # the first request allocates and tunes: keep it out of the figures


def phase_local(model: str, sizes: list[int], reps: int, out: Samples, rng: random.Random) -> dict[str, Any]:
    with EngineProcess(EngineSpec(model)) as engine:
        _warm(engine, rng)
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
        _warm(engine, rng)
        for size in sizes:
            for _ in range(reps):
                prompt = _prompt(rng, size)
                cold = engine.generate([prompt], 1)["outputs"][0]
                engine.reset_prefix_cache()
                warm = engine.generate([prompt], 1)
                same = warm["outputs"][0]["tokens"] == cold["tokens"]
                local = engine.generate([prompt], 1)["seconds"]
                out.add(
                    "example_connector", size, warm["seconds"], same, cached=warm["outputs"][0]["cached"], local_s=local
                )
                engine.reset_prefix_cache()
                dropped = _evict(storage)
                evicted = engine.generate([prompt], 1)
                same = evicted["outputs"][0]["tokens"] == cold["tokens"]
                local = engine.generate([prompt], 1)["seconds"]
                out.add(
                    "example_connector_evicted", size, evicted["seconds"], same, evicted_bytes=dropped, local_s=local
                )
        multi_turn(engine, "multi_turn:example_connector", out, rng)


def nixl_missing() -> str | None:
    """Why vLLM's NixlConnector cannot run here, or None when it can."""
    try:
        import nixl._api  # noqa: F401  # what vLLM's NixlConnector imports
    except ImportError as err:
        return f"nixl is not installed ({err}); `make nixl` installs it"
    return None


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _idle_cores(engines: list[EngineProcess], seconds: float = 2.0) -> float:
    """Cores the engines burn together while no request runs."""
    before = [_cpu_ticks(e.proc.pid) for e in engines]
    time.sleep(seconds)
    ticks = sum(_cpu_ticks(e.proc.pid) - b for e, b in zip(engines, before))
    return round(ticks / os.sysconf("SC_CLK_TCK") / seconds, 2)


def phase_nixl(model: str, sizes: list[int], reps: int, out: Samples, rng: random.Random) -> None:
    def spec() -> EngineSpec:
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        return EngineSpec(model, "nixl", "kv_both", {}, env=env)

    with EngineProcess(spec()) as prefill, EngineProcess(spec()) as decode:
        idle = _idle_cores([prefill, decode])
        print(f"[vllm_pd] nixl: the two idle engines burn {idle} cores", file=sys.stderr, flush=True)
        _warm(prefill, rng)
        for size in sizes:
            for rep in range(reps + 1):  # the first of each size warms both engines up: not measured
                prompt = _prompt(rng, size)
                pre = prefill.generate([prompt], 1, kv_transfer_params=[{"do_remote_decode": True}])["outputs"][0]
                if not pre["kv_transfer_params"]:
                    raise RuntimeError("the NIXL prefill engine returned no kv_transfer_params")
                dec = decode.generate([prompt], 1, kv_transfer_params=[pre["kv_transfer_params"]])
                local = decode.generate([prompt], 1)["seconds"]
                same = dec["outputs"][0]["tokens"] == pre["tokens"]
                if rep == 0:
                    continue
                out.add("nixl_connector", size, dec["seconds"], same, local_s=local, idle_cores=idle)


def _load_once(engine: EngineProcess, mode: str, size: int, prompt: list[int], cold: list[int], out: Samples,
               **extra: Any) -> None:  # fmt: skip
    """Drop vLLM's cache, run the prompt (its prefix from the store), then again (vLLM's own hit: the pair)."""
    before = engine.worker_stats()
    engine.reset_prefix_cache()
    warm = engine.generate([prompt], 1)
    after = engine.worker_stats()
    local = engine.generate([prompt], 1)["seconds"]
    loaded = after["load_blocks"] - before.get("load_blocks", 0)
    memcpy = MEMCPY.seconds(loaded * after["block_bytes"])
    out.add(
        mode,
        size,
        warm["seconds"],
        warm["outputs"][0]["tokens"] == cold,
        cached=warm["outputs"][0]["cached"],
        loaded_blocks=loaded,
        load_s=after["load_seconds"] - before.get("load_seconds", 0.0),
        memcpy_s=memcpy,
        copy_floor_ratio=(local + memcpy) / local,
        bytes_per_block=after["block_bytes"],
        copies_per_block=after["copies_per_block_load"],
        lane=after["lane"],
        local_s=local,
        **extra,
    )


def phase_kvstore(
    model: str, store: StoreProc, sizes: list[int], reps: int, out: Samples, rng: random.Random, tmp: Path,
    verify_loads: bool = True, huge_pages: bool = True,
) -> None:  # fmt: skip
    """Two kv_both engines side by side, one per lane; the shm one computes and saves each prompt, both load it
    from DRAM. Then the store restarts (a graceful stop writes every block to NVMe; DRAM starts empty, and
    ``--promote-on-hit false`` keeps them there) and the shm engine loads every prompt again, from NVMe."""
    from kvstore.client import Client

    def spec(lane: str) -> EngineSpec:
        extra = {"target": store.target, "lane": lane, "stats_path": str(tmp / lane), "verify_loads": verify_loads,
                 "huge_pages": huge_pages}  # fmt: skip
        return EngineSpec(model, "kvstore", "kv_both", extra)

    shape = EngineShape(model, "", "float32", 30, 3, 64, BLOCK, "vllm-LBHNC-tp1")
    stored: list[tuple[int, list[int], list[int]]] = []
    with EngineProcess(spec("shm")) as shm, EngineProcess(spec("tcp")) as tcp:
        for engine in (shm, tcp):  # first requests allocate and tune; lanes negotiated, pages touched
            p = _prompt(rng, 500)
            engine.generate([p], 1)
            engine.wait_saves()
            engine.reset_prefix_cache()
            engine.generate([p], 1)
        warm = p
        for size in sizes:
            for _ in range(reps):
                prompt = _prompt(rng, size)
                cold = shm.generate([prompt], 1)["outputs"][0]["tokens"]
                shm.wait_saves()
                _load_once(shm, "kvstore_shm", size, prompt, cold, out)
                _load_once(tcp, "kvstore_tcp", size, prompt, cold, out)
                stored.append((size, prompt, cold))
        tcp.close()
        store.restart()
        for _ in range(2):  # the engine's clients find the old lanes gone and reconnect: not measured
            shm.reset_prefix_cache()
            shm.generate([warm], 1)
        with Client(store.target) as probe:
            for size, prompt, cold in stored:
                hashes = prompt_hashes(prompt, shape, "vllm")[: (size - 1) // BLOCK]
                _, tiers = probe.lookup_tiers("vllm", hashes)
                frac = sum(t == "nvme" for t in tiers) / max(len(hashes), 1)
                _load_once(shm, "kvstore_nvme", size, prompt, cold, out, nvme_fraction=round(frac, 3))
            own = probe.stats()["counters"].get("lane_shm_disk_get_bytes", 0)  # since the restart
            print(f"[vllm_pd] kvstore_nvme: the engine read {own / 2**20:.0f} MiB from the store's NVMe files itself")
        multi_turn(shm, "multi_turn:kvstore_shm", out, rng, wait=shm.wait_saves)


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
        _warm(engine, rng)
        multi_turn(engine, "multi_turn:recompute", out, rng)


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument(
            "--sizes", default="", help="prompt tokens, comma list (default 1000,2000,3500; quick 1000,2000)"
        )
        p.add_argument("--reps", type=int, default=0, help="prompts per size and mode (default 5; quick 2)")
        p.add_argument(
            "--phases",
            default="local,example,nixl,kvstore,turns",
            help="phases to run (default: all; nixl skips with a note where the nixl package is missing)",
        )
        p.add_argument(
            "--local-reps", type=int, default=0, help="prompts per size without a connector (default 2; quick 1)"
        )
        p.add_argument(
            "--share-dram",
            default="true",
            help="start the store with --share-dram (default true): the shm engine "
            "copies DRAM hits from the mapped arena; false: the store writes them into the engine's cache",
        )
        p.add_argument(
            "--share-nvme",
            default="true",
            help="start the store with --share-nvme (default true): kvstore_nvme's engine reads the blocks from the "
            "store's NVMe files itself; false: the store reads them and writes them into the engine's cache",
        )
        p.add_argument(
            "--dram-index",
            default="true",
            help="with --share-dram: the store shares its DRAM index (default true), so the shm engine finds DRAM "
            "hits without asking it; false: every load is asked",
        )
        p.add_argument(
            "--verify-loads",
            default="true",
            choices=["true", "false"],
            help="the connector's verify_loads (default true)",
        )
        p.add_argument(
            "--huge-pages",
            default="true",
            choices=["true", "false"],
            help="the connector's huge_pages (default true: huge pages asked for under the engines' CPU caches)",
        )

    args = parse_args("vLLM TTFT with the prompt prefix from kvstore, ExampleConnector or vLLM itself", argv, configure)
    sizes = (
        [int(s) for s in args.sizes.split(",")] if args.sizes else ([1000, 2000] if args.quick else [1000, 2000, 3500])
    )
    reps = args.reps or (2 if args.quick else 5)
    phases = set(args.phases.split(","))
    local_reps = args.local_reps or (1 if args.quick else 2)
    from kvstore.model.hf_export import exported_smollm2

    model = str(exported_smollm2())
    rng = random.Random(16)
    out = Samples()
    dram = "2GiB"
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVSTORE_BENCH_DIR", "/var/tmp")) as d:
        tmp = Path(d)
        if "local" in phases:
            info = phase_local(model, sizes, local_reps, out, rng)
        if "example" in phases:
            phase_example(model, sizes, reps, out, rng, tmp)
        if "nixl" in phases:
            missing = nixl_missing()
            if missing:
                print(f"[vllm_pd] nixl_connector skipped: {missing}", file=sys.stderr, flush=True)
            else:
                phase_nixl(model, sizes, reps, out, rng)
        with _store(
            tmp / "nvme", dram, args.share_dram == "true", args.share_nvme == "true", args.dram_index == "true"
        ) as store:
            if "kvstore" in phases:
                phase_kvstore(
                    model, store, sizes, reps, out, rng, tmp, args.verify_loads == "true", args.huge_pages == "true"
                )
        if "turns" in phases:
            phase_multi_turn_recompute(model, out, rng)
    rows = out.rows()
    rows.sort(key=lambda r: (r["mode"].startswith("multi_turn"), r["prompt_tokens"], r["mode"]))
    columns = ["mode", "prompt_tokens", "n", "ttft_p50_s", "ttft_p99_s", "local_p50_s", "ratio_to_local", "tokens_match", "cached", "loaded_blocks",
               "load_s", "memcpy_s", "copy_floor_ratio", "copies_per_block", "bytes_per_block", "nvme_fraction", "hit_rate", "idle_cores"]  # fmt: skip
    report(rows, args, title=f"vLLM TTFT (SmolLM2-135M fp32, block 32; engine start {info.get('start_s', 0):.0f} s)",
           columns=columns, bench="vllm_pd")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
