"""The fused tail (RMSNorm, RoPE) through the public API: ``tail.check_backend`` per entry point and backend, bounds,
the identity tail, opcheck; ``python -m tests.test_tail_api`` prints the entry points' host cost per call."""

from __future__ import annotations

import dataclasses
import inspect
import re
import timeit

import pytest
import torch

from csa_compressor import (
    CompressorPool,
    CompressorPoolFunction,
    CSACompressorBackward,
    CSACompressorForward,
    api,
    compressor_pool,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    dispatch,
    reference,
    support,
    tail_args,
)
from csa_compressor import tail as T
from csa_compressor.backends.reference import launch as reference_launch
from csa_compressor.testing import make_pack
from csa_compressor.windows import uses_softmax_stats

from .test_tail import BAD_TAILS, CASES, _on_cuda, case_pack_and_tail, out_of_table_tail

NAMES = tuple(f.name for f in dataclasses.fields(T.Tail))


def _kwargs(tail: T.Tail) -> dict:
    return {name: getattr(tail, name) for name in NAMES}


def _rc(pack, **kw) -> dict:
    """``pack``'s ratio and coff, and ``kw``."""
    return dict(ratio=pack.ratio, coff=pack.coff, **kw)


def _pool_kw(pack, **kw) -> dict:
    return _rc(pack, total_comp=pack.total_comp, **kw)


def _leaves(*tensors) -> list:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _buffers(pack):
    """An output and three gradient buffers for the classes."""
    out = torch.empty((pack.total_comp, pack.head_dim), dtype=torch.bfloat16)
    return out, [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)]


_TRITON_REASON = dispatch.unavailable_reason("triton") or (
    None
    if hasattr(dispatch.backend_module("triton"), "supports_tail")
    else "the Triton backend has no supports_tail yet (its fused tail is on branch tritontail)"
)
_CUTE_REASON = dispatch.unavailable_reason("cute") or (None if torch.cuda.is_available() else "needs a CUDA GPU")


def _marks(backend: str):
    # A reference-backend failure fails; the Triton cases run under the interpreter too, the cute ones on a GPU.
    if backend == "triton":
        return [pytest.mark.skipif(_TRITON_REASON is not None, reason=str(_TRITON_REASON))]
    if backend == "cute":
        return [pytest.mark.gpu, pytest.mark.skipif(_CUTE_REASON is not None, reason=str(_CUTE_REASON))]
    return []


ENTRY_BACKENDS = ("reference", "triton", "cute")
BACKENDS = [pytest.param(b, marks=_marks(b)) for b in ENTRY_BACKENDS]
# The Triton interpreter is slow on the CPU: there it gets the cases without ratio 128 (a GPU runs them all).
_INTERPRETED = not torch.cuda.is_available()
TAIL_BACKENDS = [b for b in ("reference", "triton") if b == "reference" or _TRITON_REASON is None]


def _on_device(backend, fns):
    """A GPU backend on a GPU machine runs on CUDA copies (results compared on the CPU); else as given."""
    if backend == "reference" or _INTERPRETED:
        return fns
    return tuple(_on_cuda(fn) for fn in fns)


def _entry_cases(entries):
    """(entry, backend, case) for every entry point and case it applies to (statistics: long windows only)."""
    return [
        pytest.param(entry, b, name, marks=_marks(b), id=f"{entry}-{b}-{name}")
        for entry in entries
        for b in ENTRY_BACKENDS
        for name, (ratio, coff, *_) in CASES.items()
        if not (b == "triton" and _INTERPRETED and ratio == 128)
        and (entry != "wrappers-stats" or uses_softmax_stats(ratio, coff))
    ]


# ---------------------------------------------------------------- the entry points as check_backend pairs


def _grads(result):
    return result["grad_kv"], result["grad_score"], result["grad_ape"], result.get("grad_norm_weight")


def _wrappers(backend):
    def forward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp):
        kw = dict(ratio=ratio, coff=coff, total_comp=total_comp, backend=backend, **_kwargs(tail))
        return csa_compressor_forward_wrapper(kv, score, ape, cu_seqlens, cu_seqlens_comp, **kw)["out"]

    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
        kw = dict(ratio=ratio, coff=coff, backend=backend, **_kwargs(tail))
        result = csa_compressor_backward_wrapper(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, **kw)
        assert ("grad_norm_weight" in result) is tail.has_norm
        return _grads(result)

    return forward_fn, backward_fn


