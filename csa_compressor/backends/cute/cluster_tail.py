"""The fused tail (RMSNorm, then RoPE) of the long-window forward, whose rows span several CTAs: a row block's
column chunks are one thread block cluster.

After the combine a thread holds one column of one row (``ForwardLongConfig.tail_rows`` rows of
``columns_per_cta`` threads per CTA; rows past ``rows_per_cta`` hold zeros). A row's sum of squares is the CTAs'
partial sums (each ``RowTail.row_sums``: one fixed order) added in cluster-rank order, every CTA reading all of them
from distributed shared memory, so that every CTA of the row gets the same rstd, run after run. A rotary partner in
another CTA is read from that CTA's shared memory after a cluster barrier; a CTA whose shared memory others read
waits at a last cluster barrier before it exits.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .norm_rope import RowTail, ordered_sum, select
from .ptx import add_rn, load_cluster_f32, mul_rn, sub_rn
from .window import real_rows, registers


class ClusterRowTail:
    """The tail of ``ForwardLongWindow`` with a ``tail``: its shared buffers, operand loads and row epilogue."""

    def __init__(self, config):
        self.config = config
        self.spec = config.tail
        self.columns = config.columns_per_cta
        self.chunks = config.column_chunks
        self.rows = config.tail_rows
        self.row = RowTail(config.tail, config.head_dim, 1, self.columns, self.rows)
        # Whether some rotary partner lives in another CTA (a half-split block wider than a chunk's share).
        self.crosses = self.row.has_rope and any(
            self._partner(col) // self.columns != col // self.columns
            for col in range(self.row.base, config.head_dim)
        )  # fmt: skip
        # Whether a CTA reads another's shared memory: the norm's partial sums or the partners, across CTAs.
        self.remote = self.chunks > 1 and (self.spec.has_norm or self.crosses)

    def _partner(self, col: int) -> int:
        local = col - self.row.base
        if self.spec.rope_interleaved:
            return col + 1 if local % 2 == 0 else col - 1
        return col + self.row.half if local < self.row.half else col - self.row.half

    def smem_bytes(self) -> int:
        """Row sums across warps, the rows' partial sums read by the cluster, the rotation's exchange rows."""
        floats = self.row.sum_floats(1) + self.rows + (self.rows * self.columns if self.row.has_rope else 0)
        return floats * 4 + 3 * 16

    @cute.jit
    def allocate(self, smem):
        def buffer(floats):
            return smem.allocate_tensor(Float32, cute.make_layout(max(1, floats)), byte_alignment=16)

        exchange = self.rows * self.columns if self.row.has_rope else 0
        return SimpleNamespace(sums=buffer(self.row.sum_floats(1)), partials=buffer(self.rows), rows=buffer(exchange))

    @cute.jit
    def column(self, tidx, rblk, chunk, N: Int32):
        """This thread's column of the tail: its lane (row of the CTA), place in the chunk, row, column and whether
        it is a real (row, column) of the output."""
        cfg = self.config
        lane = tidx // self.columns
        index = tidx % self.columns
        row = rblk * cfg.rows_per_cta + lane
        column = chunk * self.columns + index
        ok = (lane < cfg.rows_per_cta) & (row < N)
        if cutlass.const_expr(not cfg.columns_exact):
            ok = ok & (column < cfg.head_dim)
        return SimpleNamespace(lane=lane, index=index, row=row, column=column, ok=ok, chunk=chunk)

    @cute.jit
    def load_operands(self, seg, col, norm_weight, rope_cos, rope_sin, position_start, max_position, N: Int32):
        """The column's norm weight (fp32), and its cos and sin at the row's position (1 and 0 outside the block)."""
        weight, cos, sin = registers(1), registers(1), registers(1)
        if cutlass.const_expr(self.spec.has_norm):
            self.row.load_weight(norm_weight, weight, col.column, col.column < self.config.head_dim)
        if cutlass.const_expr(self.row.has_rope):
            pos = self.row.row_position(seg, col.row, real_rows(seg, N), self.config.ratio, position_start)
            self.row.load_angles(rope_cos, rope_sin, pos, max_position, col.column, cos, sin)
        return weight, cos, sin

    @cute.jit
    def finish(self, x, col, operands, shared, out, rstd, eps, N: Int32, tidx):
        """``x`` (the pooled column, 0 where not ``col.ok``) normalised and rotated, stored as bf16; the row's
        rstd (1 without a norm) where ``rstd`` is given. Every thread of the cluster calls this."""
        weight, cos, sin = operands
        y = x
        row_rstd = Float32(1.0)
        if cutlass.const_expr(self.spec.has_norm):
            local = self.row.row_sums([mul_rn(x, x)], shared.sums, 0, col.lane, tidx)[0]
            row_rstd = self.row.rstd(self.cluster_sum(local, col, shared.partials), eps)
            y = mul_rn(mul_rn(x, row_rstd), weight[0])
        if cutlass.const_expr(self.row.has_rope):
            y = self.rotate(y, col, cos[0], sin[0], shared.rows)
        d = self.config.head_dim
        if col.ok:
            cute.make_tensor(out, cute.make_layout(N * d))[col.row * d + col.column] = BFloat16(y)
        if col.ok & (col.column == 0) & (rstd.toint() != 0):
            cute.make_tensor(rstd, cute.make_layout(N))[col.row] = row_rstd
        if cutlass.const_expr(self.remote):
            # Peers may still read this CTA's shared memory.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def cluster_sum(self, local, col, partials):
        """The row's sum over the cluster's CTAs in rank order (``local``: this CTA's, on every thread of the row)."""
        total = local
        if cutlass.const_expr(self.chunks > 1):
            if col.index == 0:
                partials[col.lane] = local
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            total = ordered_sum([self.remote_load(partials, col.lane, Int32(k)) for k in range(self.chunks)])
        return total

    @cute.jit
    def rotate(self, y, col, cos, sin, rows):
        """The forward rotation of the column, its partner from the row's exchange buffer (this CTA's or, for
        pairs across CTAs, the partner's CTA's)."""
        base = col.lane * self.columns
        rows[base + col.index] = y
        if cutlass.const_expr(self.crosses):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        partner = self.row.partner(col.column)
        other = Float32(0.0)
        if cutlass.const_expr(self.crosses):
            other = self.remote_load(rows, base + partner % self.columns, partner // self.columns)
        else:
            other = rows[base + partner % self.columns]
        first = sub_rn(mul_rn(y, cos), mul_rn(other, sin))
        second = add_rn(mul_rn(other, sin), mul_rn(y, cos))
        result = y
        if self.row.in_rope(col.column):
            result = select(self.row.is_first(col.column), first, second)
        return result

    @cute.jit
    def remote_load(self, buffer, index, rank):
        """``buffer[index]`` of the cluster's CTA ``rank`` (distributed shared memory)."""
        return load_cluster_f32(buffer.iterator + index, rank)
