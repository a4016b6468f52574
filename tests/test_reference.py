"""The three eager references against the SPEC text (tests/naive.py) and against each other."""

import pytest
import torch

from csa_compressor import reference
from csa_compressor.testing import bf16_ulp_distance, make_pack, rel_l2

from . import naive

# (ratio, coff, head_dim, seqlens, token_padding, comp_padding)
PACKS = [
    (4, 2, 5, (13, 3, 0, 9, 8), 3, 2),  # short, empty, exact-multiple segments, both paddings
    (4, 1, 7, (11, 4, 2), 0, 1),
    (2, 2, 3, (5, 1, 6), 2, 0),
    (2, 1, 4, (0, 7), 1, 3),
    (8, 2, 3, (17, 8, 7), 0, 2),
    (8, 1, 6, (24,), 5, 0),
    (128, 1, 3, (257, 100), 2, 1),
    (128, 2, 2, (300, 128, 5), 0, 2),
]
IDS = [f"r{p[0]}c{p[1]}d{p[2]}" for p in PACKS]


def _pack(params, seed=0):
    ratio, coff, head_dim, seqlens, tok_pad, comp_pad = params
    return make_pack(seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, seed=seed)


@pytest.mark.parametrize("params", PACKS, ids=IDS)
def test_oracle_matches_spec_text(params):
    p = _pack(params)
    kw = dict(ratio=p.ratio, coff=p.coff)
    out = reference.forward(*p.inputs, total_comp=p.total_comp, precision="fp64", **kw)
    expected = naive.forward(*p.inputs, total_comp=p.total_comp, **kw)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = reference.backward(*p.inputs, p.grad_out, precision="fp64", **kw)
    expected_grads = naive.backward(*p.inputs, p.grad_out, **kw)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("params", PACKS, ids=IDS)
def test_references_agree_within_precision(params):
    p = _pack(params, seed=1)
    kw = dict(ratio=p.ratio, coff=p.coff)
    f = {pr: reference.forward(*p.inputs, total_comp=p.total_comp, precision=pr, **kw) for pr in reference.PRECISIONS}
    assert f["fp32"].dtype == f["upstream"].dtype == torch.bfloat16 and f["fp64"].dtype == torch.float64
    # fp32 intermediates + one rounding: within one bf16 ulp of the correctly rounded oracle.
    assert int(bf16_ulp_distance(f["fp32"], f["fp64"].to(torch.bfloat16)).max()) <= 1
    # Upstream rounds weights and products: a few bf16 roundings, never better than fp32.
    assert rel_l2(f["upstream"], f["fp64"]) < 1.5e-2
    err32 = (f["fp32"].double() - f["fp64"]).abs().max()
    err_up = (f["upstream"].double() - f["fp64"]).abs().max()
    assert err32 <= err_up

    g = {pr: reference.backward(*p.inputs, p.grad_out, precision=pr, **kw) for pr in reference.PRECISIONS}
    for i in range(2):
        assert g["fp32"][i].dtype == torch.bfloat16 and g["fp64"][i].dtype == torch.float64
        assert rel_l2(g["fp32"][i], g["fp64"][i]) < 4e-3
        assert rel_l2(g["upstream"][i], g["fp64"][i]) < 2e-2
    assert g["fp32"][2].dtype == g["upstream"][2].dtype == torch.float32
    assert rel_l2(g["fp32"][2], g["fp64"][2]) < 1e-5
    assert rel_l2(g["upstream"][2], g["fp64"][2]) < 2e-2


@pytest.mark.parametrize("params", PACKS, ids=IDS)
def test_unconsumed_positions_are_exact_zeros(params):
    p = _pack(params, seed=2)
    grad_kv, grad_score, _ = reference.backward(*p.inputs, p.grad_out, ratio=p.ratio, coff=p.coff, precision="fp32")
    d, ratio = p.head_dim, p.ratio
    consumed = torch.zeros_like(grad_kv, dtype=torch.bool)
    start = 0
    for n in p.seqlens:
        groups = n // ratio
        for j in range(groups):
            rows = slice(start + j * ratio, start + (j + 1) * ratio)
            if p.coff == 1:
                consumed[rows] = True
            else:
                consumed[rows, d:] = True
                if j + 1 < groups:  # read by the next group's previous-half slots
                    consumed[rows, :d] = True
        start += n
    assert torch.all(grad_kv[~consumed] == 0) and torch.all(grad_score[~consumed] == 0)
    assert torch.all(grad_kv[consumed] != 0)  # random data: every consumed slot gets a gradient


