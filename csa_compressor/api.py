"""Public kernel API: the check_support / compile / execute classes (``kernel_api``) and the allocating wrappers
(SPEC section 4), each with the optional fused tail (docs/tail.md)."""

from __future__ import annotations

import torch

from . import dispatch, support
from .kernel_api import CSACompressorBackward, CSACompressorForward, TupleDict, _Op
from .tail import Tail
from .tail_args import TAIL_ARGS, is_default_tail, tail_config
from .windows import uses_softmax_stats

__all__ = [
    "CSACompressorBackward",
    "CSACompressorForward",
    "TupleDict",
    "csa_compressor_backward_wrapper",
    "csa_compressor_forward_wrapper",
]

# ---------------------------------------------------------------- wrappers


def _rows_on_device(cu_seqlens_comp) -> int:
    # Convenience path: one host synchronisation. Pass total_comp to avoid it (CUDA graphs must).
    return int(cu_seqlens_comp[-1].item())


# Wrapper ops, compiled on the first call of a configuration (samples dropped after compile, so the cache
# holds no device memory). Two levels:
# - _OPS: the full key (direction, ratio, coff, head_dim, dtype, device, resolved backend request, TailConfig);
# - _FWD_FAST / _BWD_FAST: the wrapper's raw arguments (ratio, coff, head_dim or None, kv width, backend
#   argument, raw $CSA_COMPRESSOR_BACKEND, dtype, device) -> op, filled after a successful slow call. A hit
#   skips argument normalisation; the op's recheck still tests every argument against its configuration.
#   _FWD_TAIL_FAST / _BWD_TAIL_FAST: the same key and the tail's raw configuration (_tail_key).
_OPS: dict[tuple, _Op] = {}
_FWD_FAST: dict[tuple, _Op] = {}
_BWD_FAST: dict[tuple, _Op] = {}
_FWD_TAIL_FAST: dict[tuple, _Op] = {}
_BWD_TAIL_FAST: dict[tuple, _Op] = {}
_env_token = dispatch.env_token


def _op(cls, direction: str, tensors, ratio, coff, head_dim, backend, tail_args=None) -> _Op:
    """The cached op of a configuration; ``tail_args`` (the seven tail arguments, checked here) pick its tail."""
    backend = dispatch.requested_backend(backend)
    kv, cu_seqlens = tensors[0], tensors[3]
    tail_kw = {} if tail_args is None else dict(zip(TAIL_ARGS, tail_args, strict=True))
    tail_cfg = None
    if tail_args is not None:
        tail_cfg = tail_config(Tail(*tail_args), head_dim=head_dim, batch=cu_seqlens.shape[0] - 1, device=kv.device)
    key = (direction, ratio, coff, head_dim, kv.dtype, kv.device, backend, tail_cfg)
    op = _OPS.get(key)
    if op is None:
        op = cls(*tensors, ratio=ratio, coff=coff, head_dim=head_dim, backend=backend, **tail_kw)
        op.compile()
        op._release_samples()
        _OPS[key] = op
    return op


def _fast_key(kv, ratio, coff, head_dim, backend):
    """The fast-cache key of a wrapper call, or None when an argument needs the full (validating) path."""
    if type(ratio) is not int or type(coff) is not int or not (head_dim is None or type(head_dim) is int):
        return None  # 4.0 == 4 and True == 1 as dict keys: floats and bools must reach check_config
    try:
        return (ratio, coff, head_dim, kv.shape[-1], backend, _env_token(), kv.dtype, kv.device)
    except (AttributeError, IndexError, TypeError):  # not a tensor, rank 0, unhashable backend
        return None


def _tail_key(kv, ratio, coff, head_dim, backend, tail_args):
    """``_fast_key`` with the tail's raw configuration, or None (the full path); the op's TailCheck tests the rest."""
    key = _fast_key(kv, ratio, coff, head_dim, backend)
    norm_weight, _eps, _cos, _sin, rope_dim, rope_interleaved, position_start = tail_args
    if key is None or type(rope_dim) is not int or type(rope_interleaved) is not bool:
        return None
    return (*key, getattr(norm_weight, "dtype", None), rope_dim, rope_interleaved, position_start is None)


