"""Persistent, software-pipelined form of the long-window forward (``Schedule.PS``; A/B candidate).

The one-CTA-per-tile forward (``forward.py``, G > 1) issues a tile's loads, waits for them, folds, combines and
exits: for the part of a CTA's life spent folding and combining it has no bytes in flight. Here ``PS`` CTAs
(a few per SM) walk the tiles ``bx, bx + PS, ...`` (tile = row x column chunk, chunk-major as ``Schedule.CM``)
and issue the next tile's loads into a second register buffer before folding the current one, so every CTA keeps
a tile in flight all the time. Per tile: the same loads, fold (``WindowOps``), shared-memory partials and
column-parallel combine as the one-tile form, so the output and statistics are bitwise those of ``forward.py``.
Two partial buffers (tile parity) need one CTA barrier per tile: a thread reaches the next tile's barrier only
after it finished combining the current one.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .forward import Schedule, WindowOps, ex2, find_segment, forward_smem_bytes, real_rows, vec_view


def build_forward_persistent(ratio: int, coff: int, head_dim: int, sch: Schedule):
    """The @cute.jit host function; the same signature as ``forward.build_forward`` (``sch.ST``: with stats)."""
    V, TC, G, SG, R, NB, PS = sch.V, sch.TC, sch.G, sch.SG, sch.R, sch.NB, sch.PS
    assert PS > 0 and G > 1 and NB == 1 and R == 1, "the persistent form pipelines one-batch tiles of one row"
    W = coff * ratio
    D = head_dim
    NT = sch.threads
    CW = TC * V
    NCHUNK = -(-D // CW)
    COLS_EXACT = D % CW == 0
    assert G * SG == W
    SMEM_ROW = G * CW
    ST = sch.ST
    ops = WindowOps(ratio, coff, head_dim, V, SG, SG, sch.EF)

    @cute.jit
    def tile_layout(t, tc, N: Int32, nreal: Int32, cu_t, cuc_t, B: Int32):
        """Row, first column, column mask, activity, first token and first-group flag of tile ``t``."""
        row = t // NCHUNK
        c = (t % NCHUNK * TC + tc) * V
        col_ok = Boolean(True)
        if cutlass.const_expr(not COLS_EXACT):
            col_ok = c < D
        active = (row < N) & col_ok
        t0 = Int32(0)
        first = Boolean(True)
        if active & (row < nreal):
            b = find_segment(cuc_t, B, row)
            j = row - cuc_t[b]
            t0 = cu_t[b] + j * ratio
            first = j == 0
        return row, c, col_ok, active, t0, first

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
        sm = [
            [smem.allocate_tensor(Float32, cute.make_layout(SMEM_ROW), byte_alignment=16) for _ in range(3)]
            for _ in range(2)
        ]
        kvb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        scb = [[cute.make_rmem_tensor(cute.make_layout(V), BFloat16) for _ in range(SG)] for _ in range(2)]
        apf = [cute.make_rmem_tensor(cute.make_layout(V), Float32) for _ in range(SG)]
        vm = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        vl = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        va = cute.make_rmem_tensor(cute.make_layout(V), Float32)
        out_t = cute.make_tensor(out, cute.make_layout(N * D))

        n_iter = (N * NCHUNK + PS - 1) // PS  # the same for every CTA: the barriers stay uniform
        t = bx
        row, c, col_ok, active, t0, first = tile_layout(t, tc, N, nreal, cu_t, cuc_t, B)
        ops.issue(kv, score, kvb[0], scb[0], 0, g, c, active, t0, first)
        for _jp in cutlass.range((n_iter + 1) // 2):
            for ph in cutlass.range_constexpr(2):
                tn = t + PS
                n_row, n_c, n_col_ok, n_active, n_t0, n_first = tile_layout(tn, tc, N, nreal, cu_t, cuc_t, B)
                ops.issue(kv, score, kvb[1 - ph], scb[1 - ph], 0, g, n_c, n_active, n_t0, n_first)

                ops.load_ape(ape, apf, 0, g, c, col_ok)
                ops.online_batch(kvb[ph], scb[ph], apf, vm, vl, va, 0)
                sm_m, sm_l, sm_a = sm[ph]
                base = g * CW + tc * V
                vec_view(sm_m.iterator, base, V).store(vm.load())
                vec_view(sm_l.iterator, base, V).store(vl.load())
                vec_view(sm_a.iterator, base, V).store(va.load())
                cute.arch.sync_threads()
                chunk = t % NCHUNK
                for q in cutlass.range(tidx, CW, NT):
                    col = chunk * CW + q
                    ok = row < N
                    if cutlass.const_expr(not COLS_EXACT):
                        ok = ok & (col < D)
                    if ok:
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
                t = tn
                row = n_row
                c = n_c
                col_ok = n_col_ok
                active = n_active
                t0 = n_t0
                first = n_first

    smem_bytes = forward_smem_bytes(sch)
    launch_bounds = dict(min_blocks_per_mp=sch.MB or max(1, 65536 // (NT * 128)), preferred_smem_carveout=50)

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
