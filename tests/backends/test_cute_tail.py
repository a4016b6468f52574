"""The cute backend's fused tail (RMSNorm, RoPE), composed route and plumbing. CPU: routes, geometry, placeholders,
offline compiles (sm_90a, sm_100a), recorded launches. GPU: ``tail.check_backend`` over every route and entry point.
"""

from __future__ import annotations

import dataclasses
import tempfile
from types import SimpleNamespace

import pytest
import torch

from .common import BF16, ENTRY, F32, ROOT, child_env, cubin_resources, cute_launch

launch = cute_launch()

from csa_compressor import tail as T  # noqa: E402
from csa_compressor.backends.cute import build, configs, select, tail_configs, tail_launch  # noqa: E402
from csa_compressor.backends.cute.backward_stats import BackwardWithStats  # noqa: E402
from csa_compressor.backends.cute.device import offline_spec  # noqa: E402
from csa_compressor.backends.cute.forward import ForwardLongWindow  # noqa: E402
from csa_compressor.backends.cute.tail_kernels import TailForward, TailGradient  # noqa: E402
from csa_compressor.tail import TailConfig  # noqa: E402
from csa_compressor.testing import bitwise_equal, make_pack  # noqa: E402
from csa_compressor.windows import window_slots  # noqa: E402

from ..test_tail import CASES, _on_cuda, _to_cuda, case_pack_and_tail  # noqa: E402
from .test_cute_launch import _ptrs, _Recorder  # noqa: E402

H200 = offline_spec("sm_90a")
SPEC_FULL = configs.TailSpec(True, True, 64, True, True)


# ---------------------------------------------------------------- configuration (pure Python)


def test_tail_spec_of_a_tail_config():
    assert configs.TailSpec.of(TailConfig(F32, 64, False, True)) == configs.TailSpec(True, True, 64, False, True)
    assert configs.TailSpec.of(TailConfig(BF16, 0, True, False)) == configs.TailSpec(True, False, 0, True, False)
    # Without a rotation the pair convention and the positions change nothing: one spec (one kernel).
    assert configs.TailSpec.of(TailConfig(F32, 0, False, False)) == configs.TailSpec.of(TailConfig(F32, 0, True, False))
    assert configs.TailSpec.of(TailConfig(None, 8, True, True)) == configs.TailSpec(False, False, 8, True, True)


def test_supports_tail():
    assert launch.supports_tail(4, 2, 512, TailConfig(F32, 64, True, True))
    assert launch.supports_tail(128, 2, 7, TailConfig(BF16, 6, False, False))
    assert launch.supports_tail(3, 1, launch.MAX_TAIL_HEAD_DIM, TailConfig(None, 2, True, False))
    assert not launch.supports_tail(4, 2, launch.MAX_TAIL_HEAD_DIM + 1, TailConfig(F32, 0, True, False))
    assert not launch.supports_tail(4, 2, 64, TailConfig(torch.float16, 0, True, False))
    assert not launch.supports_tail(4, 2, 64, TailConfig(F32, 66, True, False))
    assert not launch.supports_tail(4, 2, 64, TailConfig(F32, 3, True, False))


WINDOWS = [(1, 1), (2, 1), (4, 2), (3, 2), (5, 1), (8, 1), (8, 2), (16, 1), (17, 1), (32, 2), (128, 1), (128, 2)]


@pytest.mark.parametrize("ratio,coff", WINDOWS)
def test_every_window_class_has_the_composed_route(ratio, coff):
    """Where the fused hook has a configuration the route is that kernel alone; every window has the composed route
    (stats forward + TailForward; backward: stats forward, TailGradient, stats backward on fp32 dx)."""
    for head_dim in (7, 64, 130, 512, 2048):
        for direction in ("forward", "backward"):
            fused = select.fused_tail_config(direction, ratio, coff, head_dim, H200, SPEC_FULL)
            route = select.tail_route(direction, ratio, coff, head_dim, H200, SPEC_FULL)
            if fused is None:
                assert "fused" not in route
                continue
            expected = {"fused": (select.KERNEL_OF_CONFIG[type(fused)], fused)}
            if isinstance(fused, configs.BackwardStatsConfig):
                # The statistics backward with the tail: statistics computed first where a call saved none.
                stats = tail_configs.stats_forward_for_sm90(ratio, coff, head_dim, H200)
                expected["stats"] = (ForwardLongWindow, stats)
                assert fused == tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPEC_FULL)
            assert route == expected and fused.tail == SPEC_FULL
        fwd = select.tail_route("forward", ratio, coff, head_dim, H200, SPEC_FULL, fuse=False)
        bwd = select.tail_route("backward", ratio, coff, head_dim, H200, SPEC_FULL, fuse=False)
        assert set(fwd) == {"stats", "tail"} and set(bwd) == {"stats", "tail", "pool"}
        for route in (fwd, bwd):
            stats_class, stats = route["stats"]
            assert stats_class is ForwardLongWindow and stats.write_stats
            assert stats.slot_groups * stats.slots_per_batch * stats.batches == window_slots(ratio, coff)
            assert stats.columns_per_cta * stats.column_chunks >= head_dim
        assert fwd["tail"][0] is TailForward and bwd["tail"][0] is TailGradient
        pool_class, pool = bwd["pool"]
        # The statistics backward reads fp32 dx; TailGradient reduces the weight's slabs itself unless the whole-tile
        # form sums them in CTAs past its tiles; without a norm there are no slabs.
        plain = configs.stats_backward_for_sm90(ratio, coff, head_dim, H200)
        summed = plain.whole_tile and plain.threads >= configs.REDUCE_WARPS * 32 and coff == 1
        expected = dataclasses.replace(plain, grad_float32=True, norm_slabs=summed)
        assert (pool_class, pool) == (BackwardWithStats, expected)
        assert bwd["tail"][1].norm_summed_after == summed and pool.slab_entries == pool.ape_size
        rope_only = select.tail_route("backward", ratio, coff, head_dim, H200, SPECS["rope-only-half-pos"], False)
        assert rope_only["pool"][1] == dataclasses.replace(expected, norm_slabs=False)
        assert not rope_only["tail"][1].norm_summed_after
        for _, cfg in (fwd["tail"], bwd["tail"]):
            assert (cfg.source_stride, cfg.source_offset, cfg.tail) == (3 * head_dim, 2 * head_dim, SPEC_FULL)
            assert cfg.row_threads * cfg.column_steps * cfg.vector_width >= head_dim
            assert head_dim % cfg.vector_width == 0 and cfg.threads % 32 == 0 and cfg.threads <= 256
            assert cfg.column_steps * cfg.vector_width <= 16  # a row's operands stay in registers
    with pytest.raises(ValueError, match="direction"):
        select.tail_route("forward_stats", ratio, coff, 64, H200, SPEC_FULL)


def test_stats_forward_of_short_windows_is_one_group():
    cfg = tail_configs.stats_forward_for_sm90(4, 2, 512, H200)
    assert (cfg.slot_groups, cfg.slots_per_batch, cfg.batches, cfg.write_stats) == (1, 8, 1, True)
    # The pooling's own statistics forward, which lets TailForward start behind it.
    signals = dict(signals_dependents=True)
    long = tail_configs.stats_forward_for_sm90(32, 2, 64, H200)
    assert long == dataclasses.replace(configs.forward_for_sm90(32, 2, 64, H200, stats=True), **signals)
    grouped = tail_configs.stats_forward_for_sm90(3, 2, 36, H200)
    assert grouped == dataclasses.replace(configs.forward_for_sm90(3, 2, 36, H200), write_stats=True, **signals)
    assert not configs.forward_for_sm90(32, 2, 64, H200, stats=True).signals_dependents


def test_slab_entries_of_every_backward_config():
    for ratio, coff in WINDOWS:
        for cfg in (
            configs.backward_for_sm90(ratio, coff, 64, H200),
            configs.stats_backward_for_sm90(ratio, coff, 64, H200),
        ):
            assert cfg.slab_entries == cfg.ape_size
    gradient = tail_configs.tail_rows(tail_configs.TailGradientConfig, 4, 130, SPEC_FULL, 390, 260)
    assert gradient.slab_entries == 130 and gradient.reduce.ape_size == 130


