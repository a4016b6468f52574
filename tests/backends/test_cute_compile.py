"""The cute kernels build for sm_90a and sm_100a without a GPU: expected entries and parameter lists, no local
memory (a run-time-indexed register array would cost DRAM traffic), evict-first window loads in the forwards only,
launch bounds; and the kernel selection and configurations follow their rules.
"""

import math
import tempfile
from dataclasses import replace

import pytest

from .common import ENTRY, cute_launch

cute_launch = cute_launch()

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402
from cutlass.cute.typing import AddressSpace  # noqa: E402

from csa_compressor.backends.cute import configs  # noqa: E402
from csa_compressor.backends.cute.backward_long import BackwardLongWindow  # noqa: E402
from csa_compressor.backends.cute.backward_short import BackwardShortWindow  # noqa: E402
from csa_compressor.backends.cute.backward_stats import BackwardWithStats  # noqa: E402
from csa_compressor.backends.cute.build import check_shared_memory, compile_kernel  # noqa: E402
from csa_compressor.backends.cute.device import DeviceSpec, offline_spec  # noqa: E402
from csa_compressor.backends.cute.forward import ForwardLongWindow, ForwardShortWindow  # noqa: E402
from csa_compressor.backends.cute.select import config_for, kernel_for  # noqa: E402
from csa_compressor.windows import is_short_window, uses_softmax_stats  # noqa: E402

H200 = offline_spec("sm_90a")

# (name, direction, ratio, coff, head_dim, kernel class): one compile of each kernel class and form, small shapes.
BUILDS = [
    ("short forward", "forward", 4, 2, 128, ForwardShortWindow),
    ("grouped short forward", "forward", 3, 2, 36, ForwardLongWindow),
    ("long forward with stats", "forward_stats", 32, 2, 65, ForwardLongWindow),
    ("streaming forward", "forward", 256, 1, 64, ForwardLongWindow),
    ("short backward", "backward", 2, 2, 24, BackwardShortWindow),
    ("grouped short backward", "backward", 3, 2, 36, BackwardShortWindow),
    ("long backward", "backward", 8, 2, 64, BackwardLongWindow),
    ("stats backward", "backward_stats", 32, 2, 65, BackwardWithStats),
    ("whole-tile stats backward", "backward_stats", 128, 1, 512, BackwardWithStats),
]


def _entries(ptx: str) -> dict[str, str]:
    """Kernel name -> parameter kinds ('p' a 64-bit pointer, 'i' a 32-bit int)."""
    out = {}
    for name, params in ENTRY.findall(ptx):
        kinds = ["p" if ".u64" in p or ".b64" in p else "i" for p in params.split(",") if p.strip()]
        out[name] = "".join(kinds)
    return out


@pytest.fixture(scope="module", params=["sm_90a", "sm_100a"])
def built(request):
    """(arch, name -> (kernel, PTX)) of every entry of BUILDS, compiled once per architecture."""
    arch = request.param
    spec = offline_spec(arch)
    result = {}
    with tempfile.TemporaryDirectory() as dump:
        for name, direction, ratio, coff, head_dim, expected in BUILDS:
            kernel_class, config = kernel_for(direction, ratio, coff, head_dim, spec)
            assert kernel_class is expected, name
            kernel = kernel_class(config)
            result[name] = (kernel, compile_kernel(kernel, arch, dump_dir=dump).artifacts.PTX)
        wide = ForwardShortWindow(kernel_for("forward", 4, 2, 128, spec)[1].wide())
        result["wide forward"] = (wide, compile_kernel(wide, arch, dump).artifacts.PTX)
    return arch, result


@pytest.mark.parametrize("name", [b[0] for b in BUILDS] + ["wide forward"])
def test_kernels_compile_without_local_memory(built, name):
    arch, kernels = built
    kernel, ptx = kernels[name]
    cfg = kernel.config
    assert f".target {arch}" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    entries = _entries(ptx)
    forward = kernel.kind == "forward"
    stats = getattr(cfg, "write_stats", False) or isinstance(cfg, configs.BackwardStatsConfig)
    # Pointers, then B, N and T (and the backward's row range).
    main = "p" * (6 + stats) + "iii" if forward else "p" * (9 + stats) + "iiii"
    reduce = [] if forward or getattr(cfg, "whole_tile", False) else ["ppi"]
    assert sorted(entries.values()) == sorted([main, *reduce]), entries
    # Evict-first window loads in the forwards only; no evict-first stores anywhere.
    assert ("ld.global.cs" in ptx) == (forward and cfg.vector_width > 1)
    assert "st.global.cs" not in ptx
    assert f".reqntid {cfg.threads}, 1, 1" in ptx or f".maxntid {cfg.threads}, 1, 1" in ptx


