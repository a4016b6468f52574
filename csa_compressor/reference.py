"""Eager references for the compressor pooling (SPEC sections 2 and 3).

Three precisions share one window construction:

- ``"upstream"``: as Megatron-LM's THD region computes it. Softmax in fp32, the
  weights rounded to the value dtype, products and sum in that dtype. Its
  backward is autograd of that graph.
- ``"fp32"``: fp32 intermediates and one final rounding to the value dtype
  (the contract the kernels are held to). Its backward is closed form.
- ``"fp64"``: the oracle. Everything in float64, no rounding at all.

Everything here is device-side tensor work with no host synchronisation, so the
reference backend is also safe inside CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import support
from .thd import row_layout
from .windows import uses_softmax_stats

__all__ = [
    "PRECISIONS",
    "STATS_LOG2E",
    "backward",
    "backward_from_stats",
    "eager_region",
    "forward",
    "softmax_stats",
    "uses_softmax_stats",
]

PRECISIONS = ("upstream", "fp32", "fp64")


@dataclass(frozen=True)
class _Window:
    """Token indices of every window slot, shape ``(N, W)`` with ``W = coff * ratio``.

    Slot order is previous-group slots first (coff 2 only), then own slots.
    ``valid`` is False for previous-group slots of a segment's first group and
    of padding rows: value 0, logit ``-inf``. ``gather_idx`` is always in
    ``[0, T)``; ``scatter_idx`` sends invalid slots and rows without a gradient
    (padding, and rows whose window leaves ``[0, T)``: ``thd.row_layout``) to a
    dummy row ``T`` so that scatters stay inside the buffer.
    """

    gather_idx: torch.Tensor
    scatter_idx: torch.Tensor
    valid: torch.Tensor
    is_real: torch.Tensor


def _window(cu_seqlens, cu_seqlens_comp, total_comp, total_tokens, ratio, coff) -> _Window:
    # Padding rows read tokens 0..ratio-1: without them nothing is in range (the API rejects this too).
    support.check_rows_need_tokens(total_comp, total_tokens, ratio)
    t0, is_first, is_real = row_layout(cu_seqlens, cu_seqlens_comp, total_comp, ratio, total_tokens)
    offs = torch.arange(ratio, device=t0.device, dtype=torch.int64)
    own = t0[:, None] + offs
    own_valid = torch.ones_like(own, dtype=torch.bool)
    if coff == 2:
        prev = t0[:, None] - ratio + offs
        prev_valid = (~is_first)[:, None].expand_as(prev)
        idx = torch.cat([prev, own], dim=1)
        valid = torch.cat([prev_valid, own_valid], dim=1)
    else:
        idx, valid = own, own_valid
    gather_idx = torch.where(valid, idx, torch.zeros_like(idx))
    scatter_ok = valid & is_real[:, None]
    scatter_idx = torch.where(scatter_ok, idx, torch.full_like(idx, total_tokens))
    return _Window(gather_idx, scatter_idx, valid, is_real)


def _split_cols(x: torch.Tensor, coff: int, ratio: int) -> torch.Tensor:
    """Window slots from a gathered ``(N, W, coff*d)`` tensor: ``(N, W, d)``.

    Previous-group slots read the first ``d`` columns, own slots the last ``d``.
    """
    if coff == 1:
        return x
    d = x.shape[-1] // 2
    return torch.cat([x[:, :ratio, :d], x[:, ratio:, d:]], dim=1)


def _ape_window(ape: torch.Tensor, coff: int) -> torch.Tensor:
    """APE per window slot: ``(W, d)``."""
    if coff == 1:
        return ape
    d = ape.shape[-1] // 2
    return torch.cat([ape[:, :d], ape[:, d:]], dim=0)


def _windows(kv, score, ape, win: _Window, ratio, coff, dtype):
    """Values, logits ``(N, W, d)`` in ``dtype`` (logits include APE and ``-inf`` masking)."""
    values = _split_cols(kv[win.gather_idx], coff, ratio)
    logits = _split_cols(score[win.gather_idx], coff, ratio).to(dtype) + _ape_window(ape, coff).to(dtype)
    valid = win.valid[:, :, None]
    values = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    logits = torch.where(valid, logits, torch.full((), float("-inf"), dtype=dtype, device=logits.device))
    return values, logits


STATS_LOG2E = 1.4426950408889634  # log2(e), rounded to fp32 where the kernels scale logits


def softmax_stats(kv, score, ape, cu_seqlens, cu_seqlens_comp, *, ratio: int, coff: int, total_comp: int):
    """The forward's saved softmax statistics, ``(total_comp, 3, d)`` float32, for every row (padding too).

    Per row and column, over the window slots (masked slots excluded), with ``y = (score + ape) * log2(e)``
    in fp32: ``[:, 0]`` the max ``m`` of ``y``, ``[:, 1]`` ``1 / sum 2^(y - m)`` and ``[:, 2]`` the fp32
    output ``sum p * value`` before its rounding to bf16. The backward uses them instead of a
    first pass over the window: ``p = 2^(y - m) * [:, 1]``.
    """
    d = kv.shape[-1] // coff
    if total_comp == 0:
        return kv.new_empty((0, 3, d), dtype=torch.float32)
    win = _window(cu_seqlens, cu_seqlens_comp, total_comp, kv.shape[0], ratio, coff)
    values, logits = _windows(kv.float(), score, ape, win, ratio, coff, torch.float32)
    y = logits * STATS_LOG2E
    m = y.amax(dim=1)
    inv_l = 1.0 / torch.exp2(y - m[:, None, :]).sum(dim=1)
    out = (values * torch.softmax(logits, dim=1)).sum(dim=1)
    return torch.stack([m, inv_l, out], dim=1)


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def eager_region(kv, score, ape, cu_seqlens, cu_seqlens_comp, *, ratio: int, coff: int, total_comp: int):
    """The eager region the fused kernels replace ("upstream" numerics), differentiable.

    This is the baseline for benchmarks (eager and ``torch.compile``) and the
    graph the upstream backward differentiates.
    """
    return forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff, total_comp=total_comp)


def forward(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    *,
    ratio: int,
    coff: int,
    total_comp: int,
    precision: str = "upstream",
) -> torch.Tensor:
    """Pooled rows ``(total_comp, d)``.

    Dtype: ``kv.dtype`` for "upstream" and "fp32", float64 for "fp64".
    Differentiable with respect to ``kv``, ``score`` and ``ape`` (autograd).
    """
    _check_precision(precision)
    d = kv.shape[-1] // coff
    if total_comp == 0:
        out_dtype = torch.float64 if precision == "fp64" else kv.dtype
        return kv.new_empty((0, d), dtype=out_dtype)
    win = _window(cu_seqlens, cu_seqlens_comp, total_comp, kv.shape[0], ratio, coff)
    if precision == "upstream":
        values, logits = _windows(kv, score, ape, win, ratio, coff, torch.float32)
        weights = torch.softmax(logits, dim=1)
        return (values * weights.to(kv.dtype)).sum(dim=1)
    compute = torch.float64 if precision == "fp64" else torch.float32
    values, logits = _windows(kv.to(compute), score, ape, win, ratio, coff, compute)
    out = (values * torch.softmax(logits, dim=1)).sum(dim=1)
    return out if precision == "fp64" else out.to(kv.dtype)


def backward(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    ratio: int,
    coff: int,
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_kv, grad_score, grad_ape)``; rows of ``grad_out`` past ``cu_seqlens_comp[-1]`` are ignored.

    Dtypes: grad_kv/grad_score in ``kv.dtype`` (float64 for "fp64"), grad_ape
    fp32 (float64 for "fp64"). Positions no slot consumes are exact zeros.
    """
    _check_precision(precision)
    total_comp = grad_out.shape[0]
    tokens, width = kv.shape
    compute = torch.float64 if precision == "fp64" else torch.float32
    grad_dtype = torch.float64 if precision == "fp64" else kv.dtype
    ape_dtype = torch.float64 if precision == "fp64" else torch.float32
    if total_comp == 0:
        zeros = kv.new_zeros((tokens, width), dtype=grad_dtype)
        return zeros, zeros.clone(), ape.new_zeros(ape.shape, dtype=ape_dtype)
    win = _window(cu_seqlens, cu_seqlens_comp, total_comp, tokens, ratio, coff)
    g = torch.where(win.is_real[:, None], grad_out, torch.zeros((), dtype=grad_out.dtype, device=grad_out.device))

    if precision == "upstream":
        leaves = [t.detach().requires_grad_(True) for t in (kv, score, ape)]
        out = forward(*leaves, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff, total_comp=total_comp)
        grads = torch.autograd.grad(out, leaves, g.to(out.dtype), allow_unused=True)
        grad_kv, grad_score, grad_ape = (
            torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, leaves, strict=True)
        )
        return grad_kv, grad_score, grad_ape.to(torch.float32)

    values, logits = _windows(kv.to(compute), score, ape, win, ratio, coff, compute)
    p = torch.softmax(logits, dim=1)
    gf = g.to(compute)[:, None, :]
    # Same operation order as autograd of forward(): d(values) = g*p; softmax backward p*(gv - sum(gv*p)).
    d_values = gf * p
    gv = gf * values
    d_logits = p * (gv - (gv * p).sum(dim=1, keepdim=True))
    return _place_grads(d_values, d_logits, win, tokens, width, ratio, coff, grad_dtype, ape_dtype)


