"""DecodeService.Generate: stream tokens from the continuous-batching engine."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from decode_node.engine import DecodeEngine, Request
from kvstore.model.worker import prompt_tokens
from kvstore.server import validate
from kvstore.v1 import workers_pb2 as wpb
from kvstore.v1 import workers_pb2_grpc as wpb_grpc


class DecodeServicer(wpb_grpc.DecodeServiceServicer):
    def __init__(self, engine: DecodeEngine, max_new_tokens_limit: int = 4096):
        self.engine = engine
        self.limit = max_new_tokens_limit

    def Generate(self, request: wpb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[wpb.GenerateReply]:
        try:
            ns = validate.namespace(request.namespace)
            tokens = prompt_tokens(request.prompt, self.engine.tokenizer, self.engine.model.config.vocab)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not tokens or not 0 < request.max_new_tokens <= self.limit:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"need a non-empty prompt and 1 <= max_new_tokens <= {self.limit}"
            )
        req = self.engine.submit(Request(tokens, ns, request.max_new_tokens, request.use_store))
        tok = self.engine.tokenizer
        try:
            for token, first in req.stream():
                reply = wpb.GenerateReply(token_ids=[token], text=tok.decode([token]) if tok else "")
                if first is not None:
                    reply.first = True
                    reply.prompt_tokens = first.prompt_tokens
                    reply.cached_blocks = first.cached_blocks
                    reply.transfer_bytes = first.transfer_bytes
                    reply.recomputed = first.recomputed
                    reply.timings.CopyFrom(
                        wpb.Timings(
                            lookup_s=first.lookup_s,
                            transfer_s=first.transfer_s,
                            load_s=first.load_s,
                            compute_s=first.compute_s,
                            total_s=first.total_s,
                        )
                    )
                yield reply
        except RuntimeError as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
