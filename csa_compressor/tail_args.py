"""The fused tail's seven API arguments on the per-call path (issue 26, docs/tail.md).

``tail.check_tail`` holds the bounds. An op compiled for one ``TailConfig`` rechecks a call's arguments with
``TailCheck``: attribute reads against the compiled configuration and the table widths, no torch op; any
failure reruns ``check_tail`` (the error names the bound), and arguments that pass it but belong to another
configuration get an error that says so. An identity tail (neither norm nor rope) is None throughout: the
backends then see exactly the pooling.
"""

from __future__ import annotations

import math

import torch

from . import dispatch
from .tail import INT32_LIMIT, Tail, TailConfig, check_tail

__all__ = ["TAIL_ARGS", "TailCheck", "is_plain", "tail_backend", "tail_config"]

TAIL_ARGS = ("norm_weight", "norm_eps", "rope_cos", "rope_sin", "rope_dim", "rope_interleaved", "position_start")
DEFAULT_EPS = 1e-6
_F32, _I32 = torch.float32, torch.int32
_PER_CALL_ERRORS = (AttributeError, TypeError, ValueError)  # not tensors, wrong ranks (shape unpacking)


def is_plain(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start) -> bool:
    """True for the defaults (no tail): the test the entry points inline on their hot path. Other identity tails
    (a ``norm_eps`` of their own, ``rope_interleaved=False``) take the checked path and end as None there."""
    return (
        norm_weight is None
        and rope_cos is None
        and rope_sin is None
        and position_start is None
        and rope_dim == 0
        and rope_interleaved is True
        and norm_eps == DEFAULT_EPS
    )


def tail_config(tail: Tail, *, head_dim: int, batch: int, device: torch.device) -> TailConfig | None:
    """``tail`` checked (``check_tail``), then its configuration: None for an identity tail."""
    check_tail(tail, head_dim=head_dim, batch=batch, device=device)
    return None if tail.is_identity else tail.config


def _fuses(name: str, ratio: int, coff: int, head_dim: int, config: TailConfig) -> bool:
    supports = getattr(dispatch.backend_module(name), "supports_tail", None)
    return supports is not None and bool(supports(ratio, coff, head_dim, config))


def tail_backend(requested, name: str, device: torch.device, ratio: int, coff: int, head_dim: int, config) -> str:
    """The backend that runs ``config``'s tail: ``name`` (the pooling's choice) when it fuses it; for "auto" on a
    GPU, the next usable backend of auto's order that does. Else ValueError naming ``name`` (no other path)."""
    if _fuses(name, ratio, coff, head_dim, config):
        return name
    if dispatch.requested_backend(requested) == "auto" and device.type == "cuda":
        order = dispatch.available_backends(device)  # auto's order on a GPU, fastest first
        for candidate in order[order.index(name) + 1 :]:
            try:
                dispatch.resolve_backend(candidate, device, ratio, coff, head_dim)
            except (ValueError, RuntimeError):
                continue
            if _fuses(candidate, ratio, coff, head_dim, config):
                return candidate
    with_tail = [n for n in dispatch.available_backends(device) if _fuses(n, ratio, coff, head_dim, config)]
    raise ValueError(
        f"csa_compressor: backend {name!r} has no fused tail (norm_weight / rope_dim) for ratio={ratio}, "
        f"coff={coff}, head_dim={head_dim}, {config}; backends with it on {device}: {', '.join(with_tail) or 'none'}"
    )


def _device_test(device: torch.device):
    # As support's rechecks: the cheapest exact device read for the configuration's device type.
    if device.type == "cpu":
        return lambda t: t.is_cpu
    if device.type == "meta":
        return lambda t: t.is_meta
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return lambda t: t.get_device() == index
    return lambda t: t.device == device


def _laid_out(t, dtype, align_mask: int, on_device) -> bool:
    return t.dtype is dtype and t.is_contiguous() and not t.data_ptr() & align_mask and on_device(t)


class TailCheck:
    """The per-call recheck of the tail arguments for an op compiled for ``config`` (None: no tail)."""

    def __init__(self, config: TailConfig | None, head_dim: int, device: torch.device):
        self.config, self.head_dim, self.device = config, head_dim, device
        self._on_device = _device_test(device)
        plain = config is None
        self._norm_dtype = None if plain else config.norm_dtype
        self._rope_dim = 0 if plain else config.rope_dim
        self._interleaved = None if plain else config.rope_interleaved
        self._positions = not plain and config.has_positions
        self._weight_shape = (head_dim,)

    def __call__(
        self, cu_seqlens, norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start
    ):
        """The call's ``Tail`` (None for an identity tail), or ValueError naming the bound or the mismatch.
        ``cu_seqlens`` has passed the pooling's recheck (it gives the batch of ``position_start``)."""
        args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
        try:
            if self._holds(cu_seqlens, *args):
                return None if self.config is None else Tail(*args)
        except _PER_CALL_ERRORS:
            pass
        return self._full(cu_seqlens, args)

    def _holds(self, cu_seqlens, norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start):
        if not ((type(norm_eps) is float or type(norm_eps) is int) and 0 <= norm_eps < math.inf):
            return False  # NaN fails the comparison too
        if type(rope_dim) is not int or rope_dim != self._rope_dim or type(rope_interleaved) is not bool:
            return False
        if self._interleaved is not None and rope_interleaved is not self._interleaved:
            return False
        on_device = self._on_device
        if self._norm_dtype is None:
            if norm_weight is not None:
                return False
        elif not (norm_weight.shape == self._weight_shape and _laid_out(norm_weight, self._norm_dtype, 15, on_device)):
            return False
        if not rope_dim:
            return rope_cos is None and rope_sin is None and position_start is None
        max_position, half = rope_cos.shape
        if not (half * 2 == rope_dim and max_position >= 1 and max_position * half < INT32_LIMIT):
            return False
        if not (rope_sin.shape == rope_cos.shape and _laid_out(rope_cos, _F32, 15, on_device)):
            return False
        if not _laid_out(rope_sin, _F32, 15, on_device):
            return False
        if not self._positions:
            return position_start is None
        (batch,) = position_start.shape
        return batch == cu_seqlens.shape[0] - 1 and _laid_out(position_start, _I32, 3, on_device)

    def _full(self, cu_seqlens, args):
        tail = Tail(*args)
        got = tail_config(tail, head_dim=self.head_dim, batch=cu_seqlens.shape[0] - 1, device=self.device)
        if got != self.config:
            raise ValueError(
                "csa_compressor: execute() tail arguments must match the configuration compiled for: "
                f"compiled for {self.config}, got {got} (None: no norm_weight and rope_dim=0)"
            )
        return None if got is None else tail
