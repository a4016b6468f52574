"""benchmarks/variant_ab.py's schedule switches reach the kernels they name, and only those (CPU; needs
nvidia-cutlass-dsl for the cute schedules, no GPU).

An A/B measures whatever ``SCHEDULE_OVERRIDE`` holds when the kernels are built: a switch that silently skips a
kernel makes the record compare the default with itself (the eighth round's ``--backward-min-blocks`` skipped the
statistics backward that way), so each switch is checked here against the schedules it must and must not change.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cute_launch = pytest.importorskip("csa_compressor.backends.cute.launch", reason="nvidia-cutlass-dsl not installed")
if cute_launch.unavailable_reason() is not None:  # also binds the kernel modules' schedule functions
    pytest.skip(f"cute backend unavailable: {cute_launch.unavailable_reason()}", allow_module_level=True)

from csa_compressor.bench import select_cases  # noqa: E402

_SPEC = importlib.util.spec_from_file_location(
    "variant_ab", Path(__file__).resolve().parents[1] / "benchmarks" / "variant_ab.py"
)
variant_ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(variant_ab)

R4 = ("backward", 4, 2, 512)  # the short-window backward of 3x8192 d512 r4 c2
STATS = ("backward_stats", 128, 1, 512)  # the statistics backward of 3x8192 d512 r128 c1
TWO_PASS = ("backward", 128, 1, 512)  # the statistics-free long backward


@pytest.fixture
def overrides():
    cute_launch.SCHEDULE_OVERRIDE.clear()
    yield cute_launch.SCHEDULE_OVERRIDE
    cute_launch.SCHEDULE_OVERRIDE.clear()


def _apply(argv, cases=("3x8192-d512-r4-c2", "3x8192-d512-r128-c1")):
    args = variant_ab.build_parser().parse_args(list(argv))
    variant_ab.apply_overrides(args, select_cases(list(cases)))


def test_no_switch_no_override(overrides):
    _apply([])
    assert overrides == {}


def test_backward_min_blocks_reaches_both_backwards(overrides):
    _apply(["--backward-min-blocks", "4"])  # both default to 512-thread CTAs: 4 x 512 threads fill an SM
    assert overrides[R4].MB == 4
    assert overrides[STATS].MB == 4 and overrides[STATS].SC  # the statistics backward, not skipped
    assert TWO_PASS not in overrides  # sizes its grid by shared memory: left alone
    assert not any(key[0].startswith("forward") for key in overrides)


def test_backward_min_blocks_beyond_an_sm_is_refused(overrides, capsys):
    """5 CTAs of 512 threads cannot be resident on one SM (2048 threads): no launch bound is asked for."""
    _apply(["--backward-min-blocks", "5"])
    assert overrides == {}
    assert "512-thread CTAs, left at its default" in capsys.readouterr().err


def test_switches_compose(overrides):
    _apply(["--prefetch-ahead", "--backward-min-blocks", "4"])
    for key in (R4, STATS):
        assert overrides[key].PF and overrides[key].MB == 4


def test_backward_tile_and_hold_ape_touch_only_the_short_window_backward(overrides):
    _apply(["--backward-tile", "1,128", "--hold-ape"])
    sch = overrides[R4]
    assert (sch.V, sch.TC, sch.R) == (1, 128, sch.threads // 128) and sch.HA
    assert sch.threads == cute_launch._default_schedule(*R4).threads
    assert STATS not in overrides and TWO_PASS not in overrides


def test_stats_tile(overrides):
    _apply(["--stats-tile", "2,4"])
    sch = overrides[STATS]
    assert (sch.V, sch.SG) == (2, 4)
    assert sch != cute_launch._default_schedule(*STATS)
    assert R4 not in overrides


def test_forward_min_blocks_caps_only_one_group_forwards(overrides):
    _apply(["--forward-min-blocks", "7"])
    assert overrides[("forward", 4, 2, 512)].MB == 7
    assert ("forward_stats", 128, 1, 512) not in overrides  # slot groups > 1: --forward-min-blocks-long
    _apply(["--forward-min-blocks-long", "3"])
    assert overrides[("forward_stats", 128, 1, 512)].MB == 3


def test_streaming_long_forward(overrides):
    _apply(["--forward-long-stream-cols", "64"])
    fwd = overrides[("forward_stats", 128, 1, 512)]
    assert fwd.NB > 1 and fwd.TC * fwd.V == 64 and fwd.ST
    assert not overrides[("forward", 128, 1, 512)].ST
    assert ("forward", 4, 2, 512) not in overrides  # short windows have no streaming form


def test_stats_cluster_reaches_the_statistics_backward_only(overrides):
    _apply(["--stats-cluster", "1"])
    assert overrides[STATS].CL and overrides[STATS].SC
    assert all(key[0] == "backward_stats" for key in overrides)
    assert not cute_launch._default_schedule(*STATS).CL  # off by default


def test_stats_cluster_rows_sets_the_grid(overrides):
    """``--stats-cluster-rows 3``: the cluster form with 3 row ranges per tile (one wave of 128 clusters of 3 on an
    H200 instead of two waves of clusters of 4) for 3x8192 d512 r128 c1 (192 rows, 128 tiles)."""
    import types

    saved = cute_launch.CLUSTER_MAX
    try:
        _apply(["--stats-cluster-rows", "3"])
        sch = overrides[STATS]
        assert sch.CL
        fake = types.SimpleNamespace(sch=sch, num_sms=132, ctas_per_sm=4, nchunk=128)
        assert cute_launch.backward_grid(fake, 192, 128 * 512) == (64, 3)
        cute_launch.CLUSTER_MAX = saved
        assert cute_launch.backward_grid(fake, 192, 128 * 512) == (48, 4)
    finally:
        cute_launch.CLUSTER_MAX = saved


def test_stats_whole_tile_switch(overrides):
    """``--stats-whole-tile 0`` / ``1``: the slab form (128 threads, 4 row ranges) or the whole-tile form (512 threads,
    grid x 1) of the same thread tile; the cluster switch always takes the slab form's tile."""
    import types

    default = cute_launch._default_schedule(*STATS)
    assert default.WT  # 3x8192 d512 r128 c1 has 128 tiles
    _apply(["--stats-whole-tile", "0"])
    slab = overrides[STATS]
    assert not slab.WT and slab.threads == 128 and (slab.V, slab.TC, slab.G, slab.SG) == (
        default.V, default.TC, default.G, default.SG)  # fmt: skip
    fake = types.SimpleNamespace(sch=slab, num_sms=132, ctas_per_sm=4, nchunk=128)
    assert cute_launch.backward_grid(fake, 192, 128 * 512) == (48, 4)
    _apply(["--stats-whole-tile", "1"])
    whole = overrides[STATS]
    assert whole == default and whole.threads == 512
    fake = types.SimpleNamespace(sch=whole, num_sms=132, ctas_per_sm=1, nchunk=128)
    assert cute_launch.backward_grid(fake, 192, 128 * 512) == (192, 1)
    assert cute_launch.backward_grid(fake, 5, 128 * 512) == (16, 1)
    _apply(["--stats-cluster", "1"])
    assert overrides[STATS].CL and not overrides[STATS].WT and overrides[STATS].threads == 128


