"""The cute backend's fused tail (RMSNorm + RoPE in the one-group short-window kernels): offline compiles,
configurations, host-function arguments on the CPU; ``tail.check_backend`` on the GPU.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from types import SimpleNamespace

import pytest
import torch

from .common import ENTRY, cubin_resources, cute_launch

launch = cute_launch()

from csa_compressor import tail as T  # noqa: E402
from csa_compressor.backends.cute import configs, select, tail_configs  # noqa: E402
from csa_compressor.backends.cute.backward_short import BackwardShortWindow  # noqa: E402
from csa_compressor.backends.cute.build import compile_kernel  # noqa: E402
from csa_compressor.backends.cute.device import offline_spec  # noqa: E402
from csa_compressor.backends.cute.forward import ForwardShortWindow  # noqa: E402
from csa_compressor.testing import make_pack  # noqa: E402

H200 = offline_spec("sm_90a")


def spec(norm="fp32", rope_dim=0, interleaved=True, positions=False) -> configs.TailSpec:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[norm]
    return configs.TailSpec.of(T.TailConfig(dtype, rope_dim, interleaved, positions))


# (name, ratio, coff, head_dim, spec): the tail shapes that matter, each compiled forward and backward.
BUILDS = [
    ("r4c2d512-rope64-fp32", 4, 2, 512, spec("fp32", 64)),
    ("r4c2d512-half-bf16-pos", 4, 2, 512, spec("bf16", 64, False, True)),
    ("r4c2d128-rope64-pos", 4, 2, 128, spec("fp32", 64, True, True)),
    ("r2c1d128-rope128-only", 2, 1, 128, spec(None, 128)),
    ("r8c1d512-norm-only", 8, 1, 512, spec("bf16")),
    ("r4c2d65-rope2-pos", 4, 2, 65, spec("fp32", 2, True, True)),
    ("r4c1d7-rope2-half", 4, 1, 7, spec("fp32", 2, False)),
]


def _kinds(params: str) -> str:
    """Parameter kinds: 'p' a 64-bit pointer, 'f' an fp32 scalar, 'i' a 32-bit int."""
    kinds = []
    for p in params.split(","):
        if p.strip():
            kinds.append("p" if (".u64" in p or ".b64" in p) else "f" if ".f32" in p else "i")
    return "".join(kinds)


# Blackwell takes the Hopper tiles (configs.py), so its builds differ by the target alone: a subset there.
SM100_BUILDS = ("r4c2d512-half-bf16-pos", "r4c2d65-rope2-pos")
_BUILT: dict[tuple, tuple] = {}


def _build(arch: str, name: str, direction: str):
    """(kernel, PTX, cubin resources) of one entry of BUILDS, compiled once per session."""
    key = (arch, name, direction)
    if key not in _BUILT:
        _, ratio, coff, head_dim, tail = next(b for b in BUILDS if b[0] == name)
        kernel_class = ForwardShortWindow if direction == "forward" else BackwardShortWindow
        kernel = kernel_class(select.fused_tail_config(direction, ratio, coff, head_dim, offline_spec(arch), tail))
        with tempfile.TemporaryDirectory() as dump:
            artifacts = compile_kernel(kernel, arch, dump_dir=dump).artifacts
            _BUILT[key] = (kernel, artifacts.PTX, cubin_resources(artifacts.CUBIN))
    return _BUILT[key]


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize(
    "arch, name", [("sm_90a", b[0]) for b in BUILDS] + [("sm_100a", name) for name in SM100_BUILDS]
)
def test_fused_kernels_compile(arch, name, direction):
    """Parameter lists, no local memory, row-sum shuffles, correctly rounded rstd, the weight slabs' reduction."""
    kernel, ptx, used = _build(arch, name, direction)
    cfg, tail = kernel.config, kernel.config.tail
    assert f".target {arch}" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert used["frame"] == 0, used  # no spills either
    if direction == "forward" and cfg.ctas_per_sm_cap:
        assert f".minnctapersm {cfg.ctas_per_sm_cap}" in ptx
        assert used["registers"] * cfg.threads * cfg.ctas_per_sm_cap <= configs.REGISTERS_PER_SM, used
    entries = sorted(_kinds(params) for _name, params in ENTRY.findall(ptx))
    if direction == "forward":
        assert entries == ["pppppp" + "iii" + "ppppp" + "fi"]
        assert ("ld.global.cs" in ptx) == (cfg.vector_width > 1)  # the window streams as without a tail
    else:
        reduce = "pppi" if tail.has_norm else "ppi"
        assert entries == sorted(["p" * 9 + "iiii" + "ppppp" + "fi", reduce])
        assert f".minnctapersm {configs.launch_bound(cfg.threads)}" in ptx
    assert f".reqntid {cfg.threads}, 1, 1" in ptx or f".maxntid {cfg.threads}, 1, 1" in ptx
    if tail.has_norm:
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "rcp.rn.f32" in ptx
        assert ("shfl.sync.bfly" in ptx) == (cfg.column_threads > 1)
    # The forward keeps the exact softmax (its quotients by Markstein's sequence), the backward the fast form.
    assert ("%mq" in ptx) == (direction == "forward")


