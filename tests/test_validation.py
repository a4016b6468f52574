"""Scalars checked like tensors, the validation mode (validate=True, CSA_COMPRESSOR_VALIDATE=1) and the one table
of bounds (support.py) that the checks and the per-call rechecks are generated from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csa_compressor import (
    CompressorPool,
    CSACompressorBackward,
    CSACompressorForward,
    compressor_pool,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    support,
    thd,
    validate_pack,
)
from csa_compressor.testing import make_pack, misaligned_copy

KW = dict(ratio=4, coff=2, backend="reference")


def _pack(seed=0):
    return make_pack((12, 5, 9), 8, 4, 2, token_padding=2, comp_padding=1, seed=seed)


def _leaves(p):
    return [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]


# ---------------------------------------------------------------- scalars

SCALARS = [
    (dict(coff=2.0), r"coff must be 1 or 2: got coff=2\.0"),
    (dict(coff=True), r"coff must be 1 or 2: got coff=True"),
    (dict(ratio=4.0), r"ratio must be an int in \[1, 256\]: got ratio=4\.0"),
    (dict(ratio=np.float32(4)), r"ratio must be an int in \[1, 256\]: got ratio="),
    (dict(ratio=0), r"ratio must be an int in \[1, 256\]: got ratio=0"),
    (dict(head_dim=8.0), r"head_dim must be a positive int: got head_dim=8\.0"),
    (dict(head_dim=-8), r"head_dim must be a positive int: got head_dim=-8"),
]
TOTAL_COMP = [
    (-1, r"total_comp must be a non-negative int: got total_comp=-1"),
    (2.5, r"total_comp must be a non-negative int: got total_comp=2\.5"),
    (5.0, r"total_comp must be a non-negative int: got total_comp=5\.0"),
    (True, r"total_comp must be a non-negative int: got total_comp=True"),
    ("5", r"total_comp must be a non-negative int: got total_comp='5'"),
]


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "cached"])
@pytest.mark.parametrize("bad,match", SCALARS, ids=[m.split(":")[0] for _, m in SCALARS])
def test_wrappers_name_bad_scalars(bad, match, warm):
    p = _pack()
    if warm:  # the wrappers' per-call cache must not let a float or bool through (4.0 == 4 as a key)
        csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **KW)
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **KW)
    with pytest.raises(ValueError, match=match):
        csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **{**KW, **bad})
    with pytest.raises(ValueError, match=match):
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **{**KW, **bad})


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "cached"])
@pytest.mark.parametrize("total_comp,match", TOTAL_COMP, ids=[repr(t) for t, _ in TOTAL_COMP])
def test_wrappers_name_bad_total_comp(total_comp, match, warm):
    p = _pack()
    if warm:
        csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **KW)
    with pytest.raises(ValueError, match=match):
        csa_compressor_forward_wrapper(*p.inputs, total_comp=total_comp, **KW)
    with pytest.raises(ValueError, match=match):
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out, total_comp=total_comp, **KW)


def test_a_derived_head_dim_must_be_positive():
    empty = torch.empty(8, 0, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim must be >= 1: got head_dim=0"):
        csa_compressor_forward_wrapper(empty, empty, torch.empty(4, 0), cu, cu, ratio=4, coff=1, total_comp=0)


def test_backward_wrapper_total_comp_must_match_grad_out():
    p = _pack()
    with pytest.raises(ValueError, match=r"total_comp must equal grad_out.shape\[0\]: got 3 vs 7"):
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out, total_comp=3, **KW)


@pytest.mark.parametrize("bad,match", SCALARS, ids=[m.split(":")[0] for _, m in SCALARS])
def test_classes_name_bad_scalars(bad, match):
    p = _pack()
    out = torch.empty(p.total_comp, 8, dtype=torch.bfloat16)
    grads = torch.empty_like(p.kv), torch.empty_like(p.score), torch.empty_like(p.ape)
    with pytest.raises(ValueError, match=match):
        CSACompressorForward(*p.inputs, out, **{**KW, **bad}).check_support()
    with pytest.raises(ValueError, match=match):
        CSACompressorBackward(*p.inputs, p.grad_out, *grads, **{**KW, **bad}).check_support()


@pytest.mark.parametrize(
    "bad,match",
    [*[s for s in SCALARS if "head_dim" not in s[0]], *[(dict(total_comp=t), m) for t, m in TOTAL_COMP]],
)
def test_compressor_pool_names_bad_scalars(bad, match):
    p = _pack()
    args = dict(ratio=4, coff=2, total_comp=p.total_comp, backend="reference") | bad
    with pytest.raises(ValueError, match=match):
        compressor_pool(*_leaves(p), p.cu_seqlens, p.cu_seqlens_comp, **args)


@pytest.mark.parametrize("bad,match", SCALARS, ids=[m.split(":")[0] for _, m in SCALARS])
def test_module_names_bad_scalars(bad, match):
    args = dict(ratio=4, head_dim=8, coff=2) | bad
    with pytest.raises(ValueError, match=match):
        CompressorPool(**args, backend="reference")
    with pytest.raises(ValueError, match="CompressorPool needs a head_dim"):
        CompressorPool(4, None)


def test_numpy_integers_are_converted_exactly():
    """numpy integer scalars are exact integers: every entry point converts them with operator.index."""
    p = _pack()
    ints = dict(ratio=4, coff=2)
    nps = dict(ratio=np.int64(4), coff=np.int32(2))
    want = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **ints, backend="reference")["out"]
    got = csa_compressor_forward_wrapper(
        *p.inputs, total_comp=np.int64(p.total_comp), head_dim=np.int16(8), **nps, backend="reference"
    )["out"]
    assert torch.equal(got, want)
    want_grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **ints, backend="reference")
    got_grads = csa_compressor_backward_wrapper(
        *p.inputs, p.grad_out, total_comp=np.int64(p.total_comp), **nps, backend="reference"
    )
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    out = torch.empty_like(want)
    op = CSACompressorForward(*p.inputs, out, **nps, backend="reference")
    op.execute(*p.inputs, out)
    assert torch.equal(out, want) and type(op.ratio) is int and type(op.coff) is int
    pooled = compressor_pool(*p.inputs, **nps, total_comp=np.int64(p.total_comp), backend="reference")
    assert torch.equal(pooled, want)
    module = CompressorPool(np.int64(4), np.int64(8), np.int64(2), backend="reference")
    assert (type(module.ratio), type(module.head_dim), type(module.coff)) == (int, int, int)


# ---------------------------------------------------------------- the validation mode

# (cu_seqlens, cu_seqlens_comp, T, total_comp, the error) at ratio 4: each content bound, named with its segment.
BOUNDS = {
    "start": ([1, 8, 16], [0, 1, 3], 18, 4, r"cu_seqlens\[0\] must be 0: got 1 \(segment 0\)"),
    "decreasing": (
        [0, 8, 4, 12],
        [0, 2, 1, 3],
        18,
        4,
        r"cu_seqlens must be non-decreasing: segment 1 runs from 8 to 4",
    ),
    "negative": ([0, -4, 12], [0, 0, 4], 18, 4, r"cu_seqlens must be non-decreasing: segment 0 runs from 0 to -4"),
    "beyond_T": (
        [0, 8, 20],
        [0, 2, 5],
        18,
        5,
        r"cu_seqlens\[-1\] must be <= T \(kv.shape\[0\]\): segment 1 ends at 20 > T = 18",
    ),
    "comp_start": ([0, 8, 16], [1, 3, 5], 18, 5, r"cu_seqlens_comp\[0\] must be 0: got 1 \(segment 0\)"),
    "counts": (
        [0, 8, 17],
        [0, 2, 3],
        18,
        4,
        r"cu_seqlens_comp must count seqlen // ratio rows per segment: segment 1 has 9 tokens, 2 rows at ratio 4, "
        r"but cu_seqlens_comp gives 1 \(2 to 3\)",
    ),
    "total_comp": (
        [0, 8, 16],
        [0, 2, 4],
        18,
        3,
        r"total_comp must cover the real rows \(cu_seqlens_comp\[-1\] <= total_comp\): segment 1's rows end at 4 > "
        r"total_comp = 3",
    ),
}


def _malformed(name, seed=0):
    cu, comp, tokens, rows, match = BOUNDS[name]
    p = make_pack((tokens,), 8, 4, 2, seed=seed)
    cu_t, comp_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(comp, dtype=torch.int32)
    grad_out = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return (p.kv, p.score, p.ape, cu_t, comp_t), grad_out, rows, match


def _forward_wrapper(inputs, grad_out, rows, validate):
    csa_compressor_forward_wrapper(*inputs, total_comp=rows, validate=validate, **KW)


def _backward_wrapper(inputs, grad_out, rows, validate):
    csa_compressor_backward_wrapper(*inputs, grad_out, validate=validate, **KW)


def _forward_execute(inputs, grad_out, rows, validate):
    out = torch.empty(rows, 8, dtype=torch.bfloat16)
    CSACompressorForward(*inputs, out, **KW).execute(*inputs, out, validate=validate)


def _backward_execute(inputs, grad_out, rows, validate):
    grads = [torch.empty_like(t) for t in inputs[:3]]
    CSACompressorBackward(*inputs, grad_out, *grads, **KW).execute(*inputs, grad_out, *grads, validate=validate)


def _pool(inputs, grad_out, rows, validate):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs[:3]]
    out = compressor_pool(
        *leaves, *inputs[3:], ratio=4, coff=2, total_comp=rows, backend="reference", validate=validate
    )
    out.backward(grad_out)


def _module(inputs, grad_out, rows, validate):
    module = CompressorPool(4, 8, 2, backend="reference", validate=validate)
    module(inputs[0], inputs[1], inputs[3], inputs[4], total_comp=rows)


ENTRY_POINTS = [_forward_wrapper, _backward_wrapper, _forward_execute, _backward_execute, _pool, _module]
ENTRY_IDS = [f.__name__.strip("_") for f in ENTRY_POINTS]


@pytest.mark.parametrize("name", list(BOUNDS))
def test_validate_pack_names_each_bound_and_segment(name):
    inputs, _, rows, match = _malformed(name)
    with pytest.raises(ValueError, match=match):
        validate_pack(inputs[3], inputs[4], 4, inputs[0].shape[0], rows)


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=ENTRY_IDS)
@pytest.mark.parametrize("name", ["decreasing", "beyond_T", "counts", "total_comp"])
def test_every_entry_point_validates_on_request(entry, name):
    inputs, grad_out, rows, match = _malformed(name)
    with pytest.raises(ValueError, match=match):
        entry(inputs, grad_out, rows, True)
    entry(inputs, grad_out, rows, False)  # off by default: malformed offsets run, inside the tensors


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=ENTRY_IDS)
def test_the_environment_variable_validates_every_call(entry, monkeypatch):
    inputs, grad_out, rows, match = _malformed("counts")
    monkeypatch.setenv(support.VALIDATE_ENV_VAR, "1")
    with pytest.raises(ValueError, match=match):
        entry(inputs, grad_out, rows, False)
    monkeypatch.setenv(support.VALIDATE_ENV_VAR, "0")
    entry(inputs, grad_out, rows, False)
    monkeypatch.setenv(support.VALIDATE_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"CSA_COMPRESSOR_VALIDATE must be 0 or 1 \(or unset\): got 'yes'"):
        entry(inputs, grad_out, rows, False)


def test_validation_accepts_well_formed_packs_and_keeps_results():
    p = _pack(seed=3)
    plain = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **KW)["out"]
    checked = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, validate=True, **KW)["out"]
    assert torch.equal(plain, checked)
    grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, validate=True, **KW)
    want = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **KW)
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))


def test_validation_is_off_unless_asked(monkeypatch):
    """Without validate=True or the variable, nothing reads the offsets (no synchronisation per call)."""
    monkeypatch.delenv(support.VALIDATE_ENV_VAR, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("validation ran uninvited")

    monkeypatch.setattr(thd, "validate_pack", refuse)
    p = _pack()
    for entry in ENTRY_POINTS:
        entry(p.inputs, p.grad_out, p.total_comp, False)
    assert support.validation_env() is None
    monkeypatch.setenv(support.VALIDATE_ENV_VAR, "1")
    assert support.validation_env() is not None  # seen at once: the per-call read follows os.environ


def test_validate_pack_checks_the_offset_arrays_themselves():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens must have at least 2 entries: got shape \(1,\)"):
        validate_pack(cu[:1], cu[:1], 4, 16)
    with pytest.raises(ValueError, match=r"cu_seqlens_comp shape must equal cu_seqlens shape: got \(2,\) vs \(3,\)"):
        validate_pack(cu, cu[:2], 4, 16)
    with pytest.raises(ValueError, match=r"cu_seqlens dtype must be torch.int32: got torch.int64"):
        validate_pack(cu.long(), cu, 4, 16)
    with pytest.raises(ValueError, match=r"total_tokens must be a non-negative int: got total_tokens=16\.0"):
        validate_pack(cu, thd.compute_cu_seqlens_comp(cu, 4), 4, 16.0)
    with pytest.raises(ValueError, match=r"ratio must be an int in \[1, 256\]"):
        validate_pack(cu, cu, 0, 16)


def test_validation_refuses_under_graph_capture(monkeypatch):
    """Under CUDA-graph capture the validation cannot read the offsets: a RuntimeError saying what to do instead."""
    monkeypatch.setattr(thd, "_capturing", lambda device: True)
    p = _pack()
    match = r"CUDA-graph capture forbids; validate before capturing \(validate_pack\(\) or one call with validate=True"
    with pytest.raises(RuntimeError, match=match):
        validate_pack(p.cu_seqlens, p.cu_seqlens_comp, 4, p.kv.shape[0], p.total_comp)
    for entry in ENTRY_POINTS:
        with pytest.raises(RuntimeError, match=match):
            entry(p.inputs, p.grad_out, p.total_comp, True)
        entry(p.inputs, p.grad_out, p.total_comp, False)  # validation off: capture-safe as before


@pytest.mark.gpu
def test_validation_refuses_during_a_real_capture():
    p = make_pack((12, 5, 9), 8, 4, 2, comp_padding=1, device="cuda")
    kw = dict(KW, total_comp=p.total_comp)
    csa_compressor_forward_wrapper(*p.inputs, **kw)  # compiled and warm
    validate_pack(p.cu_seqlens, p.cu_seqlens_comp, 4, p.kv.shape[0], p.total_comp)  # what to do before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match="CUDA-graph capture forbids"):
            csa_compressor_forward_wrapper(*p.inputs, validate=True, **kw)
        out = csa_compressor_forward_wrapper(*p.inputs, **kw)["out"]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, csa_compressor_forward_wrapper(*p.inputs, **kw)["out"])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BOUNDS))
def test_validation_on_the_gpu_names_each_bound(name):
    inputs, _, rows, match = _malformed(name)
    inputs = [t.cuda() for t in inputs]
    with pytest.raises(ValueError, match=match):
        csa_compressor_forward_wrapper(*inputs, total_comp=rows, validate=True, **KW)


def test_torch_compile_with_validation_on():
    """fullgraph=True holds with validate=True: the check runs inside the custom op, at run time, every call."""
    torch._dynamo.reset()
    good, _, rows, _ = _malformed("total_comp")
    good = list(good)
    good[4] = thd.compute_cu_seqlens_comp(good[3], 4)
    rows = int(good[4][-1])

    def region(kv, score, ape, cu_seqlens, cu_seqlens_comp):
        out = compressor_pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, 4, 2, rows, "reference", validate=True)
        return out.float() * 2.0

    compiled = torch.compile(region, fullgraph=True)
    assert torch.equal(compiled(*good), region(*good))
    bad = list(good)
    bad[4] = torch.tensor([0, 1, 4], dtype=torch.int32)  # same shapes: no recompile, a ValueError at run time
    with pytest.raises(ValueError, match="cu_seqlens_comp must count seqlen // ratio rows per segment: segment 0"):
        compiled(*bad)


# ---------------------------------------------------------------- one table of bounds


def _all_bounds():
    steps = [s for _, variant in support.VARIANTS.values() for s in variant]
    steps += [*support.SCALARS, *support.TOTAL_COMP_ROWS, *support.TOTAL_TOKENS, *support.OFFSETS_ALONE]
    return {s for s in steps if isinstance(s, support.Bound)}


def test_every_bound_is_written_once():
    """A bound appears in the table once: no two bounds test the same thing or share a name with the same test."""
    bounds = _all_bounds()
    tests = [b.test for b in bounds]
    assert len(tests) == len(set(tests)), sorted(t for t in tests if tests.count(t) > 1)


def test_rechecks_test_only_table_bounds():
    """The per-call rechecks are generated from the table: their source is the table's per-call tests."""
    per_call = {b.test for b in _all_bounds() if b.per_call}
    assert "width == WIDTH" in per_call and "rows == 0 or T >= RATIO" in per_call
    assert all(not b.per_call for b in support.SCALARS if isinstance(b, support.Bound))


