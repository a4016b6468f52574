"""What the bench times: zero-argument callables for each case, backend and direction.

Kernel backends are timed per wrapper call ("fwd", "bwd"); the baselines (the eager region, its torch.compile,
and for tail cases our pooling followed by PyTorch's tail) as "fwd" and "fwd+bwd" (forward, then autograd
backward). A tail case's output goes through RMSNorm over ``head_dim`` and RoPE on the last ``rope_dim`` columns;
our kernel backends then run the fused tail, which needs wrappers that take the tail arguments.
"""

from __future__ import annotations

import inspect
import itertools
import time
import types
from dataclasses import dataclass

from .cases import BASELINES, TORCH_TAIL, Case

__all__ = ["TAIL_ARGS", "Tail", "callables", "fused_tail_missing", "make_tail", "torch_tail"]

# The fused tail's arguments of the wrappers, the classes and compressor_pool.
TAIL_ARGS = ("norm_weight", "norm_eps", "rope_cos", "rope_sin", "rope_dim", "rope_interleaved", "position_start")
NORM_EPS = 1e-6
ROPE_BASE = 10000.0
_fresh_ids = itertools.count()


class Skip(Exception):
    """A measurement that cannot run with the installed package (recorded as skipped, not as failed)."""


def fused_tail_missing() -> str | None:
    """Why the installed wrappers cannot run the fused tail; None when both take every tail argument."""
    from .. import api

    for fn in (api.csa_compressor_forward_wrapper, api.csa_compressor_backward_wrapper):
        params = inspect.signature(fn).parameters
        missing = [a for a in TAIL_ARGS if a not in params]
        if missing:
            return f"the installed {fn.__name__} has no fused tail ({', '.join(missing)})"
    return None


@dataclass
class Tail:
    """The RMSNorm and RoPE inputs of a tail case; ``positions``: each output row's position (for the eager tail)."""

    norm_weight: object
    rope_cos: object
    rope_sin: object
    rope_dim: int
    positions: object
    norm_eps: float = NORM_EPS
    rope_interleaved: bool = True

    def kwargs(self, norm_weight=None) -> dict:
        """The wrappers' tail arguments (``position_start`` None: each segment's rows start at position 0)."""
        return dict(
            norm_weight=self.norm_weight if norm_weight is None else norm_weight,
            norm_eps=self.norm_eps,
            rope_cos=self.rope_cos,
            rope_sin=self.rope_sin,
            rope_dim=self.rope_dim,
            rope_interleaved=self.rope_interleaved,
            position_start=None,
        )


def make_tail(case: Case, pack) -> Tail:
    """DeepSeek-style tail inputs: a bf16 norm weight near 1, cos / sin tables of the standard frequencies, and row
    ``j`` of each segment at position ``j * ratio`` (padding rows at 0)."""
    import torch

    device = pack.kv.device
    gen = torch.Generator(device="cpu").manual_seed(1)
    weight = (1.0 + 0.1 * torch.randn(case.head_dim, generator=gen)).to(torch.bfloat16).to(device)
    half = case.rope_dim // 2
    max_position = max(case.seqlens)
    inv_freq = ROPE_BASE ** (-torch.arange(half, dtype=torch.float64) / max(half, 1))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = (f(angles).to(torch.float32).to(device) for f in (torch.cos, torch.sin))
    cu_comp = pack.cu_seqlens_comp.to(torch.int64).cpu()
    rows = torch.arange(pack.total_comp, dtype=torch.int64)
    segment = (torch.searchsorted(cu_comp, rows, right=True) - 1).clamp(0, len(case.seqlens) - 1)
    real = rows < cu_comp[-1]
    positions = torch.where(real, (rows - cu_comp[segment]) * case.ratio, torch.zeros_like(rows))
    return Tail(weight, cos, sin, case.rope_dim, positions.to(device))


def torch_tail(out, tail: Tail, norm_weight=None):
    """PyTorch's RMSNorm (fp32, rounded to the output's dtype), then RoPE on the last ``rope_dim`` columns in eager
    ops: the chain a model runs after the pooling today."""
    import torch
    import torch.nn.functional as F

    d, rd = out.shape[-1], tail.rope_dim
    weight = tail.norm_weight if norm_weight is None else norm_weight
    y = F.rms_norm(out.float(), (d,), weight.float(), tail.norm_eps).to(out.dtype)
    if rd == 0:
        return y
    cos, sin = tail.rope_cos[tail.positions], tail.rope_sin[tail.positions]
    x = y[:, d - rd :].float()
    if tail.rope_interleaved:
        a, b = x[:, 0::2], x[:, 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(1)
    else:
        a, b = x.chunk(2, dim=-1)
        rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((y[:, : d - rd], rotated.to(out.dtype)), dim=-1)


# --------------------------------------------------------------------------------------------------------------------
# Kernel backends: the two wrapper calls, as autograd runs them


def _kernel_callables(backend: str, pack, case: Case, tail: Tail | None):
    """fwd and bwd wrapper calls; long windows (where autograd saves the softmax statistics) hand the forward's
    statistics to the backward, as autograd does."""
    from .. import api

    if tail is not None:
        missing = fused_tail_missing()
        if missing:
            raise Skip(missing)
    kw = dict(ratio=case.ratio, head_dim=case.head_dim, coff=case.coff, total_comp=pack.total_comp, backend=backend)
    kw |= tail.kwargs() if tail is not None else {}
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    stats = api.autograd_uses_stats(pack.kv, case.ratio, case.coff, backend)
    saved = (
        api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=True, **kw)["softmax_stats"] if stats else None
    )

    def fwd():
        return api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=stats, **kw)

    def bwd():
        return api.csa_compressor_backward_wrapper(*inputs, pack.grad_out, softmax_stats=saved, **kw)

    return {"fwd": fwd, "bwd": bwd}