def test_launch_bounds(built):
    """Launch bounds: the wide forward for WIDE_CTAS_PER_SM, grouped kernels MAX_REGISTERS, none on the exact forward."""
    _arch, kernels = built
    assert f".minnctapersm {configs.WIDE_CTAS_PER_SM}" in kernels["wide forward"][1]
    assert ".minnctapersm" not in kernels["short forward"][1]
    for name in ("long forward with stats", "short backward", "long backward", "whole-tile stats backward"):
        kernel, ptx = kernels[name]
        assert f".minnctapersm {configs.launch_bound(kernel.config.threads)}" in ptx, name
    assert kernels["whole-tile stats backward"][0].config.threads == configs.WHOLE_TILE_THREADS


CONFIG_SPACE = [(r, c, d) for r in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 32, 128, 256) for c in (1, 2)
                for d in (7, 36, 64, 65, 128, 130, 512)]  # fmt: skip


@pytest.mark.parametrize("ratio,coff", sorted({(r, c) for r, c, _ in CONFIG_SPACE}))
def test_selection_follows_the_window_classes(ratio, coff):
    """One power-of-two group: the exact forward, else the grouped one; backward by is_short_window; statistics
    kernels exactly where uses_softmax_stats."""
    for head_dim in (7, 64, 130, 512):
        forward_class, forward = kernel_for("forward", ratio, coff, head_dim, H200)
        window = coff * ratio
        exact = is_short_window(ratio, coff) and window & (window - 1) == 0
        assert forward_class is (ForwardShortWindow if exact else ForwardLongWindow)
        backward_class, backward = kernel_for("backward", ratio, coff, head_dim, H200)
        assert backward_class is (BackwardShortWindow if is_short_window(ratio, coff) else BackwardLongWindow)
        for cfg in (forward, backward):
            assert (cfg.ratio, cfg.coff, cfg.head_dim) == (ratio, coff, head_dim)
            assert cfg.threads <= 512 and cfg.columns_per_cta * cfg.column_chunks >= head_dim
        if uses_softmax_stats(ratio, coff):
            assert kernel_for("forward_stats", ratio, coff, head_dim, H200)[1].write_stats
            stats = config_for("backward_stats", ratio, coff, head_dim, H200)
            assert window % stats.slots_per_cta == 0
        else:
            for direction in ("forward_stats", "backward_stats"):
                with pytest.raises(ValueError, match="direction must be"):
                    config_for(direction, ratio, coff, head_dim, H200)


