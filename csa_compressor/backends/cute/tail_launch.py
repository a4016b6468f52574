"""The fused tail's launches (``launch.forward`` / ``launch.backward`` / ``launch.compile`` with a tail): the
routes of ``select.tail_route``, one set of launchers per (direction, ratio, coff, head_dim, dtype, device,
``configs.TailSpec``), each function primed when it is built (so nothing compiles or loads later, under CUDA-graph
capture in particular).

- fused: the pooling kernel with the tail's block (``tail_arguments``) after its own arguments; the long-window
  forward writes the statistics where the call asks for them; a backward's slabs have ``config.slab_entries``
  floats per CTA (their entries past ape_size reduce into grad_norm_weight);
- composed: the statistics forward into ``stats`` (the caller's, else a workspace) and ``TailForward``; backward:
  the statistics recomputed into a workspace where none were given, ``TailGradient`` into a dx workspace (with a
  norm, its weight slabs into another, reduced by its own host function), then the statistics backward reading
  dx. The fused statistics backward also recomputes the statistics where none were given.

Workspaces (statistics, the pooled rows' bf16 copy, dx, the weight's own slabs) are ``torch.empty`` on the launch
stream, so the caching allocator hands their blocks to no other stream before the stream's work has run, and under
capture they come from the graph's pool. The pooling backward's slabs (with a fused norm, the weight's too) are
``launch.slab_space``'s: the per-stream scratch of eager calls.

``bind`` (``launch.bind`` with a tail): the calls of one compiled configuration, each route resolved at its first
call with or without statistics and the tail's block read by a function generated for the ``TailSpec``.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import launch as base
from .configs import BackwardStatsConfig, ForwardLongConfig, TailSpec
from .device import device_spec
from .select import tail_route

_ROUTES: dict[tuple, TailRoute] = {}  # (direction, ratio, coff, head_dim, dtype, index, TailSpec, fuse) -> route
_SPECS: dict[object, TailSpec] = {}  # TailConfig -> TailSpec


class TailRoute:
    """The launchers of one route: ``fused``, or the composed steps ``stats``, ``tail`` and ``pool``."""

    __slots__ = ("fused", "pool", "stats", "tail")

    def __init__(self, steps: dict, spec):
        self.fused = self.stats = self.tail = self.pool = None
        for name, (kernel_class, config) in steps.items():
            kind = base.ForwardLauncher if kernel_class.kind in ("forward", "tail_forward") else base.BackwardLauncher
            setattr(self, name, kind(kernel_class, config, spec))


def spec_of(tail) -> TailSpec:
    config = tail.config
    spec = _SPECS.get(config)
    if spec is None:
        spec = _SPECS[config] = TailSpec.of(config)
    return spec


# grad_norm_weight's place in a gradient tail block (``block_function``), stats' among the backward's arguments.
_GRAD_NORM_WEIGHT = 5
_STATS_ARGUMENT = 10


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def tail_arguments(tail, rstd, grad_norm_weight=None, gradient: bool = False) -> tuple:
    """The tail's block of a host function (``build.py``): pointers (0 where absent), ``norm_eps``,
    ``max_position`` (``block_function`` of the tail's spec)."""
    block = block_function(spec_of(tail), gradient)
    return block(tail, rstd, grad_norm_weight) if gradient else block(tail, rstd)


@functools.cache
def block_function(spec: TailSpec, gradient: bool = False):
    """The tail block of the tails of ``spec``: ``block(tail, rstd)`` (``gradient``: ``block(tail, rstd,
    grad_norm_weight)``), generated with only the reads the spec needs (an absent operand is a literal 0)."""
    rope = spec.rope_dim > 0
    items = [
        "tail.norm_weight.data_ptr()" if spec.has_norm else "0",
        "tail.rope_cos.data_ptr()" if rope else "0",
        "tail.rope_sin.data_ptr()" if rope else "0",
        "tail.position_start.data_ptr()" if spec.has_positions else "0",
        "0 if rstd is None else rstd.data_ptr()",
        *(["0 if grad_norm_weight is None else grad_norm_weight.data_ptr()"] if gradient else []),
        "float(tail.norm_eps)",
        "tail.rope_cos.shape[0]" if rope else "0",
    ]
    params = "tail, rstd, grad_norm_weight" if gradient else "tail, rstd"
    namespace: dict = {}
    exec(f"def block({params}):\n    return ({', '.join(items)})\n", namespace)
    return namespace["block"]


def _route(direction, ratio, coff, head_dim, dtype, index, spec, fuse=True) -> TailRoute:
    """The route's launchers, created (compiled or loaded, then primed) on a miss."""
    key = (direction, ratio, coff, head_dim, dtype, index, spec, fuse)
    route = _ROUTES.get(key)
    if route is not None:
        return route
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cute backend: the {direction} kernels with the tail {spec} for ratio={ratio}, coff={coff}, "
            f"head_dim={head_dim} on cuda:{index} are not compiled and cannot be compiled during CUDA-graph "
            "capture; call compile() with the tail's configuration (or run the operation once) before capturing"
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"cute backend: only bfloat16 kv/score are supported, got {dtype}")
    with base._LOCK:
        route = _ROUTES.get(key)
        if route is None:
            device = device_spec(index)
            route = TailRoute(tail_route(direction, ratio, coff, head_dim, device, spec, fuse), device)
            with torch.cuda.device(index):
                _prime(route, direction, ratio, coff, head_dim, index, spec)
            _ROUTES[key] = route
    return route


