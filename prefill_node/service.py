"""PrefillService: hash the prompt, fetch its cached prefix, compute the rest in chunks, Put new blocks.

How much of the cached prefix to fetch is the load planner's call
(``kvstore.model.planned``); blocks the store already holds are not Put
again, whether they were loaded or recomputed.

Chunked prefill overlaps transfer with compute: when a chunk of the prompt has
been computed, its newly completed full blocks are handed to a background
uploader (``BlockUploader``) while the model computes the next chunk. The reply
comes after every Put has been acknowledged, so a decode worker that sees the
reply finds the blocks in the store.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from kvstore.model import ByteBPETokenizer, LlamaModel, OutOfBlocks, PagedKVPool, pool_nbytes
from kvstore.model.planned import prefill_planned
from kvstore.model.store_link import BlockUploader, StoreLink
from kvstore.model.worker import prompt_tokens
from kvstore.server import validate
from kvstore.v1 import workers_pb2 as wpb
from kvstore.v1 import workers_pb2_grpc as wpb_grpc

log = logging.getLogger(__name__)


class PrefillServicer(wpb_grpc.PrefillServiceServicer):
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: ByteBPETokenizer | None,
        link: StoreLink,
        *,
        pool_blocks: int = 2048,
        chunk_tokens: int = 512,
    ):
        self.model, self.tokenizer, self.link = model, tokenizer, link
        self.block_size = model.config.block_size
        self.chunk = max(self.block_size, chunk_tokens // self.block_size * self.block_size)
        link.connect()  # the lane opens now, not inside the first request's fetch
        self.pool = PagedKVPool(
            model.config, pool_blocks, memory=link.pool_memory(pool_nbytes(model.config, pool_blocks)), prefault=True
        )
        self._lock = threading.Lock()  # one prompt at a time: the CPU is the bottleneck anyway
        self._ids = itertools.count()

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillReply:
        try:
            ns = validate.namespace(request.namespace)
            tokens = prompt_tokens(request.prompt, self.tokenizer, self.model.config.vocab)
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if not tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        with self._lock:
            try:
                return self._prefill(tokens, ns)
            except OutOfBlocks as err:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prompt does not fit the KV pool: {err}")

    def _prefill(self, tokens: list[int], ns: str) -> wpb.PrefillReply:
        t0 = time.perf_counter()
        seq = next(self._ids)
        bs = self.block_size
        hashes = self.link.prompt_hashes(tokens, ns)
        self.pool.add_sequence(seq)
        compute_s = 0.0

        def tail(start: int, store_holds: int) -> None:
            nonlocal compute_s
            stored_upto = store_holds
            for lo in range(start, len(tokens), self.chunk):
                c0 = time.perf_counter()
                self.model.prefill(self.pool, seq, tokens[lo : lo + self.chunk], logits="none")
                compute_s += time.perf_counter() - c0
                full = min(len(hashes), (lo + self.chunk) // bs)
                if full > stored_upto:
                    uploader.submit(
                        hashes[stored_upto:full],
                        self.pool.sequence_payloads(seq, stored_upto, full),
                        hashes[stored_upto - 1] if stored_upto else None,
                    )
                    stored_upto = full

        uploader = BlockUploader(self.link, self.pool, ns)
        try:
            fetched = prefill_planned(
                self.link,
                self.model,
                self.pool,
                seq,
                tokens,
                ns,
                hashes,
                max_blocks=len(hashes),
                tail=tail,
                chunk_tokens=self.chunk,
                started=t0,
            )
            wait_s = uploader.finish()
        finally:
            self.pool.free_sequence(seq)
        total = time.perf_counter() - t0
        return wpb.PrefillReply(
            hashes=hashes,
            prompt_tokens=len(tokens),
            cached_blocks=fetched.loaded,
            computed_tokens=len(tokens) - fetched.loaded * bs,
            stored_blocks=uploader.stored,
            transfer_bytes=fetched.bytes + uploader.bytes,
            timings=wpb.Timings(
                lookup_s=fetched.lookup_s,
                transfer_s=fetched.load_s + wait_s,
                load_s=0.0,
                compute_s=compute_s + fetched.head_s,
                total_s=total,
            ),
        )
