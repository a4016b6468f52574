"""Triton long-window kernels with softmax statistics: the statistics vs the reference, ``out`` unchanged by the
flag, the backward's contract and that it reads each statistic, padding rows, NaN canaries, determinism.
"""

from __future__ import annotations

import pytest
import torch

from .common import HAS_CUDA, triton_skip

pytestmark = triton_skip()

from csa_compressor import reference  # noqa: E402
from csa_compressor.backends.triton import config, launch, plans  # noqa: E402
from csa_compressor.testing import bf16_ulp_distance, bitwise_equal, contract_report  # noqa: E402
from tests.backends.test_triton import DEVICE, LONG_TILINGS, _case_id, _nan_like, _pack  # noqa: E402


def _forward(pack, stats=True, cfg=None):
    """``(out, stats)`` into NaN-filled buffers (``stats`` None when not asked for)."""
    out = torch.full((pack.total_comp, pack.head_dim), float("nan"), dtype=pack.kv.dtype, device=DEVICE)
    st = None
    if stats:
        st = torch.full((pack.total_comp, 3, pack.head_dim), float("nan"), dtype=torch.float32, device=DEVICE)
    if cfg is None:
        launch.forward(*pack.inputs, out, pack.ratio, pack.coff, None, st)
    else:
        launch.launch_forward(*pack.inputs, out, pack.ratio, pack.coff, cfg, st)
    return out, st


def _backward(pack, stats, cfg=None, tile=None):
    """``(grad_kv, grad_score, grad_ape)`` from NaN-filled buffers."""
    grads = _nan_like(pack.kv), _nan_like(pack.score), _nan_like(pack.ape)
    if cfg is None and tile is None:
        launch.backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, None, stats)
    else:
        cfg = cfg or launch.choose_config("backward", pack.ratio, pack.coff, pack.head_dim, not HAS_CUDA)
        launch.launch_backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, cfg, stats, tile)
    return grads


def _ref_stats(pack):
    kw = dict(ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp)
    return reference.softmax_stats(*pack.inputs, **kw)


def _assert_stats_match(pack, stats):
    ref = _ref_stats(pack)
    assert stats.shape == ref.shape
    assert not torch.isnan(stats).any(), "stats not fully written"
    # m: the max of the same fp32 products (bitwise in practice).
    torch.testing.assert_close(stats[:, 0], ref[:, 0], rtol=1e-6, atol=0)
    torch.testing.assert_close(stats[:, 1], ref[:, 1], rtol=1e-5, atol=0)
    # The output can cancel towards 0: a small absolute slack (values are O(1)).
    torch.testing.assert_close(stats[:, 2], ref[:, 2], rtol=1e-5, atol=1e-6)


def _ok(pack, grads) -> bool:
    return contract_report(pack, None, grads)["ok"]


def _assert_contract(pack, grads):
    assert not any(bool(torch.isnan(g).any()) for g in grads), "NaN canary: a gradient was not written"
    report = contract_report(pack, None, grads)
    assert report["ok"], f"numerics contract broken: {report}"


def _same(a, b) -> bool:
    return all(bitwise_equal(x, y) for x, y in zip(a, b, strict=True))


# (seqlens, head_dim, ratio, coff, token_padding, comp_padding)
CASES = [
    ((40, 5, 0, 33, 16), 8, 16, 2, 3, 2),  # ragged: short and empty segments, both paddings
    ((52, 10, 0, 17), 9, 17, 1, 2, 2),  # non-power-of-two ratio, odd head_dim
    ((300, 5), 5, 128, 1, 1, 1),
    ((5, 0, 3), 8, 16, 2, 12, 2),  # no segment reaches ratio: every row is padding
]