def _lookup(direction, kv, ratio, coff, head_dim, tail, stats) -> TailRoute:
    """The call's route (``_route_of``)."""
    return _route_of((direction, ratio, coff, head_dim, kv.dtype, kv.device.index, spec_of(tail)), stats is not None)


def _route_of(shape: tuple, given: bool) -> TailRoute:
    """The route of ``shape`` = (direction, ratio, coff, head_dim, dtype, index, TailSpec): the fused one unless
    statistics are ``given`` to a fused kernel that takes none (all but the long-window forward, which writes
    them)."""
    route = _ROUTES.get((*shape, True))
    if route is None:
        route = _route(*shape)
    if route.fused is not None and given and not takes_stats(route.fused.config):
        route = _route(*shape, fuse=False)
    return route


def takes_stats(config) -> bool:
    """Whether a fused configuration writes (the long-window forward) or reads (the statistics backward) the
    softmax statistics where a launch passes them."""
    return isinstance(config, (ForwardLongConfig, BackwardStatsConfig))


def _on_device(index: int):
    return contextlib.nullcontext() if index == base._GET_DEVICE() else torch.cuda.device(index)


def workspace(shape, dtype, device, stream) -> torch.Tensor:
    """``torch.empty`` on the launch stream (from the graph's pool under capture)."""
    if stream is None:
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.stream(stream):
        return torch.empty(shape, dtype=dtype, device=device)


def fill_ones(rstd, stream) -> None:
    """rstd of rows without a norm."""
    if stream is None:
        rstd.fill_(1.0)
    else:
        with torch.cuda.stream(stream):
            rstd.fill_(1.0)


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats, tail, rstd) -> None:
    """``launch.forward`` with a tail."""
    if tail.is_identity:
        base.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats, None, rstd)
        return
    route = _lookup("forward", kv, ratio, coff, out.shape[1], tail, stats)
    inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    with _on_device(kv.device.index):
        _route_forward(route, inputs, out, stats, tail_arguments(tail, rstd), stream)


def _route_forward(route, inputs, out, stats, block, stream) -> None:
    """The route's forward: the fused kernel (the register-capped build from ``wide_rows`` rows on), or composed."""
    if route.fused is None:
        _composed_forward(route, inputs, out, stats, block, stream)
        return
    launcher = route.fused
    function = launcher.function if out.shape[0] < launcher.wide_rows else launcher.wide
    base.call_forward(function, *inputs, out, stats, stream, block)


def _composed_forward(route, inputs, out, stats, block, stream) -> None:
    kv, _, _, cu_seqlens, cu_seqlens_comp = inputs
    n, d = out.shape
    if stats is None:
        stats = workspace((n, 3, d), torch.float32, kv.device, stream)
    base.call_forward(route.stats.function, *inputs, out, stats, stream)
    route.tail.function(stats.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(), out.data_ptr(),
                        cu_seqlens.shape[0] - 1, n, kv.shape[0], *block,
                        base._stream_handle(stream, kv.device.index))  # fmt: skip


_NEEDS_GRAD_WEIGHT = "cute backend: a tail with norm_weight needs grad_norm_weight, a (head_dim,) float32 buffer"


def backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff,
             stream, stats, tail, grad_norm_weight, rstd) -> None:  # fmt: skip
    """``launch.backward`` with a tail."""
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
    if tail.is_identity:
        base.backward(*tensors, ratio, coff, stream, stats)
        return
    if tail.has_norm and grad_norm_weight is None:
        raise ValueError(_NEEDS_GRAD_WEIGHT)
    route = _lookup("backward", kv, ratio, coff, grad_out.shape[1], tail, stats)
    with _on_device(kv.device.index):
        _route_backward(route, tensors, stream, stats, tail_arguments(tail, rstd, grad_norm_weight, gradient=True))


