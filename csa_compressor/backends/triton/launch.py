"""Backend protocol (see ``csa_compressor.backends``) over the Triton kernels.

Runs natively on CUDA GPUs of compute capability 8.0 and newer, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), which CI uses to execute the kernels' real logic. Launches read no device memory on
the host and size their grids from shapes only, so they are CUDA-graph capture safe once :func:`compile` has
built the configuration.

Layout: ``config.py`` (tiles and launch sizes), ``plans.py`` (one configuration's launches), ``binding.py`` (the
one launch path: a kernel bound to its constants, launched directly), ``forward.py`` / ``backward.py`` (kernels).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from ...windows import uses_softmax_stats
from .config import (
    MAX_RATIO,
    KernelConfig,
    StatsTile,
    choose_config,
    is_long,
    stats_tile,
    whole_rows,
)
from .plans import NO_TAIL, BackwardPlan, ForwardPlan, TailForwardPlan, release_partials

__all__ = [
    "AUTOGRAD_STATS",
    "MAX_RATIO",
    "KernelConfig",
    "StatsTile",
    "backward",
    "bind",
    "choose_config",
    "compile",
    "config_unsupported_reason",
    "device_unsupported_reason",
    "forward",
    "launch_backward",
    "launch_forward",
    "release_partials",
    "stats_tile",
    "supports_stats",
    "supports_tail",
    "unavailable_reason",
]

# The interpreter's stand-in for a device's SM count (it sizes the one-wave backward grids).
_SMS_DEFAULT = 132


def unavailable_reason() -> str | None:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"triton is not importable ({exc}); install the 'triton' extra"
    return None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@functools.cache
def interpreter_unsupported_reason() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None: before 3.7 it takes a loop bound with ``int()``
    of a one-element array, an error from NumPy 2.4 on."""
    import triton

    try:
        import numpy
    except ImportError:
        return "triton's interpreter needs numpy, which is not installed"
    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (
            f"triton {triton.__version__}'s interpreter cannot run loops of a runtime bound under NumPy "
            f"{numpy.__version__} (fixed in triton 3.7): use triton >= 3.7 or numpy < 2.4 for the CPU"
        )
    return None


def device_unsupported_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type == "cpu":
        if _interpret():
            return interpreter_unsupported_reason()
        return "triton runs on the CPU only under its interpreter (set TRITON_INTERPRET=1 before importing triton)"
    if device.type != "cuda":
        return f"triton backend supports CUDA devices (and the CPU interpreter), not {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if _interpret():
        return None
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if (major, minor) < (8, 0):
        return f"triton backend needs compute capability >= 8.0, this GPU has {major}.{minor}"
    return None


def config_unsupported_reason(ratio: int, coff: int, head_dim: int) -> str | None:
    if coff not in (1, 2):
        return f"coff must be 1 or 2, got {coff}"
    if not 1 <= ratio <= MAX_RATIO:
        return f"ratio must be in [1, {MAX_RATIO}], got {ratio}"
    if head_dim < 1:
        return f"head_dim must be >= 1, got {head_dim}"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_KERNELS: dict[bool, tuple] = {}


def _kernels():
    """(forward, long-window forward, backward, tail epilogue) kernel modules, decorated in the interpreter mode now
    in force.

    ``triton.jit`` decides at decoration time whether a kernel is interpreted; if
    the modules were first imported under the other mode they are reloaded once (in import order).
    """
    mode = _interpret()
    mods = _KERNELS.get(mode)
    if mods is None:
        from . import backward, backward_stats, backward_tail, forward, forward_long, forward_tail, norm_rope, sweep

        if (type(forward.csa_fwd_kernel).__name__ == "InterpretedFunction") != mode:
            # The helper modules too, before the kernels that import their functions.
            for mod in (norm_rope, forward, forward_long, forward_tail, sweep, backward_tail, backward_stats, backward):
                importlib.reload(mod)
        mods = (forward, forward_long, backward, forward_tail)
        _KERNELS[mode] = mods
    return mods


# The autograd function saves softmax statistics for this backend: the statistics pair (forward in the log2
# domain, forward.py's _online_step) meets the contract at full size on the H200.
AUTOGRAD_STATS = True


def supports_stats(ratio: int, coff: int, head_dim: int) -> bool:
    """Softmax statistics (``reference.softmax_stats``) are written and read by the long-window kernels only."""
    return is_long(ratio, coff)


def _check_stats(with_stats: bool, ratio: int, coff: int) -> None:
    # Shapes and dtypes are checked by csa_compressor.support; a short-window kernel would silently ignore stats.
    if with_stats and not is_long(ratio, coff):
        raise ValueError(
            f"softmax stats are supported for long windows only (coff * ratio > 16), "
            f"got ratio={ratio}, coff={coff}; pass stats=None"
        )


