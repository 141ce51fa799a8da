"""fp8 / fp8+zstd: E4M3 rounding matches torch, and decoded values stay within the documented bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codecs import CodecError, decode, e4m3, encode

torch = pytest.importorskip("torch")

TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}


def test_decode_table_matches_torch() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3.DECODE_TABLE, expected)  # NaNs compare equal here


def test_quantize_matches_torch_cast() -> None:
    rng = np.random.default_rng(0)
    grid = e4m3.DECODE_TABLE[np.isfinite(e4m3.DECODE_TABLE)]
    grid = np.unique(grid)
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact ties: round half to even
    log_uniform = np.exp(rng.uniform(np.log(2.0**-14), np.log(448.0), 200_000)) * rng.choice([-1, 1], 200_000)
    near_ties = [np.nextafter(midpoints, 0), np.nextafter(midpoints, 1000)]
    y = np.concatenate([grid, midpoints, *near_ties, log_uniform, [0.0, -0.0]])
    y = y.astype(np.float32)
    ours = e4m3.quantize(y)
    theirs = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_bf16_rounding_matches_torch() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-30, 30, 100_000))).astype(np.float32)
    ours = e4m3.f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    up = e4m3.bf16_bits_to_f32(e4m3.bf16_bits_round_up(np.abs(x)))
    assert np.all(up >= np.abs(x)) and np.all(up <= np.abs(x) * (1 + 2.0**-7))


def vectors(dtype: str, n_vec: int, head_dim: int, seed: int) -> torch.Tensor:
    """KV-like vectors: per-vector magnitudes spread over many octaves, some tiny elements, an outlier channel."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_vec, head_dim, generator=gen)
    x *= torch.exp(torch.empty(n_vec, 1).uniform_(-8, 8, generator=gen))
    x[:, 0] *= 20
    x[:, 1] *= 1e-6
    return x.to(TORCH_DTYPE[dtype])


