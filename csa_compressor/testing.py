"""Pack builders and comparison helpers shared by the tests, the self-check and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .thd import compute_cu_seqlens_comp

__all__ = [
    "Pack",
    "assert_contract",
    "bf16_ulp_distance",
    "bitwise_equal",
    "contract_report",
    "make_pack",
    "misaligned_copy",
    "rel_l2",
    "truncated_pack",
]


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


def truncated_pack(pack: Pack) -> tuple[Pack, torch.Tensor]:
    """The eager region truncated to ``pack.total_comp`` rows, as a well-formed pack of its own, and ``keep``: the
    token of ``pack`` each of its tokens is (``pack`` itself and all tokens when nothing is truncated).

    A segment keeps the tokens of its rows below ``total_comp`` (all of them, tail included, when every row is
    kept); the tokens of dropped rows leave the pack. So ``pack``'s gradients are the truncated pack's at
    ``keep`` and exact zeros elsewhere, and its output is the truncated pack's (SEMANTICS: total_comp below the
    real rows). ``pack``'s offsets must be well-formed.
    """
    cu, comp = pack.cu_seqlens.tolist(), pack.cu_seqlens_comp.tolist()
    rows, ratio, device = pack.total_comp, pack.ratio, pack.kv.device
    if rows >= comp[-1]:
        return pack, torch.arange(pack.kv.shape[0], device=device)
    keep, seqlens = [], []
    for b in range(len(cu) - 1):
        segment_rows = comp[b + 1] - comp[b]
        kept = max(0, min(segment_rows, rows - comp[b]))
        length = cu[b + 1] - cu[b] if kept == segment_rows else kept * ratio
        keep.extend(range(cu[b], cu[b] + length))
        seqlens.append(length)
    keep = torch.tensor(keep, dtype=torch.int64, device=device)
    new_cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    new_cu[1:] = torch.cumsum(torch.tensor(seqlens, dtype=torch.int64), 0).to(torch.int32)
    new_cu = new_cu.to(device)
    truncated = Pack(
        pack.kv[keep],
        pack.score[keep],
        pack.ape,
        new_cu,
        compute_cu_seqlens_comp(new_cu, ratio),
        pack.grad_out,
        ratio=ratio,
        coff=pack.coff,
        head_dim=pack.head_dim,
        total_comp=rows,
        seqlens=tuple(seqlens),
    )
    return truncated, keep


def misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values one element into a fresh buffer on its device: contiguous, not 16-byte aligned (the
    alignment checks' negative case)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


def _ordered_bf16(x: torch.Tensor) -> torch.Tensor:
    """Map bf16 bit patterns to integers whose difference counts ulps (-0 and +0 coincide)."""
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaNs included), or are both None. Compared as integers of the
    element's size: a view of another size needs the last stride 1, which torch does not promise (an empty or
    expanded tensor)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = _SAME_SIZE_INT[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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


# ---------------------------------------------------------------- the SPEC section 3 contract

FP32_SLACK_ULPS = 16  # fp32 rounding noise allowed where a result cancels, in fp32 ulps of the magnitudes summed


def _cancellation_scales(pack: Pack):
    """Magnitudes whose fp32 rounding noise bounds each result, and the consumed-position mask.

    ``out = sum p*v`` and ``dlogit = p*(g*v - sum p*g*v)`` can cancel to nearly zero; there two correct
    fp32 evaluations in different orders (the reference, a kernel) differ by many bf16 ulps of a tiny
    value. The contract is then read as: as close as fp32 arithmetic can be, i.e. within
    ``FP32_SLACK_ULPS`` fp32 ulps of the summed magnitudes ``sum p*|v|`` and ``p*(|g*v| + sum p*|g*v|)``.
    """
    from . import reference

    ratio, coff = pack.ratio, pack.coff
    tokens, width = pack.kv.shape
    win = reference._window(pack.cu_seqlens, pack.cu_seqlens_comp, pack.total_comp, tokens, ratio, coff)
    values, logits = reference._windows(pack.kv.double(), pack.score, pack.ape, win, ratio, coff, torch.float64)
    p = torch.softmax(logits, dim=1)
    out_scale = (p * values.abs()).sum(dim=1)
    g = torch.where(win.is_real[:, None], pack.grad_out.double(), 0.0)[:, None, :]
    gv = (g * values).abs()
    score_scale = p * (gv + (gv * p).sum(dim=1, keepdim=True))
    used = torch.where((win.valid & win.is_real[:, None])[:, :, None], torch.ones_like(p), 0.0)
    score_scale = reference._scatter(score_scale, win.scatter_idx, tokens, width, ratio, coff)
    consumed = reference._scatter(used, win.scatter_idx, tokens, width, ratio, coff) > 0
    return out_scale, score_scale, consumed


def _beyond(actual, expected, scale, max_ulp: int) -> tuple[int, int]:
    """(max ulp distance, count of elements beyond ``max_ulp`` and outside the fp32 slack)."""
    if actual.numel() == 0:
        return 0, 0
    ulps = bf16_ulp_distance(actual, expected)
    diff = (actual.detach().double() - expected.detach().double()).abs().cpu()
    slack = diff <= FP32_SLACK_ULPS * 2.0**-24 * scale.detach().cpu()
    return int(ulps.max()), int(((ulps > max_ulp) & ~slack).sum())


def contract_report(pack: Pack, out=None, grads=None, max_ulp: int = 1) -> dict:
    """Check kernel results against SPEC section 3 and return the measured figures with ``ok``.

    - forward: within ``max_ulp`` bf16 ulp of the fp32 reference (or within fp32 noise where the sum
      cancels), and its max error vs the fp64 oracle no larger than the upstream reference's;
    - grad_kv: within ``max_ulp`` ulp (``g*p`` cannot cancel); grad_score like the forward;
    - unconsumed positions of grad_kv/grad_score are exact +0;
    - grad_ape: relative L2 error vs the fp64 oracle <= 1e-5.
    """
    from . import reference

    kw = dict(ratio=pack.ratio, coff=pack.coff)
    out_scale, score_scale, consumed = _cancellation_scales(pack)
    report: dict = {"ok": True}
    if out is not None:
        ref32 = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **kw)
        ref64 = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp64", **kw)
        up = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="upstream", **kw)
        report["fwd_ulp"], report["fwd_beyond"] = _beyond(out, ref32, out_scale, max_ulp)
        report["fwd_bitwise"] = bool(torch.equal(out.view(torch.int16), ref32.view(torch.int16)))
        if out.numel():
            report["fwd_err"] = float((out.double() - ref64).abs().max())
            report["upstream_err"] = float((up.double() - ref64).abs().max())
        else:
            report["fwd_err"] = report["upstream_err"] = 0.0
        report["ok"] &= report["fwd_beyond"] == 0 and report["fwd_err"] <= report["upstream_err"]
        report["ok"] &= not bool(torch.isnan(out).any()) or bool(torch.isnan(ref32).any())
    if grads is not None:
        grad_kv, grad_score, grad_ape = grads
        g32 = reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw)
        g64 = reference.backward(*pack.inputs, pack.grad_out, precision="fp64", **kw)
        report["dkv_ulp"] = int(bf16_ulp_distance(grad_kv, g32[0]).max()) if grad_kv.numel() else 0
        report["dscore_ulp"], report["dscore_beyond"] = _beyond(grad_score, g32[1], score_scale, max_ulp)
        report["dkv_bitwise"] = bool(torch.equal(grad_kv.view(torch.int16), g32[0].view(torch.int16)))
        report["dscore_bitwise"] = bool(torch.equal(grad_score.view(torch.int16), g32[1].view(torch.int16)))
        mask = consumed.to(grad_kv.device)
        zeros_exact = all(not bool(t.view(torch.int16)[~mask].any()) for t in (grad_kv, grad_score))
        report["zeros_exact"] = zeros_exact
        report["dape_rel"] = rel_l2(grad_ape, g64[2])
        report["ok"] &= (
            report["dkv_ulp"] <= max_ulp and report["dscore_beyond"] == 0 and zeros_exact and report["dape_rel"] <= 1e-5
        )
    return report


def assert_contract(pack: Pack, out=None, grads=None, max_ulp: int = 1) -> dict:
    """``contract_report`` that raises AssertionError (with the figures) when the contract is broken."""
    report = contract_report(pack, out, grads, max_ulp)
    assert report["ok"], f"numerics contract broken: {report}"
    return report
