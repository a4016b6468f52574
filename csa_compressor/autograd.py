"""Differentiable pooling: torch.library custom ops, an autograd.Function over them, and an nn.Module.

The kernels are opaque to the compiler, so each direction is a ``torch.library``
custom op with a fake (meta) implementation: ``torch.compile(fullgraph=True)``
traces through it without graph breaks, and CUDA graphs capture it like any op.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import api, support
from .thd import compute_cu_seqlens_comp

__all__ = ["CompressorPool", "CompressorPoolFunction", "compressor_pool"]


@torch.library.custom_op("csa_compressor::pool_forward", mutates_args=())
def _pool_forward(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int,
    coff: int,
    total_comp: int,
    backend: str,
    validate: bool = False,
) -> torch.Tensor:
    return api._pool_forward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate=validate
    )


def _traced_scalars(ratio, coff, total_comp) -> None:
    # While tracing, the fake implementations are where a bad scalar would first fail (as a torch error).
    support.check_config(ratio, coff)
    if not isinstance(total_comp, torch.SymInt):
        support.check_total_comp(total_comp)


@_pool_forward.register_fake
def _(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate=False):
    _traced_scalars(ratio, coff, total_comp)
    return kv.new_empty((total_comp, kv.shape[-1] // coff))


@torch.library.custom_op("csa_compressor::pool_forward_stats", mutates_args=())
def _pool_forward_stats(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int,
    coff: int,
    total_comp: int,
    backend: str,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return api._pool_forward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, return_stats=True,
        validate=validate,
    )  # fmt: skip


@_pool_forward_stats.register_fake
def _(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate=False):
    _traced_scalars(ratio, coff, total_comp)
    d = kv.shape[-1] // coff
    return kv.new_empty((total_comp, d)), kv.new_empty((total_comp, 3, d), dtype=torch.float32)


@torch.library.custom_op("csa_compressor::pool_backward", mutates_args=())
def _pool_backward(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    grad_out: torch.Tensor,
    ratio: int,
    coff: int,
    backend: str,
    softmax_stats: torch.Tensor | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return api._pool_backward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out.contiguous(), ratio, coff, backend, stats=softmax_stats,
        validate=validate,
    )  # fmt: skip


@_pool_backward.register_fake
def _(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, backend, softmax_stats=None, validate=False):
    return torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)


_PLAIN = (torch.Tensor, nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_pool_forward_op = torch.ops.csa_compressor.pool_forward.default
_pool_forward_stats_op = torch.ops.csa_compressor.pool_forward_stats.default
_pool_backward_op = torch.ops.csa_compressor.pool_backward.default


def _direct(kv, score, ape, cu_seqlens, cu_seqlens_comp) -> bool:
    """True when the custom op can be skipped: plain eager tensors, nothing tracing or intercepting.

    The custom op's dispatch (Python autograd and backend shims around the same wrapper) costs about
    10 us of host time per call on a desktop CPU. It is what torch.compile / export / make_fx
    (``is_compiling``, proxy and fake dispatch modes) and tensor subclasses (FakeTensor, DTensor,
    FunctionalTensor) need; in plain eager mode the result is the same without it.
    """
    return (
        not _is_compiling()
        and not _dispatch_modes()
        and type(kv) in _PLAIN
        and type(score) in _PLAIN
        and type(ape) in _PLAIN
        and type(cu_seqlens) in _PLAIN
        and type(cu_seqlens_comp) in _PLAIN
    )


class CompressorPoolFunction(torch.autograd.Function):
    """autograd over the two custom ops; gradients flow to ``kv``, ``score`` and ``ape``.

    In plain eager mode (see ``_direct``) both directions call the wrappers' code directly. Long windows
    save the forward's softmax statistics ``(total_comp, 3, d)`` fp32 for the backward, which then reads
    each input once instead of twice, on the backends whose statistics pair is validated
    (``api.autograd_uses_stats``).
    """

    @staticmethod
    def forward(ctx, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate=False):
        ctx.ratio, ctx.coff, ctx.backend, ctx.validate = ratio, coff, backend, validate
        direct = _direct(kv, score, ape, cu_seqlens, cu_seqlens_comp)
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend)
        if not api.autograd_uses_stats(kv, ratio, coff, backend):
            ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
            if direct:
                return api._pool_forward(*args, validate=validate)
            return _pool_forward_op(*args, validate)
        if direct:
            out, stats = api._pool_forward(*args, return_stats=True, validate=validate)
        else:
            out, stats = _pool_forward_stats_op(*args, validate)
        ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, stats)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        kv, score, ape, cu_seqlens, cu_seqlens_comp, *rest = ctx.saved_tensors
        stats = rest[0] if rest else None
        if _direct(kv, score, ape, cu_seqlens, cu_seqlens_comp) and type(grad_out) in _PLAIN:
            grad_kv, grad_score, grad_ape = api._pool_backward(
                kv,
                score,
                ape,
                cu_seqlens,
                cu_seqlens_comp,
                grad_out.contiguous(),
                ctx.ratio,
                ctx.coff,
                ctx.backend,
                stats=stats,
                validate=ctx.validate,
            )
        else:
            grad_kv, grad_score, grad_ape = _pool_backward_op(
                kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ctx.ratio, ctx.coff, ctx.backend, stats,
                ctx.validate,
            )  # fmt: skip
        return grad_kv, grad_score, grad_ape, None, None, None, None, None, None, None


def compressor_pool(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int = 4,
    coff: int = 2,
    total_comp: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """Differentiable fused pooling: ``(T, coff*d)`` kv/score, ``(ratio, coff*d)`` ape -> ``(total_comp, d)``.

    ``total_comp=None`` reads ``cu_seqlens_comp[-1]`` on the host (one synchronisation); pass an
    int (a static capacity) for CUDA graphs and ``torch.compile``. ``validate=True`` (or
    ``CSA_COMPRESSOR_VALIDATE=1``) checks the offsets' contents before each launch (docs/safety.md).
    """
    if total_comp is None:
        total_comp = int(cu_seqlens_comp[-1].item())
    if type(ratio) is not int or type(coff) is not int:  # numpy integers become ints; others a ValueError
        ratio, coff, _ = support.check_config(ratio, coff)
    if type(total_comp) is not int and not isinstance(total_comp, torch.SymInt):
        total_comp = support.check_total_comp(total_comp)
    return CompressorPoolFunction.apply(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate
    )


class CompressorPool(nn.Module):
    """The pooling step of a CSA/HCA compressor, owning the absolute position embedding ``ape``.

    ``forward(kv, score, cu_seqlens, cu_seqlens_comp=None, total_comp=None)`` takes ``kv``/``score``
    as ``(T, coff*d)`` or Megatron-LM's ``(T, 1, coff*d)`` and returns ``(total_comp, d)`` or
    ``(total_comp, 1, d)`` to match. ``cu_seqlens_comp=None`` computes it on the device.
    ``validate=True`` (an attribute too): check the offsets' contents before each launch (docs/safety.md).
    """

    def __init__(
        self, ratio: int, head_dim: int, coff: int = 2, backend: str = "auto", device=None, validate: bool = False
    ):
        super().__init__()
        if head_dim is None:
            raise ValueError("csa_compressor: CompressorPool needs a head_dim (it sizes ape): got None")
        ratio, coff, head_dim = support.check_config(ratio, coff, head_dim)
        self.ratio, self.head_dim, self.coff, self.backend, self.validate = ratio, head_dim, coff, backend, validate
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.ape, std=1.0 / math.sqrt(self.head_dim))

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}, head_dim={self.head_dim}, coff={self.coff}, backend={self.backend!r}, validate={self.validate}"

    def forward(self, kv, score, cu_seqlens, cu_seqlens_comp=None, total_comp=None):
        width = self.coff * self.head_dim
        three_d = kv.dim() == 3
        if three_d:
            if kv.shape[1] != 1 or score.shape != kv.shape:
                raise ValueError(
                    f"csa_compressor: 3-D kv/score must be (T, 1, {width}), got {tuple(kv.shape)} and {tuple(score.shape)}"
                )
            kv, score = kv.reshape(kv.shape[0], width), score.reshape(score.shape[0], width)
        if cu_seqlens_comp is None:
            cu_seqlens_comp = compute_cu_seqlens_comp(cu_seqlens, self.ratio)
        out = compressor_pool(
            kv.contiguous(),
            score.contiguous(),
            self.ape,
            cu_seqlens,
            cu_seqlens_comp,
            ratio=self.ratio,
            coff=self.coff,
            total_comp=total_comp,
            backend=self.backend,
            validate=self.validate,
        )
        return out.unsqueeze(1) if three_d else out
