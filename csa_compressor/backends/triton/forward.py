"""Triton forward kernel of the compressor pooling (SPEC section 2), plus the device helpers the backward shares.

A program owns ``BLOCK_R`` consecutive output rows times ``BLOCK_D`` columns and
builds a ``[BLOCK_R, K, BLOCK_D]`` window tile, ``K = coff * SP`` slots with
``SP = next_pow2(ratio)``: for coff = 2 slots ``k < SP`` are the previous group
(first ``d`` columns), slots ``k >= SP`` the row's own tokens (last ``d``
columns); coff = 1 has own slots only. Slots ``s >= ratio`` (non-power-of-two
ratios) and columns ``>= head_dim`` are masked. Loads run along columns, so each
(row, slot) reads ``BLOCK_D`` contiguous elements of one token. Every input
element is read by exactly one (row, slot): a row's own tokens' last-``d``
columns and its previous group's first-``d`` columns.

The segment of a row is found on the device by a binary search over
``cu_seqlens_comp``; nothing here reads device memory on the host. The long-window
forward is ``forward_long.py``; the helpers here are shared with it and the backward.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .norm_rope import _load_norm_weight, _rope_tables, _row_norm, _row_rope

# Eviction policy of the forward kernels' window loads (kv, score): read exactly once, so "evict_first"
# (``ld.global.L1::evict_first.L2::cache_hint`` with an evict-first L2 policy) makes the stream replace its own L2
# lines instead of evicting other, possibly dirty, data. (Triton 3.6 rejects the ``.cs`` operator cute uses on
# loads.) The backward kernels measured slower with it and load and store with Triton's default policy.
WINDOW_EVICT = tl.constexpr("evict_first")

# The offset arrays are only read by scalar and gather loads, and the API checks them for 4-byte alignment only: no
# specialisation on their alignment, so that one compiled kernel serves every call (binding.py relies on it).
_OFFSETS = ["cu_ptr", "cu_comp_ptr"]
# The tail's scalar and gather reads: position_start is checked for 4-byte alignment only, rstd is written per row.
_TAIL_OFFSETS = ["pos_ptr", "rstd_ptr"]
# The tail's runtime integer (the tables' rows): any value, one compiled kernel.
_TAIL_INTS = ["max_position"]


@triton.jit
def _segment_of(idx, cu_ptr, B, n_iter):
    """Largest ``b`` in ``[0, B-1]`` with ``cu[b] <= idx`` (``cu[0] == 0 <= idx``).

    "Largest" skips empty segments, as ``searchsorted(right=True) - 1`` does.
    ``n_iter = (B-1).bit_length()`` halvings suffice; extra ones keep ``lo``.
    """
    lo = tl.zeros_like(idx)
    hi = lo + (B - 1)
    for _ in range(n_iter):
        mid = (lo + hi + 1) >> 1
        go = tl.load(cu_ptr + mid) <= idx
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def _exp(x, PRECISE_EXP: tl.constexpr):
    # tl.exp lowers fp32 to ex2.approx on NVIDIA GPUs; libdevice's expf is what torch's softmax uses.
    # The interpreter has no libdevice, and its tl.exp is numpy's (accurate).
    if PRECISE_EXP:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _round(x, dtype: tl.constexpr, MANUAL_RTNE: tl.constexpr):
    """fp32 -> ``dtype``, round to nearest even.

    The interpreter's own fp32 -> bf16 cast truncates, so under it (``MANUAL_RTNE``)
    bf16 is rounded on the bit pattern; NaN stays NaN (quietened).
    """
    if MANUAL_RTNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _slot_columns(
    col_start,
    RATIO: tl.constexpr,
    SP: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
):
    """Per slot ``k``: ``s = k % SP``, ``own``, ``slot_ok``; per (slot, column): the kv/score column ``col``."""
    k = tl.arange(0, COFF * SP)
    s = k % SP
    own = k >= (COFF - 1) * SP
    # Same values as col_start + arange, but provably contiguous only in runs of VEC: this caps the vector
    # width (and the per-thread column count) Triton picks for the tile at VEC elements.
    lane = tl.arange(0, BLOCK_D)
    cols = col_start + (lane // VEC) * VEC + lane % VEC
    # Own slots read the last d columns (coff 2), previous-group slots the first d.
    col = (own.to(tl.int32) * ((COFF - 1) * HEAD_DIM))[:, None] + cols[None, :]  # [K, BLOCK_D]
    return s, own, s < RATIO, cols, cols < HEAD_DIM, col


@triton.jit
def _load_ape(
    ape_ptr,
    col_start,
    RATIO: tl.constexpr,
    SP: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
):
    """APE of every (slot, column) of a column block, ``[K, 1, BLOCK_D]`` fp32 (loaded once per program)."""
    s, _own, slot_ok, _cols, col_ok, col = _slot_columns(col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
    ape = tl.load(ape_ptr + s[:, None] * (COFF * HEAD_DIM) + col, mask=slot_ok[:, None] & col_ok[None, :], other=0.0)
    return ape.to(tl.float32)[:, None, :]


@triton.jit
def _real_rows(cu_comp_ptr, B, N):
    """Rows that are produced and real: ``min(cu_seqlens_comp[B], N)`` (rows at or past total_comp never are)."""
    return tl.minimum(tl.load(cu_comp_ptr + B), N)


@triton.jit
def _guard_row(t0, j, is_real, T, RATIO: tl.constexpr):
    """``(t0, has_prev, is_real)`` of rows (scalar or vector) after the bounds guard.

    A real row whose own tokens ``[t0, t0 + ratio)`` leave ``[0, T)`` (malformed offsets; a wrapped int32 ``t0``
    too) is computed as a padding row: ``t0 = 0``, no previous group, no gradient. The previous group is read only
    when ``j > 0`` and ``t0 >= ratio``, so it lies in ``[0, T)`` as well. One compare per row, not per element.
    """
    is_real = is_real & (t0 >= 0) & (t0 <= T - RATIO)
    t0 = tl.where(is_real, t0, 0)
    return t0, is_real & (j > 0) & (t0 >= RATIO), is_real


@triton.jit
def _program_segment(row_first, n_rows, N, B, n_iter, n_real, cu_ptr, cu_comp_ptr):
    """Whether a program's rows ``[row_first, row_first + n_rows)`` (clipped to N) are real rows of one segment.

    If so (the common case: segments are long), every row's first token is
    ``tok0 + (r - comp0) * ratio`` and the tiles need no per-row search. Returns
    ``(uniform, comp0, tok0, seg)``, ``seg`` the segment of the first row.
    """
    row_last = tl.minimum(row_first + n_rows, N) - 1
    seg_first = _segment_of(row_first, cu_comp_ptr, B, n_iter)
    seg_last = _segment_of(row_last, cu_comp_ptr, B, n_iter)
    uniform = (seg_first == seg_last) & (row_last < n_real)
    return uniform, tl.load(cu_comp_ptr + seg_first), tl.load(cu_ptr + seg_first), seg_first


@triton.jit
def _positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO: tl.constexpr):
    """Row positions ``position_start[b] + j * ratio`` (``pos_ptr`` None: zeros for ``position_start``); padding
    rows (``is_real`` false) 0. ``uniform``: every row is in segment ``seg0``, whose first row is ``comp0``."""
    if uniform:
        j = rows - comp0
        seg = seg0 + rows * 0
    else:
        seg = _segment_of(rows, cu_comp_ptr, B, n_iter)
        j = rows - tl.load(cu_comp_ptr + seg)
    pos = j * RATIO
    if pos_ptr is not None:
        pos += tl.load(pos_ptr + seg)
    return tl.where(is_real, pos, 0)


@triton.jit
def _tile(
    row_start,
    col_start,
    row_end,
    T,
    B,
    n_iter,
    n_real,
    uniform,
    comp0,
    tok0,
    cu_ptr,
    cu_comp_ptr,
    RATIO: tl.constexpr,
    SP: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
):
    """Rows ``row_start + [0, BLOCK_R)`` x one column block: row indices/masks, slot validity, kv/score offsets.

    The window tile is ``[K, BLOCK_R, BLOCK_D]`` with the slots outermost: Triton
    spreads lanes over columns first, then rows, so for small ratios every slot of a
    (row, column) sits in one thread and the softmax reductions are in-thread and
    sequential (the reference's order). Rows at or past ``row_end`` (N, or 0 for no tile) are masked; rows at or
    past ``n_real`` and rows that fail the bounds guard are padding rows (the first group of a segment at token 0).
    """
    W: tl.constexpr = COFF * HEAD_DIM
    rows = row_start + tl.arange(0, BLOCK_R)
    row_ok = rows < row_end
    if uniform:
        j = rows - comp0
        t0 = tok0 + j * RATIO
    else:
        seg = _segment_of(rows, cu_comp_ptr, B, n_iter)
        j = rows - tl.load(cu_comp_ptr + seg)
        t0 = tl.load(cu_ptr + seg) + j * RATIO
    t0, has_prev, is_real = _guard_row(t0, j, rows < n_real, T, RATIO)
    s, own, slot_ok, cols, col_ok, col = _slot_columns(col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
    valid = slot_ok[:, None] & (own[:, None] | has_prev[None, :])  # [K, BLOCK_R]
    tok = t0[None, :] + (s - tl.where(own, 0, RATIO))[:, None]
    tok = tl.where(valid, tok, 0)
    offs = tok[:, :, None] * W + col[:, None, :]
    lmask = (valid & row_ok[None, :])[:, :, None] & col_ok[None, None, :]
    return rows, row_ok, is_real, cols, col_ok, slot_ok, valid, offs, lmask


@triton.jit
def _sum_slots(x, TORCH_ORDER: tl.constexpr):
    """Sum over the slot axis of ``[K, BLOCK_R, BLOCK_D]``.

    ``TORCH_ORDER`` (slots in-thread, ``K % 4 == 0``): four interleaved running sums
    ``acc_i = x_i + x_{i+4} + ...`` combined as ``((acc_0 + acc_1) + acc_2) + acc_3``,
    the order of PyTorch's CUDA reduction kernel (four accumulators per thread) that
    the reference's ``.sum(dim=1)`` runs; otherwise Triton's own order.
    """
    if TORCH_ORDER:
        K: tl.constexpr = x.shape[0]
        parts = tl.sum(tl.reshape(x, [K // 4, 4, x.shape[1], x.shape[2]]), axis=0)
        return tl.sum(parts, axis=0)
    else:
        return tl.sum(x, axis=0)


@triton.jit
def _softmax(kv, score, ape, valid, PRECISE_EXP: tl.constexpr):
    """Values (fp32) and softmax weights of a loaded tile, in the reference's operation order."""
    v = kv.to(tl.float32)
    # logit = score + ape, -inf where the slot does not exist.
    x = tl.where(valid[:, :, None], score.to(tl.float32) + ape, float("-inf"))
    m = tl.max(x, axis=0)
    e = _exp(x - m[None, :, :], PRECISE_EXP)
    total = tl.sum(e, axis=0)
    # p = e / total, correctly rounded (as the reference's division), with one division per (row, column):
    # inv = RN(1/total), q = RN(e*inv), one Newton-Markstein correction. e <= 1 <= total <= K, so no overflow.
    inv = tl.math.div_rn(tl.full(total.shape, 1.0, tl.float32), total)[None, :, :]
    q = e * inv
    resid = tl.fma(-total[None, :, :], q, e)
    return v, tl.fma(resid, inv, q)


@triton.jit
def _tile_positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO: tl.constexpr,
                    ROPE_DIM: tl.constexpr):  # fmt: skip
    """The rotary positions of the tile's rows (``_positions``; zeros without a rotation, which reads none)."""
    pos = rows * 0
    if ROPE_DIM > 0:
        pos = _positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO)
    return pos


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "tiles_per_prog", *_TAIL_INTS],
    do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS,
)
def csa_fwd_kernel(
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, out_ptr, N, T, B, n_iter, tiles_per_prog,
    norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps,
    RATIO: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr, N_COL: tl.constexpr, PRECISE_EXP: tl.constexpr,
    MANUAL_RTNE: tl.constexpr, TORCH_ORDER: tl.constexpr, HAS_NORM: tl.constexpr = False, ROPE_DIM: tl.constexpr = 0,
    ROPE_INTERLEAVED: tl.constexpr = True, TABLES_FIRST: tl.constexpr = False,
):  # fmt: skip
    """Grid: ``ceil(N / (BLOCK_R * tiles_per_prog)) * N_COL`` programs; neighbours share rows.

    Each program walks ``tiles_per_prog`` row tiles and loads tile ``i + 1`` before
    computing tile ``i``, so a load is always in flight behind the arithmetic.

    The tail (``HAS_NORM``, ``ROPE_DIM > 0``; None pointers without it): the program owns whole rows
    (``N_COL == 1``), the pooled fp32 rows are normalised and rotated before the one rounding, and ``rstd_ptr``
    (when not None) receives each row's ``rsqrt(mean(x * x) + eps)``. ``TABLES_FIRST``: the rows' rotation tables
    are read before the pooling's math, whose work then hides their latency (one-warp programs; in wider ones the
    registers held across the math cost more than the latency saved).
    """
    TAIL: tl.constexpr = HAS_NORM or ROPE_DIM > 0
    pid = tl.program_id(0)
    rp = pid // N_COL
    col_start = (pid % N_COL) * BLOCK_D
    n_real = _real_rows(cu_comp_ptr, B, N)
    row_base = rp * tiles_per_prog * BLOCK_R
    uniform, comp0, tok0, seg0 = _program_segment(
        row_base, tiles_per_prog * BLOCK_R, N, B, n_iter, n_real, cu_ptr, cu_comp_ptr
    )
    ape = _load_ape(ape_ptr, col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
    if TAIL:
        tl.static_assert(N_COL == 1, "the tail needs whole rows per program")
        _s, _own, _so, cols, col_ok, _col = _slot_columns(col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
        w = _load_norm_weight(norm_w_ptr, cols, col_ok, HAS_NORM)
    _r, _ro, _ir, _c, _co, _so, _v, offs, lmask = _tile(
        row_base, col_start, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr,
        RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC,
    )  # fmt: skip
    kv_next = tl.load(kv_ptr + offs, mask=lmask, other=0.0, eviction_policy=WINDOW_EVICT)
    score_next = tl.load(score_ptr + offs, mask=lmask, other=0.0, eviction_policy=WINDOW_EVICT)
    for it in range(tiles_per_prog):
        kv_cur = kv_next
        score_cur = score_next
        row_start = row_base + it * BLOCK_R
        rows, row_ok, is_real, cols, col_ok, _so, valid, _o, _m = _tile(
            row_start, col_start, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr,
            RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC,
        )  # fmt: skip
        _r, _ro, _ir, _c, _co, _so, _v, offs, lmask = _tile(
            row_start + BLOCK_R, col_start, tl.where(it + 1 < tiles_per_prog, N, 0), T, B, n_iter, n_real, uniform,
            comp0, tok0, cu_ptr, cu_comp_ptr, RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC,
        )  # fmt: skip
        kv_next = tl.load(kv_ptr + offs, mask=lmask, other=0.0, eviction_policy=WINDOW_EVICT)
        score_next = tl.load(score_ptr + offs, mask=lmask, other=0.0, eviction_policy=WINDOW_EVICT)
        if TAIL and TABLES_FIRST:
            pos = _tile_positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO, ROPE_DIM)
            cos, sin = _rope_tables(pos, cols, col_ok, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM,
                                    ROPE_INTERLEAVED)  # fmt: skip
        v, p = _softmax(kv_cur, score_cur, ape, valid, PRECISE_EXP)
        out = _sum_slots(v * p, TORCH_ORDER)
        if TAIL:
            if not TABLES_FIRST:
                pos = _tile_positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO,
                                      ROPE_DIM)  # fmt: skip
            out, r = _row_norm(out, w, norm_eps, HEAD_DIM, HAS_NORM)
            if not TABLES_FIRST:
                cos, sin = _rope_tables(pos, cols, col_ok, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM,
                                        ROPE_INTERLEAVED)  # fmt: skip
            out = _row_rope(out, cols, cos, sin, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
            if rstd_ptr is not None:
                tl.store(rstd_ptr + rows, r, mask=row_ok)
        omask = row_ok[:, None] & col_ok[None, :]
        optrs = out_ptr + rows[:, None] * HEAD_DIM + cols[None, :]
        tl.store(optrs, _round(out, out_ptr.dtype.element_ty, MANUAL_RTNE), mask=omask)


# Exponentials of the long-window kernels: exp2 of logits scaled by log2(e) (ex2.approx on NVIDIA GPUs).
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _row_start(row, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO: tl.constexpr):
    """Scalar ``(t0, has_prev, is_real, row_ok)`` of output row ``row`` (SPEC 2 and the bounds guard of
    ``_guard_row``; padding rows start at token 0)."""
    row_ok = row < N
    if uniform:
        j = row - comp0
        t0 = tok0 + j * RATIO
    else:
        seg = _segment_of(tl.minimum(row, n_real), cu_comp_ptr, B, n_iter)
        j = row - tl.load(cu_comp_ptr + seg)
        t0 = tl.load(cu_ptr + seg) + j * RATIO
    t0, has_prev, is_real = _guard_row(t0, j, row < n_real, T, RATIO)
    return t0, has_prev, is_real, row_ok


@triton.jit
def _row_position(
    row, N, T, B, n_iter, n_real, uniform, comp0, tok0, seg0, cu_ptr, cu_comp_ptr, pos_ptr, RATIO: tl.constexpr
):  # fmt: skip
    """``(position, is_real)`` of output row ``row``, the position a ``[1]`` tensor (0 for padding rows and rows
    failing the guard)."""
    _t, _hp, is_real, _ok = _row_start(row, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO)
    rows = tl.zeros([1], tl.int32) + row
    return _positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO), is_real
