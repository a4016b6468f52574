"""The composed route of the fused tail (RMSNorm, then RoPE; ``csa_compressor.tail``): kernels over whole pooled
rows, run after the statistics forward and before the statistics backward.

- ``TailForward``: the fp32 pooled rows (``stats[:, 2]``, or any ``(N, head_dim)`` fp32 rows of a given stride) ->
  ``out = round_bf16(rope(rmsnorm(x)))`` and, where an rstd buffer is given, each row's
  ``rsqrt(mean(x*x) + eps)`` (1 without a norm);
- ``TailGradient``: ``grad_out`` -> the pooling's upstream gradient ``dx`` (fp32 ``(N, head_dim)``): the rotation
  turned back, then the norm's input gradient ``r (w dy) - x r^3 mean(x w dy)``; and the norm weight's gradient
  ``sum dy x r`` over the real rows, per CTA into a slab, then the fixed-order slab reduction (``ApeReduce``):
  bitwise the same from run to run. Padding rows and rows that fail the bounds guard get ``dx = 0`` and add
  nothing to the weight's gradient.

A row belongs to ``row_threads`` threads (``vector_width`` columns each, ``column_steps`` steps); its sums run over
those threads in a fixed order (butterfly shuffles, whose pairwise adds give every lane the same bits, then the
row's warps in order through shared memory). The forward's rotation reads the partner column from the row staged
in shared memory; the backward reads grad_out's partner from global memory (an input). Every multiply and add
of the tail is ``.rn``-pinned, in the fp32 reference's order, and the rstd takes correctly rounded steps.

Positions: ``position_start[b] + j * ratio`` for row ``j`` of segment ``b`` (zeros without ``position_start``),
0 for padding rows and rows that fail the bounds guard (``window.locate_row``). A position outside
``[0, max_position)`` reads no table: its row is not rotated (cos 1, sin 0).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .norm_rope import row_mean
from .ptx import add_rn, div_rn, mul_rn, sqrt_rn, sub_rn
from .reduce import ApeReduce
from .tail_configs import TailForwardConfig, TailGradientConfig
from .window import Segments, locate_row, real_rows, register_slots, registers, vec_view, widen_plain


class _TailRows:
    """Device code shared by the tail kernels: coordinates, row sums, positions, the rotary columns and tables."""

    def __init__(self, config):
        self.config = config

    @cute.jit
    def coordinates(self):
        """(column thread tc, row lane rl, CTA bx)."""
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        return tidx % cfg.row_threads, tidx // cfg.row_threads, bx

    def shared(self, smem, count: int):
        """A shared fp32 buffer of at least one entry (unused buffers stay tiny)."""
        return smem.allocate_tensor(Float32, cute.make_layout(max(1, count)), byte_alignment=16)

    @cute.jit
    def row_sum(self, value, red, tc, rl):
        """The sum of ``value`` over the row's threads, the same bits in each (every thread of the CTA calls it)."""
        cfg = self.config
        span = min(cfg.row_threads, 32)
        for level in cutlass.range_constexpr(span.bit_length() - 1):
            value = add_rn(value, cute.arch.shuffle_sync_bfly(value, span >> (level + 1)))
        if cutlass.const_expr(cfg.row_warps > 1):
            if tc % 32 == 0:
                red[rl * cfg.row_warps + tc // 32] = value
            cute.arch.sync_threads()
            value = red[rl * cfg.row_warps]
            for h in cutlass.range_constexpr(1, cfg.row_warps):
                value = add_rn(value, red[rl * cfg.row_warps + h])
            cute.arch.sync_threads()  # the buffer is free for the next sum
        return value

    @cute.jit
    def rstd_of(self, xs, red, eps, tc, rl):
        """``1 / sqrt(mean(x * x) + eps)`` of the row held in ``xs`` (zeros past head_dim)."""
        cfg = self.config
        part = Float32(0.0)
        for k in cutlass.range_constexpr(cfg.column_steps):
            for i in cutlass.range_constexpr(cfg.vector_width):
                part = add_rn(part, mul_rn(xs[k][i], xs[k][i]))
        total = self.row_sum(part, red, tc, rl)
        mean = row_mean(total, cfg.head_dim)
        return div_rn(Float32(1.0), sqrt_rn(add_rn(mean, eps)))

    @cute.jit
    def row_position(self, seg, positions, r, N: Int32, T: Int32):
        """(real, position) of row ``r``: real rows that pass the bounds guard, else position 0."""
        cfg = self.config
        real = Boolean(False)
        pos = Int32(0)
        if r < real_rows(seg, N):
            b, _t0, _first, real = locate_row(seg, r, T, cfg.ratio)
            if real:
                pos = (r - seg.cuc[b]) * cfg.ratio
                if cutlass.const_expr(cfg.tail.has_positions):
                    pos = pos + positions[b]
        return real, pos

    def column(self, k: int, i: int, tc):
        """The row column of element ``i`` of the thread's column step ``k``."""
        cfg = self.config
        return (k * cfg.row_threads + tc) * cfg.vector_width + i

    def rotary(self, col):
        """(in the rotary block, first of its pair, angle index, partner column) of column ``col``."""
        cfg = self.config
        base = cfg.head_dim - cfg.tail.rope_dim
        half = cfg.tail.rope_dim // 2
        is_rope = (col >= base) & (col < cfg.head_dim)
        local = cutlass.max(col - base, 0)
        if cutlass.const_expr(cfg.tail.rope_interleaved):
            odd = local % 2
            return is_rope, odd == 0, local // 2, col + 1 - 2 * odd
        second = Int32(local >= half)
        return is_rope, local < half, local - second * half, col + half - 2 * second * half

    @cute.jit
    def angle(self, cos_t, sin_t, pos, a, max_position: Int32):
        """(cos, sin) of angle index ``a`` at ``pos``; (1, 0) outside ``[0, max_position)`` (no table read)."""
        half = self.config.tail.rope_dim // 2
        c = Float32(1.0)
        s = Float32(0.0)
        if (pos >= 0) & (pos < max_position):
            c = cos_t[pos * half + a]
            s = sin_t[pos * half + a]
        return c, s

    @cute.jit
    def load_rows(self, src, row, ok, xs, tc):
        """The thread's columns of row ``row`` of the fp32 rows ``src`` (the configuration's source stride and
        offset) into ``xs``; 0 past head_dim and where not ``ok``."""
        cfg = self.config
        width = cfg.vector_width
        for k in cutlass.range_constexpr(cfg.column_steps):
            v = k * cfg.row_threads + tc
            xs[k].fill(0.0)
            if ok & (v < cfg.vectors):
                xs[k].store(vec_view(src, row * cfg.source_stride + cfg.source_offset + v * width, width).load())

    @cute.jit
    def load_weight(self, weight, ws, tc):
        """The norm weight of the thread's columns in fp32 (0 past head_dim)."""
        cfg = self.config
        for k in cutlass.range_constexpr(cfg.column_steps):
            v = k * cfg.row_threads + tc
            ws[k].fill(0.0)
            if v < cfg.vectors:
                ws[k].store(vec_view(weight, v * cfg.vector_width, cfg.vector_width).load().to(Float32))


class TailForward(_TailRows):
    """The composed forward's epilogue: whole pooled rows -> out (bf16) and rstd.

    It is launched behind the statistics forward as a programmatic dependent launch: its prologue (the rows'
    positions, angles and norm weights, which that kernel does not write) runs while the statistics forward does;
    ``griddepcontrol.wait`` then holds every read of the pooled rows and every write until it has finished."""

    kind = "tail_forward"

    def __init__(self, config: TailForwardConfig):
        super().__init__(config)

    @cute.jit
    def __call__(self, x: cute.Pointer, cu_seqlens: cute.Pointer, cu_seqlens_comp: cute.Pointer, out: cute.Pointer,
                 segments: Int32, total_comp: Int32, tokens: Int32, norm_weight: cute.Pointer, rope_cos: cute.Pointer,
                 rope_sin: cute.Pointer, position_start: cute.Pointer, rstd: cute.Pointer, norm_eps: Float32,
                 max_position: Int32, stream: cuda.CUstream):  # fmt: skip
        """Host function (arguments: ``build.py``): one row per row lane."""
        cfg = self.config
        args = (x, cu_seqlens, cu_seqlens_comp, out, segments, total_comp, tokens)
        tail = (norm_weight, rope_cos, rope_sin, position_start, rstd, norm_eps, max_position)
        self.kernel(*args, *tail).launch(
            grid=[(total_comp + cfg.row_lanes - 1) // cfg.row_lanes, 1, 1],
            block=[cfg.threads, 1, 1],
            smem=cfg.smem_bytes,
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, x: cute.Pointer, cu: cute.Pointer, cuc: cute.Pointer, out: cute.Pointer, B: Int32, N: Int32,
               T: Int32, weight: cute.Pointer, rope_cos: cute.Pointer, rope_sin: cute.Pointer,
               position_start: cute.Pointer, rstd: cute.Pointer, eps: Float32, max_position: Int32):  # fmt: skip
        cfg = self.config
        tc, rl, bx = self.coordinates()
        seg = Segments(cu, cuc, B)
        smem = cutlass.memory.SmemAllocator()
        red = self.shared(smem, cfg.row_lanes * cfg.row_warps if cfg.row_warps > 1 else 0)
        staged = self.shared(smem, cfg.row_lanes * cfg.padded_columns if cfg.tail.rope_dim else 0)
        r = bx * cfg.row_lanes + rl
        row_ok = r < N
        ws = angles = None
        if cutlass.const_expr(cfg.tail.has_norm):
            ws = register_slots(cfg.column_steps, cfg.vector_width)
            self.load_weight(weight, ws, tc)
        if cutlass.const_expr(cfg.tail.rope_dim > 0):
            _real, pos = self.row_position(seg, cute.make_tensor(position_start, cute.make_layout(B)), r, N, T)
            angles = self.load_angles(rope_cos, rope_sin, pos, max_position, tc)
        cute.arch.griddepcontrol_wait()
        xs = register_slots(cfg.column_steps, cfg.vector_width)
        self.load_rows(x, r, row_ok, xs, tc)
        rs = Float32(1.0)
        if cutlass.const_expr(cfg.tail.has_norm):
            rs = self.rstd_of(xs, red, eps, tc, rl)
            self.normalize(xs, ws, rs)
        if (rstd.toint() != 0) & row_ok & (tc == 0):
            cute.make_tensor(rstd, cute.make_layout(N))[r] = rs
        if cutlass.const_expr(cfg.tail.rope_dim > 0):
            self.rotate(xs, staged, angles, tc, rl)
        self.store(out, xs, r, row_ok, tc)

    @cute.jit
    def normalize(self, xs, ws, rs):
        """y = (x * rstd) * w, in the reference's order."""
        cfg = self.config
        for k in cutlass.range_constexpr(cfg.column_steps):
            for i in cutlass.range_constexpr(cfg.vector_width):
                xs[k][i] = mul_rn(mul_rn(xs[k][i], rs), ws[k][i])

    @cute.jit
    def load_angles(self, rope_cos, rope_sin, pos, max_position, tc):
        """(cos, sin) of each of the thread's columns at ``pos`` (1 and 0 outside the rotary block)."""
        cfg = self.config
        half = cfg.tail.rope_dim // 2
        cos_t = cute.make_tensor(rope_cos, cute.make_layout(max_position * half))
        sin_t = cute.make_tensor(rope_sin, cute.make_layout(max_position * half))
        cs = register_slots(cfg.column_steps, cfg.vector_width)
        sn = register_slots(cfg.column_steps, cfg.vector_width)
        for k in cutlass.range_constexpr(cfg.column_steps):
            cs[k].fill(1.0)
            sn[k].fill(0.0)
            for i in cutlass.range_constexpr(cfg.vector_width):
                is_rope, _first, a, _partner = self.rotary(self.column(k, i, tc))
                if is_rope:
                    c, s = self.angle(cos_t, sin_t, pos, a, max_position)
                    cs[k][i] = c
                    sn[k][i] = s
        return cs, sn

    @cute.jit
    def rotate(self, xs, staged, angles, tc, rl):
        """The rotary pairs of the row rotated in place: the row staged in shared memory gives each column its
        partner, ``(a, b) -> (a cos - b sin, a sin + b cos)``."""
        cfg = self.config
        cs, sn = angles
        width = cfg.vector_width
        base = rl * cfg.padded_columns
        for k in cutlass.range_constexpr(cfg.column_steps):
            vec_view(staged.iterator, base + (k * cfg.row_threads + tc) * width, width).store(xs[k].load())
        cute.arch.sync_threads()
        for k in cutlass.range_constexpr(cfg.column_steps):
            for i in cutlass.range_constexpr(width):
                is_rope, first, _a, partner = self.rotary(self.column(k, i, tc))
                if is_rope:
                    other = staged[base + partner]
                    if first:
                        xs[k][i] = sub_rn(mul_rn(xs[k][i], cs[k][i]), mul_rn(other, sn[k][i]))
                    else:
                        xs[k][i] = add_rn(mul_rn(other, sn[k][i]), mul_rn(xs[k][i], cs[k][i]))

    @cute.jit
    def store(self, out, xs, r, row_ok, tc):
        cfg = self.config
        width = cfg.vector_width
        for k in cutlass.range_constexpr(cfg.column_steps):
            v = k * cfg.row_threads + tc
            if row_ok & (v < cfg.vectors):
                vec_view(out, r * cfg.head_dim + v * width, width).store(xs[k].load().to(BFloat16))


class TailGradient(_TailRows):
    """The composed backward's first kernel: grad_out -> dx (fp32) and the norm weight's gradient."""

    kind = "tail_gradient"

    def __init__(self, config: TailGradientConfig):
        super().__init__(config)
        self.reduce = ApeReduce(config.reduce)

    @cute.jit
    def __call__(self, grad_out: cute.Pointer, x: cute.Pointer, cu_seqlens: cute.Pointer,
                 cu_seqlens_comp: cute.Pointer, dx: cute.Pointer, slabs: cute.Pointer, segments: Int32,
                 total_comp: Int32, tokens: Int32, rows_per_cta: Int32, num_ctas: Int32, norm_weight: cute.Pointer,
                 rope_cos: cute.Pointer, rope_sin: cute.Pointer, position_start: cute.Pointer, rstd: cute.Pointer,
                 grad_norm_weight: cute.Pointer, norm_eps: Float32, max_position: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        """Host function (arguments: ``build.py``): ``num_ctas`` persistent CTAs of ``rows_per_cta`` rows (a multiple
        of the row lanes), then with a norm the slabs' reduction into grad_norm_weight (unless the statistics
        backward after it sums them: ``norm_summed_after``)."""
        cfg = self.config
        args = (grad_out, x, cu_seqlens, cu_seqlens_comp, dx, slabs, segments, total_comp, tokens, rows_per_cta)
        tail = (norm_weight, rope_cos, rope_sin, position_start, rstd, norm_eps, max_position)
        self.kernel(*args, *tail).launch(
            grid=[num_ctas, 1, 1], block=[cfg.threads, 1, 1], smem=cfg.smem_bytes, stream=stream
        )
        if cutlass.const_expr(cfg.tail.has_norm and not cfg.norm_summed_after):
            self.reduce.launch(slabs, grad_norm_weight, num_ctas, stream)

    @cute.kernel
    def kernel(self, gout: cute.Pointer, x: cute.Pointer, cu: cute.Pointer, cuc: cute.Pointer, dx: cute.Pointer,
               slabs: cute.Pointer, B: Int32, N: Int32, T: Int32, rows_per_cta: Int32, weight: cute.Pointer,
               rope_cos: cute.Pointer, rope_sin: cute.Pointer, position_start: cute.Pointer, rstd: cute.Pointer,
               eps: Float32, max_position: Int32):  # fmt: skip
        cfg = self.config
        tc, rl, bx = self.coordinates()
        seg = Segments(cu, cuc, B)
        smem = cutlass.memory.SmemAllocator()
        red = [self.shared(smem, cfg.row_lanes * cfg.row_warps if cfg.row_warps > 1 else 0) for _ in range(2)]
        lanes = self.shared(smem, cfg.row_lanes * cfg.padded_columns if cfg.tail.has_norm and cfg.row_lanes > 1 else 0)
        half = cfg.tail.rope_dim // 2
        io = (gout, x, dx, rstd, cute.make_tensor(position_start, cute.make_layout(B)))
        tables = (
            cute.make_tensor(rope_cos, cute.make_layout(max_position * half)),
            cute.make_tensor(rope_sin, cute.make_layout(max_position * half)),
            max_position,
        )
        ws = register_slots(cfg.column_steps, cfg.vector_width)
        acc = register_slots(cfg.column_steps, cfg.vector_width)
        for k in cutlass.range_constexpr(cfg.column_steps):
            acc[k].fill(0.0)
        if cutlass.const_expr(cfg.tail.has_norm):
            self.load_weight(weight, ws, tc)
        for step in cutlass.range(rows_per_cta // cfg.row_lanes):
            r = bx * rows_per_cta + step * cfg.row_lanes + rl
            self.row(io, tables, seg, r, ws, acc, red, eps, N, T, tc, rl)
        if cutlass.const_expr(cfg.tail.has_norm):
            self.write_slab(slabs, acc, lanes, bx, tc, rl)

    @cute.jit
    def row(self, io, tables, seg, r, ws, acc, red, eps, N: Int32, T: Int32, tc, rl):
        """Row ``r``'s dx (0 on rows that are not real) and its terms of the weight's gradient into ``acc``."""
        cfg = self.config
        gout, x, dx, rstd, positions = io
        real, pos = self.row_position(seg, positions, r, N, T)
        dy = register_slots(cfg.column_steps, cfg.vector_width)
        self.load_grad(gout, dy, r, real, tc)
        if cutlass.const_expr(cfg.tail.rope_dim > 0):
            self.turn_back(gout, dy, tables, r, real, pos, tc)
        if cutlass.const_expr(cfg.tail.has_norm):
            xs = register_slots(cfg.column_steps, cfg.vector_width)
            self.load_rows(x, r, r < N, xs, tc)
            rs = self.rstd_of(xs, red[0], eps, tc, rl)
            if (rstd.toint() != 0) & (r < N):
                rs = cute.make_tensor(rstd, cute.make_layout(N))[r]
            self.norm_backward(xs, dy, ws, acc, rs, real, red[1], tc, rl)
        width = cfg.vector_width
        for k in cutlass.range_constexpr(cfg.column_steps):
            v = k * cfg.row_threads + tc
            if not real:
                dy[k].fill(0.0)
            if (r < N) & (v < cfg.vectors):
                vec_view(dx, r * cfg.head_dim + v * width, width).store(dy[k].load())

    @cute.jit
    def load_grad(self, gout, dy, r, real, tc):
        """grad_out of the thread's columns in fp32 (0 on rows that are not real and past head_dim)."""
        cfg = self.config
        width = cfg.vector_width
        for k in cutlass.range_constexpr(cfg.column_steps):
            v = k * cfg.row_threads + tc
            dy[k].fill(0.0)
            if real & (v < cfg.vectors):
                gb = registers(width, BFloat16)
                gb.store(vec_view(gout, r * cfg.head_dim + v * width, width).load())
                gw = widen_plain(gb, width)
                for i in cutlass.range_constexpr(width):
                    dy[k][i] = gw[i]

    @cute.jit
    def turn_back(self, gout, dy, tables, r, real, pos, tc):
        """The inverse rotation (the angle negated, the reference's operations): the partner's grad_out is read
        from global memory."""
        cfg = self.config
        cos_t, sin_t, max_position = tables
        g_t = cute.make_tensor(gout, cute.make_layout((r + 1) * cfg.head_dim))
        for k in cutlass.range_constexpr(cfg.column_steps):
            for i in cutlass.range_constexpr(cfg.vector_width):
                is_rope, first, a, partner = self.rotary(self.column(k, i, tc))
                if real & is_rope:
                    c, s = self.angle(cos_t, sin_t, pos, a, max_position)
                    neg = -s
                    other = Float32(g_t[r * cfg.head_dim + partner])
                    if first:
                        dy[k][i] = sub_rn(mul_rn(dy[k][i], c), mul_rn(other, neg))
                    else:
                        dy[k][i] = add_rn(mul_rn(other, neg), mul_rn(dy[k][i], c))

    @cute.jit
    def norm_backward(self, xs, dy, ws, acc, rs, real, red, tc, rl):
        """dy -> dx = r (w dy) - x r^3 mean(x w dy) in place; ``acc`` += dy x r on real rows."""
        cfg = self.config
        steps, width = cfg.column_steps, cfg.vector_width
        part = Float32(0.0)
        for k in cutlass.range_constexpr(steps):
            for i in cutlass.range_constexpr(width):
                part = add_rn(part, mul_rn(xs[k][i], mul_rn(ws[k][i], dy[k][i])))
        mean = row_mean(self.row_sum(part, red, tc, rl), cfg.head_dim)
        cube = mul_rn(mul_rn(rs, rs), rs)
        for k in cutlass.range_constexpr(steps):
            for i in cutlass.range_constexpr(width):
                if real:
                    acc[k][i] = add_rn(acc[k][i], mul_rn(mul_rn(dy[k][i], xs[k][i]), rs))
                wdy = mul_rn(ws[k][i], dy[k][i])
                dy[k][i] = sub_rn(mul_rn(rs, wdy), mul_rn(mul_rn(xs[k][i], cube), mean))

    @cute.jit
    def write_slab(self, slabs, acc, lanes, bx, tc, rl):
        """The row lanes' partials summed in lane order 0, 1, ... (fixed: bitwise reproducible); row lane 0 writes
        the CTA's slab of head_dim entries."""
        cfg = self.config
        width = cfg.vector_width
        if cutlass.const_expr(cfg.row_lanes > 1):
            for k in cutlass.range_constexpr(cfg.column_steps):
                col = (k * cfg.row_threads + tc) * width
                vec_view(lanes.iterator, rl * cfg.padded_columns + col, width).store(acc[k].load())
            cute.arch.sync_threads()
            if rl == 0:
                for k in cutlass.range_constexpr(cfg.column_steps):
                    col = (k * cfg.row_threads + tc) * width
                    for h in cutlass.range_constexpr(1, cfg.row_lanes):
                        for i in cutlass.range_constexpr(width):
                            acc[k][i] = add_rn(acc[k][i], lanes[h * cfg.padded_columns + col + i])
        if rl == 0:
            for k in cutlass.range_constexpr(cfg.column_steps):
                v = k * cfg.row_threads + tc
                if v < cfg.vectors:
                    vec_view(slabs, bx * cfg.head_dim + v * width, width).store(acc[k].load())
