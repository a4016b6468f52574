"""Triton forward kernel for long windows (``coff * next_pow2(ratio) > 16``), with the optional softmax statistics.

A program owns ``rows_per_prog`` consecutive rows x ``BLOCK_D`` columns (column blocks of one row are adjacent
program ids). Window tiles are ``[LANES, CS_IN, BLOCK_D]``: ``BLOCK_D / VEC`` threads side by side along the
columns (16-byte accesses at VEC = 8), ``LANES`` slots across the remaining threads and warps, ``CS_IN`` slots in
each thread (reductions over them are in-thread). Slot ``s0 + i * LANES + l`` of a chunk sits at ``[l, i, :]``.
Exponentials are ``exp2`` of logits scaled by log2(e) (ex2.approx on NVIDIA GPUs): the numerics contract
(SPEC 3) holds to 1 bf16 ulp, and bitwise equality is a ratio-4 goal only. Row and chunk only add a scalar
to per-thread offsets computed once per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import _OFFSETS, LOG2E, WINDOW_EVICT, _program_segment, _real_rows, _round, _row_start


@triton.jit
def _long_base(
    col_start, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
    CS_IN: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """Per-thread constants of the long-window tiles: the slot of each ``[l, i]`` (``i * LANES + l``,
    ``[LANES, CS_IN, 1]``), element offsets ``slot * W + col`` (``[LANES, CS_IN, BLOCK_D]``), the column mask and
    the output columns (``[BLOCK_D]``). A chunk or row only adds a scalar to them."""
    W: tl.constexpr = COFF * HEAD_DIM
    # Lanes first: with the slot-in-thread axis second, Triton's coalescing order spreads threads over the
    # columns, then the lanes, and keeps CS_IN in each thread (reductions over axis 1 stay in-thread).
    slot = tl.arange(0, LANES)[:, None, None] + tl.arange(0, CS_IN)[None, :, None] * LANES
    lane = tl.arange(0, BLOCK_D)
    # Contiguous in runs of VEC only: caps the vector width Triton picks at VEC elements.
    cols = col_start + (lane // VEC) * VEC + lane % VEC
    return slot, slot * W + cols[None, None, :], (cols < HEAD_DIM)[None, None, :], cols


@triton.jit
def _long_ape_at(
    c, slot, base, col_ok, RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, CS: tl.constexpr,
    NCH_HALF: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """Offsets and mask of chunk ``c``'s ape entries (the same for every row; see ``_long_chunk_at``)."""
    W: tl.constexpr = COFF * HEAD_DIM
    own = c >= (COFF - 1) * NCH_HALF
    s0 = (c % NCH_HALF) * CS
    amask = slot < RATIO - s0
    if not EVEN_D:
        amask = amask & col_ok
    return base + (s0 * W + tl.where(own, (COFF - 1) * HEAD_DIM, 0)), amask


