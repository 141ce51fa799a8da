"""A vLLM engine in its own process, driven over stdin/stdout: what tests, ``bench.vllm_pd`` and the demo run.

    with EngineProcess(EngineSpec(model=dir, connector="kvstore", role="kv_consumer",
                                  extra={"target": "127.0.0.1:7070"})) as engine:
        reply = engine.generate([prompt_ids], max_tokens=1)   # {"outputs": [{"tokens", "cached"}], "seconds"}

Verbs and promises:

- ``EngineProcess(spec)`` starts ``python -m kvstore.integrations.vllm_engine SPEC_JSON`` and waits until the
  engine answers (``start_seconds``). One request at a time; a reply is one JSON line on stdout behind a
  marker, so vLLM's own logging on stdout never confuses it.
- ``generate(prompts, max_tokens, cache_salt=None, ignore_eos=True, kv_transfer_params=None)``: greedy generation of
  token-id prompts; per prompt the tokens, ``num_cached_tokens`` (vLLM's own prefix hit plus the connector's) and
  the request's ``kv_transfer_params`` out, and the call's seconds measured inside the engine process (with
  ``max_tokens=1``: the time to first token). ``kv_transfer_params``, one per prompt (or None), go in with each
  request (``SamplingParams.extra_args``): what NixlConnector's prefill and decode requests carry.
- ``reset_prefix_cache()``: drops vLLM's own prefix cache, so the next prompt can only hit the connector (runs
  one-token steps until vLLM agrees: blocks of finished requests whose saves completed are freed on a step).
- ``wait_saves(timeout)``: with a kvstore connector and ``stats_path``, until its worker has no save in flight.
- ``worker_stats()`` / ``scheduler_stats()``: the connector's counters (``stats.StatsFile``).
- ``close()``: asks the engine to exit, then kills it if it does not; then removes what vLLM leaves behind: its
  ZeroMQ socket files, and with ``tensor_parallel`` > 1 the shared-memory files of its CPU ranks
  (``/dev/shm/vllm_dist_*cpushm*``: 3 x 4 MiB an engine of three ranks, never unlinked by vLLM 0.32), the ones
  that appeared while this engine ran.

``EngineSpec.connector``: ``None`` (no connector), ``"kvstore"`` (``KVStoreConnector``), ``"example"``
(vLLM's ``ExampleConnector``; ``extra`` then holds ``shared_storage_path``) or ``"nixl"`` (vLLM's
``NixlConnector`` on the CPU; ``env`` sets its ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``PORT``, one port an engine). ``mp`` sets
``VLLM_ENABLE_V1_MULTIPROCESSING``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from kvstore.integrations.vllm.stats import read_stats, stats_files

MARK = "@@kvstore-engine@@ "
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class EngineSpec:
    model: str
    connector: str | None = None
    role: str = "kv_both"
    extra: dict[str, Any] = field(default_factory=dict)
    mp: bool = False
    block_size: int = 32
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    prefix_caching: bool = True
    seed: int = 0
    env: dict[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1  # workers (processes) sharing each layer's heads


class EngineError(RuntimeError):
    pass


SHM_DIR = "/dev/shm"


def rank_shm_files() -> set[str]:
    """The shared-memory files of vLLM's CPU ranks (``cpu_communicator``: ``<VLLM_DIST_IDENT>-...-cpushm_<rank>``)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("vllm_dist_") and "-cpushm" in n}
    except OSError:
        return set()