def _route_backward(route, tensors, stream, stats, block, scratch: bool = True) -> None:
    """The route's backward: fused (the statistics backward's statistics computed first where none were given),
    or composed."""
    if route.fused is None:
        _composed_backward(route, tensors, stream, stats, block, scratch)
        return
    if isinstance(route.fused.config, BackwardStatsConfig):
        if stats is None:
            stats = _recomputed_stats(route, tensors, stream)
    else:
        stats = None  # the short-window backward reads none
    base.call_backward(route.fused, tensors, stream, stats, scratch=scratch, tail_block=block)


def _recomputed_stats(route, tensors, stream):
    """The statistics forward's statistics of the call into a workspace (its pooled rows into another, unread)."""
    kv, _, _, _, _, grad_out = tensors[:6]
    n, d = grad_out.shape
    stats = workspace((n, 3, d), torch.float32, kv.device, stream)
    pooled = workspace((n, d), torch.bfloat16, kv.device, stream)
    base.call_forward(route.stats.function, *tensors[:5], pooled, stats, stream)
    return stats


def _composed_backward(route, tensors, stream, stats, block, scratch: bool = True) -> None:
    """Statistics (recomputed where not given), dx and the weight's gradient, then the statistics backward on dx."""
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads = tensors
    n, d = grad_out.shape
    inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    if stats is None:
        stats = _recomputed_stats(route, tensors, stream)
    dx = workspace((n, d), torch.float32, kv.device, stream)
    gradient = (grad_out, stats, cu_seqlens, cu_seqlens_comp, dx, kv.shape[0])
    grid = base.backward_grid(route.tail, n, d)  # (rows_per_cta, num_ctas): one weight slab per CTA
    slabs = workspace((grid[1] * d,), torch.float32, kv.device, stream) if route.tail.config.tail.has_norm else None
    _tail_gradient(route.tail, gradient, _ptr(slabs), grid, block, stream)
    if route.pool.config.norm_slabs:
        _summing_backward(route.pool, (*inputs, dx, *grads), stats, slabs, block[_GRAD_NORM_WEIGHT], stream)
    else:
        base.call_backward(route.pool, (*inputs, dx, *grads), stream, stats, scratch=scratch)


