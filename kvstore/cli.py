"""`kvstore` command line: serve, health, stats, demo.

    kvstore serve --listen 127.0.0.1:7070 --dram 2GiB [--nvme-dir /data --nvme 100GiB]
    kvstore health --target 127.0.0.1:7070      # exit 0 only when SERVING
    kvstore stats --target 127.0.0.1:7070 [--json]
    kvstore demo                                 # embedded store + put/get throughput
    kvstore export-model smollm2 DIR             # the bundled SmolLM2 as a local Hugging Face directory

A serving node dumps every thread's stack to stderr on SIGUSR1 (a hung drain, a stuck stream).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from kvstore import config, logs


def _serve(args: argparse.Namespace) -> int:
    cfg = config.load(args)
    logs.configure(cfg.log_level)
    from kvstore.server import stacks

    stacks.install(signal.SIGUSR1)  # `kill -USR1 <pid>`: every thread's stack to stderr
    from kvstore.server.app import StoreServer
    from kvstore.server.ports import preflight

    preflight(cfg)  # a port that cannot be bound: one line naming its flag (main), before the store is built
    StoreServer(cfg).serve_forever()
    # Everything is flushed and closed. Leave without the interpreter's finalization, which daemon threads (the
    # kernels' warm-up, still compiling in a store stopped early, and its log lines) can turn into an abort:
    # "could not acquire lock for <stderr> at interpreter shutdown, possibly due to daemon threads" ends the
    # process with SIGABRT (a store stopped two seconds after its start exited -6, once, on CI).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with (
            grpc.insecure_channel(args.target)
            if not args.tls_ca
            else grpc.secure_channel(
                args.target, grpc.ssl_channel_credentials(open(args.tls_ca, "rb").read())
            ) as channel
        ):
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as err:
        print(f"{args.target}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _stats(args: argparse.Namespace) -> int:
    from kvstore.client import Client, KVStoreError

    try:
        with Client(args.target, token=args.token, tls_ca=args.tls_ca, timeout=args.timeout) as client:
            stats = client.stats()
    except KVStoreError as err:
        print(f"{args.target}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    from kvstore.sizes import format_size

    print(
        f"node {stats.get('node_id', '')}: {stats.get('blocks', 0)} blocks, "
        f"{stats.get('lookups', 0)} lookups of {stats.get('lookup_hits', 0) + stats.get('lookup_misses', 0)} hashes "
        f"({stats.get('lookup_hits', 0)} hit, {stats.get('lookup_misses', 0)} missed)"
    )
    print(f"{'tier':6} {'used':>10} {'capacity':>10} {'blocks':>8} {'hits':>8} {'evictions':>9}  backend")
    for t in stats.get("tiers", []):
        print(
            f"{t['name']:6} {format_size(int(t['used_bytes'])):>10} {format_size(int(t['capacity_bytes'])):>10} "
            f"{int(t['blocks']):>8} {int(t['hits']):>8} {int(t['evictions']):>9}  {t['backend']}"
            + ("  DEGRADED: " + t["fault"] if t.get("degraded") else "")
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvstore.demo import main as demo_main

    return demo_main(args.rest)


def _export_model(args: argparse.Namespace) -> int:
    from kvstore.model.hf_export import export_model

    result = export_model(args.model, args.dest, dtype=args.dtype)
    print(f"{result.path}: {result.parameters:,} parameters, {result.weight_bytes:,} bytes of {result.dtype} weights")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore", description="Tiered KV-cache block store for disaggregated LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run a store node",
        description="Run a store node. Every option can also be given as env var KVSTORE_<OPTION> "
        "or as a key in the --config YAML file; flags win over env over file.",
    )
    config.add_arguments(serve)
    serve.set_defaults(func=_serve)

    for name, func, text in (
        ("health", _health, "exit 0 only when the node reports SERVING"),
        ("stats", _stats, "print a node's tiers and counters"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--target", default="127.0.0.1:7070", help="store address HOST:PORT (default: %(default)s)")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds (default: %(default)s)")
        p.add_argument("--tls-ca", default=None, help="CA bundle to verify a TLS server")
        if name == "health":
            p.add_argument("--service", default="", help="service name to check (default: the whole server)")
        else:
            p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
            p.add_argument("--token", default=None, help="tenant bearer token")
        p.set_defaults(func=func)

    demo = sub.add_parser("demo", help="start an embedded store and run the demo (see `kvstore demo -- --help`)")
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)

    export = sub.add_parser(
        "export-model", help="write a bundled model as a local Hugging Face directory (vLLM, transformers)"
    )
    export.add_argument("model", choices=["smollm2"], help="the model to write")
    export.add_argument("dest", help="directory to write (created if missing)")
    export.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype (default: %(default)s)",
    )
    export.set_defaults(func=_export_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # the demo parses its own options (argparse's REMAINDER misses a leading --flag)
        from kvstore.demo import main as demo_main

        return demo_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ValueError as err:
        print(f"kvstore: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path or device the options named (e.g. an --nvme-dir that cannot be made)
        print(f"kvstore: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