def _wrappers_with_stats(backend):
    """The forward wrapper's softmax statistics (long windows) handed to the backward wrapper."""
    forward_fn, _ = _wrappers(backend)

    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
        kw = dict(ratio=ratio, coff=coff, backend=backend, **_kwargs(tail))
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        fwd = csa_compressor_forward_wrapper(*inputs, total_comp=grad_out.shape[0], return_softmax_stats=True, **kw)
        result = csa_compressor_backward_wrapper(*inputs, grad_out, softmax_stats=fwd["softmax_stats"], **kw)
        return _grads(result)

    return forward_fn, backward_fn


def _classes(backend):
    """The classes on NaN canaries, the backward given the forward's rstd."""
    saved = {}

    def forward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp):
        out = torch.full((total_comp, kv.shape[1] // coff), float("nan"), dtype=kv.dtype, device=kv.device)
        rstd = torch.full((total_comp,), float("nan"), device=kv.device)
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        op = CSACompressorForward(*inputs, out, ratio=ratio, coff=coff, backend=backend, **_kwargs(tail))
        op.execute(*inputs, out, rstd=rstd, **_kwargs(tail))
        x = T.pooled_rows(*inputs, ratio=ratio, coff=coff, total_comp=total_comp, dtype=torch.float32)
        want = T.row_rstd(x, tail.norm_eps).reshape(-1) if tail.has_norm else torch.ones_like(rstd)
        torch.testing.assert_close(rstd, want, rtol=2e-6, atol=0)
        saved["rstd"] = rstd
        return out

    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
        grads = [torch.full_like(t, float("nan")) for t in (kv, score, ape)]
        weight = torch.full((kv.shape[1] // coff,), float("nan"), device=kv.device) if tail.has_norm else None
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        op = CSACompressorBackward(*inputs, grad_out, *grads, ratio=ratio, coff=coff, backend=backend, **_kwargs(tail))
        kw = dict(grad_norm_weight=weight, rstd=saved["rstd"], **_kwargs(tail))
        result = op.execute(*inputs, grad_out, *grads, **kw)
        assert len(result) == (4 if tail.has_norm else 3) and all(a is b for a, b in zip(result, grads, strict=False))
        return (*grads, weight)

    return forward_fn, backward_fn


def _autograd_backward(region):
    """A backward pair through autograd of ``region``; an fp32 weight (bf16: see the bf16 weight gradient test)."""

    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
        leaves = _leaves(kv, score, ape)
        weight = tail.norm_weight.detach().float().clone().requires_grad_(True) if tail.has_norm else None
        tail = dataclasses.replace(tail, norm_weight=weight)
        out = region(*leaves, cu_seqlens, cu_seqlens_comp, tail, ratio=ratio, coff=coff, total_comp=grad_out.shape[0])
        out.backward(grad_out)
        return (*(t.grad for t in leaves), None if weight is None else weight.grad)

    return backward_fn


def _pool_region(backend, compile_it=False):
    """``compressor_pool`` as a check_backend region; compiled, its tensors are the graph's inputs."""

    def pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, norm_weight, rope_cos, rope_sin, position_start, scalars):
        ratio, coff, total_comp, norm_eps, rope_dim, rope_interleaved = scalars
        tables = dict(rope_cos=rope_cos, rope_sin=rope_sin, rope_dim=rope_dim, rope_interleaved=rope_interleaved)
        return compressor_pool(
            kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, backend, norm_weight=norm_weight,
            norm_eps=norm_eps, position_start=position_start, **tables,
        )  # fmt: skip

    run = torch.compile(pool, fullgraph=True) if compile_it else pool

    def region(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp):
        scalars = (ratio, coff, total_comp, tail.norm_eps, tail.rope_dim, tail.rope_interleaved)
        tensors = (tail.norm_weight, tail.rope_cos, tail.rope_sin, tail.position_start)
        return run(kv, score, ape, cu_seqlens, cu_seqlens_comp, *tensors, scalars)

    return region


def _pool(backend, compile_it=False):
    region = _pool_region(backend, compile_it)

    def forward_fn(*args, **kw):
        with torch.no_grad():
            return region(*args, **kw)

    return forward_fn, _autograd_backward(region)


ENTRY_POINTS = {
    "wrappers": _wrappers,
    "wrappers-stats": _wrappers_with_stats,
    "classes": _classes,
    "compressor_pool": _pool,
}


@pytest.mark.parametrize(("entry", "backend", "name"), _entry_cases(ENTRY_POINTS))
def test_entry_points_meet_the_contract(entry, backend, name):
    pack, tail = case_pack_and_tail(name, seed=11)
    if entry == "compressor_pool":
        tail = dataclasses.replace(tail, norm_weight=None if tail.norm_weight is None else tail.norm_weight.float())
    T.check_backend(*_on_device(backend, ENTRY_POINTS[entry](backend)), pack, tail)


COMPILE_CASES = ["r4c2d72-rope64-bf16w-pos", "r2c1d4-rope4-only-pos", "r128c2d6-rope6-pos"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", COMPILE_CASES)
def test_torch_compile_fullgraph_meets_the_contract(backend, name):
    if backend == "triton" and _INTERPRETED and name.startswith("r128"):
        pytest.skip("the Triton interpreter runs ratio 128 slowly; a GPU covers it")
    torch._dynamo.reset()
    pack, tail = case_pack_and_tail(name, seed=12)
    tail = dataclasses.replace(tail, norm_weight=None if tail.norm_weight is None else tail.norm_weight.float())
    T.check_backend(*_on_device(backend, _pool(backend, compile_it=True)), pack, tail)
    # The compiled graph and plain eager agree bitwise, the norm weight's gradient included.
    eager, compiled = (_on_device(backend, (_autograd_backward(_pool_region(backend, c)),))[0] for c in (False, True))
    args = (*pack.inputs, pack.grad_out, tail)
    for got, want in zip(compiled(*args, **_rc(pack)), eager(*args, **_rc(pack)), strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


def test_bf16_weight_gradient_is_the_fp32_one_rounded():
    pack, tail = case_pack_and_tail("r4c2d72-rope64-bf16w-pos", seed=13)
    weight = tail.norm_weight.clone().requires_grad_(True)
    kv = pack.kv.clone().requires_grad_(True)
    out = compressor_pool(
        kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp, pack.ratio, pack.coff, pack.total_comp,
        "reference", **_kwargs(dataclasses.replace(tail, norm_weight=weight)),
    )  # fmt: skip
    out.backward(pack.grad_out)
    want = T.backward(*pack.inputs, pack.grad_out, tail, **_rc(pack))
    assert weight.grad.dtype == torch.bfloat16 and torch.equal(weight.grad, want[3].to(torch.bfloat16))
    assert torch.equal(kv.grad, want[0])


# ---------------------------------------------------------------- the identity tail, the plain path


def _record_launches(monkeypatch):
    """Each launch as (direction, the tail's arguments it was given, by name: those not None), whether passed by
    position or keyword."""
    calls = []
    for direction in ("forward", "backward"):
        real = getattr(reference_launch, direction)
        signature = inspect.signature(real)

        def record(*args, _real=real, _direction=direction, _signature=signature, **kw):
            given = _signature.bind(*args, **kw).arguments
            tail_args = ("tail", "grad_norm_weight", "rstd")
            calls.append((_direction, sorted(n for n in tail_args if given.get(n) is not None)))
            return _real(*args, **kw)

        monkeypatch.setattr(reference_launch, direction, record)
    # Cached ops hold the launch function they were compiled with.
    for cache in ("_OPS", "_FWD_FAST", "_BWD_FAST", "_FWD_TAIL_FAST", "_BWD_TAIL_FAST"):
        monkeypatch.setattr(api, cache, {})
    return calls


IDENTITY_ARGS = [dict(), dict(norm_eps=1e-5, rope_interleaved=False), dict(norm_eps=0)]


@pytest.mark.parametrize("identity", IDENTITY_ARGS, ids=["defaults", "own-eps-half-split", "int-eps"])
def test_identity_tail_is_the_pooling_bitwise(monkeypatch, identity):
    calls = _record_launches(monkeypatch)
    pack, _ = case_pack_and_tail("r4c2d5-rope2-pos", seed=14)
    kw = _rc(pack, backend="reference")
    want = reference.forward(*pack.inputs, **_pool_kw(pack), precision="fp32")
    want_grads = reference.backward(*pack.inputs, pack.grad_out, **_rc(pack), precision="fp32")
    out = csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw, **identity)["out"]
    grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw, **identity)
    assert torch.equal(out, want) and list(grads.keys()) == ["grad_kv", "grad_score", "grad_ape"]
    for got, expected in zip(grads, want_grads, strict=True):
        assert torch.equal(got, expected)
    leaves = _leaves(pack.kv, pack.score, pack.ape)
    pooled = compressor_pool(*leaves, *pack.inputs[3:], pack.ratio, pack.coff, pack.total_comp, "reference", **identity)
    pooled.backward(pack.grad_out)
    assert torch.equal(pooled.detach(), want)
    for leaf, expected in zip(leaves, want_grads, strict=True):
        assert torch.equal(leaf.grad, expected)
    out_cls = torch.empty_like(out)
    CSACompressorForward(*pack.inputs, out_cls, **kw, **identity).execute(*pack.inputs, out_cls, **identity)
    assert torch.equal(out_cls, want)
    # The backend saw the pooling alone: no tail argument reached it.
    assert calls and all(keywords == [] for _, keywords in calls)


def test_tail_reaches_the_backend_as_a_tail(monkeypatch):
    calls = _record_launches(monkeypatch)
    pack, tail = case_pack_and_tail("r4c1d7-norm", seed=15)
    kw = _rc(pack, backend="reference", **_kwargs(tail))
    csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)
    csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
    # The wrappers keep no rstd: the forward computes none and the backward recomputes it.
    assert calls == [("forward", ["tail"]), ("backward", ["grad_norm_weight", "tail"])]


# ---------------------------------------------------------------- bounds


def _entry_calls(pack, tail):
    """Each entry point called with ``tail``: name -> thunk."""
    base, kw, (out, grads) = _rc(pack, backend="reference"), _kwargs(tail), _buffers(pack)
    good = _kwargs(case_pack_and_tail("r4c2d8-padding-only")[1])
    return {
        "forward wrapper": lambda: csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **base, **kw),
        "backward wrapper": lambda: csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **base, **kw),
        "forward class": lambda: CSACompressorForward(*pack.inputs, out, **base, **kw).check_support(),
        "backward class": lambda: CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, **base, **kw).compile(),
        "forward execute": lambda: CSACompressorForward(*pack.inputs, out, **base, **good).execute(*pack.inputs, out, **kw),
        "compressor_pool": lambda: compressor_pool(*pack.inputs, pack.ratio, pack.coff, pack.total_comp, "reference", **kw),
    }  # fmt: skip


