"""The compressor's tail: RMSNorm over ``head_dim``, then RoPE on the last ``rope_dim`` columns (issue 26).

Per output row ``r`` (``x`` the pooled row of SPEC section 2, never rounded in the fused op)::

    y = x * rsqrt(mean(x * x) + eps) * w                 # RMSNorm, w = norm_weight (head_dim,)
    (a, b) -> (a*cos - b*sin, a*sin + b*cos)             # each rotary pair of the last rope_dim columns
    out[r] = round_bf16(y)

Rotary pairs are ``(2i, 2i+1)`` (``rope_interleaved=True``, DeepSeek's convention) or ``(i, i + rope_dim/2)``
(half-split) inside the block ``[head_dim - rope_dim, head_dim)``; pair ``i`` reads column ``i`` of the
caller's ``(max_position, rope_dim/2)`` fp32 tables at the row's position ``position_start[b] + j*ratio``
(row ``j`` of segment ``b``, ``position_start`` defaulting to zeros); padding rows use position 0. A position
outside ``[0, max_position)`` reads no table: the row is rotated by cos = 1, sin = 0, i.e. not rotated
(``validate_positions``, and the validation mode, reject such positions instead).

Three precisions, as for the pooling (``csa_compressor.reference``):

- ``"upstream"``: the eager chain of DeepSeek-V4's compressor model code and Megatron-LM's: the pooled row
  rounded to bf16, RMSNorm in fp32 (``w * (x * rsqrt(...))``) with its output rounded to bf16, RoPE in fp32
  on that bf16 input, rounded again. Backward: autograd of that graph.
- ``"fp32"``: fp32 throughout, one rounding at the end (the kernels' contract). Closed-form backward.
- ``"fp64"``: the oracle, no rounding. Closed-form backward (checked against autograd in the tests).

Backward, per real row (padding rows' ``grad_out`` is ignored), with ``r = rsqrt(mean(x*x) + eps)``:
``dy`` is ``grad_out`` rotated back (the angle negated), ``grad_norm_weight = sum_rows dy * x * r``,
``dx = r * (w * dy) - x * r**3 * mean(x * w * dy)``, and ``dx`` enters the pooling backward in place of
``grad_out``. docs/tail.md derives it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import reference
from .testing import Pack, _beyond, bitwise_equal, rel_l2

__all__ = [
    "PRECISIONS",
    "Tail",
    "TailConfig",
    "autograd_backward",
    "backward",
    "check_tail",
    "contract_report",
    "eager_region",
    "forward",
    "pooled_rows",
    "random_tail",
    "rope_angles",
    "rope_columns",
    "row_gradient",
    "row_positions",
    "row_rstd",
    "validate_positions",
]

PRECISIONS = reference.PRECISIONS
NORM_DTYPES = (torch.float32, torch.bfloat16)
INT32_LIMIT = 2**31


@dataclass(frozen=True)
class TailConfig:
    """What a compiled tail kernel depends on: no tensors, hashable."""

    norm_dtype: torch.dtype | None  # None: no RMSNorm
    rope_dim: int
    rope_interleaved: bool
    has_positions: bool


# Every TailConfig the tails have asked for, one instance per value: (norm dtype, rope_dim, interleaved, positions).
_CONFIGS: dict[tuple, TailConfig] = {}


@dataclass(frozen=True, eq=False, init=False)
class Tail:
    """The tail's arguments, named as in the API. All defaults: no tail (the pooling alone)."""

    norm_weight: torch.Tensor | None = None
    norm_eps: float = 1e-6
    rope_cos: torch.Tensor | None = None
    rope_sin: torch.Tensor | None = None
    rope_dim: int = 0
    rope_interleaved: bool = True
    position_start: torch.Tensor | None = None

    def __init__(
        self, norm_weight=None, norm_eps=1e-6, rope_cos=None, rope_sin=None, rope_dim=0, rope_interleaved=True,
        position_start=None,
    ):  # fmt: skip
        # The API builds one per call: one write of the fields, where a frozen dataclass's own sets them one by one.
        object.__setattr__(self, "__dict__", {
            "norm_weight": norm_weight, "norm_eps": norm_eps, "rope_cos": rope_cos, "rope_sin": rope_sin,
            "rope_dim": rope_dim, "rope_interleaved": rope_interleaved, "position_start": position_start,
        })  # fmt: skip

    @property
    def has_norm(self) -> bool:
        return self.norm_weight is not None

    @property
    def has_rope(self) -> bool:
        return self.rope_dim > 0

    @property
    def is_identity(self) -> bool:
        return self.norm_weight is None and not self.rope_dim > 0

    def arguments(self) -> dict:
        """The tail as the API's keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def config(self) -> TailConfig:
        """The configuration, one shared instance per value (a backend's per-call lookup then hashes it and finds
        the key by identity)."""
        weight, rope_dim, interleaved = self.norm_weight, self.rope_dim, self.rope_interleaved
        if type(rope_dim) is not int or type(interleaved) is not bool:  # 1 == True as a key: exact types only
            return _tail_config(self)
        key = (None if weight is None else weight.dtype, rope_dim, interleaved, self.position_start is not None)
        config = _CONFIGS.get(key)
        if config is None:
            config = _CONFIGS[key] = _tail_config(self)
        return config


def _tail_config(tail: Tail) -> TailConfig:
    norm_dtype = tail.norm_weight.dtype if tail.has_norm else None
    return TailConfig(norm_dtype, tail.rope_dim, bool(tail.rope_interleaved), tail.position_start is not None)


# ---------------------------------------------------------------- bounds


def _fail(bound: str, detail: str):
    raise ValueError(f"csa_compressor: {bound}: {detail}")


def _check_tensor(name, t, shape, dtypes, device, align) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor", f"got {type(t).__name__}")
    if tuple(t.shape) != shape:
        _fail(f"{name} shape must be {shape}", f"got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(f"{name} dtype must be one of {dtypes}", f"got {t.dtype}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous", f"got strides {t.stride()}")
    if t.device != device:
        _fail("all tensors must be on one device", f"{name} is on {t.device}, kv on {device}")
    if t.device.type != "meta" and t.numel() > 0 and t.data_ptr() % align != 0:
        _fail(f"{name} must be {align}-byte aligned", f"data_ptr() % {align} = {t.data_ptr() % align}")


def check_tail(tail: Tail, *, head_dim: int, batch: int, device: torch.device) -> None:
    """Shapes, dtypes and scalar bounds of the tail's arguments (no device read); ValueError names the bound.

    ``batch`` is the number of segments, ``len(cu_seqlens) - 1``; ``device`` that of ``kv``.
    """
    if tail.norm_weight is not None:
        _check_tensor("norm_weight", tail.norm_weight, (head_dim,), NORM_DTYPES, device, 16)
    eps = tail.norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        _fail("norm_eps must be a finite float >= 0", f"got norm_eps={eps!r}")
    rope_dim = tail.rope_dim
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 <= rope_dim <= head_dim or rope_dim % 2:
        _fail(f"rope_dim must be an even int in [0, head_dim={head_dim}]", f"got rope_dim={rope_dim!r}")
    if not isinstance(tail.rope_interleaved, bool):
        _fail("rope_interleaved must be a bool", f"got {tail.rope_interleaved!r}")
    tables = (tail.rope_cos, tail.rope_sin, tail.position_start)
    if rope_dim == 0:
        if any(t is not None for t in tables):
            _fail("rope_cos, rope_sin and position_start need rope_dim > 0", "got rope_dim=0 with a table or offsets")
        return
    if tail.rope_cos is None or tail.rope_sin is None:
        _fail("rope_dim > 0 needs rope_cos and rope_sin", f"got rope_dim={rope_dim} with a table missing")
    cos_shape = tuple(tail.rope_cos.shape) if isinstance(tail.rope_cos, torch.Tensor) else ()
    if len(cos_shape) != 2 or cos_shape[0] < 1:
        _fail("rope_cos shape must be (max_position >= 1, rope_dim // 2)", f"got {cos_shape}")
    shape = (cos_shape[0], rope_dim // 2)
    _check_tensor("rope_cos", tail.rope_cos, shape, (torch.float32,), device, 16)
    _check_tensor("rope_sin", tail.rope_sin, shape, (torch.float32,), device, 16)
    if shape[0] * shape[1] >= INT32_LIMIT:
        _fail("int32 offsets need max_position * rope_dim // 2 < 2**31", f"got {shape[0]} * {shape[1]}")
    if tail.position_start is not None:
        _check_tensor("position_start", tail.position_start, (batch,), (torch.int32,), device, 4)


def validate_positions(tail: Tail, cu_seqlens_comp: torch.Tensor, ratio: int) -> None:
    """Check that every real row's position is inside the tables (reads the device: for debugging).

    Positions are ``position_start[b] + j * ratio`` for ``j < rows_b``; they must lie in ``[0, max_position)``.
    Without the check such a row is computed, not rotated (``rope_angles``); with it, a ValueError names the bound
    and the segment.
    """
    if not tail.has_rope:
        return
    comp = cu_seqlens_comp.detach().to("cpu", torch.int64)
    rows = comp[1:] - comp[:-1]
    start = torch.zeros_like(rows)
    if tail.position_start is not None:
        start = tail.position_start.detach().to("cpu", torch.int64)
    last = start + (rows - 1).clamp(min=0) * ratio
    limit = tail.rope_cos.shape[0]
    bad = (rows > 0) & ((start < 0) | (last >= limit))
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        _fail(
            f"row positions must lie in [0, max_position={limit})",
            f"segment {b} has positions {int(start[b])} .. {int(last[b])} (position_start + j * ratio)",
        )


# ---------------------------------------------------------------- the three chains


def row_positions(cu_seqlens_comp, total_comp: int, ratio: int, position_start=None) -> torch.Tensor:
    """Position of every output row, ``(total_comp,)`` int64: ``position_start[b] + j * ratio``; padding rows 0."""
    rows = torch.arange(total_comp, device=cu_seqlens_comp.device, dtype=torch.int64)
    comp = cu_seqlens_comp.to(torch.int64)
    # right=True picks the last segment starting at or before r, which skips empty segments.
    seg = (torch.searchsorted(comp, rows, right=True) - 1).clamp_(0, max(comp.numel() - 2, 0))
    pos = (rows - comp[seg]) * ratio
    if position_start is not None:
        pos = pos + position_start.to(torch.int64)[seg]
    return torch.where(rows < comp[-1], pos, torch.zeros_like(pos))


def rope_columns(head_dim: int, rope_dim: int, interleaved: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices ``(first, second)`` of the rotary pairs, ``rope_dim // 2`` each; pair ``i`` uses angle ``i``."""
    base, half = head_dim - rope_dim, rope_dim // 2
    i = torch.arange(half, device=device, dtype=torch.int64)
    if interleaved:
        return base + 2 * i, base + 2 * i + 1
    return base + i, base + half + i


