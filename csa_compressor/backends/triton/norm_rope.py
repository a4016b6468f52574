"""Device helpers of the fused tail (``csa_compressor.tail``): RMSNorm over ``head_dim``, then RoPE on the last
``rope_dim`` columns, in the forward kernels and turned back in the backward kernels.

Every helper is specialised on the tail's constexprs (``HAS_NORM``, ``ROPE_DIM``, ``ROPE_INTERLEAVED``,
``HAS_POSITIONS``); a kernel launched without a tail gets ``None`` for the tail's pointers and never calls them, so
its code is the pooling's alone. A forward program owns whole rows when a tail is given (``BLOCK_D`` covers
``head_dim``): the row's sum of squares is a reduction over registers, and the rotation's partner column is in the
same program. The backward reads the partner of ``grad_out`` from memory instead (it is an input), so its rotation
needs no exchange between threads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_columns(cols, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr):
    """Per column: in the rotary block, first of its pair, angle index, partner column (itself outside the block)."""
    BASE: tl.constexpr = HEAD_DIM - ROPE_DIM
    HALF: tl.constexpr = ROPE_DIM // 2
    local = cols - BASE
    is_rope = (local >= 0) & (cols < HEAD_DIM)
    local = tl.where(is_rope, local, 0)
    if ROPE_INTERLEAVED:
        first = (local % 2) == 0
        angle = local // 2
        partner = tl.where(first, cols + 1, cols - 1)
    else:
        first = local < HALF
        angle = tl.where(first, local, local - HALF)
        partner = tl.where(first, cols + HALF, cols - HALF)
    return is_rope, first, angle, tl.where(is_rope, partner, cols)


@triton.jit
def _angles(pos, angle, mask, cos_ptr, sin_ptr, max_position, ROPE_DIM: tl.constexpr):
    """``cos`` and ``sin`` of every (row, column) of a ``[R, D]`` tile (``pos`` ``[R]``, ``angle``/``mask`` of the
    columns; 1 and 0 where ``mask`` is false). A row whose position is outside the tables, ``[0, max_position)``,
    gets 1 and 0 too (no rotation) and reads nothing: one compare per row, whatever ``position_start`` holds."""
    inside = (pos >= 0) & (pos < max_position)
    offs = pos[:, None] * (ROPE_DIM // 2) + angle
    mask = mask & inside[:, None]
    cos = tl.load(cos_ptr + offs, mask=mask, other=1.0)
    sin = tl.load(sin_ptr + offs, mask=mask, other=0.0)
    return cos, sin


@triton.jit
def _row_rstd(x, eps, HEAD_DIM: tl.constexpr):
    """``rsqrt(mean(x * x) + eps)`` per row of ``[R, D]`` (zeros past ``head_dim``), correctly rounded steps."""
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), tl.full([x.shape[0]], HEAD_DIM, tl.float32))
    return tl.math.div_rn(tl.full([x.shape[0]], 1.0, tl.float32), tl.sqrt_rn(ms + eps))


@triton.jit
def _rotate(y, cos, sin, is_rope, first, partner, ROPE_INTERLEAVED: tl.constexpr, EVEN_PAIRS: tl.constexpr):
    """The forward rotation of the rotary pairs of ``y`` ``[R, D]``: ``(a, b) -> (a cos - b sin, a sin + b cos)``.

    ``EVEN_PAIRS`` (interleaved pairs starting on an even column): the pairs are adjacent elements, split and joined
    in place. Otherwise the partner of each column is gathered across the row.
    """
    R: tl.constexpr = y.shape[0]
    D: tl.constexpr = y.shape[1]
    if ROPE_INTERLEAVED and EVEN_PAIRS:
        a, b = tl.split(tl.reshape(y, [R, D // 2, 2]))
        ca, cb = tl.split(tl.reshape(cos, [R, D // 2, 2]))
        sa, sb = tl.split(tl.reshape(sin, [R, D // 2, 2]))
        # Pairs outside the block have cos 1 and sin 0: a*1 - b*0 is a, bitwise, for finite b.
        ra, rb = tl.split(tl.reshape(tl.broadcast_to(is_rope[None, :], [R, D]), [R, D // 2, 2]))
        a2 = tl.where(ra, a * ca - b * sa, a)
        b2 = tl.where(rb, a * sb + b * cb, b)
        return tl.reshape(tl.join(a2, b2), [R, D])
    else:
        other = tl.gather(y, tl.broadcast_to(partner[None, :], [R, D]), 1)
        # first (a): a cos - b sin; second (b): a sin + b cos.
        rotated = tl.where(first[None, :], y * cos - other * sin, other * sin + y * cos)
        return tl.where(is_rope[None, :], rotated, y)


@triton.jit
def _rope_tables(pos, cols, col_ok, cos_ptr, sin_ptr, max_position,
                 HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr):  # fmt: skip
    """``cos`` and ``sin`` of every (row, column) of the rows at ``pos`` (``_angles``); placeholders without a
    rotation. Kept apart from ``_row_rope`` so that a kernel chooses when it issues these reads."""
    if ROPE_DIM > 0:
        is_rope, _first, angle, _partner = _rope_columns(cols, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
        return _angles(pos, angle, (is_rope & col_ok)[None, :], cos_ptr, sin_ptr, max_position, ROPE_DIM)
    else:
        zero = tl.zeros([pos.shape[0], cols.shape[0]], tl.float32)
        return zero, zero


@triton.jit
def _row_norm(x, w, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """``(rmsnorm(x), rstd)`` of pooled rows ``x`` ``[R, D]`` fp32 (whole rows, zeros past ``head_dim``), ``w`` the
    norm weight ``[D]`` fp32; without a norm ``x`` and an rstd of 1."""
    if HAS_NORM:
        r = _row_rstd(x, eps, HEAD_DIM)
        return x * r[:, None] * w[None, :], r
    else:
        return x, tl.full([x.shape[0]], 1.0, tl.float32)


@triton.jit
def _row_rope(y, cols, cos, sin, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr):
    """The rotation of whole rows ``y`` ``[R, D]`` by their tables (``_rope_tables``); ``y`` without a rotation."""
    if ROPE_DIM > 0:
        is_rope, first, _angle, partner = _rope_columns(cols, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
        return _rotate(y, cos, sin, is_rope, first, partner, ROPE_INTERLEAVED, HEAD_DIM % 2 == 0)
    else:
        return y


@triton.jit
def _load_norm_weight(w_ptr, cols, col_ok, HAS_NORM: tl.constexpr):
    """The norm weight of columns ``cols`` in fp32 (0 past ``head_dim``; without a norm an unused placeholder, as
    Triton 3.6 returns no None from a JIT function)."""
    if HAS_NORM:
        return tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        return cols.to(tl.float32)


@triton.jit
def _turn_back(g, g_ptr, rows, cols, gmask, pos, cos_ptr, sin_ptr, max_position,
               HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr):  # fmt: skip
    """``dy``: the ``grad_out`` rows ``g`` ``[R, D]`` (fp32, loaded with ``gmask``: 0 on padding rows) turned back by
    the inverse rotation, ``dy_a = g_a cos + g_b sin``, ``dy_b = g_b cos - g_a sin``. The partner's ``g`` is read
    from ``grad_out`` again (the same lines: cache hits), so no value crosses threads."""
    if ROPE_DIM > 0:
        is_rope, first, angle, partner = _rope_columns(cols, HEAD_DIM, ROPE_DIM, ROPE_INTERLEAVED)
        rmask = gmask & is_rope[None, :]
        other = tl.load(g_ptr + rows[:, None] * HEAD_DIM + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
        cos, sin = _angles(pos, angle, rmask, cos_ptr, sin_ptr, max_position, ROPE_DIM)
        # The reference's rotation by minus the angle: first a cos - b (-sin), second a (-sin) + b cos.
        turned = tl.where(first[None, :], g * cos - other * -sin, other * -sin + g * cos)
        return tl.where(rmask, turned, g)
    else:
        return g


@triton.jit
def _norm_backward(x, dy, r, w, HEAD_DIM: tl.constexpr):
    """The norm's input gradient ``dx = r (w dy) - x r^3 mean(x w dy)`` of rows ``[R, D]`` (``r`` ``[R]``) and
    the rows' terms of the weight's gradient, ``dy x r`` (unmasked)."""
    wdy = w[None, :] * dy
    mean = tl.math.div_rn(tl.sum(x * wdy, axis=1), tl.full([x.shape[0]], HEAD_DIM, tl.float32))
    rc = r[:, None]
    dx = rc * wdy - x * (rc * rc * rc) * mean[:, None]
    return dx, dy * x * rc
