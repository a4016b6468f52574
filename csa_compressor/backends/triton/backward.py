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
program); ``csa_bwd_stats_kernel`` (``backward_stats.py``) streams long windows in slot
chunks from the forward's softmax statistics (no reduction over the window). The sweep
programs are ``sweep.py``'s, shared by the three. ``dape_reduce_kernel``
then sums the ``P`` partials in a fixed order into grad_ape: no atomics, bitwise
reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward_stats import csa_bwd_stats_kernel  # noqa: F401 (launched from here)
from .backward_tail import _tail_dx, csa_tail_dx_kernel  # noqa: F401 (launched from here)
from .forward import (
    _OFFSETS,
    _TAIL_INTS,
    _TAIL_OFFSETS,
    LOG2E,
    _load_ape,
    _program_segment,
    _real_rows,
    _round,
    _row_start,
    _slot_columns,
    _softmax,
    _sum_slots,
    _tile,
)
from .forward_long import _long_base
from .norm_rope import _load_norm_weight
from .sweep import _zero_sweep


@triton.jit
def _short_tile_dx(
    kv_cur, score_cur, g_cur, ape, valid, rows, row_ok, is_real, tcols, tcol_ok, w, uniform, seg0, comp0, B, n_iter,
    cu_comp_ptr, grad_out_ptr, norm_eps, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, RATIO: tl.constexpr,
    HEAD_DIM: tl.constexpr, PRECISE_EXP: tl.constexpr, TORCH_ORDER: tl.constexpr, HAS_NORM: tl.constexpr,
    ROPE_DIM: tl.constexpr, ROPE_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """A loaded tile's softmax (values ``v``, weights ``p``) and the pooling's upstream gradient ``g``
    (``[1, BLOCK_R, BLOCK_D]``: ``grad_out``, or with a tail the ``dx`` of ``_tail_dx``), and the rows' terms of the
    norm weight's gradient (an unused tensor without a norm)."""
    TAIL: tl.constexpr = HAS_NORM or ROPE_DIM > 0
    v, p = _softmax(kv_cur, score_cur, ape, valid, PRECISE_EXP)
    g = g_cur.to(tl.float32)[None, :, :]
    if TAIL:
        dx, gw_rows = _tail_dx(
            v, p, g_cur.to(tl.float32), rows, row_ok, is_real, tcols, tcol_ok, w, uniform, seg0, comp0,
            B, n_iter, cu_comp_ptr, grad_out_ptr, norm_eps, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, RATIO,
            HEAD_DIM, TORCH_ORDER, HAS_NORM, ROPE_DIM, ROPE_INTERLEAVED,
        )  # fmt: skip
        g = dx[None, :, :]
    if HAS_NORM:
        return v, p, g, gw_rows
    else:
        # No norm, no weight terms: a tensor in their place (the caller reads them only with a norm), since
        # Triton 3.6 cannot return None from a JIT function.
        return v, p, g, g


@triton.jit
def _short_tile_store(
    v, p, g, slot_ok, offs, smask, dape, grad_kv_ptr, grad_score_ptr, MANUAL_RTNE: tl.constexpr,
    TORCH_ORDER: tl.constexpr,
):  # fmt: skip
    """Store a tile's dvalue and dlogit where its slots read (``smask``) and add dlogit to the dAPE partial."""
    gdt = grad_kv_ptr.dtype.element_ty
    # Reference order: dv = g*p; gv = g*v; dlogit = p*(gv - sum(gv*p)).
    dv = g * p
    gv = g * v
    # Slots s >= ratio do not exist in the reference; keep them out of the sum even for non-finite g.
    gvp = tl.where(slot_ok[:, None, None], gv * p, 0.0)
    dlogit = p * (gv - _sum_slots(gvp, TORCH_ORDER)[None, :, :])
    tl.store(grad_kv_ptr + offs, _round(dv, gdt, MANUAL_RTNE), mask=smask)
    tl.store(grad_score_ptr + offs, _round(dlogit, gdt, MANUAL_RTNE), mask=smask)
    return dape + tl.where(smask, dlogit, 0.0)


@triton.jit
def _short_bwd_program(
    pid, kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr, N, T, B,
    n_iter, tiles_per_prog, norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps, wws_ptr,
    RATIO: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr, N_COL: tl.constexpr, PRECISE_EXP: tl.constexpr,
    MANUAL_RTNE: tl.constexpr, TORCH_ORDER: tl.constexpr, HAS_NORM: tl.constexpr, ROPE_DIM: tl.constexpr,
    ROPE_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Compute program ``pid`` of ``csa_bwd_kernel``: its row tiles' gradients, then its dAPE (and norm weight)
    partial."""
    TAIL: tl.constexpr = HAS_NORM or ROPE_DIM > 0
    W: tl.constexpr = COFF * HEAD_DIM
    rp = pid // N_COL
    col_start = (pid % N_COL) * BLOCK_D
    n_real = _real_rows(cu_comp_ptr, B, N)
    row_base = rp * tiles_per_prog * BLOCK_R
    uniform, comp0, tok0, seg0 = _program_segment(
        row_base, tiles_per_prog * BLOCK_R, N, B, n_iter, n_real, cu_ptr, cu_comp_ptr
    )
    ape = _load_ape(ape_ptr, col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
    tcols = None
    tcol_ok = None
    w = None
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

        v, p, g, gw_rows = _short_tile_dx(
            kv_cur, score_cur, g_cur, ape, valid, rows_cur, row_ok_cur, is_real, tcols, tcol_ok, w, uniform, seg0,
            comp0, B, n_iter, cu_comp_ptr, grad_out_ptr, norm_eps, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr,
            RATIO, HEAD_DIM, PRECISE_EXP, TORCH_ORDER, HAS_NORM, ROPE_DIM, ROPE_INTERLEAVED,
        )  # fmt: skip
        if HAS_NORM:
            grad_w += tl.where(is_real[:, None], gw_rows, 0.0)
        smask = lmask_cur & is_real[None, :, None]
        dape = _short_tile_store(
            v, p, g, slot_ok, offs_cur, smask, dape, grad_kv_ptr, grad_score_ptr, MANUAL_RTNE, TORCH_ORDER
        )
    # Slot (s, own) added ape[s, col]: the partial has the same [ratio, coff*d] layout as grad_ape.
    s, _own, slot_ok, cols, col_ok, col = _slot_columns(col_start, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC)
    wmask = slot_ok[:, None] & col_ok[None, :]
    tl.store(ws_ptr + rp * (RATIO * W) + s[:, None] * W + col, tl.sum(dape, axis=1), mask=wmask)
    if HAS_NORM:
        tl.store(wws_ptr + rp * HEAD_DIM + tcols, tl.sum(grad_w, axis=0), mask=tcol_ok)


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "tiles_per_prog", "n_compute", *_TAIL_INTS],
    do_not_specialize_on_alignment=_OFFSETS + _TAIL_OFFSETS,
)
def csa_bwd_kernel(
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr, N, T, B, n_iter,
    tiles_per_prog, n_compute, norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps, wws_ptr,
    RATIO: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr, N_COL: tl.constexpr, SWEEP_T: tl.constexpr, SWEEP_D: tl.constexpr,
    PRECISE_EXP: tl.constexpr, MANUAL_RTNE: tl.constexpr, TORCH_ORDER: tl.constexpr, HAS_NORM: tl.constexpr = False,
    ROPE_DIM: tl.constexpr = 0, ROPE_INTERLEAVED: tl.constexpr = True,
):  # fmt: skip
    """Short-window backward: compute programs (``_short_bwd_program``), then the zero sweep.

    The tail (``HAS_NORM``, ``ROPE_DIM > 0``; None pointers without it): programs own whole rows
    (``N_COL == 1``); a tile's ``grad_out`` is turned back (``_turn_back``) and, with a norm, the pooled rows are
    recomputed from the window (``rstd_ptr`` None: their rstd too) for the norm's input gradient, which then enters
    the pooling backward in place of ``grad_out``. The weight's gradient of the program's real rows goes to row
    ``rp`` of the ``(P, HEAD_DIM)`` fp32 partials ``wws_ptr``."""
    pid = tl.program_id(0)
    if pid < n_compute:
        _short_bwd_program(
            pid, kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr, N,
            T, B, n_iter, tiles_per_prog, norm_w_ptr, cos_ptr, sin_ptr, max_position, pos_ptr, rstd_ptr, norm_eps,
            wws_ptr, RATIO, SP, COFF, HEAD_DIM, BLOCK_R, BLOCK_D, VEC, N_COL, PRECISE_EXP, MANUAL_RTNE, TORCH_ORDER,
            HAS_NORM, ROPE_DIM, ROPE_INTERLEAVED,
        )  # fmt: skip
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
    # The previous group's slots sit RATIO tokens back. A product rather than tl.where keeps the offsets' proof of
    # contiguity and alignment along the columns, so that the window is read and written in vectors.
    back = (1 - own.to(tl.int32)) * (RATIO * W)
    return k, aoffs - back, aoffs, (s < RATIO) & col_ok, col_ok, cols


@triton.jit
def _long_window_mask(k, has_prev, ok, amask, SP: tl.constexpr, COFF: tl.constexpr):
    """Slots of the window that exist for this row (``amask``: slot < ratio and column < d)."""
    # (Thresholds rather than scalar-bool broadcasts: the interpreter turns bool tensor & 0-d bool into int32.)
    k_lo = tl.where(has_prev, 0, (COFF - 1) * SP)
    return amask & (k >= k_lo) & (k < tl.where(ok, COFF * SP, 0))


@triton.jit
def _long_bwd_loads(
    kv_ptr, score_ptr, grad_out_ptr, base, t0, lmask, row, has_g, cols, COFF: tl.constexpr, HEAD_DIM: tl.constexpr
):  # fmt: skip
    """A row's window (kv, score at ``base + t0 * W`` where ``lmask``) and its grad_out (0 unless ``has_g``: rows
    past cu_seqlens_comp[-1] contribute nothing, as the reference zeroes their grad_out)."""
    W: tl.constexpr = COFF * HEAD_DIM
    kv = tl.load(kv_ptr + (base + t0 * W), mask=lmask, other=0.0)
    sc = tl.load(score_ptr + (base + t0 * W), mask=lmask, other=0.0)
    g = tl.load(grad_out_ptr + row * HEAD_DIM + cols, mask=cols < tl.where(has_g, HEAD_DIM, 0), other=0.0)
    return kv, sc, g


@triton.jit
def _long_row_grads(
    kv_c, sc_c, g_c, ape, valid, smask, offs, dape, grad_kv_ptr, grad_score_ptr, BLOCK_D: tl.constexpr,
    MANUAL_RTNE: tl.constexpr,
):  # fmt: skip
    """One row's softmax over its whole window, its dvalue and dlogit stored where ``smask``, dlogit added to the
    dAPE partial ``dape`` (returned)."""
    gdt = grad_kv_ptr.dtype.element_ty
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
    tl.store(grad_kv_ptr + offs, _round(dv, gdt, MANUAL_RTNE), mask=smask)
    tl.store(grad_score_ptr + offs, _round(dlogit, gdt, MANUAL_RTNE), mask=smask)
    return dape + tl.where(smask, dlogit, 0.0)


@triton.jit
def _long_bwd_program(
    pid, kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr, N, T, B,
    n_iter, rows_per_prog, RATIO: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, VEC: tl.constexpr, LANES: tl.constexpr, CS_IN: tl.constexpr, N_COL: tl.constexpr,
    MANUAL_RTNE: tl.constexpr,
):  # fmt: skip
    """Compute program ``pid`` of ``csa_bwd_long_kernel``: its rows' gradients (the next row's window loaded before
    the current one is computed), then its dAPE partial."""
    W: tl.constexpr = COFF * HEAD_DIM
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
    kv_n, sc_n, g_n = _long_bwd_loads(
        kv_ptr, score_ptr, grad_out_ptr, base, t0, lmask, row_base, real, cols, COFF, HEAD_DIM
    )
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
        kv_n, sc_n, g_n = _long_bwd_loads(
            kv_ptr, score_ptr, grad_out_ptr, base, t0, lmask, row + 1, real_n & okn, cols, COFF, HEAD_DIM
        )  # fmt: skip
        dape = _long_row_grads(
            kv_c, sc_c, g_c, ape, valid, smask, offs_c, dape, grad_kv_ptr, grad_score_ptr, BLOCK_D, MANUAL_RTNE
        )  # fmt: skip
        real = real_n
    # Slot k added ape entry aoffs: the partial has grad_ape's [ratio, coff*d] layout.
    tl.store(ws_ptr + rp * (RATIO * W) + aoffs, dape, mask=amask)


@triton.jit(
    do_not_specialize=["N", "T", "B", "n_iter", "rows_per_prog", "n_compute"], do_not_specialize_on_alignment=_OFFSETS
)
def csa_bwd_long_kernel(
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr,
    N, T, B, n_iter, rows_per_prog, n_compute,
    RATIO: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    VEC: tl.constexpr, LANES: tl.constexpr, CS_IN: tl.constexpr, N_COL: tl.constexpr, SWEEP_T: tl.constexpr,
    SWEEP_D: tl.constexpr, MANUAL_RTNE: tl.constexpr,
):  # fmt: skip
    """Long-window backward: compute programs ``(rp, cb)`` hold a row's whole window (all ``coff * SP`` slots x
    ``BLOCK_D`` columns) in registers, walk ``rows_per_prog`` rows (the next row's window is loaded before the
    current one is computed), store dvalue/dlogit where the slots read and keep the dAPE partial of their rows in
    registers; the rest are zero-sweep programs as in ``csa_bwd_kernel``. Every input is read once. (With the
    forward's softmax statistics the backward runs ``csa_bwd_stats_kernel`` instead.)
    """
    pid = tl.program_id(0)
    if pid < n_compute:
        _long_bwd_program(
            pid, kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, grad_out_ptr, grad_kv_ptr, grad_score_ptr, ws_ptr,
            N, T, B, n_iter, rows_per_prog, RATIO, SP, COFF, HEAD_DIM, BLOCK_D, VEC, LANES, CS_IN, N_COL, MANUAL_RTNE,
        )  # fmt: skip
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
