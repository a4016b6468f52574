"""compressor_pool (autograd + custom op), torch.compile(fullgraph=True), and the CompressorPool module."""

import pytest
import torch

from csa_compressor import CompressorPool, available_backends, compressor_pool, compute_cu_seqlens_comp, reference
from csa_compressor.testing import bf16_ulp_distance, make_pack, rel_l2

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = available_backends(DEVICE)


def _leaves(p):
    return [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]


def _fp32_expected(p):
    kw = dict(ratio=p.ratio, coff=p.coff)
    out = reference.forward(*p.inputs, total_comp=p.total_comp, precision="fp32", **kw)
    return out, reference.backward(*p.inputs, p.grad_out, precision="fp32", **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("coff", [1, 2])
def test_autograd_matches_reference(backend, coff):
    p = make_pack((13, 2, 9), 6, 4, coff, token_padding=1, comp_padding=1, device=DEVICE)
    kv, score, ape = _leaves(p)
    out = compressor_pool(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, 4, coff, p.total_comp, backend)
    out.backward(p.grad_out)
    ref_out, ref_grads = _fp32_expected(p)
    assert int(bf16_ulp_distance(out.detach(), ref_out).max()) <= 1
    assert int(bf16_ulp_distance(kv.grad, ref_grads[0]).max()) <= 1
    assert int(bf16_ulp_distance(score.grad, ref_grads[1]).max()) <= 1
    assert rel_l2(ape.grad, ref_grads[2]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_long_window_matches_reference(backend):
    """32-slot windows: autograd saves the statistics where ``AUTOGRAD_STATS`` says; gradients meet the contract."""
    from csa_compressor import api, dispatch
    from csa_compressor.testing import contract_report

    p = make_pack((70, 16, 5, 33), 6, 16, 2, token_padding=3, comp_padding=1, device=DEVICE, seed=5)
    module = dispatch.backend_module(dispatch.resolve_backend(backend, DEVICE, 16, 2, 6))
    assert api.autograd_uses_stats(p.kv, 16, 2, backend) is bool(getattr(module, "AUTOGRAD_STATS", False))
    kv, score, ape = _leaves(p)
    out = compressor_pool(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, 16, 2, p.total_comp, backend)
    out.backward(p.grad_out)
    report = contract_report(p, out=out.detach(), grads=(kv.grad, score.grad, ape.grad))
    assert report["ok"], report


def test_opcheck_custom_ops():
    p = make_pack((9, 4), 4, 4, 2, comp_padding=1, device=DEVICE)
    args = (*p.inputs, 4, 2, p.total_comp, "reference")
    torch.library.opcheck(torch.ops.csa_compressor.pool_forward.default, args)
    bwd_args = (*p.inputs, p.grad_out, 4, 2, "reference")
    torch.library.opcheck(torch.ops.csa_compressor.pool_backward.default, bwd_args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    p = make_pack((17, 3, 8), 8, 4, 2, token_padding=2, comp_padding=1, device=DEVICE, seed=3)

    def region(kv, score, ape):
        cu_seqlens_comp = compute_cu_seqlens_comp(p.cu_seqlens, 4)  # traced too: device-side, no sync
        out = compressor_pool(kv, score, ape, p.cu_seqlens, cu_seqlens_comp, 4, 2, p.total_comp, backend)
        return (out.float() * 2.0).to(out.dtype)  # some surrounding graph to fuse around the opaque op

    compiled = torch.compile(region, fullgraph=True)
    eager_leaves, comp_leaves = _leaves(p), _leaves(p)
    eager = region(*eager_leaves)
    got = compiled(*comp_leaves)
    assert torch.equal(eager, got)
    eager.backward(p.grad_out)
    got.backward(p.grad_out)
    for a, b in zip(eager_leaves, comp_leaves, strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("shape3d", [False, True])
def test_module_accepts_megatron_shapes(shape3d):
    ratio, head_dim, coff = 4, 6, 2
    module = CompressorPool(ratio, head_dim, coff, backend="reference", device=DEVICE)
    p = make_pack((12, 7), head_dim, ratio, coff, device=DEVICE, seed=4)
    with torch.no_grad():
        module.ape.copy_(p.ape)
    kv, score = p.kv, p.score
    if shape3d:
        kv, score = kv[:, None, :], score[:, None, :]
    kv = kv.detach().clone().requires_grad_(True)
    out = module(kv, score, p.cu_seqlens)  # cu_seqlens_comp computed on the device, total_comp read once
    expected = reference.forward(*p.inputs, ratio=ratio, coff=coff, total_comp=p.true_comp, precision="fp32")
    assert out.shape == ((p.true_comp, 1, head_dim) if shape3d else (p.true_comp, head_dim))
    assert torch.equal(out.reshape(expected.shape), expected)
    out.sum().backward()
    assert module.ape.grad is not None and module.ape.grad.shape == (ratio, coff * head_dim)
    assert kv.grad.shape == kv.shape
    assert "ratio=4, head_dim=6, coff=2" in repr(module)


def test_module_rejects_bad_3d_shape():
    module = CompressorPool(4, 6, 2, backend="reference")
    kv = torch.zeros(8, 2, 12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"3-D kv/score must be \(T, 1, 12\)"):
        module(kv, kv, torch.tensor([0, 8], dtype=torch.int32))


def test_eager_calls_skip_the_custom_op_dispatch(monkeypatch):
    """Plain eager tensors go straight to the wrappers' code (no custom-op dispatch), with the same results."""
    from csa_compressor import autograd as ag

    p = make_pack((13, 2, 9), 6, 4, 2, token_padding=1, comp_padding=1, device=DEVICE, seed=5)
    args = (p.cu_seqlens, p.cu_seqlens_comp, 4, 2, p.total_comp, "reference")
    # Reference: the custom ops called directly.
    expected = torch.ops.csa_compressor.pool_forward(*p.inputs, 4, 2, p.total_comp, "reference")
    expected_grads = torch.ops.csa_compressor.pool_backward(*p.inputs, p.grad_out, 4, 2, "reference")

    def refuse(*a, **k):
        raise AssertionError("the eager path must not dispatch the custom op")

    monkeypatch.setattr(ag, "_pool_forward_op", refuse)
    monkeypatch.setattr(ag, "_pool_backward_op", refuse)
    kv, score, ape = _leaves(p)
    out = compressor_pool(kv, score, ape, *args)
    out.backward(p.grad_out)
    assert torch.equal(out.detach(), expected)
    for got, want in zip((kv.grad, score.grad, ape.grad), expected_grads, strict=True):
        assert torch.equal(got, want)


def test_tracing_goes_through_the_custom_ops():
    """Under a dispatch mode (make_fx here; torch.compile / export likewise) the custom ops are what gets traced."""
    from torch.fx.experimental.proxy_tensor import make_fx

    p = make_pack((9, 4), 4, 4, 2, comp_padding=1, device=DEVICE)

    def f(kv, score, ape):
        out = compressor_pool(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, 4, 2, p.total_comp, "reference")
        return torch.autograd.grad(out, (kv, score, ape), p.grad_out)

    graph = make_fx(f)(*_leaves(p))
    code = graph.code
    assert "csa_compressor.pool_forward" in code and "csa_compressor.pool_backward" in code
