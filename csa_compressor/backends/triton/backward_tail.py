"""Device helpers of the fused tail in the backward kernels: the pooling's upstream gradient ``dx`` from
``grad_out`` (the rotation turned back, the norm's input gradient) and the rows' terms of the weight's gradient.

Short windows (``_tail_dx``): a program owns whole rows and recomputes their pooled values from the window it
holds anyway. The statistics backward (``_stats_tail_dx``): a program owns a column block of its rows; the norm's
two row reductions (``rsqrt(mean(x * x) + eps)``, ``mean(x * w * dy)``) run over the whole row, read from the
forward's saved pooled row ``stats[:, 2]`` and ``grad_out``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import _positions, _sum_slots
from .norm_rope import _norm_backward, _row_rstd, _turn_back


@triton.jit
def _tail_dx(
    v, p, g, rows, row_ok, is_real, cols, col_ok, w, uniform, seg0, comp0, B, n_iter, cu_comp_ptr, grad_out_ptr, norm_eps,
    cos_ptr, sin_ptr, pos_ptr, rstd_ptr, RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, TORCH_ORDER: tl.constexpr,
    HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """The pooling's upstream gradient ``dx`` of a short-window tile (``[BLOCK_R, BLOCK_D]``, whole rows) from its
    ``grad_out`` rows ``g`` (0 on padding rows), and the rows' terms of the weight's gradient (None without a norm).
    The pooled rows are the forward's: the same window values, weights and slot order."""
    dy = g
    if ROPE_DIM > 0:
        pos = _positions(rows, is_real, uniform, seg0, comp0, cu_comp_ptr, pos_ptr, B, n_iter, RATIO)
        gmask = is_real[:, None] & col_ok[None, :]
        dy = _turn_back(g, grad_out_ptr, rows, cols, gmask, pos, cos_ptr, sin_ptr, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
    if HAS_NORM:
        x = _sum_slots(v * p, TORCH_ORDER)
        if rstd_ptr is not None:
            r = tl.load(rstd_ptr + rows, mask=row_ok, other=1.0)
        else:
            r = _row_rstd(x, norm_eps, HEAD_DIM)
        return _norm_backward(x, dy, r, w, HEAD_DIM)
    else:
        return dy, None


@triton.jit
def _stats_row_scalars(
    row, pos, x_ptr, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr, rstd_ptr,
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
            g, grad_out_ptr, rows, cols, ok[None, :], pos, cos_ptr, sin_ptr, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED
        )
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
    g, o, row, pos, cols, col_ok, w, x_ptr, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr, rstd_ptr,
    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    """The pooling's upstream gradient ``dx`` of one row's columns ``cols`` (``[1, BLOCK_D]``) from its ``grad_out``
    ``g`` and pooled values ``o`` (the statistics' fp32 output), and the row's terms of the weight's gradient
    (None without a norm)."""
    rows = tl.zeros([1], tl.int32) + row
    dy = _turn_back(
        g, grad_out_ptr, rows, cols, col_ok[None, :], pos, cos_ptr, sin_ptr, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED
    )  # fmt: skip
    if HAS_NORM:
        r, mean = _stats_row_scalars(
            row, pos, x_ptr, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr, rstd_ptr, HEAD_DIM, ROPE_DIM,
            ROPE_INTERLEAVED, ROW_BLOCK,
        )  # fmt: skip
        rc = r[:, None]
        wdy = w[None, :] * dy
        return rc * wdy - o * (rc * rc * rc) * mean[:, None], dy * o * rc
    else:
        return dy, None
