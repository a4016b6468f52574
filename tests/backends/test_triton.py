"""Triton backend vs the references: SPEC edge cases, NaN canaries, determinism, property tests (interpreted on
the CPU, so packs stay small).
"""

from __future__ import annotations

import os

import pytest
import torch

from .common import DEVICE, HAS_CUDA, triton_skip

pytestmark = triton_skip()

from csa_compressor import reference  # noqa: E402
from csa_compressor.backends.triton import launch  # noqa: E402
from csa_compressor.testing import assert_contract, bf16_ulp_distance, bitwise_equal, make_pack  # noqa: E402

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is a test extra
    given = None


def _pack(seqlens, head_dim, ratio, coff, tok_pad=0, comp_pad=0, seed=0, **kw):
    return make_pack(
        seqlens,
        head_dim,
        ratio,
        coff,
        token_padding=tok_pad,
        comp_padding=comp_pad,
        device=DEVICE,
        seed=seed,
        **kw,
    )


def _nan_like(t):
    return torch.full_like(t, float("nan"))


def _run(pack, cfg_fwd=None, cfg_bwd=None):
    """Forward and backward through the protocol (or explicit tiles), into NaN-filled buffers."""
    out = torch.full((pack.total_comp, pack.head_dim), float("nan"), dtype=pack.kv.dtype, device=DEVICE)
    grads = _nan_like(pack.kv), _nan_like(pack.score), _nan_like(pack.ape)
    if cfg_fwd is None:
        launch.forward(*pack.inputs, out, pack.ratio, pack.coff, None)
        launch.backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, None)
    else:
        launch.launch_forward(*pack.inputs, out, pack.ratio, pack.coff, cfg_fwd)
        launch.launch_backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, cfg_bwd)
    return out, *grads


def _check(pack, out, grad_kv, grad_score, grad_ape, max_ulp=1):
    """The SPEC section 3 contract (csa_compressor.testing), NaN-free grad_ape included."""
    assert not torch.isnan(grad_ape).any()
    assert_contract(pack, out, (grad_kv, grad_score, grad_ape), max_ulp)


# (seqlens, head_dim, ratio, coff, token_padding, comp_padding)
EDGE_CASES = [
    ((13, 8, 0, 3, 21), 7, 4, 2, 5, 3),  # ragged, empty and short segments, both paddings, odd head_dim
    ((13, 8, 0, 3, 21), 65, 4, 1, 2, 1),
    ((7, 1, 0, 4), 16, 2, 2, 1, 2),
    ((9, 1, 0, 6), 5, 2, 1, 2, 1),  # ratio 2 coff 1
    ((40, 5, 17), 9, 8, 2, 3, 1),
    ((16, 23), 32, 8, 1, 0, 0),
    ((17, 9), 10, 3, 2, 2, 1),  # non-power-of-two ratio
    ((26,), 12, 5, 1, 0, 2),
    ((3, 1, 0), 8, 4, 2, 1, 2),  # no segment reaches ratio: every row is padding
    ((4,), 8, 4, 2, 0, 0),  # one row, first group only
    ((300, 5), 5, 128, 1, 1, 1),
    ((300, 130, 0), 3, 128, 2, 0, 1),
    ((520,), 2, 256, 2, 3, 1),
    ((5, 9, 0, 0, 12, 4, 7, 0, 8, 3, 11, 6, 1, 9, 0, 4, 10), 6, 2, 2, 4, 3),  # 17 segments: deeper binary search
]


def _case_id(case):
    seqlens, d, r, c, tp, cp = case
    return f"r{r}c{c}d{d}B{len(seqlens)}tp{tp}cp{cp}"


@pytest.mark.parametrize("case", EDGE_CASES, ids=[_case_id(c) for c in EDGE_CASES])
def test_edge_cases_match_reference(case):
    seqlens, head_dim, ratio, coff, tok_pad, comp_pad = case
    pack = _pack(seqlens, head_dim, ratio, coff, tok_pad, comp_pad, seed=len(seqlens) + ratio)
    _check(pack, *_run(pack))


