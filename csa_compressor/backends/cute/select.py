"""Which kernel class and configuration serve a call: the one place that maps (direction, ratio, coff, head_dim,
device) to kernels.

Directions: ``forward``, ``backward`` and, for windows that use softmax statistics, ``forward_stats`` (the
forward that also writes them) and ``backward_stats`` (the backward that reads them).

- forward: short windows of one power-of-two slot group take ``ForwardShortWindow`` (exact, bitwise the fp32
  reference); every other window ``ForwardLongWindow`` (slot groups and a combine);
- backward: short windows ``BackwardShortWindow``, long ones ``BackwardLongWindow``;
- backward_stats: ``BackwardWithStats``. The grad_ape reduction (``ApeReduce``) runs inside the backwards' host
  functions, after their main kernel.

With the fused tail (``configs.TailSpec``; ``tail_route``) a call takes one of two routes:

- fused: the pooling kernel with the tail inside, where ``fused_tail_config`` has a configuration for it: the
  one-group short windows' forward and backward (whole rows per CTA), the forward of other windows of one batch
  per slot group whose rows fit one CTA (``ForwardLongWindow`` with a tail, ``long_tail``), and the backward of
  other windows in the statistics backward's slab form (``BackwardWithStats`` with a tail, ``stats_tail``; the
  statistics forward first where a call saved none);
- composed, every other window and direction: forward = the statistics forward (``ForwardLongWindow`` with
  ``write_stats``, for any window: ``tail_configs.stats_forward_for_sm90``) then ``TailForward`` on ``stats[:, 2]``;
  backward (the whole-tile form) = the statistics forward again where no statistics were saved, ``TailGradient``
  (dx, fp32) and ``BackwardWithStats`` reading dx (``grad_float32``).
"""

from __future__ import annotations

from dataclasses import replace

from ...windows import uses_softmax_stats
from . import configs, tail_configs
from .backward_long import BackwardLongWindow
from .backward_short import BackwardShortWindow
from .backward_stats import BackwardWithStats
from .device import DeviceSpec
from .forward import ForwardLongWindow, ForwardShortWindow
from .tail_kernels import TailForward, TailGradient

DIRECTIONS = ("forward", "forward_stats", "backward", "backward_stats")

KERNEL_OF_CONFIG = {
    configs.ForwardShortConfig: ForwardShortWindow,
    configs.ForwardLongConfig: ForwardLongWindow,
    configs.BackwardShortConfig: BackwardShortWindow,
    configs.BackwardLongConfig: BackwardLongWindow,
    configs.BackwardStatsConfig: BackwardWithStats,
    tail_configs.TailForwardConfig: TailForward,
    tail_configs.TailGradientConfig: TailGradient,
}

# Factories per architecture family: (forward, backward, backward with statistics, forward with statistics of
# any window).
_FACTORIES = {
    "sm_90": (configs.forward_for_sm90, configs.backward_for_sm90, configs.stats_backward_for_sm90,
              tail_configs.stats_forward_for_sm90),
    "sm_100": (configs.forward_for_sm100, configs.backward_for_sm100, configs.stats_backward_for_sm100,
               tail_configs.stats_forward_for_sm100),
}  # fmt: skip


def _family(device: DeviceSpec):
    return _FACTORIES["sm_100" if device.arch.startswith("sm_10") else "sm_90"]


def config_for(direction: str, ratio: int, coff: int, head_dim: int, device: DeviceSpec):
    """The configuration of ``direction``'s kernel on ``device``."""
    forward, backward, stats_backward, _ = _family(device)
    if direction == "forward":
        return forward(ratio, coff, head_dim, device)
    if direction == "backward":
        return backward(ratio, coff, head_dim, device)
    if direction in ("forward_stats", "backward_stats") and uses_softmax_stats(ratio, coff):
        if direction == "forward_stats":
            return forward(ratio, coff, head_dim, device, stats=True)
        return stats_backward(ratio, coff, head_dim, device)
    raise ValueError(f"direction must be one of {DIRECTIONS} (the *_stats ones for long windows), got {direction!r}")


def kernel_for(direction: str, ratio: int, coff: int, head_dim: int, device: DeviceSpec):
    """(kernel class, configuration) of ``direction``'s kernel on ``device``."""
    config = config_for(direction, ratio, coff, head_dim, device)
    return KERNEL_OF_CONFIG[type(config)], config


# Factories of the fused tail's configurations per architecture family: (forward, backward).
_FUSED_FACTORIES = {
    "sm_90": (tail_configs.fused_forward_for_sm90, tail_configs.fused_backward_for_sm90),
    "sm_100": (tail_configs.fused_forward_for_sm100, tail_configs.fused_backward_for_sm100),
}


def fused_tail_config(direction: str, ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail_spec):
    """The configuration that fuses the tail (``configs.TailSpec``) into ``direction``'s kernel ("forward" or
    "backward"), or None where there is no fused kernel (the composed route serves it): short windows of one
    power-of-two slot group (``ForwardShortWindow``, ``BackwardShortWindow`` with whole rows per CTA); the forward
    of other windows (``ForwardLongWindow``, ``tail_configs.long_forward_with_tail``)."""
    forward, backward = _FUSED_FACTORIES["sm_100" if device.arch.startswith("sm_10") else "sm_90"]
    if direction == "forward":
        return forward(ratio, coff, head_dim, device, tail_spec)
    if direction == "backward":
        return backward(ratio, coff, head_dim, device, tail_spec)
    raise ValueError(f"direction must be 'forward' or 'backward' for a fused tail, got {direction!r}")


def tail_route(direction: str, ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail_spec,
               fuse: bool = True) -> dict:  # fmt: skip
    """(kernel class, configuration) per step of a call with the tail: ``{"fused": ...}``, or for the composed
    route (the only one without ``fuse``) ``stats`` (the statistics forward), ``tail`` (``TailForward`` /
    ``TailGradient``) and, for the backward, ``pool`` (the statistics backward reading dx; in the whole-tile form it
    also sums the norm weight's slabs: ``tail_configs.sums_norm_slabs``)."""
    if direction not in ("forward", "backward"):
        raise ValueError(f"a tail's direction must be 'forward' or 'backward', got {direction!r}")
    fused = fused_tail_config(direction, ratio, coff, head_dim, device, tail_spec) if fuse else None
    _, _, stats_backward, stats_forward = _family(device)
    if fused is not None:
        steps = {"fused": (KERNEL_OF_CONFIG[type(fused)], fused)}
        if isinstance(fused, configs.BackwardStatsConfig):
            # Calls that saved no statistics compute them first.
            config = stats_forward(ratio, coff, head_dim, device)
            steps["stats"] = (KERNEL_OF_CONFIG[type(config)], config)
        return steps
    # The pooled rows x are stats[:, 2]: rows of 3 * head_dim floats from column 2 * head_dim.
    kind = tail_configs.TailForwardConfig if direction == "forward" else tail_configs.TailGradientConfig
    tail = tail_configs.tail_rows(kind, ratio, head_dim, tail_spec, 3 * head_dim, 2 * head_dim)
    steps = {"stats": stats_forward(ratio, coff, head_dim, device), "tail": tail}
    if direction == "backward":
        pool = replace(stats_backward(ratio, coff, head_dim, device), grad_float32=True)
        if tail_configs.sums_norm_slabs(pool, tail_spec):
            pool = replace(pool, norm_slabs=True)
            steps["tail"] = replace(tail, norm_summed_after=True)
        steps["pool"] = pool
    return {name: (KERNEL_OF_CONFIG[type(cfg)], cfg) for name, cfg in steps.items()}
