"""Triton backend: the fused tail in every window class held to ``tail.check_backend``; every output, partial and
workspace starts as NaN (tests/test_tail.py's small cases and ``EXTRA``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from .common import DEVICE, HAS_CUDA, triton_skip
from .common import nan as _nan

pytestmark = triton_skip()

from csa_compressor import reference  # noqa: E402
from csa_compressor import tail as T  # noqa: E402
from csa_compressor.backends.triton import config, launch, plans  # noqa: E402
from csa_compressor.testing import bf16_ulp_distance, bitwise_equal, make_pack  # noqa: E402
from tests.test_tail import CASES, OUT_OF_TABLE, case_pack_and_tail, out_of_table_tail  # noqa: E402


class Route(NamedTuple):
    stats: bool = False  # the statistics pair (long windows)
    rstd: bool = False  # the forward fills rstd, the backward reads it
    dx: bool = False  # the statistics backward's dx kernel first (else its in-program row sums)


def _forward(pack_inputs, tail, ratio, coff, total_comp, route: Route, cfg=None):
    """``(out, stats, rstd)`` into NaN-filled buffers (``stats`` / ``rstd`` None where the route has none)."""
    kv = pack_inputs[0]
    d = kv.shape[1] // coff
    out = _nan((total_comp, d), kv.dtype, kv.device)
    stats = _nan((total_comp, 3, d), device=kv.device) if route.stats else None
    rstd = _nan((total_comp,), device=kv.device) if route.rstd else None
    if cfg is None:
        launch.forward(*pack_inputs, out, ratio, coff, None, stats, tail, rstd)
    else:
        launch.launch_forward(*pack_inputs, out, ratio, coff, cfg, stats, tail, rstd)
    return out, stats, rstd


def _adapters(route: Route, fwd_cfg=None, tile=None):
    """``tail.check_backend``'s ``(forward_fn, backward_fn)`` over the Triton protocol calls of ``route``."""

    def forward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp):
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        return _forward(inputs, tail, ratio, coff, total_comp, route, fwd_cfg)[0]

    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
        inputs = (kv, score, ape, cu_seqlens, cu_seqlens_comp)
        stats = rstd = None
        if route.stats or route.rstd:
            _out, stats, rstd = _forward(inputs, tail, ratio, coff, grad_out.shape[0], route, fwd_cfg)
        grads = _nan(kv.shape, kv.dtype, kv.device), _nan(kv.shape, kv.dtype, kv.device), _nan(ape.shape)
        grad_w = _nan((kv.shape[1] // coff,), device=kv.device) if tail.has_norm else None
        if tile is None:
            launch.backward(*inputs, grad_out, *grads, ratio, coff, None, stats, tail, grad_w, rstd)
        else:
            cfg = launch.choose_config("backward", ratio, coff, grad_out.shape[1], not HAS_CUDA)
            launch.launch_backward(*inputs, grad_out, *grads, ratio, coff, cfg, stats, tile, tail, grad_w, rstd)
        return (*grads, grad_w)

    return forward_fn, backward_fn


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """NaN-filled partials and plans built for this test alone (the dx threshold is read when a plan is built)."""

    def workspace(shape, device):
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)

    monkeypatch.setattr(plans, "_workspace", workspace)
    for name in ("_PLANS", "_FORWARD", "_BACKWARD"):
        monkeypatch.setattr(launch, name, {})


def _force_dx_route(monkeypatch):
    monkeypatch.setattr(plans, "STATS_TAIL_RESIDENT", 0)


SHORT = [name for name, case in CASES.items() if not config.is_long(case[0], case[1])]
LONG = [name for name, case in CASES.items() if config.is_long(case[0], case[1])]
LONG_ROUTES = {
    "recompute": Route(),
    "stats": Route(stats=True),
    "stats-dx-rstd": Route(True, True, True),
    "rstd": Route(rstd=True),
}
# Two routes per long case, each route on a coff-1 and a coff-2 case (the interpreter's time is the budget).
LONG_CASE_ROUTES = [(name, list(LONG_ROUTES)[(i + k) % 4]) for i, name in enumerate(LONG) for k in (0, 2)]

# Cases test_tail.py lacks (its format): 9-16-slot windows, long windows with a norm only, odd head_dim with
# interleaved pairs, short segments and padding rows; one route each.
EXTRA = {
    "r8c2d9-rope4-pos": ((8, 2, 9, (35, 7, 16), 1, 2, dict(rope_dim=4, positions=True)), Route()),
    "r16c1d12-rope12-half": ((16, 1, 12, (40, 15), 0, 1, dict(rope_dim=12, interleaved=False)), Route(rstd=True)),
    "r5c2d10-norm": ((5, 2, 10, (23, 4, 11), 2, 1, dict(norm_dtype=torch.bfloat16)), Route(rstd=True)),
    "r128c2d7-norm": ((128, 2, 7, (260, 3), 1, 2, dict()), Route(rstd=True)),
    "r128c1d35-rope32-pos": ((128, 1, 35, (130, 256), 0, 1, dict(rope_dim=32, positions=True)), Route(True, False, True)),
}  # fmt: skip


def _extra_pack_and_tail(name, seed):
    (ratio, coff, head_dim, seqlens, tok_pad, comp_pad, tail_kw), _route = EXTRA[name]
    pack = make_pack(
        seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, seed=seed, device=DEVICE
    )
    return pack, T.random_tail(pack, seed=seed + 7, **tail_kw)


@pytest.mark.parametrize("name", SHORT)
def test_short_windows_meet_the_contract(name):
    pack, tail = case_pack_and_tail(name, seed=11, device=DEVICE)
    T.check_backend(*_adapters(Route()), pack, tail)


@pytest.mark.parametrize("name", list(EXTRA))
def test_more_windows_meet_the_contract(name, monkeypatch):
    route = EXTRA[name][1]
    if route.dx:
        _force_dx_route(monkeypatch)
    pack, tail = _extra_pack_and_tail(name, seed=17)
    T.check_backend(*_adapters(route), pack, tail)
    (plan,) = launch._FORWARD.values()
    assert isinstance(plan, plans.TailForwardPlan) == config.is_long(pack.ratio, pack.coff)


@pytest.mark.parametrize("name", ["r4c2d72-rope64-bf16w-pos", "r2c1d66-rope64-half-pos"])
def test_short_windows_with_rstd(name):
    pack, tail = case_pack_and_tail(name, seed=12, device=DEVICE)
    T.check_backend(*_adapters(Route(rstd=True)), pack, tail)


@pytest.mark.parametrize("name", ["r4c2d72-rope64-bf16w-pos", "r2c1d66-rope64-half-pos"])
def test_tables_read_before_or_after_the_pooling(name):
    """One-warp programs read the rows' rotation tables before the pooling's math, wider ones after the norm
    (``TABLES_FIRST``); wider ones also take the fast form (ex2, fma). Both within the contract; under the
    interpreter (no fast form there) the same bits of out and rstd."""
    pack, tail = case_pack_and_tail(name, seed=12, device=DEVICE)
    one = config.choose_config("forward", pack.ratio, pack.coff, pack.head_dim, interpret=True)
    wide = dataclasses.replace(one, num_warps=4)
    assert one.num_warps == 1 and one.block_d >= pack.head_dim
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    (out1, _s, rstd1), (out4, _s, rstd4) = (
        _forward(inputs, tail, pack.ratio, pack.coff, pack.total_comp, Route(rstd=True), cfg) for cfg in (one, wide)
    )
    if DEVICE == "cpu":
        assert bitwise_equal(out1, out4) and bitwise_equal(rstd1, rstd4)
    for cfg in (one, wide):
        T.check_backend(*_adapters(Route(rstd=True), cfg), pack, tail)


@pytest.mark.parametrize(("name", "route"), LONG_CASE_ROUTES)
def test_long_windows_meet_the_contract(name, route, monkeypatch):
    if LONG_ROUTES[route].dx:
        _force_dx_route(monkeypatch)
    pack, tail = case_pack_and_tail(name, seed=13, device=DEVICE)
    T.check_backend(*_adapters(LONG_ROUTES[route]), pack, tail)
    (plan,) = launch._BACKWARD.values()
    assert plan.family == "stats" and (plan.stats_forward is None) == LONG_ROUTES[route].stats
    assert all(bool(sizes[-1]) == LONG_ROUTES[route].dx for sizes in plan._sizes.values())
    (forward_plan,) = launch._FORWARD.values()
    assert isinstance(forward_plan, plans.TailForwardPlan)


def test_long_forward_composes_the_pooling_and_the_epilogue():
    """Long forward with a tail at column-chunked tiles: statistics bitwise the tail-less forward's, ``out`` within 1
    ulp of the fp32 reference and the same bits either way, rstd every row's."""
    pack = make_pack((300, 5, 129), 12, 128, 1, token_padding=2, comp_padding=2, seed=18, device=DEVICE)
    tail = T.random_tail(pack, rope_dim=8, interleaved=False, positions=True, seed=6)
    cfg = config.KernelConfig(1, 8, 1, rows_per_prog=2, vec=1, slots_per_thread=4)
    args = (pack.ratio, pack.coff, pack.total_comp)
    plain_out, plain_stats, _ = _forward(pack.inputs, None, *args, Route(stats=True), cfg)
    outs = []
    for route in (Route(stats=True, rstd=True), Route()):
        out, stats, rstd = _forward(pack.inputs, tail, *args, route, cfg)
        outs.append(out)
        if stats is not None:
            assert torch.equal(stats, plain_stats)
            x = T.pooled_rows(*pack.inputs, dtype=torch.float32, ratio=pack.ratio, coff=pack.coff,
                              total_comp=pack.total_comp)  # fmt: skip
            torch.testing.assert_close(rstd, T.row_rstd(x, tail.norm_eps).reshape(-1), rtol=1e-6, atol=0)
    want = T.forward(*pack.inputs, tail, ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp)
    assert int(bf16_ulp_distance(outs[0], want).max()) <= 1
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert not torch.equal(outs[0].view(torch.int16), plain_out.view(torch.int16))
    kinds = {type(plan) for plan in launch._PLANS.values()}
    assert kinds == {plans.ForwardPlan, plans.TailForwardPlan}


def test_statistics_keep_the_pooled_row_and_rstd_is_filled():
    """``stats[:, 2]`` is the unnormalised pooled row; rstd is every row's (padding rows too), 1 without a norm."""
    pack, tail = case_pack_and_tail("r128c2d6-rope6-pos", seed=14, device=DEVICE)
    kw = dict(ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp)
    x = T.pooled_rows(*pack.inputs, dtype=torch.float32, **kw)
    _out, stats, rstd = _forward(pack.inputs, tail, pack.ratio, pack.coff, pack.total_comp, Route(True, True))
    want = reference.softmax_stats(*pack.inputs, **kw)
    torch.testing.assert_close(stats[:, 2], want[:, 2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd, T.row_rstd(x, tail.norm_eps).reshape(-1), rtol=1e-6, atol=0)
    rope_only = dataclasses.replace(tail, norm_weight=None)
    _out, _stats, ones = _forward(pack.inputs, rope_only, pack.ratio, pack.coff, pack.total_comp, Route(rstd=True))
    assert torch.equal(ones, torch.ones_like(ones))
    _out, _stats, ones = _forward(pack.inputs, None, pack.ratio, pack.coff, pack.total_comp, Route(rstd=True))
    assert torch.equal(ones, torch.ones_like(ones))


@pytest.mark.parametrize("name", ["r4c2d5-rope2-pos", "r128c1d3-rope2-half"])
def test_identity_tail_is_the_pooling_bitwise(name):
    """A tail with neither norm nor rope runs today's plans (no tail key) and gives their bits."""
    pack, _ = case_pack_and_tail(name, device=DEVICE)
    args = (pack.ratio, pack.coff, pack.total_comp)
    plain = _forward(pack.inputs, None, *args, Route())[0]
    keys = set(launch._FORWARD)
    identity = _forward(pack.inputs, T.Tail(), *args, Route())[0]
    assert set(launch._FORWARD) == keys and all(len(k) == 6 for k in keys)
    assert torch.equal(plain.view(torch.int16), identity.view(torch.int16))
    grads = []
    for tail in (None, T.Tail()):
        g = _nan(pack.kv.shape, pack.kv.dtype), _nan(pack.kv.shape, pack.kv.dtype), _nan(pack.ape.shape)
        launch.backward(*pack.inputs, pack.grad_out, *g, pack.ratio, pack.coff, None, None, tail)
        grads.append(g)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


OUT_OF_TABLE_ROUTES = [
    (name, route)
    for name in OUT_OF_TABLE
    for route in ([Route(), Route(rstd=True)] if name in SHORT else [Route(), Route(True, True, True)])
]


@pytest.mark.parametrize(("name", "route"), OUT_OF_TABLE_ROUTES)
def test_positions_outside_the_tables(name, route, monkeypatch):
    """Rows outside ``[0, max_position)`` are not rotated, in every route; the tables sit inside NaN rows."""
    if route.dx:
        _force_dx_route(monkeypatch)
    pack, tail = out_of_table_tail(name, seed=15, device=DEVICE, guard_rows=256)
    T.check_backend(*_adapters(route), pack, tail)


def test_positions_past_int32_are_outside_the_tables():
    """``position_start`` near the int32 limits (kernel positions wrap): every such row is not rotated."""
    pack, tail = out_of_table_tail("r4c2d5-rope2-pos", seed=16, device=DEVICE, guard_rows=256)
    starts = torch.tensor([2**31 - 5, 0, 0, 2**31 - 1, -(2**31)], dtype=torch.int32, device=DEVICE)
    T.check_backend(*_adapters(Route()), pack, dataclasses.replace(tail, position_start=starts))


def test_explicit_tiles(monkeypatch):
    """GPU-like paths: the long forward with two chunks in flight, the statistics backward over several column blocks
    and slot chunks."""
    monkeypatch.setattr(plans, "TAIL_ROW_BLOCK", 4)
    pack = make_pack((40, 20, 3), 12, 12, 2, token_padding=3, comp_padding=2, seed=16, device=DEVICE)
    tail = T.random_tail(pack, rope_dim=8, interleaved=False, positions=True, seed=4)
    fwd = config.KernelConfig(1, 16, 1, rows_per_prog=2, vec=1, slots_per_thread=2, prefetch_depth=2)
    T.check_backend(*_adapters(Route(stats=True), fwd, config.StatsTile(8, 8, 1, 2)), pack, tail)


def test_supports_tail():
    full = T.TailConfig(torch.float32, 64, True, True)
    assert launch.supports_tail(4, 2, 512, full) and launch.supports_tail(128, 1, 128, full)
    assert launch.supports_tail(2, 1, 64, T.TailConfig(torch.bfloat16, 0, False, False))
    assert not launch.supports_tail(4, 2, launch.MAX_TAIL_HEAD_DIM + 2, full)
    assert not launch.supports_tail(4, 3, 512, full)
    assert not launch.supports_tail(4, 2, 512, T.TailConfig(torch.float16, 64, True, True))
    assert not launch.supports_tail(4, 2, 8, T.TailConfig(None, 10, True, False))


def test_bounds_of_the_tail_launch():
    pack, tail = case_pack_and_tail("r4c1d7-norm", device=DEVICE)
    grads = torch.empty_like(pack.kv), torch.empty_like(pack.kv), torch.empty_like(pack.ape)
    with pytest.raises(ValueError, match="needs grad_norm_weight"):
        launch.backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, None, None, tail)
    narrow = config.KernelConfig(1, 4, 1)
    out = torch.empty((pack.total_comp, pack.head_dim), dtype=pack.kv.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="whole rows"):
        launch.launch_forward(*pack.inputs, out, pack.ratio, pack.coff, narrow, None, tail)


def test_compile_builds_the_tail_plans():
    config_ = T.TailConfig(torch.bfloat16, 8, True, True)
    launch.compile("forward", 128, 2, 8, torch.bfloat16, DEVICE, config_)
    launch.compile("backward", 4, 2, 8, torch.bfloat16, DEVICE, config_)
    forward_keys = [k for k in launch._FORWARD if len(k) == 8]
    assert sorted((k[5], k[7]) for k in forward_keys) == [(False, False), (False, True), (True, False), (True, True)]
    assert all(isinstance(launch._FORWARD[k], plans.TailForwardPlan) for k in forward_keys)
    assert sorted(k[7] for k in launch._BACKWARD if len(k) == 8) == [False, True]


# SPEC section 6 sizes (the DeepSeek-V4 tails: head_dim 512 and 128, rope_dim 64, interleaved), for the H200.
GPU_CASES = [
    ((8192,), 128, 4, 2),
    ((8192,) * 3, 512, 4, 2),
    ((8192,), 128, 128, 1),
    ((65536,), 512, 128, 2),
    ((8192,) * 3, 512, 128, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{len(c[0])}x{c[0][0]}-d{c[1]}-r{c[2]}c{c[3]}")
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_full_size_contract_on_gpu(case, interleaved):
    seqlens, head_dim, ratio, coff = case
    pack = make_pack(seqlens, head_dim, ratio, coff, comp_padding=3, seed=21, device=DEVICE)
    tail = T.random_tail(pack, rope_dim=64, interleaved=interleaved, positions=True, seed=5)
    routes = [Route(rstd=True)]
    if config.is_long(ratio, coff):
        routes = [Route(stats=True, rstd=True), Route()]
    for route in routes:
        T.check_backend(*_adapters(route), pack, tail)


# Rows past 128 columns: the multi-warp whole-row programs, odd widths masked, ragged packs with short segments and
# padding rows.
WIDE_CASES = [((300, 9, 1030, 3), 130, 4, 2), ((77, 512), 256, 4, 2), ((5, 260), 300, 2, 1), ((40, 130), 520, 8, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: f"d{c[1]}-r{c[2]}c{c[3]}")
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
def test_wide_programs_meet_the_contract_on_gpu(case, interleaved):
    seqlens, head_dim, ratio, coff = case
    assert config.whole_rows(config.choose_config("forward", ratio, coff, head_dim, False), head_dim).num_warps > 1
    pack = make_pack(seqlens, head_dim, ratio, coff, token_padding=2, comp_padding=3, seed=23, device=DEVICE)
    tail = T.random_tail(pack, rope_dim=64, interleaved=interleaved, positions=True, seed=9)
    T.check_backend(*_adapters(Route(rstd=True)), pack, tail)