def test_placeholders_carry_the_tail_block():
    """The tail's block after a kind's own arguments, before the stream; the weight's pointer in its dtype."""
    from cutlass import BFloat16, Float32, Int32

    plain = SimpleNamespace(kind="forward", config=configs.forward_for_sm90(4, 2, 64, H200))
    fused = SimpleNamespace(kind="forward", config=SimpleNamespace(tail=SPEC_FULL))
    assert len(build.placeholder_arguments(plain)) == 11
    args = build.placeholder_arguments(fused)
    assert len(args) == 11 + 7 and isinstance(args[-3], Float32) and args[10].dtype is Float32
    bf16_weight = SimpleNamespace(
        kind="backward", config=SimpleNamespace(tail=dataclasses.replace(SPEC_FULL, norm_weight_float32=False))
    )
    args = build.placeholder_arguments(bf16_weight)
    assert len(args) == 17 + 8 and args[16].dtype is BFloat16
    pool = SimpleNamespace(kind="backward", config=configs.stats_backward_for_sm90(8, 2, 64, H200))
    assert build.placeholder_arguments(pool)[5].dtype is BFloat16
    pool.config = dataclasses.replace(pool.config, grad_float32=True)
    assert build.placeholder_arguments(pool)[5].dtype is Float32
    # The statistics backward with the tail: the backward's arguments, then the gradient's tail block.
    fused = SimpleNamespace(kind="backward", config=tail_configs.stats_backward_with_tail(128, 1, 128, H200, SPEC_FULL))
    args = build.placeholder_arguments(fused)
    assert len(args) == 17 + 8 and args[5].dtype is BFloat16 and isinstance(args[-2], Int32)


def test_statistics_backward_with_the_tail_reduces_the_weight_in_its_slabs():
    """The fused statistics backward (slab form): each CTA's slab ends with the norm weight's partials, summed by its
    reduction as the fused short backward's are. Both tiles keep the pooling's threads: rows within a warp take one
    column chunk at half its slots per group (the terms by shuffles in each row step), wider rows the pooling's
    tiles (the terms in blocks of rows)."""
    for ratio, coff, head_dim in ((128, 1, 128), (128, 2, 128), (16, 2, 65), (32, 1, 64)):
        plain = configs.stats_backward_for_sm90(ratio, coff, head_dim, H200)
        fused = tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPEC_FULL)
        assert not plain.whole_tile and fused.tail == SPEC_FULL
        assert fused.terms_in_warp == (head_dim != 65)
        assert (fused.threads, fused.whole_tile) == (plain.threads, False)
        assert fused.slab_entries == fused.ape_size + head_dim
        assert fused.reduce == configs.ApeReduceConfig(fused.ape_size, 1, head_dim)
        if fused.terms_in_warp:
            half_slots = max(1, plain.slots_per_group // 2)
            assert (fused.column_chunks, fused.row_lanes, fused.slots_per_group) == (1, 1, half_slots)
            assert fused.column_threads <= 32
        else:
            assert fused.tiles == plain.tiles
            assert fused.term_rows % fused.row_lanes == 0 and fused.term_rows >= configs.STATS_TAIL_TERM_ROWS
        rope_only = tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPECS["rope-only-half-pos"])
        assert rope_only.slab_entries == rope_only.ape_size and rope_only.reduce.norm_entries == 0
    # Whole tiles: every CTA would read all rows for their terms; the composed route serves them.
    whole = configs.stats_backward_for_sm90(128, 1, 512, H200)
    assert whole.whole_tile and tail_configs.stats_backward_with_tail(128, 1, 512, H200, SPEC_FULL) is None
    with pytest.raises(ValueError, match="slab form"):
        BackwardWithStats(dataclasses.replace(whole, tail=SPEC_FULL))


def test_a_gpu_case_has_lanes_past_head_dim_in_its_warp_terms():
    """The GPU contract's r32c2d100 case gives the fused statistics backward rows within a warp whose last lanes
    hold no column, so that those lanes' part in the row's shuffles is checked there."""
    ratio, coff, head_dim = OWN_CASES["r32c2d100-rope64-pos-lanes"][:3]
    config = tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPEC_FULL)
    assert config.terms_in_warp and not config.columns_exact


def test_a_gpu_case_spans_several_blocks_of_terms():
    """The GPU contract's r16c2d65 case gives the fused statistics backward (rows of two warps: terms in blocks)
    row ranges longer than its block of row terms on an H100 / H200 (132 SMs), so that the terms are recomputed
    mid-range there."""
    ratio, coff, head_dim, seqlens = OWN_CASES["r16c2d65-rope64-pos-blocks"][:4]
    config = tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPEC_FULL)
    assert not config.terms_in_warp
    grid = SimpleNamespace(row_lanes=config.row_lanes, tiles=config.tiles, capacity=launch.grid_capacity(config, H200))
    rows_per_cta, _ = launch.backward_grid(grid, sum(s // ratio for s in seqlens), config.slab_entries)
    assert config.term_rows < rows_per_cta < 2 * config.term_rows


# (ratio, coff, head_dim): rows of a few threads, several row lanes to a warp (the rows' terms in blocks).
ROW_LANE_SHAPES = [(16, 2, 8), (16, 1, 8), (8, 2, 16), (3, 1, 32), (16, 2, 4)]


def test_rows_by_shuffles_never_share_a_warp_with_another_row_lane():
    """The fused statistics backward forms a row's norm terms by shuffles in each row step only where each warp
    holds one row lane: row lanes run different row counts, and the lanes of one with no row left would never join
    the shuffles of one with a row, and the kernel would hang. Narrower rows take the terms in blocks."""
    for ratio in (3, 5, 8, 16, 32, 100, 128):
        for coff in (1, 2):
            for head_dim in (1, 2, 4, 8, 16, 32, 64, 65, 100, 128, 130):
                config = tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPECS["norm-only"])
                if config is None or not config.terms_in_warp:
                    continue
                lane_threads = config.column_threads * config.slot_groups
                assert config.row_lanes == 1 or lane_threads % 32 == 0, (ratio, coff, head_dim, config)
    for ratio, coff, head_dim in ROW_LANE_SHAPES:
        config = tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, SPECS["norm-only"])
        assert config.row_lanes > 1 and config.column_threads * config.slot_groups < 32
        assert not config.terms_in_warp and config.term_rows % config.row_lanes == 0


# ---------------------------------------------------------------- offline compile (sm_90a and sm_100a)

SPECS = {
    "norm-rope64-pos": SPEC_FULL,
    "bf16w-rope2-half": configs.TailSpec(True, False, 2, False, False),
    "rope-only-half-pos": configs.TailSpec(False, False, 64, False, True),
    "norm-only": configs.TailSpec(True, True, 0, True, False),
}
# (name, kernel class, ratio, head_dim, spec): one row of 128 threads, 2-thread rows, rows of four warps.
TAIL_BUILDS = [
    ("forward d512", TailForward, 4, 512, "norm-rope64-pos"),
    ("forward d7", TailForward, 128, 7, "bf16w-rope2-half"),
    ("forward d2048", TailForward, 2, 2048, "rope-only-half-pos"),
    ("gradient d512", TailGradient, 4, 512, "norm-rope64-pos"),
    ("gradient d7", TailGradient, 128, 7, "bf16w-rope2-half"),
    ("gradient d2048", TailGradient, 2, 2048, "norm-only"),
    ("gradient d130 rope-only", TailGradient, 4, 130, "rope-only-half-pos"),
]
# (name, kernel class, configuration factory): the statistics forward of short windows, dx-reading backwards.
POOL_BUILDS = [
    ("stats forward r4c2", ForwardLongWindow, lambda: tail_configs.stats_forward_for_sm90(4, 2, 128, H200)),
    ("stats forward r2c1", ForwardLongWindow, lambda: tail_configs.stats_forward_for_sm90(2, 1, 65, H200)),
    ("stats forward r3c2", ForwardLongWindow, lambda: tail_configs.stats_forward_for_sm90(3, 2, 36, H200)),
    ("dx backward r4c2", BackwardWithStats,
     lambda: dataclasses.replace(configs.stats_backward_for_sm90(4, 2, 64, H200), grad_float32=True)),
    ("bf16 backward r4c2", BackwardWithStats, lambda: configs.stats_backward_for_sm90(4, 2, 64, H200)),
    ("dx backward whole tile", BackwardWithStats,
     lambda: dataclasses.replace(configs.stats_backward_for_sm90(128, 1, 512, H200), grad_float32=True)),
]  # fmt: skip


# (name, ratio, coff, head_dim): composed backwards with a norm, slab form and whole-tile form.
ROUTE_BUILDS = [
    ("slab r128c1d128", 128, 1, 128),
    ("whole tile r128c1d512", 128, 1, 512),
    ("whole tile r128c2d512", 128, 2, 512),
]
# (name, ratio, coff, head_dim, spec): the statistics backward with the tail fused.
FUSED_BUILDS = [("fused stats backward r128c1d128", 128, 1, 128, "norm-rope64-pos"),
                ("fused stats backward r16c2d130 half", 16, 2, 130, "rope-only-half-pos"),
                ("fused stats backward r16c2d8 row lanes", 16, 2, 8, "norm-only")]  # fmt: skip


