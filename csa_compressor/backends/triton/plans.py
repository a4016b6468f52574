"""Launch plans: everything about one configuration's launches that does not depend on the problem, built once.

A plan holds the bound kernels of one direction (``binding.BoundKernel``: constexprs and launch options fixed)
and, per problem size seen, the grid and runtime integers. A call then reads three sizes from the tensors,
finds (or computes once) their launch sizes, and enqueues; the backward's dAPE partials come from a buffer per
(device, stream) (``_Partials``), fresh under CUDA-graph capture. Nothing here reads device memory on the host.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .binding import BoundKernel
from .config import (
    STATS_TAIL_RESIDENT,
    TAIL_DX_ELEMENTS,
    TAIL_FWD_ELEMENTS,
    TAIL_ROW_BLOCK,
    KernelConfig,
    StatsTile,
    cdiv,
    is_long,
    long_rows,
    long_shape,
    pow2,
    rows_per_prog,
    search_iters,
    stats_rows,
    stats_sweep_d,
    torch_order,
)

__all__ = ["NO_TAIL", "BackwardPlan", "ForwardPlan", "TailForwardPlan", "release_partials", "tail_consts"]

_MAX_SIZES = 4096  # problem sizes remembered per plan (a training loop sees few; a sweep is bounded by this)

# The tail's runtime arguments of the window kernels, (norm_weight, rope_cos, rope_sin, max_position,
# position_start, rstd, norm_eps): all None without a tail, so that the kernels compile to the pooling alone.
NO_TAIL = (None,) * 7


def tail_consts(tail_config) -> dict:
    """The tail's constexprs of a window kernel (none without a tail: the kernels' defaults are the pooling)."""
    if tail_config is None:
        return {}
    return dict(
        HAS_NORM=tail_config.norm_dtype is not None,
        ROPE_DIM=tail_config.rope_dim,
        ROPE_INTERLEAVED=tail_config.rope_interleaved,
    )


def _workspace(shape, device) -> torch.Tensor:
    """The dAPE and norm-weight partials (every entry is written by the backward kernel; tests fill it with NaN to
    check that)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _on_stream(stream, make):
    """``make()`` with ``stream`` current (None: the current stream), for allocations used on it."""
    if stream is None:
        return make()
    with torch.cuda.stream(stream):
        return make()


# The CUDA runtime's queries in C, without torch.cuda's Python wrappers (a plan with a device index exists only once
# CUDA is initialised; a CPU build has none of them and no such plan).
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_NO_LOCK = contextlib.nullcontext()


class _Partials:
    """The backward's dAPE partials for one (device, stream), reused by every eager backward on that stream.

    Launches on one stream run in order, and the partials are dead once the reduction (a call's last launch) has
    read them, so the next call may overwrite them: a call then allocates nothing of its own. ``lock`` is held
    across a call's launches, so that another thread's launches on the stream never land between them.
    """

    __slots__ = ("_views", "lock", "numel", "tensor")

    def __init__(self, tensor, lock):
        self.tensor, self.numel, self.lock = tensor, tensor.numel(), lock
        self._views: dict[int, torch.Tensor] = {}

    def after(self, offset: int) -> torch.Tensor:
        """The partials from float ``offset`` on (the norm weight's), a view kept per offset: slicing costs about
        what an allocation does."""
        view = self._views.get(offset)
        if view is None:
            if len(self._views) >= _MAX_SIZES:
                self._views.clear()
            view = self._views[offset] = self.tensor[offset:]
        return view


_PARTIALS: dict[tuple[int, int], _Partials] = {}  # (device index, stream handle) -> _Partials
_PARTIALS_LOCK = threading.Lock()


def _grown(key: tuple[int, int], stream, numel: int, device) -> _Partials:
    """The entry of ``key`` with at least ``numel`` floats, allocated on ``stream`` (the caching allocator then
    hands the block to no other stream before the stream's queued work has run)."""
    with _PARTIALS_LOCK:
        old = _PARTIALS.get(key)
        if old is not None and old.numel >= numel:
            return old
        numel = max(numel, old.numel if old is not None else 0)
        # A launch still holding the old entry's lock orders against this one.
        lock = old.lock if old is not None else threading.Lock()
        entry = _PARTIALS[key] = _Partials(_on_stream(stream, lambda: _workspace((numel,), device)), lock)
        return entry


