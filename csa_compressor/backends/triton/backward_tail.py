"""Device helpers of the fused tail in the backward kernels: the pooling's upstream gradient ``dx`` from
``grad_out`` (the rotation turned back, the norm's input gradient) and the rows' terms of the weight's gradient.

Short windows (``_tail_dx``): a program owns whole rows and recomputes their pooled values from the window it
holds anyway. The statistics backward, whose programs own a column block of their rows, either reduces the
norm's two row sums (``rsqrt(mean(x * x) + eps)``, ``mean(x * w * dy)``) over the whole row in every program
(``_stats_tail_dx``: no other launch, for grids of one wave), or runs on ``dx`` that ``csa_tail_dx_kernel`` wrote
first (the statistics kernel unchanged, at its own register count: for larger grids). Both read the pooled row
from the forward's ``stats[:, 2]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import _OFFSETS, _TAIL_INTS, _TAIL_OFFSETS, _guard_row, _positions, _real_rows, _segment_of, _sum_slots
from .norm_rope import _load_norm_weight, _norm_backward, _row_rstd, _turn_back


@triton.jit
def _tail_dx(
    v, p, g, rows, row_ok, is_real, cols, col_ok, w, uniform, seg0, comp0, B, n_iter, cu_comp_ptr, grad_out_ptr,
    norm_eps, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, RATIO: tl.constexpr, HEAD_DIM: tl.constexpr,
    TORCH_ORDER: tl.constexpr, HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """The pooling's upstream gradient ``dx`` of a short-window tile (``[BLOCK_R, BLOCK_D]``, whole rows) from its
    ``grad_out`` rows ``g`` (0 on padding rows), and the rows' terms of the weight's gradient (None without a norm).
    The pooled rows are the forward's: the same window values, weights and slot order."""
    dy = g
    if ROPE_DIM > 0:
        pos = _positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO)
        gmask = is_real[:, None] & col_ok[None, :]
        dy = _turn_back(
            g, grad_out_ptr, rows, cols, gmask, pos, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM,
            ROPE_INTERLEAVED,
        )  # fmt: skip
    if HAS_NORM:
        x = _sum_slots(v * p, TORCH_ORDER)
        if rstd_ptr is not None:
            r = tl.load(rstd_ptr + rows, mask=row_ok, other=1.0)
        else:
            r = _row_rstd(x, norm_eps, HEAD_DIM)
        return _norm_backward(x, dy, r, w, HEAD_DIM)
    else:
        return dy, dy  # no norm: an unused tensor for the weight's terms (Triton 3.6 returns no None)


