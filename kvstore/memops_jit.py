"""Compiled copy and CRC32C loops (numba; x86-64 with SSE4.2 and PCLMULQDQ): a block's bytes read once.

On this project's 2-core AMD EPYC VM (2026-12-01) the `crc32c` package runs at 5.8 GB/s a core, the CRC32
instruction's throughput (three interleaved streams gain nothing here), and glibc's memmove of a 48 KiB page
at 4.4 GB/s. A vLLM block is 30 such pages: copying 62 blocks (91 MB) out of the store's mapped DRAM into
their pages took 16.6 ms on two threads, and their CRC32Cs 16 ms more, over bytes already read once. The
kernels here copy each 64 bytes and fold them into the CRC32C while they are in registers: the same 62
blocks copied and checked in 12.1 ms on two threads, what a copy alone takes (a torch copy: 11 ms).

The CRC32C is computed by carry-less multiplication: four 128-bit remainders fold 64 bytes a step, then
fold into one, which two CRC32 instructions reduce. Folding a 16-byte chunk forward by ``d`` bytes (onto
the chunk ``d`` bytes later) multiplies its low half by x^(8d+32) and its high half by x^(8d-32), both mod
the CRC32C polynomial, bit-reflected and shifted left one bit (reflected products come out one bit short).
The tests check every length, alignment and starting value against the `crc32c` package.

- ``AVAILABLE``: numba is importable (``kvstore.jit``) and the CPU has SSE4.2 and PCLMULQDQ.
- ``crc_at(address, n, crc) -> crc``: the CRC32C of ``n`` bytes at an address, continuing from ``crc``.
- ``copy_crc_at(src, dst, n, crc) -> crc``: copy ``n`` bytes and return their CRC32C, one pass.
- ``crc_of(array, crc)``, ``copy_crc_of(dst, src, crc)``: the same over uint8 arrays (numba takes an array's
  address in 0.3 us; Python's ``.ctypes.data`` costs 3.4).
- ``copy_to_spans(src, spans, check) -> crc``: contiguous bytes at ``src`` across ``spans`` (an int64
  array of (address, length) rows), with their chained CRC32C when ``check`` (else 0).
- ``gather_spans(dst, spans, check) -> crc``: the reverse, spans into contiguous bytes at ``dst``.
- ``ready() -> bool``: the kernels are compiled. The first call starts compiling them (or loading them from
  numba's on-disk cache: 2.5 s cold here, 0.6 s cached) on a background thread and says False until done,
  so callers keep the `crc32c` package's path meanwhile and no request waits for a compiler.
- ``warm_up()``: compile (or load) now, on the calling thread.

Addresses must be valid for the lengths given: the kernels read and write raw memory, unchecked.
"""

from __future__ import annotations

import platform
import threading
from typing import Any

import numpy as np

from kvstore.jit import numba

_POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
_READ, _STORE, _STREAM = 0, 1, 2  # what the kernel does with the bytes it reads: nothing, copy, copy past the cache
STREAM_BYTES = 1 << 20  # copies this large, to a 16-byte aligned destination, bypass the cache


def _cpu_has_folding() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from llvmlite import binding

        features = binding.get_host_cpu_features()
    except Exception:  # pragma: no cover - llvmlite without host queries
        return False
    return bool(features.get("sse4.2") and features.get("pclmul"))


AVAILABLE = numba is not None and _cpu_has_folding()


def _reflected(value: int, bits: int) -> int:
    return int(f"{value:0{bits}b}"[::-1], 2)


def _x_pow_mod(exponent: int) -> int:
    """x^exponent mod the CRC32C polynomial, in normal (unreflected) bit order."""
    poly = (1 << 32) | _reflected(_POLY, 32)
    r = 1
    for _ in range(exponent):
        r <<= 1
        if r >> 32:
            r ^= poly
    return r


def fold_constant(exponent: int) -> int:
    """The PCLMULQDQ operand that multiplies by x^exponent mod P in the reflected domain."""
    return _reflected(_x_pow_mod(exponent), 32) << 1


FOLD64 = (fold_constant(64 * 8 + 32), fold_constant(64 * 8 - 32))  # onto the chunk 64 bytes later
FOLD16 = (fold_constant(16 * 8 + 32), fold_constant(16 * 8 - 32))  # onto the next chunk

if AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    _I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    _V2 = ir.VectorType(_I64, 2)

    def _function(builder: Any, name: str, ret: Any, args: list[Any]) -> Any:
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)

    @intrinsic
    def _crc64(typingctx: Any, crc: Any, word: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.call(_function(builder, "llvm.x86.sse42.crc32.64.64", _I64, [_I64, _I64]), args)

        return types.uint64(types.uint64, types.uint64), codegen

    @intrinsic
    def _crc8(typingctx: Any, crc: Any, byte: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            fn = _function(builder, "llvm.x86.sse42.crc32.32.8", _I32, [_I32, _I8])
            return builder.zext(builder.call(fn, [builder.trunc(args[0], _I32), builder.trunc(args[1], _I8)]), _I64)

        return types.uint64(types.uint64, types.uint64), codegen

    @intrinsic
    def _load64(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.load(builder.inttoptr(args[0], _I64.as_pointer()), align=1)

        return types.uint64(types.int64), codegen

    @intrinsic
    def _load8(typingctx: Any, address: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.zext(builder.load(builder.inttoptr(args[0], _I8.as_pointer()), align=1), _I64)

        return types.uint64(types.int64), codegen

    @intrinsic
    def _store64(typingctx: Any, address: Any, word: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            builder.store(args[1], builder.inttoptr(args[0], _I64.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(types.int64, types.uint64), codegen

    @intrinsic
    def _store8(typingctx: Any, address: Any, byte: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            builder.store(builder.trunc(args[1], _I8), builder.inttoptr(args[0], _I8.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(types.int64, types.uint64), codegen

    @intrinsic
    def _memcpy(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = _I8.as_pointer()
            d, s = builder.inttoptr(args[0], ptr), builder.inttoptr(args[1], ptr)
            cgutils.raw_memcpy(builder, d, s, args[2], 1)
            return context.get_dummy_value()

        return types.none(types.int64, types.int64, types.int64), codegen

    @intrinsic
    def _fold(typingctx: Any, lo: Any, hi: Any, k_lo: Any, k_hi: Any, next_lo: Any, next_hi: Any) -> Any:
        """(lo, hi) folded onto (next_lo, next_hi): clmul(lo, k_lo) ^ clmul(hi, k_hi) ^ next."""

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            clmul = _function(builder, "llvm.x86.pclmulqdq", _V2, [_V2, _V2, _I8])
            zero, one = ir.Constant(_I32, 0), ir.Constant(_I32, 1)

            def vector(a: Any, b: Any) -> Any:
                return builder.insert_element(builder.insert_element(ir.Constant(_V2, ir.Undefined), a, zero), b, one)

            x, k = vector(args[0], args[1]), vector(args[2], args[3])
            low = builder.call(clmul, [x, k, ir.Constant(_I8, 0x00)])
            high = builder.call(clmul, [x, k, ir.Constant(_I8, 0x11)])
            r = builder.xor(builder.xor(low, high), vector(args[4], args[5]))
            parts = [builder.extract_element(r, zero), builder.extract_element(r, one)]
            return context.make_tuple(builder, sig.return_type, parts)

        u64 = types.uint64
        return types.UniTuple(u64, 2)(u64, u64, u64, u64, u64, u64), codegen

    def _fold_steps_of(write: int) -> Any:
        """An intrinsic that ``steps`` times folds the four 128-bit remainders (eight words) onto the next 64
        bytes at ``src``, the remainders staying in vector registers across the loop; the bytes are copied
        to ``dst`` unless ``write`` is ``_READ``, with non-temporal stores when it is ``_STREAM``."""

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            src, dst, steps, accs = args
            clmul = _function(builder, "llvm.x86.pclmulqdq", _V2, [_V2, _V2, _I8])
            zero, one = ir.Constant(_I32, 0), ir.Constant(_I32, 1)
            k = ir.Constant(_V2, [ir.Constant(_I64, FOLD64[0]), ir.Constant(_I64, FOLD64[1])])
            words = [builder.extract_value(accs, i) for i in range(8)]
            start = []
            for j in range(4):
                v = builder.insert_element(ir.Constant(_V2, ir.Undefined), words[2 * j], zero)
                start.append(builder.insert_element(v, words[2 * j + 1], one))
            before = builder.block
            loop, done = builder.append_basic_block("fold.loop"), builder.append_basic_block("fold.done")
            builder.cbranch(builder.icmp_signed(">", steps, ir.Constant(_I64, 0)), loop, done)
            builder.position_at_end(loop)
            i = builder.phi(_I64)
            x = [builder.phi(_V2) for _ in range(4)]
            offset = builder.mul(i, ir.Constant(_I64, 64))
            s, d = builder.add(src, offset), builder.add(dst, offset)
            loaded = [
                builder.load(builder.inttoptr(builder.add(s, ir.Constant(_I64, 16 * j)), _V2.as_pointer()), align=1)
                for j in range(4)
            ]
            for j in range(4 if write != _READ else 0):
                target = builder.inttoptr(builder.add(d, ir.Constant(_I64, 16 * j)), _V2.as_pointer())
                if write == _STREAM:  # non-temporal: the destination's lines are not read in first
                    store = builder.store(loaded[j], target, align=16)
                    store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
                else:
                    builder.store(loaded[j], target, align=1)
            folded = []
            for j in range(4):
                low = builder.call(clmul, [x[j], k, ir.Constant(_I8, 0x00)])
                high = builder.call(clmul, [x[j], k, ir.Constant(_I8, 0x11)])
                folded.append(builder.xor(builder.xor(low, high), loaded[j]))
            following = builder.add(i, ir.Constant(_I64, 1))
            last = builder.block
            i.add_incoming(ir.Constant(_I64, 0), before)
            i.add_incoming(following, last)
            for j in range(4):
                x[j].add_incoming(start[j], before)
                x[j].add_incoming(folded[j], last)
            builder.cbranch(builder.icmp_signed("<", following, steps), loop, done)
            builder.position_at_end(done)
            merged = [builder.phi(_V2) for _ in range(4)]  # phis first in the block, then the extracts
            if write == _STREAM:  # the streamed stores are visible to other threads before this returns
                builder.call(_function(builder, "llvm.x86.sse.sfence", ir.VoidType(), []), [])
            out = []
            for j in range(4):
                merged[j].add_incoming(start[j], before)
                merged[j].add_incoming(folded[j], last)
                out += [builder.extract_element(merged[j], zero), builder.extract_element(merged[j], one)]
            return context.make_tuple(builder, sig.return_type, out)

        def typer(typingctx: Any, src: Any, dst: Any, steps: Any, accumulators: Any) -> Any:
            u64x8 = types.UniTuple(types.uint64, 8)
            return u64x8(types.int64, types.int64, types.int64, u64x8), codegen

        return intrinsic(typer)

    _fold_read, _fold_store, _fold_stream = (_fold_steps_of(w) for w in (_READ, _STORE, _STREAM))

    _K64_LO, _K64_HI = np.uint64(FOLD64[0]), np.uint64(FOLD64[1])
    _K16_LO, _K16_HI = np.uint64(FOLD16[0]), np.uint64(FOLD16[1])

    _MASK32 = np.uint64(0xFFFFFFFF)

    @numba.njit(nogil=True, cache=True, inline="always")
    def _store_line(dst: int, w0: int, w1: int, w2: int, w3: int, w4: int, w5: int, w6: int, w7: int) -> None:
        _store64(dst, w0)
        _store64(dst + 8, w1)
        _store64(dst + 16, w2)
        _store64(dst + 24, w3)
        _store64(dst + 32, w4)
        _store64(dst + 40, w5)
        _store64(dst + 48, w6)
        _store64(dst + 56, w7)

    @numba.njit(nogil=True, cache=True)
    def _copy_crc(src: int, dst: int, n: int, crc: int, write: int) -> Any:
        """The CRC32C of n bytes at src continuing from crc; copied to dst unless ``write`` is ``_READ``
        (``_STREAM``: the 64-byte steps with non-temporal stores, dst 16-byte aligned)."""
        c = np.uint64(crc) ^ _MASK32
        end = src + n
        if n >= 64:
            w0, w1, w2, w3 = _load64(src), _load64(src + 8), _load64(src + 16), _load64(src + 24)
            w4, w5, w6, w7 = _load64(src + 32), _load64(src + 40), _load64(src + 48), _load64(src + 56)
            if write:
                _store_line(dst, w0, w1, w2, w3, w4, w5, w6, w7)
            a0, b0, a1, b1, a2, b2, a3, b3 = w0 ^ c, w1, w2, w3, w4, w5, w6, w7
            src += 64
            dst += 64
            steps = (end - src) // 64
            accumulators = (a0, b0, a1, b1, a2, b2, a3, b3)
            if write == _STREAM:
                accumulators = _fold_stream(src, dst, steps, accumulators)
            elif write == _STORE:
                accumulators = _fold_store(src, dst, steps, accumulators)
            else:
                accumulators = _fold_read(src, dst, steps, accumulators)
            a0, b0, a1, b1, a2, b2, a3, b3 = accumulators
            src += 64 * steps
            dst += 64 * steps
            a1, b1 = _fold(a0, b0, _K16_LO, _K16_HI, a1, b1)
            a2, b2 = _fold(a1, b1, _K16_LO, _K16_HI, a2, b2)
            lo, hi = _fold(a2, b2, _K16_LO, _K16_HI, a3, b3)
            while end - src >= 16:
                w0, w1 = _load64(src), _load64(src + 8)
                if write:
                    _store64(dst, w0)
                    _store64(dst + 8, w1)
                lo, hi = _fold(lo, hi, _K16_LO, _K16_HI, w0, w1)
                src += 16
                dst += 16
            c = _crc64(_crc64(np.uint64(0), lo), hi)
        while end - src >= 8:
            w0 = _load64(src)
            if write:
                _store64(dst, w0)
            c = _crc64(c, w0)
            src += 8
            dst += 8
        while src < end:
            w0 = _load8(src)
            if write:
                _store8(dst, w0)
            c = _crc8(c, w0)
            src += 1
            dst += 1
        return c ^ _MASK32

    @numba.njit(nogil=True, cache=True)
    def _spans(contiguous: int, spans: Any, check: bool, into_spans: bool, stream: bool) -> int:
        crc = 0
        for k in range(spans.shape[0]):
            address, n = spans[k, 0], spans[k, 1]
            src, dst = (contiguous, address) if into_spans else (address, contiguous)
            if stream and dst & 15 == 0:  # faster than a memcpy even when the CRC32C is not wanted
                crc = _copy_crc(src, dst, n, crc, _STREAM)
            elif check:
                crc = _copy_crc(src, dst, n, crc, _STORE)
            else:
                _memcpy(dst, src, n)
            contiguous += n
        return crc if check else 0

    @numba.njit(nogil=True, cache=True)
    def _crc_of(data: Any, crc: int) -> Any:
        return _copy_crc(data.ctypes.data, 0, data.size, crc, _READ)

    @numba.njit(nogil=True, cache=True)
    def _copy_crc_of(dst: Any, src: Any, crc: int, stream: bool) -> Any:
        d = dst.ctypes.data
        return _copy_crc(src.ctypes.data, d, src.size, crc, _STREAM if stream and d & 15 == 0 else _STORE)


def crc_at(address: int, n: int, crc: int = 0) -> int:
    """CRC32C of the n bytes at ``address``, continuing from ``crc``."""
    return int(_copy_crc(address, 0, n, crc, _READ))


def copy_crc_at(src: int, dst: int, n: int, crc: int = 0) -> int:
    """Copy n bytes from ``src`` to ``dst`` (not overlapping); their CRC32C, continuing from ``crc``. Copies
    of ``STREAM_BYTES`` or more to a 16-byte aligned ``dst`` bypass the cache (non-temporal stores)."""
    mode = _STREAM if n >= STREAM_BYTES and dst & 15 == 0 else _STORE
    return int(_copy_crc(src, dst, n, crc, mode))


def crc_of(data: np.ndarray, crc: int = 0) -> int:
    """CRC32C of a contiguous uint8 array (for buffers whose address Python cannot take cheaply)."""
    return int(_crc_of(data, crc))


def copy_crc_of(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """``copy_crc_at`` for contiguous uint8 arrays of the same size."""
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into {dst.size}")
    return int(_copy_crc_of(dst, src, crc, src.size >= STREAM_BYTES))


def copy_to_spans(src: int, spans: np.ndarray, check: bool) -> int:
    """The bytes at ``src`` across ``spans`` ((address, length) rows, int64), in order; their CRC32C when
    ``check``, else 0. Past ``STREAM_BYTES`` in all, spans at 16-byte aligned addresses bypass the cache."""
    return int(_spans(src, spans, check, True, _streams(spans)))


def gather_spans(dst: int, spans: np.ndarray, check: bool) -> int:
    """The bytes of ``spans`` in order into contiguous memory at ``dst``; their CRC32C when ``check``."""
    return int(_spans(dst, spans, check, False, _streams(spans)))


def _streams(spans: np.ndarray) -> bool:
    return bool(spans.shape[0]) and int(spans[:, 1].sum()) >= STREAM_BYTES


_ready = False
_started = False
_start_lock = threading.Lock()


def ready() -> bool:
    """The kernels are compiled; the first call starts compiling them in the background (see above)."""
    global _started
    if _ready or not AVAILABLE:
        return _ready
    with _start_lock:
        if not _started:
            _started = True
            threading.Thread(target=warm_up, name="kvstore-memops-jit", daemon=True).start()
    return _ready


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache) now, not on a caller's first copy."""
    global _ready
    if not AVAILABLE:
        return
    buf = np.zeros(256, dtype=np.uint8)
    base = int(buf.ctypes.data)
    crc_at(base, 200)
    copy_crc_at(base, base + 128, 100)
    crc_of(buf, 0)
    copy_crc_of(buf[128:], buf[:128])
    spans = np.array([[base + 128, 64], [base + 192, 64]], dtype=np.int64)
    copy_to_spans(base, spans, True)
    gather_spans(base, spans, False)
    _ready = True