def _case_pack(case):
    seqlens, head_dim, ratio, coff, tok_pad, comp_pad = case
    return _pack(seqlens, head_dim, ratio, coff, tok_pad, comp_pad, seed=len(seqlens) + ratio)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_stats_match_reference_and_leave_out_unchanged(case):
    pack = _case_pack(case)
    out, stats = _forward(pack)
    plain, none = _forward(pack, stats=False)
    assert none is None
    # The statistics forward works in the log2 domain: its bf16 output may differ from the plain one by one ulp.
    assert int(bf16_ulp_distance(out, plain).max()) <= 1, "the stats flag changed out by more than 1 ulp"
    assert contract_report(pack, out=out)["ok"]
    assert not torch.isnan(out).any()
    _assert_stats_match(pack, stats)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_backward_with_stats_meets_the_contract(case):
    pack = _case_pack(case)
    _, stats = _forward(pack)
    grads = _backward(pack, stats)
    _assert_contract(pack, grads)
    # The reference's statistics serve as well as the kernel's.
    _assert_contract(pack, _backward(pack, _ref_stats(pack)))
    # The stats are what the backward uses: a wrong 1/l changes every real row's gradients.
    wrong = stats.clone()
    wrong[:, 1] *= 1.5
    changed = not _same(grads, _backward(pack, wrong))
    assert changed == (pack.true_comp > 0)


def test_backward_reads_each_statistic():
    """Shifting m by 1 and doubling 1/l is the same softmax; a wrong 1/l scales dKV; a wrong output changes dScore."""
    pack = _pack((40, 5, 0, 33), 8, 16, 2, 3, 2, seed=21)
    _, stats = _forward(pack)
    base = _backward(pack, stats)
    _assert_contract(pack, base)

    shifted = stats.clone()
    shifted[:, 0] += 1.0
    shifted[:, 1] *= 2.0
    _assert_contract(pack, _backward(pack, shifted))

    scaled = stats.clone()
    scaled[:, 1] *= 1.25
    grads = _backward(pack, scaled)
    assert not _ok(pack, grads)
    nz = base[0] != 0
    ratio = grads[0][nz].float() / base[0][nz].float()
    assert float((ratio - 1.25).abs().max()) < 2**-6  # bf16 rounding of both sides

    moved = stats.clone()
    moved[:, 2] += 0.5
    grads = _backward(pack, moved)
    assert bitwise_equal(grads[0], base[0]), "dKV must not depend on the saved output"
    assert not bitwise_equal(grads[1], base[1])
    assert not _ok(pack, grads)


def test_padding_row_stats_are_not_read():
    """Rows past cu_seqlens_comp[-1] are ignored by the backward, their statistics included."""
    pack = _pack((40, 0, 21), 8, 16, 2, 3, 4, seed=5)
    _, stats = _forward(pack)
    first = _backward(pack, stats)
    garbage = stats.clone()
    garbage[pack.true_comp :] = float("nan")
    second = _backward(pack, garbage)
    _assert_contract(pack, second)
    assert _same(first, second)


# Several lanes per column and column blocks (r128c2), two chunks in flight (r40c1), 8 slots per thread (r128c1).
STATS_TILINGS = [(LONG_TILINGS[1], 128, 2), (LONG_TILINGS[3], 40, 1), (LONG_TILINGS[2], 128, 1)]


@pytest.mark.parametrize("cfg,ratio,coff", STATS_TILINGS, ids=["d8w2c4-r128c2", "d16w1c2p2-r40c1", "d32w1c8-r128c1"])
def test_stats_with_gpu_like_tilings(cfg, ratio, coff):
    """GPU-like tiles: several lanes per column, column blocks (last partial), rows per program (stats prefetch)."""
    pack = _pack((3 * ratio + 5, ratio - 1, 2 * ratio), 24, ratio, coff, tok_pad=3, comp_pad=2, seed=13)
    out, stats = _forward(pack, cfg=cfg)
    plain, _ = _forward(pack, stats=False, cfg=cfg)
    assert int(bf16_ulp_distance(out, plain).max()) <= 1
    _assert_stats_match(pack, stats)
    grads = _backward(pack, stats, cfg=cfg)
    _assert_contract(pack, grads)
    wrong = stats.clone()
    wrong[:, 2] -= 0.25
    assert not _same(grads, _backward(pack, wrong, cfg=cfg))


# --------------------------------------------------------------------------- streaming statistics backward tiles
# ``csa_bwd_stats_kernel``'s ``tile`` (block_d, slots, num_warps, rows per program): these force several row ranges,
# chunks and column blocks (the interpreter default has one of each).

