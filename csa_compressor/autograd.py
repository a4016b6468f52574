"""Differentiable pooling and its fused tail: torch.library custom ops, an autograd.Function over them, and an
nn.Module.

The kernels are opaque to the compiler, so each direction is a ``torch.library``
custom op with a fake (meta) implementation: ``torch.compile(fullgraph=True)``
traces through it without graph breaks, and CUDA graphs capture it like any op.
The pooling alone keeps its own ops; a tail (RMSNorm, RoPE: docs/tail.md) has three more
(``pool_forward_tail``, ``pool_forward_tail_stats``, ``pool_backward_tail``), which take the tail's tensors as one
``Tensor?[]`` list and its three scalars flat (a schema is flat, and the list keeps it short).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import api, support
from .tail_args import is_default_tail
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


def _tail_args(tail_tensors, norm_eps, rope_dim, rope_interleaved) -> tuple:
    """The seven tail arguments (``tail_args.TAIL_ARGS``' order) of a tail op's tensor list and scalars."""
    if len(tail_tensors) != 4:
        raise ValueError(
            "csa_compressor: the tail ops' tail_tensors must be [norm_weight, rope_cos, rope_sin, position_start]: "
            f"got {len(tail_tensors)} entries"
        )
    norm_weight, rope_cos, rope_sin, position_start = tail_tensors
    return norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start


def _op_tail(tail_args) -> tuple:
    """A tail op's ``(tail_tensors, norm_eps, rope_dim, rope_interleaved)`` of the seven tail arguments."""
    norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start = tail_args
    return [norm_weight, rope_cos, rope_sin, position_start], norm_eps, rope_dim, rope_interleaved


def _forward_tail_outputs(inputs, ratio, coff, total_comp, backend, tail_args, return_stats, validate):
    """The tail forward ops' ``(out, rstd, softmax_stats)``, absent ones as empty tensors (an op returns tensors)."""
    out, rstd, stats = api._pool_forward_tail(
        inputs, ratio, coff, total_comp, backend, tail_args, return_stats=return_stats, return_rstd=True,
        validate=validate,
    )  # fmt: skip
    empty_rstd, empty_stats = _absent_forward_outputs(inputs[0], coff)
    return out, empty_rstd if rstd is None else rstd, empty_stats if stats is None else stats


def _absent_forward_outputs(kv, coff):
    d = kv.shape[-1] // coff
    return kv.new_empty((0,), dtype=torch.float32), kv.new_empty((0, 3, d), dtype=torch.float32)


@torch.library.custom_op("csa_compressor::pool_forward_tail", mutates_args=())
def _pool_forward_tail(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int,
    coff: int,
    total_comp: int,
    backend: str,
    tail_tensors: list[torch.Tensor | None],
    norm_eps: float,
    rope_dim: int,
    rope_interleaved: bool,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, rstd)``, ``rstd`` ``(total_comp,)`` with a norm, else ``(0,)``. ``tail_tensors``: ``[norm_weight,
    rope_cos, rope_sin, position_start]`` (each a tensor or None); the scalars are the tail's other three."""
    inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    tail_args = _tail_args(tail_tensors, norm_eps, rope_dim, rope_interleaved)
    out, rstd, _ = _forward_tail_outputs(inputs, ratio, coff, total_comp, backend, tail_args, False, validate)
    return out, rstd


def _fake_forward_tail(kv, ratio, coff, total_comp, tail_tensors, return_stats):
    _traced_scalars(ratio, coff, total_comp)
    d = kv.shape[-1] // coff
    rstd = kv.new_empty((total_comp if tail_tensors[0] is not None else 0,), dtype=torch.float32)
    stats = kv.new_empty((total_comp if return_stats else 0, 3, d), dtype=torch.float32)
    return kv.new_empty((total_comp, d)), rstd, stats


@_pool_forward_tail.register_fake
def _(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, tail_tensors, norm_eps, rope_dim,
    rope_interleaved, validate=False,
):  # fmt: skip
    return _fake_forward_tail(kv, ratio, coff, total_comp, tail_tensors, False)[:2]


@torch.library.custom_op("csa_compressor::pool_forward_tail_stats", mutates_args=())
def _pool_forward_tail_stats(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int,
    coff: int,
    total_comp: int,
    backend: str,
    tail_tensors: list[torch.Tensor | None],
    norm_eps: float,
    rope_dim: int,
    rope_interleaved: bool,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pool_forward_tail`` and the softmax statistics ``(total_comp, 3, d)`` of the pooling (long windows)."""
    inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    tail_args = _tail_args(tail_tensors, norm_eps, rope_dim, rope_interleaved)
    return _forward_tail_outputs(inputs, ratio, coff, total_comp, backend, tail_args, True, validate)


@_pool_forward_tail_stats.register_fake
def _(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, tail_tensors, norm_eps, rope_dim,
    rope_interleaved, validate=False,
):  # fmt: skip
    return _fake_forward_tail(kv, ratio, coff, total_comp, tail_tensors, True)


@torch.library.custom_op("csa_compressor::pool_backward_tail", mutates_args=())
def _pool_backward_tail(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    grad_out: torch.Tensor,
    ratio: int,
    coff: int,
    backend: str,
    tail_tensors: list[torch.Tensor | None],
    norm_eps: float,
    rope_dim: int,
    rope_interleaved: bool,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_kv, grad_score, grad_ape, grad_norm_weight)``, the last ``(d,)`` float32 with a norm, else ``(0,)``.

    ``tail_tensors``: the forward's four, then what it saved: ``[norm_weight, rope_cos, rope_sin, position_start,
    softmax_stats, rstd]`` (None where absent)."""
    if len(tail_tensors) != 6:
        raise ValueError(
            "csa_compressor: pool_backward_tail's tail_tensors must be [norm_weight, rope_cos, rope_sin, "
            f"position_start, softmax_stats, rstd]: got {len(tail_tensors)} entries"
        )
    tail_args = _tail_args(tail_tensors[:4], norm_eps, rope_dim, rope_interleaved)
    stats, rstd = tail_tensors[4:]
    *grads, grad_weight = api._pool_backward_tail(
        (kv, score, ape, cu_seqlens, cu_seqlens_comp), grad_out.contiguous(), ratio, coff, backend, tail_args,
        stats=stats, rstd=rstd, validate=validate,
    )  # fmt: skip
    return (*grads, kv.new_empty((0,), dtype=torch.float32) if grad_weight is None else grad_weight)


@_pool_backward_tail.register_fake
def _(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, backend, tail_tensors, norm_eps, rope_dim,
    rope_interleaved, validate=False,
):  # fmt: skip
    d = kv.shape[-1] // coff if tail_tensors[0] is not None else 0
    grad_weight = kv.new_empty((d,), dtype=torch.float32)
    return torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape), grad_weight


_PLAIN = (torch.Tensor, nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_pool_forward_op = torch.ops.csa_compressor.pool_forward.default
_pool_forward_stats_op = torch.ops.csa_compressor.pool_forward_stats.default
_pool_backward_op = torch.ops.csa_compressor.pool_backward.default
_pool_forward_tail_op = torch.ops.csa_compressor.pool_forward_tail.default
_pool_forward_tail_stats_op = torch.ops.csa_compressor.pool_forward_tail_stats.default
_pool_backward_tail_op = torch.ops.csa_compressor.pool_backward_tail.default


def _direct(kv, score, ape, cu_seqlens, cu_seqlens_comp) -> bool:
    """True when the custom op can be skipped: plain eager tensors, nothing tracing or intercepting.

    The custom op's dispatch (Python autograd and backend shims around the same wrapper) costs host time on
    every call, more than the launch itself. It is what torch.compile / export / make_fx
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


def _direct_tail(norm_weight, rope_cos, rope_sin, position_start) -> bool:
    return (
        (norm_weight is None or type(norm_weight) in _PLAIN)
        and (rope_cos is None or type(rope_cos) in _PLAIN)
        and (rope_sin is None or type(rope_sin) in _PLAIN)
        and (position_start is None or type(position_start) in _PLAIN)
    )


def _eager_tail(norm_weight, rope_cos, rope_sin, position_start) -> bool:
    """Whether a direct call's tail (``_direct_tail``) may leave its tables out of ``apply``'s inputs: neither asks
    for a gradient (an input that does makes the output require one, though none flows to it)."""
    return (
        _direct_tail(norm_weight, rope_cos, rope_sin, position_start)
        and (rope_cos is None or not rope_cos.requires_grad)
        and (rope_sin is None or not rope_sin.requires_grad)
    )


# The defaults of the tail's arguments after norm_weight, in compressor_pool's order.
_TAIL_REST_DEFAULTS = (1e-6, None, None, 0, True, None)


class CompressorPoolFunction(torch.autograd.Function):
    """autograd over the custom ops; gradients flow to ``kv``, ``score``, ``ape`` and ``norm_weight``.

    In plain eager mode (see ``_direct``) both directions call the wrappers' code directly; there
    ``compressor_pool`` with a tail takes ``_TailPoolFunction``, the same computation with fewer arguments.
    Long windows save the forward's softmax statistics ``(total_comp, 3, d)`` fp32 for the backward, which
    then reads each input once instead of twice, on the backends whose statistics pair is validated
    (``api.autograd_uses_stats``). With a norm the forward also saves each row's ``rstd`` (``total_comp``
    floats). The norm weight's gradient is computed in fp32 and handed back in the weight's dtype; the
    rotary tables and ``position_start`` get none.
    """

    @staticmethod
    def forward(
        ctx, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate=False,
        norm_weight=None, *tail_rest,
    ):  # fmt: skip
        """``tail_rest``: the tail's other six arguments in ``compressor_pool``'s order (``norm_eps``, ``rope_cos``,
        ``rope_sin``, ``rope_dim``, ``rope_interleaved``, ``position_start``), those not given at their defaults."""
        ctx.ratio, ctx.coff, ctx.backend, ctx.validate = ratio, coff, backend, validate
        if norm_weight is not None or tail_rest:
            tail_args = (norm_weight, *tail_rest, *_TAIL_REST_DEFAULTS[len(tail_rest) :])
            if len(tail_args) != len(_TAIL_REST_DEFAULTS) + 1:
                raise TypeError(f"CompressorPoolFunction takes at most 17 arguments, got {11 + len(tail_rest)}")
            if not is_default_tail(*tail_args):
                return _forward_tail(ctx, (kv, score, ape, cu_seqlens, cu_seqlens_comp), total_comp, tail_args)
        ctx.tail_scalars = None
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
        if ctx.tail_scalars is not None:
            grad_kv, grad_score, grad_ape, grad_weight = _backward_tail(ctx, grad_out)
            return (grad_kv, grad_score, grad_ape, *_NO_GRADS_BEFORE_WEIGHT, grad_weight, *_NO_GRADS_AFTER_WEIGHT)
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


class _TailPoolFunction(torch.autograd.Function):
    """``compressor_pool`` with a tail on the direct path (``_direct``, ``_eager_tail``): ``CompressorPoolFunction``'s
    tail path with what takes no gradient as one argument, since ``apply`` costs host time per argument (tracing
    and tensor subclasses keep ``CompressorPoolFunction`` and its custom ops)."""

    @staticmethod
    def forward(ctx, kv, score, ape, norm_weight, call):
        """``call``: ``((cu_seqlens, cu_seqlens_comp), ratio, coff, total_comp, backend, validate, tail_rest)``,
        ``tail_rest`` the tail's six arguments after ``norm_weight``, as ``CompressorPoolFunction`` takes them."""
        offsets, ratio, coff, total_comp, backend, validate, tail_rest = call
        ctx.ratio, ctx.coff, ctx.backend, ctx.validate = ratio, coff, backend, validate
        return _forward_tail(ctx, (kv, score, ape, *offsets), total_comp, (norm_weight, *tail_rest), direct=True)

    @staticmethod
    def backward(ctx, grad_out):
        grad_kv, grad_score, grad_ape, grad_weight = _backward_tail(ctx, grad_out)
        return grad_kv, grad_score, grad_ape, grad_weight, None


def _forward_tail(ctx, inputs, total_comp, tail_args, direct=None):
    """The forward with a tail: the tail ops (or their code, eagerly: ``direct``, tested here when None), rstd
    saved."""
    ratio, coff, backend, validate = ctx.ratio, ctx.coff, ctx.backend, ctx.validate
    norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start = tail_args
    # The backward's scalars in one attribute (the weight's dtype last): one write here, one read there.
    ctx.tail_scalars = (norm_eps, rope_dim, rope_interleaved, None if norm_weight is None else norm_weight.dtype)
    use_stats = api.autograd_uses_stats(inputs[0], ratio, coff, backend)
    if direct is None:
        direct = _direct(*inputs) and _direct_tail(norm_weight, rope_cos, rope_sin, position_start)
    if direct:
        out, rstd, stats = api._pool_forward_tail(
            inputs, ratio, coff, total_comp, backend, tail_args, return_stats=use_stats, return_rstd=True,
            validate=validate,
        )  # fmt: skip
    else:
        op_tail = _op_tail(tail_args)
        if use_stats:
            out, rstd, stats = _pool_forward_tail_stats_op(
                *inputs, ratio, coff, total_comp, backend, *op_tail, validate
            )
        else:
            (out, rstd), stats = (
                _pool_forward_tail_op(*inputs, ratio, coff, total_comp, backend, *op_tail, validate),
                None,
            )
        rstd = rstd if norm_weight is not None else None
    ctx.save_for_backward(*inputs, norm_weight, rope_cos, rope_sin, position_start, stats, rstd)
    return out


# What CompressorPoolFunction's backward returns for its arguments after ape (the offsets and scalars, then the
# tail's: the norm weight's gradient goes between them), composed once.
_NO_GRADS_BEFORE_WEIGHT = (None,) * 7
_NO_GRADS_AFTER_WEIGHT = (None,) * 6


def _backward_tail(ctx, grad_out):
    """The backward with a tail: ``(grad_kv, grad_score, grad_ape, grad_norm_weight or None)``."""
    kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, rope_cos, rope_sin, position_start, stats, rstd = (
        ctx.saved_tensors
    )
    norm_eps, rope_dim, rope_interleaved, norm_dtype = ctx.tail_scalars
    tail_args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
    inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    scalars = (ctx.ratio, ctx.coff, ctx.backend)
    direct = _direct(*inputs) and _direct_tail(norm_weight, rope_cos, rope_sin, position_start)
    if direct and type(grad_out) in _PLAIN:
        grad_kv, grad_score, grad_ape, grad_weight = api._pool_backward_tail(
            inputs, grad_out.contiguous(), *scalars, tail_args, stats=stats, rstd=rstd, validate=ctx.validate
        )
    else:
        tail_tensors, *tail_scalars = _op_tail(tail_args)
        grad_kv, grad_score, grad_ape, grad_weight = _pool_backward_tail_op(
            *inputs, grad_out, *scalars, [*tail_tensors, stats, rstd], *tail_scalars, ctx.validate
        )
    if norm_weight is None:
        grad_weight = None
    elif grad_weight.dtype != norm_dtype:
        grad_weight = grad_weight.to(norm_dtype)  # computed in fp32 (a sum over rows), stored as the weight
    return grad_kv, grad_score, grad_ape, grad_weight


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
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_dim: int = 0,
    rope_interleaved: bool = True,
    position_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable fused pooling: ``(T, coff*d)`` kv/score, ``(ratio, coff*d)`` ape -> ``(total_comp, d)``.

    ``total_comp=None`` reads ``cu_seqlens_comp[-1]`` on the host (one synchronisation); pass an
    int (a static capacity) for CUDA graphs and ``torch.compile``. ``validate=True`` (or
    ``CSA_COMPRESSOR_VALIDATE=1``) checks the offsets' contents before each launch (docs/safety.md).
    ``norm_weight`` .. ``position_start``: the fused tail, RMSNorm then RoPE on each row in the same kernels
    (docs/tail.md); gradients also flow to ``norm_weight``.
    """
    if total_comp is None:
        total_comp = int(cu_seqlens_comp[-1].item())
    if type(ratio) is not int or type(coff) is not int:  # numpy integers become ints; others a ValueError
        ratio, coff, _ = support.check_config(ratio, coff)
    if type(total_comp) is not int and not isinstance(total_comp, torch.SymInt):
        total_comp = support.check_total_comp(total_comp)
    if is_default_tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start):
        return CompressorPoolFunction.apply(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate
        )
    tail_rest = (norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
    direct = _direct(kv, score, ape, cu_seqlens, cu_seqlens_comp)
    if direct and _eager_tail(norm_weight, rope_cos, rope_sin, position_start):
        call = ((cu_seqlens, cu_seqlens_comp), ratio, coff, total_comp, backend, validate, tail_rest)
        return _TailPoolFunction.apply(kv, score, ape, norm_weight, call)
    return CompressorPoolFunction.apply(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, validate, norm_weight, *tail_rest
    )


class CompressorPool(nn.Module):
    """The pooling step of a CSA/HCA compressor, owning the absolute position embedding ``ape``.

    ``forward(kv, score, cu_seqlens, cu_seqlens_comp=None, total_comp=None, *, norm_weight=None, ...)`` takes
    ``kv``/``score`` as ``(T, coff*d)`` or Megatron-LM's ``(T, 1, coff*d)`` and returns ``(total_comp, d)`` or
    ``(total_comp, 1, d)`` to match. ``cu_seqlens_comp=None`` computes it on the device. The tail's keyword
    arguments (``compressor_pool``'s; the norm weight stays the caller's parameter) fuse RMSNorm and RoPE.
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

    def forward(
        self, kv, score, cu_seqlens, cu_seqlens_comp=None, total_comp=None, *, norm_weight=None, norm_eps=1e-6,
        rope_cos=None, rope_sin=None, rope_dim=0, rope_interleaved=True, position_start=None,
    ):  # fmt: skip
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
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            rope_cos=rope_cos,
            rope_sin=rope_sin,
            rope_dim=rope_dim,
            rope_interleaved=rope_interleaved,
            position_start=position_start,
        )
        return out.unsqueeze(1) if three_d else out