def test_grouped_configs_tile_the_window():
    for ratio, coff, head_dim in CONFIG_SPACE:
        cfg = config_for("forward", ratio, coff, head_dim, H200)
        if isinstance(cfg, configs.ForwardLongConfig):
            assert cfg.slot_groups * cfg.slots_per_batch * cfg.batches == coff * ratio
        back = config_for("backward", ratio, coff, head_dim, H200)
        if isinstance(back, configs.BackwardLongConfig):
            assert back.slot_groups * back.slots_per_batch * back.batches == coff * ratio
            assert back.smem_bytes <= H200.shared_memory_per_block
            assert back.prefetch_next_row == (coff * ratio <= 128)
        else:
            # The 128-thread tile with its row lanes scaled to SHORT_BACKWARD_THREADS-thread CTAs.
            assert back.slot_groups * back.slots_per_group == coff * ratio
            tile = back.column_threads * back.slot_groups
            assert back.row_lanes == max(1, configs.SHORT_BACKWARD_THREADS // tile)


@pytest.mark.parametrize("sm_count", [132, 148, 114, 40])
def test_whole_tile_form_follows_the_sm_count(sm_count):
    """Whole-tile statistics backward where the tiles fill WHOLE_TILE_FILL of the SMs, else slabs over row ranges."""
    spec = DeviceSpec("sm_90a", sm_count, H200.shared_memory_per_sm, H200.shared_memory_per_block)
    for ratio, coff, head_dim in [(128, 1, 512), (128, 2, 512), (128, 1, 128), (128, 2, 130), (17, 1, 128)]:
        cfg = configs.stats_backward_for_sm90(ratio, coff, head_dim, spec)
        assert cfg.whole_tile == (cfg.tiles >= math.ceil(configs.WHOLE_TILE_FILL * sm_count))
        assert cfg.threads == (configs.WHOLE_TILE_THREADS if cfg.whole_tile else 128)
        assert cfg.slots_per_cta <= max(configs.STATS_MIN_SLOTS, coff * ratio // configs.STATS_CHUNKS)
    # On the H200 exactly the large SPEC ratio-128 cases (128 tiles) take the whole-tile form.
    assert [config_for("backward_stats", 128, c, d, H200).whole_tile for c, d in ((1, 512), (2, 512), (1, 128))] == [
        True, True, False]  # fmt: skip


@pytest.mark.parametrize(
    "ratio,coff,head_dim,wide",
    [(4, 2, 512, False), (4, 2, 384, False), (4, 2, 128, True), (4, 2, 256, True), (8, 1, 64, True),
     (4, 1, 128, False), (4, 2, 65, False)],
)  # fmt: skip
def test_wide_forward_only_for_8_slot_windows_of_several_rows(ratio, coff, head_dim, wide):
    cfg = config_for("forward", ratio, coff, head_dim, H200)
    assert (cfg.wide() is not None) == wide
    if wide:
        assert cfg.wide() == replace(cfg, ctas_per_sm_cap=configs.WIDE_CTAS_PER_SM)


def test_backward_grid_fills_one_wave():
    """Persistent grids: one wave of CTA slots, at most WS_CAP_BYTES of slabs, rows per CTA a multiple of row lanes."""
    short = config_for("backward", 4, 2, 512, H200)
    assert cute_launch.grid_capacity(short, H200) == H200.sm_count  # one 512-thread CTA per SM
    long = config_for("backward", 128, 2, 512, H200)
    by_smem = H200.shared_memory_per_block // (long.smem_bytes + 1024)
    assert cute_launch.grid_capacity(long, H200) == H200.sm_count * min(by_smem, configs.launch_bound(long.threads))
    whole = config_for("backward_stats", 128, 1, 512, H200)
    assert cute_launch.grid_capacity(whole, H200) == whole.tiles

    class Fake:
        def __init__(self, cfg):
            self.row_lanes, self.tiles, self.capacity = cfg.row_lanes, cfg.tiles, cute_launch.grid_capacity(cfg, H200)

    for cfg, n in [(short, 6144), (short, 5), (long, 8192), (whole, 6144), (whole, 3)]:
        rows_per_cta, num_ctas = cute_launch.backward_grid(Fake(cfg), n, cfg.ape_size)
        assert rows_per_cta % cfg.row_lanes == 0 and rows_per_cta * num_ctas >= n
        assert num_ctas * cfg.tiles <= max(cute_launch.grid_capacity(cfg, H200), cfg.tiles)
        assert num_ctas * cfg.ape_size * 4 <= max(cute_launch.WS_CAP_BYTES, cfg.ape_size * 4)
        if cfg.whole_tile:
            assert num_ctas == 1


class _SharedBuffer:
    """A kernel laying out ``floats`` fp32 of shared memory, launched with ``smem`` bytes."""

    def __init__(self, floats: int, smem: int):
        self.floats, self.smem = floats, smem

    @cute.jit
    def __call__(self, out: cute.Pointer, stream: cuda.CUstream):
        self.kernel(out).launch(grid=[1, 1, 1], block=[32, 1, 1], smem=self.smem, stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Pointer):
        tidx, _, _ = cute.arch.thread_idx()
        buffer = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout(self.floats), byte_alignment=16
        )
        buffer[tidx] = Float32(tidx)
        cute.arch.sync_threads()
        cute.make_tensor(out, cute.make_layout(32))[tidx] = buffer[31 - tidx]


@pytest.mark.parametrize(
    "smem, fault",
    [
        (4096, None),
        (8192, None),
        (4095, "less shared memory than the kernel lays out"),
        (64, "less shared memory than the kernel lays out"),
        (300 * 1024, "more shared memory than the architecture has"),
    ],
)
def test_a_launch_with_wrong_shared_memory_is_refused(smem, fault):
    """``build.check_shared_memory`` refuses the build whose launch gives less than its kernel's 4096 bytes, or more
    than an sm_90 CTA may have."""
    out = make_ptr(Float32, 0, AddressSpace.gmem, assumed_align=16)
    options = "--gpu-arch=sm_90a --enable-tvm-ffi"
    compiled = cute.compile(_SharedBuffer(1024, smem), out, cuda.CUstream(0), options=options)
    if fault is None:
        check_shared_memory(compiled, "_SharedBuffer")
    else:
        with pytest.raises(RuntimeError, match=fault):
            check_shared_memory(compiled, "_SharedBuffer")
