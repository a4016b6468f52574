"""Softmax statistics of long windows: the reference definition, API plumbing and autograd path (the kernel
backends are tested against these in tests/backends).
"""

import math

import pytest
import torch

from csa_compressor import api, compressor_pool, reference
from csa_compressor.testing import contract_report, make_pack

LONG = [(16, 2, 5), (17, 1, 8), (32, 2, 3)]  # (ratio, coff, head_dim): windows of 32, 17 and 64 slots


def _pack(ratio, coff, head_dim, seed=0):
    # Ragged: a segment shorter than ratio, an empty one, a trailing partial group; padding tokens and rows.
    seqlens = (3 * ratio + 1, ratio - 1, 0, 2 * ratio)
    return make_pack(seqlens, head_dim, ratio, coff, token_padding=3, comp_padding=2, seed=seed)


def test_uses_softmax_stats_is_the_long_window_rule():
    assert not reference.uses_softmax_stats(4, 2)
    assert not reference.uses_softmax_stats(8, 2)
    assert not reference.uses_softmax_stats(16, 1)
    assert reference.uses_softmax_stats(16, 2)
    assert reference.uses_softmax_stats(17, 1)
    assert reference.uses_softmax_stats(128, 1)


@pytest.mark.parametrize("ratio,coff,head_dim", LONG)
def test_softmax_stats_match_a_float64_softmax(ratio, coff, head_dim):
    p = _pack(ratio, coff, head_dim)
    stats = reference.softmax_stats(*p.inputs, ratio=ratio, coff=coff, total_comp=p.total_comp)
    assert stats.shape == (p.total_comp, 3, head_dim) and stats.dtype == torch.float32
    out64 = reference.forward(*p.inputs, ratio=ratio, coff=coff, total_comp=p.total_comp, precision="fp64")
    torch.testing.assert_close(stats[:, 2].double(), out64, rtol=1e-5, atol=1e-6)
    out32 = reference.forward(*p.inputs, ratio=ratio, coff=coff, total_comp=p.total_comp, precision="fp32")
    assert torch.equal(stats[:, 2].to(torch.bfloat16), out32)
    # m is the max logit in the log2 domain and 1/l normalises 2^(y - m): the largest weight is 1/l.
    row = p.total_comp - 1 - 2  # the last real row
    r_first = 0
    for r in (r_first, row):
        win = reference._window(p.cu_seqlens, p.cu_seqlens_comp, p.total_comp, p.kv.shape[0], ratio, coff)
        _, logits = reference._windows(p.kv.float(), p.score, p.ape, win, ratio, coff, torch.float64)
        y = logits[r] * math.log2(math.e)
        m = y.max(dim=0).values
        torch.testing.assert_close(stats[r, 0].double(), m, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(stats[r, 1].double(), 1.0 / torch.exp2(y - m).sum(dim=0), rtol=1e-5, atol=0)


@pytest.mark.parametrize("ratio,coff,head_dim", LONG)
def test_backward_from_stats_meets_the_contract_and_uses_them(ratio, coff, head_dim):
    p = _pack(ratio, coff, head_dim, seed=1)
    stats = reference.softmax_stats(*p.inputs, ratio=ratio, coff=coff, total_comp=p.total_comp)
    grads = reference.backward_from_stats(*p.inputs, p.grad_out, stats, ratio=ratio, coff=coff)
    report = contract_report(p, grads=grads)
    assert report["ok"], report
    # Wrong statistics give wrong gradients: the stats are what the computation reads.
    wrong = stats.clone()
    wrong[:, 2] += 0.5
    bad = reference.backward_from_stats(*p.inputs, p.grad_out, wrong, ratio=ratio, coff=coff)
    assert not contract_report(p, grads=bad)["ok"]


@pytest.mark.parametrize("ratio,coff,head_dim", LONG)
def test_wrappers_return_and_take_stats(ratio, coff, head_dim):
    p = _pack(ratio, coff, head_dim, seed=2)
    kw = dict(ratio=ratio, coff=coff, total_comp=p.total_comp, backend="reference")
    res = api.csa_compressor_forward_wrapper(*p.inputs, return_softmax_stats=True, **kw)
    out, stats = res
    assert torch.equal(out, api.csa_compressor_forward_wrapper(*p.inputs, **kw)["out"])
    assert torch.equal(stats, reference.softmax_stats(*p.inputs, ratio=ratio, coff=coff, total_comp=p.total_comp))
    with_stats = api.csa_compressor_backward_wrapper(*p.inputs, p.grad_out, softmax_stats=stats, **kw)
    assert contract_report(p, grads=tuple(with_stats))["ok"]
    # The stats really travel down: corrupt ones change grad_score.
    wrong = stats.clone()
    wrong[:, 2] += 0.5
    bad = api.csa_compressor_backward_wrapper(*p.inputs, p.grad_out, softmax_stats=wrong, **kw)
    assert not torch.equal(bad["grad_score"], with_stats["grad_score"])


def test_stats_are_rejected_where_they_do_not_apply():
    p = make_pack((13, 9), 6, 4, 2, comp_padding=1)
    kw = dict(ratio=4, coff=2, total_comp=p.total_comp, backend="reference")
    with pytest.raises(ValueError, match="softmax_stats are used only for windows of more than 16 slots"):
        api.csa_compressor_forward_wrapper(*p.inputs, return_softmax_stats=True, **kw)
    stats = torch.zeros((p.total_comp, 3, 6))
    with pytest.raises(ValueError, match="more than 16 slots"):
        api.csa_compressor_backward_wrapper(*p.inputs, p.grad_out, softmax_stats=stats, **kw)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda n, d: torch.zeros((n, 3, d), dtype=torch.float64), "softmax_stats dtype must be torch.float32"),
        (lambda n, d: torch.zeros((n + 1, 3, d)), r"softmax_stats shape must be"),
        (lambda n, d: torch.zeros((n, d, 3)).transpose(1, 2), "softmax_stats must be contiguous"),
        (lambda n, d: torch.zeros((n, 3 * d)), "softmax_stats must have rank 3"),
        (lambda n, d: [0.0], "softmax_stats must be a tensor"),
    ],
)
def test_execute_checks_the_stats_tensor(bad, match):
    ratio, coff, d = 16, 2, 5
    p = _pack(ratio, coff, d)
    out = torch.empty((p.total_comp, d), dtype=torch.bfloat16)
    op = api.CSACompressorForward(*p.inputs, out, ratio=ratio, coff=coff, backend="reference")
    op.compile()
    assert op.uses_stats
    with pytest.raises(ValueError, match=match):
        op.execute(*p.inputs, out, softmax_stats=bad(p.total_comp, d))
    grads = torch.empty_like(p.kv), torch.empty_like(p.score), torch.empty_like(p.ape)
    bop = api.CSACompressorBackward(*p.inputs, p.grad_out, *grads, ratio=ratio, coff=coff, backend="reference")
    with pytest.raises(ValueError, match=match):
        bop.execute(*p.inputs, p.grad_out, *grads, softmax_stats=bad(p.total_comp, d))


