"""Continuous-batching decode engine over a paged KV pool.

One engine thread owns the model and the pool. Each loop iteration first
admits waiting requests (Lookup + Get of the cached prefix straight into pool
blocks, then a prefill of only the uncached tail, which yields the first
token), then runs one batched decode step for every active sequence. A
sequence leaves the batch at a stop token or ``max_new_tokens`` and its blocks
are freed. How much of the cached prefix to load is the load planner's call
(``kvstore.model.planned``, issue 17: load, recompute, or compute the first
blocks while later ones load). If the store fails (unreachable, missing block,
bad checksum) the request keeps the leading blocks that arrived intact and
computes from there: it never decodes from wrong KV.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvstore.model import ByteBPETokenizer, LlamaModel, OutOfBlocks, PagedKVPool, pool_nbytes
from kvstore.model.planned import prefill_planned
from kvstore.model.store_link import StoreLink

log = logging.getLogger(__name__)


@dataclass
class FirstToken:
    """Facts attached to a request's first token: what was cached and where the time went."""

    prompt_tokens: int
    cached_blocks: int
    transfer_bytes: int
    recomputed: bool
    lookup_s: float
    transfer_s: float
    load_s: float
    compute_s: float
    total_s: float
    plan: str = ""  # the load planner's choice (kvstore.loadplan.CHOICES), "" without the store
    predicted_s: float = 0.0  # its predicted TTFT
    head_blocks: int = 0  # blocks computed while the load ran


@dataclass
class Request:
    tokens: list[int]
    namespace: str
    max_new_tokens: int
    use_store: bool
    policy: str | None = None  # "decide", "load" or "recompute"; None: the link's policy
    overlap: bool | None = None  # may compute early blocks while later ones load; None: the planner's default
    arrived: float = field(default_factory=time.perf_counter)
    events: queue.Queue[tuple[int | None, FirstToken | None, str]] = field(default_factory=queue.Queue)

    def stream(self) -> Iterator[tuple[int, FirstToken | None]]:
        """Generated token ids, the first with its FirstToken facts; raises RuntimeError on failure."""
        while True:
            token, first, error = self.events.get()
            if error:
                raise RuntimeError(error)
            if token is None:
                return
            yield token, first


@dataclass
class _Active:
    req: Request
    seq: int
    last: int
    produced: int


class DecodeEngine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: ByteBPETokenizer | None,
        link: StoreLink,
        *,
        pool_blocks: int = 2048,
        max_batch: int = 16,
    ):
        self.model, self.tokenizer, self.link = model, tokenizer, link
        link.connect()  # the lane opens now, not inside the first request's fetch
        self.pool = PagedKVPool(
            model.config, pool_blocks, memory=link.pool_memory(pool_nbytes(model.config, pool_blocks)), prefault=True
        )
        self.stop_ids = set(tokenizer.stop_ids) if tokenizer is not None else set()
        self.max_batch = max_batch
        self._waiting: queue.Queue[Request | None] = queue.Queue()
        self._ids = itertools.count()
        self._active: list[_Active] = []
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._thread.start()

    def submit(self, req: Request) -> Request:
        self._waiting.put(req)
        return req

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(timeout=30)

    # -- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            block = not self._active
            while len(self._active) < self.max_batch:
                try:
                    req = self._waiting.get(block=block, timeout=None if block else 0)
                except queue.Empty:
                    break
                if req is None:
                    return
                block = False
                self._admit(req)
            if self._active:
                self._step()

    def _admit(self, req: Request) -> None:
        seq = next(self._ids)
        bs = self.model.config.block_size
        self.pool.add_sequence(seq)
        try:
            t0 = time.perf_counter()
            tail = lambda start, _: self.model.prefill(self.pool, seq, req.tokens[start:], logits="last")  # noqa: E731
            done = prefill_planned(
                self.link,
                self.model,
                self.pool,
                seq,
                req.tokens,
                req.namespace,
                self.link.prompt_hashes(req.tokens, req.namespace) if req.use_store else [],
                max_blocks=(len(req.tokens) - 1) // bs if req.use_store else 0,
                tail=tail,
                policy=req.policy,
                overlap=req.overlap,
                started=t0,
            )
            token = int(torch.argmax(done.result[-1]))
            first = FirstToken(
                prompt_tokens=len(req.tokens),
                cached_blocks=done.loaded,
                transfer_bytes=done.bytes,
                recomputed=bool(done.failed),
                lookup_s=done.lookup_s,
                transfer_s=done.load_s,
                load_s=0.0,  # received chunks land in the pool: the transfer includes the load
                compute_s=done.head_s + done.tail_s,
                total_s=time.perf_counter() - t0,
                plan=done.plan.choice if done.plan else "",
                predicted_s=done.plan.predicted_s if done.plan else 0.0,
                head_blocks=done.head_blocks,
            )
        except Exception as err:  # noqa: BLE001 - the engine thread must survive any one request
            log.exception("request failed at admission")
            self.pool.free_sequence(seq)
            req.events.put((None, None, f"cannot admit request: {err}"))
            return
        req.events.put((token, first, ""))
        active = _Active(req, seq, token, 1)
        if self._finished(active):
            self._retire(active)
        else:
            self._active.append(active)

    def _step(self) -> None:
        batch = self._active
        try:
            logits = self.model.decode(self.pool, [a.seq for a in batch], [a.last for a in batch])
        except Exception as err:  # noqa: BLE001 - fail this batch, keep serving
            why = f"KV pool exhausted: {err}" if isinstance(err, OutOfBlocks) else f"decode step failed: {err}"
            log.exception("decode step failed")
            for a in batch:
                a.req.events.put((None, None, why))
                self.pool.free_sequence(a.seq)
            self._active = []
            return
        tokens = torch.argmax(logits, dim=-1).tolist()
        still: list[_Active] = []
        for a, token in zip(batch, tokens):
            a.last, a.produced = int(token), a.produced + 1
            a.req.events.put((a.last, None, ""))
            if self._finished(a):
                self._retire(a)
            else:
                still.append(a)
        self._active = still

    def _finished(self, a: _Active) -> bool:
        return a.produced >= a.req.max_new_tokens or a.last in self.stop_ids

    def _retire(self, a: _Active) -> None:
        self.pool.free_sequence(a.seq)
        a.req.events.put((None, None, ""))
