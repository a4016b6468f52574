"""The forward kernels of the compressor pooling (SPEC section 2): one output row per (row, column chunk).

A CTA is ``rows_per_cta`` rows x ``slot_groups`` groups x ``column_threads`` threads, a thread owning
``vector_width`` contiguous columns of one row. A thread issues all the loads (kv and score) of a batch of its
slots before it uses any of them (ape, L1-resident, after them), so that many bytes are in flight per thread;
window loads are evict-first (read once). Every input element is read exactly once from DRAM. The segment of a
row is found by a binary search over ``cu_seqlens_comp`` on the device (no host sync); padding rows
(``r >= cu_seqlens_comp[-1]``) and rows whose own tokens leave ``[0, T)`` (malformed offsets: the bounds guard of
``window.locate_row``) use ``t0 = 0`` and behave as a segment's first group.

- ``ForwardShortWindow``: a thread holds a row's whole window and follows the fp32 reference's exact operation
  order (libdevice ``expf``, a correctly rounded quotient per element, ``.rn``-pinned products and torch's
  summation order): bitwise equal to the reference.
- ``ForwardLongWindow``: every group folds its batches online (max, sum e, sum e*v, log2 domain) and writes them
  to shared memory; after one barrier one thread per (row, column) combines the groups in a fixed order, writes
  the output and, with ``write_stats``, the softmax statistics ``(N, 3, head_dim)`` fp32 of
  ``reference.softmax_stats`` (log2-domain max, 1 / sum, the fp32 output).
"""

from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32, Int32

from .configs import ForwardLongConfig, ForwardShortConfig
from .long_tail import WholeRowTail
from .norm_rope import RowTail, ordered_sum, select
from .ptx import ex2, mul_rn
from .softmax import exact_probabilities, online_fold, torch_order_sum
from .window import (
    Segments,
    WindowSlots,
    bf16_registers,
    real_rows,
    register_slots,
    registers,
    row_start,
    vec_view,
    widen,
)


