"""The backward of long windows given the forward's softmax statistics (windows of more than 16 slots).

With the row max ``m``, ``1/sum`` and fp32 output saved by the forward, every window element's gradient is
independent of the others: ``p = 2^(y - m) / sum``, ``dv = g * p``, ``dlogit = p * (g*v - g*out)``. So a CTA needs
neither a whole window nor a barrier per row:

- grid ``[row ranges, column chunks x slot chunks]``: a CTA owns ``columns_per_cta`` columns and
  ``slots_per_cta`` consecutive window slots of a contiguous range of rows, ``row_lanes`` rows at a time (row
  lane ``rl`` takes rows ``rl, rl + row_lanes, ...`` of the range);
- a thread owns ``vector_width`` columns of ``slots_per_group`` slots; the next row step's window slice, its
  statistics and its grad_out are loaded into registers while the current step is computed (so the step's math
  waits no DRAM round trip), and ``dv`` and ``dlogit`` are stored at once;
- ape is loaded once per CTA; grad_ape accumulates in registers over the thread's rows, the row lanes are summed
  in lane order through shared memory, and the CTA writes its part of the slab of its row range (the grad_ape
  reduction sums the slabs in a fixed order). In the whole-tile form the grid has one row range: its CTA takes all
  rows of its tile and its "slab" is grad_ape itself (no reduction kernel).

bf16 is widened by NVVM's own conversion here, not ``window.widen``: with the shift/mask form ptxas splits a row
step's loads into two DRAM round trips. With ``grad_float32`` grad_out is fp32 (the composed tail's ``dx``).
Exact zeros and the rows' bounds guard as the other backwards (``ZeroStores``, ``window.locate_row``); the first
slot chunk's CTAs zero the segments without produced rows and the token-capacity padding.

With a ``tail`` (``stats_tail.py``) grad_out is the gradient of the tail's rows, turned into dx in the kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .configs import BackwardStatsConfig
from .persistent import FusedTailHost, launch_tiles
from .ptx import ex2
from .reduce import ApeReduce
from .softmax import LOG2E
from .stats_tail import StatsTail
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
    widen_plain,
)
from .zeros import ZeroStores


class BackwardWithStats(FusedTailHost):
    """Long windows with the forward's softmax statistics: slot chunks x column chunks x row ranges."""

    kind = "backward"
    fused_reads_stats = True

    def __init__(self, config: BackwardStatsConfig):
        self.config = config
        c = config
        # The group index of the slot loads is the global slot group: slots_per_group slots each.
        self.slots = WindowSlots(c.ratio, c.coff, c.head_dim, c.vector_width, c.slots_per_group,
                                 c.slots_per_group, False)  # fmt: skip
        self.zeros = ZeroStores(c.ratio, c.coff, c.head_dim, c.vector_width)
        self.reduce = None if c.whole_tile else ApeReduce(c.reduce)
        # grad_out's element type: the composed tail's dx is fp32 (``grad_float32``).
        self.grad_dtype = Float32 if c.grad_float32 else BFloat16
        self.tail = None
        if c.tail is not None:
            self.tail = StatsTail(c)
            # cute.compile traces the instance's __call__: with a tail, the host function that takes its arguments.
            self.__call__ = self.fused_host
        if c.norm_slabs:
            if not c.whole_tile or c.tail is not None:
                raise ValueError(f"norm slabs are summed by the composed route's whole-tile form only, got {c}")
            self.norm_reduce = ApeReduce(c.norm_reduce)
            self.kind = "summing_backward"
            self.__call__ = self.summing_host

    @cute.jit
    def __call__(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                 cu_seqlens_comp: cute.Pointer, grad_out: cute.Pointer, grad_kv: cute.Pointer,
                 grad_score: cute.Pointer, grad_ape: cute.Pointer, slabs: cute.Pointer, stats: cute.Pointer,
                 segments: Int32, total_comp: Int32, tokens: Int32, rows_per_cta: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        """Host function: the main kernel over ``[num_ctas, tiles]`` CTAs, then the grad_ape reduction (the
        whole-tile form writes grad_ape itself and leaves ``slabs`` unused)."""
        cfg = self.config
        partials = slabs
        if cutlass.const_expr(cfg.whole_tile):
            partials = grad_ape  # one row range: its slab is grad_ape itself
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, partials, stats)
        launch_tiles(cfg, self.kernel(*args, segments, total_comp, tokens, rows_per_cta), num_ctas, stream)
        if cutlass.const_expr(not cfg.whole_tile):
            self.reduce.launch(slabs, grad_ape, num_ctas, stream)

    @cute.kernel
    def kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
               cuc: cute.Pointer, gout: cute.Pointer, gkv: cute.Pointer, gsc: cute.Pointer, ws: cute.Pointer,
               stats: cute.Pointer, B: Int32, N: Int32, T: Int32, rows_per_cta: Int32):  # fmt: skip
        self.body(kv, score, ape, cu, cuc, gout, gkv, gsc, ws, stats, B, N, T, rows_per_cta, None)

    # ------------------------------------------------------------ the composed tail's norm-weight slabs

    @cute.jit
    def summing_host(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                     cu_seqlens_comp: cute.Pointer, grad_out: cute.Pointer, grad_kv: cute.Pointer,
                     grad_score: cute.Pointer, grad_ape: cute.Pointer, norm_slabs: cute.Pointer, stats: cute.Pointer,
                     grad_norm_weight: cute.Pointer, segments: Int32, total_comp: Int32, tokens: Int32,
                     rows_per_cta: Int32, num_ctas: Int32, norm_slab_count: Int32,
                     stream: cuda.CUstream):  # fmt: skip
        """Host function of ``norm_slabs`` (arguments: ``build.py``): the whole-tile kernel, whose CTAs past the
        tiles sum the ``norm_slab_count`` slabs at ``norm_slabs`` into grad_norm_weight."""
        cfg = self.config
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stats)
        call = self.summing_kernel(*args, norm_slabs, grad_norm_weight, segments, total_comp, tokens, rows_per_cta,
                                   norm_slab_count)  # fmt: skip
        # The DSL places both branches' shared buffers one after the other, not over each other: their sum.
        smem = cfg.smem_bytes + cfg.norm_reduce.smem_bytes
        launch_tiles(cfg, call, num_ctas, stream, tiles=cfg.tiles + cfg.summing_ctas, smem=smem)

    @cute.kernel
    def summing_kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
                       cuc: cute.Pointer, gout: cute.Pointer, gkv: cute.Pointer, gsc: cute.Pointer,
                       gape: cute.Pointer, stats: cute.Pointer, norm_slabs: cute.Pointer, gnorm: cute.Pointer,
                       B: Int32, N: Int32, T: Int32, rows_per_cta: Int32, slab_count: Int32):  # fmt: skip
        cfg = self.config
        _, byz, _ = cute.arch.block_idx()
        # The summing CTAs come last along y, so that the tiles take the SMs first and they the ones left over.
        if byz < cfg.tiles:
            self.body(kv, score, ape, cu, cuc, gout, gkv, gsc, gape, stats, B, N, T, rows_per_cta, None)
        else:
            self.norm_reduce.body(norm_slabs, gnorm, gnorm, slab_count, byz - cfg.tiles, cfg.threads)

    @cute.kernel
    def fused_kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
                     cuc: cute.Pointer, gout: cute.Pointer, gkv: cute.Pointer, gsc: cute.Pointer, ws: cute.Pointer,
                     stats: cute.Pointer, B: Int32, N: Int32, T: Int32, rows_per_cta: Int32,
                     norm_weight: cute.Pointer, rope_cos: cute.Pointer, rope_sin: cute.Pointer,
                     position_start: cute.Pointer, rstd: cute.Pointer, eps: Float32, max_position: Int32):  # fmt: skip
        tail_io = SimpleNamespace(norm_weight=norm_weight, rope_cos=rope_cos, rope_sin=rope_sin,
                                  position_start=position_start, rstd=rstd, eps=eps, max_position=max_position,
                                  has_rstd=rstd.toint() != 0)  # fmt: skip
        self.body(kv, score, ape, cu, cuc, gout, gkv, gsc, ws, stats, B, N, T, rows_per_cta, tail_io)

    @cute.jit
    def body(self, kv, score, ape, cu, cuc, gout, gkv, gsc, ws, stats, B: Int32, N: Int32, T: Int32,
             rows_per_cta: Int32, tail_io):  # fmt: skip
        """The kernel; ``tail_io``: the fused tail's pointers and scalars, or None."""
        cfg = self.config
        width, sg, groups, lanes = cfg.vector_width, cfg.slots_per_group, cfg.slot_groups, cfg.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bx, byz, _ = cute.arch.block_idx()
        gdx, _, _ = cute.arch.grid_dim()
        by = byz % cfg.column_chunks
        bz = byz // cfg.column_chunks
        tc = tidx % cfg.column_threads
        gl = (tidx // cfg.column_threads) % groups
        rl = tidx // (cfg.column_threads * groups)  # row lane: rows row_begin + rl, + row_lanes, ...
        gg = bz * groups + gl  # global slot group: slots gg * sg .. gg * sg + sg - 1
        c = (by * cfg.column_threads + tc) * width
        col_ok = Boolean(True)
        if cutlass.const_expr(not cfg.columns_exact):
            col_ok = c < cfg.head_dim
        seg = Segments(cu, cuc, B)
        nreal = real_rows(seg, N)
        regs = SimpleNamespace(zero=registers(width, BFloat16))
        regs.zero.fill(0.0)
        # The current row step's kv and score, and the next step's.
        regs.window = tuple(bf16_registers(sg, width) for _ in range(4))
        regs.apf = register_slots(sg, width)
        regs.dape = register_slots(sg, width)
        for k in cutlass.range_constexpr(sg):
            regs.dape[k].fill(0.0)
        # grad_out, max, 1/sum, out, dv, dlogit of the current row step.
        regs.step = (registers(width, self.grad_dtype), *(registers(width) for _ in range(5)))
        self.slots.load_ape(ape, regs.apf, 0, gg, c, col_ok)
        row_begin = bx * rows_per_cta
        # Rows past the true row count (padding) and past total_comp carry no gradient.
        row_lim = cutlass.min(row_begin + rows_per_cta, nreal)
        row_first = row_begin + rl
        io = SimpleNamespace(kv=kv, score=score, gout=gout, stats=stats, gkv=gkv, gsc=gsc)
        th = SimpleNamespace(gg=gg, c=c, col_ok=col_ok, T=T, N=N, tail=tail_io)
        if cutlass.const_expr(tail_io is not None):
            regs.tail = self.tail.registers()
            th.shared = self.tail.allocate(cutlass.memory.SmemAllocator())
            th.norm_owner = (bz == 0) & (gl == 0)  # one thread per (row, column) adds the weight's gradient
        regs.ahead = self.first_loads(io, seg, regs, row_first, row_lim, th)
        if cutlass.const_expr(cfg.has_norm and not cfg.terms_in_warp):
            self.blocked_rows(io, seg, regs, th, row_begin, row_lim, nreal)
        else:
            for r in cutlass.range(row_first, row_lim, lanes):
                self.row_step(io, seg, r, row_lim, regs, th)
        # Exact zeros: segments with no produced row and token-capacity padding (the first slot chunk's CTAs).
        if col_ok & (bz == 0):
            self.zeros.unowned(gkv, gsc, regs.zero, seg, T, N, bx, gdx, rl * groups + gl, groups * lanes, c)
        self.write_slab(ws, regs.dape, tc, gl, rl, gg, c, col_ok, bx)
        if cutlass.const_expr(cfg.has_norm):
            self.tail.write_norm(ws, th.shared, regs.tail.acc, th.norm_owner, rl, tc, c, col_ok, bx)

    @cute.jit
    def blocked_rows(self, io, seg, regs, th, row_begin, row_lim, nreal):
        """The row steps of a fused norm: per block of ``term_rows`` rows, the rows' terms first (every CTA of the
        row range computes them), then the block's row steps (whose prefetch runs into the next block)."""
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        rl = tidx // (cfg.column_threads * cfg.slot_groups)
        terms = th.shared.terms
        for blk in cutlass.range(row_begin, row_lim, cfg.term_rows):
            blk_end = cutlass.min(blk + cfg.term_rows, row_lim)
            self.tail.row_terms(io, th.tail, seg, terms, blk, blk_end, nreal, tidx)
            cute.arch.sync_threads()
            for r in cutlass.range(blk + rl, blk_end, cfg.row_lanes):
                self.row_step(io, seg, r, row_lim, regs, th, blk)
            cute.arch.sync_threads()  # the terms are read before the next block's overwrite them

    @cute.jit
    def first_loads(self, io, seg, regs, row_first, row_lim, th):
        """Registers for the next row step's grad_out and statistics, and the loads of the thread's first row (with
        the tail, its operands too)."""
        cfg = self.config
        _, _, nxt_kv, nxt_sc = regs.window
        gg, c, col_ok = th.gg, th.c, th.col_ok
        ahead = (registers(cfg.vector_width, self.grad_dtype), *(registers(cfg.vector_width) for _ in range(3)))
        for t in ahead:
            t.fill(0.0)
        if row_first < row_lim:
            # A row that fails the bounds guard reads as a padding row (t0 = 0, in bounds) and stores nothing.
            b0, t00, first0, _real0 = locate_row(seg, row_first, th.T, cfg.ratio)
            self.slots.issue(io.kv, io.score, nxt_kv, nxt_sc, 0, gg, c, col_ok, t00, first0)
            if col_ok:
                self.load_row_inputs(io.gout, io.stats, row_first, c, ahead)
            if cutlass.const_expr(self.tail is not None and self.tail.in_warp):
                self.tail.load_operands(io, th.tail, seg, b0, row_first, c, col_ok, regs.tail.ahead)
        return ahead

    @cute.jit
    def load_row_inputs(self, gout, stats, row, c, dst):
        """Row ``row``'s grad_out and statistics (max, 1/sum, out) for the thread's columns; the caller checks
        ``col_ok``."""
        cfg = self.config
        d, width = cfg.head_dim, cfg.vector_width
        g_dst, m_dst, l_dst, o_dst = dst
        base = row * (3 * d) + c
        g_dst.store(vec_view(gout, row * d + c, width).load())
        m_dst.store(vec_view(stats, base, width).load())
        l_dst.store(vec_view(stats, base + d, width).load())
        o_dst.store(vec_view(stats, base + 2 * d, width).load())

    @cute.jit
    def row_step(self, io, seg, r, row_lim, regs, th, blk=None):
        """Row ``r``: its registers from the step ahead, the next step's loads issued, then the gradients (with a
        fused norm, ``blk``: the first row of the block whose terms are in shared memory)."""
        cfg = self.config
        cur_kv, cur_sc, nxt_kv, nxt_sc = regs.window
        ahead = regs.ahead
        gg, c, col_ok = th.gg, th.c, th.col_ok
        lanes = cfg.row_lanes
        for k in cutlass.range_constexpr(cfg.slots_per_group):
            cur_kv[k].store(nxt_kv[k].load())
            cur_sc[k].store(nxt_sc[k].load())
        for dst, src in zip(regs.step[:4], ahead, strict=True):  # grad_out, max, 1/sum, out
            dst.store(src.load())
        b, t0, first, real = locate_row(seg, r, th.T, cfg.ratio)
        # The next row step's window slice, statistics and grad_out go out before this step's math.
        bn = Int32(0)
        if r + lanes < row_lim:
            bn, t0n, first_n, _real_n = locate_row(seg, r + lanes, th.T, cfg.ratio)
            self.slots.issue(io.kv, io.score, nxt_kv, nxt_sc, 0, gg, c, col_ok, t0n, first_n)
            if col_ok:
                self.load_row_inputs(io.gout, io.stats, r + lanes, c, ahead)
        if cutlass.const_expr(self.tail is not None and self.tail.in_warp):
            # No block of terms read the row's operands before: they are held a row step ahead.
            self.tail.next_operands(io, th.tail, seg, bn, r + lanes, c, col_ok, r + lanes < row_lim, regs.tail)
        elif cutlass.const_expr(self.tail is not None):
            # The row's operands: read by this CTA's terms already (cached), so not held a step ahead.
            self.tail.load_operands(io, th.tail, seg, b, r, c, col_ok, regs.tail.operands)
        # A row that fails the bounds guard (read as a padding row) stores and adds nothing.
        active = col_ok & real
        if cutlass.const_expr(self.tail is not None and self.tail.in_warp):
            # Every lane of the row's warp takes part in its terms' shuffles: columns past head_dim compute on zeros,
            # and a row that fails the guard computes, but neither stores nor adds anything.
            self.gradients(io.gkv, io.gsc, regs, t0, first, active, th, 0)
        elif active:
            self.gradients(io.gkv, io.gsc, regs, t0, first, col_ok, th, r - blk if blk is not None else 0)
        # Exact zeros owned by a segment's last produced row (this thread's slots and columns).
        last, seg_end = segment_owner(seg, b, r, th.N, th.T)
        if active & last:
            self.zeros.segment_tail(io.gkv, io.gsc, regs.zero, t0, seg_end, gg * cfg.slots_per_group,
                                    cfg.slots_per_group, c)  # fmt: skip

    @cute.jit
    def gradients(self, gkv, gsc, regs, t0, first, active, th, term):
        """dv and dlogit of the thread's slots and columns of one row, stored at once; dlogit into grad_ape
        (``active``: the thread's columns exist and the row passed the bounds guard). With the tail, grad_out is
        turned into dx first (``term``: the row's place in the block of terms)."""
        cfg = self.config
        width = cfg.vector_width
        cur_kv, cur_sc, _, _ = regs.window
        gb, vm, vl, vo, dvo, dlo = regs.step
        apf, dape = regs.apf, regs.dape
        gg, c = th.gg, th.c
        if cutlass.const_expr(self.tail is None):
            gw = widen_plain(gb, width)
        else:
            terms = th.shared.terms
            owner = th.norm_owner
            if cutlass.const_expr(self.tail.in_warp):
                owner = owner & active  # here gradients runs for every row step
            gw = self.tail.dx(gb, vo, regs.tail, th.tail, terms, term, owner, c, th.col_ok)
        for k in cutlass.range_constexpr(cfg.slots_per_group):
            s = gg * cfg.slots_per_group + k
            half = s // cfg.ratio
            scw = widen_plain(cur_sc[k], width)
            kvw = widen_plain(cur_kv[k], width)
            for i in cutlass.range_constexpr(width):
                gi = gw[i]
                pk = ex2((scw[i] + apf[k][i]) * LOG2E - vm[i]) * vl[i]
                dvo[i] = gi * pk
                dlo[i] = pk * (gi * kvw[i] - gi * vo[i])
            valid = active
            if cutlass.const_expr(cfg.coff == 2):
                valid = active & ((half == 1) | (not first))
            if valid:
                off = (t0 - (cfg.coff - 1) * cfg.ratio + s) * (cfg.coff * cfg.head_dim) + half * cfg.head_dim + c
                store_vector(gkv, off, width, dvo.load().to(BFloat16))
                store_vector(gsc, off, width, dlo.load().to(BFloat16))
                dape[k].store(dape[k].load() + dlo.load())

    @cute.jit
    def write_slab(self, ws, dape, tc, gl, rl, gg, c, col_ok, bx):
        """The row lanes' accumulators summed in lane order 0, 1, ... (fixed: bitwise reproducible); row lane 0
        writes the CTA's part of its row range's slab (in the whole-tile form, of grad_ape)."""
        cfg = self.config
        width, sg, groups, lanes, cw = (cfg.vector_width, cfg.slots_per_group, cfg.slot_groups, cfg.row_lanes,
                                        cfg.columns_per_cta)  # fmt: skip
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(lanes > 1):
            red = smem.allocate_tensor(Float32, cute.make_layout(lanes * cfg.slots_per_cta * cw), byte_alignment=16)
            for k in cutlass.range_constexpr(sg):
                vec_view(red.iterator, ((rl * groups + gl) * sg + k) * cw + tc * width, width).store(dape[k].load())
            cute.arch.sync_threads()
            for h in cutlass.range_constexpr(1, lanes):
                for k in cutlass.range_constexpr(sg):
                    part = vec_view(red.iterator, ((h * groups + gl) * sg + k) * cw + tc * width, width)
                    dape[k].store(dape[k].load() + part.load())
        if col_ok & (rl == 0):
            for k in cutlass.range_constexpr(sg):
                aoff = self.slots.ape_offset(gg * sg + k) + c
                vec_view(ws, bx * cfg.slab_entries + aoff, width).store(dape[k].load())