def _entries(ptx: str) -> list[str]:
    """Parameter kinds of every kernel entry: 'p' a 64-bit pointer, 'i' a 32-bit int, 'f' an fp32."""
    kinds = {".u64": "p", ".b64": "p", ".u32": "i", ".s32": "i", ".b32": "i", ".f32": "f"}
    return sorted(
        "".join(kinds[p.split()[1]] for p in params.split(",") if p.strip()) for _, params in ENTRY.findall(ptx)
    )


def _wide_loads(ptx: str) -> int:
    """16-byte global loads (sm_100a's PTX writes some as two 64-bit words)."""
    return ptx.count("ld.global.v4.b32") + ptx.count("ld.global.v2.b64")


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a"])
def built(request):
    arch = request.param
    result = {}
    with tempfile.TemporaryDirectory() as dump:
        for name, kernel_class, ratio, head_dim, spec in TAIL_BUILDS:
            kind = tail_configs.TailForwardConfig if kernel_class is TailForward else tail_configs.TailGradientConfig
            cfg = tail_configs.tail_rows(kind, ratio, head_dim, SPECS[spec], 3 * head_dim, 2 * head_dim)
            kernel = kernel_class(cfg)
            result[name] = (kernel, build.compile_kernel(kernel, arch, dump_dir=dump).artifacts.PTX)
        for name, kernel_class, factory in POOL_BUILDS:
            kernel = kernel_class(factory())
            result[name] = (kernel, build.compile_kernel(kernel, arch, dump_dir=dump).artifacts.PTX)
        for name, ratio, coff, head_dim in ROUTE_BUILDS:
            route = select.tail_route("backward", ratio, coff, head_dim, offline_spec(arch), SPEC_FULL, fuse=False)
            for step in ("tail", "pool"):
                kernel_class, cfg = route[step]
                kernel = kernel_class(cfg)
                artifacts = build.compile_kernel(kernel, arch, dump_dir=dump).artifacts
                result[f"{name} {step}"] = (kernel, artifacts.PTX, cubin_resources(artifacts.CUBIN))
        for name, ratio, coff, head_dim, spec in FUSED_BUILDS:
            fused = BackwardWithStats(tail_configs.stats_backward_with_tail(ratio, coff, head_dim, offline_spec(arch),
                                                                            SPECS[spec]))  # fmt: skip
            artifacts = build.compile_kernel(fused, arch, dump_dir=dump).artifacts
            result[name] = (fused, artifacts.PTX, cubin_resources(artifacts.CUBIN))
    return arch, result


@pytest.mark.parametrize("name", [b[0] for b in TAIL_BUILDS])
def test_tail_kernels_compile(built, name):
    arch, kernels = built
    kernel, ptx = kernels[name]
    cfg = kernel.config
    assert f".target {arch}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    if isinstance(kernel, TailForward):
        # x, cu_seqlens, cu_seqlens_comp, out; B, N, T; weight, cos, sin, position_start, rstd; eps; max_position.
        assert _entries(ptx) == ["ppppiiipppppfi"]
        # A programmatic dependent of the statistics forward: it waits once, before any of its stores.
        assert ptx.count("griddepcontrol.wait;") == 1
        assert ptx.index("griddepcontrol.wait;") < ptx.index("st.global")
    else:
        main = "ppppppiiiipppppfi"  # ... dx, slabs; B, N, T, rows_per_cta; the tail's pointers; eps, max_position
        assert _entries(ptx) == sorted([main, "ppi"] if cfg.tail.has_norm else [main])
    if cfg.tail.has_norm:
        # Correctly rounded rstd steps; the row's sums over its threads by butterfly shuffles.
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
        assert ("shfl.sync.bfly" in ptx) == (cfg.row_threads > 1)
    if cfg.row_warps > 1 or (cfg.tail.rope_dim and isinstance(kernel, TailForward)):
        assert "bar.sync" in ptx  # the row's warps combine, or the row is staged for the rotation
    assert f".reqntid {cfg.threads}, 1, 1" in ptx or f".maxntid {cfg.threads}, 1, 1" in ptx


@pytest.mark.parametrize("name", [b[0] for b in POOL_BUILDS])
def test_pool_kernels_of_the_tail_compile(built, name):
    arch, kernels = built
    kernel, ptx = kernels[name]
    cfg = kernel.config
    assert f".target {arch}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    if isinstance(kernel, ForwardLongWindow):
        assert _entries(ptx) == ["pppppppiii"]  # the kernel with statistics
        assert ptx.count("griddepcontrol.launch_dependents;") == 1  # TailForward's prologue may start
    else:
        main = "ppppppppppiiii"
        assert _entries(ptx) == sorted([main] if cfg.whole_tile else [main, "ppi"])
    if name == "dx backward r4c2":
        # dx is read as 16-byte vectors of 4 fp32 where grad_out was 8-byte vectors of 4 bf16.
        bf16 = kernels["bf16 backward r4c2"][1]
        assert cfg.vector_width == 4 and _wide_loads(ptx) > _wide_loads(bf16)
        assert ptx.count("ld.global.v2.b32") < bf16.count("ld.global.v2.b32")


@pytest.mark.parametrize("name", [b[0] for b in ROUTE_BUILDS])
def test_composed_backward_routes_compile(built, name):
    """Slab form: TailGradient reduces the weight's slabs itself and the statistics backward grad_ape's. Whole-tile
    form at one slot half: one kernel after TailGradient, whose CTAs past the tiles sum the weight's slabs (its
    parameters: the pooling's pointers, the weight's slabs and gradient, the four scalars and the slabs' count), and
    which spills nothing; at two halves TailGradient reduces them (the summing branch would spill there)."""
    arch, kernels = built
    (tail, tail_ptx, _), (pool, pool_ptx, resources) = kernels[f"{name} tail"], kernels[f"{name} pool"]
    gradient, main = "ppppppiiiipppppfi", "ppppppppppiiii"
    for ptx in (tail_ptx, pool_ptx):
        assert f".target {arch}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert isinstance(pool, BackwardWithStats) and pool.config.grad_float32
    whole = pool.config.whole_tile
    summed = whole and pool.config.coff == 1
    assert pool.config.norm_slabs == summed and tail.config.norm_summed_after == summed
    assert _entries(tail_ptx) == ([gradient] if summed else sorted([gradient, "ppi"]))
    assert _entries(pool_ptx) == (["ppppppppppppiiiii"] if summed else [main] if whole else sorted([main, "ppi"]))
    if summed:
        grid = f".reqntid {pool.config.threads}, 1, 1"
        assert grid in pool_ptx or f".maxntid {pool.config.threads}, 1, 1" in pool_ptx
        assert resources["frame"] == 0, resources


@pytest.mark.parametrize("name", [b[0] for b in FUSED_BUILDS])
def test_fused_statistics_backward_compiles(built, name):
    """The statistics backward with the tail: no local memory, the backward's parameters then the tail block
    (grad_norm_weight among them), its slab reduction (with a norm: into grad_ape and grad_norm_weight)."""
    arch, kernels = built
    kernel, ptx, resources = kernels[name]
    cfg = kernel.config
    assert f".target {arch}" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert resources["frame"] == 0, resources  # no spills at the launch bound (the half-slot groups' registers)
    main = "ppppppppppiiii" + "ppppp" + "fi"  # the tail's pointers but grad_norm_weight, which the reduction writes
    reduce = "pppi" if cfg.has_norm else "ppi"
    assert _entries(ptx) == sorted([main, reduce])
    if cfg.has_norm:
        # The rows' terms: correctly rounded rstd, sums over a warp's lanes by butterfly shuffles, one barrier
        # after them and one before the next block's.
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "shfl.sync.bfly" in ptx
        assert "bar.sync" in ptx


def test_loaded_tail_functions_take_pointers_ints_floats_and_the_stream(tmp_path, monkeypatch):
    """Through the disk cache's export and load: parameters in build.py's order, norm_eps a Python float."""
    monkeypatch.setenv("CSA_COMPRESSOR_CACHE_DIR", str(tmp_path))
    cfg = tail_configs.tail_rows(tail_configs.TailForwardConfig, 4, 64, SPEC_FULL, 192, 128)
    function = launch.host_function(TailForward, cfg, "sm_90a")
    with pytest.raises(TypeError) as info:
        function()
    tail_params = "norm_weight rope_cos rope_sin position_start rstd".split()
    pointers = ", ".join(f"{p}: DataPointer" for p in ["x", "cu_seqlens", "cu_seqlens_comp", "out"])
    sizes = "segments: int32, total_comp: int32, tokens: int32"
    block = ", ".join(f"{p}: DataPointer" for p in tail_params) + ", norm_eps: float32, max_position: int32"
    assert f"__call__({pointers}, {sizes}, {block}, stream: Stream)" in str(info.value)
    with pytest.raises(TypeError, match="expected float"):
        function(0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, "1e-6", 1, 0)


