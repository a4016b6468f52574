"""Pack builders and comparison helpers shared by the tests, the self-check and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .thd import compute_cu_seqlens_comp

__all__ = ["Pack", "bf16_ulp_distance", "make_pack", "rel_l2"]


@dataclass
class Pack:
    """One THD problem: inputs, an upstream gradient and its configuration."""

    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_comp: torch.Tensor
    grad_out: torch.Tensor
    ratio: int
    coff: int
    head_dim: int
    total_comp: int
    seqlens: tuple[int, ...]

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.kv, self.score, self.ape, self.cu_seqlens, self.cu_seqlens_comp

    @property
    def true_comp(self) -> int:
        return sum(s // self.ratio for s in self.seqlens)


def make_pack(
    seqlens,
    head_dim: int,
    ratio: int,
    coff: int,
    *,
    token_padding: int = 0,
    comp_padding: int = 0,
    device="cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    score_scale: float = 1.0,
) -> Pack:
    """Random pack with ``token_padding`` rows past ``cu_seqlens[-1]`` and ``comp_padding`` output rows past the real ones.

    Values are drawn so that softmax weights are far from uniform (``score_scale``)
    and so that nothing is zero by accident.
    """
    seqlens = tuple(int(s) for s in seqlens)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total_tokens = sum(seqlens) + token_padding
    width = coff * head_dim
    kv = torch.randn(total_tokens, width, generator=gen).to(dtype)
    score = (torch.randn(total_tokens, width, generator=gen) * score_scale).to(dtype)
    ape = torch.randn(ratio, width, generator=gen) * 0.5
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0).to(torch.int32)
    cu_comp = compute_cu_seqlens_comp(cu, ratio)
    total_comp = sum(s // ratio for s in seqlens) + comp_padding
    grad_out = torch.randn(total_comp, head_dim, generator=gen).to(dtype)
    tensors = [t.to(device) for t in (kv, score, ape, cu, cu_comp, grad_out)]
    return Pack(*tensors, ratio=ratio, coff=coff, head_dim=head_dim, total_comp=total_comp, seqlens=seqlens)


def _ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """Map bf16 bit patterns to integers whose difference counts ulps (-0 and +0 coincide)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def bf16_ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in bf16 ulps; NaN against NaN is 0, NaN against a number is huge."""
    if actual.dtype != torch.bfloat16 or expected.dtype != torch.bfloat16:
        raise TypeError("bf16_ulp_distance compares two bfloat16 tensors")
    a, e = actual.detach().cpu(), expected.detach().cpu()
    dist = (_ordered_bf16(a) - _ordered_bf16(e)).abs()
    both_nan = torch.isnan(a) & torch.isnan(e)
    one_nan = torch.isnan(a) ^ torch.isnan(e)
    dist = torch.where(both_nan, torch.zeros_like(dist), dist)
    return torch.where(one_nan, torch.full_like(dist, 1 << 20), dist)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are zero)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    den = torch.linalg.vector_norm(e)
    num = torch.linalg.vector_norm(a - e)
    if den == 0:
        return float(num)
    return float(num / den)