@triton.jit
def _long_chunk_at(
    c, t0, has_prev, ok, slot, base, col_ok,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, CS: tl.constexpr, NCH_HALF: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """Chunk ``c`` of a row (``CS`` slots; coff = 2: chunks ``< NCH_HALF`` are the previous group, first d
    columns): kv/score offsets, ape offsets, load mask, ape mask."""
    W: tl.constexpr = COFF * HEAD_DIM
    own = c >= (COFF - 1) * NCH_HALF
    s0 = (c % NCH_HALF) * CS
    shift = tl.where(own, (COFF - 1) * HEAD_DIM, 0)
    tok0 = t0 + s0 - tl.where(own, 0, RATIO)
    # (Thresholds rather than scalar-bool broadcasts: the interpreter turns bool tensor & 0-d bool into int32.)
    # With the columns in it (also where every column is valid): the mask a later step folds with is then in the
    # loads' layout, not converted through shared memory by threads that hold the same slots.
    smask = (slot < tl.where(ok & (own | has_prev), RATIO - s0, 0)) & col_ok
    aoffs, amask = _long_ape_at(c, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D)
    return base + (tok0 * W + shift), aoffs, smask, amask


@triton.jit
def _load_window(kv_ptr, score_ptr, offs, mask):
    """kv and score of one chunk (masked elements 0), evict-first where ``WINDOW_EVICT`` says so."""
    kv = tl.load(kv_ptr + offs, mask=mask, other=0.0, eviction_policy=WINDOW_EVICT)
    sc = tl.load(score_ptr + offs, mask=mask, other=0.0, eviction_policy=WINDOW_EVICT)
    return kv, sc


@triton.jit
def _load_chunk(
    kv_ptr, score_ptr, ape_ptr, c, t0, has_prev, ok, slot, base, col_ok,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, CS: tl.constexpr, NCH_HALF: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """kv, score and ape of chunk ``c`` of a row, and the chunk's load mask (one chunk in flight per step)."""
    offs, aoffs, mask, amask = _long_chunk_at(
        c, t0, has_prev, ok, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D
    )  # fmt: skip
    kv, sc = _load_window(kv_ptr, score_ptr, offs, mask)
    return kv, sc, tl.load(ape_ptr + aoffs, mask=amask, other=0.0), mask


@triton.jit
def _online_step(kv, sc, ape, lmask, m, den, acc, LOG2_DOMAIN: tl.constexpr):
    """Fold one chunk into the running (max, sum of exp, weighted sum) of each (lane, column).

    ``LOG2_DOMAIN`` (the statistics forward): ``y = (score + ape) * log2e`` rounded once per element and ``m``
    the running max of ``y``, so every exponent is a difference of two such values. Otherwise ``m`` is the max
    of ``x = score + ape`` and the exponents are ``x * log2e - m * log2e``: each lane then carries its own
    rounding of ``m * log2e`` into its weights, which the bf16 output absorbs but the fp32 output saved as a
    statistic does not: at full size that rounding put dScore past the contract's fp32 slack.
    """
    if LOG2_DOMAIN:
        y = tl.where(lmask, (sc.to(tl.float32) + ape) * LOG2E, float("-inf"))
        m_new = tl.maximum(m, tl.max(y, axis=1))
        # An all -inf column keeps m = -inf and adds exact zeros.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        e = tl.exp2(y - m_use[:, None, :])
    else:
        x = tl.where(lmask, sc.to(tl.float32) + ape, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # exp(x - m) as exp2(x * log2e - m * log2e); an all -inf column keeps m = -inf and adds exact zeros.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new) * LOG2E
        alpha = tl.exp2(m * LOG2E - m_use)
        e = tl.exp2(x * LOG2E - m_use[:, None, :])
    den = den * alpha + tl.sum(e, axis=1)
    acc = acc * alpha + tl.sum(e * kv.to(tl.float32), axis=1)
    return m_new, den, acc


@triton.jit
def _lane_product(a, b, MANUAL_RTNE: tl.constexpr):
    """``a * b`` rounded on its own, for a sum across lanes: fused into the first butterfly step, each thread would
    round its own product but not its partner's, and the lane groups that hold a column would end with different
    copies of the sum (which Triton's store layout conversion then has every copy write). ``mul.rn`` is never
    contracted, and unlike libdevice's it keeps subnormals. The interpreter (``MANUAL_RTNE``) runs no PTX, and
    numpy's product is never fused."""
    if MANUAL_RTNE:
        return a * b
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _long_row_finish(
    m, den, acc, ok, cols, row, row_base, out_ptr, stats_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MANUAL_RTNE: tl.constexpr, WRITE_STATS: tl.constexpr,
):  # fmt: skip
    """Combine a row's lanes (every lane rescaled to the column max) and store its output (and statistics)."""
    mx = tl.max(m, axis=0)
    if WRITE_STATS:  # log2 domain
        scale = tl.exp2(m - tl.where(mx == float("-inf"), 0.0, mx)[None, :])
    else:
        scale = tl.exp2(m * LOG2E - (tl.where(mx == float("-inf"), 0.0, mx) * LOG2E)[None, :])
    num = tl.sum(_lane_product(acc, scale, MANUAL_RTNE), axis=0)
    total = tl.sum(_lane_product(den, scale, MANUAL_RTNE), axis=0)
    res = tl.math.div_rn(num, total)
    omask = cols < tl.where(ok, HEAD_DIM, 0)
    tl.store(out_ptr + row * HEAD_DIM + cols, _round(res, out_ptr.dtype.element_ty, MANUAL_RTNE), mask=omask)
    if WRITE_STATS:
        # From the very values out was made of; mx is the max of y = (score + ape) * log2e.
        sptr = stats_ptr + (row - row_base) * (3 * HEAD_DIM) + cols
        tl.store(sptr, mx, mask=omask)
        tl.store(sptr + HEAD_DIM, tl.math.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), total), mask=omask)
        tl.store(sptr + 2 * HEAD_DIM, res, mask=omask)


@triton.jit
def _running(LANES: tl.constexpr, BLOCK_D: tl.constexpr):
    """A row's empty running max, sum of exponentials and weighted sum, per (lane, column)."""
    m = tl.full([LANES, BLOCK_D], float("-inf"), tl.float32)
    return m, tl.zeros([LANES, BLOCK_D], tl.float32), tl.zeros([LANES, BLOCK_D], tl.float32)


@triton.jit
def _load_then_fold(
    kv_c, sc_c, ape_c, mask_c, m, den, acc, kv_ptr, score_ptr, ape_ptr, c, t0, has_prev, ok, slot, base, col_ok,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, CS: tl.constexpr, NCH_HALF: tl.constexpr,
    EVEN_D: tl.constexpr, WRITE_STATS: tl.constexpr,
):  # fmt: skip
    """DEPTH 1's step: chunk ``c`` (of the row starting at ``t0``: this row or the next) goes in flight, then the
    chunk in hand is folded. Returns the loaded chunk and the running values."""
    kv_n, sc_n, ape_n, lmask = _load_chunk(
        kv_ptr, score_ptr, ape_ptr, c, t0, has_prev, ok, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF,
        EVEN_D,
    )  # fmt: skip
    m, den, acc = _online_step(kv_c, sc_c, ape_c, mask_c, m, den, acc, WRITE_STATS)
    return kv_n, sc_n, ape_n, lmask, m, den, acc


@triton.jit
def _load_then_fold2(
    kv_1, sc_1, ape_1, mask_1, kv_2, sc_2, mask_2, m, den, acc, kv_ptr, score_ptr, ape_ptr, c_win, t0, has_prev, ok,
    c_ape, slot, base, col_ok, RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, CS: tl.constexpr,
    NCH_HALF: tl.constexpr, EVEN_D: tl.constexpr, WRITE_STATS: tl.constexpr,
):  # fmt: skip
    """DEPTH 2's step: chunk ``c_win``'s kv and score (of the row starting at ``t0``) and chunk ``c_ape``'s ape go in
    flight, then the older chunk in hand (``*_1``) is folded. Returns the chunks in hand, oldest first (``*_1``:
    the previous ``*_2`` with the new ape; ``*_2``: the new window), and the running values."""
    offs, _aoffs, mask_n, _amask = _long_chunk_at(
        c_win, t0, has_prev, ok, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D
    )  # fmt: skip
    kv_n, sc_n = _load_window(kv_ptr, score_ptr, offs, mask_n)
    aoffs, amask = _long_ape_at(c_ape, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D)
    ape_n = tl.load(ape_ptr + aoffs, mask=amask, other=0.0)
    m, den, acc = _online_step(kv_1, sc_1, ape_1, mask_1, m, den, acc, WRITE_STATS)
    return kv_2, sc_2, ape_n, mask_2, kv_n, sc_n, mask_n, m, den, acc


@triton.jit
def _long_rows_depth1(
    kv_n, sc_n, ape_n, lmask, t0, hp, ok, row_base, row_end, slot, base, col_ok, cols,
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, out_ptr, stats_ptr, N, T, B, n_iter, n_real, uniform, comp0, tok0,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LANES: tl.constexpr,
    CS: tl.constexpr, NCH_HALF: tl.constexpr, EVEN_D: tl.constexpr, MANUAL_RTNE: tl.constexpr,
    WRITE_STATS: tl.constexpr,
):  # fmt: skip
    """The rows ``[row_base, row_end)`` with one chunk in flight: the next chunk (of this row, or chunk 0 of the
    next) is loaded before the current one is folded. ``kv_n`` .. ``lmask``: the row's chunk 0, loaded."""
    NCH: tl.constexpr = COFF * NCH_HALF
    for row in range(row_base, row_end):
        m, den, acc = _running(LANES, BLOCK_D)
        for c in range(NCH - 1):
            kv_n, sc_n, ape_n, lmask, m, den, acc = _load_then_fold(
                kv_n, sc_n, ape_n, lmask, m, den, acc, kv_ptr, score_ptr, ape_ptr, c + 1, t0, hp, ok, slot, base,
                col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D, WRITE_STATS,
            )  # fmt: skip
        # Last chunk of this row; prefetch chunk 0 of the next row.
        t0, hp, _ir, okn = _row_start(
            row + 1, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO
        )
        kv_n, sc_n, ape_n, lmask, m, den, acc = _load_then_fold(
            kv_n, sc_n, ape_n, lmask, m, den, acc, kv_ptr, score_ptr, ape_ptr, row * 0, t0, hp,
            okn & (row + 1 < row_end), slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D, WRITE_STATS,
        )  # fmt: skip
        _long_row_finish(
            m, den, acc, ok, cols, row, row_base, out_ptr, stats_ptr, HEAD_DIM, BLOCK_D, MANUAL_RTNE, WRITE_STATS
        )  # fmt: skip
        ok = okn


@triton.jit
def _long_rows_depth2(
    kv_n, sc_n, ape_n, lmask, t0, hp, ok, row_base, row_end, slot, base, col_ok, cols,
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, out_ptr, stats_ptr, N, T, B, n_iter, n_real, uniform, comp0, tok0,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LANES: tl.constexpr,
    CS: tl.constexpr, NCH_HALF: tl.constexpr, EVEN_D: tl.constexpr, MANUAL_RTNE: tl.constexpr,
    WRITE_STATS: tl.constexpr,
):  # fmt: skip
    """The rows ``[row_base, row_end)`` with two chunks in flight: chunk c is folded while chunks c + 1 (the *_1
    tensors) and c + 2 (*_2) are loading. Where the grid is under one wave, a program's prefetched chunks are all its
    SM has in flight, and one chunk leaves DRAM bandwidth unused. ``kv_n`` .. ``lmask``: the row's chunk 0."""
    NCH: tl.constexpr = COFF * NCH_HALF
    tl.static_assert(NCH >= 2, "DEPTH 2 needs two chunks per row")
    # ape (L2-resident, the same for every row) stays one chunk ahead: with a third ape buffer the tile would
    # need more registers, and fewer warps than programs would fit on an SM.
    mask_1 = lmask
    ape_1 = ape_n
    offs, _aoffs, mask_2, _amask = _long_chunk_at(
        1, t0, hp, ok, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D
    )  # fmt: skip
    kv_2, sc_2 = _load_window(kv_ptr, score_ptr, offs, mask_2)
    kv_1 = kv_n
    sc_1 = sc_n
    for row in range(row_base, row_end):
        m, den, acc = _running(LANES, BLOCK_D)
        for c in range(NCH - 2):
            kv_1, sc_1, ape_1, mask_1, kv_2, sc_2, mask_2, m, den, acc = _load_then_fold2(
                kv_1, sc_1, ape_1, mask_1, kv_2, sc_2, mask_2, m, den, acc, kv_ptr, score_ptr, ape_ptr, c + 2, t0, hp,
                ok, c + 1, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF, EVEN_D, WRITE_STATS,
            )  # fmt: skip
        # The row's last two chunks; chunks 0 and 1 of the next row go in flight.
        tn, hpn, _ir, okn = _row_start(
            row + 1, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO
        )
        okl = okn & (row + 1 < row_end)
        for h in tl.static_range(2):
            # ape of chunk NCH - 1 of this row (h = 0), then of chunk 0 of the next (h = 1).
            kv_1, sc_1, ape_1, mask_1, kv_2, sc_2, mask_2, m, den, acc = _load_then_fold2(
                kv_1, sc_1, ape_1, mask_1, kv_2, sc_2, mask_2, m, den, acc, kv_ptr, score_ptr, ape_ptr, row * 0 + h,
                tn, hpn, okl, row * 0 + (NCH - 1 + h) % NCH, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS, NCH_HALF,
                EVEN_D, WRITE_STATS,
            )  # fmt: skip
        _long_row_finish(
            m, den, acc, ok, cols, row, row_base, out_ptr, stats_ptr, HEAD_DIM, BLOCK_D, MANUAL_RTNE, WRITE_STATS
        )  # fmt: skip
        t0 = tn
        hp = hpn
        ok = okn


@triton.jit(do_not_specialize=["N", "T", "B", "n_iter", "rows_per_prog"], do_not_specialize_on_alignment=_OFFSETS)
def csa_fwd_long_kernel(
    kv_ptr, score_ptr, ape_ptr, cu_ptr, cu_comp_ptr, out_ptr, N, T, B, n_iter, rows_per_prog, stats_ptr,
    RATIO: tl.constexpr, COFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VEC: tl.constexpr,
    LANES: tl.constexpr, CS_IN: tl.constexpr, NCH_HALF: tl.constexpr, N_COL: tl.constexpr,
    MANUAL_RTNE: tl.constexpr, WRITE_STATS: tl.constexpr, DEPTH: tl.constexpr = 1,
):  # fmt: skip
    """Online softmax over the window in chunks of ``CS_IN * LANES`` slots, the next ``DEPTH`` chunks (of this
    row or the next) loaded before the current one is computed (``DEPTH`` 2 needs two chunks per row).

    Per (lane, column) the program keeps a running max ``m``, sum ``den`` of ``exp(x - m)`` and weighted sum
    ``acc``; a chunk's slots in a thread are folded in-thread, the lanes are combined once per row.
    ``WRITE_STATS``: also store the row's softmax statistics (``reference.softmax_stats``) into the contiguous
    ``(N, 3, HEAD_DIM)`` fp32 ``stats_ptr``: max of ``y = x * log2e``, ``1 / sum 2^(y - max)`` and the fp32 output.
    Grid: ``ceil(N / rows_per_prog) * N_COL``. The fused tail runs after it, from ``stats[:, 2]``
    (``forward_tail.py``).
    """
    CS: tl.constexpr = CS_IN * LANES
    EVEN_D: tl.constexpr = HEAD_DIM % BLOCK_D == 0
    pid = tl.program_id(0)
    rp = pid // N_COL
    col_start = (pid % N_COL) * BLOCK_D
    n_real = _real_rows(cu_comp_ptr, B, N)
    row_base = rp * rows_per_prog
    uniform, comp0, tok0, _seg = _program_segment(row_base, rows_per_prog, N, B, n_iter, n_real, cu_ptr, cu_comp_ptr)
    slot, base, col_ok, cols = _long_base(col_start, COFF, HEAD_DIM, BLOCK_D, VEC, CS_IN, LANES)
    row_end = tl.minimum(row_base + rows_per_prog, N)
    if WRITE_STATS:
        # 64-bit base: the API bounds N * HEAD_DIM below 2^31, not 3 * N * HEAD_DIM.
        stats_ptr += row_base.to(tl.int64) * (3 * HEAD_DIM)

    t0, hp, _ir, ok = _row_start(row_base, N, T, B, n_iter, n_real, uniform, comp0, tok0, cu_ptr, cu_comp_ptr, RATIO)
    kv_n, sc_n, ape_n, lmask = _load_chunk(
        kv_ptr, score_ptr, ape_ptr, row_base * 0, t0, hp, ok, slot, base, col_ok, RATIO, COFF, HEAD_DIM, CS,
        NCH_HALF, EVEN_D,
    )  # fmt: skip
    if DEPTH == 1:
        _long_rows_depth1(
            kv_n, sc_n, ape_n, lmask, t0, hp, ok, row_base, row_end, slot, base, col_ok, cols, kv_ptr, score_ptr,
            ape_ptr, cu_ptr, cu_comp_ptr, out_ptr, stats_ptr, N, T, B, n_iter, n_real, uniform, comp0, tok0, RATIO,
            COFF, HEAD_DIM, BLOCK_D, LANES, CS, NCH_HALF, EVEN_D, MANUAL_RTNE, WRITE_STATS,
        )  # fmt: skip
    else:
        _long_rows_depth2(
            kv_n, sc_n, ape_n, lmask, t0, hp, ok, row_base, row_end, slot, base, col_ok, cols, kv_ptr, score_ptr,
            ape_ptr, cu_ptr, cu_comp_ptr, out_ptr, stats_ptr, N, T, B, n_iter, n_real, uniform, comp0, tok0, RATIO,
            COFF, HEAD_DIM, BLOCK_D, LANES, CS, NCH_HALF, EVEN_D, MANUAL_RTNE, WRITE_STATS,
        )  # fmt: skip