# --------------------------------------------------------------------------------------------------------------------
# Baselines: forward without autograd, forward + autograd backward


def _fresh_function(fn):
    """A copy of ``fn`` with a code object of its own. Dynamo caches compiled graphs per code object, so every
    case's chain compiles into its own cache entries: they stay valid while later cases compile (no reset between
    cases, so both passes of the bench use one compilation) and never reach the recompile limit."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_fresh_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _autograd_pair(chain, pack, tail: Tail | None):
    """{"fwd", "fwd+bwd"} of ``chain(kv, score, ape, norm_weight)``: the forward under no_grad, and the forward on
    leaves (the norm weight among them for tail cases) followed by ``torch.autograd.grad``."""
    import torch

    inputs = [pack.kv, pack.score, pack.ape] + ([tail.norm_weight] if tail is not None else [])
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    grad_out = pack.grad_out

    def fwd():
        with torch.no_grad():
            return chain(*inputs)

    def fwd_bwd():
        return torch.autograd.grad(chain(*leaves), leaves, grad_out)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _eager_chain(pack, case: Case, tail: Tail | None):
    """The eager region, followed for tail cases by PyTorch's tail."""
    from ..reference import eager_region

    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)
    ratio, coff, total_comp = case.ratio, case.coff, pack.total_comp

    def chain(kv, score, ape, norm_weight=None):
        out = eager_region(kv, score, ape, *offsets, ratio=ratio, coff=coff, total_comp=total_comp)
        return out if tail is None else torch_tail(out, tail, norm_weight)

    return _fresh_function(chain)


def _pool_then_torch_tail(backend: str, pack, case: Case, tail: Tail):
    """Our pooling (the autograd op on ``backend``), then PyTorch's tail: the unfused chain the fused tail replaces."""
    from ..autograd import compressor_pool

    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)

    def chain(kv, score, ape, norm_weight):
        out = compressor_pool(kv, score, ape, *offsets, case.ratio, case.coff, pack.total_comp, backend)
        return torch_tail(out, tail, norm_weight)

    return _autograd_pair(chain, pack, tail)


def _compiled_pair(chain, pack, tail: Tail | None, log):
    """torch.compile of ``chain`` (static shapes, as a training step with fixed sizes would compile): fullgraph,
    or the default mode when fullgraph fails on this torch; returns the pair, compiled, and a note."""
    import torch

    notes = []
    for fullgraph in (True, False):
        calls = _autograd_pair(torch.compile(chain, fullgraph=fullgraph, dynamic=False), pack, tail)
        t0 = time.perf_counter()
        try:
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
        except Exception as exc:
            notes.append(f"fullgraph={fullgraph} failed: {short_error(exc, 200)}")
            if not fullgraph:
                raise
            continue
        mode = "fullgraph" if fullgraph else "default (fullgraph failed)"
        log(f"    torch.compile ({mode}) compiled in {time.perf_counter() - t0:.1f} s")
        return calls, "; ".join([f"torch.compile {mode}", *notes])
    raise AssertionError("unreachable")


def callables(backend: str, pack, case: Case, tail: Tail | None, log=lambda msg: None):
    """``(calls, note)``: the direction -> callable map of one row of the matrix, and a note for the record.
    Raises ``Skip`` when the installed package cannot run the row (the fused tail not there yet)."""
    if backend.endswith(TORCH_TAIL):
        return _pool_then_torch_tail(backend[: -len(TORCH_TAIL)], pack, case, tail), None
    if backend == "eager":
        return _autograd_pair(_eager_chain(pack, case, tail), pack, tail), None
    if backend == "torch.compile":
        return _compiled_pair(_eager_chain(pack, case, tail), pack, tail, log)
    assert backend not in BASELINES
    return _kernel_callables(backend, pack, case, tail), None


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (truncated), for records and progress lines."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:limit]}".rstrip(": ")