def rope_angles(tail: Tail, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of every row, ``(N, rope_dim // 2)`` fp32: the tables' rows at ``positions``, and for a
    position outside ``[0, max_position)`` cos = 1 and sin = 0 (the row is not rotated; nothing is read outside
    the tables, as in the kernels)."""
    limit = tail.rope_cos.shape[0]
    inside = ((positions >= 0) & (positions < limit))[:, None]
    rows = torch.where(inside[:, 0], positions, torch.zeros_like(positions))
    # Python scalars, not new tensors: no host-to-device copy (CUDA graphs capture this).
    return torch.where(inside, tail.rope_cos[rows], 1.0), torch.where(inside, tail.rope_sin[rows], 0.0)


def _rotate(y, tail: Tail, positions, *, inverse: bool = False, out_dtype=None) -> torch.Tensor:
    """``y`` with its rotary pairs rotated (by minus the angle for ``inverse``), out of place, differentiable.

    The pairs are computed in ``y``'s dtype and stored in ``out_dtype`` (default: ``y``'s); the other
    columns keep ``y``'s values and dtype (the caller passes them already in ``out_dtype``). A row whose position
    is outside the tables is rotated by cos = 1, sin = 0 (``rope_angles``).
    """
    first, second = rope_columns(y.shape[1], tail.rope_dim, tail.rope_interleaved, y.device)
    cos, sin = rope_angles(tail, positions)
    cos, sin = cos.to(y.dtype), sin.to(y.dtype)
    if inverse:
        sin = -sin
    a, b = y[:, first], y[:, second]
    a2, b2 = a * cos - b * sin, a * sin + b * cos
    base = y if out_dtype is None else y.to(out_dtype)
    out_dtype = base.dtype
    return base.index_copy(1, first, a2.to(out_dtype)).index_copy(1, second, b2.to(out_dtype))


def row_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(x * x) + eps)`` per row, ``(N, 1)``, in ``x``'s dtype."""
    return torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)


