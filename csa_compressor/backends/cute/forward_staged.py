"""Persistent long-window forward with tiles staged in shared memory by ``cp.async`` (``Schedule.PS``; A/B candidate).

The one-CTA-per-tile forward (``forward.py``, G > 1) holds its tile in registers: registers bound the bytes in
flight per SM (3 CTAs x 32 KB at ratio 128), and a CTA has none in flight while it folds and combines. A pure read
of the same tiles (``benchmarks/read_floor_probe.py``) keeps 6 CTAs x 32 KB in flight and runs at the SPEC floor.
Here ``PS`` persistent CTAs (as many per SM as the default holds: 3 x 256 threads at ratio 128) walk the tiles
``bx, bx + PS, ...`` (tile = row x column chunk, chunk-major) through two shared-memory stages: once tile ``i`` has
landed, the copies of tile ``i + 1`` are issued (16-byte ``cp.async.cg``, no registers, L2 evict-first) and tile
``i`` is folded from shared memory, so a CTA has the next tile in flight all the time it computes. The fold
(``WindowOps.online_batch``), the partials and the column-parallel combine are those of ``forward.py``: output and
statistics are bitwise the same. The partials reuse the folded tile's kv stage (dedicated buffers would not leave
room for three CTAs per SM).

Per tile three CTA barriers: after the wait (the tile's copies of every thread are visible, and every thread has
finished the previous tile's combine, so that stage may be refilled), after the fold (the stage's data is no
longer read, the partials may overwrite it) and after the partials (the combine reads them).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32
from cutlass.cutlass_dsl import dsl_user_op

from .forward import (
    NEG_INF,
    Schedule,
    WindowOps,
    ex2,
    find_segment,
    forward_smem_bytes,
    ptx_effect,
    real_rows,
    vec_view,
)


@dsl_user_op
def cp_async_16_evict_first(smem_ptr: cute.Pointer, gmem_ptr: cute.Pointer, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global`` of 16 bytes with an L2 evict-first policy (read once, as the register forward's
    ``ld.global.cs``): the stream replaces its own lines in L2 instead of other, possibly dirty, ones."""
    ptx_effect(
        "{\n.reg .b64 %pol;\ncreatepolicy.fractional.L2::evict_first.b64 %pol, 1.0;\n"
        "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, %pol;\n}",
        [p.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip) for p in (smem_ptr, gmem_ptr)],
        "r,l",
    )