@pytest.mark.parametrize("params", PACKS[:4], ids=IDS[:4])
def test_fp32_backward_is_autograd_of_forward(params):
    p = _pack(params, seed=3)
    kw = dict(ratio=p.ratio, coff=p.coff)
    leaves = [t.detach().clone().requires_grad_(True) for t in p.inputs[:3]]
    out = reference.forward(*leaves, *p.inputs[3:], total_comp=p.total_comp, precision="fp32", **kw)
    real = (torch.arange(p.total_comp) < p.true_comp)[:, None]
    auto = torch.autograd.grad(out, leaves, torch.where(real, p.grad_out, 0))
    closed = reference.backward(*p.inputs, p.grad_out, precision="fp32", **kw)
    assert torch.equal(auto[0], closed[0])  # d(values) = g * p: one multiply either way
    assert int(bf16_ulp_distance(auto[1], closed[1]).max()) <= 1
    assert rel_l2(auto[2], closed[2]) < 1e-6


@pytest.mark.parametrize("coff", [1, 2])
def test_fp64_gradcheck(coff):
    p = make_pack((9, 3, 6), 2, 3, coff, token_padding=1, comp_padding=1, seed=4)
    kv, score = p.kv.double().requires_grad_(), p.score.double().requires_grad_()
    ape = p.ape.double().requires_grad_()

    def fn(kv, score, ape):
        return reference.forward(
            kv,
            score,
            ape,
            p.cu_seqlens,
            p.cu_seqlens_comp,
            ratio=3,
            coff=coff,
            total_comp=p.total_comp,
            precision="fp64",
        )

    assert torch.autograd.gradcheck(fn, (kv, score, ape))
    # The closed-form oracle backward equals autograd of the oracle forward (real rows only).
    out = fn(kv, score, ape)
    real = (torch.arange(p.total_comp) < p.true_comp)[:, None]
    g = torch.where(real, p.grad_out.double(), 0)
    auto = torch.autograd.grad(out, (kv, score, ape), g)
    closed = reference.backward(
        p.kv.double(),
        p.score.double(),
        ape.detach(),
        p.cu_seqlens,
        p.cu_seqlens_comp,
        g,
        ratio=3,
        coff=coff,
        precision="fp64",
    )
    for a, c in zip(auto, closed, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("precision", reference.PRECISIONS)
def test_empty_output(precision):
    p = make_pack((3, 2), 4, 4, 2, seed=5)  # every segment shorter than ratio
    assert p.total_comp == 0
    out = reference.forward(*p.inputs, ratio=4, coff=2, total_comp=0, precision=precision)
    assert out.shape == (0, 4)
    grads = reference.backward(*p.inputs, p.grad_out, ratio=4, coff=2, precision=precision)
    assert all(torch.all(t == 0) for t in grads)
    assert grads[0].shape == p.kv.shape and grads[2].shape == p.ape.shape


def test_padding_rows_behave_as_first_group_and_are_ignored_backward():
    p = make_pack((8,), 3, 4, 2, token_padding=2, comp_padding=2, seed=6)
    out = reference.forward(*p.inputs, ratio=4, coff=2, total_comp=p.total_comp, precision="fp64")
    # A padding row pools tokens 0..ratio-1 (own half) with the previous half empty: the first row exactly.
    assert torch.equal(out[2], out[0]) and torch.equal(out[3], out[0])
    grad_out = p.grad_out.clone()
    base = reference.backward(*p.inputs, grad_out, ratio=4, coff=2, precision="fp64")
    grad_out[2:] = float("nan")
    again = reference.backward(*p.inputs, grad_out, ratio=4, coff=2, precision="fp64")
    for a, b in zip(base, again, strict=True):
        assert torch.equal(a, b)


def test_nonfinite_inputs_propagate_like_eager():
    p = make_pack((8,), 4, 4, 1, seed=7)
    p.kv[1, 2] = float("nan")
    out = reference.forward(*p.inputs, ratio=4, coff=1, total_comp=p.total_comp, precision="fp32")
    up = reference.forward(*p.inputs, ratio=4, coff=1, total_comp=p.total_comp, precision="upstream")
    assert torch.equal(torch.isnan(out), torch.isnan(up)) and bool(torch.isnan(out[0, 2]))