TILINGS = [
    # several column blocks (last one partial), row tiles not dividing N, several tiles per program, small sweeps
    launch.KernelConfig(block_r=2, block_d=16, num_warps=1, rows_per_prog=6, sweep_t=16, sweep_d=16),
    launch.KernelConfig(block_r=1, block_d=32, num_warps=1, rows_per_prog=1, sweep_t=8, sweep_d=32),
    launch.KernelConfig(block_r=4, block_d=64, num_warps=1, rows_per_prog=4, sweep_t=128, sweep_d=8),
    # the GPU tile families (natively: their layouts, vector widths and multi-warp reductions)
    launch.KernelConfig(block_r=1, block_d=128, num_warps=1, rows_per_prog=8, vec=4),
    launch.KernelConfig(block_r=2, block_d=64, num_warps=1, rows_per_prog=16, vec=4),
    launch.KernelConfig(block_r=1, block_d=16, num_warps=4, rows_per_prog=4, vec=4),
]
TILING_IDS = ["r2d16x6", "r1d32x1", "r4d64x4", "r1d128w1", "r2d64w1", "r1d16w4"]
# Each tiling once, on ragged packs (per-row search) or long segments (one segment per program), ratio 4 coff 2 or 3
# coff 1; the interpreter ignores num_warps and vector widths.
RAGGED, LONG = (13, 8, 0, 3, 21, 2), (50, 29)
TILING_CASES = [
    (TILINGS[0], (4, 2), RAGGED),
    (TILINGS[0], (3, 1), LONG),
    (TILINGS[1], (3, 1), RAGGED),
    (TILINGS[2], (4, 2), LONG),
    (TILINGS[3], (3, 1), LONG),
    (TILINGS[4], (4, 2), RAGGED),
    (TILINGS[5], (3, 1), RAGGED),
]


@pytest.mark.parametrize(
    "cfg,ratio_coff,seqlens",
    TILING_CASES,
    ids=[
        f"{TILING_IDS[TILINGS.index(c)]}-r{rc[0]}c{rc[1]}-{'long' if sl == LONG else 'ragged'}"
        for c, rc, sl in TILING_CASES
    ],
)
def test_explicit_tilings_match_reference(cfg, ratio_coff, seqlens):
    """Tile shapes other than the defaults; "long" segments take the one-segment-per-program fast path."""
    ratio, coff = ratio_coff
    pack = _pack(seqlens, 24, ratio, coff, tok_pad=5, comp_pad=3, seed=7)
    _check(pack, *_run(pack, cfg, cfg))


LONG_TILINGS = [
    # the GPU long-window families, scaled down: vectors, lanes over threads and warps, chunks per row, rows per
    # program, a partial last column block (head_dim 24)
    launch.KernelConfig(block_r=1, block_d=16, num_warps=1, rows_per_prog=3, vec=8, slots_per_thread=2),
    launch.KernelConfig(block_r=1, block_d=8, num_warps=2, rows_per_prog=2, vec=8, slots_per_thread=4),
    launch.KernelConfig(block_r=1, block_d=32, num_warps=1, rows_per_prog=1, vec=4, slots_per_thread=8),
    # two chunks in flight (the 3x8192 d512 r128 c1 tile): the row's last two prefetch the next row's first two
    launch.KernelConfig(
        block_r=1, block_d=16, num_warps=1, rows_per_prog=3, vec=8, slots_per_thread=2, prefetch_depth=2
    ),
]
LONG_IDS = [f"d{c.block_d}w{c.num_warps}c{c.slots_per_thread}" + "p2" * (c.prefetch_depth == 2) for c in LONG_TILINGS]


# Each long tiling once; two chunks in flight at ratio 40 coff 1 (exactly two per row) and 128 coff 1 (steady state).
LONG_CASES = [(LONG_TILINGS[0], 128, 2), (LONG_TILINGS[1], 40, 1), (LONG_TILINGS[2], 40, 1)]
LONG_CASES += [(LONG_TILINGS[3], 40, 1), (LONG_TILINGS[3], 128, 1)]
LONG_CASE_IDS = [f"{LONG_IDS[LONG_TILINGS.index(c)]}-r{r}c{k}" for c, r, k in LONG_CASES]


@pytest.mark.parametrize("cfg,ratio,coff", LONG_CASES, ids=LONG_CASE_IDS)
def test_long_window_tilings_match_reference(cfg, ratio, coff):
    """Long-window kernels with GPU-like tiles: first groups, odd ratio, padding rows, short segments, partial columns."""
    pack = _pack((3 * ratio + 5, ratio - 1, 2 * ratio), 24, ratio, coff, tok_pad=3, comp_pad=2, seed=13)
    _check(pack, *_run(pack, cfg, cfg))


def test_many_dape_partials():
    """More dAPE partials than one reduction step: the chunked fixed-order reduction (38 partials, steps of 32)."""
    pack = _pack((38, 33), 8, 2, 2, comp_pad=3, seed=4)
    cfg = launch.KernelConfig(
        block_r=1, block_d=8, num_warps=1, rows_per_prog=1, sweep_t=128, sweep_d=8, dape_block=8, dape_chunk=32
    )  # fmt: skip
    dflt = launch.choose_config("forward", 2, 2, 8, not HAS_CUDA)
    _check(pack, *_run(pack, dflt, cfg))