# The tail runs in programs that own whole rows (short windows' window programs, config.whole_rows; long windows'
# epilogue and dx kernels); wider rows than this would spill registers.
MAX_TAIL_HEAD_DIM = 2048


def supports_tail(ratio: int, coff: int, head_dim: int, tail_config) -> bool:
    """The fused tail (``csa_compressor.tail``) runs in every window class up to ``MAX_TAIL_HEAD_DIM`` columns."""
    if config_unsupported_reason(ratio, coff, head_dim) is not None or head_dim > MAX_TAIL_HEAD_DIM:
        return False
    if tail_config.norm_dtype not in (None, torch.float32, torch.bfloat16):
        return False
    rope_dim = tail_config.rope_dim
    return 0 <= rope_dim <= head_dim and rope_dim % 2 == 0


def _active(tail):
    """The tail to fuse, or None for no tail (an identity tail is the pooling alone)."""
    return None if tail is None or tail.is_identity else tail


def _tail_args(tail, rstd) -> tuple:
    """The kernels' tail arguments in ``plans.NO_TAIL``'s order."""
    rope = tail.rope_dim > 0
    return (
        tail.norm_weight,
        tail.rope_cos if rope else None,
        tail.rope_sin if rope else None,
        tail.rope_cos.shape[0] if rope else None,  # max_position: rows outside the tables are not rotated
        tail.position_start if rope else None,
        rstd,
        float(tail.norm_eps) if tail.has_norm else None,
    )


# --------------------------------------------------------------------------- plans

# Every plan built: (direction, ratio, coff, head_dim, dtype, device, with_stats, cfg, tile, interpret, tail,
# with_rstd) -> plan.
_PLANS: dict[tuple, ForwardPlan | BackwardPlan] = {}
# The protocol calls' plans with the default tiles: (ratio, coff, head_dim, dtype, device, with_stats) -> plan;
# with a tail the key also has the TailConfig and whether rstd is given (a None pointer specialises the kernels).
_FORWARD: dict[tuple, ForwardPlan] = {}
_BACKWARD: dict[tuple, BackwardPlan] = {}


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def composes_tail(direction: str, ratio: int, coff: int, tail_config) -> bool:
    """Whether a forward with a tail runs composed (``plans.TailForwardPlan``: the statistics forward, then the
    epilogue over whole rows) rather than fused into the window programs: long windows, whose whole-row window
    programs would hold ``head_dim`` columns of the window each. Short windows (up to 16 slots) keep the fused
    program: its whole row is one tile of at most 16 slots, the same elements per thread as the pooling's."""
    return direction == "forward" and tail_config is not None and uses_softmax_stats(ratio, coff)


def _plan(direction, ratio, coff, head_dim, dtype, device, with_stats, cfg=None, tile=None, tail=None, rstd=False):
    """The plan of one configuration (built on first use): default tiles unless ``cfg`` / ``tile`` are given.

    ``tail``: a ``TailConfig`` (default tiles are widened to whole rows, ``config.whole_rows``, except where the
    forward composes the tail: ``composes_tail``, whose ``cfg`` is the pooling's) or None; ``rstd``: whether calls
    pass an rstd buffer (part of the key only, as the kernels specialise on a None pointer)."""
    _check_stats(with_stats, ratio, coff)
    if composes_tail(direction, ratio, coff, tail):
        return _tail_forward_plan(ratio, coff, head_dim, dtype, device, cfg, tail, rstd)
    device = _device(device)
    interpret = _interpret() or device.type != "cuda"
    if cfg is None:
        cfg = choose_config(direction, ratio, coff, head_dim, interpret)
        if tail is not None:
            cfg = whole_rows(cfg, head_dim)
    if direction == "backward" and tile is None:
        tile = stats_tile(ratio, coff, head_dim, interpret)
    # The dtype is part of the key: a bound kernel's compiled code is specialised on its pointers' element types.
    key = (direction, ratio, coff, head_dim, dtype, device, with_stats, cfg, tile, interpret, tail, rstd)
    plan = _PLANS.get(key)
    if plan is None:
        fwd_mod, fwd_long_mod, bwd_mod, _tail_mod = _kernels()
        if direction == "forward":
            kernel = fwd_long_mod.csa_fwd_long_kernel if is_long(ratio, coff) else fwd_mod.csa_fwd_kernel
            plan = ForwardPlan(kernel, ratio, coff, head_dim, cfg, with_stats, device, interpret, tail)
        else:
            sms = _SMS_DEFAULT if interpret else _sm_count(device.index)
            # Long windows with a tail run the statistics backward; without statistics they are recomputed first.
            recompute = None
            if tail is not None and is_long(ratio, coff) and not with_stats:
                recompute = _plan("forward", ratio, coff, head_dim, dtype, device, True)
            plan = BackwardPlan(
                bwd_mod, ratio, coff, head_dim, cfg, tile, with_stats, device, interpret, sms, tail, recompute
            )
        plan = _PLANS[key] = plan
    return plan


