"""`python -m decode_node --listen 0.0.0.0:7090 --store HOST:PORT --model smollm2`."""

from __future__ import annotations

import sys

from decode_node.engine import DecodeEngine
from decode_node.service import DecodeServicer
from kvstore import logs
from kvstore.model.store_link import StoreLink
from kvstore.model.worker import load, parse_args, serve
from kvstore.v1 import workers_pb2_grpc as wpb_grpc


def main(argv: list[str] | None = None) -> int:
    args = parse_args("decode_node", "127.0.0.1:7090", argv)
    logs.configure(args.log_level)
    model, tokenizer = load(args.model)
    link = StoreLink(model, args.store, token=args.token, shared_pool=args.shared_pool)
    engine = DecodeEngine(model, tokenizer, link, pool_blocks=args.pool_blocks)

    def stop() -> None:
        engine.close()
        link.close()

    serve(
        args.listen,
        lambda s: wpb_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(engine), s),
        "kvstore.v1.DecodeService",
        on_stop=stop,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
