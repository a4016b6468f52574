"""csa_compressor.Compressor against an eager module written as a model's code writes it (per-segment pooling,
RMSNorm, complex RoPE; no shared code; the pooled row stays fp32 into the norm as in the fused op): real rows'
outputs and every parameter gradient agree.
"""

import math

import pytest
import torch

from csa_compressor import Compressor, compute_cu_seqlens_comp, dispatch, rope_tables
from csa_compressor import tail as T
from csa_compressor.testing import bf16_ulp_distance, rel_l2


def _triton_tail_reason():
    reason = dispatch.unavailable_reason("triton")
    if reason is None and not hasattr(dispatch.backend_module("triton"), "supports_tail"):
        reason = "the Triton backend has no supports_tail yet (its fused tail is on branch tritontail)"
    return reason


def _eager_pool_segment(kv, score, ape, ratio, coff, head_dim):
    groups = kv.shape[0] // ratio
    kv = kv[: groups * ratio].float().view(groups, ratio, coff * head_dim)
    score = score[: groups * ratio].float().view(groups, ratio, coff * head_dim) + ape.view(1, ratio, -1)
    if coff == 2:
        d = head_dim

        def overlap(t, fill):
            window = t.new_full((groups, 2 * ratio, d), fill)
            window[:, ratio:] = t[:, :, d:]
            window[1:, :ratio] = t[:-1, :, :d]
            return window

        kv, score = overlap(kv, 0.0), overlap(score, float("-inf"))
    return (kv * torch.softmax(score, dim=1)).sum(dim=1)


def _eager_rope(x, positions, rope_dim, theta, interleaved):
    if rope_dim == 0:
        return x
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = (positions.double()[:, None] * inv_freq[None, :]).float().to(x.device)
    keep, rot = x[:, : x.shape[1] - rope_dim], x[:, x.shape[1] - rope_dim :]
    if interleaved:
        pairs = torch.view_as_complex(rot.reshape(rot.shape[0], -1, 2).contiguous())
        rot = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(1)
    else:
        half = rope_dim // 2
        a, b = rot[:, :half], rot[:, half:]
        rot = torch.cat((a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()), dim=1)
    return torch.cat((keep, rot), dim=1)


def eager_compressor(module: Compressor, x, seqlens, position_start=None, theta=10000.0):
    """The model's eager code, one segment at a time: ``(sum(seqlen // ratio), head_dim)`` bf16."""
    rows, start = [], 0
    for b, seqlen in enumerate(seqlens):
        seg = x[start : start + seqlen]
        start += seqlen
        groups = seqlen // module.ratio
        if groups == 0:
            continue
        pooled = _eager_pool_segment(
            module.wkv(seg), module.wgate(seg), module.ape, module.ratio, module.coff, module.head_dim
        )
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + module.norm.eps) * module.norm.weight
        offset = 0 if position_start is None else int(position_start[b])
        positions = offset + torch.arange(groups) * module.ratio
        rows.append(_eager_rope(normed, positions, module.rope_dim, theta, module.rope_interleaved))
    return torch.cat(rows).to(torch.bfloat16)


def _pack(seqlens, hidden, padding, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(seqlens) + padding, hidden, generator=gen).to(torch.bfloat16)
    cu = torch.zeros(len(seqlens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seqlens), 0)
    return x, cu


def _grads(module):
    return {name: p.grad.detach().clone() for name, p in module.named_parameters()}