# ---------------------------------------------------------------- the launch path, recorded (CPU tensors)


@pytest.fixture
def host_path(monkeypatch):
    """Recording host functions in place of the kernels; device and stream stubbed (no CUDA here)."""
    monkeypatch.setattr(launch, "_GET_DEVICE", lambda: None)
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda index: 0x5EED)
    monkeypatch.setattr(launch, "_IS_CAPTURING", lambda: False)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    monkeypatch.setattr(launch, "_SCRATCH", {})
    monkeypatch.setattr(tail_launch, "_ROUTES", {})
    return tail_launch._ROUTES


def _forward_launcher(config=None):
    fake = launch.ForwardLauncher.__new__(launch.ForwardLauncher)
    fake.config, fake.function, fake.wide, fake.wide_rows = config, _Recorder(), None, 1 << 62
    return fake


def _backward_launcher(config, capacity=16):
    fake = launch.BackwardLauncher.__new__(launch.BackwardLauncher)
    fake.config, fake.function, fake.tiles, fake.capacity = config, _Recorder(), 1, capacity
    fake.row_lanes = getattr(config, "row_lanes", 2)
    return fake


def _composed(host_path, direction, pack, spec, fuse=True):
    """A composed route of recording launchers."""
    route = tail_launch.TailRoute.__new__(tail_launch.TailRoute)
    route.fused = None
    route.stats = _forward_launcher()
    kind = tail_configs.TailForwardConfig if direction == "forward" else tail_configs.TailGradientConfig
    tail_cfg = tail_configs.tail_rows(kind, pack.ratio, pack.head_dim, spec, 3 * pack.head_dim, 2 * pack.head_dim)
    pool_cfg = SimpleNamespace(whole_tile=False, norm_slabs=False, slab_entries=pack.ape.numel())
    route.tail = _forward_launcher(tail_cfg) if direction == "forward" else _backward_launcher(tail_cfg)
    route.pool = _backward_launcher(pool_cfg, 8)
    host_path[(direction, pack.ratio, pack.coff, pack.head_dim, pack.kv.dtype, None, spec, fuse)] = route
    return route


def _block(tail, rstd, grad_w=None, gradient=False):
    pointers = (tail.norm_weight, tail.rope_cos, tail.rope_sin, tail.position_start, rstd)
    pointers += (grad_w,) if gradient else ()
    return (*(0 if t is None else t.data_ptr() for t in pointers), float(tail.norm_eps), tail.rope_cos.shape[0])


def _pack_and_tail(seed=3):
    pack = make_pack((300, 9, 130), 64, 4, 2, token_padding=3, comp_padding=2, seed=seed)
    return pack, T.random_tail(pack, rope_dim=16, positions=True, seed=seed)


def test_composed_forward_calls(host_path):
    pack, tail = _pack_and_tail()
    route = _composed(host_path, "forward", pack, tail_launch.spec_of(tail))
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    out, rstd = torch.empty((n, d), dtype=kv.dtype), torch.empty(n)
    sizes = (cu.shape[0] - 1, n, kv.shape[0])
    for stats in (None, torch.empty((n, 3, d))):
        route.stats.function.calls.clear()
        route.tail.function.calls.clear()
        launch.forward(kv, score, ape, cu, cuc, out, 4, 2, None, stats, tail, rstd)
        (first,) = route.stats.function.calls
        # The statistics forward writes out and the statistics (a workspace when none are given).
        assert first[:6] == _ptrs(kv, score, ape, cu, cuc, out) and first[7:] == (*sizes, 0x5EED)
        assert stats is None or first[6] == stats.data_ptr()
        # TailForward reads them: x, offsets, out, sizes, the tail's block, the stream.
        (second,) = route.tail.function.calls
        assert second == (first[6], *_ptrs(cu, cuc, out), *sizes, *_block(tail, rstd), 0x5EED)


def _composed_backward(host_path, given: bool):
    """One composed backward through the host path."""
    pack, tail = _pack_and_tail()
    route = _composed(host_path, "backward", pack, tail_launch.spec_of(tail))
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    grad_w, rstd = torch.empty(d), torch.empty(n)
    stats = torch.empty((n, 3, d)) if given else None
    launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, 4, 2, None, stats, tail, grad_w, rstd)
    return pack, tail, route, grads, grad_w, rstd, stats, (cu.shape[0] - 1, n, kv.shape[0])


@pytest.mark.parametrize("given", [False, True])
def test_composed_backward_calls(host_path, given):
    pack, tail, route, grads, grad_w, rstd, stats, sizes = _composed_backward(host_path, given)
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    if given:
        assert route.stats.function.calls == [] and stats is not None
        stats_ptr = stats.data_ptr()
    else:
        (recompute,) = route.stats.function.calls  # the statistics recomputed into a workspace
        assert recompute[:5] == _ptrs(kv, score, ape, cu, cuc) and recompute[7:] == (*sizes, 0x5EED)
        stats_ptr = recompute[6]
    (gradient,) = route.tail.function.calls
    rows_per_cta, num_ctas = launch.backward_grid(route.tail, n, d)
    assert gradient[:2] == (pack.grad_out.data_ptr(), stats_ptr) and gradient[2:4] == _ptrs(cu, cuc)
    assert gradient[6:11] == (*sizes, rows_per_cta, num_ctas) and rows_per_cta % route.tail.row_lanes == 0
    assert gradient[11:] == (*_block(tail, rstd, grad_w, True), 0x5EED) and gradient[5] != 0  # the weight's slabs
    (pool,) = route.pool.function.calls
    # The statistics backward reads dx (the gradient's output) and the same statistics.
    assert pool[:5] == _ptrs(kv, score, ape, cu, cuc) and pool[5] == gradient[4] and pool[6:9] == _ptrs(*grads)
    assert pool[10] == stats_ptr and len(pool) == 17
    with pytest.raises(ValueError, match="grad_norm_weight"):
        launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, 4, 2, None, stats, tail, None, rstd)


def test_composed_backward_with_the_weight_summed_in_the_statistics_backward(host_path):
    """The whole-tile form with ``norm_slabs``: TailGradient writes the weight's slabs and launches no reduction; the
    statistics backward takes them, grad_norm_weight and their count (``build.py``'s ``summing_backward``)."""
    pack, tail = _pack_and_tail()
    route = _composed(host_path, "backward", pack, tail_launch.spec_of(tail))
    route.pool.config = SimpleNamespace(whole_tile=True, norm_slabs=True, slab_entries=pack.ape.numel())
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    grad_w, rstd, stats = torch.empty(d), torch.empty(n), torch.empty((n, 3, d))
    launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, 4, 2, None, stats, tail, grad_w, rstd)
    (gradient,) = route.tail.function.calls
    (pool,) = route.pool.function.calls
    _, num_ctas = launch.backward_grid(route.tail, n, d)
    assert pool[:5] == _ptrs(kv, score, ape, cu, cuc) and pool[5] == gradient[4] and pool[6:9] == _ptrs(*grads)
    assert pool[9] == gradient[5] != 0 and pool[10] == stats.data_ptr() and pool[11] == grad_w.data_ptr()
    rows_per_cta, pool_ctas = launch.backward_grid(route.pool, n, ape.numel())
    sizes = (cu.shape[0] - 1, n, kv.shape[0])
    assert pool[12:] == (*sizes, rows_per_cta, pool_ctas, num_ctas, 0x5EED)


