"""The compressor's tail (RMSNorm, RoPE; issue 26): the references against the issue text (tests/naive.py), each
other and autograd, and ``check_backend``, which kernel tests call over ``CASES``.
"""

import dataclasses
import functools
import pathlib
import re

import pytest
import torch

from csa_compressor import reference
from csa_compressor import tail as T
from csa_compressor.testing import _beyond, bf16_ulp_distance, bitwise_equal, make_pack, rel_l2

from . import naive

# (ratio, coff, head_dim, seqlens, token_padding, comp_padding, random_tail keywords)
CASES = {
    "r4c2d5-rope2-pos": (4, 2, 5, (13, 3, 0, 9, 8), 3, 2, dict(rope_dim=2, positions=True)),
    "r4c2d64-rope64-half": (4, 2, 64, (9, 17, 2), 1, 1, dict(rope_dim=64, interleaved=False)),
    "r4c2d72-rope64-bf16w-pos": (4, 2, 72, (12, 5), 0, 1, dict(rope_dim=64, norm_dtype=torch.bfloat16, positions=True)),
    "r4c1d7-norm": (4, 1, 7, (11, 4, 2), 0, 1, dict()),
    "r2c1d4-rope4-only-pos": (2, 1, 4, (0, 7), 1, 3, dict(norm=False, rope_dim=4, positions=True)),
    "r2c1d66-rope64-half-pos": (2, 1, 66, (9, 4), 0, 1, dict(rope_dim=64, interleaved=False, positions=True)),
    "r128c1d3-rope2-half": (128, 1, 3, (257, 100), 2, 1, dict(rope_dim=2, interleaved=False)),
    "r128c1d64-rope64": (128, 1, 64, (130,), 0, 1, dict(rope_dim=64)),
    "r128c2d6-rope6-pos": (128, 2, 6, (300, 128, 5), 0, 2, dict(rope_dim=6, positions=True)),
    "r128c2d4-rope2-only-half": (128, 2, 4, (256, 130), 0, 1, dict(norm=False, rope_dim=2, interleaved=False)),
    "r4c2d8-padding-only": (4, 2, 8, (3, 2, 1), 0, 2, dict(rope_dim=8, positions=True)),
}


def case_pack_and_tail(name, seed=0, device="cpu"):
    ratio, coff, head_dim, seqlens, tok_pad, comp_pad, tail_kw = CASES[name]
    pack = make_pack(
        seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, seed=seed, device=device
    )
    return pack, T.random_tail(pack, seed=seed + 7, **tail_kw)


def _kw(pack):
    return dict(ratio=pack.ratio, coff=pack.coff)


@pytest.mark.parametrize("name", ["r4c2d5-rope2-pos", "r4c1d7-norm", "r128c2d6-rope6-pos"])
def test_identity_tail_is_the_pooling_bitwise(name):
    pack, _ = case_pack_and_tail(name)
    for precision in T.PRECISIONS:
        got = T.forward(*pack.inputs, T.Tail(), total_comp=pack.total_comp, precision=precision, **_kw(pack))
        want = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision=precision, **_kw(pack))
        assert got.dtype == want.dtype and torch.equal(got, want)
        grads = T.backward(*pack.inputs, pack.grad_out, T.Tail(), precision=precision, **_kw(pack))
        want_grads = reference.backward(*pack.inputs, pack.grad_out, precision=precision, **_kw(pack))
        assert grads[3] is None
        for g, w in zip(grads[:3], want_grads, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
    # The unrounded pooled row is the fp32 reference before its rounding.
    x = T.pooled_rows(*pack.inputs, total_comp=pack.total_comp, dtype=torch.float32, **_kw(pack))
    fp32 = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **_kw(pack))
    assert torch.equal(x.to(torch.bfloat16), fp32)


