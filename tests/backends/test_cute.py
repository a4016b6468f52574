"""GPU tests of the CuTe-DSL backend against the references (numerics, determinism, graphs, streams, threads,
statistics, wide forward, disk cache, malformed inputs); skipped without a supported GPU or nvidia-cutlass-dsl.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from csa_compressor import reference
from csa_compressor.testing import assert_contract, bitwise_equal, make_pack, rel_l2

from .common import child_env, cute_launch

pytestmark = pytest.mark.gpu


def _launch_module():
    """The launch module; the test skips without a GPU, nvidia-cutlass-dsl or a GPU cute supports. Call it before
    importing other cute modules, which need nvidia-cutlass-dsl."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    launch = cute_launch()
    reason = launch.device_unsupported_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    return launch


# (seqlens, head_dim, ratio, coff, token_padding, comp_padding)
CASES = [
    ((37, 4, 3, 64, 129, 8), 128, 4, 2, 5, 3),
    ((37, 4, 3, 64, 129, 8), 128, 4, 1, 0, 2),
    ((1000, 2, 333), 512, 4, 2, 7, 4),
    ((515, 1, 1030, 127, 260), 512, 128, 1, 3, 2),
    ((515, 1, 1030, 127, 260), 128, 128, 2, 0, 3),
    ((33, 5, 64, 2), 128, 2, 1, 1, 2),
    ((33, 5, 64, 2), 128, 2, 2, 1, 2),
    ((81, 7, 40), 128, 8, 1, 2, 1),
    ((81, 7, 40), 64, 8, 2, 2, 1),
    ((37, 4, 64, 129), 65, 4, 2, 3, 2),
    ((37, 4, 64, 129), 36, 4, 1, 0, 1),
    ((41, 100, 7), 130, 16, 2, 2, 2),
    ((3, 2), 128, 4, 2, 4, 3),  # no segment reaches ratio: every row is padding
    # Many segments: deeper bisections of cu_seqlens_comp in every kernel.
    ((37, 4, 3, 64, 129, 8, 16, 5), 64, 4, 2, 2, 1),
    ((9, 40, 4, 17, 3, 64, 2, 130, 5, 11, 7, 33), 128, 4, 2, 3, 2),
    ((300, 128, 5, 260, 1, 129, 400, 127, 256, 3), 128, 128, 1, 2, 2),
]


def _run(launch, pack, stream=None):
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    out = torch.full((n, d), float("nan"), dtype=kv.dtype, device=kv.device)
    gkv = torch.full_like(kv, float("nan"))
    gsc = torch.full_like(score, float("nan"))
    gape = torch.full_like(ape, float("nan"))
    launch.forward(kv, score, ape, cu, cuc, out, pack.ratio, pack.coff, stream)
    launch.backward(kv, score, ape, cu, cuc, pack.grad_out, gkv, gsc, gape, pack.ratio, pack.coff, stream)
    return out, gkv, gsc, gape


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}seg-d{c[1]}-r{c[2]}-c{c[3]}")
def test_numerics_against_references(case):
    launch = _launch_module()
    seqlens, d, ratio, coff, tp, cp = case
    pack = make_pack(seqlens, d, ratio, coff, token_padding=tp, comp_padding=cp, device="cuda", seed=11)
    out, gkv, gsc, gape = _run(launch, pack)
    args = (*pack.inputs,)
    n = pack.total_comp
    ref = reference.forward(*args, ratio=ratio, coff=coff, total_comp=n, precision="fp32")
    r64 = reference.forward(*args, ratio=ratio, coff=coff, total_comp=n, precision="fp64")
    rup = reference.forward(*args, ratio=ratio, coff=coff, total_comp=n, precision="upstream")
    rkv, rsc, _ = reference.backward(*args, pack.grad_out, ratio=ratio, coff=coff, precision="fp32")
    _, _, rape64 = reference.backward(*args, pack.grad_out, ratio=ratio, coff=coff, precision="fp64")
    # NaN canaries: every element was written.
    for t in (out, gkv, gsc, gape):
        assert not torch.isnan(t).any()
    # Forward: no worse than upstream against fp64.
    assert (out.double() - r64).abs().max() <= (rup.double() - r64).abs().max()
    assert rel_l2(gape, rape64) <= 1e-5
    if coff * ratio <= 8:
        # Small windows follow the fp32 reference's operation order: bitwise.
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
        assert torch.equal(gkv.view(torch.int16), rkv.view(torch.int16))
        assert torch.equal(gsc.view(torch.int16), rsc.view(torch.int16))
    # The contract everywhere (1 ulp, or fp32 noise where a sum cancels; exact zeros; dAPE).
    assert_contract(pack, out, (gkv, gsc, gape))


