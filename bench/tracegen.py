"""bench.tracegen: synthetic KV-cache traces in the Mooncake FAST'25 format, deterministic by seed.

    python -m bench.tracegen --kind sessions --seed 1 --requests 8000 --out /tmp/sessions.jsonl

Each line is ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``
with 512 tokens per block, as in ``../shared/traces``: equal ids at the same
position are a reusable prefix. Ids name a node of one prefix tree (a block
*and* everything before it), so two requests share id k at position i only
when their first i+1 blocks are the same tokens. A request's last, partial
block gets an id of its own (a partial block is never reusable).

Verbs:
- ``generate(kind, seed, requests) -> list[dict]``: the same arguments give the
  same trace, byte for byte (one ``random.Random(seed)`` drives everything);
- ``write_trace(rows, path)`` one JSON object per line;
- ``KINDS``: name -> one-line claim of its reuse structure (tests/test_tracegen.py
  measures each claim).

Kinds (every one is a superposition of *processes* started by a Poisson clock,
each yielding its requests with think times in between):
- ``sessions``: long multi-turn chats over a few shared system prompts (Zipf
  popularity); each turn re-sends the whole history plus a new message;
- ``documents``: one-shot documents behind a few instruction prompts; most
  documents are seen once, a fifth of the requests ask about a recent one again;
- ``agents``: tool-agent loops: a large shared tool prompt, then tens of quick
  steps each appending an action and a tool result;
- ``mixture``: the three above at once (chat 50%, documents 30%, agents 20% of
  processes);
- ``shifting``: questions over a corpus of documents whose popularity (Zipf
  over a ranking) is reshuffled in part every eighth of the trace.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from bench.common import positive

TOKENS_PER_BLOCK = 512

KINDS: dict[str, str] = {
    "sessions": "multi-turn chats over shared system prompts: most blocks reused, by the next turn",
    "documents": "one-shot documents: most blocks used once",
    "agents": "tool-agent loops: a shared tool prompt, many quick steps, short reuse distance",
    "mixture": "chats, documents and agents at once",
    "shifting": "a document corpus whose popularity shifts every eighth of the trace",
}

Process = Iterator[tuple[float, list[int], int, int]]  # yields (delay s before it, ids, input, output)
Pending = tuple[float, int, Process, tuple[list[int], int, int]]  # (when, order, process, its next request)


class PrefixTree:
    """Block ids: a node per (parent id, content key); content never seen before gets a fresh id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Any], int] = {}
        self._next = itertools.count()

    def fresh(self) -> int:
        return next(self._next)

    def child(self, parent: int, content: Any) -> int:
        key = (parent, content)
        node = self._ids.get(key)
        if node is None:
            node = self._ids[key] = self.fresh()
        return node


@dataclass
class Context:
    """A token sequence as full blocks (ids) plus a partial tail of ``tail`` tokens."""

    tree: PrefixTree
    blocks: list[int] = field(default_factory=list)
    tail: int = 0

    def extend_shared(self, content: Any, tokens: int) -> None:
        """Append tokens that other contexts with the same prefix also hold (a shared prompt or document)."""
        assert self.tail == 0, "shared content starts on a block boundary"
        parent = self.blocks[-1] if self.blocks else -1
        for i in range(tokens // TOKENS_PER_BLOCK):
            parent = self.tree.child(parent, (content, i))
            self.blocks.append(parent)
        self.tail = tokens % TOKENS_PER_BLOCK

    def extend_private(self, tokens: int) -> None:
        """Append tokens no other context holds: each block they complete is new."""
        self.tail += tokens
        while self.tail >= TOKENS_PER_BLOCK:
            self.blocks.append(self.tree.fresh())
            self.tail -= TOKENS_PER_BLOCK

    def request(self) -> tuple[list[int], int]:
        """The hash ids and input length of a request that sends this context."""
        ids = list(self.blocks)
        if self.tail:
            ids.append(self.tree.fresh())
        return ids, len(self.blocks) * TOKENS_PER_BLOCK + self.tail


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), low), high))


def _zipf(rng: random.Random, n: int, s: float) -> int:
    """An index in [0, n) with P(i) proportional to 1 / (i + 1)^s."""
    weights = _zipf_weights(n, s)
    return rng.choices(range(n), cum_weights=weights)[0]


_ZIPF: dict[tuple[int, float], list[float]] = {}


def _zipf_weights(n: int, s: float) -> list[float]:
    if (n, s) not in _ZIPF:
        _ZIPF[(n, s)] = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))
    return _ZIPF[(n, s)]