def _forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, backend, key, tail_args=None):
    """The forward wrapper's slow path: the scalars and tensors checked (the first broken bound named), the op
    built and cached. ``total_comp`` is the op's recheck's business."""
    ratio, coff, head_dim = support.check_config(ratio, coff, head_dim)
    pack = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    head_dim = support.check_forward_fresh(*pack, 0, ratio=ratio, coff=coff, head_dim=head_dim).head_dim
    samples = (*pack, kv.new_empty((0, head_dim)))
    op = _op(CSACompressorForward, "forward", samples, ratio, coff, head_dim, backend, tail_args)
    if key is not None:
        (_FWD_FAST if tail_args is None else _FWD_TAIL_FAST)[key] = op
    return op


def _backward_op(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, backend, key, tail_args=None
):
    """The backward wrapper's slow path (see ``_forward_op``)."""
    ratio, coff, head_dim = support.check_config(ratio, coff, head_dim)
    pack = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out)
    head_dim = support.check_backward_fresh(*pack, ratio=ratio, coff=coff, head_dim=head_dim).head_dim
    grads = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    op = _op(CSACompressorBackward, "backward", (*pack, *grads), ratio, coff, head_dim, backend, tail_args)
    if key is not None:
        (_BWD_FAST if tail_args is None else _BWD_TAIL_FAST)[key] = op
    return op


_AUTOGRAD_STATS: dict[tuple, bool] = {}


def autograd_uses_stats(kv, ratio, coff, backend) -> bool:
    """Whether the autograd function saves the forward's softmax statistics for this call's backend.

    Long windows only (``windows.uses_softmax_stats``), and only on backends whose statistics pair is
    validated at full size on the GPU (their ``AUTOGRAD_STATS``); elsewhere the backward makes its own
    statistics. Cached per (device, backend request, configuration, $CSA_COMPRESSOR_BACKEND).
    """
    if type(ratio) is not int or type(coff) is not int or not uses_softmax_stats(ratio, coff):
        return False
    return _autograd_stats_for(kv.device, backend, ratio, coff, int(kv.shape[-1]))


def _autograd_stats_for(device, backend, ratio: int, coff: int, width: int) -> bool:
    key = (device, backend, ratio, coff, width, _env_token())
    hit = _AUTOGRAD_STATS.get(key)
    if hit is None:
        try:
            name = dispatch.resolve_backend(backend, device, ratio, coff, width // coff)
        except (ValueError, RuntimeError):
            return False  # the forward call reports the problem
        hit = bool(getattr(dispatch.backend_module(name), "AUTOGRAD_STATS", False))
        _AUTOGRAD_STATS[key] = hit
    return hit


# Under torch.compile the lookup is evaluated once while tracing and is a constant after: what
# torch.compiler.assume_constant_result does, without its import of torch._dynamo here, which would import
# triton before the self-check can select its interpreter (tests/test_stats.py checks that the two agree).
_autograd_stats_for._dynamo_marked_constant = True


def _cached_forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, backend):
    """The forward op of this configuration: the fast cache's, else built (first call, or arguments that need
    normalising)."""
    key = _fast_key(kv, ratio, coff, head_dim, backend)
    op = _FWD_FAST.get(key) if key is not None else None
    if op is None:
        op = _forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, backend, key)
    return op


def _cached_backward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, backend):
    """The backward op of this configuration, as ``_cached_forward_op``."""
    key = _fast_key(kv, ratio, coff, head_dim, backend)
    op = _BWD_FAST.get(key) if key is not None else None
    if op is None:
        op = _backward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, backend, key)
    return op


def _pool_forward(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    ratio,
    coff,
    total_comp,
    backend,
    head_dim=None,
    stream=None,
    return_stats=False,
    validate=False,
):
    """The forward wrapper without the TupleDict: returns ``out`` (also the autograd op's eager path), or
    ``(out, softmax_stats)`` with ``return_stats`` (long windows only)."""
    op = _cached_forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, backend)
    if total_comp is None:
        total_comp = _rows_on_device(cu_seqlens_comp)
    if return_stats:
        return op._run_fresh_stats(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, stream, validate)
    return op._run_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, stream, validate)


