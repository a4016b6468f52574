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

from .config import MAX_RATIO, KernelConfig, StatsTile, choose_config, is_long, stats_tile
from .plans import BackwardPlan, ForwardPlan

__all__ = [
    "AUTOGRAD_STATS",
    "MAX_RATIO",
    "KernelConfig",
    "StatsTile",
    "backward",
    "choose_config",
    "compile",
    "config_unsupported_reason",
    "device_unsupported_reason",
    "forward",
    "launch_backward",
    "launch_forward",
    "stats_tile",
    "supports_stats",
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


def device_unsupported_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type == "cpu":
        if _interpret():
            return None
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
    """(forward, long-window forward, backward) kernel modules, decorated in the interpreter mode now in force.

    ``triton.jit`` decides at decoration time whether a kernel is interpreted; if
    the modules were first imported under the other mode they are reloaded once (in import order).
    """
    mode = _interpret()
    mods = _KERNELS.get(mode)
    if mods is None:
        from . import backward, forward, forward_long

        mods = (forward, forward_long, backward)
        if (type(forward.csa_fwd_kernel).__name__ == "InterpretedFunction") != mode:
            mods = tuple(importlib.reload(mod) for mod in mods)
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


# --------------------------------------------------------------------------- plans

# Every plan built: (direction, ratio, coff, head_dim, dtype, device, with_stats, cfg, tile, interpret) -> plan.
_PLANS: dict[tuple, ForwardPlan | BackwardPlan] = {}
# The protocol calls' plans with the default tiles: (ratio, coff, head_dim, dtype, device, with_stats) -> plan.
_FORWARD: dict[tuple, ForwardPlan] = {}
_BACKWARD: dict[tuple, BackwardPlan] = {}


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _plan(direction, ratio, coff, head_dim, dtype, device, with_stats, cfg=None, tile=None):
    """The plan of one configuration (built on first use): default tiles unless ``cfg`` / ``tile`` are given."""
    _check_stats(with_stats, ratio, coff)
    device = _device(device)
    interpret = _interpret() or device.type != "cuda"
    cfg = cfg if cfg is not None else choose_config(direction, ratio, coff, head_dim, interpret)
    if direction == "backward" and tile is None:
        tile = stats_tile(ratio, coff, head_dim, interpret)
    # The dtype is part of the key: a bound kernel's compiled code is specialised on its pointers' element types.
    key = (direction, ratio, coff, head_dim, dtype, device, with_stats, cfg, tile, interpret)
    plan = _PLANS.get(key)
    if plan is None:
        fwd_mod, fwd_long_mod, bwd_mod = _kernels()
        if direction == "forward":
            kernel = fwd_long_mod.csa_fwd_long_kernel if is_long(ratio, coff) else fwd_mod.csa_fwd_kernel
            plan = ForwardPlan(kernel, ratio, coff, head_dim, cfg, with_stats, device, interpret)
        else:
            sms = _SMS_DEFAULT if interpret else _sm_count(device.index)
            plan = BackwardPlan(bwd_mod, ratio, coff, head_dim, cfg, tile, with_stats, device, interpret, sms)
        plan = _PLANS[key] = plan
    return plan


def _forward_plan(ratio, coff, head_dim, dtype, device, with_stats) -> ForwardPlan:
    plan = _FORWARD[ratio, coff, head_dim, dtype, device, with_stats] = _plan(
        "forward", ratio, coff, head_dim, dtype, device, with_stats
    )
    return plan


def _backward_plan(ratio, coff, head_dim, dtype, device, with_stats) -> BackwardPlan:
    plan = _BACKWARD[ratio, coff, head_dim, dtype, device, with_stats] = _plan(
        "backward", ratio, coff, head_dim, dtype, device, with_stats
    )
    return plan


# --------------------------------------------------------------------------- protocol


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None) -> None:
    """Write every row of ``out`` (``(N, d)``, N > 0: the API handles N == 0). ``stats``: None, or a
    ``(N, 3, d)`` float32 buffer the long-window kernel fills (``reference.softmax_stats``)."""
    key = (ratio, coff, out.shape[1], kv.dtype, kv.device, stats is not None)
    plan = _FORWARD.get(key) or _forward_plan(*key)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, stats)


def backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, stream=None,
    stats=None,
) -> None:  # fmt: skip
    """Write every element of the three gradients (N > 0). ``stats``: None, or the forward's ``(N, 3, d)``
    float32 softmax statistics (long windows only)."""
    key = (ratio, coff, grad_out.shape[1], kv.dtype, kv.device, stats is not None)
    plan = _BACKWARD.get(key) or _backward_plan(*key)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream, stats)


def launch_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, cfg: KernelConfig, stats=None):
    """``forward`` with the tiles ``cfg`` (tests and tile sweeps), on the current stream."""
    plan = _plan("forward", ratio, coff, out.shape[1], kv.dtype, kv.device, stats is not None, cfg)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, None, stats)


def launch_backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff,
    cfg: KernelConfig, stats=None, tile: StatsTile | None = None,
) -> None:  # fmt: skip
    """``backward`` with the tiles ``cfg`` (the statistics backward: ``tile``, default ``stats_tile``), on the
    current stream."""
    with_stats = stats is not None
    plan = _plan("backward", ratio, coff, grad_out.shape[1], kv.dtype, kv.device, with_stats, cfg, tile)
    plan(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, None, stats)


def compile(direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Build ``direction``'s plans for this configuration (long windows: with and without statistics) and, on a
    GPU, launch each once on a tiny problem: that compiles the kernels and binds their direct launch, so later
    calls (and CUDA-graph capture) neither compile nor bind. The interpreter has nothing to build."""
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    device = _device(device)
    make = _forward_plan if direction == "forward" else _backward_plan
    variants = (False, True) if is_long(ratio, coff) else (False,)
    plans = [make(ratio, coff, head_dim, dtype, device, with_stats) for with_stats in variants]
    if device.type != "cuda" or _interpret():
        return
    with torch.cuda.device(device):
        for plan in plans:
            _warm_up(plan, direction, ratio, coff, head_dim, dtype, device)
        torch.cuda.current_stream(device).synchronize()


def _warm_up(plan, direction, ratio, coff, head_dim, dtype, device) -> None:
    """One launch of ``plan`` on a two-row problem (the same dtypes and argument specialisation as real calls)."""
    width, tokens = coff * head_dim, 2 * ratio
    kv = torch.zeros((tokens, width), dtype=dtype, device=device)
    score = torch.zeros_like(kv)
    ape = torch.zeros((ratio, width), dtype=torch.float32, device=device)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    cu_comp = torch.tensor([0, 2], dtype=torch.int32, device=device)
    stats = torch.zeros((2, 3, head_dim), dtype=torch.float32, device=device) if plan.with_stats else None
    if direction == "forward":
        out = torch.empty((2, head_dim), dtype=dtype, device=device)
        plan(kv, score, ape, cu, cu_comp, out, None, stats)
    else:
        grad_out = torch.zeros((2, head_dim), dtype=dtype, device=device)
        grads = torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(ape)
        plan(kv, score, ape, cu, cu_comp, grad_out, *grads, None, stats)
