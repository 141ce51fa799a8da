"""Codec ratio and single-core speed on real SmolLM2 KV, plus fp8 quality.

    python -m bench.codecs [--quick] [--out bench/results/codecs.json] [--synthetic]

KV comes from ``kvstore.model.real_kv.smollm2_kv_blocks`` (SmolLM2-135M run on
real text: 30 layers, 3 KV heads, head_dim 64, 16-token blocks of 360 KiB in
bf16), one block per payload as the store holds them. ``--synthetic`` swaps in
random-init KV (rows say ``source: synthetic``) for testing the bench itself.

Per codec, dtype and variant: ratio (raw / encoded bytes over all blocks) and
single-thread encode and decode GB/s (raw bytes per second, best of the
repetitions, through the public ``encode`` / ``decode_into``), per CPU-second
of the coding thread (``encode_gbps``, ``decode_gbps``; steady when other work
shares the two cores) and per wall-second (``*_wall_gbps``, in the JSON). Variant
``dense`` is the real blocks; ``half-zero`` zeroes the last 8 tokens of each
block (a zero-padded, half-filled page: the case lz4 is kept for). For the
lossy codecs on dense blocks: relative L2 error, the largest error divided by
its head vector's max magnitude, and the cosine between attention outputs
``softmax(q K^T / sqrt(d)) V`` computed from original and decoded K and V per
layer and head, with queries drawn from the keys of 128 random tokens; also
with only K or only V decoded, to show where the error comes from.

Variant ``link N Gbit/s (sim)`` moves the dense bf16 blocks over a simulated
link (a sleep of encoded bytes / bandwidth per batch) with decoding on the
receiving side: ``sequential_gbps`` encodes, sends and decodes one batch after
another; ``pipelined_gbps`` uses ``iter_encoded`` and ``DecodePipeline`` so
coding overlaps the wire. Both in raw bytes per second of the whole transfer,
best of half the repetitions; wall-clock, so only meaningful on a quiet machine
(the JSON records the load average).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from bench.common import Row, best_seconds, parse_args, positive, report
from kvstore.codecs import codec_names, decode_into, encode, get_codec
from kvstore.codecs.pipeline import DecodePipeline, iter_encoded

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LAYOUT = dict(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--synthetic", action="store_true", help="random-init KV instead of the real model (testing only)"
    )
    parser.add_argument("--tokens", type=positive(int), default=None, help="tokens of KV (default 2048, quick 256)")
    parser.add_argument("--reps", type=positive(int), default=None, help="timed repetitions (default 5, quick 2)")
    parser.add_argument(
        "--dtypes", default=None, help="comma list (default bfloat16,float16,float32; quick bfloat16,float16)"
    )
    parser.add_argument("--codecs", default=",".join(codec_names()), help="comma list of codecs")
    parser.add_argument("--link-gbit", type=positive(float), default=1.0, help="simulated link for the pipelining rows")


def synthetic_kv(num_tokens: int, dtype: torch.dtype, block_size: int = 16, seed: int = 0) -> torch.Tensor:
    """Random-init KV in the real layout: per-channel scales with a few outlier channels in K."""
    gen = torch.Generator().manual_seed(seed)
    layers, heads, dim = LAYOUT["layers"], LAYOUT["kv_heads"], LAYOUT["head_dim"]
    n_blocks = num_tokens // block_size
    kv = torch.randn(n_blocks, layers, 2, block_size, heads, dim, generator=gen)
    channel = torch.exp(torch.randn(layers, 2, 1, heads, dim, generator=gen))
    channel[:, 0, :, :, :4] *= 8
    return (kv * channel).to(dtype)


def load_kv(num_tokens: int, dtype: str, synthetic: bool) -> torch.Tensor:
    if synthetic:
        return synthetic_kv(num_tokens, TORCH_DTYPES[dtype])
    from kvstore.model.real_kv import smollm2_kv_blocks

    return smollm2_kv_blocks(num_tokens, block_size=16, dtype=TORCH_DTYPES[dtype])


def half_zero(kv: torch.Tensor) -> torch.Tensor:
    padded = kv.clone()
    padded[:, :, :, padded.shape[3] // 2 :] = 0
    return padded


def as_blocks(kv: torch.Tensor) -> list[np.ndarray]:
    return [kv[i].contiguous().view(torch.uint8).reshape(-1).numpy() for i in range(kv.shape[0])]


def measure(codec: str, blocks: Sequence[np.ndarray], dtype: str, reps: int) -> Row:
    raw = sum(b.nbytes for b in blocks)
    payloads = [encode(codec, b, dtype) for b in blocks]
    outs = [np.empty_like(b) for b in blocks]

    def encode_all() -> None:
        for b in blocks:  # each payload dropped at once, as a streaming sender does
            encode(codec, b, dtype)

    def decode_all() -> None:
        for p, o in zip(payloads, outs):
            decode_into(codec, p, dtype, o.nbytes, o)

    enc_cpu, dec_cpu = (best_seconds(f, reps, clock=time.thread_time) for f in (encode_all, decode_all))
    enc_wall, dec_wall = (best_seconds(f, reps) for f in (encode_all, decode_all))
    if not get_codec(codec).lossy:
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks)), f"{codec} did not round-trip"
    return {
        "ratio": raw / sum(len(p) for p in payloads),
        "encode_gbps": raw / enc_cpu / 1e9,
        "decode_gbps": raw / dec_cpu / 1e9,
        "encode_wall_gbps": raw / enc_wall / 1e9,
        "decode_wall_gbps": raw / dec_wall / 1e9,
    }


def over_link(codec: str, blocks: Sequence[np.ndarray], dtype: str, gbit: float, pipelined: bool) -> float:
    """Raw GB/s of moving ``blocks`` over a simulated ``gbit`` link, coding in line or overlapped."""
    wire_bps = gbit * 1e9 / 8
    outs = [np.empty_like(b) for b in blocks]
    start = time.perf_counter()
    if pipelined:
        with DecodePipeline(max_pending=2) as receiver:
            for batch in iter_encoded(blocks, dtype, codec, depth=2):
                time.sleep(batch.encoded_bytes / wire_bps)
                for i, payload in enumerate(batch.payloads):
                    out = outs[batch.start + i]
                    receiver.submit(codec, payload, dtype, out.nbytes, out)
    else:
        for batch in iter_encoded(blocks, dtype, codec, depth=0):
            time.sleep(batch.encoded_bytes / wire_bps)
            for i, payload in enumerate(batch.payloads):
                out = outs[batch.start + i]
                decode_into(codec, payload, dtype, out.nbytes, out)
    elapsed = time.perf_counter() - start
    return sum(b.nbytes for b in blocks) / elapsed / 1e9


def decoded(codec: str, kv: torch.Tensor, dtype: str) -> torch.Tensor:
    out = torch.empty_like(kv)
    for i in range(kv.shape[0]):
        raw_len = kv[i].numel() * kv.element_size()
        decode_into(codec, encode(codec, kv[i], dtype, head_dim=kv.shape[-1]), dtype, raw_len, out[i])
    return out


def attention(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5
    return torch.softmax(scores, dim=-1) @ v


def quality(kv: torch.Tensor, kv_hat: torch.Tensor, n_queries: int = 128) -> Row:
    """Errors of ``kv_hat`` against ``kv`` ([blocks, layers, 2, block, heads, dim])."""
    x, y = kv.double(), kv_hat.double()
    vec_max = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)

    def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [blocks, layers, 2, block, heads, dim] -> K, V as [layers, heads, tokens, dim]
        flat = t.float().permute(1, 2, 4, 0, 3, 5)
        layers, _, heads, blocks, block, dim = flat.shape
        flat = flat.reshape(layers, 2, heads, blocks * block, dim)
        return flat[:, 0], flat[:, 1]

    k, v = split(kv)
    k_hat, v_hat = split(kv_hat)
    gen = torch.Generator().manual_seed(0)
    pick = torch.randperm(k.shape[2], generator=gen)[:n_queries]
    q = k[:, :, pick]
    ref = attention(k, v, q)

    def cosine(kk: torch.Tensor, vv: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(ref, attention(kk, vv, q), dim=-1).mean())

    return {
        "rel_error": float((y - x).norm() / x.norm()),
        "max_err_per_vecmax": float(((y - x).abs() / vec_max).max()),
        "attn_cosine": cosine(k_hat, v_hat),
        "attn_cosine_k_only": cosine(k_hat, v),
        "attn_cosine_v_only": cosine(k, v_hat),
    }


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args("Codec ratio and single-core GB/s on SmolLM2 KV; fp8 quality.", argv, configure)
    tokens = args.tokens or (256 if args.quick else 2048)
    reps = args.reps or (2 if args.quick else 5)
    dtypes = (args.dtypes or ("bfloat16,float16" if args.quick else "bfloat16,float16,float32")).split(",")
    codecs = args.codecs.split(",")
    source = "synthetic" if args.synthetic else "smollm2-135m"
    torch.set_num_threads(1)
    rows: list[Row] = []
    for dtype in dtypes:
        kv = load_kv(tokens, dtype, args.synthetic)
        block_kib = kv[0].numel() * kv.element_size() / 1024
        for variant, data in (("dense", kv), ("half-zero", half_zero(kv))):
            blocks = as_blocks(data)
            for codec in codecs:
                row: Row = {"codec": codec, "dtype": dtype, "variant": variant}
                row.update(measure(codec, blocks, dtype, reps))
                if get_codec(codec).lossy and variant == "dense":
                    row.update(quality(kv, decoded(codec, kv, dtype)))
                row.update({"block_kib": block_kib, "blocks": len(blocks), "source": source})
                rows.append(row)
        if dtype == "bfloat16":
            blocks = as_blocks(kv)
            link_reps = range(max(1, reps // 2))  # best of: wall clock, other jobs share the cores
            for codec in codecs:
                rows.append(
                    {
                        "codec": codec,
                        "dtype": dtype,
                        "variant": f"link {args.link_gbit:g} Gbit/s (sim)",
                        "sequential_gbps": max(
                            over_link(codec, blocks, dtype, args.link_gbit, False) for _ in link_reps
                        ),
                        "pipelined_gbps": max(over_link(codec, blocks, dtype, args.link_gbit, True) for _ in link_reps),
                        "loadavg_1m": os.getloadavg()[0],  # wall-clock rows: above ~1.5 the cores were shared
                        "block_kib": block_kib,
                        "blocks": len(blocks),
                        "source": source,
                    }
                )
    columns = [
        "codec",
        "dtype",
        "variant",
        "ratio",
        "encode_gbps",
        "decode_gbps",
        "rel_error",
        "max_err_per_vecmax",
        "attn_cosine",
        "attn_cosine_k_only",
        "attn_cosine_v_only",
        "sequential_gbps",
        "pipelined_gbps",
        "source",
    ]
    title = f"codecs on {source} KV: {tokens} tokens, single core, best of {reps}"
    report(rows, args, title=title, columns=columns, bench="codecs")
    return rows


if __name__ == "__main__":
    main()