@pytest.mark.parametrize("name", list(CASES))
def test_oracle_matches_issue_text(name):
    pack, tail = case_pack_and_tail(name)
    args = (*pack.inputs, pack.ratio, pack.coff, pack.total_comp)
    out = T.forward(*pack.inputs, tail, total_comp=pack.total_comp, precision="fp64", **_kw(pack))
    torch.testing.assert_close(out, naive.tail_forward(*args, tail), rtol=1e-12, atol=1e-12)
    grads = T.backward(*pack.inputs, pack.grad_out, tail, precision="fp64", **_kw(pack))
    expected = naive.tail_backward(*pack.inputs, pack.grad_out, pack.ratio, pack.coff, tail)
    for got, want in zip(grads, expected, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("name", list(CASES))
def test_closed_form_backward_is_autograd_of_the_oracle(name):
    pack, tail = case_pack_and_tail(name, seed=3)
    closed = T.backward(*pack.inputs, pack.grad_out, tail, precision="fp64", **_kw(pack))
    auto = T.autograd_backward(*pack.inputs, pack.grad_out, tail, precision="fp64", **_kw(pack))
    for got, want in zip(closed, auto, strict=True):
        if want is None:
            assert got is None and not tail.has_norm
        else:
            assert got.dtype == want.dtype == torch.float64
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_references_agree_within_the_contract(name):
    pack, tail = case_pack_and_tail(name, seed=1)
    out_scale, kv_scale, score_scale, _ = T._magnitudes(pack, tail)
    f = {
        pr: T.forward(*pack.inputs, tail, total_comp=pack.total_comp, precision=pr, **_kw(pack)) for pr in T.PRECISIONS
    }
    assert f["fp32"].dtype == f["upstream"].dtype == torch.bfloat16 and f["fp64"].dtype == torch.float64
    # One rounding: within one ulp of the correctly rounded oracle, except where the result cancels.
    assert _beyond(f["fp32"], f["fp64"].to(torch.bfloat16), out_scale, 1)[1] == 0
    err32, err_up = ((f[pr].double() - f["fp64"]).abs().max() for pr in ("fp32", "upstream"))
    assert err32 <= err_up
    assert rel_l2(f["upstream"], f["fp64"]) < 3e-2

    g = {pr: T.backward(*pack.inputs, pack.grad_out, tail, precision=pr, **_kw(pack)) for pr in T.PRECISIONS}
    for i, scale in ((0, kv_scale), (1, score_scale)):
        assert g["fp32"][i].dtype == g["upstream"][i].dtype == torch.bfloat16
        assert _beyond(g["fp32"][i], g["fp64"][i].to(torch.bfloat16), scale, 1)[1] == 0
        assert rel_l2(g["upstream"][i], g["fp64"][i]) < 5e-2
    assert g["fp32"][2].dtype == g["upstream"][2].dtype == torch.float32
    assert rel_l2(g["fp32"][2], g["fp64"][2]) <= 1e-5
    if tail.has_norm:
        assert g["fp32"][3].dtype == g["upstream"][3].dtype == torch.float32
        assert rel_l2(g["fp32"][3], g["fp64"][3]) <= 1e-5
        assert rel_l2(g["upstream"][3], g["fp64"][3]) < 5e-2


@pytest.mark.parametrize("name", list(CASES))
def test_checker_accepts_the_fp32_references(name):
    pack, tail = case_pack_and_tail(name, seed=2)
    report = T.check_backend(T.forward, T.backward, pack, tail)
    assert report["fwd_bitwise"] and report["dkv_bitwise"] and report["dscore_bitwise"]
    # Autograd of the differentiable fp32 chain, standing in for a kernel that adds in another order.
    T.check_backend(T.forward, T.autograd_backward, pack, tail)


# A kernel adds in its own order and may fuse multiply-adds; the checker must accept that stand-in (reverse sums, one
# rounding per rotated coordinate, other product association).


def _fused_rotate(y, tail, positions, inverse=False):
    first, second = T.rope_columns(y.shape[1], tail.rope_dim, tail.rope_interleaved, y.device)
    cos, sin = tail.rope_cos[positions].double(), tail.rope_sin[positions].double()
    sin = -sin if inverse else sin
    a, b = y[:, first].double(), y[:, second].double()
    return y.index_copy(1, first, (a * cos - b * sin).float()).index_copy(1, second, (a * sin + b * cos).float())


def _reordered_pooled(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp):
    win = reference._window(cu_seqlens, cu_seqlens_comp, total_comp, kv.shape[0], ratio, coff)
    values, logits = reference._windows(kv.float(), score, ape, win, ratio, coff, torch.float32)
    return (values * torch.softmax(logits, dim=1)).flip(1).cumsum(1)[:, -1]


def _reordered_rstd(x, eps):
    return torch.rsqrt((x * x).cumsum(-1)[:, -1:] / x.shape[1] + eps)


def _reordered_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp):
    y = _reordered_pooled(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)
    if tail.has_norm:
        y = y * (_reordered_rstd(y, tail.norm_eps) * tail.norm_weight.float())
    if tail.has_rope:
        y = _fused_rotate(y, tail, T.row_positions(cu_seqlens_comp, total_comp, ratio, tail.position_start))
    return y.to(kv.dtype)


