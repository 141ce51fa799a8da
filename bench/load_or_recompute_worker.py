"""The processes of ``bench.load_or_recompute``: the decode worker that is measured, and background clients.

``python -m bench.load_or_recompute_worker --model smollm2`` reads one JSON
command per line on stdin and answers each with one line ``@@ {json}`` on
stdout (anything else it prints is log):

- ``{"op": "connect", "target", "lane"}``: a fresh StoreLink (its own Planner,
  whose load-cost model starts from priors; the compute-cost model is the
  worker's and carries over) and a DecodeEngine on it.
- ``{"op": "populate", "tokens"}``: computes the KV of the first ``tokens``
  tokens of the base text and Puts its full blocks (the reused prefix), and
  writes their hashes to a file for background clients (``hashes_file``).
- ``{"op": "run", "regime", "lengths", "reps", "modes", "fast_reps", "fast_s", "warmup"}``:
  untimed requests in the ``warmup`` modes at the shortest length, then ``reps`` interleaved rounds of every (prompt length,
  mode), plus rounds up to ``fast_reps`` for cases under ``fast_s`` seconds
  (short TTFTs are noisy); returns every trial.
- ``{"op": "quit"}``.

A prompt of length L is the base text's first L - 32 tokens (the cached
prefix, which every prompt shares) and 32 tokens of its own. Modes are the
link policies ``load``, ``recompute``, ``decide``, and ``decide_serial``
(decide without overlap: only a leading prefix may be loaded, nothing
computed meanwhile), which measures what the overlap saves.

``--background TARGET --hashes FILE``: a client that Gets random 16-block
windows of the prefix in a loop until killed (the "loaded" regime).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kvstore.model import ByteBPETokenizer

SUFFIX_TOKENS = 32
NAMESPACE = "lor"
PUT_BLOCKS = 32


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    def __init__(self, model_name: str):
        from kvstore.loadplan import ComputeCosts
        from kvstore.model import load_model
        from kvstore.model.real_kv import english_tokens

        self.model, self.tok = load_model(model_name)
        vocab = self.model.config.vocab
        self.text: Callable[[int, int], list[int]]
        if self.tok is None:
            self.text = lambda n, seed: [random.Random(seed * 7919 + i).randrange(10, vocab) for i in range(n)]
        else:
            self.text = lambda n, seed: english_tokens(cast("ByteBPETokenizer", self.tok), n, seed=seed)
        self.base: list[int] = []
        self.compute = ComputeCosts()
        self.link: Any = None
        self.engine: Any = None

    def connect(self, target: str, lane: str) -> dict[str, Any]:
        from decode_node.engine import DecodeEngine
        from kvstore.loadplan import Planner
        from kvstore.model.store_link import StoreLink

        self.close()
        self.link = StoreLink(self.model, target, lane=lane, planner=Planner(compute=self.compute), timeout=600)
        self.engine = DecodeEngine(self.model, self.tok, self.link, pool_blocks=600, max_batch=1)
        return {"lane": lane}

    def populate(self, tokens: int) -> dict[str, Any]:
        self.base = self.text(tokens, 1)
        model, link = self.model, self.link
        pool = model.new_pool(len(self.base) // model.config.block_size + 2)
        pool.add_sequence(0)
        model.prefill(pool, 0, self.base, logits="none", chunk_size=512)
        hashes = link.prompt_hashes(self.base, NAMESPACE)
        payloads = pool.sequence_payloads(0, 0, len(hashes))
        for lo in range(0, len(hashes), PUT_BLOCKS):
            hi = min(lo + PUT_BLOCKS, len(hashes))
            results = link.client.put(
                NAMESPACE, hashes[lo:hi], payloads[lo:hi], parent=hashes[lo - 1] if lo else None, dtype="float32"
            )
            if not all(r.ok for r in results):
                raise RuntimeError(f"put failed: {[r for r in results if not r.ok][:1]}")
        with tempfile.NamedTemporaryFile("w", suffix=".hashes", delete=False) as f:
            f.write("\n".join(h.hex() for h in hashes))
        return {"blocks": len(hashes), "block_bytes": pool.block_nbytes, "hashes_file": f.name}

    def prompt(self, length: int, rep: int) -> list[int]:
        return self.base[: length - SUFFIX_TOKENS] + self.text(SUFFIX_TOKENS, 1000 + 37 * rep + length)

    def trial(self, length: int, rep: int, mode: str) -> dict[str, Any]:
        from decode_node.engine import Request

        prompt = self.prompt(length, rep)
        policy, overlap = ("decide", False) if mode == "decide_serial" else (mode, None)
        req = Request(prompt, NAMESPACE, 1, True, policy=policy, overlap=overlap)
        began = time.perf_counter()
        self.engine.submit(req)
        stream = req.stream()
        token, first = next(stream)
        ttft = time.perf_counter() - began
        for _ in stream:
            pass
        assert first is not None
        return {
            "prompt_tokens": length,
            "mode": mode,
            "rep": rep,
            "ttft_s": ttft,
            "predicted_s": first.predicted_s,
            "choice": first.plan,
            "loaded_blocks": first.cached_blocks,
            "head_blocks": first.head_blocks,
            "failed": first.recomputed,
            "token": token,
        }

    def run(
        self,
        regime: str,
        lengths: list[int],
        reps: int,
        modes: list[str],
        fast_reps: int,
        fast_s: float,
        warmup: list[str],
    ) -> dict[str, Any]:
        n, tiers = self.link.client.lookup_tiers(NAMESPACE, self.link.prompt_hashes(self.base, NAMESPACE))
        for mode in warmup:  # untimed: the planner sees this regime before the measured requests
            self.trial(lengths[0], -1, mode)
        trials = [self.trial(length, rep, mode) for rep in range(reps) for length in lengths for mode in modes]
        fast = {(t["prompt_tokens"], t["mode"]) for t in trials if t["rep"] == 0 and t["ttft_s"] < fast_s}
        # load, decide and decide_serial are compared with each other: any of them fast at a length gives all
        # three the extra rounds (unequal rounds let one mode's p50 come from a quieter stretch of the run)
        paired = ("load", "decide", "decide_serial")
        fast |= {(n, m) for n, f in list(fast) if f in paired for m in paired if m in modes}
        for rep in range(reps, fast_reps):
            trials += [self.trial(length, rep, mode) for length in lengths for mode in modes if (length, mode) in fast]
        return {
            "regime": regime,
            "trials": trials,
            "cached_blocks": n,
            "tiers": {t: tiers.count(t) for t in set(tiers)},
            "planner": self.link.planner.snapshot(),
            "history": self.link.planner.history()[-64:],
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.link.close()
            self.engine = self.link = None


def background(target: str, hashes_file: str) -> None:
    from kvstore.client import Client

    hashes = [bytes.fromhex(h) for h in open(hashes_file).read().split()]
    rng = random.Random()
    with Client(target, lane="shm", timeout=600) as kv:
        while True:
            lo = rng.randrange(0, max(len(hashes) - 16, 1))
            kv.get(NAMESPACE, hashes[lo : lo + 16])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--background", default=None, metavar="TARGET")
    p.add_argument("--hashes", default=None)
    args = p.parse_args(argv)
    if args.background:
        background(args.background, args.hashes)
        return 0
    worker = Worker(args.model)
    _say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            _say(getattr(worker, op)(**cmd))
        except Exception as err:  # noqa: BLE001 - reported to the parent, which stops the run
            import traceback

            traceback.print_exc()
            _say({"error": f"{op}: {err!r}"})
    worker.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