CASES = [
    # (ratio, coff, learned_ape, head_dim, rope_dim, interleaved, seqlens)
    (4, 2, True, 32, 16, True, (37, 3, 0, 21)),
    (4, 2, True, 24, 24, False, (9, 16)),
    (128, 1, True, 16, 8, True, (300, 60, 130)),
    (2, 1, False, 20, 0, True, (7, 1, 12)),
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}c{c[1]}d{c[3]}rope{c[4]}")
def test_matches_eager_module(case, backend):
    ratio, coff, learned_ape, head_dim, rope_dim, interleaved, seqlens = case
    if backend == "triton" and ratio == 128:
        pytest.skip("the interpreter runs ratio 128 slowly; the reference backend covers it here")
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors run Triton only under its interpreter; test_matches_eager_module_gpu covers the GPU")
    if backend == "triton" and _triton_tail_reason() is not None:
        pytest.skip(_triton_tail_reason())
    torch.manual_seed(0)
    hidden = 40
    module = Compressor(
        hidden, head_dim, ratio, coff=coff, rope_dim=rope_dim, rope_interleaved=interleaved,
        learned_ape=learned_ape, max_position=512, backend=backend, norm_eps=1e-5,
    )  # fmt: skip
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
    x, cu = _pack(seqlens, hidden, padding=3, seed=ratio)
    real = sum(s // ratio for s in seqlens)
    position_start = torch.tensor([5 * b for b in range(len(seqlens))], dtype=torch.int32)
    out = module(x, cu, total_comp=real + 2, position_start=position_start)
    assert out.shape == (real + 2, head_dim) and out.dtype == torch.bfloat16
    grad = torch.randn(real + 2, head_dim).to(torch.bfloat16)
    out.backward(grad)
    fused = _grads(module)

    module.zero_grad()
    expected = eager_compressor(module, x, seqlens, position_start)
    expected.backward(grad[:real])
    eager = _grads(module)

    # One rounding each, of the same fp32 chain evaluated in another order: at most a few ulps apart.
    assert int(bf16_ulp_distance(out[:real], expected).max()) <= 3
    assert (
        set(fused)
        == set(eager)
        == ({"wkv.weight", "wgate.weight", "norm.weight"} | ({"ape"} if learned_ape else set()))
    )
    for name in eager:
        assert rel_l2(fused[name], eager[name]) < 2e-2, name


def test_three_d_input_and_padding_rows_carry_no_gradient():
    module = Compressor(24, 16, 4, rope_dim=8, max_position=64, backend="reference")
    x, cu = _pack((13, 8), 24, padding=0, seed=1)
    out3 = module(x.unsqueeze(1), cu, total_comp=7)
    assert out3.shape == (7, 1, 16)
    assert torch.equal(out3.squeeze(1), module(x, cu, total_comp=7))
    # Rows 5 and 6 are padding: a gradient there must change no parameter gradient.
    grad = torch.zeros(7, 1, 16, dtype=torch.bfloat16)
    grad[5:] = 1.0
    out3.backward(grad)
    for name, p in module.named_parameters():
        assert not p.grad.any(), name


def test_rope_tables_and_defaults():
    cos, sin = rope_tables(8, 16, theta=100.0)
    assert cos.shape == sin.shape == (16, 4) and cos.dtype == torch.float32
    assert math.isclose(float(cos[3, 1]), math.cos(3 * 100.0 ** (-2 / 8)), rel_tol=1e-6)
    assert Compressor(16, 64, 4).coff == 2 and Compressor(16, 64, 128).coff == 1
    zero_ape = Compressor(16, 64, 2, learned_ape=False)
    assert "ape" not in dict(zero_ape.named_parameters()) and not zero_ape.ape.any()
    with pytest.raises(ValueError, match="rope_dim"):
        Compressor(16, 32, 4, rope_dim=40, max_position=8)


def test_caller_tables_and_no_rope_is_the_pooling_and_norm():
    """Against the one-rounding reference of the fused op (``tail.forward``), which the reference backend runs."""
    module = Compressor(24, 16, 4, rope_dim=0, backend="reference")
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
    x, cu = _pack((12, 9), 24, padding=0, seed=2)
    with torch.no_grad():
        inputs = (module.wkv(x), module.wgate(x), module.ape, cu, compute_cu_seqlens_comp(cu, 4))
        norm = T.Tail(norm_weight=module.norm.weight, norm_eps=module.norm.eps)
        normed = T.forward(*inputs, norm, ratio=4, coff=2, total_comp=5)
    assert torch.equal(module(x, cu, total_comp=5), normed)
    # Caller tables replace the module's own (here: a rotation by pi/2 at every position, exact in fp32).
    rot = Compressor(24, 16, 4, rope_dim=16, backend="reference")
    rot.load_state_dict(module.state_dict())
    cos, sin = torch.zeros(64, 8), torch.ones(64, 8)
    out = rot(x, cu, total_comp=5, rope_cos=cos, rope_sin=sin)
    assert torch.equal(out[:, 0::2], -normed[:, 1::2]) and torch.equal(out[:, 1::2], normed[:, 0::2])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}c{c[1]}d{c[3]}rope{c[4]}")
