"""Property tests of the references over random packs: the fp64 oracle equals the SPEC transcription
(tests/naive.py) and the fp32 reference meets the contract, for any pack shape."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csa_compressor import reference
from csa_compressor.testing import contract_report, make_pack

from . import naive

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),  # CI draws the same examples every run
)


@st.composite
def packs(draw, ratios=(1, 2, 3, 4, 8), head_dims=None):
    """A ragged pack: empty and short segments, token and row padding; head_dim from ``head_dims`` (1-5)."""
    ratio = draw(st.sampled_from(ratios))
    coff = draw(st.sampled_from([1, 2]))
    head_dim = draw(head_dims or st.integers(1, 5))
    seqlens = draw(st.lists(st.integers(0, 3 * ratio + 2), min_size=1, max_size=5))
    token_padding = draw(st.integers(0, 3))
    comp_padding = draw(st.integers(0, 2))
    if comp_padding and sum(seqlens) + token_padding < ratio:  # padding rows read tokens 0..ratio-1
        token_padding = ratio - sum(seqlens)
    seed = draw(st.integers(0, 2**16))
    return make_pack(seqlens, head_dim, ratio, coff, token_padding=token_padding, comp_padding=comp_padding, seed=seed)


@SETTINGS
@given(pack=packs())
def test_oracle_matches_spec_transcription(pack):
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    out = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp64", **kw)
    torch.testing.assert_close(
        out, naive.forward(*pack.inputs, total_comp=pack.total_comp, **kw), rtol=1e-12, atol=1e-12
    )
    got = reference.backward(*pack.inputs, pack.grad_out, precision="fp64", **kw)
    want = naive.backward(*pack.inputs, pack.grad_out, **kw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(pack=packs())
def test_fp32_reference_meets_the_contract(pack):
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    out = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **kw)
    grads = reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw)
    # Never less accurate than the upstream eager numerics, but at a bf16 midpoint: there both round half an ulp
    # away from the oracle, and the fp32 intermediates may put ours a few fp32 roundings further.
    report = contract_report(pack, out, grads)
    failed = {k for k in ("fwd_beyond", "dscore_beyond") if report[k]} | (set() if report["zeros_exact"] else {"zeros"})
    o64 = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp64", **kw)
    tie = 2**-22 * float(o64.abs().max()) if o64.numel() else 0.0
    assert report["fwd_err"] <= report["upstream_err"] + tie and report["dkv_ulp"] <= 1 and not failed, report
    # dAPE within 1e-5 of the oracle relative to the size of its terms before they cancel: each slot's
    # p * g * (v - out) has terms of at most |g| * 2 max|kv| (out is a weighted mean of the values), so a row adds
    # at most 2 max|kv| |g| to an entry. Where the values are nearly equal, v - out cancels and dAPE, grad_score
    # with it, is far smaller than its terms; fp32 then cannot be within 1e-5 of dAPE itself.
    g64 = reference.backward(*pack.inputs, pack.grad_out, precision="fp64", **kw)
    err = float((grads[2].double() - g64[2]).norm())
    kv_max = float(pack.kv.abs().max()) if pack.kv.numel() else 0.0
    terms = 2 * kv_max * float(pack.grad_out.float().abs().sum())
    assert err <= 1e-5 * max(float(g64[2].norm()), terms), (err, report)


def test_contract_checker_catches_a_wrong_result():
    pack = make_pack((13, 6), 4, 4, 2, token_padding=1, comp_padding=1, seed=3)
    kw = dict(ratio=4, coff=2)
    out = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **kw)
    grads = list(reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw))
    assert contract_report(pack, out, tuple(grads))["ok"]
    bad = out.clone()
    bad[1, 2] = bad[1, 2] * 1.05  # a few bf16 ulps off
    assert not contract_report(pack, bad)["ok"]
    unzeroed = grads[0].clone()
    unzeroed[-1] = 1.0  # a token-capacity row that must stay an exact zero
    assert not contract_report(pack, grads=(unzeroed, grads[1], grads[2]))["ok"]
    wrong_ape = grads[2] * (1 + 1e-4)
    assert not contract_report(pack, grads=(grads[0], grads[1], wrong_ape))["ok"]


@pytest.mark.parametrize("precision", ["fp32", "upstream"])
def test_references_are_deterministic(precision):
    pack = make_pack((40, 9, 17), 6, 4, 2, comp_padding=2, seed=4)
    kw = dict(ratio=4, coff=2, precision=precision)
    a = reference.backward(*pack.inputs, pack.grad_out, **kw)
    b = reference.backward(*pack.inputs, pack.grad_out, **kw)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