@pytest.mark.parametrize(
    "index,bad,match",
    [
        (0, lambda t: t.float(), "kv dtype must be one of"),
        (1, lambda t: t[:-1], r"score shape must be \(28, 16\): got \(27, 16\)"),
        (2, misaligned_copy, "ape must be 16-byte aligned: data_ptr"),
        (3, lambda t: t[None], r"cu_seqlens must have rank 1: got shape \(1, 4\)"),
        (3, lambda t: torch.empty(8, dtype=torch.int32)[::2], r"cu_seqlens must be contiguous"),
        (4, lambda t: t.to("meta"), "all tensors must be on one device: cu_seqlens_comp is on meta, not cpu"),
        (5, lambda t: t[:, :4], r"out must be contiguous"),
        (5, lambda t: torch.empty(t.shape[0], 4, dtype=t.dtype), r"out.shape\[1\] must be head_dim=8: got shape"),
    ],
)
def test_execute_and_check_support_raise_the_same_error(index, bad, match):
    p = _pack()
    out = torch.empty(p.total_comp, 8, dtype=torch.bfloat16)
    args = [*p.inputs, out]
    op = CSACompressorForward(*args, **KW)
    op.compile()
    args[index] = bad(args[index])
    with pytest.raises(ValueError, match=match) as from_execute:
        op.execute(*args)
    with pytest.raises(ValueError, match=match) as from_check:
        CSACompressorForward(*args, **KW).check_support()
    assert str(from_execute.value) == str(from_check.value)
