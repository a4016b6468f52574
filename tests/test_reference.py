"""The three eager references against the SPEC text (tests/naive.py) and against each other."""

import dataclasses

import pytest
import torch

from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper, reference
from csa_compressor.testing import bf16_ulp_distance, make_pack, rel_l2, truncated_pack
from csa_compressor.thd import row_layout

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


# ---------------------------------------------------------------- total_comp below the real rows (docs/safety.md)

# (ratio, coff, head_dim, seqlens, token_padding): ragged packs at the SPEC's window classes.
TRUNCATION = [
    (4, 2, 5, (13, 3, 0, 9, 8), 3),
    (4, 1, 7, (11, 4, 2, 16), 1),
    (2, 1, 3, (5, 1, 6, 9), 2),
    (2, 2, 4, (7, 0, 5), 0),
    (128, 1, 3, (257, 100, 300), 2),
    (128, 2, 2, (300, 128, 5, 260), 1),
]
TRUNCATION_IDS = [f"r{c[0]}c{c[1]}d{c[2]}" for c in TRUNCATION]


def _cuts(pack) -> list[int]:
    """total_comp below the real rows: none, one, one short, and each segment's first row."""
    starts = {c for c, n in zip(pack.cu_seqlens_comp[:-1].tolist(), pack.seqlens, strict=True) if n >= pack.ratio}
    return sorted({0, 1, pack.true_comp - 1, *starts} - {pack.true_comp})


def _truncated(params, seed=0):
    ratio, coff, head_dim, seqlens, tok_pad = params
    pack = make_pack(seqlens, head_dim, ratio, coff, token_padding=tok_pad, seed=seed)
    for rows in _cuts(pack):
        yield dataclasses.replace(pack, total_comp=rows, grad_out=pack.grad_out[:rows].contiguous())


@pytest.mark.parametrize("params", TRUNCATION, ids=TRUNCATION_IDS)
def test_truncated_rows_are_the_first_rows(params):
    """Rows at or past total_comp are not produced; the others are the full pack's rows, bitwise."""
    for p in _truncated(params):
        kw = dict(ratio=p.ratio, coff=p.coff)
        for precision in reference.PRECISIONS:
            full = reference.forward(*p.inputs, total_comp=p.true_comp, precision=precision, **kw)
            got = reference.forward(*p.inputs, total_comp=p.total_comp, precision=precision, **kw)
            assert got.shape[0] == p.total_comp and torch.equal(got, full[: p.total_comp])


@pytest.mark.parametrize("params", TRUNCATION, ids=TRUNCATION_IDS)
def test_truncated_gradients_are_autograd_of_the_truncated_region(params):
    """Reference gradients with total_comp below the real rows equal autograd of the truncated pack: bitwise for
    upstream and fp32's grad_kv, within fp32 rounding for fp32's grad_score and grad_ape; dropped tokens zero."""
    for p in _truncated(params, seed=1):
        short, keep = truncated_pack(p)
        kw = dict(ratio=p.ratio, coff=p.coff)
        dropped = torch.ones(p.kv.shape[0], dtype=torch.bool)
        dropped[keep] = False
        got = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, backend="reference", **kw)
        out = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, backend="reference", **kw)["out"]
        assert torch.equal(out, reference.forward(*short.inputs, total_comp=p.total_comp, precision="fp32", **kw))
        for g in got[:2]:
            assert not bool(g[dropped].view(torch.int16).any())
        leaves = [t.detach().clone().requires_grad_(True) for t in short.inputs[:3]]
        fp32 = reference.forward(*leaves, *short.inputs[3:], total_comp=p.total_comp, precision="fp32", **kw)
        auto = torch.autograd.grad(fp32, leaves, short.grad_out, allow_unused=True) if p.total_comp else None
        if auto is not None:
            assert torch.equal(got[0][keep], auto[0])
            assert int(bf16_ulp_distance(got[1][keep], auto[1]).max()) <= 1
            assert rel_l2(got[2], auto[2]) < 1e-6
        upstream = reference.backward(*p.inputs, p.grad_out, precision="upstream", **kw)
        leaves = [t.detach().clone().requires_grad_(True) for t in short.inputs[:3]]
        eager = reference.eager_region(*leaves, *short.inputs[3:], total_comp=p.total_comp, **kw)
        if p.total_comp:
            auto = torch.autograd.grad(eager, leaves, short.grad_out)
            assert torch.equal(upstream[0][keep], auto[0]) and torch.equal(upstream[1][keep], auto[1])
            assert torch.equal(upstream[2], auto[2])
        assert not bool(upstream[0][dropped].view(torch.int16).any())


