"""The request router of a disaggregated deployment, and a local stack to route to.

``Router(prefill, decode)`` sends a request down one of three paths and times
it from arrival to the first generated token (TTFT):

- ``disaggregated``: Prefill on the prefill worker (which stores the prompt's
  blocks), then Generate on the decode worker, which fetches them;
- ``recompute``: Generate alone with ``use_store=False`` (the baseline);
- ``store``: Generate alone with store lookups (multi-turn reuse: an earlier
  turn already stored the shared prefix).

``local_stack(model)`` starts a store, a prefill worker and a decode worker as
subprocesses on loopback ports (the embedded default) and yields their addresses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.free_port import free_port
from kvstore.server.process import ROOT, store_process
from kvstore.v1 import workers_pb2 as wpb
from kvstore.v1 import workers_pb2_grpc as wpb_grpc

MODES = ("disaggregated", "recompute", "store")


@dataclass
class Result:
    mode: str
    prompt_tokens: int
    cached_blocks: int
    ttft_s: float
    total_s: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    tpot_s: float = 0.0
    transfer_bytes: int = 0
    recomputed: bool = False
    prefill_s: float = 0.0
    prefill_cached_blocks: int = 0  # disaggregated: blocks the prefill worker found in the store
    lookup_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    arrived_s: float = 0.0


class Router:
    def __init__(self, prefill: str | None, decode: str, timeout: float = 600.0):
        opts = [("grpc.max_receive_message_length", 64 << 20)]
        self._channels = [grpc.insecure_channel(decode, options=opts)]
        self.decode = wpb_grpc.DecodeServiceStub(self._channels[0])
        self.prefill = None
        if prefill:
            self._channels.append(grpc.insecure_channel(prefill, options=opts))
            self.prefill = wpb_grpc.PrefillServiceStub(self._channels[1])
        self.timeout = timeout

    def run(self, mode: str, prompt: Sequence[int] | str, namespace: str, max_new_tokens: int) -> Result:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        msg = (
            wpb.Prompt(text=prompt, chat=False)
            if isinstance(prompt, str)
            else wpb.Prompt(tokens=wpb.TokenIds(ids=list(prompt)))
        )
        start = time.perf_counter()
        prefill_s, prefill_cached = 0.0, 0
        if mode == "disaggregated":
            if self.prefill is None:
                raise ValueError("disaggregated mode needs a prefill worker")
            reply = self.prefill.Prefill(wpb.PrefillRequest(prompt=msg, namespace=namespace), timeout=self.timeout)
            prefill_s, prefill_cached = time.perf_counter() - start, reply.cached_blocks
        stream = self.decode.Generate(
            wpb.GenerateRequest(
                prompt=msg, namespace=namespace, max_new_tokens=max_new_tokens, use_store=mode != "recompute"
            ),
            timeout=self.timeout,
        )
        tokens: list[int] = []
        text: list[str] = []
        first: wpb.GenerateReply | None = None
        ttft = 0.0
        for reply in stream:
            if first is None:
                first, ttft = reply, time.perf_counter() - start
            tokens.extend(reply.token_ids)
            text.append(reply.text)
        total = time.perf_counter() - start
        assert first is not None
        t = first.timings
        return Result(
            mode=mode,
            prompt_tokens=first.prompt_tokens,
            cached_blocks=first.cached_blocks,
            ttft_s=ttft,
            total_s=total,
            tokens=tokens,
            text="".join(text),
            tpot_s=(total - ttft) / max(1, len(tokens) - 1),
            transfer_bytes=first.transfer_bytes,
            recomputed=first.recomputed,
            prefill_s=prefill_s,
            prefill_cached_blocks=prefill_cached,
            lookup_s=t.lookup_s,
            transfer_s=t.transfer_s,
            load_s=t.load_s,
            compute_s=t.compute_s,
        )

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


def _wait_healthy(target: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                cmd = " ".join(map(str, proc.args)) if isinstance(proc.args, list) else str(proc.args)
                raise RuntimeError(f"{cmd} exited with {proc.returncode}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} did not become healthy")
            time.sleep(0.3)


@contextmanager
def worker_process(module: str, store: str, model: str, *extra: str, timeout: float = 300.0) -> Iterator[str]:
    target = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "--listen",
            target,
            "--store",
            store,
            "--model",
            model,
            "--log-level",
            "warning",
            *extra,
        ],
        cwd=ROOT,
        env=dict(os.environ),
    )
    try:
        _wait_healthy(target, proc, timeout)
        yield target
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def local_stack(
    model: str = "smollm2",
    dram: str = "2GiB",
    pool_blocks: int = 2048,
    store_args: Sequence[str] = (),
    worker_args: Sequence[str] = (),
) -> Iterator[tuple[str, str, str]]:
    """(store, prefill, decode) addresses of a store and two workers on loopback ports; ``worker_args`` go to
    both workers."""
    with ExitStack() as stack:
        store, _ = stack.enter_context(store_process("--dram", dram, *store_args))
        flags = ("--pool-blocks", str(pool_blocks), *worker_args)
        prefill = stack.enter_context(worker_process("prefill_node", store, model, *flags))
        decode = stack.enter_context(worker_process("decode_node", store, model, *flags))
        yield store, prefill, decode
