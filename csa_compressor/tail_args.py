"""The fused tail's seven API arguments on the per-call path (issue 26, docs/tail.md).

``tail.check_tail`` holds the bounds. An op compiled for one ``TailConfig`` rechecks a call's arguments with
``TailCheck``: attribute reads against the compiled configuration and the table widths, no torch op; any
failure reruns ``check_tail`` (the error names the bound), and arguments that pass it but belong to another
configuration get an error that says so. An identity tail (neither norm nor rope) is None throughout: the
backends then see exactly the pooling.

The entry points test for the defaults (no tail) first, with ``is_default_tail``: ``norm_weight``, ``rope_cos``,
``rope_sin`` and ``position_start`` None, ``rope_dim == 0``, ``rope_interleaved is True`` and
``norm_eps == 1e-6``. Other identity tails (an ``eps`` of their own, half-split pairs) take the checked path.
"""

from __future__ import annotations

import math

import torch

from . import dispatch
from .tail import INT32_LIMIT, Tail, TailConfig, check_tail

__all__ = ["TAIL_ARGS", "TailCheck", "is_default_tail", "tail_backend", "tail_config"]

TAIL_ARGS = ("norm_weight", "norm_eps", "rope_cos", "rope_sin", "rope_dim", "rope_interleaved", "position_start")
_F32, _I32 = torch.float32, torch.int32
_PER_CALL_ERRORS = (AttributeError, TypeError, ValueError)  # not tensors, wrong ranks (shape unpacking)


def is_default_tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start) -> bool:
    """Whether the seven tail arguments are all at their defaults: the pooling's own path, bitwise (the entry points'
    first test, so it reads no tensor)."""
    return (
        norm_weight is None
        and rope_cos is None
        and rope_sin is None
        and position_start is None
        and rope_dim == 0
        and rope_interleaved is True
        and norm_eps == 1e-6
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


# The per-call recheck is generated per configuration (as support's rechecks are): one boolean expression of
# attribute reads with the configuration's values as constants. Device reads as support's: the cheapest exact one
# for the configuration's device type.
_DEVICE_READS = {"cpu": "{t}.is_cpu", "meta": "{t}.is_meta", "cuda": "{t}.get_device() == INDEX"}


def _laid_out(t: str, dtype: str, align: int, device_read: str) -> str:
    on_device = device_read.format(t=t)
    return f"{t}.dtype is {dtype} and {t}.is_contiguous() and not {t}.data_ptr() & {align - 1} and {on_device}"


def _recheck_source(config: TailConfig | None, device_type: str) -> str:
    """``recheck(cu_seqlens, <the seven>)``: the call's ``Tail`` (None without one) where its tail arguments are
    this configuration's, all bounds kept; else (or where a test raises on arguments of the wrong kind) the full
    check's answer, ``FULL(cu_seqlens, args)``."""
    device_read = _DEVICE_READS.get(device_type, "{t}.device == DEVICE")
    tests = ["(type(norm_eps) is float or type(norm_eps) is int) and 0 <= norm_eps < INF", "type(rope_dim) is int"]
    if config is None:
        tests += ["rope_dim == 0", "type(rope_interleaved) is bool", "norm_weight is None"]
    else:
        tests += ["rope_dim == ROPE_DIM", "rope_interleaved is INTERLEAVED"]
        if config.norm_dtype is None:
            tests.append("norm_weight is None")
        else:
            tests += ["norm_weight.shape == WEIGHT_SHAPE", _laid_out("norm_weight", "NORM_DTYPE", 16, device_read)]
    if config is None or config.rope_dim == 0:
        tests.append("rope_cos is None and rope_sin is None and position_start is None")
    else:
        tests += [
            "len(cos_shape := rope_cos.shape) == 2 and cos_shape[1] == HALF and 0 < cos_shape[0]",
            "cos_shape[0] * HALF < INT32_LIMIT and rope_sin.shape == cos_shape",
            _laid_out("rope_cos", "F32", 16, device_read),
            _laid_out("rope_sin", "F32", 16, device_read),
        ]
        if not config.has_positions:
            tests.append("position_start is None")
        else:
            tests += [
                "position_start.shape == (cu_seqlens.shape[0] - 1,)",
                _laid_out("position_start", "I32", 4, device_read),
            ]
    body = "\n            and ".join(f"({test})" for test in tests)
    args = "norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start"
    # The Tail is built here, not by the caller: one call per execute, no second pass over the arguments.
    held = "None" if config is None else f"Tail({args})"
    return (
        f"def recheck(cu_seqlens, {args}):\n"
        f"    try:\n"
        f"        if (\n            {body}\n        ):\n"
        f"            return {held}\n"
        f"    except PER_CALL_ERRORS:\n"
        f"        pass\n"
        f"    return FULL(cu_seqlens, ({args}))"
    )


def _make_recheck(config: TailConfig | None, head_dim: int, device: torch.device, full):
    index = -1
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    namespace = dict(
        INF=math.inf, INT32_LIMIT=INT32_LIMIT, F32=_F32, I32=_I32, DEVICE=device, INDEX=index,
        WEIGHT_SHAPE=(head_dim,), NORM_DTYPE=None if config is None else config.norm_dtype,
        ROPE_DIM=0 if config is None else config.rope_dim, HALF=0 if config is None else config.rope_dim // 2,
        INTERLEAVED=None if config is None else config.rope_interleaved, Tail=Tail,
        PER_CALL_ERRORS=_PER_CALL_ERRORS, FULL=full,
    )  # fmt: skip
    exec(compile(_recheck_source(config, device.type), "<csa_compressor.tail_args recheck>", "exec"), namespace)
    return namespace["recheck"]


class TailCheck:
    """The per-call recheck of the tail arguments for an op compiled for ``config`` (None: no tail).

    ``recheck`` is the generated function itself (what the ops store and call); calling the instance does the same.
    """

    def __init__(self, config: TailConfig | None, head_dim: int, device: torch.device):
        self.config, self.head_dim, self.device = config, head_dim, device
        self.recheck = _make_recheck(config, head_dim, device, self._full)

    def __call__(
        self, cu_seqlens, norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start
    ):
        """The call's ``Tail`` (None for an identity tail), or ValueError naming the bound or the mismatch.
        ``cu_seqlens`` has passed the pooling's recheck (it gives the batch of ``position_start``)."""
        args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
        return self.recheck(cu_seqlens, *args)

    def _full(self, cu_seqlens, args):
        tail = Tail(*args)
        got = tail_config(tail, head_dim=self.head_dim, batch=cu_seqlens.shape[0] - 1, device=self.device)
        if got != self.config:
            raise ValueError(
                "csa_compressor: execute() tail arguments must match the configuration compiled for: "
                f"compiled for {self.config}, got {got} (None: no norm_weight and rope_dim=0)"
            )
        return None if got is None else tail