@pytest.mark.parametrize("ratio,coff,head_dim", LONG[:2])
def test_autograd_saves_stats_for_the_backward(ratio, coff, head_dim, monkeypatch):
    p = _pack(ratio, coff, head_dim, seed=3)
    seen = []
    real = api._pool_backward

    def spy(*args, stats=None, **kw):
        seen.append(stats)
        return real(*args, stats=stats, **kw)

    monkeypatch.setattr(api, "_pool_backward", spy)
    leaves = [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    out = compressor_pool(*leaves, p.cu_seqlens, p.cu_seqlens_comp, ratio, coff, p.total_comp, "reference")
    out.backward(p.grad_out)
    assert len(seen) == 1 and seen[0] is not None and seen[0].shape == (p.total_comp, 3, head_dim)
    assert contract_report(p, grads=(leaves[0].grad, leaves[1].grad, leaves[2].grad))["ok"]


def test_opcheck_stats_ops():
    p = _pack(16, 2, 4)
    args = (*p.inputs, 16, 2, p.total_comp, "reference")
    torch.library.opcheck(torch.ops.csa_compressor.pool_forward_stats.default, args)
    stats = reference.softmax_stats(*p.inputs, ratio=16, coff=2, total_comp=p.total_comp)
    bwd_args = (*p.inputs, p.grad_out, 16, 2, "reference", stats)
    torch.library.opcheck(torch.ops.csa_compressor.pool_backward.default, bwd_args)


def test_torch_compile_fullgraph_long_window():
    torch._dynamo.reset()
    p = _pack(16, 2, 4, seed=4)

    def region(kv, score, ape):
        out = compressor_pool(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, 16, 2, p.total_comp, "reference")
        return out * 2

    eager_leaves = [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    comp_leaves = [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    eager = region(*eager_leaves)
    got = torch.compile(region, fullgraph=True)(*comp_leaves)
    assert torch.equal(eager, got)
    eager.backward(p.grad_out)
    got.backward(p.grad_out)
    for a, b in zip(eager_leaves, comp_leaves, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_autograd_uses_stats_per_backend():
    """Autograd saves statistics on backends whose pair passed the full-size GPU check (``AUTOGRAD_STATS``)."""
    p = _pack(16, 2, 4)
    assert api.autograd_uses_stats(p.kv, 16, 2, "reference")
    assert not api.autograd_uses_stats(p.kv, 4, 2, "reference")  # short window
    assert not api.autograd_uses_stats(p.kv, 16, 2, "no-such-backend")  # the forward reports it
    from csa_compressor.backends.reference import launch as reference_launch

    assert reference_launch.AUTOGRAD_STATS is True
    triton_launch = pytest.importorskip("csa_compressor.backends.triton.launch", reason="triton not installed")
    assert triton_launch.AUTOGRAD_STATS is True and triton_launch.supports_stats(16, 2, 4)


def test_the_backend_lookup_is_a_compile_time_constant():
    """``api`` marks the lookup the way ``torch.compiler.assume_constant_result`` does, without importing dynamo."""

    def probe():
        return True

    marked = torch.compiler.assume_constant_result(probe)
    flags = {k: v for k, v in vars(marked).items() if k.startswith("_dynamo")}
    assert flags and all(getattr(api._autograd_stats_for, k, None) == v for k, v in flags.items())
