"""Device helpers over window slots, shared by every kernel: vector views, loads and stores, bf16 widening, the
segment lookup of a row with its bounds guard, and the per-thread slot loads of one batch.

Slot ``s`` of a row whose own tokens start at ``t0`` reads token ``t0 - (coff - 1) * ratio + s``, columns
``(s // ratio) * head_dim + c`` (SPEC section 2); the previous half of a segment's first group (and of padding
rows) is masked: value 0, logit -inf. Whatever cu_seqlens and cu_seqlens_comp hold, every token a row reads is
inside ``[0, T)`` (docs/safety.md): rows are real below ``min(cu_seqlens_comp[B], total_comp)``, and a real row
whose own tokens leave ``[0, T)`` is computed as a padding row (``locate_row``; ``inside`` is the same guard as a
compare of the row's first token alone).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass._mlir import ir

from .ptx import bf16_hi, bf16_lo

NEG_INF = float("-inf")


def vec_view(ptr: cute.Pointer, off, width: int) -> cute.Tensor:
    """``width`` contiguous elements at ``ptr + off``; ``off`` is a multiple of width, so the access is one vector."""
    return cute.make_tensor(ptr + cute.assume(off, divby=width), cute.make_layout(width))


def store_vector(ptr: cute.Pointer, off, width: int, value) -> None:
    """``vec_view(ptr, off, width).store(value)``: one vector store."""
    vec_view(ptr, off, width).store(value)


def load_evict_first(ptr: cute.Pointer, off, width: int):
    """``vec_view(ptr, off, width).load()`` as ``ld.global.cs`` (SASS ``LDG.E.EF``): data read once is cached
    evict-first in L1 and L2, so a window streaming through L2 replaces its own lines instead of evicting other,
    possibly dirty, ones whose write-back would share the DRAM bandwidth."""
    if width == 1:  # NVVM rejects a one-element vector load with a cache operator
        return vec_view(ptr, off, width).load()
    dtype = ptr.dtype
    value = cute.arch.load(ptr + cute.assume(off, divby=width), ir.VectorType.get([width], dtype.mlir_type), cop="cs")
    return cute.TensorSSA(value, (width,), dtype)


def registers(width: int, dtype=Float32):
    """A register tensor of ``width`` elements."""
    return cute.make_rmem_tensor(cute.make_layout(width), dtype)


def register_slots(count: int, width: int, dtype=Float32) -> list:
    """``count`` register tensors of ``width`` elements (one per window slot)."""
    return [cute.make_rmem_tensor(cute.make_layout(width), dtype) for _ in range(count)]


def widen_plain(t, width: int) -> list:
    """The bf16 elements of a register tensor as fp32 values, NVVM's own conversion."""
    return [Float32(t[i]) for i in range(width)]


