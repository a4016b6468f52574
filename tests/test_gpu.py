"""GPU-only behaviour of the GPU backends: CUDA graphs with static capacity, compile-under-capture,
non-current devices, explicit-stream operand lifetime. Skipped (with a reason) on CPU-only machines."""

import pytest
import torch

from csa_compressor import (
    CSACompressorForward,
    available_backends,
    compressor_pool,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    reference,
)
from csa_compressor.testing import assert_contract, bf16_ulp_distance, make_pack

pytestmark = pytest.mark.gpu
GPU_BACKENDS = [b for b in (available_backends("cuda") if torch.cuda.is_available() else []) if b != "reference"]
if not GPU_BACKENDS:
    GPU_BACKENDS = [pytest.param("none", marks=pytest.mark.skip(reason="no GPU backend available here"))]


def _assert_matches(p, out, grads):
    assert_contract(p, out, tuple(grads))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1)])
def test_cuda_graph_static_capacity_replay(backend, ratio, coff):
    head_dim = 64
    first = make_pack((40 * ratio, 13 * ratio + 3, 2), head_dim, ratio, coff, token_padding=5, device="cuda", seed=1)
    tokens, rows = first.kv.shape[0], first.total_comp
    static = [t.clone() for t in (*first.inputs, first.grad_out)]
    kw = dict(ratio=ratio, coff=coff, total_comp=rows, backend=backend)

    def step():
        kv, score, ape, cu, cuc, g = static
        out = csa_compressor_forward_wrapper(kv, score, ape, cu, cuc, **kw)["out"]
        grads = csa_compressor_backward_wrapper(kv, score, ape, cu, cuc, g, ratio=ratio, coff=coff, backend=backend)
        return out, grads

    step()  # compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grads = step()

    # New data with fewer true rows (and a different segment layout) in the same capacity.
    n2 = (7 * ratio + 1, 3, 20 * ratio)
    second = make_pack(n2, head_dim, ratio, coff, token_padding=tokens - sum(n2), device="cuda", seed=2)
    second.grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)
    second.total_comp = rows
    assert second.true_comp < first.true_comp and second.kv.shape[0] == tokens
    for dst, src in zip(static, (*second.inputs, second.grad_out), strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches(second, out, [g.clone() for g in grads])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_autograd_under_cuda_graph(backend):
    p = make_pack((96, 50), 32, 4, 2, comp_padding=3, device="cuda", seed=3)
    kv, score, ape = (t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape))

    def step():
        out = compressor_pool(kv, score, ape, p.cu_seqlens, p.cu_seqlens_comp, 4, 2, p.total_comp, backend)
        out.backward(p.grad_out)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up compiles and builds autograd state outside capture
    torch.cuda.current_stream().wait_stream(side)
    for t in (kv, score, ape):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches(p, out.detach(), [kv.grad, score.grad, ape.grad])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_compile_under_capture_is_a_clear_error(backend):
    p = make_pack((40, 9), 24, 8, 1, device="cuda", seed=4)  # a configuration no other test builds
    out = torch.empty(p.total_comp, 24, dtype=torch.bfloat16, device="cuda")
    op = CSACompressorForward(*p.inputs, out, ratio=8, coff=1, backend=backend)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="would be compiled during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            op.execute(*p.inputs, out)
    torch.cuda.synchronize()
    op.compile()  # after compile(), the same call captures fine
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.execute(*p.inputs, out)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.forward(*p.inputs, ratio=8, coff=1, total_comp=p.total_comp, precision="fp32")
    assert int(bf16_ulp_distance(out, ref).max()) <= 1


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_tensors_on_a_non_current_device(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    torch.cuda.set_device(0)
    p = make_pack((64, 33, 7), 32, 4, 2, token_padding=2, comp_padding=1, device="cuda:1", seed=5)
    out = csa_compressor_forward_wrapper(*p.inputs, ratio=4, coff=2, total_comp=p.total_comp, backend=backend)["out"]
    grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, ratio=4, coff=2, backend=backend)
    assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    _assert_matches(p, out, list(grads))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_explicit_stream_keeps_operands_alive(backend):
    p = make_pack((4096, 1000), 128, 4, 2, device="cuda", seed=6)
    expected = reference.forward(*p.inputs, ratio=4, coff=2, total_comp=p.total_comp, precision="fp32")
    kv, score = p.kv.clone(), p.score.clone()
    csa_compressor_forward_wrapper(kv, score, *p.inputs[2:], ratio=4, coff=2, total_comp=p.total_comp, backend=backend)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the kernel pending while the caller frees its inputs
    out = csa_compressor_forward_wrapper(
        kv, score, *p.inputs[2:], ratio=4, coff=2, total_comp=p.total_comp, stream=side, backend=backend
    )["out"]
    del kv, score
    # Without record_stream these allocations would reuse the freed storage before the kernel reads it.
    junk = [torch.full_like(p.kv, float("nan")) for _ in range(4)]
    torch.cuda.synchronize()
    assert int(bf16_ulp_distance(out, expected).max()) <= 1
    del junk