def pooled_rows(kv, score, ape, cu_seqlens, cu_seqlens_comp, *, ratio: int, coff: int, total_comp: int, dtype):
    """The pooled rows ``sum_s p_s * value_s`` in ``dtype`` (float32 or float64), not rounded, differentiable.

    The same operations as ``reference.forward``'s fp32/fp64 path before its final rounding, so
    ``pooled_rows(..., dtype=float32).to(kv.dtype)`` is that reference bitwise.
    """
    d = kv.shape[-1] // coff
    if total_comp == 0:
        return kv.new_empty((0, d), dtype=dtype)
    win = reference._window(cu_seqlens, cu_seqlens_comp, total_comp, kv.shape[0], ratio, coff)
    values, logits = reference._windows(kv.to(dtype), score, ape, win, ratio, coff, dtype)
    return (values * torch.softmax(logits, dim=1)).sum(dim=1)


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail: Tail, *, ratio, coff, total_comp, precision="fp32"):
    """The tail's output rows ``(total_comp, head_dim)``: ``kv.dtype`` ("upstream", "fp32"), float64 ("fp64").

    The default precision is the kernels' contract, "fp32" (``reference.forward`` defaults to "upstream").

    Differentiable with respect to ``kv``, ``score``, ``ape`` and ``tail.norm_weight``. With an identity
    tail it is ``reference.forward`` at the same precision, bitwise.
    """
    _check_precision(precision)
    pool = dict(ratio=ratio, coff=coff, total_comp=total_comp)
    if tail.is_identity:
        return reference.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, precision=precision, **pool)
    positions = row_positions(cu_seqlens_comp, total_comp, ratio, tail.position_start) if tail.has_rope else None
    if precision == "upstream":
        return _upstream_chain(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, positions, pool)
    compute = torch.float64 if precision == "fp64" else torch.float32
    y = pooled_rows(kv, score, ape, cu_seqlens, cu_seqlens_comp, dtype=compute, **pool)
    if tail.has_norm:
        y = y * row_rstd(y, tail.norm_eps) * tail.norm_weight.to(compute)
    if tail.has_rope:
        y = _rotate(y, tail, positions)
    return y if precision == "fp64" else y.to(kv.dtype)


