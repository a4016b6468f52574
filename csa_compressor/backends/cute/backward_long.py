"""CuTe-DSL backward kernel for long windows (``coff * ratio > 8``, e.g. ratio 16 and 128).

Thread mapping: one CTA = ``TC`` column threads x ``G`` slot groups (one row at a time), a thread
owns ``V`` contiguous columns (16-byte vectors at ``V = 8``) and the ``SG * NB`` slots of its
group, streamed in ``NB`` batches of ``SG`` with the next batch's loads in flight while the
current one is used. CTAs are persistent over a contiguous range of rows (``rows_per_cta``) of
one column chunk, like the short-window backward, so that each CTA produces one fp32
``grad_ape`` slab.

Per row, two passes over the window:

1. online (max, sum e, sum e*v) per column in the log2 domain (as the forward), then one
   barrier, a fixed-order combine of the ``G`` groups by one thread per column (row max ``M``,
   ``1/L`` and ``A/L = sum p*v``), and a second barrier;
2. the window again (kv, score: this CTA read them a moment ago, so L1/L2 serve them, and DRAM
   sees every input once): ``p = 2^(y - M) / L``, ``dv = g*p``, ``dlogit = p*(g*v - S)`` with
   ``S = g * sum p*v``; stored right away (16-byte stores). ``grad_ape`` accumulates per
   (slot, column) in shared memory, each entry owned by one thread (no atomics).

grad_ape: the CTA's shared-memory accumulator is its slab ``ws[cta]``; the reduction kernel of
``backward.py`` sums the slabs in a fixed order (bitwise deterministic).

Exact zeros, each from one owner (as the short-window backward): a segment's last row zeroes the
segment's tail tokens and, for coff 2, the first-half columns of its own tokens; CTA ``x`` zeroes
the tokens of segments ``b = x mod grid`` that have no row and a grid-stride share of the tokens
past ``cu_seqlens[-1]``.
"""

from __future__ import annotations

from dataclasses import replace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass.cutlass_dsl import dsl_user_op

from .backward_common import ZeroStores, make_backward_host
from .forward import (
    LOG2E,
    NEG_INF,
    Schedule,
    WindowOps,
    ex2,
    find_segment,
    ptx_effect,
    slots_per_group,
    vec_view,
    vector_width,
    window_store,
)

SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90 / sm_100


