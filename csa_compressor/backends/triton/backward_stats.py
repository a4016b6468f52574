"""Triton long-window backward from the forward's softmax statistics (``csa_bwd_stats_kernel``): the window is
streamed in slot chunks, nothing is reduced over it. Launched through ``backward`` (which re-exports it), with the
zero-sweep programs of ``sweep.py`` and the dAPE reduction of ``backward.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward_tail import _stats_tail_dx
from .forward import (
    _OFFSETS,
    _TAIL_INTS,
    _TAIL_OFFSETS,
    LOG2E,
    _program_segment,
    _real_rows,
    _round,
    _row_position,
    _row_start,
)
from .norm_rope import _load_norm_weight
from .sweep import _zero_sweep


@triton.jit
def _stats_row_mask(w, has_prev, ok, col_ok, PREV: tl.constexpr, WIN: tl.constexpr, EVEN_D: tl.constexpr):
    """``[SLOTS, BLOCK_D]`` mask of the slots ``w`` a row reads: ``w < WIN`` (the chunk's padding), not the previous
    half of a segment's first group, nothing where ``ok`` is false; columns ``< HEAD_DIM``."""
    # (Thresholds rather than scalar-bool broadcasts: the interpreter turns bool tensor & 0-d bool into int32.)
    row = (w >= tl.where(has_prev, 0, PREV)) & (w < tl.where(ok, WIN, 0))
    if EVEN_D:
        return tl.broadcast_to(row[:, None], [w.shape[0], col_ok.shape[0]])
    else:
        return row[:, None] & col_ok[None, :]


@triton.jit
def _stats_slots(
    ch, cb, ape_ptr, RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Per-program constants of chunk ``ch``, column block ``cb``: the window slots ``w``, the columns and their
    mask, the kv/score offsets relative to a row's first token (a row only adds ``t0 * W``), the ape offsets (= the
    grad_ape entry), their mask and the ape values."""
    W: tl.constexpr = COFF * HEAD_DIM
    WIN: tl.constexpr = COFF * RATIO
    PREV: tl.constexpr = (COFF - 1) * RATIO
    w = ch * SLOTS + tl.arange(0, SLOTS)
    # (Products rather than tl.where on integers: a select hides the offsets' divisibility, and the loads fall
    # back to scalar accesses.)
    own = (w >= PREV).to(tl.int32)
    shift = own * ((COFF - 1) * HEAD_DIM)
    lane = tl.arange(0, BLOCK_D)
    # Contiguous in runs of VEC only: caps the vector width Triton picks at VEC elements.
    cols = cb * BLOCK_D + (lane // VEC) * VEC + lane % VEC
    col_ok = cols < HEAD_DIM
    base = ((w - PREV) * W + shift)[:, None] + cols[None, :]
    aoffs = ((w - own * PREV) * W + shift)[:, None] + cols[None, :]
    amask = (w < WIN)[:, None] & col_ok[None, :]
    ape = tl.load(ape_ptr + aoffs, mask=amask, other=0.0)
    return w, cols, col_ok, base, aoffs, amask, ape


@triton.jit
def _stats_row_inputs(st_cols, row, row_base, grad_out_ptr, cols, col_ok, HEAD_DIM: tl.constexpr):
    """A row's statistics (``m``, ``1 / l``, ``o``) and grad_out, ``[1, BLOCK_D]`` each: one value per column,
    shared by the slots."""
    st = st_cols + (row - row_base) * (3 * HEAD_DIM)
    m = tl.load(st, mask=col_ok, other=0.0)[None, :]
    inv_l = tl.load(st + HEAD_DIM, mask=col_ok, other=0.0)[None, :]
    o = tl.load(st + 2 * HEAD_DIM, mask=col_ok, other=0.0)[None, :]
    g = tl.load(grad_out_ptr + row * HEAD_DIM + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return m, inv_l, o, g


@triton.jit
def _stats_row_grads(
    kv_c, sc_c, ape, m, inv_l, o, g, offs, mask, dape, grad_kv_ptr, grad_score_ptr, MANUAL_RTNE: tl.constexpr
):  # fmt: skip
    """One row's slots of the chunk from its statistics: dvalue and dlogit stored where ``mask``, dlogit added to
    the dAPE partial ``dape`` (returned)."""
    gdt = grad_kv_ptr.dtype.element_ty
    p = tl.exp2((sc_c.to(tl.float32) + ape) * LOG2E - m) * inv_l
    dv = g * p
    # sum_k p_k * g * v_k = g * o.
    dlogit = p * (g * kv_c.to(tl.float32) - g * o)
    tl.store(grad_kv_ptr + offs, _round(dv, gdt, MANUAL_RTNE), mask=mask)
    tl.store(grad_score_ptr + offs, _round(dlogit, gdt, MANUAL_RTNE), mask=mask)
    return dape + tl.where(mask, dlogit, 0.0)


@triton.jit
def _stats_bwd_program(
    pid, kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr, stats_ptr,
    N, T, B, n_iter, rows_per_prog, norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps, wws_ptr,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SLOTS: tl.constexpr,
    VEC: tl.constexpr, N_COL: tl.constexpr, N_CHUNK: tl.constexpr, MANUAL_RTNE: tl.constexpr, HAS_NORM: tl.constexpr,
    ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr, ROW_BLOCK: tl.constexpr,
):  # fmt: skip
    """Compute program ``pid`` of ``csa_bwd_stats_kernel``: its rows' slots of one chunk and column block, then its
    slice of the dAPE (and norm weight) partial."""
    TAIL: tl.constexpr = HAS_NORM or ROPE_DIM > 0
    W: tl.constexpr = COFF * HEAD_DIM
    WIN: tl.constexpr = COFF * RATIO
    PREV: tl.constexpr = (COFF - 1) * RATIO
    EVEN_D: tl.constexpr = HEAD_DIM % BLOCK_D == 0
    cb = pid % N_COL
    ch = (pid // N_COL) % N_CHUNK
    rp = pid // (N_COL * N_CHUNK)
    n_real = _real_rows(cu_comp_ptr, B, N)
    row_base = rp * rows_per_prog
    # Padding rows (>= cu_seqlens_comp[-1]) store nothing and add nothing: the row loop ends before them.
    row_end = tl.minimum(row_base + rows_per_prog, n_real)
    uniform, comp0, tok0, seg0 = _program_segment(
        row_base, rows_per_prog, row_end, B, n_iter, n_real, cu_ptr, cu_comp_ptr
    )  # fmt: skip
    w, cols, col_ok, base, aoffs, amask, ape = _stats_slots(ch, cb, ape_ptr, RATIO, COFF, HEAD_DIM, BLOCK_D, SLOTS, VEC)
    # 64-bit base: the API bounds N * HEAD_DIM below 2^31, not 3 * N * HEAD_DIM.
    st_cols = stats_ptr + row_base.to(tl.int64) * (3 * HEAD_DIM) + cols

    t0, hp, real, _o = _row_start(
        row_base, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO
    )  # fmt: skip
    # A row that fails the bounds guard is a padding row here too: it stores and adds nothing.
    lmask = _stats_row_mask(w, hp, (row_base < row_end) & real, col_ok, PREV, WIN, EVEN_D)
    offs = base + t0 * W
    kv_n = tl.load(kv_ptr + offs, mask=lmask, other=0.0)
    sc_n = tl.load(score_ptr + offs, mask=lmask, other=0.0)
    dape = tl.zeros([SLOTS, BLOCK_D], dtype=tl.float32)
    if TAIL:
        norm_w = _load_norm_weight(norm_w_ptr, cols, col_ok, HAS_NORM)
        if HAS_NORM:
            grad_w = tl.zeros([1, BLOCK_D], dtype=tl.float32)
    for row in range(row_base, row_end):
        kv_c = kv_n
        sc_c = sc_n
        mask_c = lmask
        offs_c = offs
        # The next row's tiles first: their loads are in flight while this row waits for its statistics.
        t0, hp, real, _o = _row_start(
            row + 1, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO
        )  # fmt: skip
        lmask = _stats_row_mask(w, hp, (row + 1 < row_end) & real, col_ok, PREV, WIN, EVEN_D)
        offs = base + t0 * W
        kv_n = tl.load(kv_ptr + offs, mask=lmask, other=0.0)
        sc_n = tl.load(score_ptr + offs, mask=lmask, other=0.0)
        m, inv_l, o, g = _stats_row_inputs(st_cols, row, row_base, grad_out_ptr, cols, col_ok, HEAD_DIM)
        if TAIL:
            pos, row_real = _row_position(
                row, N, T, B, n_iter, n_real, uniform, comp0, tok0, seg0, cu_ptr, cu_comp_ptr, pos_ptr, RATIO
            )  # fmt: skip
            x_row = stats_ptr + (row_base.to(tl.int64) + (row - row_base)) * (3 * HEAD_DIM) + 2 * HEAD_DIM
            g, gw_row = _stats_tail_dx(
                g, o, row, pos, cols, col_ok, norm_w, x_row, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr,
                max_position, rstd_ptr, HEAD_DIM, HAS_NORM, ROPE_DIM, ROPE_INTERLEAVED, ROW_BLOCK,
            )  # fmt: skip
            if HAS_NORM:
                grad_w += tl.where(row_real & (ch == 0), gw_row, 0.0)
        dape = _stats_row_grads(
            kv_c, sc_c, ape, m, inv_l, o, g, offs_c, mask_c, dape, grad_kv_ptr, grad_score_ptr, MANUAL_RTNE
        )
    # The dAPE partial has grad_ape's [RATIO, COFF * HEAD_DIM] layout: slot w added ape entry aoffs.
    tl.store(ws_ptr + rp * (RATIO * W) + aoffs, dape, mask=amask)
    if HAS_NORM:
        # (A threshold rather than a scalar-bool broadcast, as in _stats_row_mask.)
        tl.store(wws_ptr + rp * HEAD_DIM + cols[None, :], grad_w, mask=cols[None, :] < tl.where(ch == 0, HEAD_DIM, 0))


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "rows_per_prog", "n_compute", *_TAIL_INTS],
    do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS,
)
def csa_bwd_stats_kernel(
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr, stats_ptr,
    N, T, B, n_iter, rows_per_prog, n_compute,
    norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps, wws_ptr,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SLOTS: tl.constexpr,
    VEC: tl.constexpr, N_COL: tl.constexpr, N_CHUNK: tl.constexpr, SWEEP_T: tl.constexpr, SWEEP_D: tl.constexpr,
    MANUAL_RTNE: tl.constexpr, HAS_NORM: tl.constexpr = False, ROPE_DIM: tl.constexpr = 0,
    ROPE_INTERLEAVED: tl.constexpr = True, ROW_BLOCK: tl.constexpr = 1,
):  # fmt: skip
    """Long-window backward from the forward's softmax statistics (``(N, 3, HEAD_DIM)`` fp32 at ``stats_ptr``:
    max ``m`` of ``y = (score + ape) * log2e``, ``1 / l = 1 / sum 2^(y - m)``, the fp32 output ``o``).

    With the statistics nothing is reduced over the window: ``p = 2^(y - m) / l``, ``dvalue = g * p`` and
    ``dlogit = p * (g * value - g * o)`` per element. So the window is streamed in chunks: compute program
    ``(rp, ch, cb)`` (``cb`` fastest, then the chunk: a row range's chunks run side by side and share its
    statistics and grad_out in L2) owns rows ``[rp * rows_per_prog, +rows_per_prog)``, window slots
    ``[ch * SLOTS, +SLOTS)`` of the ``WIN = COFF * RATIO`` (the last chunk padded) and columns
    ``[cb * BLOCK_D, +BLOCK_D)``. Slot ``w`` of the row starting at token ``t0`` reads token ``t0 + w - PREV``
    (``PREV = (COFF - 1) * RATIO``: the previous group's slots come first), at column ``col + shift`` with
    ``shift = HEAD_DIM`` in the own half ``w >= PREV`` (a chunk may straddle the halves), and added ape entry
    ``[w - PREV if own else w, col + shift]``. Per row the program loads the row's statistics and grad_out (``[BLOCK_D]``
    each, shared by the slots) and the ``[SLOTS, BLOCK_D]`` kv and score tiles (the next row's tiles are loaded
    before the current row is computed), stores grad_kv/grad_score and adds dlogit into a ``[SLOTS, BLOCK_D]``
    fp32 accumulator; at the end that is its slice of the dAPE partial ``ws[rp]`` (``[RATIO, COFF * HEAD_DIM]``,
    the slices of a row range's programs are disjoint and cover it). Rows past ``cu_seqlens_comp[-1]`` are not
    visited. Programs ``pid >= n_compute`` are the zero sweep of ``csa_bwd_kernel``.

    The tail (``HAS_NORM``, ``ROPE_DIM > 0``; None pointers without it): ``g`` becomes the norm's input gradient
    ``dx`` of the program's columns (``_stats_tail_dx``), from row scalars each program reduces over the whole row
    in ``ROW_BLOCK`` columns at a time; the chunk-0 programs write the weight's gradient of their rows and columns
    into row ``rp`` of the ``(P, HEAD_DIM)`` fp32 partials ``wws_ptr``.
    """
    pid = tl.program_id(0)
    if pid < n_compute:
        _stats_bwd_program(
            pid, kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr,
            stats_ptr, N, T, B, n_iter, rows_per_prog, norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr,
            norm_eps, wws_ptr, RATIO, COFF, HEAD_DIM, BLOCK_D, SLOTS, VEC, N_COL, N_CHUNK, MANUAL_RTNE, HAS_NORM,
            ROPE_DIM, ROPE_INTERLEAVED, ROW_BLOCK,
        )  # fmt: skip
    else:
        _zero_sweep(
            pid - n_compute, grad_kv_ptr, grad_score_ptr, cu_ptr, cu_comp_ptr, N, T, B, n_iter, RATIO, COFF, HEAD_DIM,
            SWEEP_T, SWEEP_D,
        )  # fmt: skip