# (seqlens, head_dim, ratio, coff, token_padding, comp_padding), tile
STREAM_CASES = [
    # W = 48 in 16-slot chunks (chunk 1 straddles the halves); odd head_dim in 2 column blocks; 3 rows per range
    # across segment boundaries and padding rows.
    (((80, 5, 0, 49, 24), 13, 24, 2, 3, 4), (8, 16, 1, 3)),
    # ratio 17, coff 1: 8-slot chunks, the third one 1 slot + 7 pad; 2 column blocks (d = 9); 2 rows per range.
    (((52, 10, 0, 40), 9, 17, 1, 2, 3), (8, 8, 1, 2)),
    # Powers of two, head_dim a multiple of block_d (no column mask): 4 chunks x 2 column blocks, 4 rows per range.
    (((64, 31, 32), 16, 32, 2, 1, 5), (8, 16, 1, 4)),
]


def _stream_id(item):
    (seqlens, d, r, c, _tp, _cp), (bd, slots, _w, rows) = item
    return f"r{r}c{c}d{d}B{len(seqlens)}-d{bd}s{slots}x{rows}"


@pytest.fixture
def nan_workspace(monkeypatch):
    """dAPE partials start as NaN: an entry the kernel leaves unwritten poisons grad_ape."""

    def workspace(shape, device):
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)

    monkeypatch.setattr(plans, "_workspace", workspace)


def _stream_pack(case):
    seqlens, head_dim, ratio, coff, tok_pad, comp_pad = case
    pack = _pack(seqlens, head_dim, ratio, coff, tok_pad, comp_pad, seed=len(seqlens) + ratio + head_dim)
    # Padding rows are never read: NaN canaries in their grad_out (the reference ignores them).
    pack.grad_out[pack.true_comp :] = float("nan")
    return pack


def _tiled(pack, tile, stats):
    """The backward with statistics, in ``tile``."""
    return _backward(pack, stats, tile=launch.StatsTile(*tile))