def test_fused_route_call_convention(host_path):
    """Fused host functions: pooling arguments, the tail's block, the stream; given statistics take the composed route."""
    pack, tail = _pack_and_tail()
    spec = tail_launch.spec_of(tail)
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    fused = {}
    for direction in ("forward", "backward"):
        route = tail_launch.TailRoute.__new__(tail_launch.TailRoute)
        route.stats = route.tail = route.pool = None
        slab_entries = ape.numel() + d
        cfg = SimpleNamespace(whole_tile=False, slab_entries=slab_entries)
        route.fused = _forward_launcher() if direction == "forward" else _backward_launcher(cfg)
        host_path[(direction, 4, 2, d, kv.dtype, None, spec, True)] = fused[direction] = route
    out, rstd = torch.empty((n, d), dtype=kv.dtype), torch.empty(n)
    launch.forward(kv, score, ape, cu, cuc, out, 4, 2, None, None, tail, rstd)
    sizes = (cu.shape[0] - 1, n, kv.shape[0])
    assert fused["forward"].fused.function.calls == [
        (*_ptrs(kv, score, ape, cu, cuc, out), 0, *sizes, *_block(tail, rstd), 0x5EED)
    ]
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    grad_w = torch.empty(d)
    launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, 4, 2, None, None, tail, grad_w, rstd)
    (call,) = fused["backward"].fused.function.calls
    launcher = fused["backward"].fused
    rows_per_cta, num_ctas = launch.backward_grid(launcher, n, slab_entries)
    assert call[:9] == _ptrs(kv, score, ape, cu, cuc, pack.grad_out, *grads) and call[10] == 0
    assert call[11:16] == (*sizes, rows_per_cta, num_ctas) and call[16:] == (*_block(tail, rstd, grad_w, True), 0x5EED)
    entry = launch._SCRATCH[(None, 0x5EED)]
    assert call[9] == entry.ptr and entry.numel >= num_ctas * slab_entries
    # Statistics given: the composed route (built without the fused hook).
    composed = _composed(host_path, "forward", pack, spec, fuse=False)
    launch.forward(kv, score, ape, cu, cuc, out, 4, 2, None, torch.empty((n, 3, d)), tail, rstd)
    assert len(composed.tail.function.calls) == 1 and len(fused["forward"].fused.function.calls) == 1


def test_identity_tail_is_the_pooling(host_path):
    pack, _ = _pack_and_tail()
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    plain = _forward_launcher()
    host_path_launchers = launch._LAUNCHERS
    host_path_launchers[("forward", 4, 2, d, kv.dtype, None)] = plain
    out, rstd = torch.empty((n, d), dtype=kv.dtype), torch.full((n,), 7.0)
    launch.forward(kv, score, ape, cu, cuc, out, 4, 2, None, None, T.Tail(norm_eps=0.5, rope_interleaved=False), rstd)
    assert len(plain.function.calls) == 1 and len(plain.function.calls[0]) == 11 and not host_path
    assert torch.equal(rstd, torch.ones(n))


# ---------------------------------------------------------------- bound calls (launch.bind with a tail)


def _tail_of(pack, spec: configs.TailSpec, seed: int = 5):
    """A tail of ``spec`` for ``pack``."""
    dtype = F32 if spec.norm_weight_float32 else BF16
    return T.random_tail(pack, norm=spec.has_norm, norm_dtype=dtype, rope_dim=spec.rope_dim,
                         interleaved=spec.rope_interleaved, positions=spec.has_positions, seed=seed)  # fmt: skip


def _expected_block(tail, rstd, grad_w=None, gradient=False) -> tuple:
    """build.py's tail block, written out: the operands' pointers (0 where absent), eps, the table's positions."""
    rope = tail.rope_cos is not None
    pointers = [tail.norm_weight, tail.rope_cos, tail.rope_sin, tail.position_start, rstd]
    pointers += [grad_w] if gradient else []
    ptrs = (0 if t is None else t.data_ptr() for t in pointers)
    return (*ptrs, float(tail.norm_eps), tail.rope_cos.shape[0] if rope else 0)


@pytest.mark.parametrize("name", list(SPECS))
def test_block_function_holds_the_tail_block(name):
    """The generated block of a spec (and tail_arguments, which calls it) holds build.py's block, rstd and
    grad_norm_weight given or not."""
    pack, _ = _pack_and_tail()
    spec = SPECS[name]
    tail = _tail_of(pack, spec)
    assert tail_launch.spec_of(tail) == spec
    rstd, grad_w = torch.empty(pack.total_comp), torch.empty(pack.head_dim)
    for r in (None, rstd):
        assert tail_launch.block_function(spec)(tail, r) == _expected_block(tail, r)
        assert tail_launch.tail_arguments(tail, r) == _expected_block(tail, r)
        for g in (None, grad_w):
            assert tail_launch.block_function(spec, True)(tail, r, g) == _expected_block(tail, r, g, True)
            assert tail_launch.tail_arguments(tail, r, g, gradient=True) == _expected_block(tail, r, g, True)
    assert tail_launch.block_function(spec) is tail_launch.block_function(spec)  # one per (spec, gradient)


def test_bind_without_a_tail_is_the_module_function():
    shape = (4, 2, 64, BF16, torch.device("cpu"))
    assert launch.bind("forward", *shape) is launch.forward and launch.bind("backward", *shape) is launch.backward
    identity = TailConfig(None, 0, False, True)
    assert launch.bind("forward", *shape, identity) is launch.forward
    assert launch.bind("backward", *shape, identity) is launch.backward
    bound = launch.bind("forward", *shape, TailConfig(F32, 16, True, True))
    assert bound is not launch.forward and bound.__qualname__.startswith("_bound_forward")


def _stats_backward_route(host_path, pack, spec):
    """The fused statistics backward with the tail (its statistics forward to recompute with), recording."""
    route = tail_launch.TailRoute.__new__(tail_launch.TailRoute)
    route.tail = route.pool = None
    route.stats = _forward_launcher()
    config = tail_configs.stats_backward_with_tail(pack.ratio, pack.coff, pack.head_dim, H200, spec)
    route.fused = _backward_launcher(config)
    host_path[("backward", pack.ratio, pack.coff, pack.head_dim, pack.kv.dtype, None, spec, True)] = route
    return route


def _fused_route(host_path, direction, pack, spec):
    route = tail_launch.TailRoute.__new__(tail_launch.TailRoute)
    route.stats = route.tail = route.pool = None
    cfg = SimpleNamespace(whole_tile=False, slab_entries=pack.ape.numel() + pack.head_dim)
    route.fused = _forward_launcher() if direction == "forward" else _backward_launcher(cfg)
    host_path[(direction, pack.ratio, pack.coff, pack.head_dim, pack.kv.dtype, None, spec, True)] = route
    return route


def _recorders(routes):
    steps = ("fused", "stats", "tail", "pool")
    return [s for route in routes for s in (getattr(route, n) for n in steps) if s is not None]


def _normalised(calls, known: set) -> list:
    """The calls with each pointer the call allocated itself (workspaces) named by its first appearance. A pointer is
    an int of at least 2**24: the calls' scalars are far smaller, and host heaps may lie below 2**32."""
    names: dict = {}
    return [tuple(names.setdefault(a, f"ws{len(names)}") if isinstance(a, int) and a >= 1 << 24 and a not in known
                  else a for a in call) for call in calls]  # fmt: skip


# (name, direction, ratio, coff, head_dim, routes to build, stats given)
BOUND_CASES = [
    ("fused forward", "forward", 4, 2, 64, "fused", False),
    ("composed forward, statistics given", "forward", 4, 2, 64, "fused+composed", True),
    ("composed forward", "forward", 4, 2, 64, "composed", False),
    ("fused backward", "backward", 4, 2, 64, "fused", False),
    ("composed backward", "backward", 4, 2, 64, "composed", False),
    ("composed backward, statistics given", "backward", 4, 2, 64, "composed", True),
    ("statistics backward", "backward", 128, 1, 128, "stats", False),
    ("statistics backward, statistics given", "backward", 128, 1, 128, "stats", True),
]


def _bound_case(host_path, case):
    """The case's pack, tail, recording routes and the protocol call's arguments."""
    _, direction, ratio, coff, head_dim, kind, given = case
    pack = make_pack((300, 9, 1030), head_dim, ratio, coff, token_padding=3, comp_padding=2, seed=6)
    tail = T.random_tail(pack, rope_dim=16, positions=True, seed=6)
    spec = tail_launch.spec_of(tail)
    if kind == "stats":
        routes = [_stats_backward_route(host_path, pack, spec)]
    elif kind == "composed":
        routes = [_composed(host_path, direction, pack, spec)]
    else:
        routes = [_fused_route(host_path, direction, pack, spec)]
        routes += [_composed(host_path, direction, pack, spec, fuse=False)] if kind == "fused+composed" else []
    n, d = pack.total_comp, head_dim
    stats = torch.empty((n, 3, d)) if given else None
    rstd = torch.empty(n)
    if direction == "forward":
        args = (*pack.inputs, torch.empty((n, d), dtype=BF16), ratio, coff, None, stats, tail, rstd)
    else:
        grads = (torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape))
        args = (*pack.inputs, pack.grad_out, *grads, ratio, coff, None, stats, tail, torch.empty(d), rstd)
    return pack, tail, routes, args