def _upstream_chain(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail: Tail, positions, pool):
    # DeepSeek-V4's compressor: pooled row cast to the activation dtype, RMSNorm computed in fp32 as
    # weight * (x * rsqrt(mean(x^2) + eps)) and cast back, RoPE on the rounded row in fp32, cast back.
    y = reference.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, precision="upstream", **pool)
    if tail.has_norm:
        yf = y.float()
        y = (tail.norm_weight.float() * (yf * row_rstd(yf, tail.norm_eps))).to(kv.dtype)
    if tail.has_rope:
        # The other columns go back to bf16 exactly: they hold the rounded norm output.
        y = _rotate(y.float(), tail, positions, out_dtype=kv.dtype)
    return y


def eager_region(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail: Tail, *, ratio: int, coff: int, total_comp: int):
    """The eager pooling + tail chain the fused kernels replace ("upstream" numerics), differentiable."""
    pool = dict(ratio=ratio, coff=coff, total_comp=total_comp)
    return forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, precision="upstream", **pool)


# ---------------------------------------------------------------- backward


def _real_rows(cu_seqlens_comp, total_comp: int) -> torch.Tensor:
    rows = torch.arange(total_comp, device=cu_seqlens_comp.device)
    return (rows < cu_seqlens_comp[-1].to(torch.int64))[:, None]


