"""Backend protocol (see ``csa_compressor.backends``) over the fp32 eager reference.

Runs anywhere PyTorch runs, including the CPU, and never synchronises with the
host, so it can be captured in a CUDA graph. It is the correctness baseline,
not a fast path: it materialises ``(N, coff*ratio, d)`` windows.
"""

from __future__ import annotations

import contextlib

import torch

from ... import reference


def unavailable_reason() -> str | None:
    return None


def device_unsupported_reason(device: torch.device) -> str | None:
    return None


def config_unsupported_reason(ratio: int, coff: int, head_dim: int) -> str | None:
    return None


def compile(direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """Nothing to build: eager PyTorch."""


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


AUTOGRAD_STATS = True  # the autograd function saves softmax statistics for this backend


def supports_stats(ratio: int, coff: int, head_dim: int) -> bool:
    return reference.uses_softmax_stats(ratio, coff)


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None) -> None:
    with _on(stream):
        if stats is not None:
            stats.copy_(
                reference.softmax_stats(
                    kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff, total_comp=out.shape[0]
                )
            )
        result = reference.forward(
            kv,
            score,
            ape,
            cu_seqlens,
            cu_seqlens_comp,
            ratio=ratio,
            coff=coff,
            total_comp=out.shape[0],
            precision="fp32",
        )
        out.copy_(result)


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
) -> None:
    with _on(stream):
        if stats is None:
            d_kv, d_score, d_ape = reference.backward(
                kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=ratio, coff=coff, precision="fp32"
            )
        else:
            d_kv, d_score, d_ape = reference.backward_from_stats(
                kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, stats, ratio=ratio, coff=coff
            )
        grad_kv.copy_(d_kv)
        grad_score.copy_(d_score)
        grad_ape.copy_(d_ape)
