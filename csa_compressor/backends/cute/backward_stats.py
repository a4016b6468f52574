"""CuTe-DSL backward for long windows given the forward's softmax statistics (``Schedule.SC > 0``).

With the row max ``m``, ``1/sum`` and fp32 output saved by the forward, every window element's gradient
is independent of the others: ``p = 2^(y - m) / sum``, ``dv = g * p``, ``dlogit = p * (g*v - g*out)``.
So a CTA needs neither a whole window nor a barrier (the loop interchange of the Triton statistics
kernel):

- grid ``[row ranges, column chunks x slot chunks]``: a CTA owns ``CW = TC * V`` columns and
  ``SC = G * SG`` consecutive window slots of a contiguous range of rows, ``R`` rows at a time (row lane
  ``rl`` takes rows ``rl, rl + R, ...`` of the range);
- a thread owns ``V`` columns (8-byte vectors) of ``SG`` slots; per row it loads the row's statistics and
  ``grad_out`` for its columns (L1 serves the CTA's other slot groups) and its slots' kv and score,
  with the next row's kv and score already in flight (double buffer in registers), and stores ``dv``
  and ``dlogit`` at once;
- ``ape`` is loaded once per CTA; ``grad_ape`` accumulates in registers over the thread's rows, the ``R``
  row lanes are summed in lane order through shared memory, and the CTA writes its part of the slab
  ``ws[row range]`` (disjoint slots and columns per CTA); the reduction kernel of ``backward_common`` sums the
  slabs in a fixed order (bitwise deterministic, no atomics). The slabs are extra DRAM traffic (written, then
  read): ``R`` rows side by side divide their number by ``R`` at the same CTA count.
- ``WT`` (whole-tile form): grid x is 1; a CTA of ``WHOLE_TILE_THREADS`` threads takes all rows of its tile in
  ``R`` row lanes, sums them in lane order through shared memory and writes grad_ape itself (``ws`` is grad_ape:
  slab 0 has grad_ape's layout). No slabs and no reduction kernel, where one CTA per tile fills the GPU.
- ``CL`` (cluster form): the row ranges of one (column chunk, slot chunk) tile are one thread-block cluster
  (``num_ctas <= CLUSTER_MAX`` CTAs on grid x, launched as one cluster). After a cluster barrier each CTA sums
  a share of the tile's entries over the cluster's CTAs in rank order (distributed shared memory) and writes
  grad_ape itself: no slabs and no reduction kernel, the same fixed order (rank = row range), so the same bits.

Exact zeros as the other backwards: a segment's last row zeroes the tail tokens of the slots its threads
own (and the first-half columns of its tokens, coff 2); the first slot chunk's CTAs zero the segments
without rows and the token-capacity padding.
"""

from __future__ import annotations

import os
from dataclasses import replace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from .backward_common import ZeroStores, make_backward_host
from .backward_long import prefetch_l1, prefetch_l2
from .forward import (
    LOG2E,
    Schedule,
    WindowOps,
    add_rn,
    ex2,
    find_segment,
    inline_ptx,
    real_rows,
    vec_view,
    vector_width,
    widen_plain,
    window_store,
)

# bf16 widened by NVVM's own conversion here, not forward.widen: with widen, ptxas issues a row's statistics loads
# one after another around their first uses (two DRAM round trips per row step instead of one, SASS) and the ratio-128
# coff-2 backward measured 14 % slower (1x65536 d512: 164.7 against 144.7 us cold; coff 1 level, 30.0 against 30.2;
# benchmarks/results/stats_widen_ab_h200_20261201.md).

# A row step's statistics and grad_out are loaded one step ahead, into registers, with the next step's window slice,
# so that the step's math does not wait a DRAM round trip for them first (128 registers; the coff-2 builds spill 8
# bytes outside the row loop). H200 A/B (benchmarks/results/stats_ahead_ab_h200_20261201.md, two passes, cold):
# 1x8192 d128 r128 c1 5.19 -> 4.73-4.76 us, 3x8192 d512 r128 c1 30.3 -> 29.6-29.8, 1x65536 d512 r128 c2 144.4 ->
# 140.9. Development switch (read at import): "0" loads them at the top of their own step (A/B runs).
_STATS_AHEAD = os.environ.get("CSA_COMPRESSOR_STATS_AHEAD", "1") != "0"