def _tail_forward_plan(ratio, coff, head_dim, dtype, device, cfg, tail, rstd) -> TailForwardPlan:
    """The composed forward of a long window with a tail: the statistics forward (tiles ``cfg``, default the
    pooling's), then the epilogue specialised on ``tail`` and on whether rstd is given."""
    device = _device(device)
    interpret = _interpret() or device.type != "cuda"
    key = ("forward-tail", ratio, coff, head_dim, dtype, device, cfg, interpret, tail, rstd)
    plan = _PLANS.get(key)
    if plan is None:
        pooling = _plan("forward", ratio, coff, head_dim, dtype, device, True, cfg)
        plan = _PLANS[key] = TailForwardPlan(_kernels()[3], pooling, ratio, head_dim, tail, interpret)
    return plan


def _forward_plan(ratio, coff, head_dim, dtype, device, with_stats, tail=None, rstd=False) -> ForwardPlan:
    key = (ratio, coff, head_dim, dtype, device, with_stats) + ((tail, rstd) if tail is not None else ())
    plan = _FORWARD[key] = _plan("forward", ratio, coff, head_dim, dtype, device, with_stats, tail=tail, rstd=rstd)
    return plan


def _backward_plan(ratio, coff, head_dim, dtype, device, with_stats, tail=None, rstd=False) -> BackwardPlan:
    key = (ratio, coff, head_dim, dtype, device, with_stats) + ((tail, rstd) if tail is not None else ())
    plan = _BACKWARD[key] = _plan("backward", ratio, coff, head_dim, dtype, device, with_stats, tail=tail, rstd=rstd)
    return plan


# --------------------------------------------------------------------------- protocol


def forward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None, tail=None, rstd=None
) -> None:  # fmt: skip
    """Write every row of ``out`` (``(N, d)``, N > 0: the API handles N == 0). ``stats``: None, or a
    ``(N, 3, d)`` float32 buffer the long-window kernel fills (``reference.softmax_stats``; ``stats[:, 2]`` is the
    pooled row before the tail). ``tail``: a ``csa_compressor.tail.Tail`` or None; ``rstd``: None or an ``(N,)``
    float32 buffer of each row's ``rsqrt(mean(x * x) + eps)`` (1 without a norm)."""
    tail = _active(tail)
    if tail is None:
        key = (ratio, coff, out.shape[1], kv.dtype, kv.device, stats is not None)
        plan = _FORWARD.get(key) or _forward_plan(*key)
        plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats)
        if rstd is not None:
            _fill_ones(rstd, stream)
        return
    key = (ratio, coff, out.shape[1], kv.dtype, kv.device, stats is not None, tail.config, rstd is not None)
    plan = _FORWARD.get(key) or _forward_plan(*key)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats, _tail_args(tail, rstd))


def _fill_ones(rstd, stream) -> None:
    if stream is None:
        rstd.fill_(1.0)
    else:
        with torch.cuda.stream(stream):
            rstd.fill_(1.0)


def backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, stream=None,
    stats=None, tail=None, grad_norm_weight=None, rstd=None,
) -> None:  # fmt: skip
    """Write every element of the three gradients (N > 0). ``stats``: None, or the forward's ``(N, 3, d)``
    float32 softmax statistics (long windows only). ``tail``: the forward's tail or None; ``grad_out`` is then the
    gradient of the tail's output, and ``grad_norm_weight`` (required with a norm) a ``(d,)`` float32 buffer the
    weight's gradient overwrites; ``rstd``: None (recomputed) or the forward's ``(N,)`` rstd."""
    tail = _active(tail)
    if tail is None:
        key = (ratio, coff, grad_out.shape[1], kv.dtype, kv.device, stats is not None)
        plan = _BACKWARD.get(key) or _backward_plan(*key)
        plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream, stats)
        return
    _check_grad_norm_weight(tail, grad_norm_weight)
    key = (ratio, coff, grad_out.shape[1], kv.dtype, kv.device, stats is not None, tail.config, rstd is not None)
    plan = _BACKWARD.get(key) or _backward_plan(*key)
    grads = (grad_kv, grad_score, grad_ape)
    tail_args = _tail_args(tail, rstd)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, stream, stats, tail_args, grad_norm_weight)