ENTRY_NAMES = list(_entry_calls(*case_pack_and_tail("r4c2d8-padding-only")))


@pytest.mark.parametrize("entry", ENTRY_NAMES)
@pytest.mark.parametrize("bound", list(BAD_TAILS))
def test_every_entry_point_names_the_broken_bound(bound, entry):
    pack, tail = case_pack_and_tail("r4c2d8-padding-only")
    bad = dataclasses.replace(tail, **BAD_TAILS[bound](tail))
    with pytest.raises(ValueError, match=re.escape(bound)):
        _entry_calls(pack, bad)[entry]()


def test_execute_refuses_another_tail_configuration():
    pack, tail = case_pack_and_tail("r4c2d8-padding-only")
    out, _ = _buffers(pack)
    fwd = CSACompressorForward(*pack.inputs, out, backend="reference", **_kwargs(tail))
    fwd.execute(*pack.inputs, out, **_kwargs(tail))
    for other in (dict(rope_interleaved=False), dict(position_start=None), dict(norm_weight=None)):
        with pytest.raises(ValueError, match="must match the configuration compiled for"):
            fwd.execute(*pack.inputs, out, **_kwargs(dataclasses.replace(tail, **other)))
    with pytest.raises(ValueError, match="must match the configuration compiled for"):
        fwd.execute(*pack.inputs, out)
    plain = CSACompressorForward(*pack.inputs, out, backend="reference")
    with pytest.raises(ValueError, match="must match the configuration compiled for"):
        plain.execute(*pack.inputs, out, **_kwargs(tail))
    # A longer table and another eps are per-call values, not the configuration.
    longer = dict(rope_cos=torch.cat([tail.rope_cos, tail.rope_cos]), rope_sin=torch.cat([tail.rope_sin] * 2))
    fwd.execute(*pack.inputs, out, **_kwargs(dataclasses.replace(tail, norm_eps=0.5, **longer)))