def test_exact_zero_ownership():
    launch = _launch_module()
    pack = make_pack((9, 2, 13, 3, 8), 128, 4, 2, token_padding=6, comp_padding=2, device="cuda", seed=3)
    _, gkv, gsc, _ = _run(launch, pack)
    rkv, rsc, _ = reference.backward(*pack.inputs, pack.grad_out, ratio=4, coff=2, precision="fp32")
    zero = rkv == 0
    assert torch.equal(gkv[zero], torch.zeros_like(gkv[zero]))
    assert torch.equal(gsc[rsc == 0], torch.zeros_like(gsc[rsc == 0]))
    assert (gkv[-6:] == 0).all() and (gsc[-6:] == 0).all()


def test_determinism():
    launch = _launch_module()
    pack = make_pack((700, 300, 2000), 512, 128, 2, token_padding=9, comp_padding=1, device="cuda", seed=5)
    first = _run(launch, pack)
    for _ in range(3):
        again = _run(launch, pack)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))  # fmt: skip


def test_cuda_graph_replay_with_smaller_true_row_count():
    launch = _launch_module()
    ratio, coff, d = 4, 2, 128
    big = make_pack((300, 41, 77), d, ratio, coff, token_padding=8, comp_padding=4, device="cuda", seed=1)
    n = big.total_comp
    kv, score, ape, cu, cuc = (x.clone() for x in big.inputs)
    g = big.grad_out.clone()
    out = torch.empty((n, d), dtype=torch.bfloat16, device="cuda")
    gkv, gsc, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    launch.compile("forward", ratio, coff, d, torch.bfloat16, torch.device("cuda"))
    launch.compile("backward", ratio, coff, d, torch.bfloat16, torch.device("cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
        launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None)
    torch.cuda.current_stream().wait_stream(side)
    scratch_before = dict(launch._SCRATCH)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
        launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None)
    # The captured backward has slabs of its own: the per-stream eager scratch is neither created nor reused.
    assert launch._SCRATCH == scratch_before
    # Eager backwards with more slabs grow the eager scratch afterwards; the graph keeps its own.
    _run(launch, make_pack((2000, 3000), 512, ratio, coff, device="cuda", seed=3))
    torch.cuda.synchronize()
    small = make_pack((100, 9, 50), d, ratio, coff, device="cuda", seed=2)
    ts = small.kv.shape[0]
    kv.zero_()
    score.zero_()
    kv[:ts].copy_(small.kv)
    score[:ts].copy_(small.score)
    ape.copy_(small.ape)
    cu.copy_(small.cu_seqlens)
    cuc.copy_(small.cu_seqlens_comp)
    g.copy_(torch.randn(n, d, device="cuda").to(torch.bfloat16))
    gkv.fill_(float("nan"))
    gsc.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    args = (kv, score, ape, cu, cuc)
    ref = reference.forward(*args, ratio=ratio, coff=coff, total_comp=n, precision="fp32")
    rkv, rsc, _ = reference.backward(*args, g, ratio=ratio, coff=coff, precision="fp32")
    _, _, rape64 = reference.backward(*args, g, ratio=ratio, coff=coff, precision="fp64")
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(gkv.view(torch.int16), rkv.view(torch.int16))
    assert torch.equal(gsc.view(torch.int16), rsc.view(torch.int16))
    assert rel_l2(gape, rape64) <= 1e-5


def test_compile_under_capture_raises():
    launch = _launch_module()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA-graph capture"), torch.cuda.graph(graph):
        launch.compile("forward", 4, 2, 88, torch.bfloat16, torch.device("cuda"))