def release_partials() -> None:
    """Drop the backward's per-stream partials (their memory goes back to the caching allocator)."""
    with _PARTIALS_LOCK:
        _PARTIALS.clear()


def _capturing(stream) -> bool:
    if stream is None:
        return _IS_CAPTURING()
    with torch.cuda.stream(stream):
        return _IS_CAPTURING()


class _Plan:
    """Shared by both directions: the device, and the per-problem sizes cache."""

    def __init__(self, device: torch.device, interpret: bool, with_stats: bool):
        self.device, self.with_stats = device, with_stats
        # The CUDA device the kernels are bound on; None under the interpreter (nothing to make current).
        self.index = None if interpret or device.type != "cuda" else device.index
        self._sizes: dict[tuple, tuple] = {}

    def _remember(self, key: tuple, sizes: tuple) -> tuple:
        if len(self._sizes) >= _MAX_SIZES:
            self._sizes.clear()
        self._sizes[key] = sizes
        return sizes

    def _elsewhere(self) -> bool:
        """Whether the plan's device is not the current one (its kernels must launch with it current)."""
        return self.index is not None and _GET_DEVICE() != self.index


class ForwardPlan(_Plan):
    """The forward of one configuration: ``csa_fwd_kernel`` (short windows; with a ``tail`` in whole-row programs)
    or ``csa_fwd_long_kernel`` (long windows, no tail: ``TailForwardPlan`` composes theirs; ``with_stats``: it also
    writes the softmax statistics)."""

    def __init__(self, kernel, ratio, coff, head_dim, cfg: KernelConfig, with_stats, device, interpret, tail=None):
        super().__init__(device, interpret, with_stats)
        self.cfg, self.n_col, self.long = cfg, cdiv(head_dim, cfg.block_d), is_long(ratio, coff)
        if tail is not None and self.long:
            raise ValueError("the long-window forward with a tail is TailForwardPlan's (statistics, then epilogue)")
        if tail is not None and self.n_col != 1:
            raise ValueError(f"the tail needs whole rows per program: block_d={cfg.block_d} < head_dim={head_dim}")
        consts = dict(
            RATIO=ratio, COFF=coff, HEAD_DIM=head_dim, BLOCK_D=cfg.block_d, VEC=cfg.vec, N_COL=self.n_col,
            MANUAL_RTNE=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **tail_consts(tail),
        )  # fmt: skip
        if self.long:
            lanes, cs_in = long_shape("forward", cfg, ratio, coff)
            nch_half = cdiv(ratio, lanes * cs_in)
            depth = 2 if cfg.prefetch_depth == 2 and coff * nch_half >= 2 else 1
            consts.update(LANES=lanes, CS_IN=cs_in, NCH_HALF=nch_half, WRITE_STATS=with_stats, DEPTH=depth)
            self.kernel = BoundKernel(kernel, consts, self.index)
        else:
            # A tail's contract is one bf16 ulp, not the pooling's bitwise order: its multi-warp programs take ex2
            # and fused multiply-adds, faster there; its one-warp programs keep the exact form, faster there.
            fast = tail is not None and cfg.num_warps > 1
            if tail is not None:
                consts.update(TABLES_FIRST=cfg.num_warps == 1)  # the kernel's docstring says why
            consts.update(
                SP=pow2(ratio), BLOCK_R=cfg.block_r, PRECISE_EXP=cfg.precise_exp and not interpret and not fast,
                TORCH_ORDER=torch_order(cfg, ratio, coff) and not fast,
                # The reference rounds every product before adding: no fused multiply-adds.
                enable_fp_fusion=fast,
            )  # fmt: skip
            self.kernel = BoundKernel(kernel, consts, self.index)
        self.k = coff * pow2(ratio)

    def _size(self, n_rows: int, num_segments: int) -> tuple:
        """(programs, search halvings, rows or row tiles per program) of an ``n_rows`` problem."""
        cfg = self.cfg
        if self.long:
            per_prog = cfg.rows_per_prog if cfg.rows_per_prog > 0 else 1
            programs = cdiv(n_rows, per_prog)
        else:
            # Forward row counts never need the SM count (only the backward's one-wave sizing does).
            per_prog = max(1, rows_per_prog(cfg, "forward", n_rows, self.n_col, self.k, 0) // cfg.block_r)
            programs = cdiv(cdiv(n_rows, cfg.block_r), per_prog)
        return self._remember((n_rows, num_segments), (programs * self.n_col, search_iters(num_segments), per_prog))

    def __call__(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats, tail=NO_TAIL) -> None:
        """``tail``: the tail's runtime arguments (``NO_TAIL``'s order), or ``NO_TAIL``."""
        if self._elsewhere():
            with torch.cuda.device(self.index):
                return self(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats, tail)
        n_rows, num_segments = out.shape[0], cu_seqlens.shape[0] - 1
        grid, n_iter, per_prog = self._sizes.get((n_rows, num_segments)) or self._size(n_rows, num_segments)
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out, n_rows, kv.shape[0], num_segments, n_iter, per_prog)
        if self.long:
            self.kernel.launch(grid, stream, *args, stats)
        else:
            self.kernel.launch(grid, stream, *args, *tail)


