"""Long-window forward with the window streamed through shared memory by bulk copies (``Schedule.BS``).

A persistent CTA (``PS`` of them, at most one per tile) walks the tiles ``bx, bx + grid, ...``; a tile is one
output row times ``CW = TC * V`` columns (chunk-major: the column chunks of one row are consecutive tiles). Its
window, ``2 W`` row pieces of ``CW`` bf16 (kv and score of every slot), arrives by ``cp.async.bulk`` (the TMA
unit: no registers, no load instructions per element) into one of ``BS`` shared-memory stages, completing as
transaction bytes on the stage's mbarrier. Every thread issues the copies ``q, q + NT, ...`` of a fill and arrives
once with their bytes, so the stage holds ``BS`` tiles in flight per CTA whatever the registers allow.

A thread (slot group ``g``, column thread ``tc``) reads its ``SG`` slots x ``V`` columns from the stage and folds
them as the register forward does (``WindowOps.online_batch``, log2 domain), writes its (max, sum e, sum e*v) to one
of two combine buffers, and after one CTA barrier (which also frees the stage: the copies for tile ``k + BS`` are
issued right after it) the threads of the tile's columns combine the groups in a fixed order and store the output
(and, with ``ST``, the softmax statistics). Results are bitwise those of the register forward of the same ``V``,
``SG`` and ``G``: the same operations on the same values in the same order.

Needs 16-byte row pieces: ``head_dim % 8 == 0`` and ``CW % 8 == 0`` (copies are multiples of 16 bytes at 16-byte
aligned addresses; the pointers are 16-byte aligned by the support checks).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from .forward import NEG_INF, Schedule, WindowOps, ex2, find_segment, slots_per_group, vec_view

# Shared memory one CTA may use on sm_90 (227 KB opt-in per block).
SMEM_LIMIT = 227 * 1024


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


def bulk_forward_smem_bytes(sch: Schedule) -> int:
    """Stages (``BS`` x ``2W`` x ``CW`` bf16), two combine buffers (3 x G x CW fp32 each), the mbarriers."""
    W = sch.G * sch.SG * sch.NB
    CW = sch.TC * sch.V
    return sch.BS * 2 * W * CW * 2 + 2 * 3 * sch.G * CW * 4 + sch.BS * 8 + 256


def bulk_forward_schedule(
    ratio: int, coff: int, head_dim: int, stages: int, ctas: int, cols: int = 64, min_threads: int = 128
) -> Schedule | None:
    """The bulk-copy streamed form of a long window, or None where it does not apply (windows of at most 8 slots,
    head_dims that are not a multiple of 8, stages that do not fit in shared memory). ``ctas``: persistent CTAs
    (SMs x CTAs per SM); ``cols``: columns per tile (one copy of ``2 * cols`` bytes per slot and tensor), widened
    until the CTA has ``min_threads``. Slot groups as the register forward's (``SG = 8``): the same arithmetic."""
    W = coff * ratio
    if W <= 8 or head_dim % 8 or stages < 2 or ctas < 1:
        return None
    V = 4
    SG = slots_per_group(W, 8)
    G = W // SG
    TC = max(1, cols // V)
    while TC * G < min_threads and TC * V < head_dim:
        TC *= 2
    sch = Schedule(V=V, TC=TC, G=G, SG=SG, R=1, CM=True, BS=stages, PS=ctas)
    if (TC * V) % 8 or sch.threads > 1024 or bulk_forward_smem_bytes(sch) > SMEM_LIMIT:
        return None
    return sch


def build_forward_bulk(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function (``build_forward``'s signature) of the bulk-streamed long-window forward."""
    V, TC, G, SG, BS, PS = sch.V, sch.TC, sch.G, sch.SG, sch.BS, sch.PS
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    NT = TC * G
    CW = TC * V
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    NCOPY = 2 * W  # row pieces per tile: kv of slot s at s, score at W + s
    CPT = -(-NCOPY // NT)  # copies per thread and fill
    STAGE = NCOPY * CW  # bf16 elements per stage
    QROW = G * CW  # floats per combine quantity
    assert sch.R == 1 and sch.NB == 1 and G * SG == W and G > 1 and BS >= 2 and PS >= 1
    assert D % 8 == 0 and CW % 8 == 0, "bulk copies move 16-byte multiples"
    ST = sch.ST
    ops = WindowOps(ratio, coff, head_dim, V, SG, SG)
    smem_bytes = bulk_forward_smem_bytes(sch)

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
    def fill(kv, score, cu_t, cuc_t, B, nreal, tile, sbuf, bars, st, tidx):
        """Issue this thread's copies of tile ``tile`` into stage ``st`` and arrive on its mbarrier."""
        chunk = tile % NCHUNK
        r = tile // NCHUNK
        t0, first = row_start(cu_t, cuc_t, B, nreal, r)
        nbytes = Int32(CW * 2)
        if cutlass.const_expr(not COLS_EXACT):
            nbytes = cutlass.min(Int32(CW), D - chunk * CW) * 2
        total = Int32(0)
        for i in cutlass.range_constexpr(CPT):
            j = tidx + i * NT
            s = j % W
            ok = j < NCOPY
            if cutlass.const_expr(coff == 2):
                ok = ok & ((s // ratio == 1) | (not first))
            if ok:
                total = total + nbytes
        bar = bars + st
        cute.arch.mbarrier_arrive_and_expect_tx(bar, total)
        for i in cutlass.range_constexpr(CPT):
            j = tidx + i * NT
            s = j % W
            half = s // ratio
            ok = j < NCOPY
            if cutlass.const_expr(coff == 2):
                ok = ok & ((half == 1) | (not first))
            if ok:
                src = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + chunk * CW
                dst = sbuf.iterator + cute.assume((st * NCOPY + j) * CW, divby=8)
                if j < W:
                    bulk_copy_g2s(dst, kv + cute.assume(src, divby=8), nbytes, bar)
                else:
                    bulk_copy_g2s(dst, score + cute.assume(src, divby=8), nbytes, bar)

    @cute.jit
    def body(kv, score, ape, cu, cuc, out, stats, B: Int32, N: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tc = tidx % TC
        g = tidx // TC
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = cuc_t[B]
        ntiles = N * NCHUNK
        n_it = (ntiles - bx + grid - 1) // grid

        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(BFloat16, cute.make_layout(BS * STAGE), byte_alignment=128)
        comb = smem.allocate_tensor(Float32, cute.make_layout(2 * 3 * QROW), byte_alignment=16)
        bars = smem.allocate_array(cutlass.Int64, BS, byte_alignment=8)
        if tidx == 0:
            for st in cutlass.range_constexpr(BS):
                cute.arch.mbarrier_init(bars + st, NT)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        for st in cutlass.range_constexpr(BS):
            if st < n_it:
                fill(kv, score, cu_t, cuc_t, B, nreal, bx + st * grid, sbuf, bars, Int32(st), tidx)

        kvf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        scf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        va = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        out_t = cute.make_tensor(out, cute.make_layout(N * D))
        for k in cutlass.range(n_it):
            st = k % BS
            tile = bx + k * grid
            chunk = tile % NCHUNK
            r = tile // NCHUNK
            c = chunk * CW + tc * V
            col_ok = Boolean(True)
            if cutlass.const_expr(not COLS_EXACT):
                col_ok = c < D
            first = Boolean(True)
            if cutlass.const_expr(coff == 2):
                _t0, first = row_start(cu_t, cuc_t, B, nreal, r)
            cute.arch.mbarrier_wait(bars + st, (k // BS) % 2)
            base = st * STAGE + tc * V
            for kk in cutlass.range_constexpr(SG):
                s = g * SG + kk
                ok = col_ok
                if cutlass.const_expr(coff == 2):
                    ok = ok & ((s // ratio == 1) | (not first))
                kvf[kk].fill(0.0)
                scf[kk].fill(NEG_INF)
                if ok:
                    kvf[kk].store(vec_view(sbuf.iterator, base + s * CW, V).load())
                    scf[kk].store(vec_view(sbuf.iterator, base + (W + s) * CW, V).load())
            ops.load_ape(ape, apf, 0, g, c, col_ok)
            ops.online_batch(kvf, scf, apf, vm, vl, va, 0)
            cb = (k % 2) * 3 * QROW + g * CW + tc * V
            vec_view(comb.iterator, cb, V).store(vm.load())
            vec_view(comb.iterator, cb + QROW, V).store(vl.load())
            vec_view(comb.iterator, cb + 2 * QROW, V).store(va.load())
            # Every thread has its values of stage st in registers and its partials in the buffer: refill the
            # stage BS tiles ahead, then combine (the other buffer takes the next tile's partials).
            cute.arch.sync_threads()
            if k + BS < n_it:
                fill(kv, score, cu_t, cuc_t, B, nreal, tile + BS * grid, sbuf, bars, st, tidx)
            for q in cutlass.range(tidx, CW, NT):
                col = chunk * CW + q
                ok = Boolean(True)
                if cutlass.const_expr(not COLS_EXACT):
                    ok = col < D
                if ok:
                    qb = (k % 2) * 3 * QROW + q
                    mx = comb[qb]
                    for h in cutlass.range_constexpr(1, G):
                        mx = cute.arch.fmax(mx, comb[qb + h * CW], nan=True)
                    total = Float32(0.0)
                    acc = Float32(0.0)
                    for h in cutlass.range_constexpr(G):
                        scale = ex2(comb[qb + h * CW] - mx)
                        total = total + comb[qb + QROW + h * CW] * scale
                        acc = acc + comb[qb + 2 * QROW + h * CW] * scale
                    res_q = acc / total
                    out_t[r * D + col] = BFloat16(res_q)
                    if cutlass.const_expr(ST):
                        st_t = cute.make_tensor(stats, cute.make_layout(N * 3 * D))
                        st_t[r * 3 * D + col] = mx
                        st_t[r * 3 * D + D + col] = Float32(1.0) / total
                        st_t[r * 3 * D + 2 * D + col] = res_q

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