@cute.jit
def forward_coordinates(cfg: cutlass.Constexpr, groups: cutlass.Constexpr, chunk_major: cutlass.Constexpr):
    """This thread's index (tidx), column thread (tc), slot group (g), row lane (rl), column chunk, row block
    (rblk), first column (c) and row (r)."""
    tidx, _, _ = cute.arch.thread_idx()
    bx, by, _ = cute.arch.block_idx()
    chunk = by
    rblk = bx
    if cutlass.const_expr(chunk_major):
        chunk = bx % cfg.column_chunks
        rblk = bx // cfg.column_chunks
    tc = tidx % cfg.column_threads
    g = (tidx // cfg.column_threads) % groups
    rl = tidx // (cfg.column_threads * groups)
    c = (chunk * cfg.column_threads + tc) * cfg.vector_width
    r = rblk * cfg.rows_per_cta + rl
    return SimpleNamespace(tidx=tidx, tc=tc, g=g, rl=rl, chunk=chunk, rblk=rblk, c=c, r=r)


def _columns_ok(cfg, c):
    """Whether the thread's columns exist (chunks that tile head_dim need no test)."""
    col_ok = Boolean(True)
    if cutlass.const_expr(not cfg.columns_exact):
        col_ok = c < cfg.head_dim
    return col_ok


class ForwardShortWindow:
    """Short windows of one power-of-two slot group: the exact forward (bitwise the fp32 reference)."""

    kind = "forward"

    def __init__(self, config: ForwardShortConfig):
        self.config = config
        w = config.window
        self.slots = WindowSlots(config.ratio, config.coff, config.head_dim, config.vector_width, w, w, True)
        if config.tail is not None:
            self.tail = RowTail(config.tail, config.head_dim, config.vector_width, config.column_threads,
                                config.rows_per_cta)  # fmt: skip
            # cute.compile traces the instance's __call__: with a tail, the host function that takes its arguments.
            self.__call__ = self.fused_host

    @cute.jit
    def __call__(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                 cu_seqlens_comp: cute.Pointer, out: cute.Pointer, stats: cute.Pointer, segments: Int32,
                 total_comp: Int32, tokens: Int32, stream: cuda.CUstream):  # fmt: skip
        """Host function (arguments: ``build.py``); ``stats`` is not written (short windows save no statistics)."""
        cfg = self.config
        bounds = {}
        if cutlass.const_expr(cfg.ctas_per_sm_cap > 0):
            bounds = dict(min_blocks_per_mp=cfg.ctas_per_sm_cap, preferred_smem_carveout=50)
        self.kernel(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, segments, total_comp, tokens).launch(
            grid=[(total_comp + cfg.rows_per_cta - 1) // cfg.rows_per_cta, cfg.column_chunks, 1],
            block=[cfg.threads, 1, 1],
            smem=0,
            stream=stream,
            **bounds,
        )

    @cute.kernel
    def kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
               cuc: cute.Pointer, out: cute.Pointer, B: Int32, N: Int32, T: Int32):  # fmt: skip
        cfg = self.config
        th = forward_coordinates(cfg, 1, False)
        seg = Segments(cu, cuc, B)
        col_ok = _columns_ok(cfg, th.c)
        active = (th.r < N) & col_ok
        t0, first = row_start(seg, th.r, active, T, N, cfg.ratio)
        self.pool_row(kv, score, ape, out, th.g, th.c, th.r, col_ok, active, t0, first)

    @cute.jit
    def pool_row(self, kv, score, ape, out, g, c, r, col_ok, active, t0, first):
        """The thread's columns of row ``r`` (``pooled``), stored."""
        cfg = self.config
        res = self.pooled(kv, score, ape, g, c, col_ok, active, t0, first)
        if active:
            vec_view(out, r * cfg.head_dim + c, cfg.vector_width).store(res.load().to(BFloat16))

    @cute.jit
    def pooled(self, kv, score, ape, g, c, col_ok, active, t0, first):
        """Loads, softmax and weighted sum of the thread's columns (fp32 registers), in the reference's order:
        p = expf(x - max) / sum, out = sum(p * v) in torch's reduction order (four strided accumulators)."""
        cfg = self.config
        width, slots = cfg.vector_width, cfg.window
        kvb = [bf16_registers(slots, width) for _ in range(2)]
        scb = [bf16_registers(slots, width) for _ in range(2)]
        apf = register_slots(slots, width)
        res = registers(width)
        self.slots.issue(kv, score, kvb[0], scb[0], 0, g, c, active, t0, first)
        self.slots.load_ape(ape, apf, 0, g, c, col_ok)
        kvf, scf = kvb[0], scb[0]
        pq = registers(width * slots)
        exact_probabilities(scf, apf, pq, first, width, slots, cfg.ratio, cfg.coff)
        kvw = [widen(kvf[k], width) for k in range(slots)]
        for i in cutlass.range_constexpr(width):
            pv = [mul_rn(pq[i * slots + k], kvw[k][i]) for k in range(slots)]
            res[i] = torch_order_sum(pv)
        return res

    # ------------------------------------------------------------ the fused tail (RMSNorm, RoPE)

    @cute.jit
    def fused_host(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                   cu_seqlens_comp: cute.Pointer, out: cute.Pointer, stats: cute.Pointer, segments: Int32,
                   total_comp: Int32, tokens: Int32, norm_weight: cute.Pointer, rope_cos: cute.Pointer,
                   rope_sin: cute.Pointer, position_start: cute.Pointer, rstd: cute.Pointer, norm_eps: Float32,
                   max_position: Int32, stream: cuda.CUstream):  # fmt: skip
        """Host function with the tail (arguments: ``build.py``): ``out`` is the rows' rope(rmsnorm(x)); ``rstd``
        (0: none) gets every row's rsqrt(mean(x*x) + eps), 1 without a norm; absent tables and weights are 0."""
        cfg = self.config
        bounds = {}
        if cutlass.const_expr(cfg.ctas_per_sm_cap > 0):
            bounds = dict(min_blocks_per_mp=cfg.ctas_per_sm_cap, preferred_smem_carveout=50)
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, segments, total_comp, tokens)
        tail_args = (norm_weight, rope_cos, rope_sin, position_start, rstd, norm_eps, max_position)
        self.fused_kernel(*args, *tail_args).launch(
            grid=[(total_comp + cfg.rows_per_cta - 1) // cfg.rows_per_cta, 1, 1],
            block=[cfg.threads, 1, 1],
            smem=self.fused_smem_bytes(),
            stream=stream,
            **bounds,
        )

    def fused_smem_bytes(self) -> int:
        """The row sums across warps and, where pairs cross threads, the rotation's exchange buffer."""
        return (self.tail.sum_floats(1) + self.exchange_floats()) * 4 + 64

    def exchange_floats(self) -> int:
        cfg = self.config
        return cfg.rows_per_cta * cfg.columns_per_cta if self.tail.exchanges_rows else 0

    @cute.kernel
    def fused_kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
                     cuc: cute.Pointer, out: cute.Pointer, B: Int32, N: Int32, T: Int32, norm_weight: cute.Pointer,
                     rope_cos: cute.Pointer, rope_sin: cute.Pointer, position_start: cute.Pointer,
                     rstd: cute.Pointer, eps: Float32, max_position: Int32):  # fmt: skip
        cfg = self.config
        tail = self.tail
        th = forward_coordinates(cfg, 1, False)
        seg = Segments(cu, cuc, B)
        col_ok = _columns_ok(cfg, th.c)
        active = (th.r < N) & col_ok
        t0, first = row_start(seg, th.r, active, T, N, cfg.ratio)
        smem = cutlass.memory.SmemAllocator()
        sums = smem.allocate_tensor(Float32, cute.make_layout(max(1, tail.sum_floats(1))), byte_alignment=16)
        xbuf = smem.allocate_tensor(Float32, cute.make_layout(max(1, self.exchange_floats())), byte_alignment=16)
        # The tail's loads (L1/L2 hits) are issued before the pooling's math waits on the window.
        wf, cs, sn = registers(cfg.vector_width), registers(cfg.vector_width), registers(cfg.vector_width)
        if cutlass.const_expr(tail.spec.has_norm):
            tail.load_weight(norm_weight, wf, th.c, col_ok)
        if cutlass.const_expr(tail.has_rope):
            pos = tail.row_position(seg, th.r, real_rows(seg, N), cfg.ratio, position_start)
            tail.load_angles(rope_cos, rope_sin, pos, max_position, th.c, cs, sn)
        y = self.pooled(kv, score, ape, th.g, th.c, col_ok, active, t0, first)
        row_rstd = self.normalise(y, wf, col_ok, eps, sums, th)
        if cutlass.const_expr(tail.has_rope):
            tail.rotate(y, cs, sn, th.c, xbuf, th.rl * cfg.columns_per_cta)
        if active:
            vec_view(out, th.r * cfg.head_dim + th.c, cfg.vector_width).store(y.load().to(BFloat16))
        if (th.tc == 0) & (th.r < N) & (rstd.toint() != 0):
            cute.make_tensor(rstd, cute.make_layout(N))[th.r] = row_rstd

    @cute.jit
    def normalise(self, y, wf, col_ok, eps, sums, th):
        """RMSNorm of the row in place (``y`` the thread's pooled columns, 0 past head_dim first); its rstd (1
        without a norm)."""
        width = self.config.vector_width
        row_rstd = Float32(1.0)
        for i in cutlass.range_constexpr(width):
            y[i] = select(col_ok, y[i], Float32(0.0))
        if cutlass.const_expr(self.tail.spec.has_norm):
            part = ordered_sum([mul_rn(y[i], y[i]) for i in range(width)])
            total = self.tail.row_sums([part], sums, 0, th.rl, th.tidx)[0]
            row_rstd = self.tail.rstd(total, eps)
            for i in cutlass.range_constexpr(width):
                y[i] = mul_rn(mul_rn(y[i], row_rstd), wf[i])
        return row_rstd