def bind(
    direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, device: torch.device, tail_config=None
):  # fmt: skip
    """``forward`` or ``backward`` (as ``direction`` says) for this one configuration, which ``compile`` has built:
    the same function, whose calls go to their plan without looking it up (with a ``tail_config``, calls with a tail
    of that configuration). Other calls take the module's function; so does every call where the plans are not
    there (a configuration never compiled, the meta device)."""
    device = _device(device)
    table = _FORWARD if direction == "forward" else _BACKWARD
    if tail_config is not None:
        return _bind_tail(direction, table, (ratio, coff, head_dim, dtype, device), tail_config)
    plain = table.get((ratio, coff, head_dim, dtype, device, False))
    if plain is None:
        return forward if direction == "forward" else backward
    with_stats = table.get((ratio, coff, head_dim, dtype, device, True))
    return (_bound_forward if direction == "forward" else _bound_backward)(plain, with_stats)


def _bind_tail(direction: str, table: dict, shape: tuple, tail_config):
    """``bind`` with a tail: its plans by ``2 * (stats given) + (rstd given)``, or the module's function where
    ``compile`` built none."""
    found = tuple(table.get((*shape, stats, tail_config, rstd)) for stats in (False, True) for rstd in (False, True))
    if found[0] is None:
        return forward if direction == "forward" else backward
    if direction == "forward":
        return _bound_tail_forward(found)
    return _bound_tail_backward(found, tail_config.norm_dtype is not None)


def _bound_tail_forward(found: tuple):
    def forward_tail(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None, tail=None, rstd=None
    ) -> None:  # fmt: skip
        if tail is not None:
            plan = found[2 * (stats is not None) + (rstd is not None)]
            if plan is not None:
                tail_args = _tail_args(tail, rstd)
                return plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats, tail_args)
        return forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats, tail, rstd)

    return forward_tail


def _bound_tail_backward(found: tuple, has_norm: bool):
    def backward_tail(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, stream=None,
        stats=None, tail=None, grad_norm_weight=None, rstd=None,
    ) -> None:  # fmt: skip
        inputs = kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape
        if tail is not None:
            plan = found[2 * (stats is not None) + (rstd is not None)]
            if plan is not None:
                if has_norm and grad_norm_weight is None:
                    _check_grad_norm_weight(tail, grad_norm_weight)
                return plan(*inputs, stream, stats, _tail_args(tail, rstd), grad_norm_weight)
        return backward(*inputs, ratio, coff, stream, stats, tail, grad_norm_weight, rstd)

    return backward_tail


def _bound_forward(plain: ForwardPlan, with_stats: ForwardPlan | None):
    def forward_plan(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None, tail=None, rstd=None
    ) -> None:  # fmt: skip
        if tail is None and rstd is None:
            plan = plain if stats is None else with_stats
            if plan is not None:
                return plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats)
        return forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats, tail, rstd)

    return forward_plan


def _bound_backward(plain: BackwardPlan, with_stats: BackwardPlan | None):
    def backward_plan(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, stream=None,
        stats=None, tail=None, grad_norm_weight=None, rstd=None,
    ) -> None:  # fmt: skip
        if tail is None and grad_norm_weight is None and rstd is None:
            plan = plain if stats is None else with_stats
            if plan is not None:
                return plan(
                    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream,
                    stats,
                )  # fmt: skip
        inputs = kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape
        return backward(*inputs, ratio, coff, stream, stats, tail, grad_norm_weight, rstd)

    return backward_plan


def _check_grad_norm_weight(tail, grad_norm_weight) -> None:
    if tail.has_norm and grad_norm_weight is None:
        raise ValueError("a tail with norm_weight needs grad_norm_weight, a (head_dim,) float32 buffer")


def launch_forward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, cfg: KernelConfig, stats=None, tail=None, rstd=None
) -> None:  # fmt: skip
    """``forward`` with the tiles ``cfg`` (tests and tile sweeps; with a tail on a short window ``cfg`` must span
    whole rows, a long window's are its statistics forward's), on the current stream."""
    tail = _active(tail)
    config = None if tail is None else tail.config
    # Whether rstd is given is part of the plan: the kernels specialise on a None pointer.
    with_stats, with_rstd = stats is not None, tail is not None and rstd is not None
    plan = _plan("forward", ratio, coff, out.shape[1], kv.dtype, kv.device, with_stats, cfg, None, config, with_rstd)
    plan(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, out, None, stats,
        NO_TAIL if tail is None else _tail_args(tail, rstd),
    )  # fmt: skip


