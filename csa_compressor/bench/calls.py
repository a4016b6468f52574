"""What the bench times: zero-argument callables for each case, backend and direction.

Kernel backends are timed per wrapper call ("fwd", "bwd"; with a tail the backward is autograd's call, the
forward's rstd handed over); the baselines (the eager region, its torch.compile, and for tail cases our pooling
followed by PyTorch's tail) as "fwd" and "fwd+bwd" (forward, then autograd backward). A tail case's output goes
through RMSNorm over ``head_dim`` and RoPE on the last ``rope_dim`` columns; our kernel backends then run the fused
tail, which needs wrappers that take the tail arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
import types
from dataclasses import dataclass

from .cases import BASELINES, TORCH_TAIL, Case

__all__ = ["TAIL_ARGS", "TailCase", "callables", "fused_tail_missing", "make_tail", "torch_tail"]

# The fused tail's arguments of the wrappers, the classes and compressor_pool.
TAIL_ARGS = ("norm_weight", "norm_eps", "rope_cos", "rope_sin", "rope_dim", "rope_interleaved", "position_start")


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


@dataclass(frozen=True)
class TailCase:
    """A tail case's inputs: the tail's arguments (``csa_compressor.tail.Tail``, named as in the API) and each
    output row's position, computed once per pack as a model does once per batch."""

    tail: object
    positions: object

    def kwargs(self) -> dict:
        return self.tail.arguments()

    def with_weight(self, norm_weight) -> TailCase:
        return dataclasses.replace(self, tail=dataclasses.replace(self.tail, norm_weight=norm_weight))


def make_tail(case: Case, pack) -> TailCase:
    """The tail of a DeepSeek-style compressor: an fp32 norm weight near 1, RoPE tables of base 10000 on the last
    ``case.rope_dim`` columns, interleaved pairs, each segment's rows from position 0."""
    from ..tail import random_tail, row_positions

    tail = random_tail(pack, rope_dim=case.rope_dim, interleaved=True, seed=1)
    return TailCase(tail, row_positions(pack.cu_seqlens_comp, pack.total_comp, case.ratio, tail.position_start))


def torch_tail(out, tail_case: TailCase):
    """PyTorch's RMSNorm on the pooled bf16 rows (in fp32, rounded), then RoPE in eager fp32 ops (rounded): the
    chain a model runs after the pooling today, with the rotation of the upstream reference."""
    import torch.nn.functional as F

    from .. import tail as tail_ops

    tail = tail_case.tail
    y = F.rms_norm(out.float(), (out.shape[-1],), tail.norm_weight.float(), tail.norm_eps).to(out.dtype)
    return tail_ops._rotate(y.float(), tail, tail_case.positions, out_dtype=out.dtype) if tail.has_rope else y


# --------------------------------------------------------------------------------------------------------------------
# Kernel backends: the two wrapper calls, as autograd runs them


def _kernel_callables(backend: str, pack, case: Case, tail: TailCase | None):
    """fwd and bwd wrapper calls; long windows (where autograd saves the softmax statistics) hand the forward's
    statistics to the backward, as autograd does. With a tail the backward is autograd's call, which also hands
    over the forward's rstd (the wrappers take none)."""
    from .. import api

    if tail is not None:
        missing = fused_tail_missing()
        if missing:
            raise Skip(missing)
    kw = dict(ratio=case.ratio, head_dim=case.head_dim, coff=case.coff, total_comp=pack.total_comp, backend=backend)
    kw |= tail.kwargs() if tail is not None else {}
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    stats = api.autograd_uses_stats(pack.kv, case.ratio, case.coff, backend)

    def fwd():
        return api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=stats, **kw)

    if tail is not None:
        return {"fwd": fwd, "bwd": _autograd_tail_backward(api, inputs, pack, case, backend, tail, stats)}
    saved = (
        api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=True, **kw)["softmax_stats"] if stats else None
    )

    def bwd():
        return api.csa_compressor_backward_wrapper(*inputs, pack.grad_out, softmax_stats=saved, **kw)

    return {"fwd": fwd, "bwd": bwd}


