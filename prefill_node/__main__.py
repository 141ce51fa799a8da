"""`python -m prefill_node --listen 0.0.0.0:7080 --store HOST:PORT --model smollm2`."""

from __future__ import annotations

import sys

from kvstore import logs
from kvstore.model.store_link import StoreLink
from kvstore.model.worker import load, parse_args, serve
from kvstore.v1 import workers_pb2_grpc as wpb_grpc
from prefill_node.service import PrefillServicer


def main(argv: list[str] | None = None) -> int:
    args = parse_args("prefill_node", "127.0.0.1:7080", argv)
    logs.configure(args.log_level)
    model, tokenizer = load(args.model)
    link = StoreLink(model, args.store, token=args.token, shared_pool=args.shared_pool)
    servicer = PrefillServicer(model, tokenizer, link, pool_blocks=args.pool_blocks, chunk_tokens=args.chunk_tokens)
    serve(
        args.listen,
        lambda s: wpb_grpc.add_PrefillServiceServicer_to_server(servicer, s),
        "kvstore.v1.PrefillService",
        on_stop=link.close,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
