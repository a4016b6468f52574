"""The cute kernels build for Hopper and Blackwell without a GPU (CuTe-DSL compiles with ``CUTE_DSL_ARCH``).

Runs wherever nvidia-cutlass-dsl is installed, CI included: every configuration class compiles to
PTX with the expected kernels and parameter lists, and no kernel keeps an array in local memory
(a run-time-indexed register array would land there and cost DRAM traffic). Running the kernels
needs the GPU: tests/backends/test_cute.py.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # lets CuTe-DSL compile without a driver

cute_launch = pytest.importorskip("csa_compressor.backends.cute.launch", reason="nvidia-cutlass-dsl not installed")
if cute_launch.unavailable_reason() is not None:
    pytest.skip(f"cute backend unavailable: {cute_launch.unavailable_reason()}", allow_module_level=True)

# (ratio, coff, head_dim): the SPEC configurations, odd and tiny head_dims, short and long windows.
CONFIGS = [
    (4, 2, 512),
    (4, 2, 128),
    (4, 1, 65),
    (2, 2, 7),
    (8, 2, 64),
    (16, 2, 130),
    (128, 1, 512),
    (128, 2, 128),
    (256, 2, 8),
]


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("ratio,coff,head_dim", CONFIGS, ids=[f"r{r}c{c}d{d}" for r, c, d in CONFIGS])
def test_compiles_for_sm90_without_local_memory(direction, ratio, coff, head_dim):
    _, sch = cute_launch._key(direction, ratio, coff, head_dim, torch.bfloat16, "sm_90a")
    compiled = cute_launch._build(direction, ratio, coff, head_dim, "sm_90a", sch)
    ptx = compiled.artifacts.PTX
    assert ".target sm_90a" in ptx
    entries = cute_launch._ptx_entries(ptx)
    main = [name for name in entries if "reduce_kernel" not in name]
    assert len(main) == 1, entries
    # pointers then int32 scalars, as launch.py packs them
    assert entries[main[0]] == ("pppppp" + "ii" if direction == "forward" else "p" * 9 + "iiii")
    if direction == "backward":
        assert [entries[n] for n in entries if "reduce_kernel" in n] == ["ppi"]
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_compiles_for_sm100(direction):
    _, sch = cute_launch._key(direction, 4, 2, 512, torch.bfloat16, "sm_100a")
    compiled = cute_launch._build(direction, 4, 2, 512, "sm_100a", sch)
    assert ".target sm_100a" in compiled.artifacts.PTX


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (128, 1, 128), (16, 1, 128)])
def test_staged_backward_variant_compiles(ratio, coff, head_dim):
    """The cp.async-staged long-window backward (an opt-in schedule, not a default) keeps building."""
    from csa_compressor.backends.cute.backward import backward_schedule
    from csa_compressor.backends.cute.backward_long import staged_variant

    sch = staged_variant(backward_schedule(ratio, coff, head_dim), head_dim)
    assert sch is not None and sch.AS and not sch.PF
    ptx = cute_launch._build("backward", ratio, coff, head_dim, "sm_90a", sch).artifacts.PTX
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    # The default schedule of the same configuration is the register-streaming kernel.
    assert not backward_schedule(ratio, coff, head_dim).AS


@pytest.mark.parametrize("direction", ["forward_stats", "backward_stats"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (128, 1, 512), (16, 2, 130), (32, 2, 65)])
def test_softmax_stats_variants_compile(direction, ratio, coff, head_dim):
    """Long windows: the statistics variants take one more pointer, write (forward) or stage (backward,
    cp.async into shared memory) the statistics, and the backward drops its first pass over the window."""
    assert cute_launch.supports_stats(ratio, coff, head_dim)
    _, sch = cute_launch._key(direction, ratio, coff, head_dim, torch.bfloat16, "sm_90a")
    assert sch.ST
    ptx = cute_launch._build(direction, ratio, coff, head_dim, "sm_90a", sch).artifacts.PTX
    entries = cute_launch._ptx_entries(ptx)
    main = [name for name in entries if "reduce_kernel" not in name]
    assert entries[main[0]] == ("p" * 7 + "ii" if direction == "forward_stats" else "p" * 10 + "iiii")
    assert "ld.local" not in ptx and "st.local" not in ptx
    if direction == "backward_stats":
        plain = cute_launch._build("backward", ratio, coff, head_dim, "sm_90a", cute_launch._key(
            "backward", ratio, coff, head_dim, torch.bfloat16, "sm_90a")[1]).artifacts.PTX  # fmt: skip
        # One exp per window element instead of two (pass 1 and pass 2), plus the plain kernel's combine.
        assert ptx.count("ex2.approx") < plain.count("ex2.approx")
        # The chunked kernel of backward_stats.py: slot chunks per CTA, no shared-memory staging.
        assert sch.SC > 0 and (coff * ratio) % sch.SC == 0
        assert "cp.async" not in ptx


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 512), (128, 2, 512), (128, 1, 65)])
def test_stats_backward_whole_tile_builds_one_kernel(ratio, coff, head_dim):
    """Schedule.WT: one 512-thread kernel (one CTA per SM by the register cap) that writes grad_ape itself, no
    reduction kernel, no local memory; the slab form of the same configuration keeps its reduction kernel."""
    from csa_compressor.backends.cute.backward_stats import with_whole_tile

    _, sch = cute_launch._key("backward_stats", ratio, coff, head_dim, torch.bfloat16, "sm_90a")
    wt = with_whole_tile(sch, True)
    ptx = cute_launch._build("backward_stats", ratio, coff, head_dim, "sm_90a", wt).artifacts.PTX
    entries = cute_launch._ptx_entries(ptx)
    assert list(entries.values()) == ["p" * 10 + "iiii"] and not any("reduce_kernel" in n for n in entries)
    assert ".reqntid 512, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    slab = with_whole_tile(wt, False)
    assert slab.threads == 128 and wt.threads == 512
    slab_ptx = cute_launch._build("backward_stats", ratio, coff, head_dim, "sm_90a", slab).artifacts.PTX
    assert sum("reduce_kernel" in n for n in cute_launch._ptx_entries(slab_ptx)) == 1


def test_softmax_stats_only_for_long_windows():
    assert not cute_launch.supports_stats(8, 2, 128)
    with pytest.raises(ValueError, match="direction must be"):
        cute_launch._schedule("forward_stats", 4, 2, 128)


@pytest.mark.parametrize(
    "ratio,coff,head_dim", [(128, 1, 128), (128, 2, 512), (16, 2, 130), (17, 1, 128), (128, 1, 65), (128, 1, 512)]
)
def test_stats_backward_rows_side_by_side(ratio, coff, head_dim):
    """128-thread CTAs whatever the window (the slab form): slot chunks of at most ``max(8, W / 16)`` slots, and the
    threads left over take rows side by side (``R``), so that a CTA's grad_ape slab covers ``R`` rows at a time. Where
    there are at least WHOLE_TILE_MIN_TILES tiles, the same thread tile in CTAs of WHOLE_TILE_THREADS (whole-tile form,
    4x the row lanes)."""
    from csa_compressor.backends.cute.backward_stats import (
        STATS_CHUNKS,
        STATS_MIN_SLOTS,
        WHOLE_TILE_MIN_TILES,
        WHOLE_TILE_THREADS,
        stats_backward_schedule,
    )

    W = coff * ratio
    sch = stats_backward_schedule(ratio, coff, head_dim)
    slab = stats_backward_schedule(ratio, coff, head_dim, whole_tile=False)
    tiles = -(-head_dim // (sch.TC * sch.V)) * (W // sch.SC)
    assert sch.WT == (tiles >= WHOLE_TILE_MIN_TILES)
    assert sch.WT == ((ratio, coff, head_dim) in ((128, 2, 512), (128, 1, 512)))  # the large SPEC cases
    assert slab.threads == 128 and not slab.WT and W % slab.SC == 0
    assert slab.SC <= max(STATS_MIN_SLOTS, W // STATS_CHUNKS)
    assert slab.R == 128 // (slab.TC * slab.G)
    assert (sch.V, sch.TC, sch.G, sch.SG, sch.SC) == (slab.V, slab.TC, slab.G, slab.SG, slab.SC)
    assert sch.threads == (WHOLE_TILE_THREADS if sch.WT else 128)
    if (ratio, coff, head_dim) == (128, 1, 128):
        assert (sch.SC, sch.R) == (8, 4)
    if (ratio, coff, head_dim) == (128, 1, 512):
        assert (sch.SC, sch.R, tiles) == (8, 16, 128)


@pytest.mark.parametrize(
    "ratio,coff,head_dim,wide",
    [
        (4, 2, 512, False),  # one row per CTA: the capped build measured slower (wide_forward_ab_h200_20261201.md)
        (4, 2, 384, False),
        (4, 2, 128, True),
        (4, 2, 256, True),
        (8, 1, 64, True),
        (4, 1, 128, False),
        (4, 2, 65, False),
        (128, 1, 512, False),
    ],
)
def test_wide_forward_schedule(ratio, coff, head_dim, wide):
    """8-slot windows at 128 threads and more than one row per CTA get a register-capped build for large launches
    (launch bounds in the PTX)."""
    from csa_compressor.backends.cute.forward import WIDE_CTAS_PER_SM, forward_schedule, wide_forward_schedule

    sch = wide_forward_schedule(forward_schedule(ratio, coff, head_dim))
    assert (sch is not None) == wide
    if wide:
        assert sch.MB == WIDE_CTAS_PER_SM
        ptx = cute_launch._build("forward", ratio, coff, head_dim, "sm_90a", sch).artifacts.PTX
        assert f".minnctapersm {WIDE_CTAS_PER_SM}" in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("direction,ratio,coff,head_dim", [("backward", 4, 2, 512), ("backward_stats", 128, 1, 512)])
def test_backward_register_cap_reaches_the_launch_bounds(direction, ratio, coff, head_dim):
    """A backward schedule's MB (resident CTAs per SM) becomes the main kernel's launch bound; 0 keeps MAX_REGS's."""
    from dataclasses import replace

    from csa_compressor.backends.cute.backward_common import MAX_REGS

    _, sch = cute_launch._key(direction, ratio, coff, head_dim, torch.bfloat16, "sm_90a")
    default = cute_launch._build(direction, ratio, coff, head_dim, "sm_90a", sch).artifacts.PTX
    assert f".minnctapersm {65536 // (sch.threads * MAX_REGS)}" in default
    capped = cute_launch._build(direction, ratio, coff, head_dim, "sm_90a", replace(sch, MB=5)).artifacts.PTX
    assert ".minnctapersm 5" in capped


