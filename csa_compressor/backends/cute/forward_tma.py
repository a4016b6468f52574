"""Forward of long windows streamed through shared memory by 2D TMA tile copies (``Schedule.TM``, sm_90).

Why: the register forward of 128-slot windows (``forward.py``) sits at x1.19-1.25 of the DRAM floor; every
earlier bulk form (row-piece ``cp.async.bulk``, thirteenth round) was bound by the issue rate of its many small
copies. A tensor-map copy moves a whole ``ratio x CW`` box (8-16 KB) per instruction.

Structure (one persistent CTA per SM, warp-specialised):

- the CTA owns one column chunk of ``CW`` columns (its ape entries sit in shared memory for the whole launch) and
  walks the rows ``q, q + CPC, ...`` of that chunk (``CPC`` CTAs per chunk);
- one producer warp issues, per row, one TMA box per (tensor, window half) into one of ``TM`` stages and arrives
  on the stage's "full" mbarrier with the byte count; it refills a stage once the consumers of its previous row
  arrived on its "empty" mbarrier. The rows' first tokens come from one binary search per lane for 32 rows at a
  time, broadcast by shuffles, so the copies are never behind a dependent global load;
- ``R`` consumer groups of ``G`` warps take the rows in turn (group ``k % R`` has the CTA's ``k``-th row). Lane
  ``(rg, ch)`` of warp ``wi`` holds columns ``8 ch .. 8 ch + 7`` (16-byte shared loads, conflict-free: the 8
  lanes of a quarter warp read 128 contiguous bytes) of the rows ``wi * RG + rg + G * RG * j`` and folds them
  online in batches of ``SG`` rows (log2 domain, as ``WindowOps.online_batch``); the row groups of a warp merge by
  butterflies (rounding pinned, commutative: every lane ends with the same bits), the ``G`` warps of a group
  through shared memory (double-buffered partials, one named barrier per row, merged in a fixed order).

Numerics: fp32, ex2 of the log2-domain logits, one rounding to bf16; another summation order than the register
forward (within the contract, not bitwise equal to it), deterministic.
Needs ``head_dim % 8 == 0`` (16-byte rows and stores), ``ratio % 8 == 0`` and ``ratio <= 256`` (a TMA box is at
most 256 rows). The tensor map spans ``ROWS_MAX`` rows (no token count in the host ABI): a window never leaves
the real tensor (``t0 + ratio <= T``), so the copies never read past it.
"""

from __future__ import annotations

from dataclasses import replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass.cute.nvgpu import cpasync

from .forward import LOG2E, NEG_INF, Schedule, add_rn, ex2, find_segment, mul_rn, vec_view

SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90
V = 8  # columns per lane (one 16-byte shared load of bf16)


def tma_forward_smem_bytes(ratio: int, coff: int, sch: Schedule) -> int:
    """Stages (kv and score boxes of every half), ape chunk, group partials, stage flags and mbarriers."""
    cw = sch.TC * V
    stages = sch.TM * 2 * coff * ratio * cw * 2
    ape = coff * ratio * cw * 4
    parts = sch.R * 2 * sch.G * 3 * cw * 4 if sch.G > 1 else 0
    return stages + ape + parts + sch.TM * (4 + 16) + 256