def _autograd_tail_backward(api, inputs, pack, case: Case, backend: str, tail: TailCase, stats: bool):
    """The tail's backward as autograd calls it: the forward's statistics (where it saves them) and rstd given."""
    tail_args = tuple(tail.kwargs()[name] for name in TAIL_ARGS)
    _out, rstd, saved = api._pool_forward_tail(
        inputs, case.ratio, case.coff, pack.total_comp, backend, tail_args, return_stats=stats, return_rstd=True
    )

    def bwd():
        return api._pool_backward_tail(
            inputs, pack.grad_out, case.ratio, case.coff, backend, tail_args, stats=saved, rstd=rstd
        )

    return bwd


# --------------------------------------------------------------------------------------------------------------------
# Baselines: forward without autograd, forward + autograd backward


def _fresh_function(fn, tag: str):
    """A copy of ``fn`` with a code object of its own, named by ``tag``. Dynamo caches compiled graphs per code
    object, so every case's chain compiles into its own cache entries: they stay valid while later cases compile
    (no reset between cases, so both passes of the bench use one compilation) and never reach the recompile limit.
    The name depends on the case and the chain's role only, so that a separate process compiling a few cases
    (``--compile-only``) produces the graphs the full run then finds in the compile caches on disk."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{re.sub(r'[^0-9a-zA-Z]+', '_', tag)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _autograd_pair(make_chain, pack, tail_case: TailCase | None):
    """{"fwd", "fwd+bwd"} of the chains ``make_chain(tail_case, role)(kv, score, ape)``: the forward under no_grad
    (role "fwd"), and the forward on leaves (the norm weight among them for tail cases) followed by
    ``torch.autograd.grad`` (role "bwd")."""
    import torch

    inputs = (pack.kv, pack.score, pack.ape)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    forward_chain = make_chain(tail_case, "fwd")
    if tail_case is not None:
        weight = tail_case.tail.norm_weight.detach().clone().requires_grad_(True)
        backward_chain, leaves = make_chain(tail_case.with_weight(weight), "bwd"), [*leaves, weight]
    else:
        backward_chain = make_chain(None, "bwd")
    grad_out = pack.grad_out

    def fwd():
        with torch.no_grad():
            return forward_chain(*inputs)

    def fwd_bwd():
        return torch.autograd.grad(backward_chain(*leaves[:3]), leaves, grad_out)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _eager_chains(pack, case: Case, kind: str):
    """Chains of the eager region; for tail cases the upstream pooling + RMSNorm + RoPE chain of the references.
    ``kind``: "eager" or "compile", part of the chains' names."""
    from .. import reference
    from .. import tail as tail_ops

    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)
    pool = dict(ratio=case.ratio, coff=case.coff, total_comp=pack.total_comp)

    def make(tail_case: TailCase | None, role: str):
        if tail_case is None:

            def chain(kv, score, ape):
                return reference.eager_region(kv, score, ape, *offsets, **pool)

        else:

            def chain(kv, score, ape):
                return tail_ops.eager_region(kv, score, ape, *offsets, tail_case.tail, **pool)

        return _fresh_function(chain, f"{kind}_{case.name}_{role}")

    return make


def _pool_then_torch_tail(backend: str, pack, case: Case, tail_case: TailCase):
    """Our pooling (the autograd op on ``backend``), then PyTorch's tail: the unfused chain the fused tail replaces."""
    from ..autograd import compressor_pool

    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)

    def make(tc: TailCase, role: str):
        def chain(kv, score, ape):
            out = compressor_pool(kv, score, ape, *offsets, case.ratio, case.coff, pack.total_comp, backend)
            return torch_tail(out, tc)

        return chain

    return _autograd_pair(make, pack, tail_case)


