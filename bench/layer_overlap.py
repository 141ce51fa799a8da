"""Would a layer-by-layer load hide a vLLM load behind the forward pass on this host's cores?

    python -m bench.layer_overlap [--quick] [--out FILE.json] [--megabytes 92] [--threads 2,1]

A load that copies layer ``l`` of every block while the forward pass runs layers below ``l`` (vLLM's
``wait_for_layer_load``) pays only where the copy runs beside the forward pass rather than in its place: on a
GPU the copy is the DMA engines' work, on a CPU host it takes cores the forward pass's OpenMP threads use.
This measures that with plain parts: a 30-layer decoder step of SmolLM2-135M's shapes (32 new tokens over a
2,048-token context, fp32, torch on ``threads`` OpenMP threads) and ``np.copyto`` of the prefix's KV bytes
(``--megabytes``: 92 is SmolLM2's 2k-token prefix), in three ways, each the median of ``reps``:

- ``forward_ms`` alone, ``copy_ms`` alone (the copy as one call);
- ``serial_ms``: the copy, then the forward pass (what a whole-prefix load before the step costs);
- ``layerwise_ms``: a helper thread copies the prefix one layer's share at a time, the forward pass waits for
  layer ``l``'s share before running layer ``l``.

``hidden``: the fraction of the copy the overlap took off (``(serial - layerwise) / copy``): 1 is all of it.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from bench.common import Row, parse_args, positive, report

LAYERS, TOKENS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD, CONTEXT = 30, 32, 576, 1536, 9, 3, 64, 2048


class Step:
    """A decoder step of SmolLM2-135M's shapes over a cached context (random weights: only the time counts)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        gen = torch.Generator().manual_seed(0)
        self.weights = [
            tuple(torch.randn(*shape, generator=gen) * 0.02 for shape in
                  ((HIDDEN, 3 * HIDDEN), (HIDDEN, 2 * FFN), (FFN, HIDDEN), (HIDDEN, HIDDEN)))
            for _ in range(LAYERS)
        ]  # fmt: skip
        self.keys = torch.randn(LAYERS, KV_HEADS, CONTEXT, HEAD, generator=gen)
        self.values = torch.randn(LAYERS, KV_HEADS, CONTEXT, HEAD, generator=gen)

    def run(self, ready: list[threading.Event] | None = None) -> None:
        torch = self.torch
        x = torch.ones(TOKENS, HIDDEN)
        group = HEADS // KV_HEADS
        for layer, (qkv, up, down, out) in enumerate(self.weights):
            if ready is not None:
                ready[layer].wait()
            q = (x @ qkv)[:, :HIDDEN].view(TOKENS, HEADS, HEAD).transpose(0, 1)
            k = self.keys[layer].repeat_interleave(group, 0)
            v = self.values[layer].repeat_interleave(group, 0)
            attn = torch.softmax(q @ k.transpose(1, 2) / HEAD**0.5, -1) @ v
            x = x + attn.transpose(0, 1).reshape(TOKENS, HIDDEN) @ out
            h = x @ up
            x = x + (torch.nn.functional.silu(h[:, :FFN]) * h[:, FFN:]) @ down


def _ms(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(step: Step, src: np.ndarray, dst: np.ndarray, reps: int) -> dict[str, float]:
    share = src.size // LAYERS

    def copy_all() -> None:
        np.copyto(dst, src)

    def layerwise() -> None:
        ready = [threading.Event() for _ in range(LAYERS)]

        def copier() -> None:
            for layer in range(LAYERS):
                lo, hi = layer * share, src.size if layer == LAYERS - 1 else (layer + 1) * share
                np.copyto(dst[lo:hi], src[lo:hi])
                ready[layer].set()

        helper = threading.Thread(target=copier)
        helper.start()
        step.run(ready)
        helper.join()

    for _ in range(2):  # warm: the first runs allocate
        step.run()
        copy_all()
        layerwise()
    samples: dict[str, list[float]] = {"forward_ms": [], "copy_ms": [], "serial_ms": [], "layerwise_ms": []}
    for _ in range(reps):  # interleaved, so the host's drift falls on every way alike
        samples["forward_ms"].append(_ms(step.run))
        samples["copy_ms"].append(_ms(copy_all))
        # the tuple only sequences the two calls in one timed lambda (kept as measured)
        samples["serial_ms"].append(_ms(lambda: (copy_all(), step.run())))  # type: ignore[func-returns-value]
        samples["layerwise_ms"].append(_ms(layerwise))
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument(
            "--megabytes", type=positive(int), default=92, help="prefix KV bytes to copy (default 92: 2k tokens)"
        )
        p.add_argument("--threads", default="2,1", help="torch threads of the forward pass, comma list (default 2,1)")
        p.add_argument("--reps", type=int, default=0, help="samples per way (default 9; quick 3)")

    args = parse_args("layer-by-layer load against a whole-prefix load before the step", argv, configure)
    import torch

    reps = args.reps or (3 if args.quick else 9)
    src = np.ones(args.megabytes << 20, np.uint8)
    dst = np.ones(args.megabytes << 20, np.uint8)  # pages made: a KV cache's are
    step = Step()
    rows: list[Row] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        m = measure(step, src, dst, reps)
        hidden = (m["serial_ms"] - m["layerwise_ms"]) / m["copy_ms"]
        rows.append({"torch_threads": threads, "megabytes": args.megabytes, **m, "hidden": hidden})
        print(f"[layer_overlap] {threads} threads: {m} hidden {hidden:.2f}", file=sys.stderr, flush=True)
    report(rows, args, title="layer-by-layer load vs load-then-forward (ms, medians)", bench="layer_overlap")
    return 0


if __name__ == "__main__":
    sys.exit(main())
