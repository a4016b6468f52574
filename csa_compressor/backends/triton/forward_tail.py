"""The fused tail's forward epilogue of long windows: RMSNorm and RoPE over the pooled rows the statistics forward
wrote (``stats[:, 2]``, fp32), then the one rounding.

A long window's pooling programs own a column block of a row, at the tiling that reads the window fastest; the
tail needs whole rows (the norm's sum of squares, the rotation's partner column). So the long-window forward with a
tail is the pooling's own statistics forward, then this kernel over whole rows: one more read of ``N x head_dim``
fp32, small against the window's. The tail's arithmetic is ``norm_rope``'s ``_row_norm`` and ``_row_rope``, the short-window fused
forward's, on the same fp32 pooled values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import _OFFSETS, _TAIL_INTS, _TAIL_OFFSETS, _guard_row, _positions, _real_rows, _round, _segment_of
from .norm_rope import _load_norm_weight, _rope_tables, _row_norm, _row_rope


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", *_TAIL_INTS], do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS
)
def csa_tail_fwd_kernel(
    stats_ptr, out_ptr, cu_ptr, cu_comp_ptr, N, T, B, n_iter,
    norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    MANUAL_RTNE: tl.constexpr, HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """``out`` ``(N, HEAD_DIM)`` of ``BLOCK_R`` whole rows per program: the pooled rows ``stats[:, 2]`` normalised
    and rotated at each row's position (padding rows and rows failing the bounds guard: position 0), rounded once;
    ``rstd_ptr`` (when not None) receives each row's ``rsqrt(mean(x * x) + eps)`` (1 without a norm)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < HEAD_DIM
    xmask = row_ok[:, None] & col_ok[None, :]
    # 64-bit offsets: the API bounds N * HEAD_DIM below 2^31, not 3 * N * HEAD_DIM.
    x_offs = rows.to(tl.int64)[:, None] * (3 * HEAD_DIM) + 2 * HEAD_DIM + cols[None, :]
    pos = rows * 0
    if ROPE_DIM > 0:
        seg = _segment_of(rows, cu_comp_ptr, B, n_iter)
        j = rows - tl.load(cu_comp_ptr + seg)
        t0 = tl.load(cu_ptr + seg) + j * RATIO
        _t0, _hp, is_real = _guard_row(t0, j, rows < _real_rows(cu_comp_ptr, B, N), T, RATIO)
        pos = _positions(rows, is_real, True, seg, rows - j, cu_comp_ptr, pos_ptr, B, n_iter, RATIO)
    # The tables first: their reads (after the position's) overlap the rows' and the norm's.
    cos, sin = _rope_tables(pos, cols, col_ok, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
    x = tl.load(stats_ptr + x_offs, mask=xmask, other=0.0)
    w = _load_norm_weight(norm_w_ptr, cols, col_ok, HAS_NORM)
    y, r = _row_norm(x, w, norm_eps, HEAD_DIM, HAS_NORM)
    y = _row_rope(y, cols, cos, sin, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
    if rstd_ptr is not None:
        tl.store(rstd_ptr + rows, r, mask=row_ok)
    optrs = out_ptr + rows[:, None] * HEAD_DIM + cols[None, :]
    tl.store(optrs, _round(y, out_ptr.dtype.element_ty, MANUAL_RTNE), mask=xmask)