def widen(t, width: int) -> list:
    """The bf16 elements of a register tensor as fp32 values: pairs from 32-bit words where width is even (one
    shift and one mask per pair)."""
    if width % 2:
        return widen_plain(t, width)
    words = cute.recast_tensor(t, cutlass.Uint32)
    out = []
    for j in range(width // 2):
        out += [bf16_lo(words[j]), bf16_hi(words[j])]
    return out


@cute.jit
def find_segment(cuc: cute.Tensor, B: Int32, r: Int32) -> Int32:
    """Largest b in [0, B-1] with cu_seqlens_comp[b] <= r (skips empty segments)."""
    lo = Int32(0)
    hi = B - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if cuc[mid] <= r:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cute.jit
def real_rows(seg, N: Int32) -> Int32:
    """Rows that are produced and real: ``min(cu_seqlens_comp[B], N)`` (rows at or past total_comp never are).

    ``cu_seqlens[0]`` is loaded with the count and used: that brings the line of cu_seqlens into L1 with it, so
    that a row's first token (``cu_seqlens[b] + j * ratio``, read after the search over cu_seqlens_comp) costs no
    dependent L2 trip of its own before a CTA's first window loads (a prefetch is a hint the hardware may drop). A
    negative ``cu_seqlens[0]`` (outside the contract, which has it 0) counts no real rows."""
    nreal = cutlass.min(seg.cuc[seg.count], N)
    if seg.cu[0] < 0:
        nreal = Int32(0)
    return nreal


@cute.jit
def row_token(seg, r, ratio: cutlass.Constexpr):
    """(b, j, t) of a row ``r``: its segment (the binary search), its group in it and its first own token
    ``cu_seqlens[b] + j * ratio`` (int32; not yet guarded)."""
    b = find_segment(seg.cuc, seg.count, r)
    j = r - seg.cuc[b]
    return b, j, seg.cu[b] + j * ratio


@cute.jit
def first_group(j, t0, ratio: cutlass.Constexpr):
    """Whether row group ``j`` with first own token ``t0`` reads no previous half: a segment's first group, and
    any group whose previous half would start below token 0."""
    return (j <= 0) | (t0 < ratio)


@cute.jit
def locate_row(seg, r, T: Int32, ratio: cutlass.Constexpr):
    """(b, t0, first, real) of a row ``r`` below ``real_rows``: its segment (the binary search), its first own token,
    whether its window is its segment's first group, and the bounds guard. A row whose own tokens
    ``[t0, t0 + ratio)`` leave ``[0, T)`` (malformed offsets; a wrapped int32 t0 too) is computed as a padding row:
    ``t0 = 0``, first group, ``real`` False (no gradient). The previous half is read only where ``j > 0`` and
    ``t0 >= ratio``, so inside ``[0, T)`` as well. A few compares per row, none per element."""
    b, j, t = row_token(seg, r, ratio)
    real = (t >= 0) & (t <= T - ratio)
    t0 = Int32(0)
    if real:
        t0 = t
    # A guarded row has t0 = 0 < ratio: first.
    first = first_group(j, t0, ratio)
    return b, t0, first, real


# The first token of a row that is not located: outside every ``first_tokens`` bound.
UNLOCATED = -1


def first_tokens(T: Int32, ratio: int) -> Int32:
    """The bound of ``inside``: the ``T - ratio + 1`` first tokens whose rows stay in ``[0, T)``, none where
    ``T < ratio`` (clamped at 0, so that it stays below ``UNLOCATED`` read as unsigned)."""
    return cutlass.max(T - ratio + 1, Int32(0))


@cute.jit
def inside(t0, bound):
    """``locate_row``'s bounds guard as one unsigned compare of the row's first token: ``0 <= t0 < bound``
    (``first_tokens``); false for ``UNLOCATED`` and for every t0 outside, a wrapped int32 one too. A kernel can
    recompute it from t0 wherever it needs it instead of keeping a predicate alive across its row loop."""
    return cutlass.Uint32(t0) < cutlass.Uint32(bound)


@cute.jit
def last_produced(seg, b, r, N: Int32):
    """Whether row ``r`` of segment ``b`` is the last row its segment produces: rows at or past total_comp ``N``
    are not produced, so with total_comp below the real row count it is the last one below it. That row zeroes
    the segment's tail (``zeros.ZeroStores``)."""
    return r == cutlass.min(seg.cuc[b + 1], N) - 1


@cute.jit
def segment_owner(seg, b, r, N: Int32, T: Int32):
    """(last, seg_end) of row ``r`` of segment ``b``: ``last_produced`` and the segment's end clamped to ``T`` (the
    zeros stay inside the operands)."""
    last = last_produced(seg, b, r, N)
    return last, cutlass.min(seg.cu[b + 1], T)


class WindowSlots:
    """One thread's window slots: ``width`` columns from column ``c`` of the ``slots_per_group`` slots of group
    ``g``, visited in batches of ``batch`` slots (``evict_first``: the loads stream, see ``load_evict_first``)."""

    def __init__(self, ratio: int, coff: int, head_dim: int, width: int, batch: int, slots_per_group: int,
                 evict_first: bool):  # fmt: skip
        self.ratio, self.coff, self.head_dim = ratio, coff, head_dim
        self.width, self.batch, self.slots_per_group = width, batch, slots_per_group
        self.evict_first = evict_first

    def slot(self, g, bi: int, k: int):
        """Window slot of entry ``k`` of batch ``bi`` in group ``g``."""
        return g * self.slots_per_group + bi * self.batch + k

    def offset(self, t0, s):
        """Element offset of slot ``s``'s first column (before the thread's column ``c``)."""
        return (t0 - (self.coff - 1) * self.ratio + s) * (self.coff * self.head_dim) + (s // self.ratio) * self.head_dim

    def ape_offset(self, s):
        """Offset of slot ``s``'s ape row and half (before the thread's column ``c``)."""
        return (s % self.ratio) * (self.coff * self.head_dim) + (s // self.ratio) * self.head_dim

    @cute.jit
    def issue(self, kv, score, kvf, scf, bi: cutlass.Constexpr, g, c, active, t0, first):
        """Every load (kv and score) of batch bi, issued before any use; masked slots: kv 0, score -inf."""
        ratio, width = self.ratio, self.width
        for k in cutlass.range_constexpr(self.batch):
            s = self.slot(g, bi, k)
            half = s // ratio
            valid = active
            if cutlass.const_expr(self.coff == 2):
                valid = active & ((half == 1) | (not first))
            kvf[k].fill(0.0)
            scf[k].fill(NEG_INF)
            tok = t0 - (self.coff - 1) * ratio + s
            if valid:
                off = tok * (self.coff * self.head_dim) + half * self.head_dim + c
                if cutlass.const_expr(self.evict_first):
                    kvf[k].store(load_evict_first(kv, off, width))
                    scf[k].store(load_evict_first(score, off, width))
                else:
                    kvf[k].store(vec_view(kv, off, width).load())
                    scf[k].store(vec_view(score, off, width).load())

    @cute.jit
    def load_ape(self, ape, apf, bi: cutlass.Constexpr, g, c, col_ok):
        """ape is small and L1/L2-resident: loaded after the DRAM loads are in flight (0 past head_dim)."""
        for k in cutlass.range_constexpr(self.batch):
            s = self.slot(g, bi, k)
            apf[k].fill(0.0)
            if col_ok:
                apf[k].store(vec_view(ape, self.ape_offset(s) + c, self.width).load())


def bf16_registers(count: int, width: int) -> list:
    """``count`` bf16 register tensors of ``width`` elements (one batch of window slots)."""
    return register_slots(count, width, BFloat16)


@cute.jit
def row_start(seg, r, active, T: Int32, N: Int32, ratio: cutlass.Constexpr):
    """(t0, first) of row ``r`` of ``seg`` (``Segments``): its first own token and whether it is its segment's
    first group. Padding rows (``r >= cu_seqlens_comp[-1]``), rows that fail the bounds guard (``locate_row``) and
    inactive threads take t0 = 0 and behave as a segment's first group."""
    nreal = real_rows(seg, N)
    t0 = Int32(0)
    first = Boolean(True)
    if active & (r < nreal):
        _b, t0, first, _real = locate_row(seg, r, T, ratio)
    return t0, first


class Segments:
    """The pack's segment offsets on the device: ``cu`` (cu_seqlens) and ``cuc`` (cu_seqlens_comp) of ``count``
    segments."""

    def __init__(self, cu: cute.Pointer, cuc: cute.Pointer, count: Int32):
        self.cu = cute.make_tensor(cu, cute.make_layout(count + 1))
        self.cuc = cute.make_tensor(cuc, cute.make_layout(count + 1))
        self.count = count