def _reordered_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
    rows = grad_out.shape[0]
    real = (torch.arange(rows) < cu_seqlens_comp[-1].long())[:, None]
    g = torch.where(real, grad_out.float(), 0.0)
    if tail.has_rope:
        g = _fused_rotate(g, tail, T.row_positions(cu_seqlens_comp, rows, ratio, tail.position_start), inverse=True)
    grad_w = None
    if tail.has_norm:
        x = _reordered_pooled(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, rows)
        r, w = _reordered_rstd(x, tail.norm_eps), tail.norm_weight.float()
        grad_w = torch.where(real, g * x * r, 0.0).flip(0).cumsum(0)[-1]
        dot = (x * w * g).flip(-1).cumsum(-1)[:, -1:] / x.shape[1]
        g = r * (w * g - x * (r * r) * dot)
    grads = reference.backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, g, ratio=ratio, coff=coff, precision="fp32")
    return (*grads, grad_w)


@pytest.mark.parametrize("tail_kw", [dict(rope_dim=64, positions=True), dict(rope_dim=128, interleaved=False)])
def test_checker_accepts_a_reordered_fp32_implementation(tail_kw):
    pack = make_pack((500, 301), 128, 4, 2, comp_padding=2, seed=12)  # a seed whose grad_score needs the allowance
    tail = T.random_tail(pack, seed=3, **tail_kw)
    report = T.check_backend(_reordered_forward, _reordered_backward, pack, tail)
    # It is a different evaluation, not the reference again.
    assert not all(report[k] for k in ("fwd_bitwise", "dkv_bitwise", "dscore_bitwise"))


def _with(tail, **changes):
    return dataclasses.replace(tail, **changes)


def _forward_with(changes):
    def forward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, **kw):
        return T.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, _with(tail, **changes(tail)), **kw)

    return forward_fn


def _backward_with(changes):
    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, **kw):
        return T.backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, _with(tail, **changes(tail)), **kw)

    return backward_fn


def _backward_weight_from_all_rows(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, **kw):
    """A backward whose weight gradient also sums the padding rows (a masking bug)."""
    grads = T.backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, **kw)
    x = T.pooled_rows(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp=grad_out.shape[0], dtype=torch.float32, **kw
    )
    dy = T._rotate(
        grad_out.float(),
        tail,
        T.row_positions(cu_seqlens_comp, x.shape[0], kw["ratio"], tail.position_start),
        inverse=True,
    )
    return (*grads[:3], (dy * x * T.row_rstd(x, tail.norm_eps)).sum(dim=0))


WRONG_FORWARDS = {
    "pair convention": _forward_with(lambda t: dict(rope_interleaved=not t.rope_interleaved)),
    "position_start ignored": _forward_with(lambda t: dict(position_start=None)),
    "angle negated": _forward_with(lambda t: dict(rope_sin=-t.rope_sin)),
    "norm weight ignored": _forward_with(lambda t: dict(norm_weight=torch.ones_like(t.norm_weight))),
    "eager chain's roundings": functools.partial(T.forward, precision="upstream"),
}
WRONG_BACKWARDS = {
    "rope not undone": _backward_with(lambda t: dict(rope_dim=0, rope_cos=None, rope_sin=None, position_start=None)),
    "rotated forward, not back": _backward_with(lambda t: dict(rope_sin=-t.rope_sin)),
    "norm weight ignored": _backward_with(lambda t: dict(norm_weight=torch.ones_like(t.norm_weight))),
    "padding rows in the weight gradient": _backward_weight_from_all_rows,
}


@pytest.mark.parametrize("wrong", list(WRONG_FORWARDS) + [f"bwd: {k}" for k in WRONG_BACKWARDS])
def test_checker_rejects_wrong_kernels(wrong):
    pack, tail = case_pack_and_tail("r4c2d72-rope64-bf16w-pos", seed=4)
    tail = _with(tail, norm_weight=tail.norm_weight.float())
    forward_fn, backward_fn = T.forward, T.backward
    if wrong.startswith("bwd: "):
        backward_fn = WRONG_BACKWARDS[wrong[5:]]
    else:
        forward_fn = WRONG_FORWARDS[wrong]
    with pytest.raises(AssertionError, match="tail contract broken"):
        T.check_backend(forward_fn, backward_fn, pack, tail)


