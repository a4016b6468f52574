"""The grad_ape reduction: the second kernel of the backwards' host functions, on the same stream.

Every CTA of a persistent backward grid writes one fp32 slab of grad_ape partials; this kernel sums the slabs in a
fixed order and overwrites grad_ape (no atomics), so grad_ape is bitwise the same from run to run. A fused tail's
slabs end with the norm weight's partials (``ApeReduceConfig.norm_entries``), summed alike into grad_norm_weight.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32

from .configs import REDUCE_UNROLL, REDUCE_WARPS, ApeReduceConfig
from .ptx import add_rn
from .window import register_slots, registers, vec_view


class ApeReduce:
    """grad_ape (and grad_norm_weight) = the fixed-order sum of ``num_ctas`` slabs of ``slab_size`` fp32 entries."""

    def __init__(self, config: ApeReduceConfig):
        self.config = config

    @cute.jit
    def launch(self, ws: cute.Pointer, gape: cute.Pointer, num_ctas: Int32, stream):
        cfg = self.config
        self.kernel(ws, gape, num_ctas).launch(
            grid=[cfg.grid, 1, 1], block=[cfg.threads, 1, 1], smem=cfg.smem_bytes, stream=stream
        )

    @cute.jit
    def launch_with_norm(self, ws: cute.Pointer, gape: cute.Pointer, gnorm: cute.Pointer, num_ctas: Int32, stream):
        """The same sum of slabs that end with ``norm_entries`` grad_norm_weight partials, which go to ``gnorm``."""
        cfg = self.config
        self.kernel_with_norm(ws, gape, gnorm, num_ctas).launch(
            grid=[cfg.grid, 1, 1], block=[cfg.threads, 1, 1], smem=cfg.smem_bytes, stream=stream
        )

    @cute.kernel
    def kernel(self, ws: cute.Pointer, gape: cute.Pointer, num_ctas: Int32):
        self.body(ws, gape, gape, num_ctas)

    @cute.kernel
    def kernel_with_norm(self, ws: cute.Pointer, gape: cute.Pointer, gnorm: cute.Pointer, num_ctas: Int32):
        self.body(ws, gape, gnorm, num_ctas)

    @cute.jit
    def body(self, ws: cute.Pointer, gape: cute.Pointer, gnorm: cute.Pointer, num_ctas: Int32, cta=None,
             cta_threads: int = REDUCE_WARPS * 32):  # fmt: skip
        """A CTA covers ``entry_vectors`` consecutive vectors of entries. Walker q = w * slab_lanes + lane's slab
        lane (warp w) sums slabs q, q + walkers, ... in order; then the walkers' partials are summed in order
        q = 0, 1, ...: a fixed order per entry, whatever the vector width. ``cta``: this CTA's place among the
        reduction's (default its block index); ``cta_threads``: the CTA's threads, of which the first
        REDUCE_WARPS warps walk (a CTA of another kernel: the others only meet the barrier)."""
        cfg = self.config
        ve, nv = cfg.vector, cfg.entry_vectors
        walkers = REDUCE_WARPS * cfg.slab_lanes
        if cutlass.const_expr(cta_threads < REDUCE_WARPS * 32):
            raise ValueError(f"the reduction walks with {REDUCE_WARPS * 32} threads, the CTA has {cta_threads}")
        bx = cta
        if cutlass.const_expr(cta is None):
            bx, _, _ = cute.arch.block_idx()
        tidx, v, q = self.walker()
        e = bx * nv + v
        smem = cutlass.memory.SmemAllocator()
        part = smem.allocate_tensor(Float32, cute.make_layout(walkers * nv * ve), byte_alignment=16)
        acc = registers(ve)
        acc.fill(0.0)
        bufs = register_slots(REDUCE_UNROLL, ve)
        walks = Boolean(True)
        if cutlass.const_expr(cta_threads > REDUCE_WARPS * 32):
            walks = tidx < REDUCE_WARPS * 32  # threads past the walkers: no slab, no partial
        if (e < cfg.slab_size // ve) & walks:
            self.walk_part(ws, acc, bufs, q, e * ve, num_ctas, cfg.slab_size, ve)
        if walks:
            vec_view(part.iterator, (q * nv + v) * ve, ve).store(acc.load())
        cute.arch.sync_threads()
        if (tidx < nv) & (e < cfg.slab_size // ve):
            tot = registers(ve)
            tot.store(vec_view(part.iterator, v * ve, ve).load())
            for h in cutlass.range_constexpr(1, walkers):
                for i in cutlass.range_constexpr(ve):
                    tot[i] = add_rn(tot[i], part[(h * nv + v) * ve + i])
            if cutlass.const_expr(cfg.norm_entries == 0):
                vec_view(gape, e * ve, ve).store(tot.load())
            else:
                if e < cfg.ape_size // ve:
                    vec_view(gape, e * ve, ve).store(tot.load())
                else:
                    vec_view(gnorm, e * ve - cfg.ape_size, ve).store(tot.load())

    @cute.jit
    def walker(self):
        """``(thread, vector, walker)`` of this thread: vector v of the CTA's entries, walker q = w * slab_lanes +
        the lane's slab lane (warp w)."""
        lanes, nv = self.config.slab_lanes, self.config.entry_vectors
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        w = tidx // 32
        v = lane
        q = w
        if cutlass.const_expr(lanes > 1):
            v = lane % nv
            q = w * lanes + lane // nv
        return tidx, v, q

    @cute.jit
    def walk_part(self, ws, acc, bufs, q, first, count, size: int, ve: int):
        """One walker's ``count`` slabs of ``size`` floats (its entries at ``first`` of slab 0), REDUCE_UNROLL per
        step: their loads are all in flight before the first add, and the adds keep the walker's slab order (the
        same sum as one slab per step)."""
        stride = REDUCE_WARPS * self.config.slab_lanes
        for p0 in cutlass.range(q, count, stride * REDUCE_UNROLL):
            for u in cutlass.range_constexpr(REDUCE_UNROLL):
                # Past the last slab the load is clamped to it (in bounds) and not added.
                p = cutlass.min(p0 + u * stride, count - 1)
                bufs[u].store(vec_view(ws, first + p * size, ve).load())
            for u in cutlass.range_constexpr(REDUCE_UNROLL):
                if p0 + u * stride < count:
                    for i in cutlass.range_constexpr(ve):
                        acc[i] = add_rn(acc[i], bufs[u][i])