def launch_backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff,
    cfg: KernelConfig, stats=None, tile: StatsTile | None = None, tail=None, grad_norm_weight=None, rstd=None,
) -> None:  # fmt: skip
    """``backward`` with the tiles ``cfg`` (the statistics backward: ``tile``, default ``stats_tile``), on the
    current stream."""
    tail = _active(tail)
    config = None if tail is None else tail.config
    with_stats = stats is not None
    shape = (ratio, coff, grad_out.shape[1], kv.dtype, kv.device, with_stats)
    plan = _plan("backward", *shape, cfg, tile, config, tail is not None and rstd is not None)
    grads = (grad_kv, grad_score, grad_ape)
    if tail is None:
        plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, None, stats)
        return
    _check_grad_norm_weight(tail, grad_norm_weight)
    args = _tail_args(tail, rstd)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, None, stats, args, grad_norm_weight)


def compile(
    direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, device: torch.device, tail_config=None
) -> None:  # fmt: skip
    """Build ``direction``'s plans for this configuration (long windows: with and without statistics; with a
    ``tail_config``: with and without an rstd buffer) and, on a GPU, launch each once on a tiny problem: that
    compiles the kernels and binds their direct launch, so later calls (and CUDA-graph capture) neither compile nor
    bind. The interpreter has nothing to build."""
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    device = _device(device)
    make = _forward_plan if direction == "forward" else _backward_plan
    variants = (False, True) if is_long(ratio, coff) else (False,)
    if tail_config is not None and tail_config.norm_dtype is None and tail_config.rope_dim == 0:
        tail_config = None  # an identity tail is the pooling alone
    rstds = (False,) if tail_config is None else (False, True)
    plans = [
        (make(ratio, coff, head_dim, dtype, device, with_stats, tail_config, with_rstd), with_rstd)
        for with_stats in variants
        for with_rstd in rstds
    ]
    if device.type != "cuda" or _interpret():
        return
    with torch.cuda.device(device):
        for plan, with_rstd in plans:
            _warm_up(plan, direction, ratio, coff, head_dim, dtype, device, tail_config, with_rstd)
        torch.cuda.current_stream(device).synchronize()


def _warm_tail(tail_config, ratio: int, head_dim: int, device):
    """A ``Tail`` of ``tail_config`` for the warm-up's two rows (positions 0 and ``ratio``), or None."""
    if tail_config is None:
        return None
    from ...tail import Tail

    weight = None
    if tail_config.norm_dtype is not None:
        weight = torch.ones(head_dim, dtype=tail_config.norm_dtype, device=device)
    if tail_config.rope_dim == 0:
        return Tail(norm_weight=weight)
    table = torch.zeros((2 * ratio, tail_config.rope_dim // 2), dtype=torch.float32, device=device)
    start = torch.zeros(1, dtype=torch.int32, device=device) if tail_config.has_positions else None
    return Tail(weight, 1e-6, table, table.clone(), tail_config.rope_dim, tail_config.rope_interleaved, start)


def _warm_up(plan, direction, ratio, coff, head_dim, dtype, device, tail_config=None, with_rstd=False) -> None:
    """One launch of ``plan`` on a two-row problem (the same dtypes and argument specialisation as real calls)."""
    width, tokens = coff * head_dim, 2 * ratio
    kv = torch.zeros((tokens, width), dtype=dtype, device=device)
    score = torch.zeros_like(kv)
    ape = torch.zeros((ratio, width), dtype=torch.float32, device=device)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    cu_comp = torch.tensor([0, 2], dtype=torch.int32, device=device)
    stats = torch.zeros((2, 3, head_dim), dtype=torch.float32, device=device) if plan.with_stats else None
    tail = _warm_tail(tail_config, ratio, head_dim, device)
    rstd = torch.ones(2, dtype=torch.float32, device=device) if with_rstd else None
    tail_args = NO_TAIL if tail is None else _tail_args(tail, rstd)
    if direction == "forward":
        out = torch.empty((2, head_dim), dtype=dtype, device=device)
        plan(kv, score, ape, cu, cu_comp, out, None, stats, tail_args)
    else:
        grad_out = torch.zeros((2, head_dim), dtype=dtype, device=device)
        grads = torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(ape)
        grad_w = torch.empty(head_dim, dtype=torch.float32, device=device)
        plan(kv, score, ape, cu, cu_comp, grad_out, *grads, None, stats, tail_args, grad_w)