def _place_grads(d_values, d_logits, win: _Window, tokens, width, ratio, coff, grad_dtype, ape_dtype):
    """``(grad_kv, grad_score, grad_ape)`` from per-slot ``(N, W, d)`` gradients: masked slots and padding rows
    dropped, the rest scattered to the token/column each slot read; ``grad_ape`` sums ``d_logits`` over rows."""
    valid = (win.valid & win.is_real[:, None])[:, :, None]
    d_logits = torch.where(valid, d_logits, torch.zeros((), dtype=d_logits.dtype, device=d_logits.device))
    d_values = torch.where(valid, d_values, torch.zeros((), dtype=d_values.dtype, device=d_values.device))
    grad_kv = _scatter(d_values, win.scatter_idx, tokens, width, ratio, coff).to(grad_dtype)
    grad_score = _scatter(d_logits, win.scatter_idx, tokens, width, ratio, coff).to(grad_dtype)
    d_ape = d_logits.sum(dim=0)  # (W, d)
    if coff == 2:
        d_ape = torch.cat([d_ape[:ratio], d_ape[ratio:]], dim=1)
    return grad_kv, grad_score, d_ape.to(ape_dtype)


def backward_from_stats(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, stats, *, ratio: int, coff: int):
    """The fp32 backward computed from saved ``softmax_stats`` (what the kernels' stats path does), not from a
    softmax of its own: ``p = 2^(y - m) / l`` and ``sum p*v`` come from ``stats``. Same outputs as
    ``backward(..., precision="fp32")`` when ``stats`` are ``softmax_stats`` of the same inputs."""
    total_comp = grad_out.shape[0]
    tokens, width = kv.shape
    if total_comp == 0:
        zeros = kv.new_zeros((tokens, width))
        return zeros, zeros.clone(), ape.new_zeros(ape.shape, dtype=torch.float32)
    win = _window(cu_seqlens, cu_seqlens_comp, total_comp, tokens, ratio, coff)
    g = torch.where(win.is_real[:, None], grad_out, torch.zeros((), dtype=grad_out.dtype, device=grad_out.device))
    values, logits = _windows(kv.float(), score, ape, win, ratio, coff, torch.float32)
    stats = stats.float()
    p = torch.exp2(logits * STATS_LOG2E - stats[:, None, 0]) * stats[:, None, 1]
    gf = g.float()[:, None, :]
    d_values = gf * p
    d_logits = p * (gf * values - gf * stats[:, None, 2])
    return _place_grads(d_values, d_logits, win, tokens, width, ratio, coff, kv.dtype, torch.float32)


def _scatter(slots: torch.Tensor, scatter_idx: torch.Tensor, tokens: int, width: int, ratio: int, coff: int):
    """Place per-slot gradients ``(N, W, d)`` on the token/column each slot read.

    Row ``tokens`` is a dummy that absorbs invalid slots; it is dropped.
    """
    buf = slots.new_zeros((tokens + 1, width))
    d = width // coff
    if coff == 1:
        buf[scatter_idx.reshape(-1)] = slots.reshape(-1, d)
    else:
        buf[scatter_idx[:, :ratio].reshape(-1), :d] = slots[:, :ratio].reshape(-1, d)
        buf[scatter_idx[:, ratio:].reshape(-1), d:] = slots[:, ratio:].reshape(-1, d)
    return buf[:tokens]