def test_explicit_stream():
    launch = _launch_module()
    pack = make_pack((200, 77), 128, 4, 2, device="cuda", seed=4)
    expected = _run(launch, pack)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    got = _run(launch, pack, stream=stream)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_threads_sharing_a_stream():
    """grad_ape slabs are per stream: two threads on one stream (different slab sizes) must not interleave calls."""
    import threading

    launch = _launch_module()
    packs = [
        make_pack((300, 41, 77), 128, 4, 2, device="cuda", seed=11),
        make_pack((1000, 2, 333), 512, 128, 1, device="cuda", seed=12),
    ]
    expected = [_run(launch, p) for p in packs]
    torch.cuda.synchronize()
    for p, (out, *grads) in zip(packs, expected, strict=True):
        assert_contract(p, out, grads)  # single-threaded results against the references first
    results: list[list] = [[], []]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(k):
        try:
            barrier.wait()
            for _ in range(20):
                results[k].append(_run(launch, packs[k]))
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for k in range(2):
        for got in results[k]:
            for a, b in zip(expected[k], got, strict=True):
                assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_non_current_device():
    launch = _launch_module()
    pack = make_pack((200, 77), 128, 4, 2, device="cuda:1", seed=4)
    with torch.cuda.device(0):
        out, _, _, _ = _run(launch, pack)
    torch.cuda.synchronize(1)
    ref = reference.forward(*pack.inputs, ratio=4, coff=2, total_comp=pack.total_comp, precision="fp32")
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


# Long windows (coff * ratio > 16): the forward's softmax statistics and the backward that reads them.
STATS_CASES = [c for c in CASES if c[2] * c[3] > 16] + [
    ((700, 300, 2000), 512, 128, 2, 9, 1),
    ((50, 3, 97), 65, 32, 2, 1, 2),
    # Odd windows: one slot per CTA chunk, 16 rows side by side.
    ((200, 5, 61, 90), 128, 17, 1, 2, 1),
    ((300, 40, 7), 36, 33, 1, 1, 2),
]


def _run_stats(launch, pack):
    kv, score, ape, cu, cuc = pack.inputs
    n, d = pack.total_comp, pack.head_dim
    out = torch.full((n, d), float("nan"), dtype=kv.dtype, device=kv.device)
    stats = torch.full((n, 3, d), float("nan"), dtype=torch.float32, device=kv.device)
    grads = tuple(torch.full_like(t, float("nan")) for t in (kv, score, ape))
    launch.forward(kv, score, ape, cu, cuc, out, pack.ratio, pack.coff, None, stats)
    launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, pack.ratio, pack.coff, None, stats)
    return out, stats, grads


@pytest.mark.parametrize("case", STATS_CASES, ids=lambda c: f"{len(c[0])}seg-d{c[1]}-r{c[2]}-c{c[3]}")
def test_softmax_stats_path(case):
    launch = _launch_module()
    seqlens, d, ratio, coff, tp, cp = case
    pack = make_pack(seqlens, d, ratio, coff, token_padding=tp, comp_padding=cp, device="cuda", seed=13)
    out, stats, grads = _run_stats(launch, pack)
    for t in (out, stats, *grads):
        assert not torch.isnan(t).any()  # every element written
    # The statistics variant writes the same output as the plain forward, and statistics of the reference's definition.
    plain, *_ = _run(launch, pack)
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    ref = reference.softmax_stats(*pack.inputs, ratio=ratio, coff=coff, total_comp=pack.total_comp)
    assert torch.equal(stats[:, 0], ref[:, 0])  # the max of identically computed fp32 logits
    torch.testing.assert_close(stats[:, 1:], ref[:, 1:], rtol=2e-5, atol=1e-6)
    assert_contract(pack, out, grads)
    # Bitwise deterministic, and the backward reads the statistics: corrupt ones change the gradients.
    _, _, again = _run_stats(launch, pack)
    for a, b in zip(grads, again, strict=True):
        assert torch.equal(a, b)
    kv, score, ape, cu, cuc = pack.inputs
    wrong = stats.clone()
    wrong[:, 2] += 0.5
    bad = tuple(torch.empty_like(t) for t in (kv, score, ape))
    launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *bad, ratio, coff, None, wrong)
    assert not torch.equal(bad[1], grads[1])