class ForwardLongWindow:
    """Slot groups with an online fold and a fixed-order combine through shared memory."""

    kind = "forward"

    def __init__(self, config: ForwardLongConfig):
        self.config = config
        c = config
        self.slots = WindowSlots(c.ratio, c.coff, c.head_dim, c.vector_width, c.slots_per_batch,
                                 c.slots_per_batch * c.batches, True)  # fmt: skip
        if config.tail is not None:
            self.tail = WholeRowTail(config)
            self.__call__ = self.fused_host

    @cute.jit
    def __call__(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                 cu_seqlens_comp: cute.Pointer, out: cute.Pointer, stats: cute.Pointer, segments: Int32,
                 total_comp: Int32, tokens: Int32, stream: cuda.CUstream):  # fmt: skip
        """Host function (arguments: ``build.py``); ``stats`` is written with ``write_stats`` only."""
        cfg = self.config
        rows = (total_comp + cfg.rows_per_cta - 1) // cfg.rows_per_cta
        grid = [rows, cfg.column_chunks, 1]
        if cutlass.const_expr(cfg.chunk_major):
            grid = [rows * cfg.column_chunks, 1, 1]
        launch = dict(grid=grid, block=[cfg.threads, 1, 1], smem=cfg.smem_bytes, stream=stream, **self.bounds())
        if cutlass.const_expr(cfg.write_stats):
            args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, segments, total_comp, tokens)
            self.kernel_with_stats(*args).launch(**launch)
        else:
            args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, segments, total_comp, tokens)
            self.kernel(*args).launch(**launch)

    def bounds(self) -> dict:
        """Launch bounds: the config's CTAs per SM (by default as many as MAX_REGISTERS per thread allow), with a
        carveout hint so that the DSL does not query the device at compile time."""
        return dict(min_blocks_per_mp=self.config.launch_ctas_per_sm, preferred_smem_carveout=50)

    @cute.kernel
    def kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
               cuc: cute.Pointer, out: cute.Pointer, B: Int32, N: Int32, T: Int32):  # fmt: skip
        self.body(kv, score, ape, cu, cuc, out, out, B, N, T)

    @cute.kernel
    def kernel_with_stats(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
                          cuc: cute.Pointer, out: cute.Pointer, stats: cute.Pointer, B: Int32, N: Int32,
                          T: Int32):  # fmt: skip
        self.body(kv, score, ape, cu, cuc, out, stats, B, N, T)

    @cute.jit
    def body(self, kv, score, ape, cu, cuc, out, stats, B: Int32, N: Int32, T: Int32):
        cfg = self.config
        if cutlass.const_expr(cfg.signals_dependents):
            cute.arch.griddepcontrol_launch_dependents()
        win = self.open_window(kv, score, cu, cuc, B, N, T)
        self.fold_to_shared(kv, score, ape, win)
        self.combine(win.parts, out, stats, win.th.tidx, win.th.rblk, win.th.chunk, N)

    @cute.jit
    def open_window(self, kv, score, cu, cuc, B: Int32, N: Int32, T: Int32):
        """The thread's coordinates and row, the first batch's loads issued, and the combine's shared buffers
        (max, sum e, sum e*v per row lane, group and column)."""
        cfg = self.config
        th = forward_coordinates(cfg, cfg.slot_groups, cfg.chunk_major)
        seg = Segments(cu, cuc, B)
        col_ok = _columns_ok(cfg, th.c)
        active = (th.r < N) & col_ok
        t0, first = row_start(seg, th.r, active, T, N, cfg.ratio)
        buffers = self.start_window(kv, score, th.g, th.c, active, t0, first)
        smem = cutlass.memory.SmemAllocator()
        parts = [
            smem.allocate_tensor(Float32, cute.make_layout(cfg.rows_per_cta * self.smem_row), byte_alignment=16)
            for _ in range(3)
        ]
        return SimpleNamespace(th=th, seg=seg, col_ok=col_ok, active=active, t0=t0, first=first, buffers=buffers,
                               smem=smem, parts=parts)  # fmt: skip

    @cute.jit
    def fold_to_shared(self, kv, score, ape, win):
        """The group's fold of its batches, stored into the combine buffers; then one barrier."""
        cfg = self.config
        th = win.th
        vm, vl, va = self.fold_window(kv, score, ape, win.buffers, th.g, th.c, win.col_ok, win.active, win.t0,
                                      win.first)  # fmt: skip
        base = th.rl * self.smem_row + th.g * cfg.columns_per_cta + th.tc * cfg.vector_width
        for part, value in zip(win.parts, (vm, vl, va), strict=True):
            vec_view(part.iterator, base, cfg.vector_width).store(value.load())
        cute.arch.sync_threads()

    @property
    def smem_row(self) -> int:
        """Floats of one combine buffer per row lane: a column's value per slot group."""
        return self.config.slot_groups * self.config.columns_per_cta

    @cute.jit
    def start_window(self, kv, score, g, c, active, t0, first):
        """Two register buffers of one batch (batch i + 1 is in flight while batch i is folded) and the loads of
        the first batch."""
        cfg = self.config
        width, batch = cfg.vector_width, cfg.slots_per_batch
        kvb = [bf16_registers(batch, width) for _ in range(2)]
        scb = [bf16_registers(batch, width) for _ in range(2)]
        apf = register_slots(batch, width)
        va = registers(width)
        self.slots.issue(kv, score, kvb[0], scb[0], 0, g, c, active, t0, first)
        return kvb, scb, apf, va

    @cute.jit
    def fold_window(self, kv, score, ape, buffers, g, c, col_ok, active, t0, first):
        """The group's (max, sum e, sum e*v) per column over its batches, the next batch's loads issued first."""
        cfg = self.config
        kvb, scb, apf, va = buffers
        vm = registers(cfg.vector_width)
        vl = registers(cfg.vector_width)
        for bi in cutlass.range_constexpr(cfg.batches):
            if cutlass.const_expr(bi + 1 < cfg.batches):
                self.slots.issue(kv, score, kvb[(bi + 1) % 2], scb[(bi + 1) % 2], bi + 1, g, c, active, t0, first)
            self.slots.load_ape(ape, apf, bi, g, c, col_ok)
            online_fold(kvb[bi % 2], scb[bi % 2], apf, vm, vl, va, bi, cfg.vector_width, cfg.slots_per_batch)
        return vm, vl, va

    @cute.jit
    def combine(self, parts, out, stats, tidx, rblk, chunk, N):
        """Column-parallel combine: one thread per (row lane, column), groups in a fixed order."""
        cfg = self.config
        cw, d = cfg.columns_per_cta, cfg.head_dim
        for q in cutlass.range(tidx, cfg.rows_per_cta * cw, cfg.threads):
            rq = q // cw
            cq = q % cw
            row = rblk * cfg.rows_per_cta + rq
            col = chunk * cw + cq
            ok = row < N
            if cutlass.const_expr(not cfg.columns_exact):
                ok = ok & (col < d)
            if ok:
                mx, total, res_q = self.combine_column(parts, rq * self.smem_row + cq)
                out_t = cute.make_tensor(out, cute.make_layout(N * d))
                out_t[row * d + col] = BFloat16(res_q)
                if cutlass.const_expr(cfg.write_stats):
                    write_stats(stats, row, col, d, N, mx, total, res_q)

    @cute.jit
    def combine_column(self, parts, qb):
        """One column's groups (at ``qb`` of the shared buffers) in a fixed order: (max, sum e, output)."""
        cfg = self.config
        sm_m, sm_l, sm_a = parts
        cw, groups = cfg.columns_per_cta, cfg.slot_groups
        mx = sm_m[qb]
        for h in cutlass.range_constexpr(1, groups):
            mx = cute.arch.fmax(mx, sm_m[qb + h * cw], nan=True)
        total = Float32(0.0)
        acc = Float32(0.0)
        for h in cutlass.range_constexpr(groups):
            scale = ex2(sm_m[qb + h * cw] - mx)
            total = total + sm_l[qb + h * cw] * scale
            acc = acc + sm_a[qb + h * cw] * scale
        return mx, total, acc / total

    # ------------------------------------------------------------ the fused tail (RMSNorm, RoPE)

    @cute.jit
    def fused_host(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                   cu_seqlens_comp: cute.Pointer, out: cute.Pointer, stats: cute.Pointer, segments: Int32,
                   total_comp: Int32, tokens: Int32, norm_weight: cute.Pointer, rope_cos: cute.Pointer,
                   rope_sin: cute.Pointer, position_start: cute.Pointer, rstd: cute.Pointer, norm_eps: Float32,
                   max_position: Int32, stream: cuda.CUstream):  # fmt: skip
        """Host function with the tail (arguments: ``build.py``): whole rows per CTA; ``stats`` (0: none) and
        ``rstd`` (0: none) are written where given."""
        cfg = self.config
        blocks = (total_comp + cfg.rows_per_cta - 1) // cfg.rows_per_cta * cfg.column_chunks
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, segments, total_comp, tokens)
        tail_args = (norm_weight, rope_cos, rope_sin, position_start, rstd, norm_eps, max_position)
        launch = dict(grid=[blocks, 1, 1], block=[cfg.threads, 1, 1], smem=cfg.smem_bytes + self.tail.smem_bytes(),
                      stream=stream, **self.bounds())  # fmt: skip
        if cutlass.const_expr(self.tail.clustered):
            launch["cluster"] = [cfg.column_chunks, 1, 1]
        self.fused_kernel(*args, *tail_args).launch(**launch)

    @cute.kernel
    def fused_kernel(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu: cute.Pointer,
                     cuc: cute.Pointer, out: cute.Pointer, stats: cute.Pointer, B: Int32, N: Int32, T: Int32,
                     norm_weight: cute.Pointer, rope_cos: cute.Pointer, rope_sin: cute.Pointer,
                     position_start: cute.Pointer, rstd: cute.Pointer, eps: Float32, max_position: Int32):  # fmt: skip
        cfg = self.config
        tail = self.tail
        win = self.open_window(kv, score, cu, cuc, B, N, T)
        shared = tail.allocate(win.smem)
        tail.start_cluster(shared, win.th.tidx)
        col = tail.column(win.th.tidx, win.th.rblk, win.th.chunk, N)
        # The tail's operands (L2 hits) are in flight while the window arrives (one batch per group).
        tables = (norm_weight, rope_cos, rope_sin, position_start, max_position)
        operands = tail.load_operands(win.seg, col, *tables, N)
        self.fold_to_shared(kv, score, ape, win)
        x = Float32(0.0)
        if col.ok:
            mx, total, x = self.combine_column(win.parts, col.lane * self.smem_row + col.local)
            if stats.toint() != 0:
                write_stats(stats, col.row, col.column, cfg.head_dim, N, mx, total, x)
        tail.finish(x, col, operands, shared, out, rstd, eps, N, win.th.tidx)


@cute.jit
def write_stats(stats, row, col, d: cutlass.Constexpr, N: Int32, mx, total, res):
    """One column's softmax statistics (``reference.softmax_stats``): log2-domain max, 1 / sum, the output."""
    st_t = cute.make_tensor(stats, cute.make_layout(N * 3 * d))
    st_t[row * 3 * d + col] = mx
    st_t[row * 3 * d + d + col] = Float32(1.0) / total
    st_t[row * 3 * d + 2 * d + col] = res
