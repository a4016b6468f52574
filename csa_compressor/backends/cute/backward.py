"""CuTe-DSL backward kernel of the compressor pooling (SPEC sections 2-3).

Same thread mapping as the forward (``R`` rows x ``G`` slot groups x ``TC`` column
threads per CTA, ``V`` contiguous columns per thread), but the CTAs are persistent
over a contiguous range of rows (``rows_per_cta``) so that each CTA produces one
fp32 partial of ``grad_ape`` for its column chunk:

- a thread keeps its group's window (kv and score as bf16) in registers between the
  max/sum pass and the gradient pass: every input is read once from DRAM;
- ``G == 1`` (ratio 4 coff 2, ratio 2, ratio 8 coff 1): the fp32 reference's exact
  operation order, p = expf(x - max) / sum (IEEE division), dv = g*p, gv = g*v,
  S = sum(gv*p) in the order of torch's reduction (four strided accumulators, then
  combined left to right), dlogit = p*(gv - S); every multiply/add is pinned to ``.rn``
  so that no fma contraction changes a bit;
- ``G > 1`` (big windows): per group (max, sum e) then the group's share of
  S = sum(gv*p) go through shared memory; one thread per (row, column) combines the
  groups in a fixed order (two barriers each); exp via ex2.approx and p = e * (1/sum);
- grad_ape: per-thread fp32 register accumulators over the CTA's rows, summed over the
  CTA's row lanes in a fixed order, written to a workspace slab
  ``ws[cta, ratio, coff*head_dim]``; a second kernel (same host function, same
  stream) sums the slabs in a fixed order into ``grad_ape`` (overwrite, no atomics,
  bitwise deterministic).

Exact zeros (so grad buffers may be uninitialised), each from one owner:
the last group of a segment zeroes the segment's tail tokens (all columns) and,
for coff 2, the first-half columns of its own tokens; CTA ``p`` zeroes the tokens
of the segments ``b = p mod grid`` that have no group, and a grid-stride share of
the tokens past ``cu_seqlens[-1]``.
"""

from __future__ import annotations

from dataclasses import replace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .backward_common import ZeroStores, make_backward_host, reduce_slab_lanes
from .backward_long import build_backward_long, long_backward_schedule, long_backward_smem_bytes, prefetch_l2
from .backward_stats import build_backward_stats, stats_backward_smem_bytes
from .forward import (
    LOG2E,
    NEG_INF,
    Schedule,
    add_rn,
    ex2,
    exact_probabilities,
    find_segment,
    make_schedule,
    mul_rn,
    sub_rn,
    torch_order_sum,
    vec_view,
    widen,
    window_load,
    window_store,
)

SMEM_CARVEOUT = 50  # percent of the unified L1/shared memory offered to shared memory
# Threads per CTA of the short-window backward: the 128-thread tile's row lanes x 4, the same warps per SM (one CTA
# instead of four) and a quarter of the grad_ape slabs (one per CTA). H200, one GPU, A B / B A (2026-12-01,
# benchmarks/results/backward_threads_ab_h200_20261201.md): 3x8192 d512 r4 c2 backward 64.4-64.9 -> 60.4-60.8 us
# cold (-6 %), clean and warm -4 to -5 %; 3x8192 d128 r4 c2 level (-1.4 / +0.3 %).
SHORT_BACKWARD_THREADS = 512


def backward_schedule(ratio: int, coff: int, head_dim: int) -> Schedule:
    """Windows of at most 8 slots: this file's kernel, persistent CTAs with V = 2, which keeps two rows of
    window (double buffer), the thread's ape entries and its grad_ape accumulators (SG*V fp32 each) in registers.
    Longer windows: the two-pass streaming kernel of ``backward_long.py``.
    """
    W = coff * ratio
    if W <= 8:
        # HA: the thread's ape entries stay in registers across its rows (ratio 4 coff 2: 124 registers, was 120
        # with a reload per row). H200, one GPU, two runs per side (2026-12-01): 3x8192 d512 r4 c2 backward -1 to
        # -2 % cold, the other ratio-4 cases level to -2 % (benchmarks/results/backward_occupancy_ab_h200_20261201.md).
        sch = make_schedule(ratio, coff, head_dim, vcap=2, threads=128, cols_cap=128, md=True)
        # SHORT_BACKWARD_THREADS: the same thread tile, 4x the row lanes per CTA (one CTA per SM by registers).
        return replace(sch, HA=True).with_threads(SHORT_BACKWARD_THREADS)
    return long_backward_schedule(ratio, coff, head_dim)


