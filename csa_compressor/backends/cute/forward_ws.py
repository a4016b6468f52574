"""Warp-specialised forward of 128-slot windows, streamed through shared memory by bulk copies (``Schedule.BS``).

A persistent CTA (at most ``PS``) walks the tiles ``bx, bx + grid, ...``; a tile is one output row times
``CW = 128`` columns (chunk-major). One producer warp copies each tile's ``2 W`` row pieces (kv and score of every
slot, ``2 * CW`` bytes each) by ``cp.async.bulk`` into one of ``BS`` shared-memory stages and arrives on the stage's
"full" mbarrier with their bytes; it refills a stage as soon as every consumer thread has arrived on its "empty"
mbarrier, i.e. has the stage's values in registers. Nothing else synchronises the CTA: no barrier per tile, so the
consumer warps drift and hide each other's latency (the lock step of a CTA-wide barrier per tile made the
thirteenth round's first bulk form 16-146 % slower than the register forward).

Consumer warp ``w`` owns columns ``8 w .. 8 w + 7`` of the tile across all 16 slot groups: lane ``2 g + h`` holds
slots ``g, g + 16, ..., g + 112`` of columns ``8 w + 4 h .. + 3`` (stage rows padded by 16 bytes: the 16 groups'
rows fall on distinct banks), folds them online in the log2 domain (``WindowOps.online_batch``) and the 16 groups
merge by four butterflies over the lanes (products and sums pinned in rounding, so every lane ends with the same
bits); lanes of groups 0-3 store the output and the three statistics.

Numerics: as the register long-window forward (ex2 of the log2-domain logits, fp32, one rounding to bf16), in
another order (strided slot groups, butterfly merge): within the contract, not bitwise equal to it.
Needs ``coff * ratio == 128`` and ``head_dim % 8 == 0`` (copies move 16-byte multiples).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .forward import NEG_INF, Schedule, WindowOps, add_rn, ex2, find_segment, mul_rn, vec_view

SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90 / sm_100
WS_WINDOW = 128  # slots: 16 groups of 8, strided
WS_COLS = 128  # columns per tile: 16 consumer warps of 8
PAD = 8  # bf16 elements after each stage row (16 bytes): bank spread of the groups' rows


@dsl_user_op
def bulk_copy_g2s(smem_dst: cute.Pointer, gmem_src: cute.Pointer, nbytes, mbar: cute.Pointer, *, loc=None, ip=None):
    """``cp.async.bulk`` of ``nbytes`` (a multiple of 16; both addresses 16-byte aligned) from global into shared
    memory by the TMA unit, completing as transaction bytes on the mbarrier ``mbar`` (no registers held)."""
    llvm.inline_asm(
        None,
        [
            smem_dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
            gmem_src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
            Int32(nbytes).ir_value(loc=loc, ip=ip),
            mbar.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
        ],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def ws_forward_smem_bytes(sch: Schedule) -> int:
    """``BS`` stages of ``2W`` padded rows of ``CW`` bf16, and two mbarriers per stage."""
    return sch.BS * 2 * WS_WINDOW * (WS_COLS + PAD) * 2 + sch.BS * 16 + 128


def ws_forward_schedule(ratio: int, coff: int, head_dim: int, stages: int, ctas: int) -> Schedule | None:
    """The warp-specialised form, or None where it does not apply (window other than 128 slots, head_dim not a
    multiple of 8, stages that do not fit). ``ctas``: persistent CTAs (one per SM fits), rounded down to a multiple
    of the column chunks so that every CTA keeps one chunk (its ape entries stay in registers)."""
    if coff * ratio != WS_WINDOW or head_dim % 8 or stages < 2 or ctas < 1:
        return None
    nchunk = -(-head_dim // WS_COLS)
    if ctas >= nchunk:
        ctas -= ctas % nchunk
    sch = Schedule(V=4, TC=2, G=16, SG=8, R=1, CM=True, BS=stages, PS=ctas)
    if ws_forward_smem_bytes(sch) > SMEM_LIMIT:
        return None
    return sch


def build_forward_ws(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function (``build_forward``'s signature) of the warp-specialised forward."""
    V, G, SG, BS, PS = sch.V, sch.G, sch.SG, sch.BS, sch.PS
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    CW = WS_COLS
    NCW = CW // 8  # consumer warps
    NC = NCW * 32  # consumer threads
    NT = NC + 32  # and the producer warp
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    ROW = CW + PAD  # bf16 elements per stage row
    NCOPY = 2 * W  # stage rows: kv of slot s at s, score at W + s
    CPL = NCOPY // 32  # copies per producer lane and fill; copy i * 32 + lane (kv for i < CPL / 2)
    STAGE = NCOPY * ROW
    assert W == WS_WINDOW and G * SG == W and G == 16 and V == 4 and sch.TC == 2 and sch.R == 1
    assert D % 8 == 0 and BS >= 2 and PS >= 1 and NCOPY % 64 == 0
    HOLD_APE = PS % NCHUNK == 0  # then the grid is a multiple of NCHUNK: a CTA's tiles share one column chunk
    ST = sch.ST
    ops = WindowOps(ratio, coff, head_dim, V, SG, SG)
    smem_bytes = ws_forward_smem_bytes(sch)

    @cute.jit
    def row_start(cu_t, cuc_t, B, nreal, r):
        """(first token, first row of its segment?) of row r; padding rows read from token 0 as a first row."""
        t0 = Int32(0)
        first = Boolean(True)
        if r < nreal:
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0
        return t0, first

    @cute.jit
    def produce(kv, score, cu_t, cuc_t, B, nreal, bx, grid, n_it, sbuf, full, empty, lane):
        for k in cutlass.range(n_it):
            st = k % BS
            if k >= BS:
                cute.arch.mbarrier_wait(empty + st, (k // BS - 1) % 2)
            tile = bx + k * grid
            chunk = tile % NCHUNK
            t0, first = row_start(cu_t, cuc_t, B, nreal, tile // NCHUNK)
            nbytes = Int32(CW * 2)
            if cutlass.const_expr(not COLS_EXACT):
                nbytes = cutlass.min(Int32(CW), D - chunk * CW) * 2
            total = Int32(0)
            for i in cutlass.range_constexpr(CPL):
                s = (i * 32 + lane) % W
                ok = Boolean(True)
                if cutlass.const_expr(coff == 2):
                    ok = (s // ratio == 1) | (not first)
                if ok:
                    total = total + nbytes
            cute.arch.mbarrier_arrive_and_expect_tx(full + st, total)
            for i in cutlass.range_constexpr(CPL):
                j = i * 32 + lane
                s = j % W
                half = s // ratio
                ok = Boolean(True)
                if cutlass.const_expr(coff == 2):
                    ok = (half == 1) | (not first)
                if ok:
                    src = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + chunk * CW
                    dst = sbuf.iterator + cute.assume((st * NCOPY + j) * ROW, divby=8)
                    if cutlass.const_expr(i < CPL // 2):
                        bulk_copy_g2s(dst, kv + cute.assume(src, divby=8), nbytes, full + st)
                    else:
                        bulk_copy_g2s(dst, score + cute.assume(src, divby=8), nbytes, full + st)

    @cute.jit
    def load_ape(ape, apf, g, c, col_ok):
        for kk in cutlass.range_constexpr(SG):
            s = g + G * kk
            apf[kk].fill(0.0)
            if col_ok:
                apf[kk].store(vec_view(ape, (s % ratio) * WIDTH + (s // ratio) * D + c, V).load())

    @cute.jit
    def consume(ape, out, stats, cu_t, cuc_t, B, N, nreal, bx, grid, n_it, sbuf, full, empty, tidx):
        w = tidx // 32
        lane = tidx % 32
        g = lane // 2
        cl = w * 8 + (lane % 2) * V  # column within the tile
        kvf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        scf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        va = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        res = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        inv = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        if cutlass.const_expr(HOLD_APE):
            c0 = (bx % NCHUNK) * CW + cl
            load_ape(ape, apf, g, c0, c0 < D)
        for k in cutlass.range(n_it):
            st = k % BS
            tile = bx + k * grid
            chunk = tile % NCHUNK
            r = tile // NCHUNK
            c = chunk * CW + cl
            col_ok = Boolean(True)
            if cutlass.const_expr(not COLS_EXACT):
                col_ok = c < D
            first = Boolean(True)
            if cutlass.const_expr(coff == 2):
                _t0, first = row_start(cu_t, cuc_t, B, nreal, r)
            cute.arch.mbarrier_wait(full + st, (k // BS) % 2)
            base = st * STAGE + cl
            for kk in cutlass.range_constexpr(SG):
                s = g + G * kk
                ok = col_ok
                if cutlass.const_expr(coff == 2):
                    ok = ok & ((s // ratio == 1) | (not first))
                kvf[kk].fill(0.0)
                scf[kk].fill(NEG_INF)
                if ok:
                    kvf[kk].store(vec_view(sbuf.iterator, base + s * ROW, V).load())
                    scf[kk].store(vec_view(sbuf.iterator, base + (W + s) * ROW, V).load())
            cute.arch.mbarrier_arrive(empty + st)  # the stage's values are in registers: the producer may refill
            if cutlass.const_expr(not HOLD_APE):
                load_ape(ape, apf, g, c, col_ok)
            ops.online_batch(kvf, scf, apf, vm, vl, va, 0)
            # The 16 groups (lane bits 1-4) merge by butterflies; both lanes of a pair form the same two rounded
            # products and add them (commutative), so every lane ends with the same bits.
            for step in cutlass.range_constexpr(4):
                off = 2 << step
                for i in cutlass.range_constexpr(V):
                    m = vm[i]
                    mo = cute.arch.shuffle_sync_bfly(m, offset=off)
                    lo = cute.arch.shuffle_sync_bfly(vl[i], offset=off)
                    ao = cute.arch.shuffle_sync_bfly(va[i], offset=off)
                    mn = cute.arch.fmax(m, mo, nan=True)
                    mns = mn
                    if mn == Float32(NEG_INF):
                        mns = Float32(0.0)
                    sa = ex2(m - mns)
                    sb = ex2(mo - mns)
                    vl[i] = add_rn(mul_rn(vl[i], sa), mul_rn(lo, sb))
                    va[i] = add_rn(mul_rn(va[i], sa), mul_rn(ao, sb))
                    vm[i] = mn
            if col_ok:
                for i in cutlass.range_constexpr(V):
                    res[i] = va[i] / vl[i]
                    inv[i] = Float32(1.0) / vl[i]
                if g == 0:
                    vec_view(out, r * D + c, V).store(res.load().to(BFloat16))
                if cutlass.const_expr(ST):
                    if g == 1:
                        vec_view(stats, r * 3 * D + c, V).store(vm.load())
                    if g == 2:
                        vec_view(stats, r * 3 * D + D + c, V).store(inv.load())
                    if g == 3:
                        vec_view(stats, r * 3 * D + 2 * D + c, V).store(res.load())

    @cute.jit
    def body(kv, score, ape, cu, cuc, out, stats, B: Int32, N: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = cuc_t[B]
        n_it = (N * NCHUNK - bx + grid - 1) // grid
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(BFloat16, cute.make_layout(BS * STAGE), byte_alignment=128)
        full = smem.allocate_array(cutlass.Int64, BS, byte_alignment=8)
        empty = smem.allocate_array(cutlass.Int64, BS, byte_alignment=8)
        if tidx == 0:
            for st in cutlass.range_constexpr(BS):
                cute.arch.mbarrier_init(full + st, 32)
                cute.arch.mbarrier_init(empty + st, NC)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx >= NC:
            produce(kv, score, cu_t, cuc_t, B, nreal, bx, grid, n_it, sbuf, full, empty, tidx - NC)
        else:
            consume(ape, out, stats, cu_t, cuc_t, B, N, nreal, bx, grid, n_it, sbuf, full, empty, tidx)

    def grid_of(N):
        return [cutlass.min(N * NCHUNK, PS), 1, 1]

    if ST:

        @cute.kernel
        def kernel_st(
            kv: cute.Pointer,
            score: cute.Pointer,
            ape: cute.Pointer,
            cu: cute.Pointer,
            cuc: cute.Pointer,
            out: cute.Pointer,
            stats: cute.Pointer,
            B: Int32,
            N: Int32,
        ):
            body(kv, score, ape, cu, cuc, out, stats, B, N)

        @cute.jit
        def host_st(
            kv: cute.Pointer,
            score: cute.Pointer,
            ape: cute.Pointer,
            cu: cute.Pointer,
            cuc: cute.Pointer,
            out: cute.Pointer,
            stats: cute.Pointer,
            B: Int32,
            N: Int32,
            stream: cuda.CUstream,
        ):
            kernel_st(kv, score, ape, cu, cuc, out, stats, B, N).launch(
                grid=grid_of(N), block=[NT, 1, 1], smem=smem_bytes, stream=stream
            )

        return host_st

    @cute.kernel
    def kernel(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        out: cute.Pointer,
        B: Int32,
        N: Int32,
    ):
        body(kv, score, ape, cu, cuc, out, out, B, N)

    @cute.jit
    def host(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        out: cute.Pointer,
        B: Int32,
        N: Int32,
        stream: cuda.CUstream,
    ):
        kernel(kv, score, ape, cu, cuc, out, B, N).launch(
            grid=grid_of(N), block=[NT, 1, 1], smem=smem_bytes, stream=stream
        )

    return host