def test_upstream_chain_is_deepseeks_formulation():
    """The eager chain as DeepSeek-V4's model code: RMSNorm cast to bf16, then rotary pairs as complex phasors in fp32."""
    pack, tail = case_pack_and_tail("r4c2d72-rope64-bf16w-pos", seed=5)
    tail = _with(tail, norm_weight=tail.norm_weight.float())
    pooled = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="upstream", **_kw(pack))
    h = pooled.float()
    normed = (tail.norm_weight * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + tail.norm_eps))).to(
        torch.bfloat16
    )
    positions = T.row_positions(pack.cu_seqlens_comp, pack.total_comp, pack.ratio, tail.position_start)
    phasor = torch.complex(tail.rope_cos[positions], tail.rope_sin[positions])
    rope = torch.view_as_complex(normed[:, -tail.rope_dim :].float().unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(rope * phasor).flatten(-2).to(torch.bfloat16)
    expected = torch.cat([normed[:, : -tail.rope_dim], rotated], dim=1)
    got = T.eager_region(*pack.inputs, tail, total_comp=pack.total_comp, **_kw(pack))
    # A complex product may fuse its multiply-adds: equal up to the last bit of a cancelling pair.
    assert int(bf16_ulp_distance(got, expected).max()) <= 1
    assert (bf16_ulp_distance(got, expected) > 0).float().mean() < 0.01


def test_row_positions():
    cu_comp = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # segments of 3, 0 and 2 rows
    got = T.row_positions(cu_comp, 7, 4)
    assert got.tolist() == [0, 4, 8, 0, 4, 0, 0]
    start = torch.tensor([10, 20, 30], dtype=torch.int32)
    assert T.row_positions(cu_comp, 7, 4, start).tolist() == [10, 14, 18, 30, 34, 0, 0]
    assert T.row_positions(cu_comp, 0, 4).numel() == 0


@pytest.mark.parametrize("head_dim", [5, 1])
def test_empty_output(head_dim):
    # head_dim 1: the fp32 reference's empty (0, 1) output has a last stride of 0, which a byte view refuses.
    pack = make_pack((13, 3), head_dim, 4, 2, seed=0)
    pack = dataclasses.replace(pack, total_comp=0, grad_out=pack.grad_out[:0])
    tail = T.random_tail(pack, rope_dim=2 * (head_dim // 2), positions=True, seed=7)
    for precision in T.PRECISIONS:
        out = T.forward(*pack.inputs, tail, total_comp=0, precision=precision, **_kw(pack))
        assert out.shape == (0, pack.head_dim)
        grads = T.backward(*pack.inputs, pack.grad_out, tail, precision=precision, **_kw(pack))
        assert all(not bool(g.any()) for g in grads)
        assert grads[3].shape == (pack.head_dim,)
    assert T.check_backend(T.forward, T.backward, pack, tail)["repeatable"]


def test_bitwise_equal():
    x = torch.tensor([0.0, float("nan"), 1.5])
    assert bitwise_equal(x, x.clone()) and bitwise_equal(None, None)
    assert not bitwise_equal(x, torch.tensor([-0.0, float("nan"), 1.5]))  # -0 and +0 differ in their bits
    assert not bitwise_equal(x, None) and not bitwise_equal(x, x.double()) and not bitwise_equal(x, x[:2])
    strided = torch.empty(0, 1).as_strided((0, 1), (1, 0))
    assert bitwise_equal(strided, torch.empty(0, 1)) and bitwise_equal(x[::2], torch.tensor([0.0, 1.5]))


def test_saved_rstd_gives_the_same_gradients():
    pack, tail = case_pack_and_tail("r4c2d64-rope64-half")
    x = T.pooled_rows(*pack.inputs, total_comp=pack.total_comp, dtype=torch.float32, **_kw(pack))
    rstd = T.row_rstd(x, tail.norm_eps).reshape(-1)
    with_rstd = T.backward(*pack.inputs, pack.grad_out, tail, rstd=rstd, **_kw(pack))
    for got, want in zip(with_rstd, T.backward(*pack.inputs, pack.grad_out, tail, **_kw(pack)), strict=True):
        assert torch.equal(got, want)


def _backward_from_stats(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
    """The long-window route: the forward's saved fp32 output ``stats[:, 2]`` is the norm's ``x``."""
    stats = reference.softmax_stats(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff, total_comp=grad_out.shape[0]
    )
    dx, grad_w = T.row_gradient(stats[:, 2], grad_out, tail, cu_seqlens_comp, ratio=ratio, dtype=torch.float32)
    grads = reference.backward_from_stats(
        kv, score, ape, cu_seqlens, cu_seqlens_comp, dx, stats, ratio=ratio, coff=coff
    )
    return (*grads, grad_w)


@pytest.mark.parametrize("name", ["r128c1d64-rope64", "r128c2d6-rope6-pos"])
def test_statistics_route_meets_the_contract(name):
    pack, tail = case_pack_and_tail(name, seed=8)
    T.check_backend(T.forward, _backward_from_stats, pack, tail)


def _bounds_tail():
    pack, tail = case_pack_and_tail("r4c2d8-padding-only")
    return pack, tail


BAD_TAILS = {
    "norm_weight shape": lambda t: dict(norm_weight=t.norm_weight[:-1]),
    "norm_weight dtype": lambda t: dict(norm_weight=t.norm_weight.half()),
    "norm_weight must be contiguous": lambda t: dict(norm_weight=torch.ones(16)[::2]),
    "norm_eps": lambda t: dict(norm_eps=float("nan")),
    "rope_dim must be an even": lambda t: dict(rope_dim=3),
    "rope_dim must be an even int in": lambda t: dict(rope_dim=10),
    "rope_interleaved must be a bool": lambda t: dict(rope_interleaved=1),
    "need rope_dim > 0": lambda t: dict(rope_dim=0),
    "needs rope_cos and rope_sin": lambda t: dict(rope_sin=None),
    "rope_cos shape": lambda t: dict(rope_cos=t.rope_cos[:, :1]),
    "rope_sin shape": lambda t: dict(rope_sin=t.rope_sin[:1]),
    "rope_sin dtype": lambda t: dict(rope_sin=t.rope_sin.double()),
    "position_start shape": lambda t: dict(position_start=t.position_start[:2]),
    "position_start dtype": lambda t: dict(position_start=t.position_start.long()),
}


@pytest.mark.parametrize("bound", list(BAD_TAILS))
def test_check_tail_names_the_bound(bound):
    pack, tail = _bounds_tail()
    kw = dict(head_dim=pack.head_dim, batch=len(pack.seqlens), device=pack.kv.device)
    T.check_tail(tail, **kw)
    with pytest.raises(ValueError, match=re.escape(bound)):
        T.check_tail(_with(tail, **BAD_TAILS[bound](tail)), **kw)


def test_validate_positions():
    pack, tail = case_pack_and_tail("r4c2d5-rope2-pos")
    T.validate_positions(tail, pack.cu_seqlens_comp, pack.ratio)  # random_tail sizes the tables to fit
    short = _with(tail, rope_cos=tail.rope_cos[:-1], rope_sin=tail.rope_sin[:-1])
    with pytest.raises(ValueError, match="row positions must lie in"):
        T.validate_positions(short, pack.cu_seqlens_comp, pack.ratio)
    negative = _with(tail, position_start=tail.position_start - 5000)
    with pytest.raises(ValueError, match="row positions must lie in"):
        T.validate_positions(negative, pack.cu_seqlens_comp, pack.ratio)


# ---------------------------------------------------------------- positions outside the tables

# (case, position_start per segment, table rows): rows below 0, inside, and at or past the tables' end.
OUT_OF_TABLE = {
    "r4c2d5-rope2-pos": ([-4, 0, 5, 2, 7], 6),
    "r2c1d66-rope64-half-pos": ([-3, 1], 4),
    "r128c2d6-rope6-pos": ([-128, 130, 2], 129),
}


def out_of_table_tail(name, seed=0, device="cpu", guard_rows=0):
    """A case with rows below 0 and past ``max_position``; ``guard_rows``: tables inside NaN rows."""
    pack, tail = case_pack_and_tail(name, seed=seed, device=device)
    starts, rows = OUT_OF_TABLE[name]
    half = tail.rope_dim // 2
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * (1.0 + torch.arange(half, dtype=torch.float64))
    tables = []
    for table in (torch.cos(angles), torch.sin(angles)):
        buf = torch.full((rows + 2 * guard_rows, half), float("nan"), dtype=torch.float32, device=device)
        buf[guard_rows : guard_rows + rows] = table.float()
        tables.append(buf[guard_rows : guard_rows + rows])
    start = torch.tensor(starts, dtype=torch.int32, device=device)
    return pack, _with(tail, rope_cos=tables[0], rope_sin=tables[1], position_start=start)


def _identity_padded(tail, shift, total_rows):
    """Positions moved up by ``shift``, tables padded with (cos 1, sin 0) rows: the same rotation, all inside."""
    half = tail.rope_dim // 2
    cos = torch.ones(total_rows, half)
    sin = torch.zeros(total_rows, half)
    rows = tail.rope_cos.shape[0]
    cos[shift : shift + rows], sin[shift : shift + rows] = tail.rope_cos, tail.rope_sin
    return _with(tail, rope_cos=cos, rope_sin=sin, position_start=tail.position_start + shift)


@pytest.mark.parametrize("name", list(OUT_OF_TABLE))
def test_positions_outside_the_tables_are_not_rotated(name):
    """Rows outside ``[0, max_position)`` are not rotated: bitwise as identity-padded tables, the norm's output alone."""
    pack, tail = out_of_table_tail(name)
    positions = T.row_positions(pack.cu_seqlens_comp, pack.total_comp, pack.ratio, tail.position_start)
    outside = (positions < 0) | (positions >= tail.rope_cos.shape[0])
    assert bool(outside.any()) and bool((~outside).any())
    shift = -int(positions.min())
    padded = _identity_padded(tail, shift, int(positions.max()) + shift + 1)
    fwd = dict(_kw(pack), total_comp=pack.total_comp)
    for precision in T.PRECISIONS:
        out = T.forward(*pack.inputs, tail, precision=precision, **fwd)
        assert torch.equal(out, T.forward(*pack.inputs, padded, precision=precision, **fwd))
        norm_only = T.forward(*pack.inputs, _with(tail, rope_dim=0, rope_cos=None, rope_sin=None,
                                                  position_start=None), precision=precision, **fwd)  # fmt: skip
        assert torch.equal(out[outside], norm_only[outside])
    for precision in ("fp32", "fp64"):
        got = T.backward(*pack.inputs, pack.grad_out, tail, precision=precision, **_kw(pack))
        want = T.backward(*pack.inputs, pack.grad_out, padded, precision=precision, **_kw(pack))
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    T.check_backend(T.forward, T.backward, pack, tail)
    with pytest.raises(
        ValueError, match=re.escape(f"row positions must lie in [0, max_position={tail.rope_cos.shape[0]})")
    ):
        T.validate_positions(tail, pack.cu_seqlens_comp, pack.ratio)


def test_positions_past_int32_are_outside_the_tables():
    """``position_start`` near the int32 limit: past the tables (int64) or wrapped below them (int32); no rotation."""
    pack, tail = out_of_table_tail("r4c2d5-rope2-pos")
    tail = _with(tail, position_start=torch.tensor([2**31 - 5, 0, 0, 2**31 - 1, -(2**31)], dtype=torch.int32))
    positions = T.row_positions(pack.cu_seqlens_comp, pack.total_comp, pack.ratio, tail.position_start)
    assert int(positions.max()) >= 2**31
    out = T.forward(*pack.inputs, tail, total_comp=pack.total_comp, **_kw(pack))
    norm_only = T.forward(
        *pack.inputs, T.Tail(tail.norm_weight, tail.norm_eps), total_comp=pack.total_comp, **_kw(pack)
    )
    real = positions != 0
    assert torch.equal(out[real], norm_only[real])


def test_docs_examples_run():
    text = (pathlib.Path(__file__).parents[1] / "docs" / "tail.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/tail.md", "exec"), {})


def _to_cuda(a):
    """A CUDA copy of a tensor or of a tail's tensors; anything else as it is."""
    if isinstance(a, T.Tail):
        return dataclasses.replace(a, **{f.name: _to_cuda(getattr(a, f.name)) for f in dataclasses.fields(a)})
    return a.cuda() if isinstance(a, torch.Tensor) else a


def _on_cuda(fn):
    """``fn`` run on CUDA copies of its tensor arguments (and of the tail's), results back on the CPU."""

    def moved(*args, **kw):
        result = fn(*(_to_cuda(a) for a in args), **kw)
        if isinstance(result, torch.Tensor):
            return result.cpu()
        return tuple(None if r is None else r.cpu() for r in result)

    return moved


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["r4c2d72-rope64-bf16w-pos", "r128c2d6-rope6-pos", "r2c1d66-rope64-half-pos"])
def test_references_on_cuda_meet_the_cpu_contract(name):
    pack, tail = case_pack_and_tail(name, seed=6)
    T.check_backend(_on_cuda(T.forward), _on_cuda(T.backward), pack, tail)