def backward_smem_bytes(sch: Schedule) -> int:
    """Dynamic shared memory of the main backward kernel (row-lane reduction + cross-group buffers)."""
    if sch.SC:
        return stats_backward_smem_bytes(sch)
    if sch.LONG:
        return long_backward_smem_bytes(sch)
    cw = sch.TC * sch.V
    cross = 2 * sch.R * sch.G * cw + 3 * sch.R * cw if sch.G > 1 else 0
    return (sch.threads * sch.V + cross) * 4 + 128


def build_backward(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function (main kernel + grad_ape reduction kernel).

    Signature: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
    grad_ape, ws, B, N, T, rows_per_cta, num_ctas, stream)``; ``rows_per_cta`` is a multiple of R,
    ``num_ctas * rows_per_cta >= N``, ``ws`` holds ``num_ctas * ratio * coff * head_dim`` fp32.
    """
    if sch.SC:
        return build_backward_stats(ratio, coff, head_dim, sch)
    if sch.LONG:
        return build_backward_long(ratio, coff, head_dim, sch)
    V, TC, G, SG, R, MD, EF, ES = sch.V, sch.TC, sch.G, sch.SG, sch.R, sch.MD, sch.EF, sch.ES
    assert sch.NB == 1 and not sch.CM, "the short-window backward streams rows, not slot batches"
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    NT = sch.threads
    CW = TC * V
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    assert G * SG == W
    SMEM_ROW = G * CW
    LANES = R * G  # threads sharing one column vector (zero duties are spread over them)
    zeros = ZeroStores(ratio, coff, head_dim, V, ES)
    APE_SIZE = ratio * WIDTH
    # Register cap: ptxas otherwise spends ~150 registers on ILP; 128 per thread keeps 512 threads per SM.

    # PF: per row lane and row step, the window two steps ahead (W slots x 2 tensors x LINES 128-byte lines of the
    # CTA's columns) is prefetched into L2 by the row lane's first threads, adding bytes in flight that hold no
    # registers (the next row's loads are in registers already). Hints only: the token is guessed from the next
    # row's (same segment), clamped into [0, T); a wrong guess at a segment boundary costs a line.
    LINES = -(-CW * 2 // 128)

    @cute.jit
    def prefetch_window(kv, score, rp, t0p, q, by, row_lim, T):
        if (q < 2 * W * LINES) & (rp < row_lim):
            rem = q % (W * LINES)
            s = rem // LINES
            tok = cutlass.min(cutlass.max(t0p - (coff - 1) * ratio + s, Int32(0)), T - 1)
            off = tok * WIDTH + (s // ratio) * D + by * CW + (rem % LINES) * 64
            if q < W * LINES:
                prefetch_l2(kv + off)
            else:
                prefetch_l2(score + off)

    @cute.jit
    def store_slot(gkv, gsc, dvo, dlo, t0, s, valid, c):
        # A slot's gradients land where its inputs were read (stores are disjoint across rows).
        if valid:
            off = (t0 - (coff - 1) * ratio + s) * WIDTH + (s // ratio) * D + c
            window_store(gkv, off, V, dvo.load().to(BFloat16), ES)
            window_store(gsc, off, V, dlo.load().to(BFloat16), ES)

    @cute.jit
    def load_row(kv, score, gout, cu_t, cuc_t, B, kvf, scf, gb, r, ok, g, c):
        """Row layout of row r and every DRAM load of the thread's window slots (issued, not waited for)."""
        active = ok
        t0 = Int32(0)
        first = Boolean(True)
        last = Boolean(False)
        seg_end = Int32(0)
        if active:
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0
            last = r == cuc_t[b + 1] - 1
            seg_end = cu_t[b + 1]
        for k in cutlass.range_constexpr(SG):
            s = g * SG + k
            half = s // ratio
            vk = active
            if cutlass.const_expr(coff == 2):
                vk = active & ((half == 1) | (not first))
            kvf[k].fill(0.0)
            scf[k].fill(NEG_INF)
            if vk:
                off = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + c
                kvf[k].store(window_load(kv, off, V, EF))
                scf[k].store(window_load(score, off, V, EF))
        gb.fill(0.0)
        if active:
            gb.store(window_load(gout, r * D + c, V, EF))
        return active, t0, first, last, seg_end

    @cute.jit
    def load_ape(ape, apf, g, c, col_ok):
        """The thread's ape entries (its group's slots x V columns; 0 past head_dim)."""
        for k in cutlass.range_constexpr(SG):
            s = g * SG + k
            apf[k].fill(0.0)
            if col_ok:
                apf[k].store(vec_view(ape, (s % ratio) * WIDTH + (s // ratio) * D + c, V).load())

    @cute.jit
    def compute_row(
        ape, gkv, gsc, kvf, scf, gb, apf, pf, pq, xf, vm, vs, vl, dvo, dlo, zero, dap,
        sm_a, sm_b, sm_res, active, t0, first, last, seg_end, g, tc, rl, tidx, c, col_ok,
    ):  # fmt: skip
        """Gradients of one row from the thread's registers; stores; exact zeros of a segment's last group."""
        valid = []
        for k in cutlass.range_constexpr(SG):
            s = g * SG + k
            vk = active
            if cutlass.const_expr(coff == 2):
                vk = active & ((s // ratio == 1) | (not first))
            valid.append(vk)
        if cutlass.const_expr(not sch.HA):
            load_ape(ape, apf, g, c, col_ok)
        gf = widen(gb, V)  # grad_out in fp32
        kvw = [widen(kvf[k], V) for k in range(SG)]

        if cutlass.const_expr(G == 1):
            # Pass A (per column): p = expf(x - max) / sum and S, the reference's operation order.
            exact_probabilities(scf, apf, pq, first, V, SG, ratio, coff, MD)
            for i in cutlass.range_constexpr(V):
                gi = gf[i]
                p = [pq[i * SG + k] for k in range(SG)]
                gvp = [mul_rn(mul_rn(gi, kvw[k][i]), p[k]) for k in range(SG)]
                ssum = torch_order_sum(gvp)
                for k in cutlass.range_constexpr(SG):
                    pf[k][i] = p[k]
                vs[i] = ssum
            # Pass B (per slot): dv = g*p, dlogit = p*(g*v - S); stored right away.
            for k in cutlass.range_constexpr(SG):
                for i in cutlass.range_constexpr(V):
                    gi = gf[i]
                    dvo[i] = mul_rn(gi, pf[k][i])
                    dlo[i] = mul_rn(pf[k][i], sub_rn(mul_rn(gi, kvw[k][i]), vs[i]))
                if valid[k]:
                    for i in cutlass.range_constexpr(V):
                        dap[k][i] = add_rn(dap[k][i], dlo[i])
                store_slot(gkv, gsc, dvo, dlo, t0, g * SG + k, valid[k], c)
        else:
            for k in cutlass.range_constexpr(SG):
                scw = widen(scf[k], V)
                for i in cutlass.range_constexpr(V):
                    xf[k][i] = scw[i] + apf[k][i]
            base = rl * SMEM_ROW + g * CW + tc * V
            # Pass 1: per-group (max, sum e).
            for i in cutlass.range_constexpr(V):
                m = xf[0][i]
                for k in cutlass.range_constexpr(1, SG):
                    m = cute.arch.fmax(m, xf[k][i], nan=True)
                msafe = m
                if m == Float32(NEG_INF):
                    msafe = Float32(0.0)
                ml = msafe * LOG2E
                total = Float32(0.0)
                for k in cutlass.range_constexpr(SG):
                    total = total + ex2(xf[k][i] * LOG2E - ml)
                vm[i] = m
                vs[i] = total
            vec_view(sm_a.iterator, base, V).store(vm.load())
            vec_view(sm_b.iterator, base, V).store(vs.load())
            cute.arch.sync_threads()
            # Column-parallel combine (groups in a fixed order): row max and 1/sum.
            for qa in cutlass.range(tidx, R * CW, NT):
                qab = (qa // CW) * SMEM_ROW + qa % CW
                mx = sm_a[qab]
                for h in cutlass.range_constexpr(1, G):
                    mx = cute.arch.fmax(mx, sm_a[qab + h * CW], nan=True)
                mxl = mx * LOG2E
                total = Float32(0.0)
                for h in cutlass.range_constexpr(G):
                    total = total + sm_b[qab + h * CW] * ex2(sm_a[qab + h * CW] * LOG2E - mxl)
                sm_res[qa] = mxl
                sm_res[R * CW + qa] = Float32(1.0) / total
            cute.arch.sync_threads()
            # Pass 2: the group's share of S = sum(gv * p).
            resb = rl * CW + tc * V
            for i in cutlass.range_constexpr(V):
                mxl = sm_res[resb + i]
                inv = sm_res[R * CW + resb + i]
                vm[i] = mxl
                vs[i] = inv
                ssum = Float32(0.0)
                for k in cutlass.range_constexpr(SG):
                    pk = ex2(xf[k][i] * LOG2E - mxl) * inv
                    ssum = ssum + gf[i] * kvw[k][i] * pk
                dvo[i] = ssum
            vec_view(sm_a.iterator, base, V).store(dvo.load())
            cute.arch.sync_threads()
            for qs in cutlass.range(tidx, R * CW, NT):
                qsb = (qs // CW) * SMEM_ROW + qs % CW
                ssum = sm_a[qsb]
                for h in cutlass.range_constexpr(1, G):
                    ssum = ssum + sm_a[qsb + h * CW]
                sm_res[2 * R * CW + qs] = ssum
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(V):
                vl[i] = sm_res[2 * R * CW + resb + i]
            # Pass 3 (per slot): gradients, stored right away.
            for k in cutlass.range_constexpr(SG):
                for i in cutlass.range_constexpr(V):
                    gi = gf[i]
                    pk = ex2(xf[k][i] * LOG2E - vm[i]) * vs[i]
                    dvo[i] = gi * pk
                    dlo[i] = pk * (gi * kvw[k][i] - vl[i])
                if valid[k]:
                    for i in cutlass.range_constexpr(V):
                        dap[k][i] = dap[k][i] + dlo[i]
                store_slot(gkv, gsc, dvo, dlo, t0, g * SG + k, valid[k], c)

        # Exact zeros owned by a segment's last group.
        if active & last:
            zeros.segment_tail(gkv, gsc, zero, t0, seg_end, g * SG, SG, c)

    @cute.kernel
    def kernel(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        gout: cute.Pointer,
        gkv: cute.Pointer,
        gsc: cute.Pointer,
        ws: cute.Pointer,
        B: Int32,
        N: Int32,
        T: Int32,
        rows_per_cta: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        tc = tidx % TC
        g = (tidx // TC) % G
        rl = tidx // (TC * G)
        lane = rl * G + g
        q = tidx % (TC * G)  # thread within its row lane
        c = (by * TC + tc) * V
        col_ok = Boolean(True)
        if cutlass.const_expr(not COLS_EXACT):
            col_ok = c < D
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = cuc_t[B]

        smem = cutlass.memory.SmemAllocator()
        sm_red = smem.allocate_tensor(Float32, cute.make_layout(NT * V), byte_alignment=16)
        sm_a = sm_red
        sm_b = sm_red
        sm_res = sm_red
        if cutlass.const_expr(G > 1):
            sm_a = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_b = smem.allocate_tensor(Float32, cute.make_layout(R * SMEM_ROW), byte_alignment=16)
            sm_res = smem.allocate_tensor(Float32, cute.make_layout(3 * R * CW), byte_alignment=16)

        zero = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
        zero.fill(0.0)
        dap = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        for k in cutlass.range_constexpr(SG):
            dap[k].fill(0.0)
        # Two buffer sets: the next row's loads are in flight while the current row is computed.
        kvb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        scb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        gbb = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(2)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        if cutlass.const_expr(sch.HA):
            load_ape(ape, apf, g, c, col_ok)  # the same for every row of the thread: loaded once
        # G == 1 keeps p per (slot, column); G > 1 keeps the fp32 logits (score + ape) instead.
        pf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG if G == 1 else 0)]
        pq = cute.make_rmem_tensor(cute.make_layout(V * SG if G == 1 else 1), Float32)
        xf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG if G > 1 else 0)]
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vs = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        dvo = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        dlo = cute.make_rmem_tensor(cute.make_layout(V), Float32)

        row_begin = bx * rows_per_cta
        row_end = row_begin + rows_per_cta
        # Rows past the true row count (padding) carry no gradient.
        row_lim = cutlass.min(cutlass.min(row_end, N), nreal)
        n_iter = rows_per_cta // R
        r0 = row_begin + rl
        active, t0, first, last, seg_end = load_row(
            kv, score, gout, cu_t, cuc_t, B, kvb[0], scb[0], gbb[0], r0, col_ok & (r0 < row_lim), g, c
        )
        for jp in cutlass.range((n_iter + 1) // 2):
            for ph in cutlass.range_constexpr(2):
                rn = row_begin + (2 * jp + ph + 1) * R + rl
                n_active, n_t0, n_first, n_last, n_seg_end = load_row(
                    kv, score, gout, cu_t, cuc_t, B, kvb[1 - ph], scb[1 - ph], gbb[1 - ph], rn,
                    col_ok & (rn < row_lim), g, c,
                )  # fmt: skip
                if cutlass.const_expr(sch.PF):
                    prefetch_window(kv, score, rn + R, n_t0 + R * ratio, q, by, row_lim, T)
                compute_row(
                    ape, gkv, gsc, kvb[ph], scb[ph], gbb[ph], apf, pf, pq, xf, vm, vs, vl, dvo, dlo, zero, dap,
                    sm_a, sm_b, sm_res, active, t0, first, last, seg_end, g, tc, rl, tidx, c, col_ok,
                )  # fmt: skip
                active = n_active
                t0 = n_t0
                first = n_first
                last = n_last
                seg_end = n_seg_end

        # Exact zeros: segments with no group (seqlen < ratio) and token-capacity padding.
        if col_ok:
            zeros.unowned(gkv, gsc, zero, cu_t, cuc_t, B, T, bx, gdx, lane, LANES, c)

        # grad_ape partial of this CTA: row lanes summed in a fixed order, one slab per CTA.
        for k in cutlass.range_constexpr(SG):
            if cutlass.const_expr(R > 1):
                vec_view(sm_red.iterator, tidx * V, V).store(dap[k].load())
                cute.arch.sync_threads()
                if rl == 0:
                    for i in cutlass.range_constexpr(V):
                        acc = sm_red[tidx * V + i]
                        for h in cutlass.range_constexpr(1, R):
                            acc = add_rn(acc, sm_red[(tidx + h * TC * G) * V + i])
                        dap[k][i] = acc
                cute.arch.sync_threads()
            if (rl == 0) & col_ok:
                s = g * SG + k
                aoff = (s % ratio) * WIDTH + (s // ratio) * D + c
                vec_view(ws, bx * APE_SIZE + aoff, V).store(dap[k].load())

    return make_backward_host(
        kernel,
        APE_SIZE,
        NCHUNK,
        NT,
        backward_smem_bytes(sch),
        SMEM_CARVEOUT,
        slab_lanes=reduce_slab_lanes(sch),
        min_blocks=sch.MB,
    )