@pytest.mark.parametrize(
    "direction,ratio,coff,head_dim",
    [("backward", 4, 2, 512), ("backward", 2, 2, 7), ("backward_stats", 128, 1, 512), ("backward_stats", 17, 1, 128)],
)
def test_backward_prefetch_ahead_compiles(direction, ratio, coff, head_dim):
    """Schedule.PF on the short-window and statistics backwards: L2 (and, for the statistics, L1) prefetches, no
    local memory; off, the kernels carry none."""
    from dataclasses import replace

    _, sch = cute_launch._key(direction, ratio, coff, head_dim, torch.bfloat16, "sm_90a")
    assert not sch.PF
    plain = cute_launch._build(direction, ratio, coff, head_dim, "sm_90a", sch).artifacts.PTX
    assert "prefetch.global" not in plain
    ptx = cute_launch._build(direction, ratio, coff, head_dim, "sm_90a", replace(sch, PF=True)).artifacts.PTX
    assert "prefetch.global.L2" in ptx
    assert ("prefetch.global.L1" in ptx) == (direction == "backward_stats")
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_compiled_kernels_are_cached_per_schedule(monkeypatch):
    """One build per (direction, configuration, dtype, arch, schedule): the default and the wide (register-capped)
    forward of one configuration are two entries, and a second request of either builds nothing."""
    from csa_compressor.backends.cute.forward import wide_forward_schedule

    builds = []
    monkeypatch.setattr(cute_launch, "_COMPILED", {})
    monkeypatch.setattr(cute_launch, "_build", lambda *a: builds.append(a) or object())
    _, sch = cute_launch._key("forward", 4, 2, 128, torch.bfloat16, "sm_90a")
    wide = wide_forward_schedule(sch)
    first = [cute_launch._compiled_for("forward", 4, 2, 128, torch.bfloat16, "sm_90a", s) for s in (sch, wide)]
    again = [cute_launch._compiled_for("forward", 4, 2, 128, torch.bfloat16, "sm_90a", s) for s in (sch, wide)]
    assert first[0] is not first[1] and again[0] is first[0] and again[1] is first[1]
    assert [b[-1] for b in builds] == [sch, wide]
    assert cute_launch._key("forward", 4, 2, 128, torch.bfloat16, "sm_90a")[0] in cute_launch._COMPILED
