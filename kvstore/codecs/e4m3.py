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
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0
MIN_NORMAL = 2.0**-6
MAX_CODE = 0x7E  # 448; 0x7F is NaN
_REBIAS = (127 - 7) << 3  # float32 (exponent << 3 | mantissa) minus this = e4m3 code
_MIN_NORMAL_BITS = (127 - 6) << 23  # float32 bits of 2**-6
_INF_BITS = 0x7F800000


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
    table = (sign * magnitude).astype(np.float32)
    table[(codes & 0x7F) == 0x7F] = np.nan
    return table


DECODE_TABLE = _decode_table()
"""float32 value of each of the 256 E4M3FN codes."""


def quantize(y: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) of float32 ``y``, |y| <= 448 assumed (larger saturates to 448).

    NaN maps to the NaN code.
    """
    with np.errstate(invalid="ignore", over="ignore"):
        return _quantize(np.ascontiguousarray(y, dtype=np.float32))


def _quantize(y: np.ndarray) -> np.ndarray:
    bits = y.reshape(-1).view(np.int32)
    mbits = bits & np.int32(0x7FFFFFFF)  # |y| as bits; orders like the magnitudes
    # Normal range: round the float32 mantissa to 3 bits (ties to even), then rebias.
    code = (mbits >> 20) & 1
    code += mbits
    code += 0x7FFFF  # NaN bit patterns may wrap here; they are fixed below
    code >>= 20
    code -= _REBIAS
    np.clip(code, 0, MAX_CODE, out=code)
    # Subnormal range (|y| < 2**-6): multiples of 2**-9, ties to even. Rare after scaling.
    small = np.flatnonzero(mbits < _MIN_NORMAL_BITS)
    if small.size:
        code[small] = np.rint(np.abs(y.reshape(-1)[small]) * np.float32(512.0))
    out = code.astype(np.uint8)
    out |= ((bits >> 24) & 0x80).astype(np.uint8)
    nan = np.flatnonzero(mbits > _INF_BITS)
    if nan.size:
        out[nan] |= np.uint8(0x7F)
    return out.reshape(y.shape)


def dequantize(codes: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 ``codes``."""
    return np.take(DECODE_TABLE, codes)


def bf16_bits_round_up(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of non-negative float32 ``x``, rounded toward +inf."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    up = (bits.astype(np.uint64) + 0xFFFF) >> 16
    up = np.where(np.isnan(x), 0x7FC0, up)
    return np.minimum(up, 0x7F80).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray, out: np.ndarray | None = None, *, may_have_nan: bool = True) -> np.ndarray:
    """bfloat16 bit patterns of float32 ``x``, round to nearest even (NaN stays NaN).

    ``out`` (uint16, same size) receives them if given; ``may_have_nan=False``
    skips the NaN pass when the caller knows there are none.
    """
    bits = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
    rounded = (bits >> 16) & 1
    rounded += bits
    rounded += 0x7FFF
    rounded >>= 16
    if may_have_nan:
        nan = np.flatnonzero((bits & np.uint32(0x7FFFFFFF)) > np.uint32(_INF_BITS))
        if nan.size:
            rounded[nan] = (bits[nan] >> 16) | 0x40
    if out is None:
        return rounded.astype(np.uint16).reshape(np.shape(x))
    out.reshape(-1)[...] = rounded
    return out