def _programs(pack, tile):
    """(row ranges, slot chunks, column blocks) of a tile on a pack."""
    block_d, slots, _w, rows = tile
    n_rows = pack.total_comp
    return -(-n_rows // rows), -(-(pack.coff * pack.ratio) // slots), -(-pack.head_dim // block_d)


@pytest.mark.parametrize("item", STREAM_CASES, ids=[_stream_id(i) for i in STREAM_CASES])
def test_streaming_tiles_meet_the_contract(item, nan_workspace):
    """Several row ranges, slot chunks and column blocks: the contract, NaN canaries, and dKV/dScore bitwise the
    default tile's (a tile only moves work between programs)."""
    case, tile = item
    pack = _stream_pack(case)
    parts, chunks, col_blocks = _programs(pack, tile)
    assert parts > 1 and col_blocks > 1 and (chunks > 1 or tile[1] >= pack.coff * pack.ratio)
    _, stats = _forward(pack)
    stats[pack.true_comp :] = float("nan")
    grads = _tiled(pack, tile, stats)
    _assert_contract(pack, grads)
    default = _backward(pack, stats)
    _assert_contract(pack, default)
    assert _same(grads[:2], default[:2])
    torch.testing.assert_close(grads[2], default[2], rtol=1e-5, atol=1e-6)
    # The statistics are read per (row, column): a wrong output in one real row's column changes dScore.
    if pack.true_comp:
        moved = stats.clone()
        moved[pack.true_comp - 1, 2, pack.head_dim - 1] += 1.0
        other = _tiled(pack, tile, moved)
        assert _same(other[:1], grads[:1]) and not _same(other[1:2], grads[1:2])


def test_streaming_tile_reference_stats_and_empty_ranges(nan_workspace):
    """More padding rows than a range holds (their partials: zeros); every row padding; one row per range."""
    for case, rows in [(((50, 7, 0, 33), 10, 16, 2, 2, 7), 5), (((5, 0, 3), 8, 16, 2, 12, 2), 1)]:
        pack = _stream_pack(case)
        stats = _ref_stats(pack)
        stats[pack.true_comp :] = float("nan")
        _assert_contract(pack, _tiled(pack, (8, 8, 1, rows), stats))


def test_default_stats_tiles():
    """GPU defaults (tile constexprs never depend on the problem size; rows per program do)."""
    # About one wave (528 programs) of 2-32 rows each: the H200 sweep's best of the tried row counts.
    cases = [((1, 65536), 512, 128, 2, 1024, 32), ((3, 8192), 512, 128, 1, 512, 12), ((1, 8192), 128, 128, 1, 256, 2)]
    for (n, seqlen), d, ratio, coff, min_programs, want_rows in cases:
        tile = launch.stats_tile(ratio, coff, d, interpret=False)
        assert tile == launch.StatsTile(64, 32, 4, 0)
        n_rows = n * seqlen // ratio
        rows = config.stats_rows(tile, ratio, coff, d, n_rows)
        parts = -(-n_rows // rows)
        programs = parts * -(-(coff * ratio) // tile.slots) * -(-d // tile.block_d)
        assert programs >= min_programs, (n, seqlen, d, ratio, coff, rows, programs)
        assert parts * ratio * coff * d * 4 <= 20 << 20
        assert rows == want_rows
    # A 128K pack: the workspace bound sets the rows.
    tile = launch.stats_tile(128, 2, 512, interpret=False)
    rows = config.stats_rows(tile, 128, 2, 512, 1024)
    assert rows > 16 and -(-1024 // rows) * 128 * 1024 * 4 <= 20 << 20
    # Small head_dim / windows: tiles shrink to the problem; an explicit row count is kept.
    assert launch.stats_tile(9, 2, 24, interpret=False) == launch.StatsTile(32, 32, 4, 0)
    assert config.stats_rows(launch.StatsTile(128, 16, 8, 3), 128, 2, 512, 10**6) == 3


def test_run_to_run_bitwise_determinism_with_stats():
    pack = _pack((37, 0, 70, 9), 12, 16, 2, 3, 2, seed=11)
    out1, stats1 = _forward(pack)
    out2, stats2 = _forward(pack)
    assert _same((out1, stats1), (out2, stats2))
    assert _same(_backward(pack, stats1), _backward(pack, stats1))


def test_stats_rejected_for_short_windows():
    pack = _pack((24, 13), 8, 4, 2, 2, 1)
    out = torch.empty((pack.total_comp, 8), dtype=torch.bfloat16, device=DEVICE)
    stats = torch.empty((pack.total_comp, 3, 8), dtype=torch.float32, device=DEVICE)
    grads = _nan_like(pack.kv), _nan_like(pack.score), _nan_like(pack.ape)
    cfg = launch.choose_config("forward", 4, 2, 8, not HAS_CUDA)
    with pytest.raises(ValueError, match="long windows"):
        launch.forward(*pack.inputs, out, 4, 2, None, stats)
    with pytest.raises(ValueError, match="long windows"):
        launch.launch_forward(*pack.inputs, out, 4, 2, cfg, stats)
    with pytest.raises(ValueError, match="long windows"):
        launch.backward(*pack.inputs, pack.grad_out, *grads, 4, 2, None, stats)
    with pytest.raises(ValueError, match="long windows"):
        launch.launch_backward(*pack.inputs, pack.grad_out, *grads, 4, 2, cfg, stats)
    # Nothing was launched.
    assert all(bool(torch.isnan(g).all()) for g in grads)


def test_supports_stats_is_the_long_window_split():
    for coff in (1, 2):
        for ratio in range(1, launch.MAX_RATIO + 1):
            want = config.is_long(ratio, coff)
            assert launch.supports_stats(ratio, coff, 64) is want
            assert reference.uses_softmax_stats(ratio, coff) is want


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_with_stats_after_compile():
    # compile() builds the stats variants too: nothing may compile under capture.
    ratio, coff, d = 16, 2, 128
    pack = _pack((640, 37, 0, 397), d, ratio, coff, 4, 3, seed=9)
    for direction in ("forward", "backward"):
        launch.compile(direction, ratio, coff, d, torch.bfloat16, DEVICE)
    out = torch.empty((pack.total_comp, d), dtype=torch.bfloat16, device=DEVICE)
    stats = torch.empty((pack.total_comp, 3, d), dtype=torch.float32, device=DEVICE)
    grads = torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launch.forward(*pack.inputs, out, ratio, coff, None, stats)
        launch.backward(*pack.inputs, pack.grad_out, *grads, ratio, coff, None, stats)
    for t in (out, stats, *grads):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _assert_stats_match(pack, stats)
    _assert_contract(pack, grads)