# Window slots per CTA: at least 8, and few enough slot chunks (at most STATS_CHUNKS) that a row's statistics and
# grad_out are not read by too many CTAs. H200 A/B (2026-11-30, cold backward, slots per CTA 32 / 16 / 8):
# 1x8192 d128 r128 c1 5.2 / 4.1-4.3 / 4.0 us; 3x8192 d512 r128 c1 31.3-31.6 / 30.4-31.0 / 30.5-31.1;
# 1x65536 d512 r128 c2 151.6 / 147.9-148.6 / 165 (32 chunks of 8 slots: the statistics re-reads cost more than
# the slabs they save).
STATS_MIN_SLOTS = 8
STATS_CHUNKS = 16
# The cluster form (Schedule.CL) is opt-in: on the H200 it measured 28-52 % slower than the slabs and the reduction
# kernel on all three ratio-128 cases, cold, clean and warm (benchmarks/results/stats_cluster_ab_h200_20261201.md).
STATS_CLUSTER = False
# Row ranges per cluster in the CL form: the portable cluster size (more needs a non-portable launch attribute).
CLUSTER_MAX = 8
# The whole-tile form (Schedule.WT) where one CTA per tile nearly fills the GPU (132 SMs on the H200, 148 on the B200):
# both large ratio-128 cases of SPEC section 6 have 128 tiles, 1x8192 d128 r128 c1 has 32 (slab form).
WHOLE_TILE_MIN_TILES = 96
WHOLE_TILE_THREADS = 512


@dsl_user_op
def ld_cluster_f32(addr, rank, *, loc=None, ip=None) -> Float32:
    """The fp32 at shared-memory address ``addr`` (this CTA's offset) of the cluster's CTA ``rank``.

    Side-effecting so that it stays after the cluster barrier that publishes the peers' stores."""
    operands = [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)]
    text = "{\n.reg .u32 %ra;\nmapa.shared::cluster.u32 %ra, $1, $2;\nld.shared::cluster.f32 $0, [%ra];\n}"
    return Float32(inline_ptx(text, operands, "=f,r,r", T.f32(), side_effects=True))


