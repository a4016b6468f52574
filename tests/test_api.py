"""Kernel API through every backend usable here: wrappers, classes, NaN canaries, N == 0, determinism."""

import dataclasses

import pytest
import torch

from csa_compressor import (
    CSACompressorBackward,
    CSACompressorForward,
    TupleDict,
    available_backends,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    reference,
)
from csa_compressor.testing import assert_contract, make_pack, rel_l2, truncated_pack

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = available_backends(DEVICE)
# Small packs (the Triton interpreter is slow on the CPU): ragged, short/empty segments, paddings, odd head_dim.
PACKS = [
    (4, 2, 9, (13, 3, 0, 9), 2, 2),
    (4, 1, 8, (10, 4), 1, 1),
    (128, 1, 4, (130, 5), 0, 1),
]
PACK_IDS = [f"r{p[0]}c{p[1]}d{p[2]}" for p in PACKS]


def _pack(params, seed=0):
    ratio, coff, head_dim, seqlens, tok_pad, comp_pad = params
    return make_pack(
        seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, device=DEVICE, seed=seed
    )


def test_tupledict_unpacks_like_a_tuple():
    td = TupleDict(grad_kv=1, grad_score=2, grad_ape=3)
    a, b, c = td
    assert (a, b, c) == (1, 2, 3)
    assert td["grad_score"] == 2 and td[2] == 3 and td[:2] == (1, 2) and len(td) == 3
    assert list(td.keys()) == ["grad_kv", "grad_score", "grad_ape"]
    (out,) = TupleDict(out=5)
    assert out == 5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", PACKS, ids=PACK_IDS)
def test_wrappers_match_fp32_reference(backend, params):
    p = _pack(params)
    kw = dict(ratio=p.ratio, coff=p.coff)
    (out,) = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, backend=backend, **kw)
    grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, backend=backend, **kw)
    assert_contract(p, out, tuple(grads))


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrapper_reads_total_comp_when_not_given(backend):
    p = _pack(PACKS[0])
    (out,) = csa_compressor_forward_wrapper(*p.inputs, ratio=4, coff=2, backend=backend)
    assert out.shape == (p.true_comp, 9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", PACKS, ids=PACK_IDS)
def test_class_api_overwrites_nan_canaries(backend, params):
    p = _pack(params, seed=1)
    kw = dict(ratio=p.ratio, coff=p.coff, backend=backend)
    out = torch.full((p.total_comp, p.head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fwd = CSACompressorForward(*p.inputs, out, **kw)
    assert fwd.check_support()
    fwd.compile()
    fwd.execute(*p.inputs, out)
    assert_contract(p, out)

    grads = [torch.full_like(p.kv, float("nan")), torch.full_like(p.score, float("nan")), torch.full_like(p.ape, 7.0)]
    bwd = CSACompressorBackward(*p.inputs, p.grad_out, *grads, **kw)
    bwd.compile()
    bwd.execute(*p.inputs, p.grad_out, *grads)
    assert not any(torch.isnan(g).any() for g in grads)
    # Includes: exact +0 where nothing was consumed, and grad_ape overwritten (not added to the 7.0 there).
    assert_contract(p, grads=tuple(grads))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_deterministic(backend):
    p = _pack(PACKS[0], seed=2)
    kw = dict(ratio=p.ratio, coff=p.coff, backend=backend)
    a = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **kw)["out"]
    b = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **kw)["out"]
    assert torch.equal(a, b)
    ga = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **kw)
    gb = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **kw)
    for x, y in zip(ga, gb, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_output(backend):
    p = make_pack((3, 1, 0), 8, 4, 2, token_padding=2, device=DEVICE)
    assert p.total_comp == 0
    (out,) = csa_compressor_forward_wrapper(*p.inputs, ratio=4, coff=2, total_comp=0, backend=backend)
    assert out.shape == (0, 8)
    grads = [torch.full_like(p.kv, float("nan")), torch.full_like(p.score, float("nan")), torch.full_like(p.ape, 1.0)]
    bwd = CSACompressorBackward(*p.inputs, p.grad_out, *grads, ratio=4, coff=2, backend=backend)
    bwd.execute(*p.inputs, p.grad_out, *grads)
    assert all(bool((g == 0).all()) for g in grads)
    wrapped = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, ratio=4, coff=2, backend=backend)
    assert all(bool((g == 0).all()) for g in wrapped)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tail", [False, True], ids=["pooling", "tail"])
def test_wrappers_build_no_autograd_graph(backend, tail):
    """The kernel API is not differentiable (compressor_pool is): given leaves that require grad, every backend
    returns plain results, as a kernel writing into buffers does, and holds no graph of its intermediates."""
    from csa_compressor import tail as T

    p = _pack(PACKS[0])
    leaves = [t.clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    kw = dict(ratio=p.ratio, coff=p.coff, backend=backend)
    if tail:
        t = T.random_tail(p, rope_dim=8, positions=True).arguments()
        kw.update(t, norm_weight=t["norm_weight"].clone().requires_grad_(True))
    inputs = (*leaves, p.cu_seqlens, p.cu_seqlens_comp)
    (out,) = csa_compressor_forward_wrapper(*inputs, total_comp=p.total_comp, **kw)
    grads = csa_compressor_backward_wrapper(*inputs, p.grad_out, **kw)
    assert not out.requires_grad and out.grad_fn is None
    assert len(grads) == (4 if tail else 3) and not any(g.requires_grad for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_algorithms_mode(backend):
    p = _pack(PACKS[1], seed=3)
    torch.use_deterministic_algorithms(True)
    try:
        grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, ratio=p.ratio, coff=p.coff, backend=backend)
    finally:
        torch.use_deterministic_algorithms(False)
    g64 = reference.backward(*p.inputs, p.grad_out, ratio=p.ratio, coff=p.coff, precision="fp64")
    assert rel_l2(grads["grad_ape"], g64[2]) <= 1e-5


@pytest.mark.parametrize("params", PACKS, ids=PACK_IDS)
def test_class_api_truncates_to_total_comp(params):
    """total_comp below the real rows: the first rows produced, the truncated pack's gradients, dropped tokens zero."""
    p = _pack(params, seed=4)
    rows = p.true_comp - 1
    p = dataclasses.replace(p, total_comp=rows, grad_out=p.grad_out[:rows].contiguous())
    short, keep = truncated_pack(p)
    kw = dict(ratio=p.ratio, coff=p.coff, backend="reference")
    out = torch.full((rows, p.head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    CSACompressorForward(*p.inputs, out, **kw).execute(*p.inputs, out)
    want = reference.forward(*short.inputs, ratio=p.ratio, coff=p.coff, total_comp=rows, precision="fp32")
    assert torch.equal(out, want)
    grads = [torch.full_like(t, float("nan")) for t in (p.kv, p.score, p.ape)]
    CSACompressorBackward(*p.inputs, p.grad_out, *grads, **kw).execute(*p.inputs, p.grad_out, *grads)
    want = reference.backward(*short.inputs, short.grad_out, ratio=p.ratio, coff=p.coff, precision="fp32")
    dropped = torch.ones(p.kv.shape[0], dtype=torch.bool, device=DEVICE)
    dropped[keep] = False
    for got, expected in zip(grads[:2], want[:2], strict=True):
        assert torch.equal(got[keep], expected) and not bool(got[dropped].view(torch.int16).any())
    assert torch.equal(grads[2], want[2])
