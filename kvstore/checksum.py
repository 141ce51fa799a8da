"""CRC32C (Castagnoli) of any buffer: memoryview, bytearray, numpy array or bytes.

Uses the `crc32c` package (hardware SSE4.2/ARMv8 CRC instructions, about
16 GB/s here) because it takes any buffer without a copy; google-crc32c's C
extension accepts only `bytes`, which would force a copy of every block.
"""

from __future__ import annotations

from typing import Any

from crc32c import crc32c as _crc32c


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of `data`, continuing from `value` (the CRC of the bytes before it)."""
    return _crc32c(data, value)