@triton.jit
def _stats_row_scalars(
    row, pos, x_ptr, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr, max_position, rstd_ptr,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr, ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    """``(r, mean(x w dy))`` of row ``row`` (``[1]`` each) over all its columns, ``ROW_BLOCK`` at a time: ``x`` the
    forward's pooled row (``x_ptr``: ``stats[row, 2]``), ``dy`` its ``grad_out`` turned back; ``r`` read from
    ``rstd_ptr`` when not None."""
    rows = tl.zeros([1], tl.int32) + row
    ss = tl.zeros([1, ROW_BLOCK], tl.float32)
    dot = tl.zeros([1, ROW_BLOCK], tl.float32)
    for c0 in tl.static_range(0, HEAD_DIM, ROW_BLOCK):
        cols = c0 + tl.arange(0, ROW_BLOCK)
        ok = cols < HEAD_DIM
        x = tl.load(x_ptr + cols, mask=ok, other=0.0)[None, :]
        g = tl.load(grad_out_ptr + row * HEAD_DIM + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        dy = _turn_back(
            g, grad_out_ptr, rows, cols, ok[None, :], pos, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM,
            ROPE_INTERLEAVED,
        )  # fmt: skip
        w = tl.load(norm_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        ss += x * x
        dot += x * (w * dy)
    d = tl.full([1], HEAD_DIM, tl.float32)
    if rstd_ptr is not None:
        r = tl.load(rstd_ptr + rows)
    else:
        ms = tl.math.div_rn(tl.sum(ss, axis=1), d)
        r = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.sqrt_rn(ms + norm_eps))
    return r, tl.math.div_rn(tl.sum(dot, axis=1), d)


@triton.jit
def _stats_tail_dx(
    g, o, row, pos, cols, col_ok, w, x_ptr, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr, max_position,
    rstd_ptr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    """The pooling's upstream gradient ``dx`` of one row's columns ``cols`` (``[1, BLOCK_D]``) from its ``grad_out``
    ``g`` and pooled values ``o`` (the statistics' fp32 output), and the row's terms of the weight's gradient
    (None without a norm)."""
    rows = tl.zeros([1], tl.int32) + row
    dy = _turn_back(
        g, grad_out_ptr, rows, cols, col_ok[None, :], pos, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM,
        ROPE_INTERLEAVED
    )  # fmt: skip
    if HAS_NORM:
        r, mean = _stats_row_scalars(
            row, pos, x_ptr, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr, max_position, rstd_ptr, HEAD_DIM,
            ROPE_DIM, ROPE_INTERLEAVED, ROW_BLOCK,
        )  # fmt: skip
        rc = r[:, None]
        wdy = w[None, :] * dy
        return rc * wdy - o * (rc * rc * rc) * mean[:, None], dy * o * rc
    else:
        return dy, dy  # no norm: an unused tensor for the weight's terms (Triton 3.6 returns no None)


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", *_TAIL_INTS], do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS
)
def csa_tail_dx_kernel(
    stats_ptr, grad_out_ptr, dx_ptr, wws_ptr, cu_ptr, cu_comp_ptr, N, T, B, n_iter,
    norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """The pooling's upstream gradient ``dx`` ``(N, HEAD_DIM)`` fp32 of the statistics backward, ``BLOCK_R`` whole
    rows per program: ``grad_out`` turned back, then the norm's input gradient from the pooled rows ``stats[:, 2]``
    (and ``rstd_ptr`` when not None). Padding rows (and rows failing the bounds guard) get 0 and add nothing to the
    weight's gradient, whose partial of the program's rows goes to row ``pid`` of ``wws_ptr``."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < HEAD_DIM
    seg = _segment_of(rows, cu_comp_ptr, B, n_iter)
    j = rows - tl.load(cu_comp_ptr + seg)
    _t0, _hp, is_real = _guard_row(tl.load(cu_ptr + seg) + j * RATIO, j, rows < _real_rows(cu_comp_ptr, B, N), T, RATIO)
    gmask = is_real[:, None] & col_ok[None, :]
    g = tl.load(grad_out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=gmask, other=0.0).to(tl.float32)
    dx = g
    if ROPE_DIM > 0:
        pos = _positions(rows, is_real, True, seg, rows - j, cu_comp_ptr, pos_ptr, B, n_iter, RATIO)
        dx = _turn_back(
            g, grad_out_ptr, rows, cols, gmask, pos, cos_ptr, sin_ptr, max_position, HEAD_DIM, ROPE_DIM,
            ROPE_INTERLEAVED,
        )  # fmt: skip
    if HAS_NORM:
        xmask = row_ok[:, None] & col_ok[None, :]
        x_offs = rows.to(tl.int64)[:, None] * (3 * HEAD_DIM) + 2 * HEAD_DIM + cols[None, :]
        x = tl.load(stats_ptr + x_offs, mask=xmask, other=0.0)
        if rstd_ptr is not None:
            r = tl.load(rstd_ptr + rows, mask=row_ok, other=1.0)
        else:
            r = _row_rstd(x, norm_eps, HEAD_DIM)
        w = _load_norm_weight(norm_w_ptr, cols, col_ok, HAS_NORM)
        dx, gw = _norm_backward(x, dx, r, w, HEAD_DIM)
        dx = tl.where(is_real[:, None], dx, 0.0)
        tl.store(wws_ptr + pid * HEAD_DIM + cols, tl.sum(tl.where(is_real[:, None], gw, 0.0), axis=0), mask=col_ok)
    tl.store(dx_ptr + rows[:, None] * HEAD_DIM + cols[None, :], dx, mask=row_ok[:, None] & col_ok[None, :])