@pytest.mark.parametrize("case", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
def test_bound_calls_launch_as_the_module_functions(host_path, case):
    """Every route: the bound function's launches are the module function's, argument for argument (the
    workspaces each call allocates named by their order); a repeat call finds its route without a lookup."""
    pack, tail, routes, args = _bound_case(host_path, case)
    direction, ratio, coff, head_dim = case[1:5]
    module = launch.forward if direction == "forward" else launch.backward
    bound = launch.bind(direction, ratio, coff, head_dim, BF16, pack.kv.device, tail.config)
    known = {t.data_ptr() for t in args if isinstance(t, torch.Tensor)} | set(tail_launch.tail_arguments(tail, None))
    recorders = _recorders(routes)
    module(*args)
    want = [_normalised(r.function.calls, known) for r in recorders]
    assert any(want)
    for r in recorders:
        r.function.calls.clear()
    bound(*args)
    host_path.clear()  # resolved at the first call: no lookup after it
    bound(*args)
    for r, calls in zip(recorders, want, strict=True):
        assert _normalised(r.function.calls[: len(calls)], known) == calls
        assert _normalised(r.function.calls[len(calls) :], known) == calls


def test_bound_calls_keep_the_errors_and_the_capture_refusal(host_path, monkeypatch):
    """grad_norm_weight required with a norm (before any launch); an unresolved route is built as by the module
    functions, so never under CUDA-graph capture; no tail: the pooling's path."""
    case = BOUND_CASES[3]
    pack, tail, routes, args = _bound_case(host_path, case)
    bound = launch.bind("backward", 4, 2, 64, BF16, pack.kv.device, tail.config)
    with pytest.raises(ValueError, match="grad_norm_weight"):
        bound(*args[:-2], None, args[-1])
    assert routes[0].fused.function.calls == []
    host_path.clear()
    with monkeypatch.context() as capturing:
        capturing.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        for fn in (bound, launch.backward):
            with pytest.raises(RuntimeError, match="cannot be compiled during CUDA-graph capture"):
                fn(*args)
    forward = launch.bind("forward", 4, 2, 64, BF16, pack.kv.device, tail.config)
    plain = _forward_launcher()
    launch._LAUNCHERS[("forward", 4, 2, 64, BF16, None)] = plain
    out, rstd = torch.empty((pack.total_comp, 64), dtype=BF16), torch.full((pack.total_comp,), 7.0)
    forward(*pack.inputs, out, 4, 2, None, None, None, rstd)
    assert len(plain.function.calls) == 1 and len(plain.function.calls[0]) == 11
    assert torch.equal(rstd, torch.ones_like(rstd))


def test_compiled_ops_call_the_bound_functions():
    """The API's ops with a tail call launch.bind's functions (the host-cost tool's stand-ins for the kernels)."""
    from csa_compressor import api
    from csa_compressor.bench.host import launch_stubs

    pack, tail = _pack_and_tail()
    kw = dict(ratio=4, coff=2, head_dim=pack.head_dim, backend="cute", **tail.arguments())
    with launch_stubs() as stubs:
        for _ in range(2):
            before = stubs.launches
            api.csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)
            api.csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
            assert stubs.launches - before == 2  # the fused forward, the fused backward
        names = sorted(op._launch.__qualname__ for op in api._OPS.values())
    assert names == ["_bound_backward.<locals>.backward", "_bound_forward.<locals>.forward"]


# ---------------------------------------------------------------- GPU: the contract


def _gpu_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = launch.device_unsupported_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    return launch


