"""Device helpers of the fused tail (``csa_compressor.tail``: RMSNorm over the row, then RoPE on its last
``rope_dim`` columns) in the short-window kernels, and of its backward (the rotation turned back, the norm's input
gradient), shared by ``ForwardShortWindow`` and ``BackwardShortWindow``.

A fused row spans ``row_threads`` threads, a power of two (an aligned share of a warp, or whole warps), each with
``width`` contiguous columns from its column ``c``. A row sum takes each thread's columns in order, then a butterfly
of shuffles over the row's lanes of a warp (the two partners of an exchange add the same two values, so every lane
ends with the same sum) and, for rows of several warps, the warps' sums in warp order through shared memory: one
fixed order, the same for every thread of the row and from run to run.

Rotary pairs: interleaved pairs that start on an even column, with even vectors, lie in one thread's vector, and with
one column per thread in neighbouring lanes (a shuffle); other pairs exchange the partner through shared memory
(the forward) or read it from grad_out again (the backward: an input). A row's position is ``position_start[b] +
j * ratio`` (padding rows 0); a position outside ``[0, max_position)`` rotates by nothing (cos 1, sin 0) and reads
nothing from the tables.

Numerics follow the fp32 reference's operation order where it has one: ``rstd = 1 / sqrt(sum(x*x) / d + eps)``
with correctly rounded steps (as the Triton kernels), ``y = (x * rstd) * w``, each product and sum of the rotation
rounded on its own, ``dx = r * (w*dy) - (x * r^3) * (sum(x*w*dy) / d)``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .configs import TailSpec
from .ptx import add_rn, div_rn, mul_rn, rcp_rn, sqrt_rn, sub_rn
from .window import find_segment, vec_view


def row_mean(total, head_dim: int) -> Float32:
    """``total / head_dim`` correctly rounded; a product by the exact reciprocal where head_dim is a power of two (the
    same bits, a fraction of the division's instructions on the rows' serial chain)."""
    if head_dim & (head_dim - 1) == 0:
        return mul_rn(total, Float32(1.0 / head_dim))
    return div_rn(total, Float32(head_dim))


def select(cond, a, b) -> Float32:
    """``a`` where ``cond`` else ``b`` (fp32, no branch)."""
    return Float32(cutlass.select_(cond, Float32(a), Float32(b)))


def ordered_sum(values) -> Float32:
    """Left-to-right sum, each add rounded on its own."""
    total = values[0]
    for v in values[1:]:
        total = add_rn(total, v)
    return total


class RowTail:
    """The tail of one fused kernel: its spec and the row's thread mapping (``rows`` rows of ``row_threads``)."""

    def __init__(self, spec: TailSpec, head_dim: int, width: int, row_threads: int, rows: int):
        self.spec, self.head_dim, self.width = spec, head_dim, width
        self.row_threads, self.rows = row_threads, rows
        self.row_warps = row_threads // 32  # > 1: the row sums cross warps through shared memory
        if self.row_warps > 1 and rows > 15:
            raise ValueError(f"{rows} rows of several warps need more named barriers than a CTA has")
        self.base = head_dim - spec.rope_dim  # the rotary block's first column
        self.half = spec.rope_dim // 2
        self.has_rope = spec.rope_dim > 0
        self.pairs_in_thread = spec.rope_interleaved and self.base % 2 == 0 and width % 2 == 0
        # One column per thread, interleaved pairs from an even column: the partner is the neighbouring lane.
        self.pairs_in_lanes = self.has_rope and spec.pairs_adjacent(head_dim) and width == 1 and row_threads > 1
        self.exchanges_rows = self.has_rope and not (self.pairs_in_thread or self.pairs_in_lanes)

    def sum_floats(self, sums: int) -> int:
        """Shared floats of one buffer of ``sums`` row sums across warps (0 where a row is within a warp)."""
        return self.rows * sums * self.row_warps if self.row_warps > 1 else 0

    # ------------------------------------------------------------ rows

    @cute.jit
    def row_sums(self, parts: list, buf, base, row, tidx):
        """The row sums of ``parts`` (this thread's partials), the same on every thread of the row; ``buf`` at
        ``base`` holds ``sum_floats(len(parts))`` floats, free for this call (every thread of the CTA calls it)."""
        n = len(parts)
        vals = list(parts)
        for off in [o for o in (16, 8, 4, 2, 1) if o < min(self.row_threads, 32)]:
            vals = [add_rn(v, cute.arch.shuffle_sync_bfly(v, offset=off)) for v in vals]
        if cutlass.const_expr(self.row_warps > 1):
            warps = self.row_warps
            warp = (tidx % self.row_threads) // 32
            if tidx % 32 == 0:
                for q in cutlass.range_constexpr(n):
                    buf[base + (row * n + q) * warps + warp] = vals[q]
            if cutlass.const_expr(self.rows > 1):
                # The row's warps wait for one another only, so that the CTA's rows do not run in lock step.
                cute.arch.barrier(barrier_id=1 + row, number_of_threads=self.row_threads)
            else:
                cute.arch.sync_threads()
            vals = [ordered_sum([buf[base + (row * n + q) * warps + h] for h in range(warps)]) for q in range(n)]
        return vals

    def rstd(self, sum_squares, eps) -> Float32:
        """``1 / sqrt(mean(x*x) + eps)``, every step correctly rounded."""
        return rcp_rn(sqrt_rn(add_rn(div_rn(sum_squares, Float32(self.head_dim)), eps)))

    @cute.jit
    def saved_or_rstd(self, saved, sum_squares, has_saved, eps) -> Float32:
        """``saved`` (the forward's rstd) where ``has_saved`` (uniform: an rstd was given), else ``rstd``: a branch,
        so that a call with the forward's rstd skips the chain of three rounded steps."""
        r = Float32(0.0)
        if has_saved:
            r = saved
        else:
            r = self.rstd(sum_squares, eps)
        return r

    @cute.jit
    def row_position(self, seg, r, nreal, ratio: cutlass.Constexpr, position_start):
        """``position_start[b] + j * ratio`` of row ``r`` (row j of segment b); rows at or past ``nreal`` 0."""
        pos = Int32(0)
        if r < nreal:
            b = find_segment(seg.cuc, seg.count, r)
            pos = (r - seg.cuc[b]) * ratio
            if cutlass.const_expr(self.spec.has_positions):
                ps = cute.make_tensor(position_start, cute.make_layout(seg.count))
                pos = pos + ps[b]
        return pos

    @cute.jit
    def load_weight(self, norm_weight, wf, c, col_ok):
        """The norm weight of the thread's columns in fp32 into ``wf`` (0 past head_dim)."""
        wf.fill(0.0)
        if col_ok:
            if cutlass.const_expr(self.spec.norm_weight_float32):
                wf.store(vec_view(norm_weight, c, self.width).load())
            else:
                w16 = cute.recast_ptr(norm_weight, dtype=BFloat16)
                wf.store(vec_view(w16, c, self.width).load().to(Float32))

    # ------------------------------------------------------------ rotary columns

    def in_rope(self, col):
        return (col >= self.base) & (col < self.head_dim)

    def local(self, col):
        """The column's place in the rotary block (0 outside it, so that every index stays in range)."""
        return cutlass.max(col - self.base, Int32(0))

    def is_first(self, col):
        """Whether the column is the first (a) of its pair."""
        if self.spec.rope_interleaved:
            return self.local(col) % 2 == 0
        return self.local(col) < self.half

    def angle(self, col):
        """The column's angle index (its pair's)."""
        local = self.local(col)
        if self.spec.rope_interleaved:
            return local // 2
        return Int32(cutlass.select_(local < self.half, local, local - self.half))

    def partner(self, col):
        """The other column of the pair (the column itself outside the block)."""
        local = self.local(col)
        if self.spec.rope_interleaved:
            other = cutlass.select_(local % 2 == 0, col + 1, col - 1)
        else:
            other = cutlass.select_(local < self.half, col + self.half, col - self.half)
        return Int32(cutlass.select_(self.in_rope(col), Int32(other), col))

    @cute.jit
    def load_angles(self, rope_cos, rope_sin, pos, max_position, c, cs, sn):
        """cos and sin of each of the thread's columns at position ``pos`` into ``cs``, ``sn``: 1 and 0 outside the
        rotary block and for a position outside ``[0, max_position)`` (no table read then)."""
        cs.fill(1.0)
        sn.fill(0.0)
        pos_ok = (pos >= 0) & (pos < max_position)
        cos_t = cute.make_tensor(rope_cos, cute.make_layout(max_position * self.half))
        sin_t = cute.make_tensor(rope_sin, cute.make_layout(max_position * self.half))
        step = 2 if self.pairs_in_thread else 1
        for i in cutlass.range_constexpr(0, self.width, step):
            col = c + i
            if pos_ok & self.in_rope(col):
                k = pos * self.half + self.angle(col)
                cs[i] = cos_t[k]
                sn[i] = sin_t[k]
            if cutlass.const_expr(step == 2):
                cs[i + 1] = cs[i]
                sn[i + 1] = sn[i]

    @cute.jit
    def rotate(self, y, cs, sn, c, xbuf, xbase):
        """The forward rotation of ``y`` (the thread's columns, fp32, in place): ``(a, b) -> (a cos - b sin,
        a sin + b cos)``. Partners in the neighbouring lane come by a shuffle, in other threads through ``xbuf``
        at ``xbase`` (the row's columns; every thread of the CTA calls this then)."""
        width = self.width
        if cutlass.const_expr(self.pairs_in_lanes):
            own = y[0]
            first, second = self.rotated(own, cute.arch.shuffle_sync_bfly(own, offset=1), cs[0], sn[0])
            if self.in_rope(c):
                y[0] = select(self.is_first(c), first, second)
        elif cutlass.const_expr(self.pairs_in_thread):
            for j in cutlass.range_constexpr(width // 2):
                a = y[2 * j]
                b = y[2 * j + 1]
                a2 = sub_rn(mul_rn(a, cs[2 * j]), mul_rn(b, sn[2 * j]))
                b2 = add_rn(mul_rn(a, sn[2 * j]), mul_rn(b, cs[2 * j]))
                if self.in_rope(c + 2 * j):
                    y[2 * j] = a2
                    y[2 * j + 1] = b2
        else:
            vec_view(xbuf.iterator, xbase + c, width).store(y.load())
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr(width):
                col = c + i
                first, second = self.rotated(y[i], xbuf[xbase + self.partner(col)], cs[i], sn[i])
                if self.in_rope(col):
                    y[i] = select(self.is_first(col), first, second)

    @staticmethod
    def rotated(own, other, cos, sin) -> tuple:
        """A column's value after its pair's rotation, given its partner's: (as the pair's first, ``a cos - b sin``;
        as its second, ``b sin + a cos``)."""
        return sub_rn(mul_rn(own, cos), mul_rn(other, sin)), add_rn(mul_rn(other, sin), mul_rn(own, cos))

    @cute.jit
    def load_partners(self, gout, row_off, c, ok, gp):
        """grad_out of each column's partner into ``gp`` (fp32; 0 outside the block or where not ``ok``), for the
        backward's turn-back where the pair is split across threads."""
        gp.fill(0.0)
        g_t = cute.make_tensor(gout + row_off, cute.make_layout(self.head_dim))
        for i in cutlass.range_constexpr(self.width):
            col = c + i
            if ok & self.in_rope(col):
                gp[i] = Float32(g_t[self.partner(col)])

    def turn_back(self, g: list, gp, cs, sn, c) -> list:
        """``dy``: grad_out ``g`` (fp32 per column) rotated back, first ``g_a cos + g_b sin``, second
        ``g_b cos - g_a sin`` (the reference's rotation by minus the angle); partners from ``g`` itself where
        pairs are in the thread, else ``gp``."""
        dy = []
        for i in range(self.width):
            col = c + i
            other = g[i ^ 1] if self.pairs_in_thread else gp[i]
            own = g[i]
            if self.pairs_in_thread:
                first = i % 2 == 0
                turned = (add_rn if first else sub_rn)(mul_rn(own, cs[i]), mul_rn(other, sn[i]))
            else:
                first = add_rn(mul_rn(own, cs[i]), mul_rn(other, sn[i]))
                second = sub_rn(mul_rn(own, cs[i]), mul_rn(other, sn[i]))
                turned = select(self.is_first(col), first, second)
            dy.append(select(self.in_rope(col), turned, own))
        return dy