def test_matches_eager_module_gpu(case):
    ratio, coff, learned_ape, head_dim, rope_dim, interleaved, seqlens = case
    module = Compressor(
        64, head_dim * 8, ratio, coff=coff, rope_dim=rope_dim * 4, rope_interleaved=interleaved,
        learned_ape=learned_ape, max_position=4096, device="cuda",
    )  # fmt: skip
    x, cu = _pack(tuple(s * 4 for s in seqlens), 64, padding=5, seed=3)
    x, cu = x.cuda(), cu.cuda()
    real = sum(4 * s // ratio for s in seqlens)
    out = module(x, cu, total_comp=real + 3)
    grad = torch.randn(real + 3, head_dim * 8, device="cuda").to(torch.bfloat16)
    out.backward(grad)
    fused = _grads(module)
    module.zero_grad()
    expected = eager_compressor(module, x, tuple(4 * s for s in seqlens))
    expected.backward(grad[:real])
    assert int(bf16_ulp_distance(out[:real], expected).max()) <= 3
    for name, g in _grads(module).items():
        assert rel_l2(fused[name], g) < 2e-2, name


@pytest.mark.parametrize(("ratio", "rope_dim", "interleaved"), [(4, 8, True), (128, 16, False), (2, 0, True)])
def test_forward_cp_world_of_one_matches_forward(ratio, rope_dim, interleaved):
    """``forward_cp`` on a world of one holding the pack in pieces out of order: after ``gather_rows`` the
    module's rows bitwise, kv's and score's paths the same (so every parameter gradient agrees up to the order of
    its sum over tokens)."""
    from csa_compressor.distributed import CPLayout, gather_rows

    torch.manual_seed(ratio)
    module = Compressor(24, 16, ratio, rope_dim=rope_dim, max_position=2048, rope_interleaved=interleaved,
                        learned_ape=ratio != 2, backend="reference")  # fmt: skip
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
    seqlens = (3 * ratio + 1, 2, 2 * ratio + 3)
    x, cu = _pack(seqlens, 24, padding=0, seed=ratio)
    start = torch.tensor([5, 100, 0], dtype=torch.int64)  # cast to int32 by the module, as forward does
    total = sum(seqlens)
    layout = CPLayout.from_pieces(cu, [(total // 2, total - total // 2), (1, total // 2 - 1), (0, 1)])
    out = module(x, cu, position_start=start)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out.backward(grad)
    expected = _grads(module)
    module.zero_grad(set_to_none=True)
    x_local = layout.select_local(x)
    three_d = ratio == 128  # (T, 1, hidden) in, (rows, 1, head_dim) out
    out_local, rows = module.forward_cp(x_local.unsqueeze(1) if three_d else x_local, layout, position_start=start)
    assert out_local.dim() == (3 if three_d else 2)
    out_all = gather_rows(out_local.squeeze(1) if three_d else out_local, rows, layout)
    assert torch.equal(out_all, out)
    out_all.backward(grad)
    for name, value in _grads(module).items():
        assert rel_l2(value.float(), expected[name].float()) <= (1e-6 if value.dtype == torch.float32 else 1e-2), name