# 8-slot windows of several rows per CTA: launches past one wave take the register-capped build.
WIDE_CONFIGS = [(128, 4, 2), (64, 8, 1), (256, 4, 2)]


@pytest.mark.parametrize("d,ratio,coff", WIDE_CONFIGS, ids=[f"d{d}-r{r}-c{c}" for d, r, c in WIDE_CONFIGS])
def test_wide_forward_for_large_launches(d, ratio, coff):
    launch = _launch_module()
    dev = torch.device("cuda", torch.cuda.current_device())
    launcher = launch._launcher("forward", ratio, coff, d, torch.bfloat16, dev.index)
    assert launcher.wide is not None and launcher.config.wide() is not None
    rows = launcher.wide_rows + 37
    half = rows // 2
    seqlens = (ratio * half + ratio - 1, 3, ratio * (rows - half) + 1)  # tails and a segment with no group
    pack = make_pack(seqlens, d, ratio, coff, token_padding=5, comp_padding=3, device=dev, seed=29)
    assert pack.total_comp >= launcher.wide_rows
    kv, score, ape, cu, cuc = pack.inputs
    out = torch.full((pack.total_comp, d), float("nan"), dtype=kv.dtype, device=dev)
    wide_calls = []
    wide = launcher.wide
    launcher.wide = lambda *args: (wide_calls.append(args[8]), wide(*args))  # args[8]: total_comp
    try:
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
    finally:
        launcher.wide = wide
    assert wide_calls == [pack.total_comp]  # the capped build ran, once, over every row
    ref = reference.forward(*pack.inputs, ratio=ratio, coff=coff, total_comp=pack.total_comp, precision="fp32")
    assert not torch.isnan(out).any()
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    # One row fewer than the threshold takes the default build: same function, bitwise.
    small = out[: launcher.wide_rows - 1].clone().fill_(float("nan"))
    launch.forward(kv, score, ape, cu, cuc, small, ratio, coff, None)
    part = reference.forward(*pack.inputs, ratio=ratio, coff=coff, total_comp=small.shape[0], precision="fp32")
    assert torch.equal(small.view(torch.int16), part.view(torch.int16))


def test_no_wide_forward_for_one_row_per_cta():
    """d512 ratio 4 coff 2 (one row per CTA) has no capped build: a launch of many waves takes the default, exactly."""
    launch = _launch_module()
    dev = torch.device("cuda", torch.cuda.current_device())
    launcher = launch._launcher("forward", 4, 2, 512, torch.bfloat16, dev.index)
    assert launcher.config.rows_per_cta == 1 and launcher.wide is None and launcher.wide_rows == 1 << 62
    pack = make_pack((4 * 1500 + 3, 2, 4 * 700), 512, 4, 2, token_padding=3, comp_padding=2, device=dev, seed=31)
    out = torch.full((pack.total_comp, 512), float("nan"), dtype=pack.kv.dtype, device=dev)
    launch.forward(*pack.inputs, out, 4, 2, None)
    ref = reference.forward(*pack.inputs, ratio=4, coff=2, total_comp=pack.total_comp, precision="fp32")
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def _assert_bitwise(a, b):
    assert not torch.isnan(b).any()
    assert bitwise_equal(a, b)