def _pool_backward(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    ratio,
    coff,
    backend,
    head_dim=None,
    stream=None,
    stats=None,
    validate=False,
):
    """The backward wrapper without the TupleDict: returns ``(grad_kv, grad_score, grad_ape)``."""
    op = _cached_backward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, backend)
    return op._run_fresh(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, stream, stats, validate)


def _pool_forward_into(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, backend, stats=None):
    """The forward wrapper's op writing ``out`` (its rows: ``out.shape[0]``) and, given (long windows), the
    softmax statistics ``stats``, buffers of the caller's; returns ``out``."""
    op = _cached_forward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, None, backend)
    return op.execute(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, softmax_stats=stats)


def _pool_backward_into(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grads, ratio, coff, backend,
                        stats=None):  # fmt: skip
    """The backward wrapper's op overwriting ``grads`` (grad_kv, grad_score, grad_ape: the caller's buffers)."""
    op = _cached_backward_op(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, None, backend)
    return op.execute(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads, softmax_stats=stats)


def _tail_op(inputs, grad_out, ratio, coff, backend, tail_args, head_dim=None):
    """The cached op of a call with the tail: the backward's with ``grad_out``, else the forward's."""
    key = _tail_key(inputs[0], ratio, coff, head_dim, backend, tail_args)
    op = (_FWD_TAIL_FAST if grad_out is None else _BWD_TAIL_FAST).get(key) if key is not None else None
    if op is not None:
        return op
    if grad_out is None:
        return _forward_op(*inputs, ratio, coff, head_dim, backend, key, tail_args)
    return _backward_op(*inputs, grad_out, ratio, coff, head_dim, backend, key, tail_args)


def _pool_forward_tail_into(inputs, out, ratio, coff, backend, tail_args, stats=None, rstd=None):
    """``_pool_forward_into`` with the seven tail arguments ``tail_args``; ``rstd``: a ``(rows,)`` float32 buffer
    for the rows' rstd (with a norm), or None."""
    op = _tail_op(inputs, None, ratio, coff, backend, tail_args)
    return op.execute(*inputs, out, softmax_stats=stats, rstd=rstd, **dict(zip(TAIL_ARGS, tail_args, strict=True)))


def _pool_backward_tail_into(inputs, grad_out, grads, ratio, coff, backend, tail_args, stats=None, rstd=None,
                             grad_norm_weight=None):  # fmt: skip
    """``_pool_backward_into`` with the tail: ``grad_norm_weight`` (with a norm) is overwritten too."""
    op = _tail_op(inputs, grad_out, ratio, coff, backend, tail_args)
    tail_kw = dict(zip(TAIL_ARGS, tail_args, strict=True))
    return op.execute(*inputs, grad_out, *grads, softmax_stats=stats, rstd=rstd, grad_norm_weight=grad_norm_weight,
                      **tail_kw)  # fmt: skip


def _pool_forward_tail(
    inputs, ratio, coff, total_comp, backend, tail_args, head_dim=None, stream=None, return_stats=False,
    return_rstd=False, validate=False,
):  # fmt: skip
    """The forward of ``inputs`` (kv, score, ape, cu_seqlens, cu_seqlens_comp) with the seven tail arguments
    ``tail_args``: ``(out, rstd, softmax_stats)``, rstd (with a norm and ``return_rstd``) and the statistics
    (``return_stats``) None where absent."""
    op = _tail_op(inputs, None, ratio, coff, backend, tail_args, head_dim)
    if total_comp is None:
        total_comp = _rows_on_device(inputs[4])
    return op._run_fresh_tail(inputs, total_comp, tail_args, stream, return_stats, return_rstd, validate)


def _pool_backward_tail(
    inputs, grad_out, ratio, coff, backend, tail_args, head_dim=None, stream=None, stats=None, rstd=None,
    validate=False,
):  # fmt: skip
    """The backward of ``inputs`` (as for the forward) with the tail: ``(grad_kv, grad_score, grad_ape,
    grad_norm_weight or None)``."""
    op = _tail_op(inputs, grad_out, ratio, coff, backend, tail_args, head_dim)
    return op._run_fresh_tail(inputs, grad_out, tail_args, stream, stats, rstd, validate)