def reference_fp8(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The same scheme written with torch's float8 cast, for comparison."""
    v = x.float().reshape(-1, head_dim)
    amax = v.abs().amax(dim=1, keepdim=True)
    scale = torch.from_numpy(e4m3.bf16_bits_to_f32(e4m3.bf16_bits_round_up(amax.numpy() / np.float32(448))))
    q = (v / torch.where(scale > 0, scale, torch.ones_like(scale))).to(torch.float8_e4m3fn).float()
    return (q * scale).to(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("codec", ["fp8", "fp8+zstd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_error_bound_and_torch_agreement(codec: str, dtype: str, head_dim: int) -> None:
    x = vectors(dtype, 512, head_dim, seed=head_dim)
    if dtype == "float16":
        x = x.float().clamp(-60000, 60000).to(torch.float16)
    raw = x.view(torch.uint8).numpy().tobytes()
    encoded = encode(codec, x, dtype, head_dim=head_dim)
    assert len(encoded) < len(raw) * (0.55 if dtype != "float32" else 0.3)
    back = torch.frombuffer(bytearray(decode(codec, encoded, dtype, len(raw))), dtype=x.dtype).reshape(x.shape)
    assert torch.equal(back, reference_fp8(x, head_dim))
    xf, bf = x.double(), back.double()
    vmax = xf.abs().amax(dim=1, keepdim=True)
    scale = vmax / 448 * (1 + 2.0**-7)
    bound = 2.0**-4 * xf.abs() + 2.0**-10 * scale + HALF_ULP[dtype] * bf.abs()
    if dtype == "float16":
        bound += 2.0**-25
    assert torch.all((bf - xf).abs() <= bound)
    assert torch.all((bf - xf).abs() <= 0.0668 * vmax + 2.0**-25)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    n_bytes=st.integers(min_value=0, max_value=9_001),
    head_dim=st.sampled_from([1, 7, 64, 128]),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_any_length_round_trips_within_bound(dtype: str, n_bytes: int, head_dim: int, seed: int) -> None:
    itemsize = 4 if dtype == "float32" else 2
    n = n_bytes // itemsize
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(TORCH_DTYPE[dtype])
    tail = bytes(range(n_bytes % itemsize))
    raw = x.view(torch.uint8).numpy().tobytes() + tail
    back = decode("fp8", encode("fp8", raw, dtype, head_dim=head_dim), dtype, n_bytes)
    assert back[n * itemsize :] == tail
    got = torch.frombuffer(bytearray(back[: n * itemsize]), dtype=x.dtype).double() if n else torch.zeros(0)
    xf = x.double()
    padded = torch.nn.functional.pad(xf.abs(), (0, (-n) % head_dim)).reshape(-1, head_dim)
    vmax = padded.amax(dim=1).repeat_interleave(head_dim)[:n]
    assert torch.all((got - xf).abs() <= 0.0668 * vmax + 2.0**-25)


def test_special_vectors() -> None:
    x = torch.randn(4, 64)
    x[0] = 0.0
    x[1, 5] = float("inf")
    x[2, 7] = float("nan")
    x[3] *= 1e-30
    raw = decode("fp8", encode("fp8", x, "float32"), "float32", x.numel() * 4)
    back = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(4, 64)
    assert torch.equal(back[0], torch.zeros(64))
    assert torch.isnan(back[1]).all() and torch.isnan(back[2]).all()
    assert torch.all((back[3] - x[3]).abs() <= 0.07 * x[3].abs().max())


@pytest.mark.parametrize("dtype,limit", [("float16", 65504.0), ("bfloat16", 3.3895313892515355e38)])
def test_no_overflow_near_dtype_max(dtype: str, limit: float) -> None:
    x = torch.full((64,), limit, dtype=torch.float64)
    x[1::2] = -limit * 0.97  # rounds up in fp8, must clamp instead of becoming Inf
    x = x.to(TORCH_DTYPE[dtype])
    back = torch.frombuffer(bytearray(decode("fp8", encode("fp8", x, dtype), dtype, x.numel() * 2)), dtype=x.dtype)
    assert torch.isfinite(back).all()
    assert torch.all((back.double() - x.double()).abs() <= 0.07 * limit)


def test_header_is_self_describing() -> None:
    x = torch.randn(16, 128).to(torch.bfloat16)
    raw_len = x.numel() * 2
    coarse, fine = encode("fp8", x, "bfloat16", head_dim=128), encode("fp8", x, "bfloat16", head_dim=64)
    assert len(fine) - len(coarse) == 2 * 16  # one more bf16 scale per 128-vector
    decode("fp8", coarse, "bfloat16", raw_len)  # decoder needs no head_dim
    with pytest.raises(CodecError):
        decode("fp8", coarse, "float16", raw_len)
    with pytest.raises(CodecError):
        decode("fp8", coarse[:-1], "bfloat16", raw_len)


@pytest.mark.parametrize("codec", ["fp8", "fp8+zstd", "zstd", "byteplane"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_encode_decoded_gives_what_the_receiver_decodes(codec: str, dtype: str) -> None:
    # a lossy sender checksums the decoded bytes; fp8+zstd decodes its fp8 payload before compressing it
    from kvstore.codecs.base import DEFAULT_OPTIONS
    from kvstore.codecs.registry import decode, get_codec

    rng = np.random.default_rng(11)
    src = (rng.standard_normal(64 * 48 + 5) * 0.3).astype(np.float32)
    raw = (
        src.astype(dtype).view(np.uint8)
        if dtype != "bfloat16"
        else (src.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    )
    raw = np.concatenate([raw, np.array([7], dtype=np.uint8)])  # an odd byte length
    out = np.empty(raw.nbytes, dtype=np.uint8)
    payload = get_codec(codec).encode_decoded(raw, dtype, DEFAULT_OPTIONS, out)
    assert bytes(out) == decode(codec, payload, dtype, raw.nbytes)
