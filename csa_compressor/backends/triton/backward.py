"""Triton backward kernel of the compressor pooling, and the deterministic dAPE reduction.

One launch, two kinds of programs:

- compute programs (``pid < n_compute``): program ``(rp, cb)`` walks
  ``tiles_per_prog`` row tiles of ``BLOCK_R`` rows in column block ``cb``,
  rebuilds the window tile as the forward does, stores ``dvalue`` into grad_kv and
  ``dlogit`` into grad_score exactly where the slot read (disjoint stores), and
  keeps the column sums of ``dlogit`` over its real rows in registers; at the end
  it writes that ``[ratio, BLOCK_D]`` slice of its partial ``workspace[rp]``
  (``(P, ratio, coff*d)`` fp32, every entry written once).
- sweep programs (``pid >= n_compute``): each takes ``SWEEP_T`` tokens, finds their
  segment by binary search over ``cu_seqlens`` and stores exact zeros where no
  slot consumes the token/column (past ``cu_seqlens[-1]``, segment tails, the
  first ``d`` columns of a segment's last group when coff = 2). Consumed
  positions are never touched by the sweep, so all stores stay disjoint.

``csa_bwd_long_kernel`` is the same for long windows (a row's whole window per
program); ``csa_bwd_stats_kernel`` streams long windows in slot chunks from the
forward's softmax statistics (no reduction over the window). ``dape_reduce_kernel``
then sums the ``P`` partials in a fixed order into grad_ape: no atomics, bitwise
reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward_tail import _stats_tail_dx, _tail_dx, csa_tail_dx_kernel  # noqa: F401 (launched from here)
from .forward import (
    _OFFSETS,
    _TAIL_OFFSETS,
    LOG2E,
    _load_ape,
    _program_segment,
    _real_rows,
    _round,
    _row_position,
    _row_start,
    _segment_of,
    _slot_columns,
    _softmax,
    _sum_slots,
    _tile,
)
from .forward_long import _long_base
from .norm_rope import _load_norm_weight


@triton.jit
def _zero_sweep(
    sweep_pid,
    grad_kv_ptr,
    grad_score_ptr,
    cu_ptr,
    cu_comp_ptr,
    N,
    T,
    B,
    n_iter,
    RATIO: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SWEEP_T: tl.constexpr,
    SWEEP_D: tl.constexpr,
):
    """Exact zeros at the ``SWEEP_T`` tokens of sweep program ``sweep_pid`` that no produced row consumes.

    A segment's produced groups are its groups whose row is below ``min(cu_seqlens_comp[B], N)``: with total_comp
    under the real row count, the tokens the dropped rows would have read are unconsumed, and a segment whose first
    row is at or past total_comp has none. Every store is a token of ``[0, T)``, whatever the offsets hold.
    """
    W: tl.constexpr = COFF * HEAD_DIM
    gdt = grad_kv_ptr.dtype.element_ty
    toks = sweep_pid * SWEEP_T + tl.arange(0, SWEEP_T)
    tok_ok = toks < T
    seg = _segment_of(toks, cu_ptr, B, n_iter)
    seg_start = tl.load(cu_ptr + seg)
    n_groups = (tl.load(cu_ptr + seg + 1) - seg_start) // RATIO
    n_groups = tl.minimum(n_groups, _real_rows(cu_comp_ptr, B, N) - tl.load(cu_comp_ptr + seg))
    local = toks - seg_start
    consumed = (toks < tl.load(cu_ptr + B)) & (local < n_groups * RATIO)
    # Per token: zero its first d columns / its last (coff-1)*d columns. Row flags broadcast over columns
    # keep the stores vectorised.
    zero_hi = tok_ok & ~consumed
    if COFF == 2:
        # The first d columns of a segment's last produced group would be read by a next group that is not produced.
        zero_lo = zero_hi | (tok_ok & consumed & (local // RATIO == n_groups - 1))
    else:
        zero_lo = zero_hi
    if tl.max(zero_lo.to(tl.int32), axis=0) > 0:
        zeros = tl.zeros([SWEEP_T, SWEEP_D], dtype=gdt)
        for c0 in range(0, HEAD_DIM, SWEEP_D):
            cols = c0 + tl.arange(0, SWEEP_D)
            zmask = zero_lo[:, None] & (cols < HEAD_DIM)[None, :]
            zoffs = toks[:, None] * W + cols[None, :]
            tl.store(grad_kv_ptr + zoffs, zeros, mask=zmask)
            tl.store(grad_score_ptr + zoffs, zeros, mask=zmask)
        if COFF == 2:
            if tl.max(zero_hi.to(tl.int32), axis=0) > 0:
                for c0 in range(0, HEAD_DIM, SWEEP_D):
                    cols = c0 + tl.arange(0, SWEEP_D)
                    zmask = zero_hi[:, None] & (cols < HEAD_DIM)[None, :]
                    zoffs = toks[:, None] * W + HEAD_DIM + cols[None, :]
                    tl.store(grad_kv_ptr + zoffs, zeros, mask=zmask)
                    tl.store(grad_score_ptr + zoffs, zeros, mask=zmask)


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "tiles_per_prog", "n_compute"],
    do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS,
)
def csa_bwd_kernel(
    kv_ptr,
    score_ptr,
    ape_ptr,
    cu_ptr,
    cu_comp_ptr,
    grad_out_ptr,
    grad_kv_ptr,
    grad_score_ptr,
    ws_ptr,
    N,
    T,
    B,
    n_iter,
    tiles_per_prog,
    n_compute,
    norm_w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    rstd_ptr,
    norm_eps,
    wws_ptr,
    RATIO: tl.constexpr,
    SP: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
    N_COL: tl.constexpr,
    SWEEP_T: tl.constexpr,
    SWEEP_D: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    MANUAL_RTNE: tl.constexpr,
    TORCH_ORDER: tl.constexpr,
    HAS_NORM: tl.constexpr = False,
    ROPE_DIM: tl.constexpr = 0,
    ROPE_INTERLEAVED: tl.constexpr = True,
):
    """The tail (``HAS_NORM``, ``ROPE_DIM > 0``; None pointers without it): programs own whole rows
    (``N_COL == 1``); a tile's ``grad_out`` is turned back (``_turn_back``) and, with a norm, the pooled rows are
    recomputed from the window (``rstd_ptr`` None: their rstd too) for the norm's input gradient, which then enters
    the pooling backward in place of ``grad_out``. The weight's gradient of the program's real rows goes to row
    ``rp`` of the ``(P, HEAD_DIM)`` fp32 partials ``wws_ptr``."""
    W: tl.constexpr = COFF * HEAD_DIM
    TAIL: tl.constexpr = HAS_NORM or ROPE_DIM > 0
    pid = tl.program_id(0)
    gdt = grad_kv_ptr.dtype.element_ty
    if pid < n_compute:
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
            _s, _own, _so, tcols, tcol_ok, _col = _slot_columns(col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
            w = _load_norm_weight(norm_w_ptr, tcols, tcol_ok, HAS_NORM)
            if HAS_NORM:
                grad_w = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        # dAPE partial kept per (slot, row lane, column); rows are summed once, after the loop.
        dape = tl.zeros([COFF * SP, BLOCK_R, BLOCK_D], dtype=tl.float32)
        # Tile i + 1 is loaded before tile i is computed (a load always in flight behind the arithmetic).
        rows, _ro, is_real, cols, col_ok, _so, _v, offs, lmask = _tile(
            row_base, col_start, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr,
            RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC,
        )  # fmt: skip
        kv_next = tl.load(kv_ptr + offs, mask=lmask, other=0.0)
        score_next = tl.load(score_ptr + offs, mask=lmask, other=0.0)
        # Rows past cu_seqlens_comp[-1] contribute nothing (the reference zeroes their grad_out).
        gmask = is_real[:, None] & col_ok[None, :]
        g_next = tl.load(grad_out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=gmask, other=0.0)
        for it in range(tiles_per_prog):
            kv_cur = kv_next
            score_cur = score_next
            g_cur = g_next
            row_start = row_base + it * BLOCK_R
            rows_cur, row_ok_cur, is_real, _c, _co, slot_ok, valid, offs_cur, lmask_cur = _tile(
                row_start, col_start, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr,
                RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC,
            )  # fmt: skip
            rows, row_ok_n, is_real_n, cols, col_ok, _so, _v, offs, lmask = _tile(
                row_start + BLOCK_R, col_start, tl.where(it + 1 < tiles_per_prog, N, 0), T, B, n_iter, n_real, uniform,
                comp0, tok0, cu_ptr, cu_comp_ptr, RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC,
            )  # fmt: skip
            kv_next = tl.load(kv_ptr + offs, mask=lmask, other=0.0)
            score_next = tl.load(score_ptr + offs, mask=lmask, other=0.0)
            gmask = (is_real_n & row_ok_n)[:, None] & col_ok[None, :]
            g_next = tl.load(grad_out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=gmask, other=0.0)

            v, p = _softmax(kv_cur, score_cur, ape, valid, PRECISE_EXP)
            g = g_cur.to(tl.float32)[None, :, :]
            if TAIL:
                dx, gw_rows = _tail_dx(
                    v, p, g_cur.to(tl.float32), rows_cur, row_ok_cur, is_real, tcols, tcol_ok, w, uniform, seg0, comp0,
                    B, n_iter, cu_comp_ptr, grad_out_ptr, norm_eps, cos_ptr, sin_ptr, pos_ptr, rstd_ptr, RATIO,
                    HEAD_DIM, TORCH_ORDER, HAS_NORM, ROPE_DIM, ROPE_INTERLEAVED,
                )  # fmt: skip
                g = dx[None, :, :]
                if HAS_NORM:
                    grad_w += tl.where(is_real[:, None], gw_rows, 0.0)
            # Reference order: dv = g*p; gv = g*v; dlogit = p*(gv - sum(gv*p)).
            dv = g * p
            gv = g * v
            # Slots s >= ratio do not exist in the reference; keep them out of the sum even for non-finite g.
            gvp = tl.where(slot_ok[:, None, None], gv * p, 0.0)
            dlogit = p * (gv - _sum_slots(gvp, TORCH_ORDER)[None, :, :])
            smask = lmask_cur & is_real[None, :, None]
            tl.store(grad_kv_ptr + offs_cur, _round(dv, gdt, MANUAL_RTNE), mask=smask)
            tl.store(grad_score_ptr + offs_cur, _round(dlogit, gdt, MANUAL_RTNE), mask=smask)
            dape += tl.where(smask, dlogit, 0.0)
        # Slot (s, own) added ape[s, col]: the partial has the same [ratio, coff*d] layout as grad_ape.
        s, _own, slot_ok, cols, col_ok, col = _slot_columns(col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
        wmask = slot_ok[:, None] & col_ok[None, :]
        tl.store(ws_ptr + rp * (RATIO * W) + s[:, None] * W + col, tl.sum(dape, axis=1), mask=wmask)
        if HAS_NORM:
            tl.store(wws_ptr + rp * HEAD_DIM + tcols, tl.sum(grad_w, axis=0), mask=tcol_ok)
    else:
        _zero_sweep(
            pid - n_compute, grad_kv_ptr, grad_score_ptr, cu_ptr, cu_comp_ptr, N, T, B, n_iter, RATIO, COFF, HEAD_DIM,
            SWEEP_T, SWEEP_D,
        )  # fmt: skip


@triton.jit
def _long_window_base(
    col_start, RATIO: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr, CS_IN: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """A row's whole window as one ``[LANES, CS_IN, BLOCK_D]`` tile: slot ``k = i * LANES + l`` (coff = 2:
    ``k < SP`` is the previous group). Per-thread constants: ``k``, kv/score offsets relative to the row's first
    token (``t0 * W`` is added per row), ape offsets (= the grad_ape entry), ape mask, the column mask and the
    output columns (``[BLOCK_D]``)."""
    W: tl.constexpr = COFF * HEAD_DIM
    k, _b, col_ok, cols = _long_base(col_start, COFF, HEAD_DIM, BLOCK_D, VEC, CS_IN, LANES)
    s = k % SP
    own = k >= (COFF - 1) * SP
    colw = cols[None, None, :] + own.to(tl.int32) * ((COFF - 1) * HEAD_DIM)
    aoffs = s * W + colw
    return k, aoffs - tl.where(own, 0, RATIO * W), aoffs, (s < RATIO) & col_ok, col_ok, cols


@triton.jit
def _long_window_mask(k, has_prev, ok, amask, SP: tl.constexpr, COFF: tl.constexpr):
    """Slots of the window that exist for this row (``amask``: slot < ratio and column < d)."""
    # (Thresholds rather than scalar-bool broadcasts: the interpreter turns bool tensor & 0-d bool into int32.)
    k_lo = tl.where(has_prev, 0, (COFF - 1) * SP)
    return amask & (k >= k_lo) & (k < tl.where(ok, COFF * SP, 0))


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "rows_per_prog", "n_compute"], do_not_specialize_on_alignment=_OFFSETS
)
def csa_bwd_long_kernel(
    kv_ptr,
    score_ptr,
    ape_ptr,
    cu_ptr,
    cu_comp_ptr,
    grad_out_ptr,
    grad_kv_ptr,
    grad_score_ptr,
    ws_ptr,
    N,
    T,
    B,
    n_iter,
    rows_per_prog,
    n_compute,
    RATIO: tl.constexpr,
    SP: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VEC: tl.constexpr,
    LANES: tl.constexpr,
    CS_IN: tl.constexpr,
    N_COL: tl.constexpr,
    SWEEP_T: tl.constexpr,
    SWEEP_D: tl.constexpr,
    MANUAL_RTNE: tl.constexpr,
):
    """Long-window backward: compute programs ``(rp, cb)`` hold a row's whole window (all ``coff * SP`` slots x
    ``BLOCK_D`` columns) in registers, walk ``rows_per_prog`` rows (the next row's window is loaded before the
    current one is computed), store dvalue/dlogit where the slots read and keep the dAPE partial of their rows in
    registers; the rest are zero-sweep programs as in ``csa_bwd_kernel``. Every input is read once. (With the
    forward's softmax statistics the backward runs ``csa_bwd_stats_kernel`` instead.)
    """
    W: tl.constexpr = COFF * HEAD_DIM
    pid = tl.program_id(0)
    gdt = grad_kv_ptr.dtype.element_ty
    if pid < n_compute:
        rp = pid // N_COL
        col_start = (pid % N_COL) * BLOCK_D
        n_real = _real_rows(cu_comp_ptr, B, N)
        row_base = rp * rows_per_prog
        uniform, comp0, tok0, _seg = _program_segment(
            row_base, rows_per_prog, N, B, n_iter, n_real, cu_ptr, cu_comp_ptr
        )  # fmt: skip
        k, base, aoffs, amask, _col_ok, cols = _long_window_base(
            col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC, CS_IN, LANES
        )  # fmt: skip
        row_end = tl.minimum(row_base + rows_per_prog, N)
        t0, hp, real, ok = _row_start(
            row_base, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO
        )  # fmt: skip
        ape = tl.load(ape_ptr + aoffs, mask=amask, other=0.0)
        lmask = _long_window_mask(k, hp, ok, amask, SP, COFF)
        kv_n = tl.load(kv_ptr + (base + t0 * W), mask=lmask, other=0.0)
        sc_n = tl.load(score_ptr + (base + t0 * W), mask=lmask, other=0.0)
        # Rows past cu_seqlens_comp[-1] contribute nothing (the reference zeroes their grad_out).
        g_n = tl.load(grad_out_ptr + row_base * HEAD_DIM + cols, mask=cols < tl.where(real, HEAD_DIM, 0), other=0.0)
        dape = tl.zeros([LANES, CS_IN, BLOCK_D], dtype=tl.float32)
        for row in range(row_base, row_end):
            kv_c = kv_n
            sc_c = sc_n
            g_c = g_n
            valid = lmask
            offs_c = base + t0 * W
            smask = valid & (cols < tl.where(real, HEAD_DIM, 0))[None, None, :]
            t0, hp, real_n, okn = _row_start(
                row + 1, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO
            )  # fmt: skip
            okn = okn & (row + 1 < row_end)
            lmask = _long_window_mask(k, hp, okn, amask, SP, COFF)
            kv_n = tl.load(kv_ptr + (base + t0 * W), mask=lmask, other=0.0)
            sc_n = tl.load(score_ptr + (base + t0 * W), mask=lmask, other=0.0)
            g_n = tl.load(
                grad_out_ptr + (row + 1) * HEAD_DIM + cols, mask=cols < tl.where(real_n & okn, HEAD_DIM, 0), other=0.0
            )

            x = tl.where(valid, sc_c.to(tl.float32) + ape, float("-inf"))
            mx = tl.max(tl.max(x, axis=1), axis=0)
            mx = tl.where(mx == float("-inf"), 0.0, mx) * LOG2E
            e = tl.exp2(x * LOG2E - mx[None, None, :])
            inv = tl.math.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), tl.sum(tl.sum(e, axis=1), axis=0))
            p = e * inv[None, None, :]
            v = kv_c.to(tl.float32)
            g = g_c.to(tl.float32)[None, None, :]
            # sum_k p_k * g * v_k = g * sum_k p_k v_k (g is the same for every slot of a column).
            gd = g * tl.sum(tl.sum(p * v, axis=1), axis=0)[None, None, :]
            dv = g * p
            dlogit = p * (g * v - gd)
            tl.store(grad_kv_ptr + offs_c, _round(dv, gdt, MANUAL_RTNE), mask=smask)
            tl.store(grad_score_ptr + offs_c, _round(dlogit, gdt, MANUAL_RTNE), mask=smask)
            dape += tl.where(smask, dlogit, 0.0)
            real = real_n
        # Slot k added ape entry aoffs: the partial has grad_ape's [ratio, coff*d] layout.
        tl.store(ws_ptr + rp * (RATIO * W) + aoffs, dape, mask=amask)
    else:
        _zero_sweep(
            pid - n_compute, grad_kv_ptr, grad_score_ptr, cu_ptr, cu_comp_ptr, N, T, B, n_iter, RATIO, COFF, HEAD_DIM,
            SWEEP_T, SWEEP_D,
        )  # fmt: skip


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


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "rows_per_prog", "n_compute"],
    do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS,
)
def csa_bwd_stats_kernel(
    kv_ptr,
    score_ptr,
    ape_ptr,
    cu_ptr,
    cu_comp_ptr,
    grad_out_ptr,
    grad_kv_ptr,
    grad_score_ptr,
    ws_ptr,
    stats_ptr,
    N,
    T,
    B,
    n_iter,
    rows_per_prog,
    n_compute,
    norm_w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    rstd_ptr,
    norm_eps,
    wws_ptr,
    RATIO: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr,
    VEC: tl.constexpr,
    N_COL: tl.constexpr,
    N_CHUNK: tl.constexpr,
    SWEEP_T: tl.constexpr,
    SWEEP_D: tl.constexpr,
    MANUAL_RTNE: tl.constexpr,
    HAS_NORM: tl.constexpr = False,
    ROPE_DIM: tl.constexpr = 0,
    ROPE_INTERLEAVED: tl.constexpr = True,
    ROW_BLOCK: tl.constexpr = 1,
):
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
    TAIL: tl.constexpr = HAS_NORM or ROPE_DIM > 0
    W: tl.constexpr = COFF * HEAD_DIM
    WIN: tl.constexpr = COFF * RATIO
    PREV: tl.constexpr = (COFF - 1) * RATIO
    EVEN_D: tl.constexpr = HEAD_DIM % BLOCK_D == 0
    pid = tl.program_id(0)
    gdt = grad_kv_ptr.dtype.element_ty
    if pid < n_compute:
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

        # Per-program constants; a row only adds t0 * W to the kv/score offsets.
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
            # This row's statistics and grad_out: one value per column, shared by the slots.
            st = st_cols + (row - row_base) * (3 * HEAD_DIM)
            m = tl.load(st, mask=col_ok, other=0.0)[None, :]
            inv_l = tl.load(st + HEAD_DIM, mask=col_ok, other=0.0)[None, :]
            o = tl.load(st + 2 * HEAD_DIM, mask=col_ok, other=0.0)[None, :]
            g = tl.load(grad_out_ptr + row * HEAD_DIM + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if TAIL:
                pos, row_real = _row_position(
                    row, N, T, B, n_iter, n_real, uniform, comp0, tok0, seg0, cu_ptr, cu_comp_ptr, pos_ptr, RATIO
                )  # fmt: skip
                x_row = stats_ptr + (row_base.to(tl.int64) + (row - row_base)) * (3 * HEAD_DIM) + 2 * HEAD_DIM
                g, gw_row = _stats_tail_dx(
                    g, o, row, pos, cols, col_ok, norm_w, x_row, grad_out_ptr, norm_w_ptr, norm_eps, cos_ptr, sin_ptr,
                    rstd_ptr, HEAD_DIM, HAS_NORM, ROPE_DIM, ROPE_INTERLEAVED, ROW_BLOCK,
                )  # fmt: skip
                if HAS_NORM:
                    grad_w += tl.where(row_real & (ch == 0), gw_row, 0.0)

            p = tl.exp2((sc_c.to(tl.float32) + ape) * LOG2E - m) * inv_l
            dv = g * p
            # sum_k p_k * g * v_k = g * o.
            dlogit = p * (g * kv_c.to(tl.float32) - g * o)
            tl.store(grad_kv_ptr + offs_c, _round(dv, gdt, MANUAL_RTNE), mask=mask_c)
            tl.store(grad_score_ptr + offs_c, _round(dlogit, gdt, MANUAL_RTNE), mask=mask_c)
            dape += tl.where(mask_c, dlogit, 0.0)
        # The dAPE partial has grad_ape's [RATIO, COFF * HEAD_DIM] layout: slot w added ape entry aoffs.
        tl.store(ws_ptr + rp * (RATIO * W) + aoffs, dape, mask=amask)
        if HAS_NORM:
            # (A threshold rather than a scalar-bool broadcast, as in _stats_row_mask.)
            tl.store(
                wws_ptr + rp * HEAD_DIM + cols[None, :], grad_w, mask=cols[None, :] < tl.where(ch == 0, HEAD_DIM, 0)
            )
    else:
        _zero_sweep(
            pid - n_compute, grad_kv_ptr, grad_score_ptr, cu_ptr, cu_comp_ptr, N, T, B, n_iter, RATIO, COFF, HEAD_DIM,
            SWEEP_T, SWEEP_D,
        )  # fmt: skip


@triton.jit
def _reduce_partials(ws_ptr, out_ptr, P, block_id, SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """``out[i] = sum_{p < P} ws[p, i]`` for the ``BLOCK`` entries of block ``block_id``: lane ``c`` of a
    ``[CHUNK, BLOCK]`` accumulator sums partials ``c, c + CHUNK, ...`` in increasing order, then the ``CHUNK``
    lanes are summed as a tile. One fixed order for a given ``P``, so bitwise reproducible."""
    offs = block_id * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    parts = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK, BLOCK], dtype=tl.float32)
    for first in range(0, P, CHUNK):
        pmask = (first + parts < P)[:, None] & mask[None, :]
        acc += tl.load(ws_ptr + (first + parts)[:, None] * SIZE + offs[None, :], mask=pmask, other=0.0)
    tl.store(out_ptr + offs, tl.sum(acc, axis=0), mask=mask)


@triton.jit(do_not_specialize=["P"])
def dape_reduce_kernel(ws_ptr, grad_ape_ptr, P, SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """``grad_ape = sum_p ws[p]`` (``_reduce_partials``), ``BLOCK`` entries per program.

    No cross-thread sum (shuffles, barriers) inside the loop: a step is its loads and adds. Per step ptxas keeps
    about three of a thread's LDG.128 in flight (sm_90), so the chain is ~3 L2 round trips x ``P / CHUNK`` steps:
    the launcher sizes ``CHUNK`` to keep ``P / CHUNK`` at 1-3 steps on common problems.
    """
    _reduce_partials(ws_ptr, grad_ape_ptr, P, tl.program_id(0), SIZE, BLOCK, CHUNK)


@triton.jit(do_not_specialize=["P", "P_W"])
def tail_reduce_kernel(
    ws_ptr, grad_ape_ptr, wws_ptr, grad_w_ptr, P, P_W,
    SIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, W_SIZE: tl.constexpr, W_BLOCK: tl.constexpr,
):  # fmt: skip
    """``dape_reduce_kernel`` and, in the same launch, the norm weight's gradient ``grad_w = sum_p wws[p]``
    (``(P_W, W_SIZE)`` partials): programs past ``cdiv(SIZE, BLOCK)`` reduce ``W_BLOCK`` entries of it each."""
    pid = tl.program_id(0)
    APE_PROGRAMS: tl.constexpr = (SIZE + BLOCK - 1) // BLOCK
    if pid < APE_PROGRAMS:
        _reduce_partials(ws_ptr, grad_ape_ptr, P, pid, SIZE, BLOCK, CHUNK)
    else:
        _reduce_partials(wws_ptr, grad_w_ptr, P_W, pid - APE_PROGRAMS, W_SIZE, W_BLOCK, CHUNK)