def _summing_backward(launcher, tensors, stats, slabs, grad_norm_weight: int, stream) -> None:
    """The whole-tile statistics backward that also sums TailGradient's norm-weight ``slabs`` into the pointer
    ``grad_norm_weight`` (``build.py``'s ``summing_backward``)."""
    grad_out, grad_ape = tensors[5], tensors[8]
    rows_per_cta, num_ctas = base.backward_grid(launcher, grad_out.shape[0], grad_ape.numel())
    args = base.backward_arguments(tensors, slabs.data_ptr(), stats, rows_per_cta, num_ctas)
    # build.py's order: grad_norm_weight after the pointers' stats, the slabs' count after num_ctas.
    args.insert(_STATS_ARGUMENT + 1, grad_norm_weight)
    launcher.function(*args, slabs.numel() // grad_out.shape[1], base._stream_handle(stream, grad_out.device.index))


def _tail_gradient(launcher, gradient, slabs: int, grid, block, stream) -> None:
    """One TailGradient launch: ``gradient`` = (grad_out, stats, cu_seqlens, cu_seqlens_comp, dx, tokens), the
    weight's slabs at the pointer ``slabs`` (0 without a norm), ``grid`` = (rows_per_cta, num_ctas)."""
    grad_out, stats, cu_seqlens, cu_seqlens_comp, dx, tokens = gradient
    launcher.function(grad_out.data_ptr(), stats.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(),
                      dx.data_ptr(), slabs, cu_seqlens.shape[0] - 1, grad_out.shape[0], tokens, *grid, *block,
                      base._stream_handle(stream, grad_out.device.index))  # fmt: skip


def _probe_tail(spec: TailSpec, head_dim: int, dev):
    """A tail of ``spec`` on a one-position table (priming launches)."""
    from ...tail import Tail

    weight = None
    if spec.has_norm:
        weight = torch.ones(head_dim, dtype=torch.float32 if spec.norm_weight_float32 else torch.bfloat16, device=dev)
    if not spec.rope_dim:
        return Tail(weight)
    table = torch.zeros((1, spec.rope_dim // 2), dtype=torch.float32, device=dev)
    start = torch.zeros(1, dtype=torch.int32, device=dev) if spec.has_positions else None
    return Tail(weight, 1e-6, table, table, spec.rope_dim, spec.rope_interleaved, start)


def _prime(route, direction: str, ratio: int, coff: int, head_dim: int, index: int, spec: TailSpec) -> None:
    """One launch of each of the route's functions on a one-row problem (as ``launch._prime``)."""
    dev = torch.device("cuda", index)
    kv = torch.zeros((ratio, coff * head_dim), dtype=torch.bfloat16, device=dev)
    ape = torch.zeros((ratio, coff * head_dim), dtype=torch.float32, device=dev)
    inputs = (kv, kv, ape, torch.tensor([0, ratio], dtype=torch.int32, device=dev),
              torch.tensor([0, 1], dtype=torch.int32, device=dev))  # fmt: skip
    tail = _probe_tail(spec, head_dim, dev)
    rstd = torch.empty(1, dtype=torch.float32, device=dev)
    if direction == "forward":
        out = torch.empty((1, head_dim), dtype=torch.bfloat16, device=dev)
        block = tail_arguments(tail, rstd)
        if route.fused is not None:
            for function in [route.fused.function] + ([route.fused.wide] if route.fused.wide is not None else []):
                base.call_forward(function, *inputs, out, None, None, block)
        else:
            _composed_forward(route, inputs, out, None, block, None)
        return
    grad_out = torch.zeros((1, head_dim), dtype=torch.bfloat16, device=dev)
    tensors = (*inputs, grad_out, torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(ape))
    grad_w = torch.empty(head_dim, dtype=torch.float32, device=dev) if spec.has_norm else None
    block = tail_arguments(tail, rstd, grad_w, gradient=True)
    _route_backward(route, tensors, None, None, block, scratch=False)


def compile(direction, ratio, coff, head_dim, dtype, index, tail_config) -> None:
    """``launch.compile`` with a tail: every kernel of a call with it (an identity tail: the pooling's)."""
    spec = TailSpec.of(tail_config)
    if not spec.has_norm and not spec.rope_dim:
        base.compile(direction, ratio, coff, head_dim, dtype, torch.device("cuda", index))
        return
    _route(direction, ratio, coff, head_dim, dtype, index, spec)


# ---------------------------------------------------------------- bound calls of one configuration


def bind(direction, ratio, coff, head_dim, dtype, device, tail_config):
    """``launch.bind`` with a ``tail_config``: ``forward`` or ``backward`` for calls with tails of that configuration
    on ``device`` (the op's tail check has matched them), which resolve their route once per whether statistics are
    given and read the tail's block with ``block_function``; a call without a tail takes the pooling's path.
    An identity configuration is the pooling alone: the module's function."""
    spec = TailSpec.of(tail_config)
    if not spec.has_norm and not spec.rope_dim:
        return base.forward if direction == "forward" else base.backward
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()  # as launch.compile resolves it
    shape = (direction, ratio, coff, head_dim, dtype, index, spec)
    if direction == "forward":
        return _bound_forward(shape, block_function(spec))
    return _bound_backward(shape, block_function(spec, True), spec.has_norm)


def _step(steps: list, shape: tuple, given: bool):
    """The launch of the route with statistics ``given`` or not, resolved (and on a miss built, as ``_route``
    allows) at its first call: ``step(inputs, out, stats, block, stream)`` forward, ``step(tensors, stream, stats,
    block)`` backward."""
    step = functools.partial(_route_forward if shape[0] == "forward" else _route_backward, _route_of(shape, given))
    steps[given] = step
    return step


def _bound_forward(shape: tuple, block):
    index = shape[5]
    steps = [None, None]  # by whether statistics are given

    def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None, tail=None,
                rstd=None) -> None:  # fmt: skip
        if tail is None:
            return base.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats, None,
                                rstd)  # fmt: skip
        given = stats is not None
        step = steps[given] or _step(steps, shape, given)
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        if index == base._GET_DEVICE():
            return step(inputs, out, stats, block(tail, rstd), stream)
        with torch.cuda.device(index):
            return step(inputs, out, stats, block(tail, rstd), stream)

    return forward


def _bound_backward(shape: tuple, block, has_norm: bool):
    index = shape[5]
    steps = [None, None]  # by whether statistics are given

    def backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff,
                 stream=None, stats=None, tail=None, grad_norm_weight=None, rstd=None) -> None:  # fmt: skip
        tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
        if tail is None:
            return base.backward(*tensors, ratio, coff, stream, stats)
        if has_norm and grad_norm_weight is None:
            raise ValueError(_NEEDS_GRAD_WEIGHT)
        given = stats is not None
        step = steps[given] or _step(steps, shape, given)
        if index == base._GET_DEVICE():
            return step(tensors, stream, stats, block(tail, rstd, grad_norm_weight))
        with torch.cuda.device(index):
            return step(tensors, stream, stats, block(tail, rstd, grad_norm_weight))

    return backward