def _nan(shape, dtype=F32):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _protocol(with_stats: bool, with_rstd: bool):
    """check_backend's pair over the protocol calls; every buffer starts as NaN (an unwritten entry fails)."""

    def forward_pass(inputs, tail, ratio, coff, total_comp):
        kv = inputs[0]
        d = kv.shape[1] // coff
        out = _nan((total_comp, d), kv.dtype)
        stats = _nan((total_comp, 3, d)) if with_stats else None
        rstd = _nan((total_comp,)) if with_rstd else None
        launch.forward(*inputs, out, ratio, coff, None, stats, tail, rstd)
        return out, stats, rstd

    def forward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, tail, *, ratio, coff, total_comp):
        inputs = tuple(t.cuda() for t in (kv, score, ape, cu_seqlens, cu_seqlens_comp))
        return forward_pass(inputs, _to_cuda(tail), ratio, coff, total_comp)[0].cpu()

    def backward_fn(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, tail, *, ratio, coff):
        inputs = tuple(t.cuda() for t in (kv, score, ape, cu_seqlens, cu_seqlens_comp))
        tail = _to_cuda(tail)
        stats = rstd = None
        if with_stats or with_rstd:
            _, stats, rstd = forward_pass(inputs, tail, ratio, coff, grad_out.shape[0])
        kv = inputs[0]
        grads = _nan(kv.shape, kv.dtype), _nan(kv.shape, kv.dtype), _nan(inputs[2].shape)
        grad_w = _nan((kv.shape[1] // coff,)) if tail.has_norm else None
        launch.backward(*inputs, grad_out.cuda(), *grads, ratio, coff, None, stats, tail, grad_w, rstd)
        return tuple(None if g is None else g.cpu() for g in (*grads, grad_w))

    return forward_fn, backward_fn


# Beside tests/test_tail.py's cases (same format): SPEC sizes, rows wider than a warp, rope_dim = head_dim,
# 16-slot windows.
OWN_CASES = {
    "r4c2d512-rope64-pos": (4, 2, 512, (1000, 2, 333, 64), 7, 4, dict(rope_dim=64, positions=True)),
    "r128c1d512-rope64": (128, 1, 512, (515, 1, 1030, 260), 3, 2, dict(rope_dim=64)),
    "r128c2d512-rope64-half-bf16w": (128, 2, 512, (515, 1030, 127), 0, 3,
                                     dict(rope_dim=64, interleaved=False, norm_dtype=BF16)),
    "r2c1d2048-rope2048-pos": (2, 1, 2048, (33, 5, 64), 1, 2, dict(rope_dim=2048, positions=True)),
    "r4c2d65-norm": (4, 2, 65, (37, 4, 64, 129), 3, 2, dict()),
    "r8c2d130-rope130-half": (8, 2, 130, (81, 7, 40), 2, 1, dict(rope_dim=130, interleaved=False)),
    "r3c2d36-rope36-only": (3, 2, 36, (41, 100, 7), 0, 1, dict(norm=False, rope_dim=36)),
    "r16c1d128-rope64-pos": (16, 1, 128, (300, 5, 129), 2, 2, dict(rope_dim=64, positions=True)),
    "r4c2d128-padding-only": (4, 2, 128, (3, 2), 4, 3, dict(rope_dim=64)),
    # The composed backward's one reduction: padding-only CTAs, more TailGradient CTAs than row ranges, odd
    # head_dim, odd-sized grad_ape slabs (r5c1d7), no norm.
    "r128c1d128-rope64-padding-ctas": (128, 1, 128, (300, 1, 129), 2, 40, dict(rope_dim=64)),
    "r128c2d65-norm-padding-ctas": (128, 2, 65, (600, 3, 256), 1, 30, dict()),
    "r128c1d128-rope64-pos-many": (128, 1, 128, (20000, 13000, 5400), 3, 3, dict(rope_dim=64, positions=True)),
    # The statistics backward with the tail over long row ranges: terms by shuffles in each row step (a row within
    # a warp), and terms in blocks of rows, several per range (rows of two warps).
    "r16c2d64-rope64-pos-long": (16, 2, 64, (200000, 40000, 3000), 2, 5, dict(rope_dim=64, positions=True)),
    "r16c2d65-rope64-pos-blocks": (16, 2, 65, (100000, 20000, 3000), 2, 5, dict(rope_dim=64, positions=True)),
    # Terms in a warp whose lanes past head_dim hold no column (they join the row's shuffles with zeros).
    "r32c2d100-rope64-pos-lanes": (32, 2, 100, (700, 129, 3), 1, 3, dict(rope_dim=64, positions=True)),
    "r128c2d128-rope64-half-bf16w": (128, 2, 128, (9000, 300), 0, 37,
                                     dict(rope_dim=64, interleaved=False, norm_dtype=BF16)),
    "r128c2d128-rope64-only": (128, 2, 128, (9000, 300), 0, 37, dict(norm=False, rope_dim=64)),
    "r5c1d7-rope2-pos": (5, 1, 7, (300, 41, 7), 0, 9, dict(rope_dim=2, positions=True)),
    # The long-window forward with the tail (whole rows per CTA) or, past its tile, the composed route: half-split
    # partners across warps, an odd head_dim (composed), two rows per CTA without a norm.
    "r128c1d128-rope128-half-pos": (128, 1, 128, (1030, 7, 515), 1, 5,
                                    dict(rope_dim=128, interleaved=False, positions=True)),
    "r128c1d65-rope64-pos": (128, 1, 65, (700, 129, 3), 2, 2, dict(rope_dim=64, positions=True)),
    "r32c2d64-rope64-half-only": (32, 2, 64, (640, 31, 96), 0, 3, dict(norm=False, rope_dim=64, interleaved=False)),
    # A rotation alone on a row's two chunks: adjacent CTAs, no cluster (only the norm exchanges across chunks).
    "r128c1d128-rope64-only-pos": (128, 1, 128, (1030, 7, 515), 1, 5, dict(norm=False, rope_dim=64, positions=True)),
    # The whole-row stream (d512, one slot half): half-split partners across the CTA, a bf16 weight, positions,
    # 4 batches per group; one batch (r16); rope_dim = head_dim without a norm; more rows than one wave holds.
    "r64c1d512-rope64-half-bf16w-pos": (64, 1, 512, (1030, 70, 515), 3, 4,
                                        dict(rope_dim=64, interleaved=False, norm_dtype=BF16, positions=True)),
    "r16c1d512-rope512-only": (16, 1, 512, (300, 17, 129), 2, 3, dict(norm=False, rope_dim=512)),
    "r128c1d512-rope64-pos-many": (128, 1, 512, (40000, 30000, 9000), 3, 3, dict(rope_dim=64, positions=True)),
}  # fmt: skip


def _case(name, seed):
    if name in CASES:
        return case_pack_and_tail(name, seed=seed)
    ratio, coff, head_dim, seqlens, tok_pad, comp_pad, tail_kw = OWN_CASES[name]
    pack = make_pack(seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, seed=seed)
    return pack, T.random_tail(pack, seed=seed + 7, **tail_kw)


ALL_CASES = [*CASES, *OWN_CASES]
ROUTES = {"plain": (False, False), "rstd": (False, True), "stats": (True, False), "stats-rstd": (True, True)}


def _routes(name):
    ratio, coff = (CASES.get(name) or OWN_CASES[name])[:2]
    long = window_slots(ratio, coff) > 16
    return [r for r, (stats, _) in ROUTES.items() if long or not stats]  # statistics: long windows only


@pytest.mark.gpu
@pytest.mark.parametrize("name,route", [(n, r) for n in ALL_CASES for r in _routes(n)])
def test_protocol_meets_the_contract(name, route):
    _gpu_launch()
    pack, tail = _case(name, seed=31)
    T.check_backend(*_protocol(*ROUTES[route]), pack, tail)


# The rounding of a pooled x summed over up to 128 slots of |v| < 8 in another order.
X_ROUNDING = 128 * 8 * 2.0**-24


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["r128c1d128-rope128-half-pos", "r128c1d128-rope64-pos-many",
                                  "r128c1d128-rope64-padding-ctas", "r32c2d64-rope64-half-only", "r128c1d128-rope64-only-pos",
                                  "r128c1d512-rope64-pos-many", "r64c1d512-rope64-half-bf16w-pos"])  # fmt: skip
def test_long_forward_with_tail_is_one_launch_with_the_pooling_statistics(name):
    """The fused long-window forward: one kernel, the statistics the pooling's statistics forward's (bitwise for the
    widened tile; the whole-row stream folds its slots in other groups, so its sums differ by their rounding: the
    max bitwise, 1 / sum to a few fp32 ulps, x to the rounding of a sum of up to 128 terms of |v| < 8), the rows
    within the contract of the composed route's (rstd from another summation order)."""
    _gpu_launch()
    from torch.profiler import ProfilerActivity, profile

    pack, tail = _case(name, seed=41)
    tail = _to_cuda(tail)
    inputs = tuple(t.cuda() for t in pack.inputs)
    n, d = pack.total_comp, pack.kv.shape[1] // pack.coff
    args = (pack.ratio, pack.coff, None)
    assert tail_launch._lookup("forward", inputs[0], pack.ratio, pack.coff, d, tail, _nan((1,))).fused is not None
    out, stats, rstd = _nan((n, d), BF16), _nan((n, 3, d)), _nan((n,))
    launch.forward(*inputs, out, *args, stats, tail, rstd)
    plain_stats = _nan((n, 3, d))
    launch.forward(*inputs, _nan((n, d), BF16), *args, plain_stats)
    fused_config = tail_launch._lookup("forward", inputs[0], pack.ratio, pack.coff, d, tail, _nan((1,))).fused.config
    stream = fused_config == tail_configs.whole_row_stream(pack.ratio, pack.coff, d, tail_launch.spec_of(tail))
    assert stream == (name.startswith(("r128c1d512", "r64c1d512")))
    if stream:
        assert torch.equal(stats[:, 0], plain_stats[:, 0])
        torch.testing.assert_close(stats[:, 1], plain_stats[:, 1], rtol=2e-6, atol=0)
        torch.testing.assert_close(stats[:, 2], plain_stats[:, 2], rtol=2e-6, atol=X_ROUNDING)
    else:
        assert torch.equal(stats, plain_stats)
    composed = tail_launch._route("forward", pack.ratio, pack.coff, d, BF16, 0, tail_launch.spec_of(tail), False)
    out_c, rstd_c = _nan((n, d), BF16), _nan((n,))
    tail_launch._composed_forward(composed, inputs, out_c, None, tail_launch.tail_arguments(tail, rstd_c), None)
    torch.testing.assert_close(rstd, rstd_c, rtol=1e-6, atol=0)
    # One bf16 ulp of the composed route's row; the stream's x may differ from its x by the rounding of the sum
    # (X_ROUNDING), which the norm scales by rstd |w| and a rotation adds from two columns.
    ulp = (out_c.float().abs() * 2.0**-7).clamp(min=2.0**-133)
    if stream:
        w_max = tail.norm_weight.float().abs().max() if tail.norm_weight is not None else 1.0
        ulp = ulp + 2 * X_ROUNDING * rstd_c[:, None] * w_max
    assert bool(((out.float() - out_c.float()).abs() <= ulp).all())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch.forward(*inputs, out, *args, stats, tail, rstd)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 512])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("given", [True, False])
def test_ratio_128_backward_launches(head_dim, norm, given):
    """Kernels of one backward at ratio 128, the statistics forward first where none were given. Slab form (d128):
    the statistics backward with the tail and its slab reduction (grad_ape's and the weight's). Whole tiles (d512):
    composed, TailGradient then the statistics backward, whose CTAs past its tiles sum the weight's slabs."""
    _gpu_launch()
    from torch.profiler import ProfilerActivity, profile

    pack = make_pack((1030, 515), head_dim, 128, 1, comp_padding=3, seed=3)
    tail = _to_cuda(T.random_tail(pack, norm=norm, rope_dim=64, seed=4))
    inputs = tuple(t.cuda() for t in pack.inputs)
    kv, score, ape = inputs[:3]
    n, d = pack.total_comp, head_dim
    stats = torch.empty((n, 3, d), device="cuda") if given else None
    launch.forward(*inputs, torch.empty((n, d), dtype=BF16, device="cuda"), 128, 1, None, stats, tail, None)
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    grad_w = torch.empty(d, device="cuda") if norm else None
    call = (*inputs, pack.grad_out.cuda(), *grads, 128, 1, None, stats, tail, grad_w, None)
    launch.backward(*call)  # compiles and primes the route
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch.backward(*call)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    route = tail_launch._lookup("backward", kv, 128, 1, d, tail, stats)
    recompute = 0 if given else 1
    if head_dim == 128:
        assert route.fused is not None and route.fused.config.tail is not None
        assert len(kernels) == recompute + 2, [e.name for e in kernels]
    else:
        assert route.fused is None and route.pool.config.whole_tile and route.pool.config.norm_slabs == norm
        assert len(kernels) == recompute + 2, [e.name for e in kernels]


@pytest.mark.gpu
@pytest.mark.parametrize("given", [True, False])
def test_weight_summed_in_the_statistics_backward_is_the_reduction_kernels(monkeypatch, given):
    """The whole-tile composed backward's weight gradient summed by the statistics backward's extra CTAs: bitwise
    the reduction kernel's (the same slabs in the same order), every other gradient bitwise too; NaN canaries in
    the buffers, a token-padded ragged pack."""
    _gpu_launch()
    pack = make_pack((1030, 515, 3, 260), 512, 128, 1, token_padding=5, comp_padding=3, seed=11)
    tail = _to_cuda(T.random_tail(pack, rope_dim=64, positions=True, seed=12))
    inputs = tuple(t.cuda() for t in pack.inputs)
    kv, score, ape = inputs[:3]
    n, d = pack.total_comp, pack.head_dim

    def backward():
        stats = torch.empty((n, 3, d), device="cuda")
        out = torch.empty((n, d), dtype=BF16, device="cuda")
        launch.forward(*inputs, out, 128, 1, None, stats, tail, None)
        grads = [torch.full_like(t, float("nan")) for t in (kv, score, ape)] + [
            torch.full((d,), float("nan"), device="cuda")
        ]
        launch.backward(*inputs, pack.grad_out.cuda(), *grads[:3], 128, 1, None, stats if given else None, tail,
                        grads[3], None)  # fmt: skip
        route = tail_launch._lookup("backward", kv, 128, 1, d, tail, stats if given else None)
        return grads, route.pool.config.norm_slabs

    monkeypatch.setattr(tail_launch, "_ROUTES", {})
    summed, in_pool = backward()
    monkeypatch.setattr(tail_launch, "_ROUTES", {})
    monkeypatch.setattr(tail_configs, "sums_norm_slabs", lambda *args: False)
    reduced, in_kernel = backward()
    assert in_pool and not in_kernel
    for a, b in zip(summed, reduced, strict=True):
        assert not torch.isnan(a).any() and torch.equal(a, b)