def csa_compressor_forward_wrapper(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    ratio: int = 4,
    head_dim: int | None = None,
    coff: int = 2,
    total_comp: int | None = None,
    stream=None,
    backend: str | None = "auto",
    return_softmax_stats: bool = False,
    validate: bool = False,
    norm_weight=None,
    norm_eps: float = 1e-6,
    rope_cos=None,
    rope_sin=None,
    rope_dim: int = 0,
    rope_interleaved: bool = True,
    position_start=None,
) -> TupleDict:
    """Allocate ``out`` and run the forward. ``total_comp=None`` reads ``cu_seqlens_comp[-1]`` (one host sync).

    ``return_softmax_stats=True`` (windows of more than 16 slots): also ``softmax_stats``, the
    ``(total_comp, 3, head_dim)`` float32 statistics the backward wrapper takes to skip a pass over the window
    (``softmax_stats[:, 2]`` is the pooled row before any tail).
    ``validate=True`` (or ``CSA_COMPRESSOR_VALIDATE=1``): check the offsets' contents on the device first (one
    host synchronisation; refused under CUDA-graph capture), see ``validate_pack``.
    ``norm_weight`` .. ``position_start``: the fused tail, RMSNorm then RoPE on each row (docs/tail.md).
    """
    if not is_default_tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start):
        tail_args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        out, _, stats = _pool_forward_tail(
            inputs, ratio, coff, total_comp, backend, tail_args, head_dim, stream, return_softmax_stats, False, validate
        )  # fmt: skip
        return TupleDict(out=out, softmax_stats=stats) if return_softmax_stats else TupleDict(out=out)
    if return_softmax_stats:
        out, stats = _pool_forward(
            kv,
            score,
            ape,
            cu_seqlens,
            cu_seqlens_comp,
            ratio,
            coff,
            total_comp,
            backend,
            head_dim,
            stream,
            True,
            validate,
        )
        return TupleDict(out=out, softmax_stats=stats)
    out = _pool_forward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, head_dim, stream, False, validate
    )
    return TupleDict(out=out)


def csa_compressor_backward_wrapper(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    ratio: int = 4,
    head_dim: int | None = None,
    coff: int = 2,
    total_comp: int | None = None,
    stream=None,
    backend: str | None = "auto",
    softmax_stats=None,
    validate: bool = False,
    norm_weight=None,
    norm_eps: float = 1e-6,
    rope_cos=None,
    rope_sin=None,
    rope_dim: int = 0,
    rope_interleaved: bool = True,
    position_start=None,
) -> TupleDict:
    """Allocate and compute ``grad_kv``, ``grad_score`` (``empty``: the kernel writes every element) and ``grad_ape``.

    ``softmax_stats``: the forward wrapper's ``softmax_stats`` for the same inputs (long windows), or None.
    ``validate``: as for the forward wrapper. With the tail's arguments (as given to the forward), ``grad_out``
    is the gradient of the tail's output, and a norm adds ``grad_norm_weight`` ``(head_dim,)`` float32.
    """
    if total_comp is not None:
        support.check_total_comp_rows(total_comp, grad_out)
    if not is_default_tail(norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start):
        tail_args = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        *grads, grad_weight = _pool_backward_tail(
            inputs, grad_out, ratio, coff, backend, tail_args, head_dim, stream, softmax_stats, None, validate
        )  # fmt: skip
        result = TupleDict(grad_kv=grads[0], grad_score=grads[1], grad_ape=grads[2])
        if grad_weight is not None:
            result["grad_norm_weight"] = grad_weight
        return result
    grad_kv, grad_score, grad_ape = _pool_backward(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, backend, head_dim, stream, softmax_stats,
        validate,
    )  # fmt: skip
    return TupleDict(grad_kv=grad_kv, grad_score=grad_score, grad_ape=grad_ape)
