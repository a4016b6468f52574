"""Input validation: the bounds of SPEC section 4, each with an error that names it.

``check_forward`` / ``check_backward`` run once per configuration (``check_support``);
``recheck_forward`` / ``recheck_backward`` are the cheap per-call versions used by
``execute``: one pass of attribute reads (no torch op, no CUDA query) that compares every
tensor against the compiled configuration. Any mismatch reruns the full checks, so a bad
tensor gets the same error on every call as from ``check_support``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "MAX_RATIO",
    "Config",
    "check_backward",
    "check_forward",
    "check_softmax_stats",
    "recheck_backward",
    "recheck_forward",
]

MAX_RATIO = 256
INT32_LIMIT = 2**31
_VALUE_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class Config:
    """What a compiled kernel depends on (sizes T and N are runtime values)."""

    ratio: int
    coff: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    # Derived once, for the per-call rechecks.
    width: int = field(init=False, compare=False)
    ape_shape: tuple[int, int] = field(init=False, compare=False)
    device_index: int = field(init=False, compare=False)
    is_cuda: bool = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "width", self.coff * self.head_dim)
        object.__setattr__(self, "ape_shape", (self.ratio, self.coff * self.head_dim))
        index = self.device.index if self.device.type == "cuda" else -1
        if self.device.type == "cuda" and index is None:
            index = torch.cuda.current_device()
        object.__setattr__(self, "device_index", index)
        object.__setattr__(self, "is_cuda", self.device.type == "cuda")


def _fail(bound: str, detail: str):
    raise ValueError(f"csa_compressor: {bound}: {detail}")


def check_config(ratio: int, coff: int, head_dim: int | None = None) -> None:
    if not isinstance(ratio, int) or isinstance(ratio, bool) or not 1 <= ratio <= MAX_RATIO:
        _fail(f"ratio must be an int in [1, {MAX_RATIO}]", f"got ratio={ratio!r}")
    if coff not in (1, 2) or isinstance(coff, bool):
        _fail("coff must be 1 or 2", f"got coff={coff!r}")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        _fail("head_dim must be a positive int", f"got head_dim={head_dim!r}")


def _check_tensor(name: str, t, rank: int, dtype: torch.dtype, align: int) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor", f"got {type(t).__name__}")
    if t.dim() != rank:
        _fail(f"{name} must have rank {rank}", f"got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        _fail(f"{name} dtype must be {dtype}", f"got {t.dtype}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous", f"got strides {t.stride()} for shape {tuple(t.shape)}")
    if t.device.type != "meta" and t.numel() > 0 and t.data_ptr() % align != 0:
        _fail(f"{name} must be {align}-byte aligned", f"data_ptr() % {align} = {t.data_ptr() % align}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        _fail(f"{name} shape must be {shape}", f"got {tuple(t.shape)}")


def _check_pack(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim) -> Config:
    check_config(ratio, coff, head_dim)
    if not isinstance(kv, torch.Tensor) or kv.dtype not in _VALUE_DTYPES:
        got = kv.dtype if isinstance(kv, torch.Tensor) else type(kv).__name__
        _fail(f"kv dtype must be one of {_VALUE_DTYPES}", f"got {got}")
    dtype = kv.dtype
    _check_tensor("kv", kv, 2, dtype, 16)
    width = kv.shape[1]
    if width % coff != 0:
        _fail("kv.shape[1] must be coff * head_dim", f"got kv.shape[1]={width} with coff={coff}")
    if head_dim is None:
        head_dim = width // coff
    if width != coff * head_dim:
        _fail("kv.shape[1] must be coff * head_dim", f"got {width} != {coff} * {head_dim}")
    if head_dim < 1:
        _fail("head_dim must be >= 1", f"got head_dim={head_dim}")
    tokens = kv.shape[0]
    _check_tensor("score", score, 2, dtype, 16)
    _check_shape("score", score, (tokens, width))
    _check_tensor("ape", ape, 2, torch.float32, 16)
    _check_shape("ape", ape, (ratio, width))
    _check_tensor("cu_seqlens", cu_seqlens, 1, torch.int32, 4)
    if cu_seqlens.shape[0] < 2:
        _fail("cu_seqlens must have at least 2 entries", f"got shape {tuple(cu_seqlens.shape)}")
    _check_tensor("cu_seqlens_comp", cu_seqlens_comp, 1, torch.int32, 4)
    if cu_seqlens_comp.shape != cu_seqlens.shape:
        _fail(
            "cu_seqlens_comp shape must equal cu_seqlens shape",
            f"got {tuple(cu_seqlens_comp.shape)} vs {tuple(cu_seqlens.shape)}",
        )
    if tokens * width >= INT32_LIMIT:
        _fail("int32 offsets need T * coff * head_dim < 2**31", f"got {tokens} * {width} = {tokens * width}")
    devices = {t.device for t in (kv, score, ape, cu_seqlens, cu_seqlens_comp)}
    if len(devices) != 1:
        _fail("all tensors must be on one device", f"got {sorted(str(d) for d in devices)}")
    return Config(ratio, coff, head_dim, dtype, kv.device)


def _check_rows(name: str, t: torch.Tensor, cfg: Config, tokens: int) -> None:
    _check_tensor(name, t, 2, cfg.dtype, 16)
    if t.shape[1] != cfg.head_dim:
        _fail(f"{name}.shape[1] must be head_dim={cfg.head_dim}", f"got shape {tuple(t.shape)}")
    if t.device != cfg.device:
        _fail("all tensors must be on one device", f"{name} is on {t.device}, kv on {cfg.device}")
    rows = t.shape[0]
    if rows * cfg.head_dim >= INT32_LIMIT:
        _fail("int32 offsets need total_comp * head_dim < 2**31", f"got {rows} * {cfg.head_dim}")
    if rows > 0 and tokens < cfg.ratio:
        _fail(
            "total_comp > 0 needs T >= ratio (padding rows read tokens 0..ratio-1)",
            f"got total_comp={rows}, T={tokens}, ratio={cfg.ratio}",
        )


def check_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, *, ratio, coff, head_dim=None) -> Config:
    cfg = _check_pack(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim)
    _check_rows("out", out, cfg, kv.shape[0])
    return cfg


def check_backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, *, ratio, coff, head_dim=None
) -> Config:
    cfg = _check_pack(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim)
    _check_rows("grad_out", grad_out, cfg, kv.shape[0])
    for name, t in (("grad_kv", grad_kv), ("grad_score", grad_score)):
        _check_tensor(name, t, 2, cfg.dtype, 16)
        _check_shape(name, t, tuple(kv.shape))
        if t.device != cfg.device:
            _fail("all tensors must be on one device", f"{name} is on {t.device}, kv on {cfg.device}")
    _check_tensor("grad_ape", grad_ape, 2, torch.float32, 16)
    _check_shape("grad_ape", grad_ape, tuple(ape.shape))
    if grad_ape.device != cfg.device:
        _fail("all tensors must be on one device", f"grad_ape is on {grad_ape.device}, kv on {cfg.device}")
    return cfg


_F32, _I32 = torch.float32, torch.int32
_PER_CALL_ERRORS = (AttributeError, TypeError, ValueError)


def _on_device(device: torch.device, tensors) -> bool:
    # Off CUDA, get_device() is -1 for CPU and meta alike: compare the devices themselves.
    for t in tensors:
        if t.device != device:
            return False
    return True


def _inputs_ok(cfg: Config, kv, score, ape, cu_seqlens, cu_seqlens_comp, rows: int, head_dim: int) -> bool:
    """The part of the per-call check both directions share: the five inputs against ``cfg`` (sizes that
    may change per call, dtype, contiguity, 16/4-byte alignment, int32 bounds, ``T >= ratio``, device)."""
    shape = kv.shape
    tokens, width = shape
    cu_shape = cu_seqlens.shape
    dtype = cfg.dtype
    index = cfg.device_index
    return (
        width == cfg.width
        and head_dim == cfg.head_dim
        and kv.dtype is dtype
        and score.dtype is dtype
        and ape.dtype is _F32
        and cu_seqlens.dtype is _I32
        and cu_seqlens_comp.dtype is _I32
        and score.shape == shape
        and ape.shape == cfg.ape_shape
        and len(cu_shape) == 1
        and cu_shape[0] >= 2
        and cu_seqlens_comp.shape == cu_shape
        and kv.is_contiguous()
        and score.is_contiguous()
        and ape.is_contiguous()
        and cu_seqlens.is_contiguous()
        and cu_seqlens_comp.is_contiguous()
        and not (kv.data_ptr() | score.data_ptr() | ape.data_ptr()) & 15
        and not (cu_seqlens.data_ptr() | cu_seqlens_comp.data_ptr()) & 3
        and tokens * width < INT32_LIMIT
        and rows * head_dim < INT32_LIMIT
        and (rows == 0 or tokens >= cfg.ratio)
        and (
            # CUDA: one index read per tensor (CPU and meta tensors read -1).
            kv.is_cuda
            and kv.get_device() == index
            and score.get_device() == index
            and ape.get_device() == index
            and cu_seqlens.get_device() == index
            and cu_seqlens_comp.get_device() == index
            if cfg.is_cuda
            else _on_device(cfg.device, (kv, score, ape, cu_seqlens, cu_seqlens_comp))
        )
    )


def _buffer_ok(cfg: Config, t, dtype) -> bool:
    """One caller-provided buffer (output or gradient): dtype, contiguity, 16-byte alignment, device."""
    return (
        t.dtype is dtype
        and t.is_contiguous()
        and not t.data_ptr() & 15
        and (t.get_device() == cfg.device_index if cfg.is_cuda else t.device == cfg.device)
    )


def recheck_forward(cfg: Config, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, fresh: bool = False) -> int:
    """Cheap per-call check; returns ``out.shape[0]``. Anything unexpected reruns the full checks for the message.

    One pass of plain attribute reads (no torch op, no device or stream query): the sizes that may
    change per call are compared against the compiled configuration; dtype, contiguity, 16/4-byte
    alignment, the int32 bounds, ``T >= ratio`` and the device are read from every tensor.
    ``fresh=True`` (the wrappers): ``out`` is ``kv.new_empty((rows, head_dim))``, so its dtype, device,
    contiguity and (allocator) alignment follow from kv's and are not read again; its shape is.
    """
    try:
        rows, head_dim = out.shape
        if _inputs_ok(cfg, kv, score, ape, cu_seqlens, cu_seqlens_comp, rows, head_dim) and (
            fresh or _buffer_ok(cfg, out, cfg.dtype)
        ):
            return rows
    except _PER_CALL_ERRORS:  # not tensors, wrong ranks
        pass
    check_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio=cfg.ratio, coff=cfg.coff)
    _check_same_config(cfg, kv, out)


def recheck_backward(
    cfg: Config,
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    grad_kv,
    grad_score,
    grad_ape,
    fresh: bool = False,
) -> int:
    """The backward's cheap per-call check (returns ``grad_out.shape[0]``); see ``recheck_forward``.

    ``fresh=True`` (the wrappers): the three gradients are ``torch.empty_like`` of kv, score and ape,
    which this check finds contiguous, so nothing of theirs is read.
    """
    try:
        rows, head_dim = grad_out.shape
        dtype = cfg.dtype
        if (
            _inputs_ok(cfg, kv, score, ape, cu_seqlens, cu_seqlens_comp, rows, head_dim)
            and _buffer_ok(cfg, grad_out, dtype)
            and (
                fresh
                or (
                    grad_kv.shape == kv.shape
                    and grad_score.shape == kv.shape
                    and grad_ape.shape == cfg.ape_shape
                    and _buffer_ok(cfg, grad_kv, dtype)
                    and _buffer_ok(cfg, grad_score, dtype)
                    and _buffer_ok(cfg, grad_ape, _F32)
                )
            )
        ):
            return rows
    except _PER_CALL_ERRORS:
        pass
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
    check_backward(*tensors, ratio=cfg.ratio, coff=cfg.coff)
    _check_same_config(cfg, kv, grad_out)


def check_softmax_stats(cfg: Config, stats, rows: int, uses_stats: bool) -> None:
    """The optional ``softmax_stats`` tensor: ``(rows, 3, head_dim)`` float32, contiguous, 16-byte aligned, on
    the configuration's device, and only where the configuration uses them (``uses_stats``)."""
    if not uses_stats:
        _fail(
            "softmax_stats are used only for windows of more than 16 slots (coff * ratio > 16) on backends "
            "that support them",
            f"got ratio={cfg.ratio}, coff={cfg.coff}; pass softmax_stats=None",
        )
    if not isinstance(stats, torch.Tensor):
        _fail("softmax_stats must be a tensor", f"got {type(stats).__name__}")
    _check_tensor("softmax_stats", stats, 3, torch.float32, 16)
    _check_shape("softmax_stats", stats, (rows, 3, cfg.head_dim))
    if not _buffer_ok(cfg, stats, _F32):
        _fail("all tensors must be on one device", f"softmax_stats is on {stats.device}, kv on {cfg.device}")


def stats_ok(cfg: Config, stats, rows: int) -> bool:
    """Per-call form of ``check_softmax_stats`` (attribute reads only)."""
    try:
        return stats.shape == (rows, 3, cfg.head_dim) and _buffer_ok(cfg, stats, _F32)
    except _PER_CALL_ERRORS:
        return False


def _check_same_config(cfg: Config, kv: torch.Tensor, rows: torch.Tensor) -> None:
    """The full checks passed, so what differs from the compiled configuration is the configuration itself."""
    _fail(
        "execute() tensors must match the configuration compiled for",
        f"compiled for head_dim={cfg.head_dim}, coff={cfg.coff}, {cfg.dtype} on {cfg.device}; "
        f"got kv {tuple(kv.shape)} {kv.dtype} on {kv.device}, rows {tuple(rows.shape)}",
    )
