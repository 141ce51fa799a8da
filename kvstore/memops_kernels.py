"""The numba kernels behind ``kvstore.memops_jit`` (which says what they do and what they measured). Imported
only once that module has found numba and a CPU with SSE4.2 and PCLMULQDQ, and only when the kernels are
first wanted: importing numba at start broke vLLM 0.32's scan of every module's globals for Triton kernels
(llvmlite's ``ffi.lib`` answers any attribute, ``__dict__`` too), so an engine never pays for it early.

The CRC32C folds 64 bytes a step into four 128-bit remainders (``_fold_steps_of``: the loop written in LLVM IR so
the remainders stay in vector registers), then into one, which two CRC32 instructions reduce. Folding a
16-byte chunk forward by ``d`` bytes multiplies its low half by x^(8d+32) and its high half by x^(8d-32), both
mod the CRC32C polynomial, bit-reflected and shifted left one bit (reflected products come out one bit short).

Where the CPU numba compiles for has AVX2 and VPCLMULQDQ (``WIDE``: Intel from Ice Lake, AMD from Zen 3), buffers
of ``WIDE_MIN`` bytes or more are folded 128 bytes a step into four 256-bit remainders first (``_wide_steps_of``:
two 128-bit lanes each, folded 128 bytes forward), which then fold into one and continue as above. On this
project's Zen 4 VM (2026-12-05, ``python -m bench.crc``): 24-29 GB/s in cache and 19-26 out of it (64 KiB to 64
MiB), against 12-15 for the 64-byte loop and, for the `crc32c` package, 22-28 in cache and 13-15 out of it, where
a disk's DMA leaves its bytes. A streamed copy (``STREAM``) takes the wide loop only into 32-byte aligned memory.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

_POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
READ, STORE, STREAM = 0, 1, 2  # what copy_crc does with the bytes it reads: nothing, copy, copy past the cache


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


_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V2 = ir.VectorType(_I64, 2)
_V4 = ir.VectorType(_I64, 4)


def _wide_folding() -> bool:
    """AVX2 and VPCLMULQDQ on the CPU numba compiles for: its host's, unless NUMBA_CPU_NAME or NUMBA_CPU_FEATURES
    name another (then the 128-bit loop alone, which every x86-64 with PCLMULQDQ runs)."""
    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES:
        return False
    try:
        features = llvm.get_host_cpu_features()
    except RuntimeError:  # a host LLVM cannot describe
        return False
    return bool(features.get("avx2") and features.get("vpclmulqdq"))


WIDE = _wide_folding()
WIDE_STEP = 128  # bytes a step of the wide loop folds: four 256-bit remainders
WIDE_MIN = 2 * WIDE_STEP  # shorter buffers take the 64-byte loop alone
FOLD128 = (fold_constant(WIDE_STEP * 8 + 32), fold_constant(WIDE_STEP * 8 - 32))


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


class _FoldLoop:
    """The LLVM IR of a folding loop over four remainders of one vector type (``_V2``: 128 bits, PCLMULQDQ;
    ``_V4``: 256 bits, VPCLMULQDQ), which stay in vector registers across it; each step reads four vectors at
    ``src`` (and copies them to ``dst`` unless ``write`` is ``READ``, with non-temporal stores when it is
    ``STREAM``) and folds the remainders onto them by the ``constants`` of the step's length."""

    def __init__(self, builder: Any, vector: Any, clmul: str, constants: tuple[int, int], write: int):
        self.b, self.vector, self.write = builder, vector, write
        self.chunk = 8 * vector.count  # bytes a vector holds
        self.clmul = _function(builder, clmul, vector, [vector, vector, _I8])
        words = [ir.Constant(_I64, constants[0]), ir.Constant(_I64, constants[1])] * (vector.count // 2)
        self.k = ir.Constant(vector, words)
        self.nontemporal = builder.module.add_metadata([ir.Constant(_I32, 1)])

    def load(self, base: Any) -> list[Any]:
        b = self.b
        return [
            b.load(b.inttoptr(b.add(base, ir.Constant(_I64, self.chunk * j)), self.vector.as_pointer()), align=1)
            for j in range(4)
        ]

    def copy(self, base: Any, values: list[Any]) -> None:
        b = self.b
        for j in range(4 if self.write != READ else 0):
            target = b.inttoptr(b.add(base, ir.Constant(_I64, self.chunk * j)), self.vector.as_pointer())
            if self.write == STREAM:  # non-temporal: the destination's lines are not read in first
                b.store(values[j], target, align=self.chunk).set_metadata("nontemporal", self.nontemporal)
            else:
                b.store(values[j], target, align=1)

    def run(self, src: Any, dst: Any, first_step: int, steps: Any, start: list[Any]) -> list[Any]:
        """Steps ``first_step`` to ``steps - 1`` (none when there are no more): the four remainders after them."""
        b, step = self.b, 4 * self.chunk
        before = b.block
        loop, done = b.append_basic_block("fold.loop"), b.append_basic_block("fold.done")
        b.cbranch(b.icmp_signed(">", steps, ir.Constant(_I64, first_step)), loop, done)
        b.position_at_end(loop)
        i = b.phi(_I64)
        x = [b.phi(self.vector) for _ in range(4)]
        offset = b.mul(i, ir.Constant(_I64, step))
        loaded = self.load(b.add(src, offset))
        self.copy(b.add(dst, offset), loaded)
        folded = []
        for j in range(4):
            low = b.call(self.clmul, [x[j], self.k, ir.Constant(_I8, 0x00)])
            high = b.call(self.clmul, [x[j], self.k, ir.Constant(_I8, 0x11)])
            folded.append(b.xor(b.xor(low, high), loaded[j]))
        following = b.add(i, ir.Constant(_I64, 1))
        last = b.block
        i.add_incoming(ir.Constant(_I64, first_step), before)
        i.add_incoming(following, last)
        for j in range(4):
            x[j].add_incoming(start[j], before)
            x[j].add_incoming(folded[j], last)
        b.cbranch(b.icmp_signed("<", following, steps), loop, done)
        b.position_at_end(done)
        merged = [b.phi(self.vector) for _ in range(4)]  # phis first in the block, then anything else
        for j in range(4):
            merged[j].add_incoming(start[j], before)
            merged[j].add_incoming(folded[j], last)
        if self.write == STREAM:  # the streamed stores are visible to other threads before this returns
            b.call(_function(b, "llvm.x86.sse.sfence", ir.VoidType(), []), [])
        return merged

    def words(self, vectors: list[Any]) -> list[Any]:
        """The vectors' 64-bit words, in the order of the bytes they stand for."""
        lanes = [ir.Constant(_I32, q) for q in range(self.vector.count)]
        return [self.b.extract_element(v, lane) for v in vectors for lane in lanes]


def _fold_steps_of(write: int) -> Any:
    """An intrinsic that ``steps`` times folds the four 128-bit remainders (eight words) onto the next 64
    bytes at ``src``, the remainders staying in vector registers across the loop; the bytes are copied
    to ``dst`` unless ``write`` is ``READ``, with non-temporal stores when it is ``STREAM``."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        src, dst, steps, accs = args
        loop = _FoldLoop(builder, _V2, "llvm.x86.pclmulqdq", FOLD64, write)
        words = [builder.extract_value(accs, i) for i in range(8)]
        start = []
        for j in range(4):
            v = builder.insert_element(ir.Constant(_V2, ir.Undefined), words[2 * j], ir.Constant(_I32, 0))
            start.append(builder.insert_element(v, words[2 * j + 1], ir.Constant(_I32, 1)))
        return context.make_tuple(builder, sig.return_type, loop.words(loop.run(src, dst, 0, steps, start)))

    def typer(typingctx: Any, src: Any, dst: Any, steps: Any, accumulators: Any) -> Any:
        u64x8 = types.UniTuple(types.uint64, 8)
        return u64x8(types.int64, types.int64, types.int64, u64x8), codegen

    return intrinsic(typer)


_fold_read, _fold_store, _fold_stream = (_fold_steps_of(w) for w in (READ, STORE, STREAM))


def _wide_steps_of(write: int) -> Any:
    """An intrinsic that takes the first 128 bytes at ``src`` as four 256-bit remainders (the CRC so far XORed
    into the first word), folds them ``steps - 1`` times onto the next 128 bytes, and returns them as sixteen
    words, in the order of the bytes they stand for; the bytes are copied to ``dst`` as ``_fold_steps_of``'s
    are (``STREAM``: ``dst`` 32-byte aligned). Where ``WIDE`` is False it compiles to zeros: never called."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        if not WIDE:  # VPCLMULQDQ would not compile for this CPU; copy_crc never takes this path here
            return context.make_tuple(builder, sig.return_type, [ir.Constant(_I64, 0)] * 16)
        src, dst, steps, crc = args
        loop = _FoldLoop(builder, _V4, "llvm.x86.pclmulqdq.256", FOLD128, write)
        first = loop.load(src)
        loop.copy(dst, first)
        seed = builder.insert_element(ir.Constant(_V4, [ir.Constant(_I64, 0)] * 4), crc, ir.Constant(_I32, 0))
        first[0] = builder.xor(first[0], seed)
        return context.make_tuple(builder, sig.return_type, loop.words(loop.run(src, dst, 1, steps, first)))

    def typer(typingctx: Any, src: Any, dst: Any, steps: Any, crc: Any) -> Any:
        return types.UniTuple(types.uint64, 16)(types.int64, types.int64, types.int64, types.uint64), codegen

    return intrinsic(typer)


_wide_read, _wide_store, _wide_stream = (_wide_steps_of(w) for w in (READ, STORE, STREAM))

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
def copy_crc(src: int, dst: int, n: int, crc: int, write: int) -> Any:
    """The CRC32C of n bytes at src continuing from crc; copied to dst unless ``write`` is ``READ``
    (``STREAM``: non-temporal stores, dst 16-byte aligned; the wide loop's only where it is 32-byte aligned)."""
    if WIDE and n >= WIDE_MIN and (write != STREAM or dst & 31 == 0):
        steps = n // WIDE_STEP
        c = np.uint64(crc) ^ _MASK32
        if write == STREAM:
            words = _wide_stream(src, dst, steps, c)
        elif write == STORE:
            words = _wide_store(src, dst, steps, c)
        else:
            words = _wide_read(src, dst, steps, c)
        lo, hi = words[0], words[1]
        for q in range(1, 8):  # the eight 128-bit remainders, in the bytes' order, folded into one
            lo, hi = _fold(lo, hi, _K16_LO, _K16_HI, words[2 * q], words[2 * q + 1])
        done = steps * WIDE_STEP  # the last 0-127 bytes go on from the CRC32C so far, through the 64-byte loop
        so_far = _crc64(_crc64(np.uint64(0), lo), hi) ^ _MASK32
        return copy_crc_narrow(src + done, dst + done, n - done, so_far, write)
    return copy_crc_narrow(src, dst, n, crc, write)


@numba.njit(nogil=True, cache=True)
def copy_crc_narrow(src: int, dst: int, n: int, crc: int, write: int) -> Any:
    """``copy_crc`` with the 64-byte loop alone (every CPU the kernels run on; the tail of a wide one)."""
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
        if write == STREAM:
            accumulators = _fold_stream(src, dst, steps, accumulators)
        elif write == STORE:
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
    while src < end:  # the last 0-15 bytes (0-63 of a short buffer), a byte at a time
        w0 = _load8(src)
        if write:
            _store8(dst, w0)
        c = _crc8(c, w0)
        src += 1
        dst += 1
    return c ^ _MASK32


@numba.njit(nogil=True, cache=True)
def spans_copy(contiguous: int, spans: Any, check: bool, into_spans: bool, stream: bool) -> int:
    crc = 0
    for k in range(spans.shape[0]):
        address, n = spans[k, 0], spans[k, 1]
        src, dst = (contiguous, address) if into_spans else (address, contiguous)
        if stream and dst & 15 == 0:  # faster than a memcpy even when the CRC32C is not wanted
            crc = copy_crc(src, dst, n, crc, STREAM)
        elif check:
            crc = copy_crc(src, dst, n, crc, STORE)
        else:
            _memcpy(dst, src, n)
        contiguous += n
    return crc if check else 0


@numba.njit(nogil=True, cache=True)
def crc_of(data: Any, crc: int) -> Any:
    return copy_crc(data.ctypes.data, 0, data.size, crc, READ)


@numba.njit(nogil=True, cache=True)
def copy_crc_of(dst: Any, src: Any, crc: int, stream: bool) -> Any:
    d = dst.ctypes.data
    return copy_crc(src.ctypes.data, d, src.size, crc, STREAM if stream and d & 15 == 0 else STORE)


@numba.njit(nogil=True, cache=True)
def rows_copy(rows: Any, crcs: Any, check: bool, stream: bool) -> None:
    """Each row (src, dst, n, block) of ``rows``: n bytes from src copied to dst (dst 0: only read), their
    CRC32C chained onto ``crcs[block]`` when ``check`` (a block's rows in order). One call for a whole batch:
    the GIL is let go once, not once per block (per-block calls from two threads ran at half speed here)."""
    for k in range(rows.shape[0]):
        src, dst, n, block = rows[k, 0], rows[k, 1], rows[k, 2], rows[k, 3]
        if dst == 0:
            if check:
                crcs[block] = copy_crc(src, 0, n, crcs[block], READ)
        elif stream and dst & 15 == 0:  # faster than a memcpy even when the CRC32C is not wanted
            crc = copy_crc(src, dst, n, crcs[block], STREAM)
            if check:
                crcs[block] = crc
        elif check:
            crcs[block] = copy_crc(src, dst, n, crcs[block], STORE)
        else:
            _memcpy(dst, src, n)
