"""FP8 E4M3 (the ``float8_e4m3fn`` format) in numpy, plus bfloat16 bit helpers.

No torch needed: the store server decodes fp8 payloads without it. E4M3FN has
1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, and one
NaN pattern per sign (``0x7f``/``0xff``); the largest finite value is 448 and
the smallest normal 2**-6, below which subnormals step by 2**-9. Rounding is
to nearest, ties to even, the same as ``torch.Tensor.to(torch.float8_e4m3fn)``
(tests/test_codecs_fp8.py checks they agree code for code).

Error of one rounding: ``|q(y) - y| <= max(2**-4 * |y|, 2**-10)`` for
``|y| <= 448`` (half a unit in the last place of a 3-bit mantissa, or half a
subnormal step).

The ``*_into`` kernels write into caller arrays and take their temporaries
from ``scratch`` (no per-block allocation); the plain forms allocate.
"""

from __future__ import annotations

import numpy as np

from .scratch import scratch

E4M3_MAX = 448.0
MIN_NORMAL = 2.0**-6
MAX_CODE = 0x7E  # 448; 0x7F is NaN
_REBIAS = (127 - 7) << 3  # float32 (exponent << 3 | mantissa) minus this = e4m3 code
_SUBNORMAL_LO_BITS = (127 - 10) << 23  # 2**-10: at or below, the normal path's clip to 0 is exact
_MIN_NORMAL_BITS = (127 - 6) << 23  # 2**-6
_INF_BITS = 0x7F800000
BF16_NAN = 0x7FC0


def _decode_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    magnitude = np.where(
        exponent == 0,
        mantissa * 2.0**-9,
        (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0),
    )
    table: np.ndarray = (sign * magnitude).astype(np.float32)
    table[(codes & 0x7F) == 0x7F] = np.nan
    return table


DECODE_TABLE = _decode_table()
"""float32 value of each of the 256 E4M3FN codes."""


def quantize(y: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) of float32 ``y``; beyond +-448 saturates to 448, NaN maps to NaN."""
    y = np.ascontiguousarray(y, dtype=np.float32)
    out = np.empty(y.shape, dtype=np.uint8)
    quantize_into(y.reshape(-1), out.reshape(-1), may_have_nan=True)
    return out


def quantize_into(y: np.ndarray, out: np.ndarray, *, may_have_nan: bool) -> None:
    """Write the E4M3 codes of flat float32 ``y`` into flat uint8 ``out``.

    ``may_have_nan=False`` skips the NaN pass (the fp8 codec knows from the
    per-vector maxima).
    """
    n = y.size
    bits = y.view(np.int32)
    mbits = scratch("e4m3.mbits", n, np.int32)
    code = scratch("e4m3.code", n, np.int32)
    np.bitwise_and(bits, 0x7FFFFFFF, out=mbits)  # |y| as bits; orders like the magnitudes
    # Normal range: round the float32 mantissa to 3 bits (ties to even), then rebias;
    # anything at or below 2**-10 lands below zero and clips to code 0, as it should.
    np.right_shift(mbits, 20, out=code)
    code &= 1
    code += mbits
    code += 0x7FFFF  # NaN bit patterns may wrap here; they are fixed below
    code >>= 20
    code -= _REBIAS
    np.clip(code, 0, MAX_CODE, out=code)
    # Subnormal range (2**-10, 2**-6): multiples of 2**-9, ties to even. Rare after scaling.
    above = scratch("e4m3.above", n, np.bool_)
    below = scratch("e4m3.below", n, np.bool_)
    np.greater(mbits, _SUBNORMAL_LO_BITS, out=above)
    np.less(mbits, _MIN_NORMAL_BITS, out=below)
    above &= below
    small = np.flatnonzero(above)
    if small.size:
        code[small] = np.rint(np.abs(y[small]) * np.float32(512.0))
    nan = np.flatnonzero(np.greater(mbits, _INF_BITS, out=above)) if may_have_nan else small[:0]
    np.right_shift(bits, 24, out=mbits)  # sign bit into 0x80
    mbits &= 0x80
    code |= mbits
    if nan.size:
        code[nan] |= 0x7F
    np.copyto(out, code, casting="unsafe")


def dequantize(codes: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 ``codes``."""
    return np.take(DECODE_TABLE, codes)


def bf16_bits_round_up(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of non-negative float32 ``x``, rounded toward +inf."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    up = (bits.astype(np.uint64) + 0xFFFF) >> 16
    up = np.where(np.isnan(x), BF16_NAN, up)
    bf16: np.ndarray = np.minimum(up, 0x7F80).astype(np.uint16)
    return bf16


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray, out: np.ndarray | None = None, *, may_have_nan: bool = True) -> np.ndarray:
    """bfloat16 bit patterns of float32 ``x``, round to nearest even (NaN stays NaN).

    ``out`` (uint16, same size) receives them if given; ``may_have_nan=False``
    skips the NaN pass when the caller knows there are none.
    """
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    target = np.empty(flat.size, dtype=np.uint16) if out is None else out.reshape(-1)
    bits = flat.view(np.uint32)
    rounded = scratch("e4m3.bf16", flat.size, np.uint32)
    np.right_shift(bits, 16, out=rounded)
    rounded &= 1
    rounded += bits
    rounded += 0x7FFF
    rounded >>= 16
    np.copyto(target, rounded, casting="unsafe")
    if may_have_nan:
        nan = np.flatnonzero(np.isnan(flat))
        if nan.size:
            target[nan] = BF16_NAN | (bits[nan] >> 16) & 0x8000
    return target.reshape(np.shape(x)) if out is None else out
