"""Backend protocol (see ``csa_compressor.backends``) over the fp32 eager reference.

Runs anywhere PyTorch runs, including the CPU, and never synchronises with the
host, so it can be captured in a CUDA graph. It is the correctness baseline,
not a fast path: it materialises ``(N, coff*ratio, d)`` windows. The fused tail is
``csa_compressor.tail`` at fp32 (one rounding).
"""

from __future__ import annotations

import contextlib

import torch

from ... import reference
from ... import tail as tails


def unavailable_reason() -> str | None:
    return None


def device_unsupported_reason(device: torch.device) -> str | None:
    return None


def config_unsupported_reason(ratio: int, coff: int, head_dim: int) -> str | None:
    return None


def compile(
    direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, device: torch.device, tail_config=None
) -> None:
    """Nothing to build: eager PyTorch."""


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


AUTOGRAD_STATS = True  # the autograd function saves softmax statistics for this backend


def supports_stats(ratio: int, coff: int, head_dim: int) -> bool:
    return reference.uses_softmax_stats(ratio, coff)


def supports_tail(ratio: int, coff: int, head_dim: int, tail_config) -> bool:
    return True


# The backend writes into the caller's buffers as a kernel does: no autograd graph through inputs that require grad.
@torch.no_grad()
def forward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None, tail=None, rstd=None
) -> None:
    pool = dict(ratio=ratio, coff=coff, total_comp=out.shape[0])
    with _on(stream):
        if stats is not None:
            stats.copy_(reference.softmax_stats(kv, score, ape, cu_seqlens, cu_seqlens_comp, **pool))
        if tail is None:
            result = reference.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, precision="fp32", **pool)
        else:
            result = tails.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, precision="fp32", **pool)
            if rstd is not None:
                _fill_rstd(rstd, kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, pool)
        out.copy_(result)


def _fill_rstd(rstd, kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, pool) -> None:
    if not tail.has_norm:
        rstd.fill_(1.0)
        return
    x = tails.pooled_rows(kv, score, ape, cu_seqlens, cu_seqlens_comp, dtype=torch.float32, **pool)
    rstd.copy_(tails.row_rstd(x, tail.norm_eps).reshape(-1))


@torch.no_grad()
def backward(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    grad_kv,
    grad_score,
    grad_ape,
    ratio,
    coff,
    stream=None,
    stats=None,
    tail=None,
    grad_norm_weight=None,
    rstd=None,
) -> None:
    inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
    with _on(stream):
        if tail is not None:
            d_kv, d_score, d_ape, d_weight = _tail_backward(inputs, grad_out, stats, tail, rstd, ratio, coff)
            if d_weight is not None:
                grad_norm_weight.copy_(d_weight)
        elif stats is None:
            d_kv, d_score, d_ape = reference.backward(*inputs, grad_out, ratio=ratio, coff=coff, precision="fp32")
        else:
            d_kv, d_score, d_ape = reference.backward_from_stats(*inputs, grad_out, stats, ratio=ratio, coff=coff)
        grad_kv.copy_(d_kv)
        grad_score.copy_(d_score)
        grad_ape.copy_(d_ape)


def _tail_backward(inputs, grad_out, stats, tail, rstd, ratio, coff):
    """``(grad_kv, grad_score, grad_ape, grad_norm_weight)``; with statistics the norm's ``x`` is ``stats[:, 2]``."""
    if stats is None:
        return tails.backward(*inputs, grad_out, tail, ratio=ratio, coff=coff, precision="fp32", rstd=rstd)
    cu_seqlens_comp = inputs[4]
    dx, d_weight = tails.row_gradient(
        stats[:, 2], grad_out, tail, cu_seqlens_comp, ratio=ratio, dtype=torch.float32, rstd=rstd
    )
    grads = reference.backward_from_stats(*inputs, dx, stats, ratio=ratio, coff=coff)
    return (*grads, d_weight)