def test_buffers_of_the_tail_are_checked():
    pack, tail = case_pack_and_tail("r4c2d8-padding-only")
    kw, (out, grads) = dict(backend="reference", **_kwargs(tail)), _buffers(pack)
    fwd = CSACompressorForward(*pack.inputs, out, **kw)
    with pytest.raises(ValueError, match=re.escape(f"rstd shape must be ({pack.total_comp},)")):
        fwd.execute(*pack.inputs, out, rstd=torch.empty(pack.total_comp + 1), **_kwargs(tail))
    with pytest.raises(ValueError, match="rstd needs a tail"):
        CSACompressorForward(*pack.inputs, out, backend="reference").execute(*pack.inputs, out, rstd=torch.empty(4))
    bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, **kw)
    with pytest.raises(ValueError, match="grad_norm_weight is required with norm_weight"):
        bwd.execute(*pack.inputs, pack.grad_out, *grads, **_kwargs(tail))
    with pytest.raises(ValueError, match=re.escape("grad_norm_weight dtype must be torch.float32")):
        bwd.execute(*pack.inputs, pack.grad_out, *grads, grad_norm_weight=torch.empty(8).double(), **_kwargs(tail))
    rope_only = _kwargs(dataclasses.replace(tail, norm_weight=None))
    bwd_rope = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, backend="reference", **rope_only)
    with pytest.raises(ValueError, match="grad_norm_weight needs norm_weight"):
        bwd_rope.execute(*pack.inputs, pack.grad_out, *grads, grad_norm_weight=torch.empty(8), **rope_only)