# (name, ratio, coff, head_dim, spec): the long-window forward with the tail, whole rows per CTA.
LONG_BUILDS = [
    ("r128c1d128-rope64", 128, 1, 128, spec("fp32", 64)),
    ("r128c1d128-rope128-half-pos", 128, 1, 128, spec("fp32", 128, False, True)),  # partners across warps
    ("r16c2d512-norm-bf16", 16, 2, 512, spec("bf16")),  # a 512-column row
    ("r16c2d128-rope64-pos", 16, 2, 128, spec("fp32", 64, True, True)),  # two rows per CTA: named barriers
    ("r32c2d64-rope64-half-only", 32, 2, 64, spec(None, 64, False)),  # no norm
    ("r128c1d128-rope64-only", 128, 1, 128, spec(None, 64)),  # two chunks, no norm: plain CTAs, no cluster
    # The whole-row stream (sm_90a; composed on sm_100a): several batches per group, two CTAs per SM.
    ("r128c1d512-stream-rope64", 128, 1, 512, spec("fp32", 64)),
    ("r64c1d512-stream-half-bf16-pos", 64, 1, 512, spec("bf16", 64, False, True)),
]
STREAM_BUILDS = ("r128c1d512-stream-rope64", "r64c1d512-stream-half-bf16-pos")