def row_gradient(x, grad_out, tail: Tail, cu_seqlens_comp, *, ratio: int, dtype, rstd=None):
    """The tail's part of the backward: ``(dx, grad_norm_weight)`` in ``dtype`` from the pooled rows ``x``.

    ``dx`` ``(N, d)`` is the pooling's upstream gradient (zero on padding rows); ``grad_norm_weight`` is None
    without a norm. ``x`` (any float dtype; only read with a norm) may be the forward's saved fp32 output of
    ``reference.softmax_stats`` (``stats[:, 2]``), ``rstd`` the forward's ``rsqrt(mean(x*x) + eps)`` per row.
    """
    total_comp = grad_out.shape[0]
    real = _real_rows(cu_seqlens_comp, total_comp)
    zero = torch.zeros((), dtype=dtype, device=grad_out.device)
    dy = torch.where(real, grad_out.to(dtype), zero)
    if tail.has_rope:
        dy = _rotate(dy, tail, row_positions(cu_seqlens_comp, total_comp, ratio, tail.position_start), inverse=True)
    if not tail.has_norm:
        return dy, None
    x = x.to(dtype)
    r = row_rstd(x, tail.norm_eps) if rstd is None else rstd.to(dtype).reshape(-1, 1)
    # Masked before the sum so that non-finite padding rows cannot reach the weight's gradient.
    grad_w = torch.where(real, dy * x * r, zero).sum(dim=0)
    wdy = tail.norm_weight.to(dtype) * dy
    return r * wdy - x * (r * r * r) * (x * wdy).mean(dim=-1, keepdim=True), grad_w


def backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail: Tail, *, ratio, coff, precision="fp32", rstd=None
):
    """``(grad_kv, grad_score, grad_ape, grad_norm_weight)``; rows of ``grad_out`` past the real rows are ignored.

    "fp32"/"fp64": the closed form of the module docstring; "upstream": autograd of the eager chain.
    ``grad_norm_weight`` is None without a norm, else fp32 (float64 for "fp64") whatever the weight's dtype.
    ``rstd`` (``(N,)`` or ``(N, 1)``) replaces the recomputed ``rsqrt(mean(x*x) + eps)`` (a saved statistic).
    """
    _check_precision(precision)
    if precision == "upstream":
        return autograd_backward(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, ratio=ratio, coff=coff, precision=precision
        )
    total_comp = grad_out.shape[0]
    compute = torch.float64 if precision == "fp64" else torch.float32
    pool = reference.backward
    if tail.is_identity:
        return (
            *pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=ratio, coff=coff, precision=precision),
            None,
        )
    x = None
    if tail.has_norm:
        x = pooled_rows(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff, total_comp=total_comp, dtype=compute
        )
    dx, grad_w = row_gradient(x, grad_out, tail, cu_seqlens_comp, ratio=ratio, dtype=compute, rstd=rstd)
    grads = pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, dx, ratio=ratio, coff=coff, precision=precision)
    return (*grads, grad_w)


def autograd_backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail: Tail, *, ratio, coff, precision="fp32"
):
    """The same four gradients by autograd of ``forward`` at ``precision`` (the autograd reference)."""
    total_comp = grad_out.shape[0]
    d = kv.shape[-1] // coff
    wide = torch.float64 if precision == "fp64" else torch.float32
    # The oracle's leaves are float64 too: autograd would cast their gradients to the leaves' dtypes.
    leaves = [(t.double() if precision == "fp64" else t).detach().requires_grad_(True) for t in (kv, score, ape)]
    # The weight's gradient is fp32 whatever its dtype: a bf16 leaf (an exact widening) would narrow it.
    weight = tail.norm_weight.to(wide).detach().requires_grad_(True) if tail.has_norm else None
    leaf_tail = dataclasses.replace(tail, norm_weight=weight)
    grad_w = None if weight is None else torch.zeros(d, dtype=wide, device=kv.device)
    if total_comp == 0:
        zeros = kv.new_zeros(kv.shape, dtype=torch.float64 if precision == "fp64" else kv.dtype)
        return zeros, zeros.clone(), ape.new_zeros(ape.shape, dtype=wide), grad_w
    out = forward(
        *leaves,
        cu_seqlens,
        cu_seqlens_comp,
        leaf_tail,
        ratio=ratio,
        coff=coff,
        total_comp=total_comp,
        precision=precision,
    )
    real = _real_rows(cu_seqlens_comp, total_comp)
    g = torch.where(real, grad_out.to(out.dtype), torch.zeros((), dtype=out.dtype, device=out.device))
    inputs = [*leaves] if weight is None else [*leaves, weight]
    grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, inputs, strict=True)]
    grad_kv, grad_score, grad_ape = grads[0], grads[1], grads[2].to(wide)
    if weight is not None:
        grad_w = grads[3].to(wide)
    return grad_kv, grad_score, grad_ape, grad_w