def test_a_backend_without_the_tail_is_refused(monkeypatch):
    pack, tail = case_pack_and_tail("r4c1d7-norm")
    for cache in ("_OPS", "_FWD_TAIL_FAST", "_BWD_TAIL_FAST"):
        monkeypatch.setattr(api, cache, {})
    monkeypatch.delattr(reference_launch, "supports_tail")
    kw = _pool_kw(pack, **_kwargs(tail))
    with pytest.raises(ValueError, match="backend 'reference' has no fused tail"):
        csa_compressor_forward_wrapper(*pack.inputs, backend="reference", **kw)
    monkeypatch.setattr(reference_launch, "supports_tail", lambda *a: False, raising=False)
    with pytest.raises(ValueError, match="backend 'reference' has no fused tail"):
        csa_compressor_forward_wrapper(*pack.inputs, backend="auto", **kw)


def test_auto_on_a_gpu_takes_the_next_backend_with_a_tail(monkeypatch):
    """auto's pick without a tail is the fastest backend; with one, the fastest that fuses it."""
    modules = {"cute": object(), "triton": type("M", (), {"supports_tail": staticmethod(lambda *a: True)})}
    monkeypatch.setattr(dispatch, "backend_module", lambda name: modules[name])
    monkeypatch.setattr(dispatch, "available_backends", lambda device: ["cute", "triton"])
    monkeypatch.setattr(dispatch, "resolve_backend", lambda name, *a: name)
    config = T.TailConfig(torch.float32, 64, True, False)
    cuda = torch.device("cuda", 0)
    assert tail_args.tail_backend("auto", "cute", cuda, 4, 2, 512, config) == "triton"
    with pytest.raises(ValueError, match=r"backend 'cute' has no fused tail.*backends with it on cuda:0: triton"):
        tail_args.tail_backend("cute", "cute", cuda, 4, 2, 512, config)


def test_validate_checks_the_positions():
    pack, tail = case_pack_and_tail("r4c2d5-rope2-pos")
    short = dataclasses.replace(tail, rope_cos=tail.rope_cos[:-1], rope_sin=tail.rope_sin[:-1])
    kw = _pool_kw(pack, backend="reference", validate=True)
    csa_compressor_forward_wrapper(*pack.inputs, **kw, **_kwargs(tail))
    with pytest.raises(ValueError, match="row positions must lie in"):
        csa_compressor_forward_wrapper(*pack.inputs, **kw, **_kwargs(short))


@pytest.mark.parametrize("backend", TAIL_BACKENDS)
def test_positions_outside_the_tables_through_the_api(backend):
    """Without validation a row outside the tables is not rotated; with it, every entry point raises naming the bound."""
    pack, tail = out_of_table_tail("r4c2d5-rope2-pos", seed=22)
    # A GPU backend on a GPU machine runs on a CUDA copy (generated on the CPU: the same values).
    device = "cpu" if backend == "reference" or _INTERPRETED else "cuda"
    run_pack, run_tail = out_of_table_tail("r4c2d5-rope2-pos", seed=22, device=device)
    kw = _pool_kw(run_pack, backend=backend, **_kwargs(run_tail))
    out = csa_compressor_forward_wrapper(*run_pack.inputs, **kw)["out"].cpu()
    grads = csa_compressor_backward_wrapper(*run_pack.inputs, run_pack.grad_out, **kw)
    report = T.contract_report(pack, tail, out, tuple(None if g is None else g.cpu() for g in grads.values()))
    assert report["ok"], report
    bound = re.escape(f"row positions must lie in [0, max_position={tail.rope_cos.shape[0]})") + ".*segment 0"
    calls = {
        "forward wrapper": lambda: csa_compressor_forward_wrapper(*run_pack.inputs, validate=True, **kw),
        "backward wrapper": lambda: csa_compressor_backward_wrapper(
            *run_pack.inputs, run_pack.grad_out, validate=True, **kw
        ),
        "compressor_pool": lambda: compressor_pool(*run_pack.inputs, validate=True, **kw),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=bound):
            call()
            raise AssertionError(f"{name} let a position outside the tables through")