def test_backward_threads_sets_only_the_short_window_backward(overrides):
    """``--backward-threads 128``: a quarter of the row lanes of the ratio-4 backward's default (512 threads, one CTA
    per SM by registers), the thread tile unchanged; the default's CTA size leaves nothing to override."""
    from csa_compressor.backends.cute.backward import SHORT_BACKWARD_THREADS

    default = cute_launch._default_schedule(*R4)
    assert default.threads == SHORT_BACKWARD_THREADS == 512
    _apply(["--backward-threads", "512"])
    assert overrides == {}
    _apply(["--backward-threads", "128"])
    sch = overrides[R4]
    assert sch.threads == 128 and 4 * sch.R == default.R and (sch.V, sch.TC, sch.G, sch.HA) == (
        default.V, default.TC, default.G, default.HA)  # fmt: skip
    assert STATS not in overrides


def test_stats_threads_widens_only_the_slab_form(overrides):
    """``--stats-threads 512``: 4x the row lanes of a slab-form statistics backward (1x8192 d128 r128 c1, 32 tiles);
    the whole-tile default of 3x8192 d512 r128 c1 is left alone."""
    _apply(["--stats-threads", "512"], cases=("1x8192-d128-r128-c1", "3x8192-d512-r128-c1"))
    small = ("backward_stats", 128, 1, 128)
    default = cute_launch._default_schedule(*small)
    assert not default.WT and default.threads == 128
    assert overrides[small].threads == 512 and overrides[small].R == 4 * default.R and not overrides[small].WT
    assert STATS not in overrides


def test_forward_long_tile_reaches_only_the_64_column_forwards(overrides):
    """``--forward-long-tile 8,128``: 16-byte vectors in 128-thread CTAs for the ratio-128 coff-1 forwards (plain and
    statistics); short windows and the streaming schedule of longer windows keep theirs."""
    _apply(["--forward-long-tile", "8,128"], cases=("3x8192-d512-r128-c1", "1x65536-d512-r128-c2", "3x8192-d512-r4-c2"))
    for direction in ("forward", "forward_stats"):
        sch = overrides[(direction, 128, 1, 512)]
        assert (
            (sch.V, sch.threads, sch.TC * sch.V) == (8, 128, 64) and sch.CM and sch.ST == (direction == "forward_stats")
        )
    assert ("forward", 4, 2, 512) not in overrides and ("forward_stats", 128, 2, 512) not in overrides


def test_forward_tile_reaches_only_the_short_window_forward(overrides):
    """``--forward-tile 2,128``: 4-byte vectors for the one-group forwards of 8-slot windows; the long-window forwards
    and every backward keep theirs."""
    _apply(["--forward-tile", "2,128"], cases=("3x8192-d512-r128-c1", "3x8192-d512-r4-c2", "1x8192-d128-r4-c2"))
    for d in (512, 128):
        sch = overrides[("forward", 4, 2, d)]
        default = cute_launch._default_schedule("forward", 4, 2, d)
        assert (sch.V, sch.threads, sch.G, sch.MD) == (2, 128, 1, True) and default.V == 4
    assert set(overrides) == {("forward", 4, 2, 512), ("forward", 4, 2, 128)}


def test_compare_names_the_switches_each_run_set(tmp_path):
    """The comparison's header shows the cache policies and the switches a run set, not those left at defaults."""
    rows = [dict(case="c", backend="cute", direction="fwd", cold=2.0, clean=1.5, warm=1.0)]
    base = dict(stream_loads=True, stream_backward="none", stats_slots=0, forward_min_blocks=[0, 0], hold_ape=False)
    a = dict(base, forward_long_tile="8,128", device="H200", rows=[dict(rows[0], cold=3.0)])
    b = dict(base, device="H200", rows=rows)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    text = variant_ab.compare(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    head_a, head_b = text.splitlines()[:2]
    assert "stream_loads=True, stream_backward=none, forward_long_tile=8,128)" in head_a
    assert head_b.endswith("(stream_loads=True, stream_backward=none); ")
    assert "stats_slots" not in text and "hold_ape" not in text
    assert "| c | cute | fwd | 3.0 / 2.0 | 1.5 / 1.5 | 1.0 / 1.0 | 1.500 |" in text