@pytest.mark.parametrize("params", TRUNCATION[:4], ids=TRUNCATION_IDS[:4])
def test_truncated_oracle_matches_spec_text(params):
    """The SPEC transcription (tests/naive.py) pools the first total_comp rows, read the same way."""
    for p in _truncated(params, seed=2):
        kw = dict(ratio=p.ratio, coff=p.coff)
        got = reference.backward(*p.inputs, p.grad_out, precision="fp64", **kw)
        for a, b in zip(got, naive.backward(*p.inputs, p.grad_out, **kw), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- malformed offsets (docs/safety.md rules 1-4)


def _pool(kv, score, ape, cu, comp, rows, ratio=4, coff=2, precision="fp64"):
    cu, comp = torch.tensor(cu, dtype=torch.int32), torch.tensor(comp, dtype=torch.int32)
    return reference.forward(kv, score, ape, cu, comp, ratio=ratio, coff=coff, total_comp=rows, precision=precision)


def test_rows_whose_tokens_leave_the_tensor_are_padding_rows():
    p = make_pack((16,), 3, 4, 2, seed=3)  # T = 16
    args = (p.kv, p.score, p.ape)
    padding = _pool(*args, [0, 16], [0, 4], 5)[4]  # a padding row: the first group at token 0
    # Segment 1 claims tokens 8..39: its rows at t0 = 16, 20, ... leave [0, 16).
    out = _pool(*args, [0, 8, 40], [0, 2, 10], 10)
    assert torch.equal(out[:4], _pool(*args, [0, 8, 16], [0, 2, 4], 4))  # rows inside [0, T) as if well-formed
    assert all(torch.equal(row, padding) for row in out[4:])
    # Rows of a segment starting at -8 (t0 = -8, -4) likewise; they have no gradient.
    grads = reference.backward(
        *args, torch.tensor([0, -8, 16], dtype=torch.int32), torch.tensor([0, 0, 6], dtype=torch.int32),
        torch.ones(2, 3, dtype=torch.bfloat16), ratio=4, coff=2, precision="fp64",
    )  # fmt: skip
    assert all(not bool(g.any()) for g in grads)


def test_previous_half_only_inside_the_tensor():
    """coff 2: a row with j > 0 but t0 < ratio reads no previous half (the slots are masked, as for a first group)."""
    p = make_pack((16,), 3, 4, 2, seed=4)
    args = (p.kv, p.score, p.ape)
    # Segment 1 starts at -2: its row j = 1 has t0 = 2 (tokens 2..5 in range, previous group 2..5 - 4 not).
    out = _pool(*args, [0, -2, 16], [0, 0, 2], 2)
    as_first_group = _pool(*args, [0, 2, 16], [0, 0, 1], 1)[0]  # a segment starting at token 2
    assert torch.equal(out[1], as_first_group)


def test_row_starts_use_int32_arithmetic():
    """t0 = cu_seqlens[b] + j * ratio wraps as the kernels' int32 arithmetic does (docs/safety.md rule 2)."""
    p = make_pack((16,), 3, 4, 2, seed=5)
    args = (p.kv, p.score, p.ape)
    # j = r + 2**30 (cu_seqlens_comp[0] = -2**30), so j * ratio wraps by 2**32: t0 = 4r, inside the tensor.
    wrapped = _pool(*args, [0, 16], [-(2**30), 4], 4)
    t0, first, real = row_layout(
        torch.tensor([0, 16], dtype=torch.int32), torch.tensor([-(2**30), 4], dtype=torch.int32), 4, 4, 16
    )
    assert t0.tolist() == [0, 4, 8, 12] and real.all() and first.tolist() == [True, False, False, False]
    assert torch.equal(wrapped, _pool(*args, [0, 16], [0, 4], 4))


@pytest.mark.parametrize(
    "cu,comp,rows",
    [
        ([0, 8, 40], [0, 2, 10], 10),  # beyond T
        ([0, 12, 4, 16], [0, 3, 1, 4], 4),  # decreasing
        ([0, -8, 16], [0, -2, 4], 6),  # negative
        ([0, 8, 16], [0, 9, 20], 20),  # counts larger than the segments allow
        ([0, 2**31 - 4, 2**31 - 1], [0, 2**29, 2**30], 5),  # near the int32 limit
        ([0, -(2**31), 2**31 - 1], [-(2**31), 0, 2**31 - 1], 3),
    ],
)
@pytest.mark.parametrize("precision", reference.PRECISIONS)
def test_malformed_offsets_stay_inside_the_tensors(cu, comp, rows, precision):
    """No IndexError on the CPU (a device-side assert on a GPU), finite results, every gradient position written."""
    p = make_pack((16,), 3, 4, 2, seed=6)
    cu_t, comp_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(comp, dtype=torch.int32)
    out = reference.forward(*p.inputs[:3], cu_t, comp_t, ratio=4, coff=2, total_comp=rows, precision=precision)
    assert out.shape == (rows, 3) and bool(torch.isfinite(out).all())
    grad_out = torch.randn(rows, 3).to(torch.bfloat16)
    grads = reference.backward(*p.inputs[:3], cu_t, comp_t, grad_out, ratio=4, coff=2, precision=precision)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
