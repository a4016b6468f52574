"""Pieces shared by the two cute backward kernels (``backward.py``, ``backward_long.py``).

- the grad_ape reduction kernel (fixed-order sum of the per-CTA slabs, overwrite: no atomics);
- the exact-zero stores that make uninitialised gradient buffers safe, each position from one owner;
- the host function: main kernel, then the reduction kernel, on one stream.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .forward import add_rn, vec_view, window_store

REDUCE_WARPS = 8  # 32 warps measured slower on the H200 (the 32-partial serial combine at every 32 entries)
REDUCE_UNROLL = 8
MAX_REGS = 128  # launch bound of the main kernels: no spills, and the residency launch.py assumes


def reduce_vector(ape_size: int) -> int:
    """Entries per thread of the reduction kernel: 16-byte vectors where the slab size allows."""
    return 4 if ape_size % 4 == 0 else 1


def reduce_slab_lanes(sch) -> int:
    """Lanes of a reduction warp that walk different slabs.

    4 for the short-window backward (``backward.py``): its persistent grid leaves ~530 slabs of a few KB, and
    with one slab per lane the 8 CTAs of head_dim 128 (32 vectors of entries each) took 9 dependent steps of
    slab loads; with 4, a warp covers 8 entry vectors of 4 slabs, the grid has 4x the CTAs and a step 256
    slabs in flight (H200: 1x8192 d128 r4 c2 backward 9.9 -> 7.1 us). 1 for the long-window backwards: they
    have 16-64 large slabs, which 4 slab lanes left partly idle (3x8192 d512 r128 c1 backward +5 %).
    """
    return 1 if sch.LONG else 4


def reduce_grid_x(ape_size: int, slab_lanes: int = 1) -> int:
    """CTAs of the reduction kernel: ``32 // slab_lanes`` vectors of entries each."""
    per_cta = 32 // slab_lanes
    return (ape_size // reduce_vector(ape_size) + per_cta - 1) // per_cta


def make_reduce_kernel(APE_SIZE: int, slab_lanes: int = 1):
    """Second kernel of the backward: grad_ape = the fixed-order sum of the per-CTA slabs (overwrite)."""
    VE = reduce_vector(APE_SIZE)
    NE = APE_SIZE // VE
    SL = slab_lanes
    NV = 32 // SL  # entry vectors per CTA
    STRIDE = REDUCE_WARPS * SL  # slab walkers per CTA

    @cute.kernel
    def reduce_kernel(ws: cute.Pointer, gape: cute.Pointer, num_ctas: Int32):
        # NV consecutive vectors of VE entries per CTA. Walker q = w * SL + sl (warp w, slab lane sl) sums slabs
        # q, q + STRIDE, ... in order; then the STRIDE walker partials are summed in order q = 0, 1, ...: a fixed
        # order per entry, whatever VE is, so grad_ape is bitwise the same from run to run.
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        w = tidx // 32
        v = lane
        q = w
        if cutlass.const_expr(SL > 1):
            v = lane % NV
            q = w * SL + lane // NV
        e = bx * NV + v
        smem = cutlass.memory.SmemAllocator()
        part = smem.allocate_tensor(Float32, cute.make_layout(STRIDE * NV * VE), byte_alignment=16)
        acc = cute.make_rmem_tensor(cute.make_layout(VE), Float32)
        acc.fill(0.0)
        bufs = [cute.make_rmem_tensor(cute.make_layout(VE), Float32) for _ in range(REDUCE_UNROLL)]
        if e < NE:
            # REDUCE_UNROLL slabs per step: their loads are all in flight before the first add; the adds keep
            # the walker's slab order q, q + STRIDE, ... (the same sum as one slab per step).
            for p0 in cutlass.range(q, num_ctas, STRIDE * REDUCE_UNROLL):
                for u in cutlass.range_constexpr(REDUCE_UNROLL):
                    # Past the last slab the load is clamped to it (in bounds) and not added.
                    p = cutlass.min(p0 + u * STRIDE, num_ctas - 1)
                    bufs[u].store(vec_view(ws, p * APE_SIZE + e * VE, VE).load())
                for u in cutlass.range_constexpr(REDUCE_UNROLL):
                    if p0 + u * STRIDE < num_ctas:
                        for i in cutlass.range_constexpr(VE):
                            acc[i] = add_rn(acc[i], bufs[u][i])
        vec_view(part.iterator, (q * NV + v) * VE, VE).store(acc.load())
        cute.arch.sync_threads()
        if (tidx < NV) & (e < NE):
            tot = cute.make_rmem_tensor(cute.make_layout(VE), Float32)
            tot.store(vec_view(part.iterator, v * VE, VE).load())
            for h in cutlass.range_constexpr(1, STRIDE):
                for i in cutlass.range_constexpr(VE):
                    tot[i] = add_rn(tot[i], part[(h * NV + v) * VE + i])
            vec_view(gape, e * VE, VE).store(tot.load())

    return reduce_kernel


class ZeroStores:
    """Exact zeros where nothing consumes a gradient position, each written by exactly one owner.

    ``segment_tail``: a segment's last row zeroes the tokens after its last group (all columns) and,
    for coff 2, the first-half columns of its own tokens (no next row reads them); the calling
    thread owns window slots ``slot0 .. slot0 + count - 1``.
    ``unowned``: CTA ``bx`` zeroes the tokens of the segments ``b = bx mod grid`` that have no row
    and a grid-stride share of the tokens past ``cu_seqlens[-1]``, spread over ``lanes`` threads.
    """

    def __init__(self, ratio: int, coff: int, head_dim: int, V: int, evict_first: bool = False):
        D = head_dim
        WIDTH = coff * head_dim

        @cute.jit
        def segment_tail(gkv, gsc, zero, t0, seg_end, slot0, count: cutlass.Constexpr, c):
            for k in cutlass.range_constexpr(count):
                qz = slot0 + k
                if qz < ratio:
                    tail_tok = t0 + ratio + qz
                    if tail_tok < seg_end:
                        for h in cutlass.range_constexpr(coff):
                            window_store(gkv, tail_tok * WIDTH + h * D + c, V, zero.load(), evict_first)
                            window_store(gsc, tail_tok * WIDTH + h * D + c, V, zero.load(), evict_first)
                    if cutlass.const_expr(coff == 2):
                        own_tok = t0 + qz
                        window_store(gkv, own_tok * WIDTH + c, V, zero.load(), evict_first)
                        window_store(gsc, own_tok * WIDTH + c, V, zero.load(), evict_first)

        @cute.jit
        def unowned(gkv, gsc, zero, cu_t, cuc_t, B, T, bx, gdx, lane, lanes: cutlass.Constexpr, c):
            for b in cutlass.range(bx, B, gdx):
                if cuc_t[b + 1] == cuc_t[b]:
                    for t in cutlass.range(cu_t[b] + lane, cu_t[b + 1], lanes):
                        for h in cutlass.range_constexpr(coff):
                            window_store(gkv, t * WIDTH + h * D + c, V, zero.load(), evict_first)
                            window_store(gsc, t * WIDTH + h * D + c, V, zero.load(), evict_first)
            # Token-capacity padding rows past cu_seqlens[-1]: grid-stride.
            for t in cutlass.range(cu_t[B] + bx * lanes + lane, T, gdx * lanes):
                for h in cutlass.range_constexpr(coff):
                    window_store(gkv, t * WIDTH + h * D + c, V, zero.load(), evict_first)
                    window_store(gsc, t * WIDTH + h * D + c, V, zero.load(), evict_first)

        self.segment_tail, self.unowned = segment_tail, unowned


def make_backward_host(
    kernel,
    ape_size: int,
    nchunk: int,
    threads: int,
    smem_bytes: int,
    carveout: int,
    stats: bool = False,
    slab_lanes: int = 1,
    min_blocks: int = 0,
    cluster: bool = False,
    single: bool = False,
):
    """The @cute.jit host function of a backward: ``kernel`` over ``[num_ctas, nchunk]`` persistent CTAs,
    then the grad_ape reduction, on ``stream``.

    Signature: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
    grad_ape, ws, B, N, T, rows_per_cta, num_ctas, stream)``; with ``stats`` the softmax statistics
    pointer follows ``ws`` (also in the kernel's arguments). With ``cluster`` the grid's x dimension is one
    cluster of ``num_ctas <= 8`` CTAs, the kernel gets ``grad_ape`` in place of ``ws`` and sums it itself (``ws``
    is not used) and there is no second kernel. ``single`` (``Schedule.single_kernel``: the cluster form, or the
    whole-tile form with grid x 1, whose one slab is grad_ape) passes ``grad_ape`` in place of ``ws`` and launches no
    second kernel.
    """
    single = single or cluster
    reduce_kernel = None if single else make_reduce_kernel(ape_size, slab_lanes)
    # Registers capped at MAX_REGS, or for ``min_blocks`` resident CTAs per SM (a schedule's MB).
    min_blocks = min_blocks or max(1, 65536 // (threads * MAX_REGS))

    def launch_both(main, ws, gape, num_ctas, stream):
        # Plain Python, run while the host function is traced.
        main.launch(
            grid=[num_ctas, nchunk, 1],
            block=[threads, 1, 1],
            smem=smem_bytes,
            stream=stream,
            min_blocks_per_mp=min_blocks,
            preferred_smem_carveout=carveout,
            **(dict(cluster=[num_ctas, 1, 1]) if cluster else {}),
        )
        if single:
            return  # the kernel wrote grad_ape itself
        reduce_kernel(ws, gape, num_ctas).launch(
            grid=[reduce_grid_x(ape_size, slab_lanes), 1, 1],
            block=[REDUCE_WARPS * 32, 1, 1],
            smem=REDUCE_WARPS * 32 * 4 * reduce_vector(ape_size) + 64,
            stream=stream,
        )

    if stats:

        @cute.jit
        def host_st(
            kv: cute.Pointer,
            score: cute.Pointer,
            ape: cute.Pointer,
            cu: cute.Pointer,
            cuc: cute.Pointer,
            gout: cute.Pointer,
            gkv: cute.Pointer,
            gsc: cute.Pointer,
            gape: cute.Pointer,
            ws: cute.Pointer,
            st: cute.Pointer,
            B: Int32,
            N: Int32,
            T: Int32,
            rows_per_cta: Int32,
            num_ctas: Int32,
            stream: cuda.CUstream,
        ):
            main = kernel(kv, score, ape, cu, cuc, gout, gkv, gsc, gape if single else ws, st, B, N, T, rows_per_cta)
            launch_both(main, ws, gape, num_ctas, stream)

        return host_st

    @cute.jit
    def host(
        kv: cute.Pointer,
        score: cute.Pointer,
        ape: cute.Pointer,
        cu: cute.Pointer,
        cuc: cute.Pointer,
        gout: cute.Pointer,
        gkv: cute.Pointer,
        gsc: cute.Pointer,
        gape: cute.Pointer,
        ws: cute.Pointer,
        B: Int32,
        N: Int32,
        T: Int32,
        rows_per_cta: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        main = kernel(kv, score, ape, cu, cuc, gout, gkv, gsc, ws, B, N, T, rows_per_cta)
        launch_both(main, ws, gape, num_ctas, stream)

    return host