API_NAMES = ["r4c2d72-rope64-bf16w-pos", "r128c2d6-rope6-pos", "r2c1d66-rope64-half-pos", "r4c2d512-rope64-pos",
             "r128c1d512-rope64"]  # fmt: skip
API_CASES = [
    (entry, name)
    for entry in ("wrappers", "wrappers-stats", "classes", "compressor_pool")
    for name in API_NAMES
    if entry != "wrappers-stats" or "r128" in name  # softmax statistics: long windows only
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["r4c2d5-rope2-pos", "r2c1d66-rope64-half-pos", "r4c2d512-rope64-pos"])
def test_composed_route_of_windows_the_hook_fuses(name, monkeypatch):
    """The composed route also where a fused kernel exists (one-group short windows)."""
    _gpu_launch()
    monkeypatch.setattr(select, "fused_tail_config", lambda *args: None)
    monkeypatch.setattr(tail_launch, "_ROUTES", {})
    pack, tail = _case(name, seed=37)
    T.check_backend(*_protocol(False, True), pack, tail)
    assert all(route.fused is None for route in tail_launch._ROUTES.values()) and tail_launch._ROUTES


@pytest.mark.gpu
@pytest.mark.parametrize("entry,name", API_CASES)
def test_api_entry_points_meet_the_contract(entry, name):
    """Every entry point with backend="cute" (the autograd saves the statistics of long windows)."""
    _gpu_launch()
    from ..test_tail_api import ENTRY_POINTS

    pack, tail = _case(name, seed=32)
    if entry == "compressor_pool" and tail.norm_weight is not None:
        tail = dataclasses.replace(tail, norm_weight=tail.norm_weight.float())
    T.check_backend(*(_on_cuda(fn) for fn in ENTRY_POINTS[entry]("cute")), pack, tail)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["r4c2d512-rope64-pos", "r128c2d6-rope6-pos", "r2c1d4-rope4-only-pos"])
def test_positions_outside_the_tables_are_not_rotated(name):
    """Rows at positions outside [0, max_position) are not rotated: the contract against tables padded with
    (cos 1, sin 0) rows."""
    _gpu_launch()
    pack, tail = _case(name, seed=33)
    half = tail.rope_dim // 2
    segments = pack.cu_seqlens.shape[0] - 1
    gen = torch.Generator().manual_seed(5)
    start = torch.randint(-3 * pack.ratio, tail.rope_cos.shape[0] + 2 * pack.ratio, (segments,), generator=gen)
    cut = max(1, tail.rope_cos.shape[0] // 2)  # the kernel's tables: the first half of the rows
    given = dataclasses.replace(tail, rope_cos=tail.rope_cos[:cut].contiguous(), rope_sin=tail.rope_sin[:cut].contiguous(),
                                position_start=start.to(torch.int32))  # fmt: skip
    pad = 3 * pack.ratio + 1
    rows = int((start.max() + pack.total_comp * pack.ratio + 1).clamp(min=1)) + pad
    cos = torch.ones(pad + rows, half)
    sin = torch.zeros(pad + rows, half)
    cos[pad : pad + cut], sin[pad : pad + cut] = given.rope_cos, given.rope_sin
    # Padding rows take position 0: the given tables' row 0 (angle 0 in random_tail's tables: cos 1, sin 0).
    assert torch.equal(tail.rope_cos[0], torch.ones(half)) and torch.equal(tail.rope_sin[0], torch.zeros(half))
    oracle = dataclasses.replace(given, rope_cos=cos, rope_sin=sin, position_start=(start + pad).to(torch.int32))
    fwd, bwd = _protocol(False, False)

    def forward_fn(*args, **kw):
        return fwd(*args[:5], given, **kw)

    def backward_fn(*args, **kw):
        return bwd(*args[:6], given, **kw)

    T.check_backend(forward_fn, backward_fn, pack, oracle)


@pytest.mark.gpu
def test_rstd_and_identity_tail():
    """rstd of every row (1 without a norm); an identity tail gives the pooling's bits."""
    _gpu_launch()
    pack, tail = _case("r4c2d512-rope64-pos", seed=34)
    inputs = tuple(t.cuda() for t in pack.inputs)
    tail = _to_cuda(tail)
    n, d = pack.total_comp, pack.head_dim
    x = T.pooled_rows(*inputs, ratio=4, coff=2, total_comp=n, dtype=F32)
    out, rstd = _nan((n, d), BF16), _nan((n,))
    launch.forward(*inputs, out, 4, 2, None, None, tail, rstd)
    torch.testing.assert_close(rstd, T.row_rstd(x, tail.norm_eps).reshape(-1), rtol=2e-6, atol=0)
    launch.forward(*inputs, out, 4, 2, None, None, dataclasses.replace(tail, norm_weight=None), rstd)
    assert torch.equal(rstd, torch.ones_like(rstd))
    plain, identity = _nan((n, d), BF16), _nan((n, d), BF16)
    launch.forward(*inputs, plain, 4, 2, None)
    launch.forward(*inputs, identity, 4, 2, None, None, T.Tail(norm_eps=0.5))
    assert torch.equal(plain.view(torch.int16), identity.view(torch.int16))


# A child process: a kernel that hangs fails the test at its time limit instead of stopping the suite.
_ROW_LANES_CHILD = """
import sys
from tests import sanitize_cases
shapes = [tuple(int(v) for v in s.split(",")) for s in sys.argv[1:]]
sanitize_cases.TAIL_CASES[:] = [(r, c, d, (3000, 1000, 7), 2, min(8, d), True, True) for r, c, d in shapes]
sys.exit(0 if sanitize_cases.run_tail_cases("cute", "cuda") else 1)
"""


@pytest.mark.gpu
def test_rows_in_row_lanes_sharing_a_warp_finish_within_the_contract():
    """The statistics backward with a norm where several row lanes share a warp (ROW_LANE_SHAPES): every call
    returns, and within the contract (with their terms by shuffles in the row loop they would wait forever)."""
    import subprocess
    import sys

    _gpu_launch()
    shapes = [",".join(map(str, shape)) for shape in ROW_LANE_SHAPES]
    res = subprocess.run([sys.executable, "-c", _ROW_LANES_CHILD, *shapes], env=child_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count(": ok") == len(ROW_LANE_SHAPES), res.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [False, True], ids=["module", "bound"])
@pytest.mark.parametrize("ratio,coff", [(4, 2), (128, 1), (128, 2)])
def test_cuda_graph_capture_with_a_tail(ratio, coff, bound):
    """compile() with the tail's configuration, then forward and backward captured (the module functions or
    launch.bind's, whose routes the eager call resolves): the replay equals the eager call (short fused, long fused
    forward with the composed backward, composed)."""
    _gpu_launch()
    pack = make_pack((600, 50, 7, 300), 128, ratio, coff, comp_padding=3, device="cuda", seed=35)
    tail = T.random_tail(pack, rope_dim=64, positions=True, seed=36)
    for direction in ("forward", "backward"):
        launch.compile(direction, ratio, coff, 128, BF16, pack.kv.device, tail_config=tail.config)
    forward, backward = launch.forward, launch.backward
    if bound:
        shape = (ratio, coff, 128, BF16, pack.kv.device, tail.config)
        forward, backward = launch.bind("forward", *shape), launch.bind("backward", *shape)
    n, d = pack.total_comp, pack.head_dim
    out, rstd = torch.empty((n, d), dtype=BF16, device="cuda"), torch.empty(n, device="cuda")
    grads = (torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape))
    grad_w = torch.empty(d, device="cuda")

    def step():
        forward(*pack.inputs, out, ratio, coff, None, None, tail, rstd)
        backward(*pack.inputs, pack.grad_out, *grads, ratio, coff, None, None, tail, grad_w, rstd)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    eager = [t.clone() for t in (out, rstd, *grads, grad_w)]
    for t in (out, rstd, *grads, grad_w):
        t.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((out, rstd, *grads, grad_w), eager, strict=True):
        assert bitwise_equal(got, want)