def test_the_environment_variable_validates_the_tail_paths(monkeypatch):
    """``CSA_COMPRESSOR_VALIDATE=1`` checks the rows' positions on every tail path, autograd's backward included, as
    ``validate=True`` does; ``0`` leaves them unchecked and any other value is refused."""
    pack, tail = out_of_table_tail("r4c2d5-rope2-pos", seed=22)
    kw = _pool_kw(pack, backend="reference", **_kwargs(tail))
    monkeypatch.delenv(support.VALIDATE_ENV_VAR, raising=False)
    pooled = compressor_pool(*_leaves(pack.kv, pack.score, pack.ape), *pack.inputs[3:], **kw)
    calls = {
        "forward wrapper": lambda: csa_compressor_forward_wrapper(*pack.inputs, **kw),
        "backward wrapper": lambda: csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw),
        "compressor_pool forward": lambda: compressor_pool(*pack.inputs, **kw),
        "compressor_pool backward": lambda: pooled.backward(pack.grad_out, retain_graph=True),
    }
    for value, match in (("1", "row positions must lie in"), ("yes", "CSA_COMPRESSOR_VALIDATE must be 0 or 1")):
        monkeypatch.setenv(support.VALIDATE_ENV_VAR, value)
        for name, call in calls.items():
            with pytest.raises(ValueError, match=match):
                call()
                raise AssertionError(f"{name} ran with {support.VALIDATE_ENV_VAR}={value}")
    monkeypatch.setenv(support.VALIDATE_ENV_VAR, "0")
    for call in calls.values():
        call()


def test_empty_output_zeroes_the_weight_gradient():
    pack, tail = case_pack_and_tail("r4c2d5-rope2-pos")
    kw = _rc(pack, backend="reference", **_kwargs(tail))
    empty = pack.grad_out[:0]
    out = csa_compressor_forward_wrapper(*pack.inputs, total_comp=0, **kw)["out"]
    assert out.shape == (0, pack.head_dim)
    grads = csa_compressor_backward_wrapper(*pack.inputs, empty, **kw)
    assert all(not bool(g.any()) for g in grads) and grads["grad_norm_weight"].shape == (pack.head_dim,)


def test_module_takes_the_tail():
    pack, tail = case_pack_and_tail("r4c2d64-rope64-half", seed=16)
    module = CompressorPool(pack.ratio, pack.head_dim, pack.coff, backend="reference")
    with torch.no_grad():
        module.ape.copy_(pack.ape)
    out = module(
        pack.kv[:, None], pack.score[:, None], pack.cu_seqlens, pack.cu_seqlens_comp, pack.total_comp, **_kwargs(tail)
    )
    want = T.forward(*pack.inputs, tail, **_pool_kw(pack))
    assert out.shape == (pack.total_comp, 1, pack.head_dim) and torch.equal(out[:, 0], want)


# ---------------------------------------------------------------- the custom ops


def _op_tail(tail):
    """The tail ops' ``(tail_tensors, norm_eps, rope_dim, rope_interleaved)`` of a ``Tail``."""
    tensors = [tail.norm_weight, tail.rope_cos, tail.rope_sin, tail.position_start]
    return tensors, tail.norm_eps, tail.rope_dim, tail.rope_interleaved