class TailForwardPlan(_Plan):
    """The long-window forward with a tail: the pooling's statistics forward (``pooling``, a ``ForwardPlan`` with
    statistics and no tail, at its own column-chunked tiles) into the caller's statistics or a workspace, then
    ``csa_tail_fwd_kernel`` over whole rows from ``stats[:, 2]``. Whole-row window programs would hold ``head_dim``
    columns of a long window each; the epilogue adds one read of the pooled rows instead."""

    def __init__(self, tail_mod, pooling: ForwardPlan, ratio, head_dim, tail, interpret):
        # The statistics are written (the caller's buffer, or a workspace).
        super().__init__(pooling.device, interpret, with_stats=True)
        self.pooling, self.head_dim = pooling, head_dim
        block_d = pow2(head_dim)
        self.block_r = max(1, min(64, TAIL_FWD_ELEMENTS // block_d))
        consts = dict(
            RATIO=ratio, HEAD_DIM=head_dim, BLOCK_R=self.block_r, BLOCK_D=block_d, MANUAL_RTNE=interpret,
            num_warps=4, **tail_consts(tail),
        )  # fmt: skip
        self.epilogue = BoundKernel(tail_mod.csa_tail_fwd_kernel, consts, pooling.index)

    def _stats(self, n_rows: int) -> torch.Tensor:
        return _workspace((n_rows, 3, self.head_dim), self.device)

    def _size(self, n_rows: int, num_segments: int) -> tuple:
        """(epilogue programs, search halvings) of an ``n_rows`` problem."""
        return self._remember((n_rows, num_segments), (cdiv(n_rows, self.block_r), search_iters(num_segments)))

    def __call__(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats, tail=NO_TAIL) -> None:
        """``stats``: the caller's ``(N, 3, d)`` buffer, or None (a workspace on ``stream``)."""
        if self._elsewhere():
            with torch.cuda.device(self.index):
                return self(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats, tail)
        n_rows, num_segments = out.shape[0], cu_seqlens.shape[0] - 1
        if stats is None:
            stats = _on_stream(stream, lambda: self._stats(n_rows))
        self.pooling(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats)
        grid, n_iter = self._sizes.get((n_rows, num_segments)) or self._size(n_rows, num_segments)
        offsets = (cu_seqlens, cu_seqlens_comp, n_rows, kv.shape[0], num_segments, n_iter)
        self.epilogue.launch(grid, stream, stats, out, *offsets, *tail)


class BackwardPlan(_Plan):
    """The backward of one configuration: the window kernel (short, long, or with statistics: ``csa_bwd_kernel``,
    ``csa_bwd_long_kernel``, ``csa_bwd_stats_kernel``; each with its zero-sweep programs), then the dAPE
    reduction of its partials (``dape_reduce_kernel``; with a norm ``tail_reduce_kernel``, which also sums the
    norm weight's partials).

    ``tail``: the ``TailConfig`` the kernels are specialised on, or None. ``stats_forward``: a statistics forward
    plan, for long windows with a tail called without statistics: the norm needs whole rows of pooled values, which
    only the statistics pair provides, so such a call first recomputes the statistics into a workspace.

    The statistics backward with a tail has two routes (``backward_tail``): grids of at most
    ``in_program_programs`` compute programs reduce the norm's row sums in every program; larger ones launch
    ``csa_tail_dx_kernel`` first and run the statistics kernel without a tail on its ``dx``."""

    def __init__(
        self, bwd_mod, ratio, coff, head_dim, cfg, tile: StatsTile, with_stats, device, interpret, sm_count,
        tail=None, stats_forward: ForwardPlan | None = None,
    ):  # fmt: skip
        super().__init__(device, interpret, with_stats)
        self.cfg, self.tile, self.sm_count, self.stats_forward = cfg, tile, sm_count, stats_forward
        self.ratio, self.coff, self.head_dim, self.width = ratio, coff, head_dim, coff * head_dim
        self.has_norm = tail is not None and tail.norm_dtype is not None
        stats = with_stats or stats_forward is not None
        self.family = "stats" if stats else "long" if is_long(ratio, coff) else "short"
        if tail is not None and self.family == "long":
            raise ValueError("the tail's long-window backward runs from statistics: pass stats_forward")
        self.k = coff * pow2(ratio)
        self.n_col = cdiv(head_dim, tile.block_d if stats else cfg.block_d)
        if tail is not None and self.family == "short" and self.n_col != 1:
            raise ValueError(f"the tail needs whole rows per program: block_d={cfg.block_d} < head_dim={head_dim}")
        kernel, consts = self._window_kernel(bwd_mod, interpret, tail)
        self.kernel = BoundKernel(kernel, consts, self.index)
        self.tail, self.dx_kernel, self.in_program_programs = tail, None, 0
        if tail is not None and self.family == "stats":
            self._bind_dx_route(bwd_mod, interpret)
        self._bind_reduction(bwd_mod)

    def _bind_dx_route(self, bwd_mod, interpret) -> None:
        """The statistics backward's second route: ``csa_tail_dx_kernel``, then the statistics kernel on its fp32
        ``dx`` (no tail constexprs: the pooling's own kernel)."""
        _kernel, consts = self._window_kernel(bwd_mod, interpret, None)
        self.from_dx = BoundKernel(bwd_mod.csa_bwd_stats_kernel, consts, self.index)
        block_d = pow2(self.head_dim)
        self.dx_rows = max(1, min(64, TAIL_DX_ELEMENTS // block_d))
        dx_consts = dict(
            RATIO=self.ratio, HEAD_DIM=self.head_dim, BLOCK_R=self.dx_rows, BLOCK_D=block_d, num_warps=4,
            **tail_consts(self.tail),
        )  # fmt: skip
        self.dx_kernel = BoundKernel(bwd_mod.csa_tail_dx_kernel, dx_consts, self.index)
        # The in-program route's programs (4 warps, about 250 registers) fit STATS_TAIL_RESIDENT per SM.
        self.in_program_programs = self.sm_count * STATS_TAIL_RESIDENT

    def _window_kernel(self, bwd_mod, interpret, tail):
        """The window kernel of this family and its constexprs."""
        cfg, tile, ratio, coff, head_dim = self.cfg, self.tile, self.ratio, self.coff, self.head_dim
        block_d = tile.block_d if self.family == "stats" else cfg.block_d
        consts = dict(
            RATIO=ratio, COFF=coff, HEAD_DIM=head_dim, BLOCK_D=block_d, N_COL=self.n_col, SWEEP_T=cfg.sweep_t,
            MANUAL_RTNE=interpret, num_stages=cfg.num_stages, **tail_consts(tail),
        )  # fmt: skip
        if self.family == "stats":
            self.n_chunk = cdiv(coff * ratio, tile.slots)
            consts.update(
                SLOTS=tile.slots, VEC=max(1, min(8, tile.block_d)), N_CHUNK=self.n_chunk,
                SWEEP_D=stats_sweep_d(tile, cfg), num_warps=tile.num_warps, num_stages=1,
            )  # fmt: skip
            if self.has_norm:
                consts.update(ROW_BLOCK=min(pow2(head_dim), TAIL_ROW_BLOCK))
            return bwd_mod.csa_bwd_stats_kernel, consts
        consts.update(SP=pow2(ratio), VEC=cfg.vec, SWEEP_D=cfg.sweep_d, num_warps=cfg.num_warps)
        if self.family == "long":
            lanes, cs_in = long_shape("backward", cfg, ratio, coff)
            consts.update(LANES=lanes, CS_IN=cs_in)
            return bwd_mod.csa_bwd_long_kernel, consts
        consts.update(
            BLOCK_R=cfg.block_r, PRECISE_EXP=cfg.precise_exp and not interpret,
            TORCH_ORDER=torch_order(cfg, ratio, coff), enable_fp_fusion=False,
        )  # fmt: skip
        return bwd_mod.csa_bwd_kernel, consts

    def _bind_reduction(self, bwd_mod) -> None:
        # [dape_chunk partials, dape_block entries] per step: a short dependent chain and many programs. Neither
        # constexpr depends on the problem size: compile() warms up on a tiny problem (capture safety).
        cfg = self.cfg
        size = self.ratio * self.width
        block = min(cfg.dape_block, pow2(size))
        dape = dict(SIZE=size, BLOCK=block, CHUNK=cfg.dape_chunk, num_warps=4, enable_fp_fusion=False)
        self.dape_grid = cdiv(size, block)
        if self.has_norm:
            w_block = min(cfg.dape_block, pow2(self.head_dim))
            dape.update(W_SIZE=self.head_dim, W_BLOCK=w_block)
            self.dape = BoundKernel(bwd_mod.tail_reduce_kernel, dape, self.index)
            self.dape_grid += cdiv(self.head_dim, w_block)
        else:
            self.dape = BoundKernel(bwd_mod.dape_reduce_kernel, dape, self.index)

    def _recomputed(self, n_rows: int, dtype) -> tuple:
        """Buffers of the statistics forward a long-window tail backward runs first: statistics, and its output."""
        stats = torch.empty((n_rows, 3, self.head_dim), dtype=torch.float32, device=self.device)
        return stats, torch.empty((n_rows, self.head_dim), dtype=dtype, device=self.device)

    def _size(self, n_rows: int, tokens: int, num_segments: int) -> tuple:
        """(programs, the window kernel's arguments after its tensors without a tail, dAPE partials, the partials'
        floats, the window kernel's runtime integers, where the norm weight's partials start among those floats, dx
        programs: 0 unless the statistics backward with a tail takes the dx route)."""
        cfg = self.cfg
        if self.family == "stats":
            per_prog = stats_rows(self.tile, self.ratio, self.coff, self.head_dim, n_rows)
            parts = cdiv(n_rows, per_prog)
            compute = parts * self.n_chunk * self.n_col
        elif self.family == "long":
            per_prog = long_rows(cfg, "backward", n_rows, self.n_col, self.sm_count, self.k)
            parts = cdiv(n_rows, per_prog)
            compute = parts * self.n_col
        else:
            rows = rows_per_prog(cfg, "backward", n_rows, self.n_col, self.k, self.sm_count)
            per_prog = max(1, rows // cfg.block_r)
            parts = cdiv(cdiv(n_rows, cfg.block_r), per_prog)
            compute = parts * self.n_col
        # Compute programs first, then the zero-sweep programs.
        grid = compute + cdiv(tokens, cfg.sweep_t)
        dx_programs = cdiv(n_rows, self.dx_rows) if self.dx_kernel and compute > self.in_program_programs else 0
        ints = (n_rows, tokens, num_segments, search_iters(num_segments), per_prog, compute)
        # The window kernel's arguments after its tensors on the path without a tail, composed once.
        rest = ints if self.family == "long" else (*ints, *NO_TAIL, None)
        numel = norm_at = parts * self.ratio * self.width
        if self.has_norm:
            # The norm's partials follow the dAPE partials in the same buffer (one allocation, or none: the
            # stream's), 16-byte aligned as a buffer of their own would be (the kernels specialise on it).
            norm_at = cdiv(numel, 4) * 4
            numel = norm_at + (dx_programs or parts) * self.head_dim
        sizes = (grid, rest, parts, numel, ints, norm_at, dx_programs)
        return self._remember((n_rows, tokens, num_segments), sizes)

    def _partials(self, stream, numel: int) -> _Partials:
        """The call's partials (``tensor``, and the ``lock`` its launches hold): on a GPU the stream's reusable
        ``_Partials``; under CUDA-graph capture (from the graph's pool) and on the CPU (the interpreter's tests fill
        them with NaN) partials of the call's own."""
        index = self.index
        if index is not None and not _capturing(stream):
            key = (index, _RAW_STREAM(index) if stream is None else stream.cuda_stream)
            entry = _PARTIALS.get(key)
            if entry is None or entry.numel < numel:
                entry = _grown(key, stream, numel, self.device)
            return entry
        return _Partials(_on_stream(stream, lambda: _workspace((numel,), self.device)), _NO_LOCK)

    def __call__(
        self, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream, stats,
        tail=NO_TAIL, grad_norm_weight=None,
    ):  # fmt: skip
        """``tail``: the tail's runtime arguments (``NO_TAIL``'s order); ``grad_norm_weight`` (with a norm) the
        ``(head_dim,)`` fp32 buffer its gradient is written to."""
        if self._elsewhere():
            with torch.cuda.device(self.index):
                return self(
                    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream,
                    stats, tail, grad_norm_weight,
                )  # fmt: skip
        key = (grad_out.shape[0], kv.shape[0], cu_seqlens.shape[0] - 1)
        sizes = self._sizes.get(key) or self._size(*key)
        grid, rest, parts, numel = sizes[:4]
        partials = self._partials(stream, numel)
        workspace = partials.tensor
        with partials.lock:
            if self.tail is not None:
                # The norm weight's partials follow the dAPE partials (``_size``).
                norm_parts = partials.after(sizes[5]) if self.has_norm else None
                args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, workspace)
                return self._launch_tail(args, grad_ape, sizes, stream, stats, (tail, norm_parts), grad_norm_weight)
            if self.family == "stats":
                self.kernel.launch(
                    grid, stream, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                    workspace, stats, *rest,
                )  # fmt: skip
            else:
                self.kernel.launch(
                    grid, stream, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                    workspace, *rest,
                )  # fmt: skip
            self.dape.launch(self.dape_grid, stream, workspace, grad_ape, parts)

    def _launch_tail(self, args, grad_ape, sizes, stream, stats, tail, grad_norm_weight) -> None:
        """The launches with the tail: the statistics recomputed first where the call has none, the dx route, the
        window kernel and the reduction (``args``: the window kernel's tensors; ``tail``: the tail's runtime
        arguments and the norm weight's partials, None without a norm)."""
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, workspace = args
        grid, _rest, parts, _numel, ints, _norm_at, dx_programs = sizes
        tail, norm_parts = tail
        if self.stats_forward is not None:
            stats, out = _on_stream(stream, lambda: self._recomputed(ints[0], grad_out.dtype))
            self.stats_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats)
        norm_count = dx_programs or parts
        if dx_programs:
            dx = _on_stream(stream, lambda: torch.empty(grad_out.shape, dtype=torch.float32, device=self.device))
            offsets = (cu_seqlens, cu_seqlens_comp, *ints[:4])
            self.dx_kernel.launch(dx_programs, stream, stats, grad_out, dx, norm_parts, *offsets, *tail)
            dx_args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, dx, grad_kv, grad_score, workspace)
            self.from_dx.launch(grid, stream, *dx_args, stats, *ints, *NO_TAIL, None)
        elif self.family == "stats":
            self.kernel.launch(grid, stream, *args, stats, *ints, *tail, norm_parts)
        else:  # short windows (a long window's tail runs from statistics)
            self.kernel.launch(grid, stream, *args, *ints, *tail, norm_parts)
        if self.has_norm:
            reduce_args = (workspace, grad_ape, norm_parts, grad_norm_weight, parts, norm_count)
            self.dape.launch(self.dape_grid, stream, *reduce_args)
        else:
            self.dape.launch(self.dape_grid, stream, workspace, grad_ape, parts)
