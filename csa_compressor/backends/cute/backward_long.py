"""The long-window backward (windows of more than 8 slots), without softmax statistics.

A CTA is ``column_threads`` x ``slot_groups`` threads working on one row at a time; a thread owns
``vector_width`` columns (16-byte vectors at 8) of its group's slots, streamed in batches with the next batch's
loads in flight. CTAs are persistent over a contiguous row range of one column chunk, so that each writes one
fp32 grad_ape slab (summed by ``ApeReduce``). Per row, two passes over the window:

1. online (max, sum e, sum e*v) per column in the log2 domain (as the forward), then one barrier, a fixed-order
   combine of the groups by one thread per column (row max ``M``, ``1/L`` and ``sum p*v``), a second barrier;
2. the window again (this CTA read it a moment ago: L1/L2 serve it, DRAM sees every input once):
   ``p = 2^(y - M) / L``, ``dv = g*p``, ``dlogit = p*(g*v - S)`` with ``S = g * sum p*v``, stored right away;
   grad_ape accumulates per (slot, column) in shared memory, each entry owned by one thread (no atomics).

Where ``prefetch_next_row``, the next row's window is prefetched into L2 between the passes, so that its first
pass waits on L2 rather than DRAM. Exact zeros and the rows' bounds guard as the short-window backward
(``ZeroStores``, ``window.locate_row``).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .configs import BackwardLongConfig
from .persistent import PersistentBackward
from .ptx import ex2, prefetch_l2
from .reduce import ApeReduce
from .softmax import LOG2E, online_fold
from .window import (
    Segments,
    WindowSlots,
    bf16_registers,
    locate_row,
    real_rows,
    register_slots,
    registers,
    segment_owner,
    store_vector,
    vec_view,
)
from .zeros import ZeroStores


class BackwardLongWindow(PersistentBackward):
    """Long windows: two passes per row, grad_ape per CTA in shared memory."""

    def __init__(self, config: BackwardLongConfig):
        self.config = config
        c = config
        self.slots = WindowSlots(c.ratio, c.coff, c.head_dim, c.vector_width, c.slots_per_batch,
                                 c.slots_per_batch * c.batches, False)  # fmt: skip
        self.zeros = ZeroStores(c.ratio, c.coff, c.head_dim, c.vector_width)
        self.reduce = ApeReduce(c.reduce)

    @cute.kernel
    def kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
               cuc: cute.Pointer, gout: cute.Pointer, gkv: cute.Pointer, gsc: cute.Pointer, ws: cute.Pointer,
               B: Int32, N: Int32, T: Int32, rows_per_cta: Int32):  # fmt: skip
        cfg = self.config
        width, cw, spg = cfg.vector_width, cfg.columns_per_cta, cfg.slots_per_batch * cfg.batches
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        tc = tidx % cfg.column_threads
        g = tidx // cfg.column_threads
        c = (by * cfg.column_threads + tc) * width
        col_ok = Boolean(True)
        if cutlass.const_expr(not cfg.columns_exact):
            col_ok = c < cfg.head_dim
        seg = Segments(cu, cuc, B)
        nreal = real_rows(seg, N)
        smem = cutlass.memory.SmemAllocator()
        sm_dape = smem.allocate_tensor(Float32, cute.make_layout(cfg.window * cw), byte_alignment=16)
        shared = [
            smem.allocate_tensor(Float32, cute.make_layout(cfg.slot_groups * cw), byte_alignment=16) for _ in range(3)
        ]
        sm_res = smem.allocate_tensor(Float32, cute.make_layout(3 * cw), byte_alignment=16)
        zero = registers(width, BFloat16)
        zero.fill(0.0)
        zf = registers(width)
        zf.fill(0.0)
        for k in cutlass.range_constexpr(spg):
            vec_view(sm_dape.iterator, (g * spg + k) * cw + tc * width, width).store(zf.load())
        regs = (
            [bf16_registers(cfg.slots_per_batch, width) for _ in range(2)],
            [bf16_registers(cfg.slots_per_batch, width) for _ in range(2)],
            register_slots(cfg.slots_per_batch, width),
            registers(width, BFloat16),
            *(registers(width) for _ in range(6)),  # gf, vm, vl, va, dvo, dlo
        )
        th = SimpleNamespace(tidx=tidx, tc=tc, g=g, c=c, col_ok=col_ok, T=T, N=N)
        io = SimpleNamespace(kv=kv, score=score, ape=ape, gout=gout, gkv=gkv, gsc=gsc)
        row_begin = bx * rows_per_cta
        # Rows past the true row count (padding) and past total_comp carry no gradient.
        row_lim = cutlass.min(row_begin + rows_per_cta, nreal)
        for r in cutlass.range(row_begin, row_lim):
            self.row(io, seg, r, row_lim, regs, zero, (sm_dape, *shared, sm_res), th)
        # Exact zeros: segments with no produced row and token-capacity padding.
        if col_ok:
            self.zeros.unowned(gkv, gsc, zero, seg, T, N, bx, gdx, g, cfg.slot_groups, c)
        # This CTA's grad_ape slab: each thread copies the entries it owns.
        if col_ok:
            for k in cutlass.range_constexpr(spg):
                s = g * spg + k
                aoff = self.slots.ape_offset(s) + c
                vec_view(ws, bx * cfg.ape_size + aoff, width).store(
                    vec_view(sm_dape.iterator, s * cw + tc * width, width).load()
                )

    @cute.jit
    def row(self, io, seg, r, row_lim, regs, zero, smem, th):
        """Both passes over row ``r`` and the exact zeros a segment's last produced row owns."""
        cfg = self.config
        kv, score, ape = io.kv, io.score, io.ape
        kvb, scb, apf, gb = regs[:4]
        vm, vl, va = regs[5:8]
        g, c, col_ok = th.g, th.c, th.col_ok
        b, t0, first, real = locate_row(seg, r, th.T, cfg.ratio)
        last, seg_end = segment_owner(seg, b, r, th.N, th.T)
        # A row that fails the bounds guard reads the window of a padding row (t0 = 0, in bounds: the loads keep
        # their mask) and stores nothing.
        active = col_ok
        gb.fill(0.0)
        if active:
            gb.store(vec_view(io.gout, r * cfg.head_dim + c, cfg.vector_width).load())
        # Pass 1: online (max, sum e, sum e*v) per column, log2 domain.
        self.slots.issue(kv, score, kvb[0], scb[0], 0, g, c, active, t0, first)
        for bi in cutlass.range_constexpr(cfg.batches):
            if cutlass.const_expr(bi + 1 < cfg.batches):
                self.slots.issue(kv, score, kvb[(bi + 1) % 2], scb[(bi + 1) % 2], bi + 1, g, c, active, t0, first)
            self.slots.load_ape(ape, apf, bi, g, c, col_ok)
            online_fold(kvb[bi % 2], scb[bi % 2], apf, vm, vl, va, bi, cfg.vector_width, cfg.slots_per_batch)
        # The second pass's first batch is in flight during the combine.
        self.slots.issue(kv, score, kvb[0], scb[0], 0, g, c, active, t0, first)
        self.combine(smem, vm, vl, va, th.tidx, th.tc, g)
        if cutlass.const_expr(cfg.prefetch_next_row):
            self.prefetch_row(io, seg, r + 1, row_lim, th)
        if real:
            self.gradients(io, regs, smem, t0, first, active, th)
        # Exact zeros owned by a segment's last produced row.
        if active & real & last:
            spg = cfg.slots_per_batch * cfg.batches
            self.zeros.segment_tail(io.gkv, io.gsc, zero, t0, seg_end, g * spg, spg, c)

    @cute.jit
    def combine(self, smem, vm, vl, va, tidx, tc, g):
        """The groups' partials through shared memory; one thread per column combines them in a fixed order into
        the row's max, 1/L and sum p*v."""
        cfg = self.config
        cw = cfg.columns_per_cta
        _, sm_m, sm_l, sm_a, sm_res = smem
        base = g * cw + tc * cfg.vector_width
        vec_view(sm_m.iterator, base, cfg.vector_width).store(vm.load())
        vec_view(sm_l.iterator, base, cfg.vector_width).store(vl.load())
        vec_view(sm_a.iterator, base, cfg.vector_width).store(va.load())
        cute.arch.sync_threads()
        for q in cutlass.range(tidx, cw, cfg.threads):
            mx = sm_m[q]
            for h in cutlass.range_constexpr(1, cfg.slot_groups):
                mx = cute.arch.fmax(mx, sm_m[h * cw + q], nan=True)
            total = Float32(0.0)
            acc = Float32(0.0)
            for h in cutlass.range_constexpr(cfg.slot_groups):
                scale = ex2(sm_m[h * cw + q] - mx)
                total = total + sm_l[h * cw + q] * scale
                acc = acc + sm_a[h * cw + q] * scale
            inv = Float32(1.0) / total
            sm_res[q] = mx
            sm_res[cw + q] = inv
            sm_res[2 * cw + q] = acc * inv
        cute.arch.sync_threads()

    @cute.jit
    def prefetch_row(self, io, seg, rn, row_lim, th):
        """Row ``rn``'s window of the thread's slots into L2, one prefetch per 128-byte line of the CTA's columns:
        DRAM stays busy during this row's second pass."""
        cfg = self.config
        line_threads = max(1, 128 // (2 * cfg.vector_width))  # column threads per 128-byte line
        spg = cfg.slots_per_batch * cfg.batches
        g, c = th.g, th.c
        if (rn < row_lim) & th.col_ok & (th.tc % line_threads == 0):
            _bn, t0n, first_n, real_n = locate_row(seg, rn, th.T, cfg.ratio)
            for k in cutlass.range_constexpr(spg):
                s = g * spg + k
                half = s // cfg.ratio
                okn = real_n
                if cutlass.const_expr(cfg.coff == 2):
                    okn = real_n & ((half == 1) | (not first_n))
                if okn:
                    off = (t0n - (cfg.coff - 1) * cfg.ratio + s) * (cfg.coff * cfg.head_dim) + half * cfg.head_dim + c
                    prefetch_l2(io.kv + off)
                    prefetch_l2(io.score + off)

    @cute.jit
    def gradients(self, io, regs, smem, t0, first, active, th):
        """Pass 2: the row's statistics into registers, then per slot dv and dlogit, stored right away, and dlogit
        added to the slot's grad_ape entries in shared memory."""
        cfg = self.config
        width, cw, batch = cfg.vector_width, cfg.columns_per_cta, cfg.slots_per_batch
        kvb, scb, apf, gb, gf, vm, vl, va, dvo, dlo = regs
        sm_dape, sm_res = smem[0], smem[4]
        tc, g, c = th.tc, th.g, th.c
        gf.store(gb.load().to(Float32))
        for i in cutlass.range_constexpr(width):
            vm[i] = sm_res[tc * width + i]
            vl[i] = sm_res[cw + tc * width + i]
            va[i] = gf[i] * sm_res[2 * cw + tc * width + i]  # S = g * sum p*v
        for bi in cutlass.range_constexpr(cfg.batches):
            if cutlass.const_expr(bi + 1 < cfg.batches):
                self.slots.issue(io.kv, io.score, kvb[(bi + 1) % 2], scb[(bi + 1) % 2], bi + 1, g, c, active, t0,
                                 first)  # fmt: skip
            self.slots.load_ape(io.ape, apf, bi, g, c, th.col_ok)
            kvf, scf = kvb[bi % 2], scb[bi % 2]
            for k in cutlass.range_constexpr(batch):
                s = self.slots.slot(g, bi, k)
                half = s // cfg.ratio
                for i in cutlass.range_constexpr(width):
                    gi = gf[i]
                    pk = ex2((Float32(scf[k][i]) + apf[k][i]) * LOG2E - vm[i]) * vl[i]
                    dvo[i] = gi * pk
                    dlo[i] = pk * (gi * Float32(kvf[k][i]) - va[i])
                valid = active
                if cutlass.const_expr(cfg.coff == 2):
                    valid = active & ((half == 1) | (not first))
                if valid:
                    off = (t0 - (cfg.coff - 1) * cfg.ratio + s) * (cfg.coff * cfg.head_dim) + half * cfg.head_dim + c
                    store_vector(io.gkv, off, width, dvo.load().to(BFloat16))
                    store_vector(io.gsc, off, width, dlo.load().to(BFloat16))
                    sv = vec_view(sm_dape.iterator, s * cw + tc * width, width)
                    sv.store(sv.load() + dlo.load())