# ---------------------------------------------------------------- the contract, for tests of any backend


def random_tail(
    pack: Pack,
    *,
    norm: bool = True,
    norm_dtype: torch.dtype = torch.float32,
    rope_dim: int = 0,
    interleaved: bool = True,
    positions: bool = False,
    eps: float = 1e-6,
    seed: int = 0,
) -> Tail:
    """A tail for ``pack``: a norm weight near 1, RoPE tables of base 10000 just long enough for the rows'
    positions, and with ``positions`` random ``position_start`` offsets below 1000."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = pack.kv.device
    weight = (1 + 0.5 * torch.randn(pack.head_dim, generator=gen)).to(norm_dtype).to(device) if norm else None
    if rope_dim == 0:
        return Tail(weight, eps)
    rows = torch.tensor([s // pack.ratio for s in pack.seqlens], dtype=torch.int64)
    start = (
        torch.randint(0, 1000, rows.shape, generator=gen, dtype=torch.int64) if positions else torch.zeros_like(rows)
    )
    max_position = int((start + (rows - 1).clamp(min=0) * pack.ratio).max()) + 1
    inv_freq = 10000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = (f(angles).to(torch.float32).to(device) for f in (torch.cos, torch.sin))
    position_start = start.to(torch.int32).to(device) if positions else None
    return Tail(weight, eps, cos, sin, rope_dim, interleaved, position_start)


def _rotated_magnitude(m, tail: Tail, positions) -> torch.Tensor:
    """Magnitudes after a rotation: ``|cos| m_a + |sin| m_b`` and ``|sin| m_a + |cos| m_b`` per pair."""
    first, second = rope_columns(m.shape[1], tail.rope_dim, tail.rope_interleaved, m.device)
    cos, sin = (t.double().abs() for t in rope_angles(tail, positions))
    a, b = m[:, first], m[:, second]
    return m.index_copy(1, first, cos * a + sin * b).index_copy(1, second, sin * a + cos * b)


def _magnitudes(pack: Pack, tail: Tail):
    """fp64 magnitudes bounding each result's fp32 rounding noise (see docs/tail.md), and the consumed mask.

    ``(out_scale (N, d), kv_scale (T, coff*d), score_scale (T, coff*d), consumed (T, coff*d) bool)``.
    """
    ratio, coff, d = pack.ratio, pack.coff, pack.head_dim
    tokens, width = pack.kv.shape
    f64 = torch.float64
    win = reference._window(pack.cu_seqlens, pack.cu_seqlens_comp, pack.total_comp, tokens, ratio, coff)
    values, logits = reference._windows(pack.kv.double(), pack.score, pack.ape, win, ratio, coff, f64)
    p = torch.softmax(logits, dim=1)
    x = (p * values).sum(dim=1)
    m_x = (p * values.abs()).sum(dim=1)
    m_y = m_x
    m_dy = torch.where(win.is_real[:, None], pack.grad_out.double().abs(), torch.zeros((), dtype=f64))
    if tail.has_norm:
        w, r = tail.norm_weight.double().abs(), row_rstd(x, tail.norm_eps)
        m_y = r * w * m_x
    if tail.has_rope:
        positions = row_positions(pack.cu_seqlens_comp, pack.total_comp, ratio, tail.position_start)
        m_y, m_dy = _rotated_magnitude(m_y, tail, positions), _rotated_magnitude(m_dy, tail, positions)
    m_dx = m_dy
    if tail.has_norm:
        # dx = r*w*dy - x*r^3*mean(x*w*dy): the mean is a signed sum of d terms and r^2 carries the relative
        # error of mean(x*x), so the second term is bounded with the (d - 1)-fold worst case of a sum.
        m_dx = r * w * m_dy + d * r**3 * m_x * (m_x * w * m_dy).mean(dim=-1, keepdim=True)
    m_dx = m_dx[:, None, :]
    kv_slots = p * m_dx
    gv = m_dx * values.abs()
    score_slots = p * (gv + (p * gv).sum(dim=1, keepdim=True))
    used = torch.where((win.valid & win.is_real[:, None])[:, :, None], torch.ones_like(p), 0.0)
    kv_scale, score_scale, used = (
        reference._scatter(t, win.scatter_idx, tokens, width, ratio, coff) for t in (kv_slots, score_slots, used)
    )
    return m_y, kv_scale, score_scale, used > 0


def contract_report(pack: Pack, tail: Tail, out=None, grads=None, max_ulp: int = 1) -> dict:
    """Check results of the pooling + tail against the contract and return the figures with ``ok``.

    - ``out``: within ``max_ulp`` bf16 ulp of the fp32 reference, or within ``FP32_SLACK_ULPS`` fp32 ulps of the
      magnitudes it is computed from where it cancels; max error vs the fp64 oracle no larger than the eager
      chain's ("upstream");
    - ``grads = (grad_kv, grad_score, grad_ape, grad_norm_weight)``: grad_kv and grad_score like ``out`` (the
      norm's ``dx`` can cancel, so grad_kv gets the slack too), unconsumed positions exact +0, grad_ape and
      grad_norm_weight at relative L2 <= 1e-5 vs the oracle (grad_norm_weight None without a norm).
    """
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    out_scale, kv_scale, score_scale, consumed = _magnitudes(pack, tail)
    report: dict = {"ok": True}
    if out is not None:
        ref = {pr: forward(*pack.inputs, tail, total_comp=pack.total_comp, precision=pr, **kw) for pr in PRECISIONS}
        report["fwd_ulp"], report["fwd_beyond"] = _beyond(out, ref["fp32"], out_scale, max_ulp)
        report["fwd_bitwise"] = bool(torch.equal(out.view(torch.int16), ref["fp32"].view(torch.int16)))
        errs = [float((t.double() - ref["fp64"]).abs().max()) if t.numel() else 0.0 for t in (out, ref["upstream"])]
        report["fwd_err"], report["upstream_err"] = errs
        report["ok"] &= report["fwd_beyond"] == 0 and errs[0] <= errs[1]
        report["ok"] &= not bool(torch.isnan(out).any()) or bool(torch.isnan(ref["fp32"]).any())
    if grads is not None:
        grad_kv, grad_score, grad_ape, grad_w = grads
        g32 = backward(*pack.inputs, pack.grad_out, tail, precision="fp32", **kw)
        g64 = backward(*pack.inputs, pack.grad_out, tail, precision="fp64", **kw)
        report["dkv_ulp"], report["dkv_beyond"] = _beyond(grad_kv, g32[0], kv_scale, max_ulp)
        report["dscore_ulp"], report["dscore_beyond"] = _beyond(grad_score, g32[1], score_scale, max_ulp)
        for name, got, want in (("dkv", grad_kv, g32[0]), ("dscore", grad_score, g32[1])):
            report[f"{name}_bitwise"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
        mask = consumed.to(grad_kv.device)
        report["zeros_exact"] = all(not bool(t.view(torch.int16)[~mask].any()) for t in (grad_kv, grad_score))
        report["dape_rel"] = rel_l2(grad_ape, g64[2])
        report["dnorm_rel"] = rel_l2(grad_w, g64[3]) if tail.has_norm else 0.0
        report["ok"] &= report["dkv_beyond"] == 0 and report["dscore_beyond"] == 0 and report["zeros_exact"]
        report["ok"] &= report["dape_rel"] <= 1e-5 and report["dnorm_rel"] <= 1e-5
    return report


def check_backend(forward_fn, backward_fn, pack: Pack, tail: Tail, max_ulp: int = 1) -> dict:
    """Run a backend's fused pair on ``pack`` twice, assert the contract and bitwise repeatability, return the figures.

    ``forward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp) -> out`` and
    ``backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff) ->
    (grad_kv, grad_score, grad_ape, grad_norm_weight)``: ``forward`` and ``backward`` of this module fit.
    """
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    runs = []
    for _ in range(2):
        out = forward_fn(*pack.inputs, tail, total_comp=pack.total_comp, **kw)
        grads = backward_fn(*pack.inputs, pack.grad_out, tail, **kw)
        runs.append((out, *grads))
    report = contract_report(pack, tail, runs[0][0], runs[0][1:], max_ulp)
    report["repeatable"] = all(bitwise_equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    assert report["ok"] and report["repeatable"], f"tail contract broken: {report}"
    return report
