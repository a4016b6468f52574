"""The fused tail (RMSNorm, then RoPE; ``csa_compressor.tail``) in the statistics backward: ``BackwardWithStats``
with a ``tail`` turns grad_out into the pooling's upstream gradient itself, where the composed route runs
``TailGradient`` first.

The norm's backward needs two sums over each whole row, ``sum(x*x)`` (for rstd, where the forward saved none) and
``sum(x * w * dy)``. Where a row's columns lie in one warp's lanes (one column chunk of at most 32 threads) and the
CTA runs one row lane (``terms_in_warp``, head_dim up to 128 at 4-column vectors), each row step forms them from its
own operands by a butterfly of shuffles, and the row's cos, sin and saved rstd are loaded a row step ahead with its
window. Wider rows span column chunks or warps, and the row lanes of narrower ones can run different row counts
within a warp (a shuffle in the row loop would wait for lanes that have left it), so there every CTA first computes
both terms for a block of its rows (``term_rows``; one warp per row, its lanes across the row's columns, then a
butterfly of shuffles: the same order as in a warp's row step) into shared memory; the row's cos, sin and partners
are then loaded in the step (this CTA's terms read them already). Each thread forms its own columns'
``dx = r (w dy) - (x r^3) mean(x w dy)``: dy is grad_out rotated back (the partner from the same vector, or read
again from grad_out) and x the statistics' third plane, loaded a row step ahead. The threads of slot group 0 in the
first slot chunk add ``dy x r`` of the real rows into the norm weight's gradient, per CTA into the slab after its
grad_ape partials.

Every CTA of a row range reads the range's whole rows for the terms (from L2 after the first): the cost of not
running a second kernel, small in the slab form, whose row ranges are short. The whole-tile form (every CTA over
all rows) is not built with a tail (``tail_configs.stats_backward_with_tail``). Every multiply and add is
``.rn``-pinned in the fp32 reference's order, as in the other tail kernels (``norm_rope``).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .configs import BackwardStatsConfig
from .norm_rope import RowTail, row_mean
from .ptx import add_rn, mul_rn, sub_rn
from .window import registers, vec_view, widen_plain


class StatsTail:
    """The tail's device code in ``BackwardWithStats``: shared buffers, the rows' terms, the operands loaded a row
    step ahead, each column's dx and the norm weight's gradient."""

    def __init__(self, config: BackwardStatsConfig):
        if config.whole_tile:
            raise ValueError(f"the statistics backward takes the tail in its slab form only, got {config}")
        self.config = config
        self.spec = config.tail
        self.in_warp = config.terms_in_warp
        # Columns of a step are the thread's vector; the terms' rows are one warp each (shuffles only), or in
        # ``in_warp`` the row's column threads in each row step.
        row_threads = config.column_threads if self.in_warp else 32
        self.row = RowTail(config.tail, config.head_dim, config.vector_width, row_threads, 1)
        self.term_steps = -(-config.head_dim // (32 * config.vector_width))

    @cute.jit
    def allocate(self, smem):
        """(terms: rstd and mean per row of a block, lanes: the row lanes' weight gradients)."""
        cfg = self.config
        lanes = cfg.row_lanes * cfg.columns_per_cta if cfg.has_norm and cfg.row_lanes > 1 else 0
        floats = 2 * cfg.term_rows if cfg.has_norm and not self.in_warp else 1
        terms = smem.allocate_tensor(Float32, cute.make_layout(floats), byte_alignment=16)
        return SimpleNamespace(terms=terms, lanes=smem.allocate_tensor(Float32, cute.make_layout(max(1, lanes)),
                                                                       byte_alignment=16))  # fmt: skip

    def registers(self):
        """The norm weight's gradient's accumulators and the row step's operands (cos, sin, partners; in
        ``in_warp`` the saved rstd too, and a second set loaded a row step ahead)."""
        width = self.config.vector_width
        acc = registers(width)
        acc.fill(0.0)
        regs = SimpleNamespace(acc=acc, operands=self.operand_registers())
        if self.in_warp:
            regs.ahead = self.operand_registers()
        return regs

    def operand_registers(self) -> tuple:
        width = self.config.vector_width
        return (*(registers(width) for _ in range(3)), registers(1))

    # ------------------------------------------------------------ row operands

    @cute.jit
    def position(self, seg, b, r, position_start):
        """Row ``r``'s position (row j of segment ``b``: ``position_start[b] + j * ratio``)."""
        pos = (r - seg.cuc[b]) * self.config.ratio
        if cutlass.const_expr(self.spec.has_positions):
            pos = pos + cute.make_tensor(position_start, cute.make_layout(seg.count))[b]
        return pos

    @cute.jit
    def load_operands(self, io, t, seg, b, r, c, ok, dst):
        """Row ``r``'s cos and sin at its position and, where pairs cross vectors, grad_out's partners into
        ``dst``."""
        cs, sn, gp, rs = dst
        if cutlass.const_expr(self.row.has_rope):
            pos = self.position(seg, b, r, t.position_start)
            self.row.load_angles(t.rope_cos, t.rope_sin, pos, t.max_position, c, cs, sn)
            if cutlass.const_expr(not self.row.pairs_in_thread):
                self.row.load_partners(io.gout, r * self.config.head_dim, c, ok, gp)
        if cutlass.const_expr(self.in_warp and self.spec.has_norm):
            rs[0] = Float32(1.0)
            if t.has_rstd:
                rs[0] = cute.make_tensor(t.rstd, cute.make_layout(r + 1))[r]

    @cute.jit
    def next_operands(self, io, t, seg, b, r, c, col_ok, has_next, regs):
        """``in_warp``: the current row step's operands from the set loaded ahead, then row ``r``'s (the next
        step's, where there is one) issued into it."""
        for dst, src in zip(regs.operands, regs.ahead, strict=True):
            dst.store(src.load())
        if has_next:
            self.load_operands(io, t, seg, b, r, c, col_ok, regs.ahead)

    # ------------------------------------------------------------ the rows' terms

    @cute.jit
    def row_terms(self, io, t, seg, terms, blk, blk_end, nreal, tidx):
        """rstd (the forward's where given) and ``mean(x w dy)`` of rows ``[blk, blk_end)`` into ``terms``: warp
        ``w`` takes rows ``blk + w, blk + w + warps, ...``. Every thread of the CTA calls this."""
        cfg = self.config
        width, d = cfg.vector_width, cfg.head_dim
        lane = tidx % 32
        for r in cutlass.range(blk + tidx // 32, blk_end, cfg.threads // 32):
            # The row's own operands go out before the search for its position, which they do not wait for.
            operands = [self.term_operands(io, t, r, (k * 32 + lane) * width) for k in range(self.term_steps)]
            saved = Float32(1.0)
            if t.has_rstd:
                saved = cute.make_tensor(t.rstd, cute.make_layout(r + 1))[r]
            pos = Int32(0)
            if cutlass.const_expr(self.row.has_rope):
                pos = self.row.row_position(seg, r, nreal, cfg.ratio, t.position_start)
            parts = [Float32(0.0), Float32(0.0)]
            for k in cutlass.range_constexpr(self.term_steps):
                parts = self.term_parts(t, pos, (k * 32 + lane) * width, operands[k], parts)
            total_sq, total_dot = self.row.row_sums(parts, terms, 0, 0, tidx)
            rs = self.row.saved_or_rstd(saved, total_sq, t.has_rstd, t.eps)
            if lane == 0:
                terms[2 * (r - blk)] = rs
                terms[2 * (r - blk) + 1] = row_mean(total_dot, d)

    @cute.jit
    def term_operands(self, io, t, r, c):
        """(x, grad_out, norm weight, grad_out's partners) of row ``r``'s columns from ``c`` (0 past head_dim)."""
        cfg = self.config
        width, d = cfg.vector_width, cfg.head_dim
        ok = c < d
        x = registers(width)
        g = registers(width, BFloat16)
        weight = registers(width)  # read per row (cached): held across rows it would crowd the row steps
        partners = registers(width)
        x.fill(0.0)
        g.fill(0.0)
        self.row.load_weight(t.norm_weight, weight, c, ok)
        if ok:
            x.store(vec_view(io.stats, r * (3 * d) + 2 * d + c, width).load())
            g.store(vec_view(io.gout, r * d + c, width).load())
        if cutlass.const_expr(self.row.has_rope and not self.row.pairs_in_thread):
            self.row.load_partners(io.gout, r * d, c, ok, partners)
        return x, g, weight, partners

    @cute.jit
    def term_parts(self, t, pos, c, operands, parts):
        """``parts`` (the sums of x*x and x*(w*dy)) with the thread's columns from ``c`` added in order."""
        width = self.config.vector_width
        x, g, weight, partners = operands
        dy = widen_plain(g, width)
        if cutlass.const_expr(self.row.has_rope):
            cs, sn = registers(width), registers(width)
            self.row.load_angles(t.rope_cos, t.rope_sin, pos, t.max_position, c, cs, sn)
            dy = self.row.turn_back(dy, partners, cs, sn, c)
        return self.column_terms(parts, x, weight, dy)

    @cute.jit
    def column_terms(self, parts, x, weight, dy) -> list:
        """``parts`` (the sums of x*x and x*(w*dy)) with the thread's ``vector_width`` columns added in order."""
        sq, dot = parts
        for i in cutlass.range_constexpr(self.config.vector_width):
            sq = add_rn(sq, mul_rn(x[i], x[i]))
            dot = add_rn(dot, mul_rn(x[i], mul_rn(weight[i], dy[i])))
        return [sq, dot]

    # ------------------------------------------------------------ a row step's dx

    @cute.jit
    def dx(self, grad_out, x, tail_regs, t, terms, term, accumulate, c, col_ok) -> list:
        """The thread's columns of dx (fp32) from grad_out (bf16 registers) and x; with a norm, row ``term`` of
        ``terms`` and ``dy x r`` into the weight's gradient where ``accumulate``."""
        cfg = self.config
        width = cfg.vector_width
        dy = widen_plain(grad_out, width)
        if cutlass.const_expr(self.row.has_rope):
            cs, sn, gp, _rs = tail_regs.operands
            dy = self.row.turn_back(dy, gp, cs, sn, c)
        if cutlass.const_expr(not self.spec.has_norm):
            return dy
        weight = registers(width)  # read per step (cached): a register less held across the row loop
        self.row.load_weight(t.norm_weight, weight, c, col_ok)
        r, mean = Float32(0.0), Float32(0.0)
        if cutlass.const_expr(self.in_warp):
            r, mean = self.row_step_terms(x, dy, weight, tail_regs.operands[3][0], t)
        else:
            r = terms[2 * term]
            mean = terms[2 * term + 1]
        r3 = mul_rn(mul_rn(r, r), r)
        acc = tail_regs.acc  # a plain name: the dynamic `if` writes through it
        if accumulate:
            for i in cutlass.range_constexpr(width):
                acc[i] = add_rn(acc[i], mul_rn(mul_rn(dy[i], x[i]), r))
        return [sub_rn(mul_rn(r, mul_rn(weight[i], dy[i])), mul_rn(mul_rn(x[i], r3), mean)) for i in range(width)]

    @cute.jit
    def row_step_terms(self, x, dy, weight, saved, t) -> tuple:
        """``in_warp``: (rstd, mean(x w dy)) of the row step's row from its column threads' columns: the same sums,
        in the same order, as ``row_terms`` (each thread's columns in order, then the butterfly over the row's
        lanes)."""
        parts = self.column_terms([Float32(0.0), Float32(0.0)], x, weight, dy)
        tidx, _, _ = cute.arch.thread_idx()
        total_sq, total_dot = self.row.row_sums(parts, None, 0, 0, tidx)
        return self.row.saved_or_rstd(saved, total_sq, t.has_rstd, t.eps), row_mean(total_dot, self.config.head_dim)

    @cute.jit
    def write_norm(self, ws, shared, acc, owner, rl, tc, c, col_ok, bx):
        """The row lanes' weight gradients (``owner`` threads) summed in lane order; row lane 0 writes the CTA's
        part of its slab. Every thread of the CTA calls this."""
        cfg = self.config
        width, cw = cfg.vector_width, cfg.columns_per_cta
        if cutlass.const_expr(cfg.row_lanes > 1):
            if owner:
                vec_view(shared.lanes.iterator, rl * cw + tc * width, width).store(acc.load())
            cute.arch.sync_threads()
            if owner & (rl == 0):
                for h in cutlass.range_constexpr(1, cfg.row_lanes):
                    for i in cutlass.range_constexpr(width):
                        acc[i] = add_rn(acc[i], shared.lanes[h * cw + tc * width + i])
        if owner & (rl == 0) & col_ok:
            vec_view(ws, bx * cfg.slab_entries + cfg.ape_size + c, width).store(acc.load())