class EngineProcess:
    def __init__(self, spec: EngineSpec, *, start_timeout: float = 300.0):
        self.spec = spec
        # vLLM binds its ZeroMQ sockets as files under VLLM_RPC_BASE_PATH (/tmp) and leaves them behind when its
        # process ends: seven a start here. A directory of our own, removed by close(), unless the caller names one.
        own_rpc_dir = "VLLM_RPC_BASE_PATH" not in spec.env and "VLLM_RPC_BASE_PATH" not in os.environ
        self.rpc_dir = tempfile.mkdtemp(prefix="kvstore-vllm-") if own_rpc_dir else None
        env = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if spec.mp else "0",
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "TOKENIZERS_PARALLELISM": "false",
            **({"VLLM_RPC_BASE_PATH": self.rpc_dir} if self.rpc_dir else {}),
            **spec.env,
        }
        # vLLM's CPU ranks share memory through files it never unlinks: the ones new when this engine ends are its
        self._shm_before = rank_shm_files() if spec.tensor_parallel > 1 else None
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.integrations.vllm_engine", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self._log: deque[str] = deque(maxlen=200)
        self._replies: deque[dict[str, Any]] = deque()
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self._wait(start_timeout)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - started

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                with self._cond:
                    self._replies.append(json.loads(line[len(MARK) :]))
                    self._cond.notify_all()
            else:
                self._log.append(line.rstrip())
        with self._cond:
            self._cond.notify_all()

    def _wait(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._replies:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise EngineError(f"engine exited with {self.proc.returncode}:\n" + "\n".join(self._log))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError("engine did not answer in time:\n" + "\n".join(list(self._log)[-40:]))
                self._cond.wait(min(left, 1.0))
            reply = self._replies.popleft()
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply

    def call(self, op: str, timeout: float = 300.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._wait(timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 1,
        cache_salt: str | None = None,
        timeout: float = 300.0,
        ignore_eos: bool = True,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        return self.call(
            "generate", timeout, prompts=prompts, max_tokens=max_tokens, cache_salt=cache_salt, ignore_eos=ignore_eos,
            kv_transfer_params=kv_transfer_params,
        )  # fmt: skip

    def reset_prefix_cache(self) -> None:
        self.call("reset_prefix_cache")  # raises EngineError when vLLM could not drop it

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(list(self._log)[-n:])

    def _stats(self, which: int) -> dict[str, Any]:
        path = self.spec.extra.get("stats_path")
        return read_stats(stats_files(path)[which]) if path else {}

    def scheduler_stats(self) -> dict[str, Any]:
        return self._stats(0)

    def worker_stats(self) -> dict[str, Any]:
        return self._stats(1)

    def wait_saves(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.worker_stats()
            if stats.get("saves_in_flight", 0) == 0:
                return stats
            if time.monotonic() > deadline:
                raise EngineError(f"saves still in flight after {timeout} s: {stats}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
        if self._shm_before is not None:
            for name in rank_shm_files() - self._shm_before:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
            self._shm_before = None

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the engine process ----------------------------------------------------------------------------------
def _build(spec: EngineSpec) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if spec.connector == "kvstore":
        transfer = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role=cast(Any, spec.role),
            kv_connector_extra_config=spec.extra,
        )
    elif spec.connector == "example":
        transfer = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role=cast(Any, spec.role), kv_connector_extra_config=spec.extra
        )
    elif spec.connector == "nixl":  # vLLM's NixlConnector: the decode engine pulls the KV from the prefill engine
        transfer = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role=cast(Any, spec.role),
            kv_buffer_device="cpu",
            kv_connector_extra_config=spec.extra,
        )
    elif spec.connector is not None:
        raise ValueError(f"unknown connector {spec.connector!r}")
    return LLM(
        model=spec.model,
        block_size=spec.block_size,
        enforce_eager=True,
        max_model_len=spec.max_model_len,
        max_num_batched_tokens=spec.max_model_len,
        dtype="float32",
        seed=spec.seed,
        tensor_parallel_size=spec.tensor_parallel,
        enable_prefix_caching=spec.prefix_caching,
        kv_transfer_config=transfer,
        disable_log_stats=True,
    )


def _serve(spec: EngineSpec) -> None:
    from vllm import SamplingParams

    def reply(data: dict[str, Any]) -> None:
        sys.stdout.write(MARK + json.dumps(data) + "\n")
        sys.stdout.flush()

    llm = _build(spec)
    reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            if op == "generate":
                transfers = cmd.get("kv_transfer_params") or [None] * len(cmd["prompts"])
                if len(transfers) != len(cmd["prompts"]):
                    raise ValueError(f"{len(transfers)} kv_transfer_params for {len(cmd['prompts'])} prompts")
                params = [
                    SamplingParams(
                        max_tokens=int(cmd["max_tokens"]),
                        temperature=0.0,
                        ignore_eos=bool(cmd.get("ignore_eos", True)),
                        extra_args={"kv_transfer_params": t} if t else None,
                    )
                    for t in transfers
                ]
                salt = cmd.get("cache_salt")
                prompts = [{"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})} for p in cmd["prompts"]]
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                reply(
                    {
                        "seconds": seconds,
                        "outputs": [
                            {
                                "tokens": list(o.outputs[0].token_ids),
                                "cached": int(o.num_cached_tokens or 0),
                                "kv_transfer_params": o.kv_transfer_params,
                            }
                            for o in outs
                        ],
                    }
                )
            elif op == "reset_prefix_cache":
                # vLLM refuses while blocks are still held, e.g. by a finished request whose async save
                # completed after the engine's last step: the scheduler hears of it only on its next step,
                # so run tiny steps until it does.
                ok = bool(llm.reset_prefix_cache())
                for _ in range(50):
                    if ok:
                        break
                    llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
                    time.sleep(0.02)
                    ok = bool(llm.reset_prefix_cache())
                reply({"ok": True} if ok else {"error": "vLLM would not reset its prefix cache"})
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as err:  # reported to the driver, which raises EngineError
            reply({"error": f"{type(err).__name__}: {err}"})
    del llm


if __name__ == "__main__":
    _serve(EngineSpec(**json.loads(sys.argv[1])))