@pytest.mark.parametrize(
    "arch, name",
    [
        (arch, b[0])
        for arch in ("sm_90a", "sm_100a")
        for b in LONG_BUILDS
        if arch == "sm_90a" or b[0] not in STREAM_BUILDS
    ],
)
def test_long_forward_with_tail_compiles(arch, name):
    """One kernel with the statistics pointer among its parameters, no local memory, the launch bound of its
    threads, row sums by shuffles (across warps: named barriers where a CTA has several rows), correctly rounded
    rstd."""
    from csa_compressor.backends.cute.forward import ForwardLongWindow

    _, ratio, coff, head_dim, tail = next(b for b in LONG_BUILDS if b[0] == name)
    cfg = select.fused_tail_config("forward", ratio, coff, head_dim, offline_spec(arch), tail)
    kernel = select.KERNEL_OF_CONFIG[type(cfg)](cfg)
    assert isinstance(kernel, ForwardLongWindow) and not cfg.signals_dependents
    # A row's column chunks stay separate CTAs where its rotary pairs sit in neighbouring lanes (or it has none);
    # with a norm they are one cluster, their sums of squares crossing it by st.async, counted on each mbarrier.
    pooling = tail_configs.stats_forward_for_sm90(ratio, coff, head_dim, offline_spec(arch))
    in_lanes = tail.rope_dim == 0 or (tail.rope_interleaved and (head_dim - tail.rope_dim) % 2 == 0)
    chunks = pooling.column_chunks
    chunked = name not in STREAM_BUILDS and 1 < chunks <= tail_configs.MAX_CLUSTER_CHUNKS and in_lanes
    assert cfg.column_chunks == (pooling.column_chunks if chunked else 1)
    with tempfile.TemporaryDirectory() as dump:
        artifacts = compile_kernel(kernel, arch, dump_dir=dump).artifacts
        ptx, used = artifacts.PTX, cubin_resources(artifacts.CUBIN)
    assert "ld.local" not in ptx and "st.local" not in ptx and used["frame"] == 0, used
    assert [_kinds(p) for _n, p in ENTRY.findall(ptx)] == ["ppppppp" + "iii" + "ppppp" + "fi"]
    assert f".minnctapersm {cfg.launch_ctas_per_sm}" in ptx
    exchanges = chunked and tail.has_norm
    assert ("st.async.shared::cluster" in ptx) == exchanges and ("barrier.cluster.wait" in ptx) == exchanges
    # Only the norm's exchange makes the chunks one cluster, with its chunk sums and mbarrier in shared memory.
    assert kernel.tail.clustered == exchanges and (kernel.tail.partial_floats() > 0) == exchanges
    assert (cfg == tail_configs.whole_row_stream(ratio, coff, head_dim, tail)) == (name in STREAM_BUILDS)
    # Interleaved rotary partners sit in the neighbouring lane (a shuffle); half-split ones go through shared memory.
    row = kernel.tail.row
    assert row.pairs_in_lanes == (tail.rope_dim > 0 and tail.rope_interleaved and (head_dim - tail.rope_dim) % 2 == 0)
    assert (kernel.tail.exchange_floats() > 0) == (tail.rope_dim > 0 and not row.pairs_in_lanes)
    assert ("shfl.sync.bfly" in ptx) == ((tail.has_norm or row.pairs_in_lanes) and cfg.columns_per_cta > 1)
    # Empty rows' warps skip the tail only where no CTA-wide barrier (the half-split exchange) waits for them, and
    # only as whole warps.
    whole_warps = cfg.rows_per_cta * cfg.columns_per_cta % 32 == 0
    skips = cfg.tail_rows > cfg.rows_per_cta and kernel.tail.exchange_floats() == 0 and whole_warps
    assert kernel.tail.skips_empty_rows == skips
    named = cfg.tail_rows > 1 and cfg.columns_per_cta > 32 and tail.has_norm
    assert bool(re.search(r"bar(rier)?\.sync(\.aligned)?\s+\S+,\s*\d+;", ptx)) == named  # id, thread count
    if tail.has_norm:
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "rcp.rn.f32" in ptx


