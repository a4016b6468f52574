"""Input validation: the bounds of SPEC section 4, each with an error that names it.

``check_forward`` / ``check_backward`` run once per configuration (``check_support``);
``recheck_forward`` / ``recheck_backward`` are the cheap per-call versions used by
``execute``: they assume the configuration already passed and look only at what
can change between calls (sizes, contiguity, alignment, device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "MAX_RATIO",
    "Config",
    "check_backward",
    "check_forward",
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


def _recheck(cfg: Config, tensors) -> None:
    # Cheap per-call check; on any doubt fall through to the full checks for the message.
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device != cfg.device or not t.is_contiguous():
            raise _Mismatch
        if t.data_ptr() & 15 and t.dtype != torch.int32:
            raise _Mismatch


class _Mismatch(Exception):
    pass


def recheck_forward(cfg: Config, kv, score, ape, cu_seqlens, cu_seqlens_comp, out) -> None:
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
    try:
        _recheck(cfg, tensors)
        width = cfg.coff * cfg.head_dim
        tokens = kv.shape[0]
        rows = out.shape[0]
        if (
            kv.dtype != cfg.dtype
            or score.dtype != cfg.dtype
            or out.dtype != cfg.dtype
            or kv.shape[1] != width
            or score.shape != kv.shape
            or ape.shape != (cfg.ratio, width)
            or ape.dtype != torch.float32
            or out.dim() != 2
            or out.shape[1] != cfg.head_dim
            or cu_seqlens.dtype != torch.int32
            or cu_seqlens_comp.shape != cu_seqlens.shape
            or cu_seqlens_comp.dtype != torch.int32
            or tokens * width >= INT32_LIMIT
            or rows * cfg.head_dim >= INT32_LIMIT
            or (rows > 0 and tokens < cfg.ratio)
        ):
            raise _Mismatch
    except _Mismatch:
        check_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio=cfg.ratio, coff=cfg.coff)
        _check_same_config(cfg, kv)


def recheck_backward(
    cfg: Config, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape
) -> None:
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
    try:
        _recheck(cfg, tensors)
        width = cfg.coff * cfg.head_dim
        tokens = kv.shape[0]
        rows = grad_out.shape[0]
        if (
            kv.dtype != cfg.dtype
            or kv.shape[1] != width
            or score.shape != kv.shape
            or score.dtype != cfg.dtype
            or grad_kv.shape != kv.shape
            or grad_kv.dtype != cfg.dtype
            or grad_score.shape != kv.shape
            or grad_score.dtype != cfg.dtype
            or ape.shape != (cfg.ratio, width)
            or ape.dtype != torch.float32
            or grad_ape.shape != ape.shape
            or grad_ape.dtype != torch.float32
            or grad_out.dim() != 2
            or grad_out.shape[1] != cfg.head_dim
            or grad_out.dtype != cfg.dtype
            or cu_seqlens.dtype != torch.int32
            or cu_seqlens_comp.shape != cu_seqlens.shape
            or cu_seqlens_comp.dtype != torch.int32
            or tokens * width >= INT32_LIMIT
            or rows * cfg.head_dim >= INT32_LIMIT
            or (rows > 0 and tokens < cfg.ratio)
        ):
            raise _Mismatch
    except _Mismatch:
        check_backward(*tensors, ratio=cfg.ratio, coff=cfg.coff)
        _check_same_config(cfg, kv)


def _check_same_config(cfg: Config, kv: torch.Tensor) -> None:
    width = cfg.coff * cfg.head_dim
    if kv.shape[1] != width or kv.dtype != cfg.dtype or kv.device != cfg.device:
        _fail(
            "execute() tensors must match the configuration compiled for",
            f"compiled for head_dim={cfg.head_dim}, coff={cfg.coff}, {cfg.dtype} on {cfg.device}; "
            f"got kv {tuple(kv.shape)} {kv.dtype} on {kv.device}",
        )