def staged_applies(ratio: int, coff: int, head_dim: int, sch: Schedule) -> bool:
    """Whether the staged form can run a (one-batch, one-row) long-window schedule: whole 16-byte pieces only."""
    cw = sch.TC * sch.V
    return (
        sch.G > 1
        and sch.NB == 1
        and sch.R == 1
        and head_dim % cw == 0
        and cw % 8 == 0
        and (coff * ratio * cw // 8) % sch.threads == 0
    )


def build_forward_staged(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function; the same signature as ``forward.build_forward`` (``sch.ST``: with stats)."""
    V, TC, G, SG, PS, NS = sch.V, sch.TC, sch.G, sch.SG, sch.PS, sch.NS
    assert PS > 0 and NS == 2 and staged_applies(ratio, coff, head_dim, sch)
    assert 3 * sch.G * sch.TC * sch.V * 4 <= coff * ratio * sch.TC * sch.V * 2, "the partials fit in a kv stage"
    W = coff * ratio
    D = head_dim
    WIDTH = coff * head_dim
    NT = sch.threads
    CW = TC * V
    NCHUNK = D // CW
    PIECES = CW // 8  # 16-byte pieces of one slot's columns
    COPIES = W * PIECES // NT  # cp.async per thread, tensor and tile
    STAGE = W * CW  # bf16 elements of one stage of one tensor
    ST = sch.ST
    ops = WindowOps(ratio, coff, head_dim, V, SG, SG, sch.EF)

    @cute.jit
    def tile_rows(t, N: Int32, nreal: Int32, cu_t, cuc_t, B: Int32):
        """Row, first token and first-group flag of tile ``t`` (padding rows: token 0, a first group)."""
        row = t // NCHUNK
        t0 = Int32(0)
        first = Boolean(True)
        if row < cutlass.min(N, nreal):
            b = find_segment(cuc_t, B, row)
            j = row - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0
        return row, t0, first

    @cute.jit
    def copy_tile(kv, score, skv, ssc, t, stage, tidx, N: Int32, nreal: Int32, cu_t, cuc_t, B: Int32):
        """cp.async of tile t's window (its chunk's columns) into a stage; masked slots are not copied."""
        row, t0, first = tile_rows(t, N, nreal, cu_t, cuc_t, B)
        if row < N:
            col0 = t % NCHUNK * CW
            for k in cutlass.range_constexpr(COPIES):
                q = tidx + k * NT
                s = q // PIECES
                piece = q % PIECES
                half = s // ratio
                valid = Boolean(True)
                if cutlass.const_expr(coff == 2):
                    valid = (half == 1) | (not first)
                if valid:
                    goff = (t0 - (coff - 1) * ratio + s) * WIDTH + half * D + col0 + piece * 8
                    soff = stage * STAGE + s * CW + piece * 8
                    cp_async_16_evict_first(skv + soff, kv + cute.assume(goff, divby=8))
                    cp_async_16_evict_first(ssc + soff, score + cute.assume(goff, divby=8))

    @cute.jit
    def body(kv, score, ape, cu, cuc, out, stats, B: Int32, N: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        tc = tidx % TC
        g = (tidx // TC) % G
        cu_t = cute.make_tensor(cu, cute.make_layout(B + 1))
        cuc_t = cute.make_tensor(cuc, cute.make_layout(B + 1))
        nreal = real_rows(cu_t, cuc_t, B)

        smem = cutlass.memory.SmemAllocator()
        sm_kv = smem.allocate_tensor(BFloat16, cute.make_layout(NS * STAGE), byte_alignment=128)
        sm_sc = smem.allocate_tensor(BFloat16, cute.make_layout(NS * STAGE), byte_alignment=128)
        skv = sm_kv.iterator
        ssc = sm_sc.iterator
        kvf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        scf = [cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        va = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        out_t = cute.make_tensor(out, cute.make_layout(N * D))

        n_iter = (N * NCHUNK + PS - 1) // PS  # the same for every CTA: the barriers stay uniform
        copy_tile(kv, score, skv, ssc, bx, 0, tidx, N, nreal, cu_t, cuc_t, B)
        cute.arch.cp_async_commit_group()
        for it in cutlass.range(n_iter):
            # Tile it has landed (the one group in flight), for every thread's copies after the barrier; every thread
            # has also finished tile it - 1's combine, so its stage (data, then partials) may be refilled.
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            copy_tile(kv, score, skv, ssc, bx + (it + 1) * PS, (it + 1) % NS, tidx, N, nreal, cu_t, cuc_t, B)
            cute.arch.cp_async_commit_group()

            t = bx + it * PS
            row, _, first = tile_rows(t, N, nreal, cu_t, cuc_t, B)
            chunk = t % NCHUNK
            c = (chunk * TC + tc) * V
            active = row < N
            sbase = it % NS * STAGE
            for k in cutlass.range_constexpr(SG):
                s = g * SG + k
                valid = active
                if cutlass.const_expr(coff == 2):
                    valid = active & ((s // ratio == 1) | (not first))
                kvf[k].fill(0.0)
                scf[k].fill(NEG_INF)
                if valid:
                    off = sbase + s * CW + tc * V
                    kvf[k].store(vec_view(skv, off, V).load())
                    scf[k].store(vec_view(ssc, off, V).load())
            ops.load_ape(ape, apf, 0, g, c, Boolean(True))
            ops.online_batch(kvf, scf, apf, vm, vl, va, 0)
            # The partials overwrite this tile's kv stage once every thread has read its data from it.
            cute.arch.sync_threads()
            part = cute.recast_ptr(skv + cute.assume(sbase, divby=STAGE), dtype=Float32)
            sm_m = cute.make_tensor(part, cute.make_layout(G * CW))
            sm_l = cute.make_tensor(part + G * CW, cute.make_layout(G * CW))
            sm_a = cute.make_tensor(part + 2 * G * CW, cute.make_layout(G * CW))
            base = g * CW + tc * V
            vec_view(sm_m.iterator, base, V).store(vm.load())
            vec_view(sm_l.iterator, base, V).store(vl.load())
            vec_view(sm_a.iterator, base, V).store(va.load())
            cute.arch.sync_threads()
            if active:
                for q in cutlass.range(tidx, CW, NT):
                    col = chunk * CW + q
                    mx = sm_m[q]
                    for h in cutlass.range_constexpr(1, G):
                        mx = cute.arch.fmax(mx, sm_m[q + h * CW], nan=True)
                    total = Float32(0.0)
                    acc = Float32(0.0)
                    for h in cutlass.range_constexpr(G):
                        scale = ex2(sm_m[q + h * CW] - mx)
                        total = total + sm_l[q + h * CW] * scale
                        acc = acc + sm_a[q + h * CW] * scale
                    res_q = acc / total
                    out_t[row * D + col] = BFloat16(res_q)
                    if cutlass.const_expr(ST):
                        st_t = cute.make_tensor(stats, cute.make_layout(N * 3 * D))
                        st_t[row * 3 * D + col] = mx
                        st_t[row * 3 * D + D + col] = Float32(1.0) / total
                        st_t[row * 3 * D + 2 * D + col] = res_q
        cute.arch.cp_async_wait_group(0)  # no copy outlives the CTA (the trailing group is empty anyway)

    smem_bytes = forward_smem_bytes(sch)
    # Shared memory holds the stages: the largest carveout (a carveout hint needs min_blocks_per_mp > 1).
    launch_bounds = dict(min_blocks_per_mp=max(2, sch.MB), preferred_smem_carveout=100)

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
                grid=[PS, 1, 1], block=[NT, 1, 1], smem=smem_bytes, stream=stream, **launch_bounds
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
            grid=[PS, 1, 1], block=[NT, 1, 1], smem=smem_bytes, stream=stream, **launch_bounds
        )

    return host