def stats_backward_schedule(
    ratio: int,
    coff: int,
    head_dim: int,
    slots_cap: int | None = None,
    vcap: int = 4,
    slots: int = 4,
    cluster: bool = STATS_CLUSTER,
    whole_tile: bool | None = None,
) -> Schedule:
    """128 threads: 64 columns (8-byte vectors, ``TC`` threads) x ``G`` groups of 4 slots (``SC = G * SG <=
    slots_cap`` window slots per CTA) x ``R`` rows at a time. Every CTA writes one grad_ape slab per row range, so
    rows side by side in a CTA (``R``) divide the slab bytes by ``R`` at the same CTA count (one wave); the price is
    that the statistics and grad_out of a row are read by ``W / SC`` CTAs (L2 hits; ``slots_cap``, by default
    ``max(STATS_MIN_SLOTS, W // STATS_CHUNKS)``, bounds that). 4 slots of 4 columns per thread keep the
    double-buffered rows, the statistics and the grad_ape accumulators within 128 registers (124), and load a row's
    statistics and grad_out once per 4 slots. H200 A/B (2026-12-01, cold backward, against 16-byte vectors x 2 slots):
    1x8192 d128 r128 c1 -6 / -7 %, 3x8192 d512 r128 c1 -1 / -2 %, 1x65536 d512 r128 c2 -0.3 / -0.9 % (both GPUs;
    benchmarks/results/stats_tile_ab_h200_20261201.md); 4 columns x 2 slots (79 registers, 6 CTAs per SM): +16-18 %
    on the large cases.

    ``whole_tile`` (``WT``; by default where the configuration has at least ``WHOLE_TILE_MIN_TILES`` tiles): the
    same thread tile in CTAs of ``WHOLE_TILE_THREADS`` (4x the row lanes, one CTA per SM by registers, so the same
    warps per SM), one CTA per tile over all rows: it writes grad_ape itself, with no slabs and no second kernel.
    """
    W = coff * ratio
    if slots_cap is None:
        slots_cap = max(STATS_MIN_SLOTS, W // STATS_CHUNKS)
    V = vector_width(head_dim, vcap)
    col_threads = -(-head_dim // V)
    TC = 1
    while TC * 2 <= col_threads and TC * 2 * V <= 64:
        TC *= 2
    SG = slots if W % slots == 0 else 1
    G = max(1, min(128 // TC, slots_cap // SG))
    while G > 1 and W % (G * SG):
        G //= 2
    R = max(1, 128 // (TC * G))
    sch = Schedule(V=V, TC=TC, G=G, SG=SG, R=R, NB=1, LONG=True, ST=True, SC=G * SG, CL=cluster)
    if whole_tile is None:
        tiles = -(-head_dim // (TC * V)) * (W // (G * SG))
        whole_tile = tiles >= WHOLE_TILE_MIN_TILES and not cluster
    return with_whole_tile(sch, bool(whole_tile))


def with_whole_tile(sch: Schedule, on: bool) -> Schedule:
    """``sch`` in the whole-tile form (``on``: CTAs of WHOLE_TILE_THREADS) or the slab form (128 threads), the thread
    tile unchanged: only the row lanes ``R`` change."""
    if sch.WT == on:
        return sch
    return replace(sch, WT=on).with_threads(WHOLE_TILE_THREADS if on else 128)


def stats_backward_smem_bytes(sch: Schedule) -> int:
    """The fixed-order combine of the ``R`` row lanes' grad_ape accumulators, fp32 (and, in the cluster form, the
    CTA's sum that the cluster's CTAs read)."""
    tile = sch.SC * sch.TC * sch.V * 4
    return 128 + (sch.R * tile if sch.R > 1 else 0) + (tile + 16 if sch.CL else 0)


def build_backward_stats(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """Host function ``host(kv, score, ape, cu, cuc, grad_out, grad_kv, grad_score, grad_ape, ws, stats, B, N, T,
    rows_per_cta, num_ctas, stream)`` (the ``backward_stats`` signature of launch.py)."""
    V, TC, G, SG, SC, R = sch.V, sch.TC, sch.G, sch.SG, sch.SC, sch.R
    W = coff * ratio
    assert sch.ST and SC == G * SG and W % SC == 0 and sch.NB == 1 and not (sch.CL and sch.WT)
    D = head_dim
    WIDTH = coff * head_dim
    NT = sch.threads
    CW = TC * V
    NCOL = -(-D // CW)
    NZ = W // SC  # slot chunks
    COLS_EXACT = D % CW == 0
    APE_SIZE = ratio * WIDTH
    ops = WindowOps(ratio, coff, head_dim, V, SG, SG, sch.EF)  # group index = global slot group, SG slots each
    zeros = ZeroStores(ratio, coff, head_dim, V, sch.ES)

    # PF: per row lane and row step, threads 0 .. 5 prefetch the next step's statistics (3 x CW fp32) into L1 and
    # thread 6 its grad_out (CW bf16), whose loads otherwise wait a full L2 round trip at the top of every step (with
    # _STATS_AHEAD they are in flight a step early anyway);
    # threads 7 .. 7 + 2 * SC - 1 prefetch the window two steps ahead (one CW-column line per slot and tensor) into
    # L2. Hints only: token offsets are clamped into [0, T) and a wrong guess (a segment boundary) costs a line.
    PF_STATS = 3 * -(-CW * 4 // 128)  # 128-byte lines of one row's statistics for the CTA's columns
    PF_THREADS = PF_STATS + 1 + 2 * SC

    @cute.jit
    def prefetch_ahead(kv, score, gout, stats, r, t0n, q, by, bz, row_lim, T):
        if q < PF_THREADS:
            rq = r + R
            if (q < PF_STATS) & (rq < row_lim):
                per = PF_STATS // 3
                prefetch_l1(stats + (rq * (3 * D) + (q // per) * D + by * CW + (q % per) * 32))
            if (q == PF_STATS) & (rq < row_lim):
                prefetch_l1(gout + (rq * D + by * CW))
            rp = r + 2 * R
            if (q > PF_STATS) & (rp < row_lim):
                qq = q - PF_STATS - 1
                k = qq % SC
                s = bz * SC + k
                tok = cutlass.min(cutlass.max(t0n + R * ratio - (coff - 1) * ratio + s, Int32(0)), T - 1)
                off = tok * WIDTH + (s // ratio) * D + by * CW
                if qq < SC:
                    prefetch_l2(kv + off)
                else:
                    prefetch_l2(score + off)

    @cute.jit
    def load_row_inputs(gout, stats, row, c, g_dst, m_dst, l_dst, o_dst):
        """Row ``row``'s grad_out and statistics (max, 1/sum, out) for the thread's columns; the caller checks
        ``col_ok``."""
        base = row * (3 * D) + c
        g_dst.store(vec_view(gout, row * D + c, V).load())
        m_dst.store(vec_view(stats, base, V).load())
        l_dst.store(vec_view(stats, base + D, V).load())
        o_dst.store(vec_view(stats, base + 2 * D, V).load())

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
        stats: cute.Pointer,
        B: Int32,
        N: Int32,
        T: Int32,
        rows_per_cta: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bx, byz, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        by = byz % NCOL
        bz = byz // NCOL
        tc = tidx % TC
        gl = (tidx // TC) % G
        rl = tidx // (TC * G)  # row lane: rows row_begin + rl, + R, ...
        q = tidx % (TC * G)  # thread within its row lane
        gg = bz * G + gl  # global slot group: slots gg * SG .. gg * SG + SG - 1
        c = (by * TC + tc) * V
        col_ok = Boolean(True)
        if cutlass.const_expr(not COLS_EXACT):
            col_ok = c < D
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = real_rows(cu_t, cuc_t, B)

        zero = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
        zero.fill(0.0)
        cur_kv = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        cur_sc = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        nxt_kv = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        nxt_sc = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        dape = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        for k in cutlass.range_constexpr(SG):
            dape[k].fill(0.0)
        gb = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vo = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        dvo = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        dlo = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        ops.load_ape(ape, apf, 0, gg, c, col_ok)

        row_begin = bx * rows_per_cta
        # Rows past the true row count (padding) carry no gradient.
        row_lim = cutlass.min(cutlass.min(row_begin + rows_per_cta, N), nreal)
        row_first = row_begin + rl
        if cutlass.const_expr(_STATS_AHEAD):
            ngb = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
            nvm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            nvl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            nvo = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            ngb.fill(0.0)
            nvm.fill(0.0)
            nvl.fill(0.0)
            nvo.fill(0.0)
        if row_first < row_lim:
            b0 = find_segment(cuc_t, B, row_first)
            j0 = row_first - cuc_t[b0]
            ops.issue(kv, score, nxt_kv, nxt_sc, 0, gg, c, col_ok, cu_t[b0] + j0 * ratio, j0 == 0)
            if cutlass.const_expr(_STATS_AHEAD):
                if col_ok:
                    load_row_inputs(gout, stats, row_first, c, ngb, nvm, nvl, nvo)
        for r in cutlass.range(row_first, row_lim, R):
            for k in cutlass.range_constexpr(SG):
                cur_kv[k].store(nxt_kv[k].load())
                cur_sc[k].store(nxt_sc[k].load())
            if cutlass.const_expr(_STATS_AHEAD):
                gb.store(ngb.load())
                vm.store(nvm.load())
                vl.store(nvl.load())
                vo.store(nvo.load())
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0
            # The next row's window slice goes out before this row's math.
            t0n = t0 + R * ratio
            if r + R < row_lim:
                bn = find_segment(cuc_t, B, r + R)
                jn = r + R - cuc_t[bn]
                t0n = cu_t[bn] + jn * ratio
                ops.issue(kv, score, nxt_kv, nxt_sc, 0, gg, c, col_ok, t0n, jn == 0)
                if cutlass.const_expr(_STATS_AHEAD):
                    if col_ok:
                        load_row_inputs(gout, stats, r + R, c, ngb, nvm, nvl, nvo)
            if cutlass.const_expr(sch.PF):
                prefetch_ahead(kv, score, gout, stats, r, t0n, q, by, bz, row_lim, T)
            if cutlass.const_expr(not _STATS_AHEAD):
                gb.fill(0.0)
                vm.fill(0.0)
                vl.fill(0.0)
                vo.fill(0.0)
                if col_ok:
                    load_row_inputs(gout, stats, r, c, gb, vm, vl, vo)
            gw = widen_plain(gb, V)
            for k in cutlass.range_constexpr(SG):
                s = gg * SG + k
                half = s // ratio
                scw = widen_plain(cur_sc[k], V)
                kvw = widen_plain(cur_kv[k], V)
                for i in cutlass.range_constexpr(V):
                    gi = gw[i]
                    pk = ex2((scw[i] + apf[k][i]) * LOG2E - vm[i]) * vl[i]
                    dvo[i] = gi * pk
                    dlo[i] = pk * (gi * kvw[i] - gi * vo[i])
                valid = col_ok
                if cutlass.const_expr(coff == 2):
                    valid = col_ok & ((half == 1) | (not first))
                if valid:
                    off = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + c
                    window_store(gkv, off, V, dvo.load().to(BFloat16), sch.ES)
                    window_store(gsc, off, V, dlo.load().to(BFloat16), sch.ES)
                    dape[k].store(dape[k].load() + dlo.load())
            # Exact zeros owned by a segment's last row (this thread's slots and columns).
            if col_ok & (r == cuc_t[b + 1] - 1):
                zeros.segment_tail(gkv, gsc, zero, t0, cu_t[b + 1], gg * SG, SG, c)

        # Exact zeros: segments with no row and token-capacity padding (the first slot chunk's CTAs).
        if col_ok & (bz == 0):
            zeros.unowned(gkv, gsc, zero, cu_t, cuc_t, B, T, bx, gdx, rl * G + gl, G * R, c)

        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(R > 1):
            # The row lanes' accumulators, summed in lane order 0, 1, ..., R - 1 (fixed: bitwise reproducible).
            red = smem.allocate_tensor(Float32, cute.make_layout(R * SC * CW), byte_alignment=16)
            for k in cutlass.range_constexpr(SG):
                vec_view(red.iterator, ((rl * G + gl) * SG + k) * CW + tc * V, V).store(dape[k].load())
            cute.arch.sync_threads()
            for h in cutlass.range_constexpr(1, R):
                for k in cutlass.range_constexpr(SG):
                    dape[k].store(
                        dape[k].load() + vec_view(red.iterator, ((h * G + gl) * SG + k) * CW + tc * V, V).load()
                    )

        if cutlass.const_expr(sch.CL):
            # ``ws`` is grad_ape itself. The CTA's sum (row lane 0) goes to shared memory; after the cluster barrier
            # CTA ``rank`` sums its share of the tile's vectors over the cluster's CTAs in rank order (the slabs'
            # order in the two-kernel form) and stores them; the second barrier keeps every CTA's shared memory
            # alive until its peers have read it.
            part = smem.allocate_tensor(Float32, cute.make_layout(SC * CW), byte_alignment=16)
            if rl == 0:
                for k in cutlass.range_constexpr(SG):
                    vec_view(part.iterator, (gl * SG + k) * CW + tc * V, V).store(dape[k].load())
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            ncl = cute.arch.cluster_size()
            rank = cute.arch.block_idx_in_cluster()
            nvec = SC * TC
            per = (nvec + ncl - 1) // ncl
            base = part.iterator.toint()
            tot = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            for vi in cutlass.range(rank * per + tidx, cutlass.min((rank + 1) * per, nvec), NT):
                sl = vi // TC
                col = (by * TC + vi % TC) * V
                if col < D:
                    addr = base + (sl * CW + (vi % TC) * V) * 4
                    for i in cutlass.range_constexpr(V):
                        tot[i] = ld_cluster_f32(addr + i * 4, 0)
                    for h in cutlass.range(1, ncl):
                        for i in cutlass.range_constexpr(V):
                            tot[i] = add_rn(tot[i], ld_cluster_f32(addr + i * 4, h))
                    s = bz * SC + sl
                    vec_view(ws, (s % ratio) * WIDTH + (s // ratio) * D + col, V).store(tot.load())
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        elif col_ok & (rl == 0):
            # This CTA's part of its row range's grad_ape slab (row lane 0 holds the CTA's sum).
            for k in cutlass.range_constexpr(SG):
                s = gg * SG + k
                aoff = (s % ratio) * WIDTH + (s // ratio) * D + c
                vec_view(ws, bx * APE_SIZE + aoff, V).store(dape[k].load())

    return make_backward_host(
        kernel,
        APE_SIZE,
        NCOL * NZ,
        NT,
        stats_backward_smem_bytes(sch),
        100,
        stats=True,
        min_blocks=sch.MB,
        cluster=sch.CL,
        single=sch.single_kernel,
    )