def _stats_forms(config):
    """The slab and whole-tile forms of a statistics-backward configuration (same thread tile, other row lanes)."""
    from csa_compressor.backends.cute.configs import WHOLE_TILE_THREADS

    tile = config.column_threads * config.slot_groups
    slab = replace(config, whole_tile=False, row_lanes=max(1, 128 // tile))
    whole = replace(config, whole_tile=True, row_lanes=max(1, slab.row_lanes * WHOLE_TILE_THREADS // slab.threads))
    return slab, whole


@pytest.mark.parametrize("case", STATS_CASES, ids=lambda c: f"{len(c[0])}seg-d{c[1]}-r{c[2]}-c{c[3]}")
def test_stats_backward_whole_tile_form(case):
    """Whole-tile form (forced) vs slab form: grad_kv/grad_score bitwise, grad_ape within fp32 summation error; NaN
    canaries, the contract, bitwise run to run."""
    launch = _launch_module()
    from csa_compressor.backends.cute.backward_stats import BackwardWithStats
    from csa_compressor.backends.cute.device import device_spec
    from csa_compressor.backends.cute.select import config_for

    seqlens, d, ratio, coff, tp, cp = case
    pack = make_pack(seqlens, d, ratio, coff, token_padding=tp, comp_padding=cp, device="cuda", seed=47)
    kv, score, ape, cu, cuc = pack.inputs
    spec = device_spec(kv.device.index)
    out, stats, _ = _run_stats(launch, pack)

    def run(config):
        launcher = launch.BackwardLauncher(BackwardWithStats, config, spec)
        grads = tuple(torch.full_like(t, float("nan")) for t in (kv, score, ape))
        launch.call_backward(launcher, (kv, score, ape, cu, cuc, pack.grad_out, *grads), None, stats)
        return grads, launch.backward_grid(launcher, pack.total_comp, ape.numel())

    slab, whole = _stats_forms(config_for("backward_stats", ratio, coff, d, spec))
    slabs, slab_grid = run(slab)
    got, whole_grid = run(whole)
    again, _ = run(whole)
    assert whole_grid[1] == 1 and whole_grid[0] >= pack.total_comp
    assert slab_grid[1] >= 1
    for a, b in zip(slabs[:2], got[:2], strict=True):
        _assert_bitwise(a, b)
    torch.testing.assert_close(got[2], slabs[2], rtol=1e-5, atol=1e-5)
    for a, b in zip(got, again, strict=True):
        _assert_bitwise(a, b)
    assert_contract(pack, out, got)


def test_first_launch_after_compile_may_be_captured():
    """The first launches after compile() can be captured into a CUDA graph; the replay matches the references."""
    launch = _launch_module()
    ratio, coff, d = 4, 2, 72
    pack = make_pack((300, 41, 77), d, ratio, coff, token_padding=3, comp_padding=2, device="cuda", seed=53)
    kv, score, ape, cu, cuc = pack.inputs
    launch.compile("forward", ratio, coff, d, torch.bfloat16, kv.device)
    launch.compile("backward", ratio, coff, d, torch.bfloat16, kv.device)
    out = torch.full((pack.total_comp, d), float("nan"), dtype=kv.dtype, device=kv.device)
    grads = tuple(torch.full_like(t, float("nan")) for t in (kv, score, ape))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
        launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, ratio, coff, None)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.forward(*pack.inputs, ratio=ratio, coff=coff, total_comp=pack.total_comp, precision="fp32")
    rkv, rsc, _ = reference.backward(*pack.inputs, pack.grad_out, ratio=ratio, coff=coff, precision="fp32")
    _assert_bitwise(ref, out)
    _assert_bitwise(rkv, grads[0])
    _assert_bitwise(rsc, grads[1])
    assert_contract(pack, out, grads)


# A fresh process on one cache folder: the first call of a forward and a backward (compile or load), their results.
_CACHE_CHILD = """
import json, sys, time, torch
from csa_compressor.backends.cute import launch
from csa_compressor.testing import make_pack
compiled = []
real = launch.compile_kernel
launch.compile_kernel = lambda kernel, arch: compiled.append(1) or real(kernel, arch)
p = make_pack((1000, 77, 260), 128, 128, 1, token_padding=3, comp_padding=2, device="cuda", seed=59)
kv, score, ape, cu, cuc = p.inputs
out = torch.empty((p.total_comp, 128), dtype=kv.dtype, device="cuda")
grads = [torch.empty_like(t) for t in (kv, score, ape)]
t0 = time.perf_counter()
launch.forward(kv, score, ape, cu, cuc, out, 128, 1, None)
launch.backward(kv, score, ape, cu, cuc, p.grad_out, *grads, 128, 1, None)
torch.cuda.synchronize()
seconds = time.perf_counter() - t0
torch.save([t.cpu() for t in (out, *grads)], sys.argv[1])
print(json.dumps({"compiled": len(compiled), "seconds": seconds}))
"""


def test_a_second_process_loads_the_kernels_and_matches_bitwise(tmp_path):
    """Disk cache: a fresh process compiles, a second loads (no compile) and writes the same bits; times printed."""
    import json
    import subprocess
    import sys

    _launch_module()
    env = child_env(CSA_COMPRESSOR_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for k in range(2):
        res = subprocess.run([sys.executable, "-c", _CACHE_CHILD, str(tmp_path / f"out{k}.pt")], env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0]["compiled"] == 2 and runs[1]["compiled"] == 0  # forward and backward
    first, second = (torch.load(tmp_path / f"out{k}.pt") for k in range(2))
    for a, b in zip(first, second, strict=True):
        _assert_bitwise(a, b)
    print(f"first forward+backward call: cold cache {runs[0]['seconds']:.2f} s, warm cache {runs[1]['seconds']:.2f} s")


# --------------------------------------------------------------------------- inputs a data pipeline gets wrong
# (docs/safety.md); helpers from test_triton_safety (imported where used: it needs triton).

# total_comp below the real row count, every kernel family; statistics backwards in both forms.
TRUNCATED = [
    ((13, 8, 0, 3, 21), 64, 4, 2),  # exact forward, short backward
    ((9, 4, 0, 11), 128, 2, 1),
    ((20, 7, 2, 33), 36, 3, 2),  # grouped forward and short backward (three slot groups)
    ((81, 7, 40), 64, 8, 2),  # grouped forward, long backward without statistics
    ((300, 260), 128, 128, 2),  # long backward, the statistics pair
    ((260, 5, 300), 512, 128, 1),
]


def _nan_grads(pack):
    return tuple(torch.full_like(t, float("nan")) for t in (pack.kv, pack.score, pack.ape))


def _assert_truncated_bitwise(tpack, out, grads):
    """Windows of at most 8 slots: bitwise the fp32 reference of the truncated pack, at the tokens it keeps."""
    from csa_compressor.testing import truncated_pack

    short, keep = truncated_pack(tpack)
    kw = dict(ratio=tpack.ratio, coff=tpack.coff)
    _assert_bitwise(reference.forward(*short.inputs, total_comp=tpack.total_comp, precision="fp32", **kw), out)
    rkv, rsc, _ = reference.backward(*short.inputs, short.grad_out, precision="fp32", **kw)
    _assert_bitwise(rkv, grads[0][keep])
    _assert_bitwise(rsc, grads[1][keep])


@pytest.mark.parametrize("case", TRUNCATED, ids=[f"r{c[2]}c{c[3]}d{c[1]}" for c in TRUNCATED])
def test_undersized_total_comp_matches_truncated_autograd(case):
    """Rows past total_comp are not produced; gradients equal autograd of the truncated reference (bitwise at <= 8
    slots); the statistics forward and both statistics-backward forms too."""
    launch = _launch_module()
    from csa_compressor.backends.cute.backward_stats import BackwardWithStats
    from csa_compressor.backends.cute.device import device_spec
    from csa_compressor.backends.cute.select import config_for
    from tests.backends import test_triton_safety as safety

    seqlens, d, ratio, coff = case
    pack = make_pack(seqlens, d, ratio, coff, token_padding=3, device="cuda", seed=ratio + coff)
    spec = device_spec(pack.kv.device.index)
    stats_too = launch.supports_stats(ratio, coff, d)
    for rows in safety._cuts(pack):
        assert 0 < rows < pack.true_comp
        tpack = replace(pack, total_comp=rows, grad_out=pack.grad_out[:rows].contiguous())
        out = torch.full((rows, d), float("nan"), dtype=pack.kv.dtype, device="cuda")
        launch.forward(*pack.inputs, out, ratio, coff, None)
        assert_contract(tpack, out=out)
        grads = _nan_grads(pack)
        launch.backward(*pack.inputs, tpack.grad_out, *grads, ratio, coff, None)
        safety._assert_matches_autograd(tpack, grads)
        if coff * ratio <= 8:
            _assert_truncated_bitwise(tpack, out, grads)
        if not stats_too:
            continue
        out_s = torch.full_like(out, float("nan"))
        stats = torch.full((rows, 3, d), float("nan"), device="cuda")
        launch.forward(*pack.inputs, out_s, ratio, coff, None, stats)
        _assert_bitwise(out, out_s)
        for config in _stats_forms(config_for("backward_stats", ratio, coff, d, spec)):
            grads = _nan_grads(pack)
            launcher = launch.BackwardLauncher(BackwardWithStats, config, spec)
            launch.call_backward(launcher, (*pack.inputs, tpack.grad_out, *grads), None, stats)
            safety._assert_matches_autograd(tpack, grads)


# Malformed offsets with a non-decreasing cu_seqlens_comp (the rules define the forward exactly): (cu_seqlens,
# cu_seqlens_comp, total_comp) over 44 tokens at ratio 4, scaled for larger ratios.
MONOTONIC_MALFORMED = {
    "beyond_T": ([0, 16, 80], [0, 4, 20], 20),
    "comp_over_count": ([0, 16, 32], [0, 9, 20], 21),
    "comp_start_not_zero": ([0, 16, 40], [3, 7, 13], 12),
    "int32_wrap": ([0, 2**31 - 5, 2**31 - 1], [0, 2**29, 2**30], 7),
    "start_past_T": ([50, 60, 70], [0, 2, 4], 4),
}
FORWARD_FAMILIES = [(4, 2, 64), (2, 1, 128), (3, 2, 36), (8, 2, 64), (16, 2, 64), (128, 1, 512)]


@pytest.mark.parametrize("name", list(MONOTONIC_MALFORMED))
@pytest.mark.parametrize("ratio,coff,d", FORWARD_FAMILIES, ids=[f"r{r}c{c}d{d}" for r, c, d in FORWARD_FAMILIES])
def test_malformed_offsets_forward_follows_the_guard_rules(ratio, coff, d, name):
    """Forwards (statistics too) on malformed offsets vs the reference: bitwise at <= 8 slots, else the contract."""
    launch = _launch_module()
    scale = ratio // 4 if ratio > 4 else 1
    base = make_pack((44 * scale,), d, ratio, coff, device="cuda", seed=61)
    cu, cuc, rows = MONOTONIC_MALFORMED[name]
    cu = [v * scale if abs(v) < 2**20 else v for v in cu]
    grad_out = base.grad_out[:1].expand(rows, d).contiguous()  # the contract's scales need one per row
    pack = replace(base, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"),
                   cu_seqlens_comp=torch.tensor(cuc, dtype=torch.int32, device="cuda"), total_comp=rows,
                   grad_out=grad_out)  # fmt: skip
    out = torch.full((rows, d), float("nan"), dtype=pack.kv.dtype, device="cuda")
    launch.forward(*pack.inputs, out, ratio, coff, None)
    if coff * ratio <= 8:
        _assert_bitwise(reference.forward(*pack.inputs, ratio=ratio, coff=coff, total_comp=rows, precision="fp32"), out)
    assert_contract(pack, out=out)
    if launch.supports_stats(ratio, coff, d):
        out_s = torch.full_like(out, float("nan"))
        stats = torch.full((rows, 3, d), float("nan"), device="cuda")
        launch.forward(*pack.inputs, out_s, ratio, coff, None, stats)
        _assert_bitwise(out, out_s)
        assert bool(torch.isfinite(stats).all())


def test_malformed_offsets_stay_inside_the_operands():
    """test_triton_safety's malformed cases through every cute kernel family between NaN canary rows: canaries
    intact, results finite (memcheck: ``python -m tests.sanitize_cases --backend cute --malformed``)."""
    from tests.sanitize_cases import CUTE_MALFORMED_CONFIGS, malformed_results

    _launch_module()
    results = list(malformed_results("cute"))
    bad = [(case, result) for case, result in results if not all(result.values())]
    assert not bad, bad
    assert len(results) >= 5 * len(CUTE_MALFORMED_CONFIGS)
