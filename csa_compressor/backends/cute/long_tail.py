"""The fused tail (RMSNorm, then RoPE) of the long-window forward, whose CTA holds whole rows
(``tail_configs.long_forward_with_tail``).

After the combine a thread holds one column of one row: the CTA's threads are ``ForwardLongConfig.tail_rows`` rows
of ``columns_per_cta`` threads (a power of two); rows past ``rows_per_cta`` hold none (their warps skip the tail where
no CTA barrier waits for them, else they add zeros). The norm and the rotation are ``norm_rope.RowTail``'s with one
column per thread: a row's sum in one fixed order, interleaved partners by a shuffle, half-split ones through shared
memory. Where a row's column chunks are separate CTAs (``tail_configs.chunk_cluster``) and the tail has a norm, they
are one cluster: each chunk's sum of squares goes to every CTA of the cluster through distributed shared memory, and
each adds them in chunk order (a rotation alone needs nothing from the other chunk: no cluster).
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .norm_rope import RowTail, ordered_sum
from .ptx import mul_rn, store_to_cluster_peer
from .window import real_rows, registers


class WholeRowTail:
    """The tail of ``ForwardLongWindow`` with a ``tail``: its shared buffers, operand loads and row epilogue."""

    def __init__(self, config):
        self.config = config
        self.spec = config.tail
        self.columns = config.columns_per_cta
        self.rows = config.tail_rows
        self.chunks = config.column_chunks  # > 1: a row's chunks are adjacent CTAs (chunk-major)
        self.row = RowTail(config.tail, config.head_dim, 1, self.columns, self.rows)
        if self.chunks > 1 and (self.row.exchanges_rows or not config.chunk_major):
            raise ValueError(f"a row's chunks fuse the tail as adjacent CTAs with their pairs in lanes, got {config}")
        # Only the norm needs the whole row: its chunks' sums cross a cluster. A rotation alone stays in each chunk,
        # whose CTAs then launch as plain CTAs.
        self.clustered = self.chunks > 1 and self.spec.has_norm
        # Rows past rows_per_cta hold no row: their warps skip the tail where no CTA barrier needs them (a row's
        # sums wait on its own named barrier; the half-split exchange waits on the whole CTA) and the real rows
        # fill whole warps (a warp's shuffles need all its lanes).
        real_threads = config.rows_per_cta * self.columns
        self.skips_empty_rows = (
            self.rows > config.rows_per_cta and not self.row.exchanges_rows and real_threads % 32 == 0
        )

    def exchange_floats(self) -> int:
        return self.rows * self.columns if self.row.exchanges_rows else 0

    def partial_floats(self) -> int:
        """Each row's chunk sums, one per CTA of the cluster (written by that CTA)."""
        return self.config.rows_per_cta * self.chunks if self.clustered else 0

    def smem_bytes(self) -> int:
        """Row sums across warps, the rotation's exchange rows, the cluster's chunk sums and their mbarrier."""
        buffers = 4 if self.clustered else 2
        return (self.row.sum_floats(1) + self.exchange_floats() + self.partial_floats()) * 4 + buffers * 16

    @cute.jit
    def allocate(self, smem):
        def buffer(floats):
            return smem.allocate_tensor(Float32, cute.make_layout(max(1, floats)), byte_alignment=16)

        shared = SimpleNamespace(sums=buffer(self.row.sum_floats(1)), rows=buffer(self.exchange_floats()))
        if cutlass.const_expr(self.clustered):
            shared.partials = buffer(self.partial_floats())
            shared.arrived = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=16)
        return shared

    @cute.jit
    def column(self, tidx, rblk, chunk, N: Int32):
        """This thread's column of the tail: its lane (row of the CTA), row, column (in the row and in the CTA's
        chunk) and whether it is a real (row, column) of the output."""
        cfg = self.config
        lane = tidx // self.columns
        local = tidx % self.columns
        column = local
        if cutlass.const_expr(self.chunks > 1):
            column = chunk * self.columns + local
        row = rblk * cfg.rows_per_cta + lane
        ok = (lane < cfg.rows_per_cta) & (row < N)
        if cutlass.const_expr(not cfg.columns_exact):
            ok = ok & (column < cfg.head_dim)
        return SimpleNamespace(lane=lane, row=row, column=column, local=local, ok=ok)

    @cute.jit
    def load_operands(self, seg, col, norm_weight, rope_cos, rope_sin, position_start, max_position, N: Int32):
        """The column's norm weight (fp32), and its cos and sin at the row's position (1 and 0 outside the block)."""
        weight, cos, sin = registers(1), registers(1), registers(1)
        if self.holds_row(col):
            if cutlass.const_expr(self.spec.has_norm):
                self.row.load_weight(norm_weight, weight, col.column, col.column < self.config.head_dim)
            if cutlass.const_expr(self.row.has_rope):
                pos = self.row.row_position(seg, col.row, real_rows(seg, N), self.config.ratio, position_start)
                self.row.load_angles(rope_cos, rope_sin, pos, max_position, col.column, cos, sin)
        return weight, cos, sin

    def holds_row(self, col):
        """Whether this thread's warp takes part in the tail (always, unless ``skips_empty_rows``)."""
        if self.skips_empty_rows:
            return col.lane < self.config.rows_per_cta
        return True

    @cute.jit
    def finish(self, x, col, operands, shared, out, rstd, eps, N: Int32, tidx):
        """``x`` (the pooled column, 0 where not ``col.ok``) normalised and rotated, stored as bf16; the row's
        rstd (1 without a norm) where ``rstd`` is given. Every thread of the CTA (and of its cluster) calls this."""
        total = None  # the row's sum of squares, summed in finish_row where the CTA holds the whole row
        if cutlass.const_expr(self.clustered):
            total = Float32(0.0)
            if self.holds_row(col):
                total = self.row.row_sums([mul_rn(x, x)], shared.sums, 0, col.lane, tidx)[0]
            total = self.cluster_total(total, col, shared)
        if self.holds_row(col):
            self.finish_row(x, total, col, operands, shared, out, rstd, eps, N, tidx)

    @cute.jit
    def cluster_total(self, total, col, shared):
        """The row's sum over the cluster's chunks, in chunk order, from this chunk's ``total``: each row's first
        column sends it to every CTA of the cluster, whose mbarrier counts the bytes. Every thread of the cluster
        calls this, after ``start_cluster``."""
        rows, chunks = self.config.rows_per_cta, self.chunks
        lane = cutlass.min(col.lane, Int32(rows - 1))  # the empty lanes read a real row's sums, unused
        cute.arch.cluster_wait()  # every CTA of the cluster runs, its mbarrier initialised
        if (col.local == 0) & (col.lane < rows):
            rank = cute.arch.block_idx_in_cluster()
            for peer in cutlass.range_constexpr(chunks):
                store_to_cluster_peer(shared.partials.iterator + (lane * chunks + rank), shared.arrived.iterator,
                                      peer, total)  # fmt: skip
        if col.local + col.lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(shared.arrived.iterator, rows * chunks * 4)
        cute.arch.mbarrier_wait(shared.arrived.iterator, 0)
        return ordered_sum([shared.partials[lane * chunks + k] for k in range(chunks)])

    @cute.jit
    def start_cluster(self, shared, tidx):
        """The cluster's mbarrier initialised (one arrival: the thread that expects the bytes), then the arrive
        that ``cluster_total``'s wait pairs with, early so that it costs no wait: a CTA sends to a peer only once the
        whole cluster runs and its mbarrier is ready."""
        if cutlass.const_expr(self.clustered):
            if tidx == 0:
                cute.arch.mbarrier_init(shared.arrived.iterator, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

    @cute.jit
    def finish_row(self, x, total, col, operands, shared, out, rstd, eps, N: Int32, tidx):
        weight, cos, sin = operands
        y = registers(1)
        y[0] = x
        row_rstd = Float32(1.0)
        if cutlass.const_expr(self.spec.has_norm):
            if cutlass.const_expr(total is None):
                total = self.row.row_sums([mul_rn(x, x)], shared.sums, 0, col.lane, tidx)[0]
            row_rstd = self.row.rstd(total, eps)
            y[0] = mul_rn(mul_rn(x, row_rstd), weight[0])
        if cutlass.const_expr(self.row.has_rope):
            self.row.rotate(y, cos, sin, col.column, shared.rows, col.lane * self.columns)
        d = self.config.head_dim
        if col.ok:
            cute.make_tensor(out, cute.make_layout(N * d))[col.row * d + col.column] = BFloat16(y[0])
        if col.ok & (col.column == 0) & (rstd.toint() != 0):
            cute.make_tensor(rstd, cute.make_layout(N))[col.row] = row_rstd