def test_bitwise_at_ratio_4_on_this_device():
    """SPEC goal: forward, dKV and dScore bitwise equal to the fp32 reference at ratio 4 (1 ulp is the contract)."""
    pack = _pack((24, 13, 9), 16, 4, 2, 2, 1, seed=3)
    out, grad_kv, grad_score, _ = _run(pack)
    kw = dict(ratio=4, coff=2)
    ref_out = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **kw)
    ref_kv, ref_score, _ = reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw)
    # Report rather than fail on the rare fp32 summation-order tie; the 1-ulp contract is asserted everywhere else.
    mismatches = [
        int((bf16_ulp_distance(a, b) != 0).sum())
        for a, b in ((out, ref_out), (grad_kv, ref_kv), (grad_score, ref_score))
    ]
    total = out.numel() + grad_kv.numel() + grad_score.numel()
    assert sum(mismatches) <= max(1, total // 1000), mismatches


def test_run_to_run_bitwise_determinism():
    pack = _pack((37, 0, 22, 9), 24, 4, 2, 3, 2, seed=11)
    first = _run(pack)
    second = _run(pack)
    for a, b in zip(first, second, strict=True):
        assert bitwise_equal(a, b)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_inputs_propagate_like_the_reference():
    pack = _pack((16, 9), 8, 4, 2, 1, 1, seed=5)
    pack.kv[5, 3] = float("nan")
    pack.score[9, 10] = float("inf")
    pack.score[2, 1] = float("-inf")
    pack.grad_out[1, 2] = float("nan")
    out, grad_kv, grad_score, _ = _run(pack)
    kw = dict(ratio=4, coff=2)
    ref_out = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **kw)
    ref_kv, ref_score, _ = reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    assert int(bf16_ulp_distance(out, ref_out).max()) <= 1
    assert int(bf16_ulp_distance(grad_kv, ref_kv).max()) <= 1
    assert int(bf16_ulp_distance(grad_score, ref_score).max()) <= 1


def test_nan_canary_through_the_class_api():
    api = pytest.importorskip("csa_compressor.api")
    pack = _pack((21, 2, 0, 13), 9, 4, 2, tok_pad=3, comp_pad=2, seed=2)
    out = torch.full((pack.total_comp, 9), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    fwd = api.CSACompressorForward(*pack.inputs, out, ratio=4, coff=2, backend="triton")
    fwd.check_support()
    fwd.compile()
    fwd.execute(*pack.inputs, out)
    grads = _nan_like(pack.kv), _nan_like(pack.score), _nan_like(pack.ape)
    bwd = api.CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, ratio=4, coff=2, backend="triton")
    bwd.check_support()
    bwd.compile()
    bwd.execute(*pack.inputs, pack.grad_out, *grads)
    assert not any(bool(torch.isnan(t).any()) for t in (out, *grads))
    _check(pack, out, *grads)


def test_protocol_reasons():
    assert launch.unavailable_reason() is None
    assert launch.config_unsupported_reason(4, 3, 16) is not None
    assert launch.config_unsupported_reason(512, 1, 16) is not None
    assert launch.config_unsupported_reason(7, 2, 33) is None
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert launch.device_unsupported_reason(torch.device("cpu")) is not None


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_after_compile():
    # Sizes unlike compile()'s warm-up problem (many programs, several dAPE partials): nothing may recompile.
    pack = _pack((640, 37, 0, 397), 128, 4, 2, 4, 3, seed=9)
    for direction in ("forward", "backward"):
        launch.compile(direction, 4, 2, 128, torch.bfloat16, DEVICE)
    out = torch.empty((pack.total_comp, 128), dtype=torch.bfloat16, device=DEVICE)
    grads = torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launch.forward(*pack.inputs, out, 4, 2, None)
        launch.backward(*pack.inputs, pack.grad_out, *grads, 4, 2, None)
    for t in (out, *grads):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(pack, out, *grads)


if given is not None:

    @st.composite
    def _packs(draw):
        ratio = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 128]))
        coff = draw(st.sampled_from([1, 2]))
        head_dim = draw(st.integers(1, 65))
        top = 3 * ratio + 3 if ratio <= 16 else ratio + ratio // 2
        seqlens = draw(st.lists(st.integers(0, top), min_size=1, max_size=5))
        tok_pad = draw(st.integers(0, 3))
        comp_pad = draw(st.integers(0, 2))
        if sum(s // ratio for s in seqlens) + comp_pad == 0:
            comp_pad = 1  # N == 0 is the API's business
        if sum(seqlens) + tok_pad < ratio:
            tok_pad = ratio - sum(seqlens)  # padding rows read tokens 0..ratio-1
        seed = draw(st.integers(0, 2**16))
        return _pack(tuple(seqlens), head_dim, ratio, coff, tok_pad, comp_pad, seed=seed)

    # Each new shape compiles on a GPU (the interpreter pays per example); CI draws the same examples
    # (reproducible).
    @settings(
        max_examples=8 if HAS_CUDA else 12,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=bool(os.environ.get("CI")),
    )
    @given(pack=_packs())
    def test_property_random_packs_match_reference(pack):
        _check(pack, *_run(pack))
