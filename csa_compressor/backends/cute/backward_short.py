"""The short-window backward (windows of at most 8 slots): persistent CTAs over contiguous row ranges.

A CTA is ``row_lanes`` x ``slot_groups`` x ``column_threads`` threads with ``vector_width`` columns each (the
forward's mapping), persistent over ``rows_per_cta`` rows of one column chunk, so that it produces one fp32 slab of
grad_ape partials (summed by ``ApeReduce``):

- a thread keeps its group's window (kv and score, bf16) in registers between the softmax and the gradient pass,
  with the next row's loads in flight (two buffer sets), so every input is read once from DRAM; its ape entries
  are loaded once and held across its rows;
- one group (ratio 4 coff 2, ratio 2, ratio 8 coff 1): the fp32 reference's exact operation order,
  p = expf(x - max) / sum, dv = g*p, S = sum(g*v*p) in torch's reduction order, dlogit = p*(g*v - S), every
  multiply and add pinned to ``.rn``: bitwise the reference; with the fused tail (whole rows per CTA, whose
  contract is one bf16 ulp) the fast form of ``softmax.fast_pooled``, S = dx * x from the pooled row it needs
  anyway, and dlogit = p * fma(dx, v, -S);
- several groups (windows whose slots are no power of two): per group (max, sum e), then the group's share of S,
  through shared memory; one thread per (row, column) combines the groups in a fixed order; exp via ex2.approx;
- grad_ape: per-thread fp32 accumulators over the thread's rows, summed over the row lanes in a fixed order.

Exact zeros (``ZeroStores``): a segment's last produced row owns its tail; CTA ``p`` owns the segments
``b = p mod grid`` without produced rows and a grid-stride share of the token-capacity padding. Rows are located
with the bounds guard of ``window.locate_row`` (a row that fails it has no gradient) in the form of
``window.inside``: a row carries its first token through the row loop (``UNLOCATED`` for a row not located) and
the guard is recomputed from it where it is used, so that it keeps no predicate alive across the loop (at the
kernel's register bound ptxas packs such predicates into a register, with instructions at every use).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .configs import BackwardShortConfig
from .norm_rope import RowTail, ordered_sum, row_mean, select
from .persistent import FusedTailHost, PersistentBackward
from .ptx import add_rn, ex2, fma_rn, mul_rn, sub_rn
from .reduce import ApeReduce
from .softmax import LOG2E, exact_probabilities, fast_pooled, torch_order_sum
from .window import (
    NEG_INF,
    UNLOCATED,
    Segments,
    WindowSlots,
    bf16_registers,
    first_group,
    first_tokens,
    inside,
    last_produced,
    real_rows,
    register_slots,
    registers,
    row_token,
    store_vector,
    vec_view,
    widen,
)
from .zeros import ZeroStores


class _Registers:
    """A thread's register tensors (plain Python holder; the tensors are mutated in place)."""

    def __init__(self, cfg: BackwardShortConfig):
        width, sg = cfg.vector_width, cfg.slots_per_group
        self.zero = registers(width, BFloat16)
        self.zero.fill(0.0)
        self.dap = register_slots(sg, width)
        for k in range(sg):
            self.dap[k].fill(0.0)
        # Two buffer sets: the next row's loads are in flight while the current row is computed.
        self.kvb = [bf16_registers(sg, width) for _ in range(2)]
        self.scb = [bf16_registers(sg, width) for _ in range(2)]
        self.gbb = [registers(width, BFloat16) for _ in range(2)]
        self.apf = register_slots(sg, width)

    def allocate_row(self, cfg: BackwardShortConfig) -> None:
        """One group keeps p per (slot, column); several groups keep the fp32 logits (score + ape) instead."""
        width, sg = cfg.vector_width, cfg.slots_per_group
        one_group = cfg.slot_groups == 1
        self.pf = register_slots(sg if one_group else 0, width)
        self.pq = registers(width * sg if one_group else 1)
        self.xf = register_slots(0 if one_group else sg, width)
        self.vm, self.vs, self.vl, self.dvo, self.dlo = (registers(width) for _ in range(5))

    def allocate_tail(self, cfg: BackwardShortConfig) -> None:
        """The fused tail's registers: the norm weight and its gradient's accumulators, and one set of the row's
        cos, sin, grad_out partners and saved rstd (the next row's loaded once the current row has read them)."""
        width = cfg.vector_width
        self.wf = registers(width)
        self.gw = registers(width)
        self.gw.fill(0.0)
        self.cs, self.sn, self.gp = (registers(width) for _ in range(3))
        self.rs = registers(1)