@dsl_user_op
def cp_async_16(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global`` of 16 bytes (L2 only, no registers; completes at a wait_group)."""
    ptx_effect(
        "cp.async.cg.shared.global [$0], [$1], 16;",
        [p.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip) for p in (smem_ptr, gmem_ptr)],
        "r,l",
    )


def _prefetch(level: str):
    """``prefetch.global.<level>`` of the 128-byte line holding ``ptr`` (no register, no wait)."""

    @dsl_user_op
    def fn(ptr: cute.Pointer, *, loc=None, ip=None) -> None:
        ptx_effect(f"prefetch.global.{level} [$0];", [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)], "l")

    return fn


prefetch_l2 = _prefetch("L2")
prefetch_l1 = _prefetch("L1")  # into L1 (and L2)


def long_backward_schedule(ratio: int, coff: int, head_dim: int, threads: int = 256, cols_cap: int = 64) -> Schedule:
    """16-byte column vectors, ``cols_cap`` columns per CTA (the grad_ape accumulator is window x
    columns of shared memory), batches of 4 slots, as many groups as ``threads`` allows."""
    W = coff * ratio
    V = vector_width(head_dim, 8)
    col_threads = -(-head_dim // V)
    TC = 1
    while TC * 2 <= col_threads and TC * 2 * V <= cols_cap:
        TC *= 2
    sch = None
    for sg_cap in (4, 2):
        SG = slots_per_group(W, sg_cap)
        batches = W // SG
        G = max(g for g in range(1, min(batches, 32) + 1) if batches % g == 0 and TC * g <= threads)
        # L2 prefetch of the next row: measured on the H200 (2026-11-30) 43.6 -> 39.3 us at 3x8192 d512 r128 c1,
        # but 224 -> 242 us at 1x65536 d512 r128 c2 (256-slot windows), where it stays off.
        sch = Schedule(V=V, TC=TC, G=G, SG=SG, R=1, NB=batches // G, LONG=True, PF=W <= 128)
        # Two 16-byte batches of 4 slots in flight (NB > 1) do not fit 128 registers: batches of 2.
        if sch.NB == 1 or V < 8:
            break
    return sch


def staged_variant(sch: Schedule, head_dim: int) -> Schedule | None:
    """The cp.async-staged form of a long-window backward schedule (``AS``), or None where it does not apply.

    Not a default: on the H200 (2026-11-30, `benchmarks/NOTES_cute.md`) it measured slower than the
    register-streaming kernel (1x65536 d512 r128 c2: 233 vs 226 us; 3x8192 d512 r128 c1: 47 vs 39 us):
    two 64 KB stages leave one CTA per SM with a single row in flight. Kept, compiled in CI, as the
    base for deeper pipelines (narrower chunks, more stages).
    """
    cw = sch.TC * sch.V
    window = sch.G * sch.SG * sch.NB
    staged = replace(sch, PF=False, AS=True)
    if not sch.LONG or head_dim % cw or head_dim % 8 or (window * cw // 8) % sch.threads:
        return None
    return staged if long_backward_smem_bytes(staged) <= SMEM_LIMIT else None


def long_backward_smem_bytes(sch: Schedule) -> int:
    """grad_ape accumulator (window x columns) + group partials + per-column row results, fp32."""
    cw = sch.TC * sch.V
    window = sch.G * sch.SG * sch.NB
    staged = 2 * 2 * window * cw * 2 + 256 if sch.AS else 0  # two stages of kv and score, bf16
    return (window * cw + 3 * sch.G * cw + 3 * cw) * 4 + 128 + staged


def build_backward_long(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function (this main kernel + the grad_ape reduction kernel).

    Same signature as ``backward.build_backward``'s host function.
    """
    V, TC, G, SG, NB = sch.V, sch.TC, sch.G, sch.SG, sch.NB
    assert sch.LONG and sch.R == 1 and G * SG * NB == coff * ratio
    assert not sch.ST, "the statistics backward is backward_stats.py"
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    NT = sch.threads
    CW = TC * V
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    SPG = SG * NB
    APE_SIZE = ratio * WIDTH
    LINE_THREADS = max(1, 128 // (2 * V))  # column threads per 128-byte line
    AS = sch.AS
    PIECES = CW // 8  # 16-byte pieces of a slot's columns
    CHUNKS = W * PIECES // NT  # cp.async copies per thread, tensor and row
    STAGE = W * CW  # elements of one stage of one tensor
    if AS:
        assert COLS_EXACT and D % 8 == 0 and CW % 8 == 0 and (W * PIECES) % NT == 0 and not sch.PF
    ops = WindowOps(ratio, coff, head_dim, V, SG, SPG)
    zeros = ZeroStores(ratio, coff, head_dim, V, sch.ES)
    smem_bytes = long_backward_smem_bytes(sch)

    @cute.jit
    def issue_smem(skv, ssc, kvf, scf, bi: cutlass.Constexpr, g, tc, active, first, sbase):
        """Batch bi of the thread's slots from the staged window (masked slots: kv 0, score -inf)."""
        for k in cutlass.range_constexpr(SG):
            s = g * SPG + bi * SG + k
            half = s // ratio
            valid = active
            if cutlass.const_expr(coff == 2):
                valid = active & ((half == 1) | (not first))
            kvf[k].fill(0.0)
            scf[k].fill(NEG_INF)
            if valid:
                off = sbase + s * CW + tc * V
                kvf[k].store(vec_view(skv, off, V).load())
                scf[k].store(vec_view(ssc, off, V).load())

    @cute.jit
    def fetch(kv, score, skv, ssc, kvb, scb, bi: cutlass.Constexpr, g, c, tc, active, t0, first, sbase):
        """Batch bi of the thread's slots into register buffer ``bi % 2`` of ``kvb``/``scb``: from the staged
        window (``AS``) or straight from global memory."""
        kvf, scf = kvb[bi % 2], scb[bi % 2]
        if cutlass.const_expr(AS):
            issue_smem(skv, ssc, kvf, scf, bi, g, tc, active, first, sbase)
        else:
            ops.issue(kv, score, kvf, scf, bi, g, c, active, t0, first)

    @cute.jit
    def copy_row(kv, score, skv, ssc, cu_t, cuc_t, B, rr, sbase, tidx, by):
        """cp.async of row rr's window (this CTA's columns) into a stage; masked slots are skipped."""
        b = find_segment(cuc_t, B, rr)
        j = rr - cuc_t[b]
        t0 = cu_t[b] + j * ratio
        for k in cutlass.range_constexpr(CHUNKS):
            q = tidx + k * NT
            s = q // PIECES
            piece = q % PIECES
            half = s // ratio
            valid = Boolean(True)
            if cutlass.const_expr(coff == 2):
                valid = (half == 1) | (j != 0)
            if valid:
                goff = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + by * CW + piece * 8
                soff = sbase + s * CW + piece * 8
                cp_async_16(skv + soff, kv + cute.assume(goff, divby=8))
                cp_async_16(ssc + soff, score + cute.assume(goff, divby=8))

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
        g = tidx // TC
        c = (by * TC + tc) * V
        col_ok = Boolean(True)
        if cutlass.const_expr(not COLS_EXACT):
            col_ok = c < D
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = cuc_t[B]

        smem = cutlass.memory.SmemAllocator()
        sm_dape = smem.allocate_tensor(Float32, cute.make_layout(W * CW), byte_alignment=16)
        sm_m = smem.allocate_tensor(Float32, cute.make_layout(G * CW), byte_alignment=16)
        sm_l = smem.allocate_tensor(Float32, cute.make_layout(G * CW), byte_alignment=16)
        sm_a = smem.allocate_tensor(Float32, cute.make_layout(G * CW), byte_alignment=16)
        sm_res = smem.allocate_tensor(Float32, cute.make_layout(3 * CW), byte_alignment=16)
        sm_kv = sm_res
        sm_sc = sm_res
        if cutlass.const_expr(AS):
            sm_kv = smem.allocate_tensor(BFloat16, cute.make_layout(2 * STAGE), byte_alignment=128)
            sm_sc = smem.allocate_tensor(BFloat16, cute.make_layout(2 * STAGE), byte_alignment=128)

        zero = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
        zero.fill(0.0)
        zf = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        zf.fill(0.0)
        for k in cutlass.range_constexpr(SPG):
            vec_view(sm_dape.iterator, (g * SPG + k) * CW + tc * V, V).store(zf.load())

        kvb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        scb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        gb = cute.make_rmem_tensor(cute.make_layout(V), BFloat16)
        gf = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        va = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        dvo = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        dlo = cute.make_rmem_tensor(cute.make_layout(V), Float32)

        row_begin = bx * rows_per_cta
        # Rows past the true row count (padding) carry no gradient.
        row_lim = cutlass.min(cutlass.min(row_begin + rows_per_cta, N), nreal)
        if cutlass.const_expr(AS):
            # Stage 0 <- the first row's window; every iteration commits one group (maybe empty).
            if row_begin < row_lim:
                copy_row(kv, score, sm_kv.iterator, sm_sc.iterator, cu_t, cuc_t, B, row_begin, 0, tidx, by)
            cute.arch.cp_async_commit_group()
        for r in cutlass.range(row_begin, row_lim):
            st = (r - row_begin) % 2
            sbase = st * STAGE
            if cutlass.const_expr(AS):
                # The next row's window streams into the other stage while this row is computed.
                if r + 1 < row_lim:
                    copy_row(
                        kv, score, sm_kv.iterator, sm_sc.iterator, cu_t, cuc_t, B, r + 1, (1 - st) * STAGE, tidx, by
                    )
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
                cute.arch.sync_threads()
            b = find_segment(cuc_t, B, r)
            j = r - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0
            last = r == cuc_t[b + 1] - 1
            seg_end = cu_t[b + 1]
            active = col_ok
            gb.fill(0.0)
            if active:
                gb.store(vec_view(gout, r * D + c, V).load())

            # Pass 1: online (max, sum e, sum e*v) per column, log2 domain.
            fetch(kv, score, sm_kv.iterator, sm_sc.iterator, kvb, scb, 0, g, c, tc, active, t0, first, sbase)
            for bi in cutlass.range_constexpr(NB):
                if cutlass.const_expr(bi + 1 < NB):
                    fetch(
                        kv, score, sm_kv.iterator, sm_sc.iterator, kvb, scb, bi + 1, g, c, tc, active, t0, first, sbase
                    )
                ops.load_ape(ape, apf, bi, g, c, col_ok)
                ops.online_batch(kvb[bi % 2], scb[bi % 2], apf, vm, vl, va, bi)
            # The second pass's first batch is in flight during the combine.
            fetch(kv, score, sm_kv.iterator, sm_sc.iterator, kvb, scb, 0, g, c, tc, active, t0, first, sbase)
            base = g * CW + tc * V
            vec_view(sm_m.iterator, base, V).store(vm.load())
            vec_view(sm_l.iterator, base, V).store(vl.load())
            vec_view(sm_a.iterator, base, V).store(va.load())
            cute.arch.sync_threads()
            # Fixed-order combine of the groups, one thread per column: M, 1/L, sum p*v.
            for q in cutlass.range(tidx, CW, NT):
                mx = sm_m[q]
                for h in cutlass.range_constexpr(1, G):
                    mx = cute.arch.fmax(mx, sm_m[h * CW + q], nan=True)
                total = Float32(0.0)
                acc = Float32(0.0)
                for h in cutlass.range_constexpr(G):
                    scale = ex2(sm_m[h * CW + q] - mx)
                    total = total + sm_l[h * CW + q] * scale
                    acc = acc + sm_a[h * CW + q] * scale
                inv = Float32(1.0) / total
                sm_res[q] = mx
                sm_res[CW + q] = inv
                sm_res[2 * CW + q] = acc * inv
            cute.arch.sync_threads()
            # The next row's window goes to L2 now (one prefetch per 128-byte line of the CTA's columns):
            # its first pass then waits on L2, not DRAM, and DRAM stays busy during this row's second pass.
            if cutlass.const_expr(sch.PF):
                rn = r + 1
                if (rn < row_lim) & col_ok & (tc % LINE_THREADS == 0):
                    bn = find_segment(cuc_t, B, rn)
                    jn = rn - cuc_t[bn]
                    t0n = cu_t[bn] + jn * ratio
                    for k in cutlass.range_constexpr(SPG):
                        s = g * SPG + k
                        half = s // ratio
                        okn = Boolean(True)
                        if cutlass.const_expr(coff == 2):
                            okn = (half == 1) | (jn != 0)
                        if okn:
                            off = (t0n - (coff - 1) * ratio + s) * WIDTH + half * D + c
                            prefetch_l2(kv + off)
                            prefetch_l2(score + off)
            gf.store(gb.load().to(Float32))
            for i in cutlass.range_constexpr(V):
                vm[i] = sm_res[tc * V + i]
                vl[i] = sm_res[CW + tc * V + i]
                va[i] = gf[i] * sm_res[2 * CW + tc * V + i]  # S = g * sum p*v

            # Pass 2: gradients per slot, stored right away; grad_ape in shared memory.
            for bi in cutlass.range_constexpr(NB):
                if cutlass.const_expr(bi + 1 < NB):
                    fetch(
                        kv, score, sm_kv.iterator, sm_sc.iterator, kvb, scb, bi + 1, g, c, tc, active, t0, first, sbase
                    )
                ops.load_ape(ape, apf, bi, g, c, col_ok)
                kvf, scf = kvb[bi % 2], scb[bi % 2]
                for k in cutlass.range_constexpr(SG):
                    s = g * SPG + bi * SG + k
                    half = s // ratio
                    for i in cutlass.range_constexpr(V):
                        gi = gf[i]
                        pk = ex2((Float32(scf[k][i]) + apf[k][i]) * LOG2E - vm[i]) * vl[i]
                        dvo[i] = gi * pk
                        dlo[i] = pk * (gi * Float32(kvf[k][i]) - va[i])
                    valid = active
                    if cutlass.const_expr(coff == 2):
                        valid = active & ((half == 1) | (not first))
                    if valid:
                        off = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + c
                        window_store(gkv, off, V, dvo.load().to(BFloat16), sch.ES)
                        window_store(gsc, off, V, dlo.load().to(BFloat16), sch.ES)
                        sv = vec_view(sm_dape.iterator, s * CW + tc * V, V)
                        sv.store(sv.load() + dlo.load())

            # Exact zeros owned by a segment's last row.
            if active & last:
                zeros.segment_tail(gkv, gsc, zero, t0, seg_end, g * SPG, SPG, c)

            if cutlass.const_expr(AS):
                cute.arch.sync_threads()  # every thread is done with this stage before it is refilled

        # Exact zeros: segments with no row (seqlen < ratio) and token-capacity padding.
        if col_ok:
            zeros.unowned(gkv, gsc, zero, cu_t, cuc_t, B, T, bx, gdx, g, G, c)

        # This CTA's grad_ape slab: each thread copies the entries it owns.
        if col_ok:
            for k in cutlass.range_constexpr(SPG):
                s = g * SPG + k
                aoff = (s % ratio) * WIDTH + (s // ratio) * D + c
                vec_view(ws, bx * APE_SIZE + aoff, V).store(vec_view(sm_dape.iterator, s * CW + tc * V, V).load())

    return make_backward_host(kernel, APE_SIZE, NCHUNK, NT, smem_bytes, 100)