@pytest.mark.parametrize("name", ["r4c2d5-rope2-pos", "r2c1d4-rope4-only-pos", "r128c2d4-rope2-only-half"])
def test_opcheck_tail_ops(name):
    pack, tail = case_pack_and_tail(name, seed=17)
    tensors, *scalars = _op_tail(tail)
    stats = uses_softmax_stats(pack.ratio, pack.coff)
    args = (*pack.inputs, pack.ratio, pack.coff, pack.total_comp, "reference", tensors, *scalars)
    op = torch.ops.csa_compressor.pool_forward_tail_stats if stats else torch.ops.csa_compressor.pool_forward_tail
    torch.library.opcheck(op.default, args)
    out, rstd, *saved = op(*args)
    assert rstd.shape == ((pack.total_comp,) if tail.has_norm else (0,))
    assert len(saved) == int(stats) and torch.equal(out, T.forward(*pack.inputs, tail, **_pool_kw(pack)))
    bwd_tensors = [*tensors, saved[0] if stats else None, rstd if tail.has_norm else None]
    bwd_args = (*pack.inputs, pack.grad_out, pack.ratio, pack.coff, "reference", bwd_tensors, *scalars)
    torch.library.opcheck(torch.ops.csa_compressor.pool_backward_tail.default, bwd_args)
    grads = torch.ops.csa_compressor.pool_backward_tail(*bwd_args)
    want = T.backward(*pack.inputs, pack.grad_out, tail, **_rc(pack))
    assert torch.equal(grads[0], want[0]) and grads[3].shape == ((pack.head_dim,) if tail.has_norm else (0,))


def test_tail_ops_name_a_wrong_tensor_list():
    pack, tail = case_pack_and_tail("r4c2d5-rope2-pos", seed=17)
    tensors, *scalars = _op_tail(tail)
    args = (*pack.inputs, pack.ratio, pack.coff, pack.total_comp, "reference")
    with pytest.raises(ValueError, match=r"tail_tensors must be \[norm_weight, rope_cos, rope_sin, position_start\]"):
        torch.ops.csa_compressor.pool_forward_tail(*args, tensors[:3], *scalars)
    bwd_args = (*pack.inputs, pack.grad_out, pack.ratio, pack.coff, "reference", tensors, *scalars)
    with pytest.raises(ValueError, match="position_start, softmax_stats, rstd"):
        torch.ops.csa_compressor.pool_backward_tail(*bwd_args)


def test_tail_op_with_an_identity_tail_is_the_pooling_op():
    pack, _ = case_pack_and_tail("r4c1d7-norm", seed=18)
    args = (*pack.inputs, pack.ratio, pack.coff, pack.total_comp, "reference")
    out, rstd = torch.ops.csa_compressor.pool_forward_tail(*args, [None] * 4, 1e-5, 0, True)
    assert torch.equal(out, torch.ops.csa_compressor.pool_forward(*args)) and rstd.numel() == 0


def test_function_apply_keeps_the_positional_tail():
    """``CompressorPoolFunction.apply`` takes validate and the tail arguments positionally, in compressor_pool's order."""
    pack, tail = case_pack_and_tail("r4c2d5-rope2-pos", seed=21)
    leaves = _leaves(pack.kv, pack.score, pack.ape, tail.norm_weight)
    head = (*leaves[:3], *pack.inputs[3:], pack.ratio, pack.coff, pack.total_comp, "reference", False)
    out = CompressorPoolFunction.apply(*head, leaves[3], *(getattr(tail, n) for n in NAMES[1:]))
    out.backward(pack.grad_out)
    assert torch.equal(out, T.forward(*pack.inputs, tail, **_pool_kw(pack)))
    grads = T.backward(*pack.inputs, pack.grad_out, tail, **_rc(pack))
    assert torch.equal(leaves[0].grad, grads[0]) and torch.equal(leaves[3].grad, grads[3].to(leaves[3].dtype))
    norm_only = CompressorPoolFunction.apply(*head, tail.norm_weight)  # the other six at their defaults
    assert torch.equal(norm_only, T.forward(*pack.inputs, T.Tail(tail.norm_weight), **_pool_kw(pack)))
    with pytest.raises(TypeError, match="at most 17 arguments"):
        CompressorPoolFunction.apply(*head, tail.norm_weight, *(getattr(tail, n) for n in NAMES[1:]), None)