class BackwardShortWindow(FusedTailHost, PersistentBackward):
    """Short windows: the persistent double-buffered backward with a grad_ape slab per CTA."""

    def __init__(self, config: BackwardShortConfig):
        self.config = config
        c = config
        self.slots = WindowSlots(c.ratio, c.coff, c.head_dim, c.vector_width, c.slots_per_group,
                                 c.slots_per_group, False)  # fmt: skip
        self.zeros = ZeroStores(c.ratio, c.coff, c.head_dim, c.vector_width)
        self.reduce = ApeReduce(c.reduce)
        if c.tail is not None:
            self.tail = RowTail(c.tail, c.head_dim, c.vector_width, c.column_threads, c.row_lanes)
            # cute.compile traces the instance's __call__: with a tail, the host function that takes its arguments.
            self.__call__ = self.fused_host

    @cute.kernel
    def kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
               cuc: cute.Pointer, gout: cute.Pointer, gkv: cute.Pointer, gsc: cute.Pointer, ws: cute.Pointer,
               B: Int32, N: Int32, T: Int32, rows_per_cta: Int32):  # fmt: skip
        self.body(kv, score, ape, cu, cuc, gout, gkv, gsc, ws, B, N, T, rows_per_cta, None)

    @cute.kernel
    def fused_kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
                     cuc: cute.Pointer, gout: cute.Pointer, gkv: cute.Pointer, gsc: cute.Pointer, ws: cute.Pointer,
                     B: Int32, N: Int32, T: Int32, rows_per_cta: Int32, norm_weight: cute.Pointer,
                     rope_cos: cute.Pointer, rope_sin: cute.Pointer, position_start: cute.Pointer,
                     rstd: cute.Pointer, eps: Float32, max_position: Int32):  # fmt: skip
        tail_io = SimpleNamespace(norm_weight=norm_weight, rope_cos=rope_cos, rope_sin=rope_sin,
                                  position_start=position_start, rstd=rstd, eps=eps, max_position=max_position,
                                  has_rstd=rstd.toint() != 0)  # fmt: skip
        self.body(kv, score, ape, cu, cuc, gout, gkv, gsc, ws, B, N, T, rows_per_cta, tail_io)

    @cute.jit
    def body(self, kv, score, ape, cu, cuc, gout, gkv, gsc, ws, B: Int32, N: Int32, T: Int32, rows_per_cta: Int32,
             tail_io):  # fmt: skip
        """The kernel; ``tail_io``: the fused tail's pointers and scalars, or None."""
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        tc = tidx % cfg.column_threads
        g = (tidx // cfg.column_threads) % cfg.slot_groups
        rl = tidx // (cfg.column_threads * cfg.slot_groups)
        lane = rl * cfg.slot_groups + g
        c = (by * cfg.column_threads + tc) * cfg.vector_width
        col_ok = Boolean(True)
        if cutlass.const_expr(not cfg.columns_exact):
            col_ok = c < cfg.head_dim
        seg = Segments(cu, cuc, B)
        nreal = real_rows(seg, N)
        smem = self.allocate_shared()
        regs = _Registers(cfg)
        self.slots.load_ape(ape, regs.apf, 0, g, c, col_ok)  # the same for every row of the thread
        regs.allocate_row(cfg)
        th = SimpleNamespace(tidx=tidx, bx=bx, g=g, tc=tc, rl=rl, c=c, col_ok=col_ok, T=T, N=N,
                             bound=first_tokens(T, cfg.ratio))  # fmt: skip
        io = SimpleNamespace(kv=kv, score=score, gout=gout, gkv=gkv, gsc=gsc)
        if cutlass.const_expr(tail_io is not None):
            regs.allocate_tail(cfg)
            th.nreal, th.tail = nreal, tail_io
            if cutlass.const_expr(cfg.tail.has_norm):
                self.tail.load_weight(tail_io.norm_weight, regs.wf, c, col_ok)  # the same for every row
        self.rows(io, seg, nreal, rows_per_cta, regs, smem, th)
        # Exact zeros: segments with no produced row and token-capacity padding.
        if col_ok:
            lanes = cfg.row_lanes * cfg.slot_groups  # threads sharing one column vector
            self.zeros.unowned(gkv, gsc, regs.zero, seg, T, N, bx, gdx, lane, lanes, c)
        self.write_slab(ws, regs.dap, smem[0], tidx, g, rl, c, col_ok, bx)
        if cutlass.const_expr(tail_io is not None and cfg.tail.has_norm):
            self.write_norm_slab(ws, regs.gw, smem[0], tidx, rl, c, col_ok, bx)

    def allocate_shared(self):
        """(row-lane reduction, group partials a and b, combined row results); one buffer serves all four where
        there is one group."""
        cfg = self.config
        smem = cutlass.memory.SmemAllocator()
        sm_red = smem.allocate_tensor(Float32, cute.make_layout(cfg.threads * cfg.vector_width), byte_alignment=16)
        if cutlass.const_expr(cfg.slot_groups == 1 and cfg.tail is not None):
            # The fused tail's row sums across warps (two buffers: consecutive rows alternate) in place of sm_a.
            floats = max(1, 2 * self.tail.sum_floats(2))
            sm_sums = smem.allocate_tensor(Float32, cute.make_layout(floats), byte_alignment=16)
            return sm_red, sm_sums, sm_red, sm_red
        if cutlass.const_expr(cfg.slot_groups == 1):
            return sm_red, sm_red, sm_red, sm_red
        smem_row = cfg.slot_groups * cfg.columns_per_cta
        sm_a = smem.allocate_tensor(Float32, cute.make_layout(cfg.row_lanes * smem_row), byte_alignment=16)
        sm_b = smem.allocate_tensor(Float32, cute.make_layout(cfg.row_lanes * smem_row), byte_alignment=16)
        sm_res = smem.allocate_tensor(Float32, cute.make_layout(3 * cfg.row_lanes * cfg.columns_per_cta),
                                      byte_alignment=16)  # fmt: skip
        return sm_red, sm_a, sm_b, sm_res

    @cute.jit
    def rows(self, io, seg, nreal, rows_per_cta, regs, smem, th):
        """The CTA's row range, row lanes side by side, the next row's loads issued before the current row's math."""
        cfg = self.config
        R = cfg.row_lanes
        rl, col_ok = th.rl, th.col_ok
        row_begin = th.bx * rows_per_cta
        row_end = row_begin + rows_per_cta
        # Rows past the true row count (padding) and past total_comp carry no gradient.
        row_lim = cutlass.min(row_end, nreal)
        n_iter = rows_per_cta // R
        r0 = row_begin + rl
        t0, first, last, seg_end = self.load_row(io, seg, regs, 0, r0, col_ok & (r0 < row_lim), th)
        if cutlass.const_expr(self.config.tail is not None):
            self.load_row_tail(io, seg, regs, r0, inside(t0, th.bound), th, True, True)
        for jp in cutlass.range((n_iter + 1) // 2):
            for ph in cutlass.range_constexpr(2):
                rn = row_begin + (2 * jp + ph + 1) * R + rl
                n_t0, n_first, n_last, n_seg_end = self.load_row(io, seg, regs, 1 - ph, rn, col_ok & (rn < row_lim),
                                                                 th)  # fmt: skip
                row = (t0, first, last, seg_end)
                nxt = SimpleNamespace(io=io, seg=seg, r=rn, active=inside(n_t0, th.bound))
                self.compute_row(io.gkv, io.gsc, regs, ph, smem, row, th, nxt)
                t0 = n_t0
                first = n_first
                last = n_last
                seg_end = n_seg_end

    @cute.jit
    def load_row(self, io, seg, regs, buf: cutlass.Constexpr, r, ok, th):
        """(t0, first, last, seg_end) of row r (``seg_end`` not yet clamped to T: only a last row uses it) and every
        DRAM load of the thread's window slots into buffer set ``buf`` (issued, not waited for). A row that is not
        ``ok`` or fails the bounds guard is inactive: no load, no gradient."""
        ratio = self.config.ratio
        kvf, scf, gb = regs.kvb[buf], regs.scb[buf], regs.gbb[buf]
        t0 = Int32(UNLOCATED)
        first = Boolean(True)
        last = Boolean(False)
        seg_end = Int32(0)
        if ok:
            b, j, t0 = row_token(seg, r, ratio)
            first = first_group(j, t0, ratio)
            last = last_produced(seg, b, r, th.N)
            seg_end = seg.cu[b + 1]
        active = inside(t0, th.bound)
        self.load_window(io.kv, io.score, kvf, scf, active, t0, first, th.g, th.c)
        gb.fill(0.0)
        if active:
            gb.store(vec_view(io.gout, r * self.config.head_dim + th.c, self.config.vector_width).load())
        return t0, first, last, seg_end

    @cute.jit
    def load_row_tail(self, io, seg, regs, r, active, th, angles: cutlass.Constexpr, rstd: cutlass.Constexpr):
        """The fused tail's loads of row r: with ``angles`` cos and sin at the row's position and grad_out of the
        partners in other threads, with ``rstd`` the saved rstd (when given)."""
        cfg, tail, t = self.config, self.tail, th.tail
        if cutlass.const_expr(tail.has_rope and angles):
            pos = tail.row_position(seg, r, th.nreal, cfg.ratio, t.position_start)
            tail.load_angles(t.rope_cos, t.rope_sin, pos, t.max_position, th.c, regs.cs, regs.sn)
            if cutlass.const_expr(not tail.pairs_in_thread):
                tail.load_partners(io.gout, r * cfg.head_dim, th.c, active, regs.gp)
        if cutlass.const_expr(tail.spec.has_norm and rstd):
            rs = regs.rs
            rs[0] = Float32(1.0)
            if active & t.has_rstd:
                rs[0] = cute.make_tensor(t.rstd, cute.make_layout(th.N))[r]

    @cute.jit
    def load_window(self, kv, score, kvf, scf, active, t0, first, g, c):
        """The thread's window slots of one row; masked slots: kv 0, score -inf."""
        cfg = self.config
        for k in cutlass.range_constexpr(cfg.slots_per_group):
            s = g * cfg.slots_per_group + k
            half = s // cfg.ratio
            vk = active
            if cutlass.const_expr(cfg.coff == 2):
                vk = active & ((half == 1) | (not first))
            kvf[k].fill(0.0)
            scf[k].fill(NEG_INF)
            if vk:
                off = (t0 - (cfg.coff - 1) * cfg.ratio + s) * (cfg.coff * cfg.head_dim) + half * cfg.head_dim + c
                kvf[k].store(vec_view(kv, off, cfg.vector_width).load())
                scf[k].store(vec_view(score, off, cfg.vector_width).load())

    @cute.jit
    def compute_row(self, gkv, gsc, regs, ph: cutlass.Constexpr, smem, row, th, nxt):
        """Gradients of one row from the thread's registers; stores; exact zeros of a segment's last group. With the
        tail, the next row's (``nxt``) tail operands are loaded as the row's are read."""
        cfg = self.config
        t0, first, last, seg_end = row
        active = inside(t0, th.bound)
        g, c = th.g, th.c
        valid = []
        for k in cutlass.range_constexpr(cfg.slots_per_group):
            s = g * cfg.slots_per_group + k
            vk = active
            if cutlass.const_expr(cfg.coff == 2):
                vk = active & ((s // cfg.ratio == 1) | (not first))
            valid.append(vk)
        gf = widen(regs.gbb[ph], cfg.vector_width)  # grad_out in fp32
        kvw = [widen(regs.kvb[ph][k], cfg.vector_width) for k in range(cfg.slots_per_group)]
        if cutlass.const_expr(cfg.slot_groups == 1 and cfg.tail is not None):
            self.fused_gradients(gkv, gsc, regs, ph, gf, kvw, valid, active, t0, smem, th, nxt)
        elif cutlass.const_expr(cfg.slot_groups == 1):
            self.exact_gradients(gkv, gsc, regs, regs.scb[ph], gf, kvw, valid, t0, first, g, c)
        else:
            self.grouped_gradients(gkv, gsc, regs, regs.scb[ph], gf, kvw, valid, t0, smem, th)
        # Exact zeros owned by a segment's last group; its end clamped to T here, not in every row's layout.
        if active & last:
            self.zeros.segment_tail(gkv, gsc, regs.zero, t0, cutlass.min(seg_end, th.T), g * cfg.slots_per_group,
                                    cfg.slots_per_group, c)  # fmt: skip

    @cute.jit
    def store_slot(self, gkv, gsc, dvo, dlo, t0, s, valid, c):
        """A slot's gradients land where its inputs were read (stores are disjoint across rows)."""
        cfg = self.config
        if valid:
            off = self.slots.offset(t0, s) + c
            store_vector(gkv, off, cfg.vector_width, dvo.load().to(BFloat16))
            store_vector(gsc, off, cfg.vector_width, dlo.load().to(BFloat16))

    @cute.jit
    def exact_gradients(self, gkv, gsc, regs, scf, gf, kvw, valid, t0, first, g, c):
        """One group: the reference's operation order. Pass A (per column): p and S; pass B (per slot):
        dv = g*p, dlogit = p*(g*v - S), stored right away."""
        cfg = self.config
        exact_probabilities(scf, regs.apf, regs.pq, first, cfg.vector_width, cfg.slots_per_group, cfg.ratio, cfg.coff)
        self.exact_pass(gkv, gsc, regs, gf, kvw, valid, t0, g, c)

    @cute.jit
    def exact_pass(self, gkv, gsc, regs, gf, kvw, valid, t0, g, c):
        """Passes A and B of ``exact_gradients`` from the probabilities in ``regs.pq`` and the row's upstream
        gradient ``gf`` (fp32 per column)."""
        cfg = self.config
        width, sg = cfg.vector_width, cfg.slots_per_group
        dap, dlo = regs.dap, regs.dlo  # plain names: a dynamic `if` may write through them
        for i in cutlass.range_constexpr(width):
            gi = gf[i]
            p = [regs.pq[i * sg + k] for k in range(sg)]
            gvp = [mul_rn(mul_rn(gi, kvw[k][i]), p[k]) for k in range(sg)]
            ssum = torch_order_sum(gvp)
            for k in cutlass.range_constexpr(sg):
                regs.pf[k][i] = p[k]
            regs.vs[i] = ssum
        for k in cutlass.range_constexpr(sg):
            for i in cutlass.range_constexpr(width):
                gi = gf[i]
                regs.dvo[i] = mul_rn(gi, regs.pf[k][i])
                regs.dlo[i] = mul_rn(regs.pf[k][i], sub_rn(mul_rn(gi, kvw[k][i]), regs.vs[i]))
            if valid[k]:
                for i in cutlass.range_constexpr(width):
                    dap[k][i] = add_rn(dap[k][i], dlo[i])
            self.store_slot(gkv, gsc, regs.dvo, regs.dlo, t0, g * sg + k, valid[k], c)

    @cute.jit
    def grouped_gradients(self, gkv, gsc, regs, scf, gf, kvw, valid, t0, smem, th):
        """Several groups: pass 1 per-group (max, sum e), combined; pass 2 the group's share of S, combined;
        pass 3 the gradients per slot, stored right away."""
        cfg = self.config
        width, sg = cfg.vector_width, cfg.slots_per_group
        tidx, g, tc, rl, c = th.tidx, th.g, th.tc, th.rl, th.c
        _, sm_a, sm_b, sm_res = smem
        dap, dlo = regs.dap, regs.dlo  # plain names: a dynamic `if` may write through them
        for k in cutlass.range_constexpr(sg):
            scw = widen(scf[k], width)
            for i in cutlass.range_constexpr(width):
                regs.xf[k][i] = scw[i] + regs.apf[k][i]
        base = rl * (cfg.slot_groups * cfg.columns_per_cta) + g * cfg.columns_per_cta + tc * width
        self.group_max_sum(regs)
        vec_view(sm_a.iterator, base, width).store(regs.vm.load())
        vec_view(sm_b.iterator, base, width).store(regs.vs.load())
        cute.arch.sync_threads()
        self.combine_max_sum(sm_a, sm_b, sm_res, tidx)
        cute.arch.sync_threads()
        self.group_share(regs, gf, kvw, sm_res, rl, tc)
        vec_view(sm_a.iterator, base, width).store(regs.dvo.load())
        cute.arch.sync_threads()
        self.combine_share(sm_a, sm_res, tidx)
        cute.arch.sync_threads()
        resb = rl * cfg.columns_per_cta + tc * width
        for i in cutlass.range_constexpr(width):
            regs.vl[i] = sm_res[2 * cfg.row_lanes * cfg.columns_per_cta + resb + i]
        for k in cutlass.range_constexpr(sg):
            for i in cutlass.range_constexpr(width):
                gi = gf[i]
                pk = ex2(regs.xf[k][i] * LOG2E - regs.vm[i]) * regs.vs[i]
                regs.dvo[i] = gi * pk
                regs.dlo[i] = pk * (gi * kvw[k][i] - regs.vl[i])
            if valid[k]:
                for i in cutlass.range_constexpr(width):
                    dap[k][i] = dap[k][i] + dlo[i]
            self.store_slot(gkv, gsc, regs.dvo, regs.dlo, t0, g * sg + k, valid[k], c)

    @cute.jit
    def group_max_sum(self, regs):
        """Pass 1: the group's (max, sum e) per column."""
        cfg = self.config
        for i in cutlass.range_constexpr(cfg.vector_width):
            m = regs.xf[0][i]
            for k in cutlass.range_constexpr(1, cfg.slots_per_group):
                m = cute.arch.fmax(m, regs.xf[k][i], nan=True)
            msafe = m
            if m == Float32(NEG_INF):
                msafe = Float32(0.0)
            ml = msafe * LOG2E
            total = Float32(0.0)
            for k in cutlass.range_constexpr(cfg.slots_per_group):
                total = total + ex2(regs.xf[k][i] * LOG2E - ml)
            regs.vm[i] = m
            regs.vs[i] = total

    @cute.jit
    def combine_max_sum(self, sm_a, sm_b, sm_res, tidx):
        """Column-parallel combine of the groups in a fixed order: the row's log2-domain max and 1/sum."""
        cfg = self.config
        cw, groups, lanes = cfg.columns_per_cta, cfg.slot_groups, cfg.row_lanes
        for qa in cutlass.range(tidx, lanes * cw, cfg.threads):
            qab = (qa // cw) * (groups * cw) + qa % cw
            mx = sm_a[qab]
            for h in cutlass.range_constexpr(1, groups):
                mx = cute.arch.fmax(mx, sm_a[qab + h * cw], nan=True)
            mxl = mx * LOG2E
            total = Float32(0.0)
            for h in cutlass.range_constexpr(groups):
                total = total + sm_b[qab + h * cw] * ex2(sm_a[qab + h * cw] * LOG2E - mxl)
            sm_res[qa] = mxl
            sm_res[lanes * cw + qa] = Float32(1.0) / total

    @cute.jit
    def group_share(self, regs, gf, kvw, sm_res, rl, tc):
        """Pass 2: the row's max and 1/sum into registers, and the group's share of S = sum(g*v*p) in dvo."""
        cfg = self.config
        cw = cfg.columns_per_cta
        resb = rl * cw + tc * cfg.vector_width
        for i in cutlass.range_constexpr(cfg.vector_width):
            mxl = sm_res[resb + i]
            inv = sm_res[cfg.row_lanes * cw + resb + i]
            regs.vm[i] = mxl
            regs.vs[i] = inv
            ssum = Float32(0.0)
            for k in cutlass.range_constexpr(cfg.slots_per_group):
                pk = ex2(regs.xf[k][i] * LOG2E - mxl) * inv
                ssum = ssum + gf[i] * kvw[k][i] * pk
            regs.dvo[i] = ssum

    @cute.jit
    def combine_share(self, sm_a, sm_res, tidx):
        """S per (row lane, column): the groups' shares in a fixed order."""
        cfg = self.config
        cw, groups, lanes = cfg.columns_per_cta, cfg.slot_groups, cfg.row_lanes
        for qs in cutlass.range(tidx, lanes * cw, cfg.threads):
            qsb = (qs // cw) * (groups * cw) + qs % cw
            ssum = sm_a[qsb]
            for h in cutlass.range_constexpr(1, groups):
                ssum = ssum + sm_a[qsb + h * cw]
            sm_res[2 * lanes * cw + qs] = ssum

    @cute.jit
    def write_slab(self, ws, dap, sm_red, tidx, g, rl, c, col_ok, bx):
        """This CTA's grad_ape partial: the row lanes summed in a fixed order, one slab per CTA."""
        cfg = self.config
        width, sg, lanes = cfg.vector_width, cfg.slots_per_group, cfg.row_lanes
        for k in cutlass.range_constexpr(sg):
            if cutlass.const_expr(lanes > 1):
                vec_view(sm_red.iterator, tidx * width, width).store(dap[k].load())
                cute.arch.sync_threads()
                if rl == 0:
                    for i in cutlass.range_constexpr(width):
                        acc = sm_red[tidx * width + i]
                        for h in cutlass.range_constexpr(1, lanes):
                            acc = add_rn(acc, sm_red[(tidx + h * cfg.column_threads * cfg.slot_groups) * width + i])
                        dap[k][i] = acc
                cute.arch.sync_threads()
            if (rl == 0) & col_ok:
                aoff = self.slots.ape_offset(g * sg + k) + c
                vec_view(ws, bx * cfg.slab_entries + aoff, width).store(dap[k].load())

    # ------------------------------------------------------------ the fused tail (RMSNorm, RoPE)

    @cute.jit
    def fused_gradients(self, gkv, gsc, regs, ph: cutlass.Constexpr, gf, kvw, valid, active, t0, smem, th, nxt):
        """One group with the tail: the probabilities and the pooled row x in the fast form (within a few fp32 ulps
        of the forward's exact x), dy = grad_out rotated back, the norm's dx, then the slots' gradients from dx. The
        tail operands' one register set takes the next row's as soon as this row has read it: registers a second
        set would hold, and the loads still land a row's work later."""
        cfg, tail = self.config, self.tail
        width, sg = cfg.vector_width, cfg.slots_per_group
        pooled = fast_pooled(regs.scb[ph], regs.apf, kvw, regs.pq, width, sg)
        x = [select(th.col_ok, v, Float32(0.0)) for v in pooled]
        dx = gf
        if cutlass.const_expr(tail.has_rope):
            dx = tail.turn_back(gf, regs.gp, regs.cs, regs.sn, th.c)
            self.load_row_tail(nxt.io, nxt.seg, regs, nxt.r, nxt.active, th, True, False)
        if cutlass.const_expr(tail.spec.has_norm):
            dx = self.norm_backward(regs, ph, x, dx, active, smem[1], th)
            self.load_row_tail(nxt.io, nxt.seg, regs, nxt.r, nxt.active, th, False, True)
        self.fused_pass(gkv, gsc, regs, dx, x, kvw, valid, t0, th.g, th.c)

    @cute.jit
    def fused_pass(self, gkv, gsc, regs, dx, x, kvw, valid, t0, g, c):
        """The slots' gradients from the pooled row's gradient dx: S = sum_k dx v_k p_k = dx x, dv = dx p,
        dlogit = p (dx v - S) with one fma; stored right away."""
        cfg = self.config
        width, sg = cfg.vector_width, cfg.slots_per_group
        dap, dlo = regs.dap, regs.dlo  # plain names: a dynamic `if` may write through them
        for i in cutlass.range_constexpr(width):
            regs.vs[i] = dx[i] * x[i]
        for k in cutlass.range_constexpr(sg):
            for i in cutlass.range_constexpr(width):
                p = regs.pq[i * sg + k]
                regs.dvo[i] = dx[i] * p
                regs.dlo[i] = p * fma_rn(dx[i], kvw[k][i], -regs.vs[i])
            if valid[k]:
                for i in cutlass.range_constexpr(width):
                    dap[k][i] = dap[k][i] + dlo[i]
            self.store_slot(gkv, gsc, regs.dvo, regs.dlo, t0, g * sg + k, valid[k], c)

    @cute.jit
    def norm_backward(self, regs, ph: cutlass.Constexpr, x, dy, active, sums, th):
        """dx = r (w dy) - (x r^3) mean(x w dy) of the thread's columns, r the row's rstd (the forward's when given);
        the real rows' dy x r into the weight's gradient accumulators."""
        tail, width = self.tail, self.config.vector_width
        wdy = [mul_rn(regs.wf[i], dy[i]) for i in range(width)]
        parts = [ordered_sum([mul_rn(x[i], x[i]) for i in range(width)]),
                 ordered_sum([mul_rn(x[i], wdy[i]) for i in range(width)])]  # fmt: skip
        total_sq, total_dot = tail.row_sums(parts, sums, ph * tail.sum_floats(2), th.rl, th.tidx)
        r = tail.saved_or_rstd(regs.rs[0], total_sq, th.tail.has_rstd, th.tail.eps)
        mean = row_mean(total_dot, self.config.head_dim)
        r3 = mul_rn(mul_rn(r, r), r)
        gw = regs.gw  # a plain name: the dynamic `if` writes through it
        if active:
            for i in cutlass.range_constexpr(width):
                gw[i] = add_rn(gw[i], mul_rn(mul_rn(dy[i], x[i]), r))
        return [sub_rn(mul_rn(r, wdy[i]), mul_rn(mul_rn(x[i], r3), mean)) for i in range(width)]

    @cute.jit
    def write_norm_slab(self, ws, gw, sm_red, tidx, rl, c, col_ok, bx):
        """This CTA's grad_norm_weight partial after its grad_ape entries: the row lanes summed in a fixed order."""
        cfg = self.config
        width, lanes = cfg.vector_width, cfg.row_lanes
        if cutlass.const_expr(lanes > 1):
            vec_view(sm_red.iterator, tidx * width, width).store(gw.load())
            cute.arch.sync_threads()
            if rl == 0:
                for i in cutlass.range_constexpr(width):
                    acc = sm_red[tidx * width + i]
                    for h in cutlass.range_constexpr(1, lanes):
                        acc = add_rn(acc, sm_red[(tidx + h * cfg.column_threads) * width + i])
                    gw[i] = acc
            cute.arch.sync_threads()
        if (rl == 0) & col_ok:
            vec_view(ws, bx * cfg.slab_entries + cfg.ape_size + c, width).store(gw.load())