def test_long_forward_with_tail_only_where_the_tile_allows():
    """The statistics tile of one batch per group widened to whole rows of power-of-two threads, at most
    WHOLE_ROW_THREADS, one column per thread in the tail; else the whole-row stream where it serves the window;
    otherwise the composed route."""
    tail = spec("fp32", 64)
    # Three groups x 4 columns; ragged chunks; several batches per group (streaming windows); more columns than
    # threads per row; two slot halves past WHOLE_ROW_THREADS.
    for ratio, coff, head_dim in ((3, 2, 128), (128, 1, 65), (128, 2, 512), (128, 2, 128), (16, 1, 64), (64, 2, 512)):
        assert tail_configs.long_forward_with_tail(ratio, coff, head_dim, H200, tail) is None
    # Where the widened tile does not fit, d512 windows of one slot half stream each row through one CTA (on
    # sm_90a; sm_100a keeps the composed route).
    for ratio, head_dim in ((128, 512), (64, 512), (16, 512)):
        cfg = tail_configs.long_forward_with_tail(ratio, 1, head_dim, H200, tail)
        assert cfg == tail_configs.whole_row_stream(ratio, 1, head_dim, tail) and cfg.column_chunks == 1
        assert cfg.threads == tail_configs.WHOLE_ROW_THREADS and cfg.tail_rows == cfg.rows_per_cta == 1
        assert cfg.batches * cfg.slot_groups * cfg.slots_per_batch == ratio and cfg.launch_ctas_per_sm == 2
        assert cfg.write_stats and not cfg.signals_dependents and cfg.tail == tail
        assert tail_configs.long_forward_with_tail(ratio, 1, head_dim, H200, tail, stream_rows=False) is None
        assert tail_configs.fused_forward_for_sm100(ratio, 1, head_dim, offline_spec("sm_100a"), tail) is None
    # Where the widened tile fits: the pooling's own tile, a row's chunks separate CTAs, with interleaved pairs (or no
    # rotation) and at most MAX_CLUSTER_CHUNKS chunks; the widened tile with half-split pairs (they cross chunks),
    # one chunk or more chunks.
    for ratio, coff, head_dim in ((128, 1, 128), (64, 2, 128), (16, 2, 512), (16, 2, 128), (32, 2, 64)):
        stats = tail_configs.stats_forward_for_sm90(ratio, coff, head_dim, H200)
        chunks = stats.column_chunks
        clustered = tail_configs.long_forward_with_tail(ratio, coff, head_dim, H200, tail)
        half = spec("fp32", 64, False)
        cfg = tail_configs.long_forward_with_tail(ratio, coff, head_dim, H200, half)
        widened = dataclasses.replace(cfg, tail=tail)
        cluster = dataclasses.replace(stats, tail=tail, signals_dependents=False)
        assert clustered == (cluster if 1 < chunks <= tail_configs.MAX_CLUSTER_CHUNKS else widened)
        assert cfg.column_chunks == 1 and cfg.column_threads == stats.column_threads * chunks
        assert cfg.rows_per_cta == max(1, stats.rows_per_cta // chunks) and cfg.tail == half
        assert (cfg.slot_groups, cfg.slots_per_batch, cfg.batches) == (
            stats.slot_groups, stats.slots_per_batch, stats.batches)  # fmt: skip
        assert cfg.threads <= tail_configs.WHOLE_ROW_THREADS and cfg.threads % cfg.columns_per_cta == 0
        assert cfg.batches == 1 and cfg.tail_rows >= cfg.rows_per_cta
        assert cfg.write_stats and not cfg.signals_dependents


CONFIG_SPACE = [(r, c) for r in (1, 2, 3, 4, 5, 8, 16, 32, 128) for c in (1, 2)]


@pytest.mark.parametrize("pairs", ["interleaved", "half"])
@pytest.mark.parametrize("ratio,coff", CONFIG_SPACE)
def test_fused_configs_exactly_for_one_power_of_two_group(ratio, coff, pairs):
    """Short fused configurations exist exactly for one power-of-two slot group; whole rows, power-of-two threads,
    the pooling kernel's vectors; defaults without a tail unchanged. Other windows: the long-window forward and the
    statistics backward with the tail."""
    tail = spec("fp32", 64, pairs == "interleaved", True)
    for head_dim in (7, 64, 65, 128, 130, 512):
        for direction, kernel_class in (("forward", ForwardShortWindow), ("backward", BackwardShortWindow)):
            fused = select.fused_tail_config(direction, ratio, coff, head_dim, H200, tail)
            default_class, default = select.kernel_for(direction, ratio, coff, head_dim, H200)
            if default_class is not kernel_class or getattr(default, "slot_groups", 1) != 1:
                if direction == "backward":
                    # The statistics backward's slab form with the tail; whole tiles are composed.
                    assert fused == tail_configs.stats_backward_with_tail(ratio, coff, head_dim, H200, tail)
                    plain = configs.stats_backward_for_sm90(ratio, coff, head_dim, H200)
                    assert (fused is None) == plain.whole_tile, (ratio, coff, head_dim)
                    if fused is not None:
                        assert (fused.threads, fused.tail) == (plain.threads, tail)
                        assert fused.terms_in_warp or fused.tiles == plain.tiles
                else:
                    assert fused == tail_configs.long_forward_with_tail(ratio, coff, head_dim, H200, tail)
                continue
            assert fused is not None and fused.tail == tail and default.tail is None
            assert fused.column_chunks == 1 and fused.columns_per_cta >= head_dim
            assert fused.column_threads & (fused.column_threads - 1) == 0
            assert fused.vector_width == default.vector_width and fused.threads % 32 == 0
            same_tile = dataclasses.replace(default, tail=tail)
            if direction == "forward":
                # One-row CTAs are built for fewer registers (more of them resident); other tiles keep the default.
                one_row = fused.rows_per_cta == 1 and fused.threads == tail_configs.FUSED_FORWARD_THREADS
                one_row = one_row and tail.rope_interleaved
                budget = tail_configs.ONE_ROW_FORWARD_REGISTERS * fused.threads
                want = configs.REGISTERS_PER_SM // budget if one_row else 0
                assert fused.ctas_per_sm_cap == want, (ratio, coff, head_dim)
                same_tile = dataclasses.replace(same_tile, ctas_per_sm_cap=want)
            if default.column_chunks == 1 and default.column_threads == fused.column_threads:
                assert same_tile == fused
    with pytest.raises(ValueError, match="direction"):
        select.fused_tail_config("forward_stats", 4, 2, 128, H200, tail)


def test_tail_spec_and_slabs():
    """TailSpec.of maps a TailConfig; a fused norm adds head_dim slab entries, reduced after grad_ape's."""
    assert spec("bf16", 64, False, True) == configs.TailSpec(True, False, 64, False, True)
    assert spec(None, 2) == configs.TailSpec(False, False, 2, True, False)
    assert spec("fp32", 0, False, True) == configs.TailSpec(True, True, 0, True, False)  # no rotation: one spec
    for head_dim, vector in ((512, 4), (65, 1), (130, 1)):
        back = select.fused_tail_config("backward", 4, 2, head_dim, H200, spec("fp32"))
        assert back.slab_entries == back.ape_size + head_dim
        assert back.reduce.norm_entries == head_dim and back.reduce.slab_size == back.slab_entries
        assert back.reduce.vector == vector
    rope_only = select.fused_tail_config("backward", 4, 2, 512, H200, spec(None, 64))
    assert rope_only.slab_entries == rope_only.ape_size and rope_only.reduce.norm_entries == 0
    default = select.config_for("backward", 4, 2, 512, H200)
    assert default.slab_entries == default.ape_size and default.reduce == configs.ApeReduceConfig(default.ape_size, 4)
    # The fused backward's shared memory adds the row sums' two buffers where a row spans warps.
    fused = select.fused_tail_config("backward", 4, 2, 512, H200, spec("fp32"))
    plain = dataclasses.replace(fused, tail=None)
    assert fused.smem_bytes - plain.smem_bytes == 4 * 2 * fused.row_lanes * 2 * (fused.column_threads // 32)


def _signature(function) -> str:
    with pytest.raises(TypeError, match="Expects") as info:
        function()
    text = str(info.value)
    return text[text.index("fused_host(") + len("fused_host(") : text.rindex(")")]


def test_host_function_signatures(tmp_path, monkeypatch):
    """Host functions take the existing arguments, the tail's pointers, norm_eps, max_position, the stream."""
    monkeypatch.setenv("CSA_COMPRESSOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_FUNCTIONS", {})
    tail = spec("fp32", 64)
    pointers = "kv score ape cu_seqlens cu_seqlens_comp".split()
    tail_pointers = "norm_weight rope_cos rope_sin position_start rstd".split()
    scalars = ["norm_eps: float32", "max_position: int32", "stream: Stream"]
    cfg = select.fused_tail_config("forward", 4, 2, 64, H200, tail)
    forward = launch.host_function(ForwardShortWindow, cfg, "sm_90a")
    want = [f"{p}: DataPointer" for p in [*pointers, "out", "stats"]]
    want += [f"{i}: int32" for i in ("segments", "total_comp", "tokens")]
    assert _signature(forward) == ", ".join(want + [f"{p}: DataPointer" for p in tail_pointers] + scalars)
    cfg = select.fused_tail_config("backward", 4, 2, 64, H200, tail)
    backward = launch.host_function(BackwardShortWindow, cfg, "sm_90a")
    grads = "grad_out grad_kv grad_score grad_ape slabs stats".split()
    want = [f"{p}: DataPointer" for p in [*pointers, *grads]]
    want += [f"{i}: int32" for i in ("segments", "total_comp", "tokens", "rows_per_cta", "num_ctas")]
    want += [f"{p}: DataPointer" for p in [*tail_pointers, "grad_norm_weight"]]
    assert _signature(backward) == ", ".join(want + scalars)


# ---------------------------------------------------------------- GPU: the kernels against the references


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _nan(shape, dtype=torch.float32, device="cuda"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _tail_pointers(tail: T.Tail, rstd):
    return [_ptr(tail.norm_weight), _ptr(tail.rope_cos), _ptr(tail.rope_sin), _ptr(tail.position_start), _ptr(rstd)]


def _tail_scalars(tail: T.Tail):
    max_position = tail.rope_cos.shape[0] if tail.has_rope else 1
    return [float(tail.norm_eps), max_position]


def _function(direction, kernel_class, tail: T.Tail, ratio, coff, head_dim, device):
    from csa_compressor.backends.cute.device import device_spec

    dev = device_spec(device.index or 0)
    cfg = select.fused_tail_config(direction, ratio, coff, head_dim, dev, configs.TailSpec.of(tail.config))
    assert cfg is not None
    return cfg, dev, launch.host_function(kernel_class, cfg, dev.arch)


def fused_forward(kv, score, ape, cu, cuc, tail, *, ratio, coff, total_comp, rstd=None):
    """The fused forward's output (NaN-filled before the launch); ``rstd`` a buffer it fills."""
    head_dim = kv.shape[1] // coff
    _cfg, _dev, function = _function("forward", ForwardShortWindow, tail, ratio, coff, head_dim, kv.device)
    out = _nan((total_comp, head_dim), kv.dtype, kv.device)
    stream = torch.cuda.current_stream(kv.device).cuda_stream
    function(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu.data_ptr(), cuc.data_ptr(), out.data_ptr(), 0,
             cu.shape[0] - 1, total_comp, kv.shape[0], *_tail_pointers(tail, rstd), *_tail_scalars(tail),
             stream)  # fmt: skip
    return out


def fused_backward(kv, score, ape, cu, cuc, grad_out, tail, *, ratio, coff, rstd=None):
    """The fused backward's gradients, every buffer NaN-filled first."""
    head_dim = grad_out.shape[1]
    cfg, dev, function = _function("backward", BackwardShortWindow, tail, ratio, coff, head_dim, kv.device)
    n = grad_out.shape[0]
    grid = SimpleNamespace(row_lanes=cfg.row_lanes, tiles=cfg.tiles, capacity=launch.grid_capacity(cfg, dev))
    rows_per_cta, num_ctas = launch.backward_grid(grid, n, cfg.slab_entries)
    slabs = _nan((num_ctas * cfg.slab_entries,), device=kv.device)
    grad_kv, grad_score = _nan(kv.shape, kv.dtype, kv.device), _nan(kv.shape, kv.dtype, kv.device)
    grad_ape = _nan(ape.shape, device=kv.device)
    grad_w = _nan((head_dim,), device=kv.device) if tail.has_norm else None
    stream = torch.cuda.current_stream(kv.device).cuda_stream
    function(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu.data_ptr(), cuc.data_ptr(), grad_out.data_ptr(),
             grad_kv.data_ptr(), grad_score.data_ptr(), grad_ape.data_ptr(), slabs.data_ptr(), 0, cu.shape[0] - 1, n,
             kv.shape[0], rows_per_cta, num_ctas, *_tail_pointers(tail, rstd), _ptr(grad_w), *_tail_scalars(tail),
             stream)  # fmt: skip
    return grad_kv, grad_score, grad_ape, grad_w


def _with_rstd(forward_fn, backward_fn):
    """The pair with the forward's rstd saved and handed to the backward (as the autograd does)."""
    saved = {}

    def fwd(kv, score, ape, cu, cuc, tail, *, ratio, coff, total_comp):
        rstd = _nan((total_comp,), device=kv.device)
        saved["rstd"] = rstd
        return forward_fn(kv, score, ape, cu, cuc, tail, ratio=ratio, coff=coff, total_comp=total_comp, rstd=rstd)

    def bwd(kv, score, ape, cu, cuc, grad_out, tail, *, ratio, coff):
        return backward_fn(kv, score, ape, cu, cuc, grad_out, tail, ratio=ratio, coff=coff, rstd=saved["rstd"])

    return fwd, bwd


# (ratio, coff, head_dim, seqlens, token_padding, comp_padding, random_tail keywords)
GPU_CASES = {
    "r4c2d512-rope64": (4, 2, 512, (4096, 37, 3, 0, 1030), 5, 3, dict(rope_dim=64)),
    "r4c2d512-half-bf16w-pos": (4, 2, 512, (2050, 9, 515), 0, 2,
                                dict(rope_dim=64, interleaved=False, norm_dtype=torch.bfloat16, positions=True)),
    "r4c2d128-rope64-pos": (4, 2, 128, (3000, 5, 2, 777), 3, 4, dict(rope_dim=64, positions=True)),
    "r4c2d128-rope128-half": (4, 2, 128, (600, 13), 0, 1, dict(rope_dim=128, interleaved=False)),
    "r2c1d128-rope2-only": (2, 1, 128, (1001, 1, 64), 1, 2, dict(norm=False, rope_dim=2, positions=True)),
    "r8c1d512-norm": (8, 1, 512, (1024, 15, 7), 0, 2, dict()),
    "r8c1d64-rope64-half-pos": (8, 1, 64, (333, 8, 0, 90), 2, 1, dict(rope_dim=64, interleaved=False, positions=True)),
    "r4c2d65-rope2-pos": (4, 2, 65, (257, 3, 40), 2, 2, dict(rope_dim=2, positions=True)),
    "r4c1d7-rope6-half": (4, 1, 7, (131, 6, 2), 0, 3, dict(rope_dim=6, interleaved=False)),
    "r2c1d66-rope64-half-pos": (2, 1, 66, (91, 4), 0, 1, dict(rope_dim=64, interleaved=False, positions=True)),
    "r4c2d72-rope64-bf16w-pos": (4, 2, 72, (120, 5), 0, 1, dict(rope_dim=64, norm_dtype=torch.bfloat16,
                                                                 positions=True)),
    "r1c2d96-rope32": (1, 2, 96, (50, 3), 1, 2, dict(rope_dim=32)),
    "r4c2d8-padding-only": (4, 2, 8, (3, 2, 1), 0, 2, dict(rope_dim=8, positions=True)),
}  # fmt: skip


def gpu_case(name, seed=0):
    ratio, coff, head_dim, seqlens, tok_pad, comp_pad, tail_kw = GPU_CASES[name]
    pack = make_pack(seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, seed=seed,
                     device="cuda")  # fmt: skip
    return pack, T.random_tail(pack, seed=seed + 5, **tail_kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_fused_pair_meets_the_contract(name):
    pack, tail = gpu_case(name, seed=3)
    report = T.check_backend(fused_forward, fused_backward, pack, tail)
    print(name, report)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["r4c2d512-rope64", "r4c2d128-rope64-pos", "r4c2d65-rope2-pos", "r8c1d512-norm"])
def test_fused_pair_with_the_saved_rstd(name):
    """The forward fills rstd (every row), the backward reads it."""
    pack, tail = gpu_case(name, seed=4)
    T.check_backend(*_with_rstd(fused_forward, fused_backward), pack, tail)
    rstd = _nan((pack.total_comp,))
    fused_forward(*pack.inputs, tail, ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp, rstd=rstd)
    x = T.pooled_rows(*pack.inputs, ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp, dtype=torch.float32)
    want = T.row_rstd(x, tail.norm_eps)[:, 0]
    torch.testing.assert_close(rstd, want, rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_rstd_is_one_without_a_norm():
    pack, tail = gpu_case("r2c1d128-rope2-only", seed=5)
    rstd = _nan((pack.total_comp,))
    fused_forward(*pack.inputs, tail, ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp, rstd=rstd)
    assert bool((rstd == 1.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_positions_outside_the_tables_rotate_by_nothing(interleaved):
    """Positions outside [0, max_position) use cos 1, sin 0 and read nothing outside the (NaN-bordered) tables."""
    pack, tail = gpu_case("r4c2d128-rope64-pos", seed=6)
    tail = dataclasses.replace(tail, rope_interleaved=interleaved)
    keep = tail.rope_cos.shape[0] // 2
    storage = [torch.full_like(t, float("nan")) for t in (tail.rope_cos, tail.rope_sin)]
    for full, t in zip(storage, (tail.rope_cos, tail.rope_sin), strict=True):
        full[:keep] = t[:keep]
    cut = dataclasses.replace(tail, rope_cos=storage[0][:keep], rope_sin=storage[1][:keep])
    extended = dataclasses.replace(tail, rope_cos=tail.rope_cos.clone(), rope_sin=tail.rope_sin.clone())
    extended.rope_cos[keep:] = 1.0
    extended.rope_sin[keep:] = 0.0
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    out = fused_forward(*pack.inputs, cut, total_comp=pack.total_comp, **kw)
    assert not bool(torch.isnan(out).any())
    report = T.contract_report(pack, extended, out=out)
    assert report["fwd_beyond"] == 0, report
    grads = fused_backward(*pack.inputs, pack.grad_out, cut, **kw)
    report = T.contract_report(pack, extended, grads=grads)
    assert report["ok"], report