# -- processes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompts:
    """A few shared prompts: their token lengths, drawn once per trace."""

    lengths: tuple[int, ...]
    zipf: float = 1.1

    @classmethod
    def draw(cls, rng: random.Random, n: int, median: int, high: int) -> Prompts:
        # whole blocks, so the prompt's blocks are shared and what follows starts a new block
        return cls(
            tuple(
                TOKENS_PER_BLOCK * max(1, _lognormal(rng, median, 0.6, 512, high) // TOKENS_PER_BLOCK) for _ in range(n)
            )
        )

    def pick(self, rng: random.Random) -> int:
        return _zipf(rng, len(self.lengths), self.zipf)


def chat(rng: random.Random, tree: PrefixTree, prompts: Prompts, tag: str) -> Process:
    """A multi-turn conversation: system prompt, then turns of (message, answer), history re-sent each turn."""
    ctx = Context(tree)
    p = prompts.pick(rng)
    ctx.extend_shared((tag, p), prompts.lengths[p])
    turns = 1 + int(rng.expovariate(1 / 7.0))
    delay = 0.0
    for _ in range(turns):
        ctx.extend_private(_lognormal(rng, 250, 1.0, 10, 6000))
        ids, length = ctx.request()
        out = _lognormal(rng, 300, 0.7, 5, 2000)
        yield delay, ids, length, out
        ctx.extend_private(out)
        # reading and typing (long-tailed: some users come back much later), plus decoding the answer
        delay = _lognormal(rng, 30, 1.5, 2, 3600) + out / 50.0


def document(rng: random.Random, tree: PrefixTree, prompts: Prompts, recent: list[int]) -> Process:
    """One document behind an instruction prompt; 20% of the requests ask about a recent document again."""
    ctx = Context(tree)
    p = prompts.pick(rng)
    ctx.extend_shared(("instr", p), prompts.lengths[p])
    if recent and rng.random() < 0.2:
        doc = recent[-1 - min(int(rng.expovariate(1 / 60.0)), len(recent) - 1)]
    else:
        doc = tree.fresh()  # a document id nobody else has
        recent.append(doc)
        del recent[:-2000]
    ctx.tail = 0
    ctx.extend_shared(("doc", doc), _doc_tokens(doc))
    ctx.extend_private(_lognormal(rng, 60, 0.8, 5, 500))  # the question
    ids, length = ctx.request()
    yield 0.0, ids, length, _lognormal(rng, 200, 0.7, 5, 2000)


def _doc_tokens(doc: int) -> int:
    """A document's length, a function of its id so a re-asked document is the same tokens."""
    return _lognormal(random.Random(doc * 7919 + 17), 5000, 0.8, 600, 60000)


def agent(rng: random.Random, tree: PrefixTree, prompts: Prompts) -> Process:
    """A tool-agent loop: tool prompt, task, then steps of (action, tool result) re-sent every step."""
    ctx = Context(tree)
    p = prompts.pick(rng)
    ctx.extend_shared(("tools", p), prompts.lengths[p])
    ctx.extend_private(_lognormal(rng, 400, 0.8, 20, 4000))  # the task
    steps = 3 + int(rng.expovariate(1 / 10.0))
    delay = 0.0
    for _ in range(steps):
        ids, length = ctx.request()
        out = _lognormal(rng, 120, 0.6, 5, 1000)
        yield delay, ids, length, out
        ctx.extend_private(out + _lognormal(rng, 400, 1.0, 10, 8000))  # the action, then the tool's result
        delay = _lognormal(rng, 3, 1.0, 0, 120) + out / 50.0  # the tool runs


def question(rng: random.Random, tree: PrefixTree, corpus: Shifting) -> Process:
    ctx = Context(tree)
    doc = corpus.pick(rng)
    ctx.extend_shared(("corpus", doc), corpus.tokens[doc])
    ctx.extend_private(_lognormal(rng, 80, 0.8, 5, 800))
    ids, length = ctx.request()
    yield 0.0, ids, length, _lognormal(rng, 200, 0.7, 5, 2000)


@dataclass
class Shifting:
    """A corpus whose popularity ranking is partly reshuffled at every ``shift()``."""

    tokens: list[int]
    ranking: list[int]
    zipf: float = 0.9

    @classmethod
    def draw(cls, rng: random.Random, n: int) -> Shifting:
        tokens = [
            TOKENS_PER_BLOCK * max(1, _lognormal(rng, 6000, 0.8, 512, 40000) // TOKENS_PER_BLOCK) for _ in range(n)
        ]
        ranking = list(range(n))
        rng.shuffle(ranking)
        return cls(tokens, ranking)

    def pick(self, rng: random.Random) -> int:
        return self.ranking[_zipf(rng, len(self.ranking), self.zipf)]

    def shift(self, rng: random.Random) -> None:
        """The hottest fifth retires to the cold end; cold documents take their places."""
        n = len(self.ranking)
        hot = self.ranking[: n // 5]
        rest = self.ranking[n // 5 :]
        rng.shuffle(rest)
        self.ranking = rest + hot


# -- the clock -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mix:
    """Which processes start, how often (per second) and with what weight."""

    rate: float
    makers: tuple[tuple[float, Callable[[random.Random], Process]], ...]
    on_tick: Callable[[random.Random, int], None] | None = None  # called with each request count


def _mix(kind: str, rng: random.Random, tree: PrefixTree, requests: int) -> Mix:
    chats = Prompts.draw(rng, 24, 1500, 12000)
    instr = Prompts.draw(rng, 6, 700, 3000)
    tools = Prompts.draw(rng, 4, 5000, 16000)
    recent: list[int] = []
    chat_mk = (1.0, lambda r: chat(r, tree, chats, "sys"))
    doc_mk = (1.0, lambda r: document(r, tree, instr, recent))
    agent_mk = (1.0, lambda r: agent(r, tree, tools))
    if kind == "sessions":
        return Mix(0.8, (chat_mk,))
    if kind == "documents":
        return Mix(4.0, (doc_mk,))
    if kind == "agents":
        return Mix(0.6, (agent_mk,))
    if kind == "mixture":
        return Mix(1.5, ((0.5, chat_mk[1]), (0.3, doc_mk[1]), (0.2, agent_mk[1])))
    if kind == "shifting":
        corpus = Shifting.draw(rng, 600)
        phase = max(requests // 8, 1)

        def tick(r: random.Random, done: int) -> None:
            if done and done % phase == 0:
                corpus.shift(r)

        return Mix(4.0, ((1.0, lambda r: question(r, tree, corpus)),), tick)
    raise ValueError(f"unknown trace kind {kind!r}; choose one of {', '.join(KINDS)}")


def generate(kind: str, seed: int, requests: int) -> list[dict[str, int | list[int]]]:
    """``requests`` requests of trace ``kind``, in arrival order; deterministic in (kind, seed, requests)."""
    if requests < 1:
        raise ValueError("requests must be >= 1")
    rng = random.Random(f"{kind}:{seed}")
    tree = PrefixTree()
    mix = _mix(kind, rng, tree, requests)
    weights = list(itertools.accumulate(w for w, _ in mix.makers))
    queue: list[Pending] = []
    order = itertools.count()
    rows: list[dict[str, int | list[int]]] = []
    next_start = 0.0
    while len(rows) < requests:
        if not queue or next_start <= queue[0][0]:
            maker = mix.makers[rng.choices(range(len(mix.makers)), cum_weights=weights)[0]][1]
            _advance(queue, next_start, next(order), maker(rng))
            next_start += rng.expovariate(mix.rate)
            continue
        when, _, process, (ids, length, out) = heapq.heappop(queue)
        rows.append({"timestamp": int(when * 1000), "input_length": length, "output_length": out, "hash_ids": ids})
        if mix.on_tick is not None:
            mix.on_tick(rng, len(rows))
        _advance(queue, when, next(order), process)
    return rows


def _advance(queue: list[Pending], now: float, order: int, process: Process) -> None:
    """Queue the process's next request (drawn now, so draws stay in a deterministic order)."""
    step = next(process, None)
    if step is None:
        return
    delay, ids, length, out = step
    heapq.heappush(queue, (now + delay, order, process, (ids, length, out)))


def write_trace(rows: Sequence[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic Mooncake-format KV-cache trace")
    parser.add_argument("--kind", choices=tuple(KINDS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=positive(int), default=8000)
    parser.add_argument("--out", type=Path, required=True, metavar="FILE.jsonl")
    args = parser.parse_args(argv)
    rows = generate(args.kind, args.seed, args.requests)
    write_trace(rows, args.out)
    blocks = sum(len(cast("list[int]", r["hash_ids"])) for r in rows)  # generate's rows: hash_ids is the list
    distinct = len({b for r in rows for b in cast("list[int]", r["hash_ids"])})
    print(f"{args.kind} seed {args.seed}: {len(rows)} requests, {blocks} blocks, {distinct} distinct -> {args.out}")


if __name__ == "__main__":
    main()