def test_compressor_pool_eager_tail_is_the_function_bitwise():
    """compressor_pool's eager tail calls take the lean Function: the public Function's results and gradients, a
    table that asks for a gradient keeps the public one (its output then requires a gradient), in-place changes of
    the saved tables are still caught."""
    pack, tail = case_pack_and_tail("r4c2d5-rope2-pos", seed=23)
    head = (*pack.inputs[3:], pack.ratio, pack.coff, pack.total_comp, "reference")
    results = []
    for lean in (True, False):
        leaves = _leaves(pack.kv, pack.score, pack.ape, tail.norm_weight)
        kw = _kwargs(dataclasses.replace(tail, norm_weight=leaves[3]))
        if lean:
            out = compressor_pool(*leaves[:3], *head, **kw)
            assert type(out.grad_fn).__name__ == "_TailPoolFunctionBackward"
        else:
            out = CompressorPoolFunction.apply(*leaves[:3], *head, False, *kw.values())
        out.backward(pack.grad_out)
        results.append((out.detach(), *(t.grad for t in leaves)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    cos = tail.rope_cos.clone().requires_grad_(True)
    out = compressor_pool(*pack.inputs[:3], *head, **_kwargs(dataclasses.replace(tail, rope_cos=cos)))
    assert type(out.grad_fn).__name__ == "CompressorPoolFunctionBackward"
    leaves = _leaves(pack.kv, pack.score, pack.ape)
    sin = tail.rope_sin.clone()
    out = compressor_pool(*leaves, *head, **_kwargs(dataclasses.replace(tail, rope_sin=sin)))
    sin.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(pack.grad_out)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [*TAIL_BACKENDS, pytest.param("cute", marks=_marks("cute"))])
def test_cuda_graph_captures_the_tail(backend):
    """compressor_pool with a full tail captured and replayed: no host sync, the replay bitwise the eager call."""
    pack = make_pack((96, 50, 7), 64, 4, 2, comp_padding=3, device="cuda", seed=19)
    tail = T.random_tail(pack, rope_dim=32, positions=True, seed=20)
    leaves = _leaves(pack.kv, pack.score, pack.ape, tail.norm_weight)
    kw = _kwargs(dataclasses.replace(tail, norm_weight=leaves[3]))

    def step():
        out = compressor_pool(*leaves[:3], *pack.inputs[3:], 4, 2, pack.total_comp, backend, **kw)
        out.backward(pack.grad_out)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step().detach().clone()  # the warm-up compiles outside capture
    torch.cuda.current_stream().wait_stream(side)
    eager_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.detach(), eager)
    for t, want in zip(leaves, eager_grads, strict=True):
        assert torch.equal(t.grad, want)


# ---------------------------------------------------------------- host cost (python -m tests.test_tail_api)


def host_costs(with_tail: bool) -> dict[str, float]:
    """Per-call host microseconds of each entry point on CPU tensors, the reference backend's launch a no-op."""
    torch.set_num_threads(1)
    noop = lambda *a, **k: None  # noqa: E731
    reference_launch.forward = reference_launch.backward = noop
    pack = make_pack((64, 40), 128, 4, 2, comp_padding=1)
    tail = T.random_tail(pack, rope_dim=64, positions=True) if with_tail else T.Tail()
    kw = _kwargs(tail) if with_tail else {}
    base, (out, grads) = dict(ratio=4, coff=2, backend="reference"), _buffers(pack)
    bkw = dict(kw, grad_norm_weight=torch.empty(128)) if with_tail else {}
    fwd = CSACompressorForward(*pack.inputs, out, **base, **kw)
    bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, **base, **kw)
    calls = {
        "forward wrapper": lambda: csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **base, **kw),
        "backward wrapper": lambda: csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **base, **kw),
        "forward execute": lambda: fwd.execute(*pack.inputs, out, **kw),
        "backward execute": lambda: bwd.execute(*pack.inputs, pack.grad_out, *grads, **bkw),
        "compressor_pool (no grad)": lambda: compressor_pool(*pack.inputs, 4, 2, pack.total_comp, "reference", **kw),
    }  # fmt: skip
    costs = {}
    for name, call in calls.items():
        call()
        costs[name] = min(timeit.repeat(call, number=2000, repeat=25)) / 2000 * 1e6
    return costs


def main() -> None:
    for with_tail in (False, True):
        label = "with norm + rope + positions" if with_tail else "no tail"
        for name, us in host_costs(with_tail).items():
            print(f"{label}: {name}: {us:.2f} us per call")


if __name__ == "__main__":
    main()


def test_tail_arguments_are_the_api_names():
    from csa_compressor.bench.calls import TAIL_ARGS

    weight, table = torch.ones(8), torch.zeros(4, 1)
    tail = T.Tail(weight, 1e-5, table, table, 2, False, None)
    args = tail.arguments()
    assert tuple(args) == tuple(TAIL_ARGS)
    assert args["norm_weight"] is weight and args["rope_cos"] is table and args["norm_eps"] == 1e-5
    assert (args["rope_dim"], args["rope_interleaved"], args["position_start"]) == (2, False, None)