def tma_forward_schedule(
    ratio: int, coff: int, head_dim: int, num_sms: int, cols: int = 32, warps_per_row: int = 0,
    groups: int = 0, stages: int = 0, rows_per_batch: int = 4,
) -> Schedule | None:  # fmt: skip
    """The TMA form (persistent grid of at most ``num_sms`` CTAs), or None where it does not apply. Defaults: coff 1
    two warps per row and four groups (12 stages of 16 KB), coff 2 four warps per row and two groups (the stages
    are twice as large, 5 fit): at least half the stages stay in flight. ``stages`` 0: as many as fit."""
    if coff * ratio <= 16 or ratio % 8 or ratio > 256 or head_dim % 8 or cols not in (32, 64):
        return None
    tc = cols // V
    rg = 32 // tc
    # Shorter windows (ratio 64): fewer warps per row, so that a lane keeps at least one batch of rows.
    warps_per_row = warps_per_row or max(1, min(2 if coff == 1 else 4, ratio // (rg * rows_per_batch)))
    groups = groups or (4 if coff == 1 else 2)
    rows_per_lane = ratio // (warps_per_row * rg)
    if rows_per_lane < 1 or ratio % (warps_per_row * rg) or rows_per_lane % rows_per_batch:
        return None
    sch = Schedule(V=V, TC=tc, G=warps_per_row, SG=rows_per_batch, R=groups, CM=True, TM=max(stages, 2), PS=num_sms)
    if stages <= 0:  # as many stages as fit
        fixed = tma_forward_smem_bytes(ratio, coff, replace(sch, TM=0))
        per = 2 * coff * ratio * cols * 2 + 20
        sch = replace(sch, TM=min(16, (SMEM_LIMIT - fixed) // per))
    if sch.TM < 2 or tma_forward_smem_bytes(ratio, coff, sch) > SMEM_LIMIT:
        return None
    return sch


def tma_grid(n_rows: int, head_dim: int, sch: Schedule) -> int:
    """CTAs of one launch: ``CPC`` per column chunk, at most one per SM in all."""
    nchunk = -(-head_dim // (sch.TC * V))
    return nchunk * max(1, min(n_rows, sch.PS // nchunk))


def build_forward_tma(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function (``build_forward``'s signature) of the TMA forward."""
    TC, WPT, RB, NG, NS, PS = sch.TC, sch.G, sch.SG, sch.R, sch.TM, sch.PS
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    CW = TC * V
    NCHUNK = -(-D // CW)
    CPC_MAX = max(1, PS // NCHUNK)
    RG = 32 // TC  # row groups per warp
    RPL = ratio // (WPT * RG)  # rows per lane and half
    NB = RPL // RB  # batches per half
    NCONS = NG * WPT  # consumer warps
    NT = (NCONS + 1) * 32
    BOX = ratio * CW  # elements of one TMA box
    STAGE = 2 * coff * BOX
    ROWS_MAX = (2**31 - 1) // WIDTH
    ST = sch.ST
    EF = sch.EF
    smem_bytes = tma_forward_smem_bytes(ratio, coff, sch)
    assert RPL >= 1 and NB >= 1 and NG + 2 <= 16

    @cute.jit
    def row_start(cu_t, cuc_t, B, nreal, r):
        """(first token, first row of its segment? as 0/1) of row r; padding rows read from token 0 as a first row."""
        t0 = Int32(0)
        first = Int32(1)
        if r < nreal:
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            if j != 0:
                first = Int32(0)
        return t0, first

    @cute.jit
    def produce(tma_kv, g_kv, tma_sc, g_sc, cu_t, cuc_t, B, nreal, q, cpc, col0, n_it, sbuf, flags, full, empty):
        lane = cute.arch.lane_idx()
        s_layout = cute.make_layout((ratio, CW), stride=(CW, 1))
        policy = None
        if cutlass.const_expr(EF):
            policy = evict_first_policy()
        t0_l = Int32(0)
        first_l = Int32(1)
        for k in cutlass.range(n_it, unroll=1):
            if k % 32 == 0:
                t0_l, first_l = row_start(cu_t, cuc_t, B, nreal, q + (k + lane) * cpc)
            t0 = cute.arch.shuffle_sync(t0_l, k % 32)
            first = cute.arch.shuffle_sync(first_l, k % 32)
            st = k % NS
            if k >= NS:
                cute.arch.mbarrier_wait(empty + st, (k // NS - 1) % 2)
            nbytes = 2 * BOX * 2
            if cutlass.const_expr(coff == 2):
                if first == 0:
                    nbytes = 2 * 2 * BOX * 2
            with cute.arch.elect_one():
                flags[st] = first
                cute.arch.mbarrier_arrive_and_expect_tx(full + st, nbytes)
            for x in cutlass.range_constexpr(2):
                atom = tma_kv if x == 0 else tma_sc
                gt = g_kv if x == 0 else g_sc
                for h in cutlass.range_constexpr(coff):
                    off = (st * 2 + x) * coff * BOX + h * BOX
                    s_tile = cute.make_tensor(sbuf.iterator + cute.assume(off, divby=BOX), s_layout)
                    row = t0 - (coff - 1 - h) * ratio
                    g_tile = cute.local_tile(cute.domain_offset((row, h * D + col0), gt), (ratio, CW), (0, 0))
                    t_s, t_g = cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2), cute.group_modes(g_tile, 0, 2)
                    )
                    go = Boolean(True)
                    if cutlass.const_expr(coff == 2 and h == 0):
                        go = first == 0
                    if go:
                        if cutlass.const_expr(EF):
                            cute.copy(atom, t_g, t_s, tma_bar_ptr=full + st, cache_policy=policy)
                        else:
                            cute.copy(atom, t_g, t_s, tma_bar_ptr=full + st)

    @cute.jit
    def fold_batch(sbuf, ape_s, base, rows0, h, vm, vl, va):
        """Fold rows ``rows0 + G*RG*b`` (b < RB) of half h at stage offset ``base`` into (max, sum e, sum e*v)."""
        kvf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(RB)]
        scf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(RB)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(RB)]
        lane = cute.arch.lane_idx()
        ch = lane % TC
        for b in cutlass.range_constexpr(RB):
            rr = rows0 + WPT * RG * b
            kvf[b].store(vec_view(sbuf.iterator, base + h * BOX + rr * CW + ch * V, V).load())
            scf[b].store(vec_view(sbuf.iterator, base + coff * BOX + h * BOX + rr * CW + ch * V, V).load())
            arow = (h * ratio + rr) * CW + ch * 4
            odd = rr % 2  # ratio is even: the slot's parity
            lo = vec_view(ape_s.iterator, arow + odd * (CW // 2), 4).load()
            hi = vec_view(ape_s.iterator, arow + (1 - odd) * (CW // 2), 4).load()
            for i in cutlass.range_constexpr(4):
                apf[b][i] = lo[i]
                apf[b][4 + i] = hi[i]
        for i in cutlass.range_constexpr(V):
            y = [(Float32(scf[b][i]) + apf[b][i]) * LOG2E for b in range(RB)]
            m = vm[i]
            for b in cutlass.range_constexpr(RB):
                m = cute.arch.fmax(m, y[b], nan=True)
            # Every slot so far masked (or -inf): m = -inf, keep e = 0.
            msafe = m
            if m == Float32(NEG_INF):
                msafe = Float32(0.0)
            carry = ex2(vm[i] - msafe)
            total = vl[i] * carry
            acc = va[i] * carry
            for b in cutlass.range_constexpr(RB):
                e = ex2(y[b] - msafe)
                total = total + e
                acc = acc + e * Float32(kvf[b][i])
            vm[i] = m
            vl[i] = total
            va[i] = acc

    @cute.jit
    def merge(m, lo, ao, mo, lo2, ao2):
        """(max, sum, acc) of two partials; products and sums pinned, so merge(a, b) == merge(b, a) bitwise."""
        mn = cute.arch.fmax(m, mo, nan=True)
        mns = mn
        if mn == Float32(NEG_INF):
            mns = Float32(0.0)
        sa = ex2(m - mns)
        sb = ex2(mo - mns)
        return mn, add_rn(mul_rn(lo, sa), mul_rn(lo2, sb)), add_rn(mul_rn(ao, sa), mul_rn(ao2, sb))

    @cute.jit
    def consume(ape, out, stats, q, cpc, chunk, n_it, sbuf, ape_s, parts, flags, full, empty, w):
        lane = cute.arch.lane_idx()
        ch = lane % TC
        rg = lane // TC
        gi = w // WPT
        wi = w % WPT
        col0 = chunk * CW
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        va = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        res = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        inv = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        out_t = cute.make_tensor(out, cute.make_layout(1 << 30))
        st_t = cute.make_tensor(stats, cute.make_layout(1 << 30))
        for k in cutlass.range(gi, n_it, NG, unroll=1):
            st = k % NS
            r = q + k * cpc
            cute.arch.mbarrier_wait(full + st, (k // NS) % 2)
            first = flags[st]
            vm.fill(NEG_INF)
            vl.fill(0.0)
            va.fill(0.0)
            base = st * STAGE
            for h in cutlass.range_constexpr(coff):
                go = Boolean(True)
                if cutlass.const_expr(coff == 2 and h == 0):
                    go = first == 0
                if go:
                    for bi in cutlass.range_constexpr(NB):
                        fold_batch(sbuf, ape_s, base, wi * RG + rg + WPT * RG * RB * bi, h, vm, vl, va)
            cute.arch.mbarrier_arrive(empty + st)  # this lane's reads of the stage are done
            # Row groups of the warp (lane bits above the column lanes): butterflies.
            for step in cutlass.range_constexpr(5):
                off = 1 << step
                if cutlass.const_expr(off >= TC):
                    for i in cutlass.range_constexpr(V):
                        mo = cute.arch.shuffle_sync_bfly(vm[i], offset=off)
                        lo = cute.arch.shuffle_sync_bfly(vl[i], offset=off)
                        ao = cute.arch.shuffle_sync_bfly(va[i], offset=off)
                        vm[i], vl[i], va[i] = merge(vm[i], vl[i], va[i], mo, lo, ao)
            if cutlass.const_expr(WPT == 1):
                col = col0 + ch * V
                if (rg == 0) & (col < D):
                    for i in cutlass.range_constexpr(V):
                        res[i] = va[i] / vl[i]
                        inv[i] = Float32(1.0) / vl[i]
                    vec_view(out, r * D + col, V).store(res.load().to(BFloat16))
                    if cutlass.const_expr(ST):
                        vec_view(stats, r * 3 * D + col, V).store(vm.load())
                        vec_view(stats, r * 3 * D + D + col, V).store(inv.load())
                        vec_view(stats, r * 3 * D + 2 * D + col, V).store(res.load())
            else:
                pb = ((gi * 2 + (k // NG) % 2) * WPT) * 3 * CW
                if rg == 0:
                    pw = pb + wi * 3 * CW + ch * V
                    vec_view(parts.iterator, pw, V).store(vm.load())
                    vec_view(parts.iterator, pw + CW, V).store(vl.load())
                    vec_view(parts.iterator, pw + 2 * CW, V).store(va.load())
                cute.arch.barrier(barrier_id=1 + gi, number_of_threads=WPT * 32)
                for cq in cutlass.range(wi * 32 + lane, CW, WPT * 32, unroll=1):
                    col = col0 + cq
                    if col < D:
                        mx = parts[pb + cq]
                        total = parts[pb + CW + cq]
                        acc = parts[pb + 2 * CW + cq]
                        for w2 in cutlass.range_constexpr(1, WPT):
                            p2 = pb + w2 * 3 * CW + cq
                            mx, total, acc = merge(mx, total, acc, parts[p2], parts[p2 + CW], parts[p2 + 2 * CW])
                        rq = acc / total
                        out_t[r * D + col] = BFloat16(rq)
                        if cutlass.const_expr(ST):
                            st_t[r * 3 * D + col] = mx
                            st_t[r * 3 * D + D + col] = Float32(1.0) / total
                            st_t[r * 3 * D + 2 * D + col] = rq

    @cute.jit
    def body(tma_kv, g_kv, tma_sc, g_sc, ape, cu, cuc, out, stats, B: Int32, N: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        cpc = grid // NCHUNK
        chunk = bx % NCHUNK
        q = bx // NCHUNK
        n_it = (N - q + cpc - 1) // cpc
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = cuc_t[B]
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(BFloat16, cute.make_layout(NS * STAGE), byte_alignment=1024)
        ape_s = smem.allocate_tensor(Float32, cute.make_layout(W * CW), byte_alignment=16)
        parts = ape_s
        if cutlass.const_expr(WPT > 1):
            parts = smem.allocate_tensor(Float32, cute.make_layout(NG * 2 * WPT * 3 * CW), byte_alignment=16)
        flags = smem.allocate_tensor(Int32, cute.make_layout(NS), byte_alignment=16)
        full = smem.allocate_array(cutlass.Int64, NS, byte_alignment=8)
        empty = smem.allocate_array(cutlass.Int64, NS, byte_alignment=8)
        w = tidx // 32
        if tidx == 0:
            for st in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(full + st, 1)
                cute.arch.mbarrier_init(empty + st, WPT * 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if w == NCONS:
            produce(tma_kv, g_kv, tma_sc, g_sc, cu_t, cuc_t, B, nreal, q, cpc, chunk * CW, n_it, sbuf, flags, full,
                    empty)  # fmt: skip
        else:
            # The chunk's ape entries (zero past head_dim), permuted so that a lane's 8 columns are two 16-byte
            # reads: element (s, 8 ch + i) at s * CW + (i // 4 ^ s % 2) * CW / 2 + 4 ch + i % 4. The parity swap
            # puts the two slots a quarter warp reads (CW 32: 4 lanes per slot) on disjoint banks.
            for e in cutlass.range(tidx, W * CW, NCONS * 32, unroll=1):
                s = e // CW
                c = e % CW
                col = chunk * CW + c
                v = Float32(0.0)
                if col < D:
                    v = cute.make_tensor(ape, cute.make_layout(W * WIDTH))[(s % ratio) * WIDTH + (s // ratio) * D + col]
                ape_s[s * CW + (((c % V) // 4) ^ (s % 2)) * (CW // 2) + (c // V) * 4 + c % 4] = v
            cute.arch.barrier(barrier_id=1 + NG, number_of_threads=NCONS * 32)
            consume(ape, out, stats, q, cpc, chunk, n_it, sbuf, ape_s, parts, flags, full, empty, w)

    def grid_of(N):
        return [NCHUNK * cutlass.max(1, cutlass.min(N, CPC_MAX)), 1, 1]

    def atoms(kv, score):
        op = cpasync.CopyBulkTensorTileG2SOp()
        s_layout = cute.make_layout((ratio, CW), stride=(CW, 1))
        layout = cute.make_layout((ROWS_MAX, WIDTH), stride=(WIDTH, 1))
        tma_kv, g_kv = cpasync.make_tiled_tma_atom(op, cute.make_tensor(kv, layout), s_layout, (ratio, CW))
        tma_sc, g_sc = cpasync.make_tiled_tma_atom(op, cute.make_tensor(score, layout), s_layout, (ratio, CW))
        return tma_kv, g_kv, tma_sc, g_sc

    if ST:

        @cute.kernel
        def kernel_st(tma_kv: cute.CopyAtom, g_kv: cute.Tensor, tma_sc: cute.CopyAtom, g_sc: cute.Tensor,
                      ape: cute.Pointer, cu: cute.Pointer, cuc: cute.Pointer, out: cute.Pointer, stats: cute.Pointer,
                      B: Int32, N: Int32):  # fmt: skip
            body(tma_kv, g_kv, tma_sc, g_sc, ape, cu, cuc, out, stats, B, N)

        @cute.jit
        def host_st(kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer, cuc: cute.Pointer,
                    out: cute.Pointer, stats: cute.Pointer, B: Int32, N: Int32, stream: cuda.CUstream):  # fmt: skip
            tma_kv, g_kv, tma_sc, g_sc = atoms(kv, score)
            kernel_st(tma_kv, g_kv, tma_sc, g_sc, ape, cu, cuc, out, stats, B, N).launch(
                grid=grid_of(N), block=[NT, 1, 1], smem=smem_bytes, stream=stream
            )

        return host_st

    @cute.kernel
    def kernel(tma_kv: cute.CopyAtom, g_kv: cute.Tensor, tma_sc: cute.CopyAtom, g_sc: cute.Tensor,
               ape: cute.Pointer, cu: cute.Pointer, cuc: cute.Pointer, out: cute.Pointer, B: Int32, N: Int32):  # fmt: skip
        body(tma_kv, g_kv, tma_sc, g_sc, ape, cu, cuc, out, out, B, N)

    @cute.jit
    def host(kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer, cuc: cute.Pointer,
             out: cute.Pointer, B: Int32, N: Int32, stream: cuda.CUstream):  # fmt: skip
        tma_kv, g_kv, tma_sc, g_sc = atoms(kv, score)
        kernel(tma_kv, g_kv, tma_sc, g_sc, ape, cu, cuc, out, B, N).launch(
            grid=grid_of(N), block=[NT, 1, 1], smem=smem_bytes, stream=stream
        )

    return host


def evict_first_policy():
    """An L2 cache policy (``createpolicy``) that marks every line a copy brings in evict-first."""
    from cutlass import Int64
    from cutlass.cutlass_dsl import T

    from .forward import inline_ptx

    return Int64(inline_ptx("createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", [], "=l", T.i64()))