def flat_gather_pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, *, ratio: int, coff: int, total_comp: int):
    """The eager region's pooling for well-formed packs written with flat gathers: the row layout by
    ``repeat_interleave``, every window element one index into ``kv`` / ``score``, no slices of gathered tensors.
    The same math as ``reference.eager_region`` (upstream numerics), in a form some Inductor releases lower where
    they cannot lower the reference's (torch.compile's baseline falls back to it, with a note)."""
    import torch

    device, d = kv.device, kv.shape[-1] // coff
    segments = cu_seqlens.numel() - 1
    comp = cu_seqlens_comp.long()
    # Padding rows (past cu_seqlens_comp[-1]) form one more segment: t0 = 0, first group.
    index = torch.arange(segments + 1, device=device)
    counts = torch.nn.functional.pad(comp[1:] - comp[:-1], (0, 1)) + (index == segments) * (total_comp - comp[segments])
    seg = torch.repeat_interleave(index, counts, output_size=total_comp)
    padding = seg == segments
    seg = seg.clamp(max=segments - 1)
    j = torch.where(padding, 0, torch.arange(total_comp, device=device) - comp[seg])
    t0 = torch.where(padding, 0, cu_seqlens.long()[seg] + j * ratio)
    slots = torch.arange(coff * ratio, device=device)
    valid = (slots >= (coff - 1) * ratio) | (j > 0)[:, None]
    token = torch.where(valid, t0[:, None] - (coff - 1) * ratio + slots, 0)
    column = (slots // ratio) * d
    columns = torch.arange(d, device=device)
    flat = (token * (coff * d) + column)[:, :, None] + columns
    ape_w = ape.reshape(-1)[((slots % ratio) * (coff * d) + column)[:, None] + columns]
    values = torch.where(valid[:, :, None], kv.reshape(-1)[flat], 0)
    logits = torch.where(valid[:, :, None], score.reshape(-1)[flat].float() + ape_w, float("-inf"))
    return (values * torch.softmax(logits, dim=1).to(kv.dtype)).sum(dim=1)


def _flat_chains(pack, case: Case):
    """The eager chains with ``flat_gather_pool`` for the pooling (for tail cases PyTorch's tail after it)."""
    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)
    pool = dict(ratio=case.ratio, coff=case.coff, total_comp=pack.total_comp)

    def make(tail_case: TailCase | None, role: str):
        def chain(kv, score, ape):
            out = flat_gather_pool(kv, score, ape, *offsets, **pool)
            return out if tail_case is None else torch_tail(out, tail_case)

        return _fresh_function(chain, f"compile_flat_{case.name}_{role}")

    return make


def _try_compile(make_chain, pack, tail_case, fullgraph: bool):
    """The compiled pair, called once (where it compiles); raises what the compiler raised."""
    import torch

    def compiled(tc, role):
        return torch.compile(make_chain(tc, role), fullgraph=fullgraph, dynamic=False)

    calls = _autograd_pair(compiled, pack, tail_case)
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    return calls


def _compiled_pair(make_chain, pack, tail_case: TailCase | None, log, flat_chain=None):
    """torch.compile of the chains (static shapes, as a training step with fixed sizes would compile): fullgraph,
    or the default mode when fullgraph fails on this torch, or else the flat-gather form of the same region
    (``flat_chain``); returns the pair, compiled, and a note."""
    attempts = [(make_chain, True, "fullgraph"), (make_chain, False, "default (fullgraph failed)")]
    if flat_chain is not None:
        attempts.append((flat_chain, True, "fullgraph of the flat-gather pooling (the reference's failed)"))
    notes = []
    for index, (chain, fullgraph, mode) in enumerate(attempts):
        t0 = time.perf_counter()
        try:
            calls = _try_compile(chain, pack, tail_case, fullgraph)
        except Exception as exc:
            notes.append(f"{mode} failed: {short_error(exc, 200)}")
            if index == len(attempts) - 1:
                raise
            continue
        log(f"    torch.compile ({mode}) compiled in {time.perf_counter() - t0:.1f} s")
        return calls, "; ".join([f"torch.compile {mode}", *notes])
    raise AssertionError("unreachable")


def callables(backend: str, pack, case: Case, tail: TailCase | None, log=lambda msg: None):
    """``(calls, note)``: the direction -> callable map of one row of the matrix, and a note for the record.
    Raises ``Skip`` when the installed package cannot run the row (the fused tail not there yet)."""
    if backend.endswith(TORCH_TAIL):
        return _pool_then_torch_tail(backend[: -len(TORCH_TAIL)], pack, case, tail), None
    if backend == "eager":
        return _autograd_pair(_eager_chains(pack, case, "eager"), pack, tail), None
    if backend == "torch.compile":
        return _compiled_pair(_eager_chains(pack, case, "compile"), pack, tail, log, _flat_chains(pack, case))
    assert backend not in BASELINES
    return _kernel_callables(backend, pack, case, tail), None


def short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (truncated), for records and progress lines."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:limit]}".rstrip(": ")
