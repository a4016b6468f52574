"""The bench on the CPU: case selection, the floor, the timer's arithmetic and queueing, the fused-tail baselines,
the records, the report and the chart, and run_bench's two passes with a stand-in timer. GPU runs at the end."""

from __future__ import annotations

import json
import sys
import types
import typing
from collections import namedtuple

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval

from csa_compressor import bench
from csa_compressor.bench import (
    CASES,
    CUDNN_FRONTEND_H200,
    BenchResult,
    Case,
    DeviceActivity,
    floor_bytes,
    floor_us,
    format_markdown,
    kernel_us_per_call,
    make_record,
    parse_case,
    select_backends,
    select_cases,
    select_directions,
)
from csa_compressor.bench import calls as bench_calls
from csa_compressor.bench import cases as bench_cases
from csa_compressor.bench import run as bench_run
from csa_compressor.bench import timer as bench_timer
from csa_compressor.testing import bf16_ulp_distance

# The published floors (fwd, bwd), us, at the copy rate they were computed with (4.22 TB/s rounded; the rows
# imply 4.21-4.22, so they are matched to 0.6 %).
PUBLISHED_FLOORS = {
    "1x8192-d128-r4-c2": (2.1, 4.1),
    "3x8192-d128-r4-c2": (6.3, 12.3),
    "1x8192-d512-r4-c2": (8.5, 16.4),
    "3x8192-d512-r4-c2": (25.4, 49.2),
    "1x8192-d128-r128-c1": (1.0, 2.0),
    "1x65536-d512-r128-c2": (63.9, 127.7),
    "3x8192-d512-r128-c1": (12.0, 24.0),
}
PUBLISHED_RATE = 4.213e12


# ---------------------------------------------------------------- cases and selections


def test_case_matrix():
    assert [c.name for c in CASES] == list(PUBLISHED_FLOORS) == list(CUDNN_FRONTEND_H200)
    assert CASES[1].seqlens == (8192, 8192, 8192)
    assert (CASES[5].total_tokens, CASES[5].total_comp) == (65536, 512)
    tail = Case((8192,), 512, 4, 2, tail=True)
    assert tail.name == "1x8192-d512-r4-c2-tail" and tail.rope_dim == 64 and tail.pooling == CASES[2]
    assert CASES[0].rope_dim == 0 and Case((64,), 33, 4, 1, tail=True).rope_dim == 32


@pytest.mark.parametrize(
    "text",
    ["3x8192-d512-r4-c2", "3x8192 d512 r4 c2", "3x8192_d512_r4_c2", " 3X8192-D512-R4-C2 ", "3x8192d512r4c2"],
)
def test_parse_case_spellings(text):
    assert parse_case(text) == Case((8192,) * 3, 512, 4, 2)
    assert parse_case(text + "-tail") == Case((8192,) * 3, 512, 4, 2, tail=True)


@pytest.mark.parametrize(
    "text", ["", "3x8192", "3x8192-d512-r4", "x8192-d512-r4-c2", "1x8192-d128-r4-c3", "0x8-d8-r4-c1", "1x8-d8-r4-c1-x"]
)
def test_parse_case_rejects(text):
    with pytest.raises(ValueError):
        parse_case(text)


def test_case_names_round_trip():
    for case in CASES:
        assert parse_case(case.name) == case
        assert parse_case(case.name + "-tail").pooling == case
    assert Case((100, 50), 64, 4, 1).name == "100+50-d64-r4-c1"


def test_select_cases_and_tail_modes():
    tails = [Case(c.seqlens, c.head_dim, c.ratio, c.coff, True) for c in CASES]
    assert select_cases(None) == list(CASES)
    assert select_cases(None, "on") == list(CASES) + tails
    assert select_cases(None, "only") == tails
    assert select_cases(["0", "6"]) == [CASES[0], CASES[6]]
    assert select_cases(["0,3", "3"], "on") == [CASES[0], CASES[3], tails[0], tails[3]]
    assert select_cases(["1x65536 d512 r128 c2-tail"], "off") == [tails[5]]  # a tail named explicitly stays
    assert select_cases(["2x4096-d256-r8-c2"]) == [Case((4096, 4096), 256, 8, 2)]  # off the matrix
    with pytest.raises(ValueError, match="out of range"):
        select_cases(["7"])
    with pytest.raises(ValueError, match="tail mode"):
        select_cases(None, "sometimes")


def test_select_backends():
    assert select_backends(None, ["triton", "reference"]) == (["triton", "torch.compile", "eager"], [])
    assert select_backends(None, ["reference"]) == (["reference", "torch.compile", "eager"], [])
    assert select_backends(["all"], ["triton", "reference"]) == (["triton", "reference", "torch.compile", "eager"], [])
    chosen, unavailable = select_backends(["eager,compile", "reference"], ["cute", "triton", "reference"])
    assert chosen == ["reference", "torch.compile", "eager"] and unavailable == []
    assert select_backends(["cute", "eager"], ["reference"]) == (["eager"], ["cute"])
    with pytest.raises(ValueError, match="unknown backend"):
        select_backends(["cuda"], ["reference"])
    with pytest.raises(ValueError, match="cute cannot run"):
        bench.resolve_backends(["cute"], ["reference"])


def test_select_directions_and_what_they_mean():
    assert select_directions(None) == ["fwd", "bwd"]
    assert select_directions(["bwd,fwd"]) == ["fwd", "bwd"]
    with pytest.raises(ValueError):
        select_directions(["both"])
    assert bench.measured_direction("eager", "bwd") == "fwd+bwd"
    assert bench.measured_direction("cute+torch tail", "bwd") == "fwd+bwd"
    assert bench.measured_direction("torch.compile", "fwd") == "fwd"
    assert bench.measured_direction("triton", "bwd") == "bwd"


def test_rows_of_a_tail_case():
    chosen = ["cute", "triton", "reference", "torch.compile", "eager"]
    assert bench_cases.case_backends(CASES[0], chosen) == chosen
    assert bench_cases.case_backends(Case((64,), 8, 4, 1, True), chosen) == [
        "cute", "triton", "cute+torch tail", "triton+torch tail", "torch.compile", "eager",
    ]  # fmt: skip


# ---------------------------------------------------------------- floor


def test_floor_bytes_formula():
    case = Case((8192,), 128, 4, 2)
    t, width, n, d = 8192, 256, 2048, 128
    assert floor_bytes(case, "fwd") == 2 * t * width * 2 + n * d * 2
    assert floor_bytes(case, "bwd") == 4 * t * width * 2 + n * d * 2
    assert floor_bytes(case, "fwd+bwd") == floor_bytes(case, "fwd") + floor_bytes(case, "bwd")
    assert floor_bytes(Case((10, 7), 8, 4, 1), "fwd") == 2 * 17 * 8 * 2 + 3 * 8 * 2  # tails of segments: no row
    tail = Case((8192,), 128, 4, 2, True)
    assert floor_bytes(tail, "fwd") == floor_bytes(case, "fwd") + n * 64 * 4 + d * 2  # cos / sin rows, weight
    assert floor_bytes(tail, "bwd") == floor_bytes(case, "bwd") + n * 64 * 4 + d * 2 + d * 4  # + fp32 grad weight
    with pytest.raises(ValueError):
        floor_bytes(case, "sideways")
    with pytest.raises(ValueError):
        floor_us(case, "fwd", 0.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_floor_matches_the_published_table(case):
    fwd, bwd = PUBLISHED_FLOORS[case.name]
    assert floor_us(case, "fwd", PUBLISHED_RATE) == pytest.approx(fwd, rel=0.006, abs=0.05)
    assert floor_us(case, "bwd", PUBLISHED_RATE) == pytest.approx(bwd, rel=0.006, abs=0.05)


def test_copy_rate():
    # 1 GB copied in a median of 0.5 ms: 2 GB moved (read + write) -> 4 TB/s.
    assert bench.copy_rate(10**9, [0.4e-3, 0.5e-3, 0.9e-3]) == pytest.approx(4e12)


# ---------------------------------------------------------------- timer arithmetic


def test_kernel_us_per_call_subtracts_the_timers_work_and_skips_annotations():
    acts = [
        DeviceActivity("flush_fill", 30.0, start_us=0.0),
        DeviceActivity("fused_fwd", 5.0, start_us=31.0),
        DeviceActivity("memset", 1.0, start_us=36.5),
        DeviceActivity("csa_bench.l2_flush", 31.0, is_user_annotation=True, start_us=0.0),
        DeviceActivity("Torch-Compiled Region: 0/0", 7.0, is_user_annotation=True, start_us=31.0),
        DeviceActivity("flush_fill", 30.0, start_us=40.0),
        DeviceActivity("fused_fwd", 7.0, start_us=71.0),
    ]
    assert kernel_us_per_call(acts, calls=2, excluded_us=60.0) == pytest.approx(6.5)
    assert kernel_us_per_call(acts[1:3], calls=1) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        kernel_us_per_call(acts, calls=0)
    with pytest.raises(ValueError, match="own device time"):
        kernel_us_per_call(acts[1:2], calls=1, excluded_us=60.0)


def act(start, dur, ann=False):
    """A device activity named k."""
    return DeviceActivity("k", dur, ann, start)


Kernel = namedtuple("Kernel", "name device duration")


def test_busy_time_counts_overlapping_kernels_once():
    assert bench.busy_us([]) == 0.0
    # Serial kernels: the sum of durations; a dependent that starts under its predecessor: their common span once.
    assert bench.busy_us([act(0, 4), act(5, 2)]) == pytest.approx(6.0)
    assert bench.busy_us([act(0, 4), act(1, 5), act(10, 1), act(0, 20, ann=True)]) == pytest.approx(7.0)
    assert bench.busy_us([act(2, 1), act(0, 5)]) == pytest.approx(5.0)  # order-free, nested
    assert kernel_us_per_call([act(0, 4), act(3, 3)], calls=1) == pytest.approx(6.0)


def test_device_idle_counts_gaps_between_busy_spans():
    assert bench.device_idle([]) == (0.0, 0.0)
    # Busy 0-10, 5-12 (overlap), idle 12-20, busy 20-25, an annotation over the gap does not fill it, idle 25-26.
    acts = [act(0, 10), act(5, 7), act(20, 5), act(11, 9, ann=True), act(26, 1)]
    assert bench.device_idle(acts) == pytest.approx((9.0, 8.0))
    assert bench.device_idle([act(3, 1), act(0, 3)]) == (0.0, 0.0)  # order-free; back to back is not idle


def test_range_device_us_walks_the_range_tree():
    class Ev:
        def __init__(self, kernels=(), children=()):
            self.kernels, self.cpu_children = list(kernels), list(children)

    fill = Ev([Kernel("FillFunctor<double>", 0, 25.0)])
    rng = Ev([Kernel(bench_timer.FLUSH_RANGE, 0, 26.0)], children=[Ev(children=[fill]), Ev()])
    assert bench.range_device_us(rng) == pytest.approx(25.0)  # the range's own GPU mirror is skipped
    assert bench.range_device_us(Ev()) == 0.0


def test_range_device_us_on_real_profiler_events():
    # The attribute names the walk relies on, on this torch version (CPU only: no kernels, so 0).
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(bench_timer.FLUSH_RANGE):
            torch.ones(1000).fill_(2.0)
    ranges = [e for e in prof.events() if e.name == bench_timer.FLUSH_RANGE]
    assert len(ranges) == 1 and bench_timer.is_annotation(ranges[0])
    assert any(c.name == "aten::fill_" or c.cpu_children for c in ranges[0].cpu_children)
    assert bench.range_device_us(ranges[0]) == 0.0
    assert hasattr(ranges[0].time_range, "start") and ranges[0].time_range.elapsed_us() >= 0


class _Event:
    """A stand-in for the profiler's FunctionEvent."""

    def __init__(self, name, start, dur, device=DeviceType.CUDA, annotation=False, kernels=()):
        self.name, self.device_type, self.time_range = name, device, Interval(start, start + dur)
        self.is_user_annotation, self.kernels, self.cpu_children = annotation, list(kernels), []


SPIN = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def _profile(calls, kernel_us, gap_us=0.0, cold=True, spin_us=100.0, spin_before_us=0.0):
    """Events of one profiled loop: the queue spin, then per call (a spin,) (the flush under its range,) the kernel."""
    events, t = [_Event(SPIN, 0.0, spin_us)], spin_us
    for _ in range(calls):
        if spin_before_us:
            events.append(_Event(SPIN, t, spin_before_us))
            t += spin_before_us
        if cold:
            events.append(_Event(bench_timer.FLUSH_RANGE, 0.0, 1.0, DeviceType.CPU, True, [Kernel("fill", 0, 30.0)]))
            events.append(_Event(bench_timer.FLUSH_RANGE, t, 30.0, annotation=True))
            events.append(_Event("void at::native::FillFunctor<double>", t, 30.0))
            t += 30.0
        t += gap_us
        events.append(_Event("csa_fwd_kernel", t, kernel_us))
        t += kernel_us
    return events


def test_split_profile_finds_the_flush_and_the_spin():
    acts, flush_us, spins = bench_timer.split_profile(_profile(3, 2.0), calls=3, cold=True)
    assert flush_us == pytest.approx(90.0) and [s.duration_us for s in spins] == [100.0]
    measured = [a for a in acts if a is not spins[0]]
    assert kernel_us_per_call(measured, 3, flush_us) == pytest.approx(2.0)
    # No kernel attached to the flush range: the float64 fills are found by name.
    events = [e for e in _profile(2, 2.0) if e.device_type == DeviceType.CUDA]
    assert bench_timer.split_profile(events, calls=2, cold=True)[1] == pytest.approx(60.0)
    with pytest.raises(RuntimeError, match="flush"):
        bench_timer.split_profile(events, calls=3, cold=True)
    with pytest.raises(RuntimeError, match="no device activity"):
        bench_timer.split_profile([], calls=1, cold=False)


class _ScriptedTimer(bench.Timer):
    """The timer's logic over scripted profiles (no device)."""

    def __init__(self, profiles):
        self.profiles, self.queues = list(profiles), []
        self._profiler_primed, self.read_buf = True, object()

    def host_us(self, fn, calls):
        return 10.0

    def _profile(self, fn, calls, loop):
        self.queues.append(loop.queue_us)
        return self.profiles.pop(0)


def test_timer_queues_the_calls_and_times_again_when_the_queue_ran_dry():
    timer = _ScriptedTimer([_profile(4, 3.0, gap_us=20.0, cold=False), _profile(4, 2.0, cold=False)])
    result = timer.kernel(lambda: None, 4, cold=False)
    q = 4 * 10.0 * bench_timer._QUEUE_HOST_FACTOR
    assert timer.queues == pytest.approx([q, 4 * q])  # the first profile had 20-us gaps: a longer spin
    assert (result.us, result.idle_us, result.queued) == (pytest.approx(2.0), 0.0, True)
    cold = _ScriptedTimer([_profile(2, 5.0, gap_us=1.0)]).kernel(lambda: None, 2, cold=True, host_us=40.0)
    assert cold.us == pytest.approx(5.0) and cold.idle_us == pytest.approx(1.0) and cold.max_gap_us == 1.0


def test_timer_leaves_out_the_spins_before_each_call():
    timer = _ScriptedTimer([_profile(3, 2.5, cold=False, spin_before_us=40.0)])
    result = timer.kernel(lambda: None, 3, cold=False, spin_before_us=40.0)
    assert result.us == pytest.approx(2.5) and result.idle_us == 0.0 and result.queued  # the spins are busy time


def test_timer_unqueued_and_after_idle_have_no_spin():
    events = [e for e in _profile(2, 4.0, gap_us=50.0, cold=False) if "spin" not in e.name]
    for kw in (dict(queued=False), dict(idle_before_us=50.0)):
        timer = _ScriptedTimer([events])
        result = timer.kernel(lambda: None, 2, cold=False, **kw)
        assert timer.queues == [0.0] and result.us == pytest.approx(4.0) and not result.queued
        assert result.idle_us == pytest.approx(25.0)  # one 50-us gap over two calls
    with pytest.raises(RuntimeError, match="spin"):
        _ScriptedTimer([events]).kernel(lambda: None, 2, cold=False)


# ---------------------------------------------------------------- fused-tail callables (CPU, reference pooling)


@pytest.fixture(scope="module")
def tail_pack():
    from csa_compressor.testing import make_pack

    case = Case((40, 9, 16), 16, 4, 2, tail=True)
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, seed=0)
    return case, pack, bench.make_tail(case, pack)


def test_make_tail_positions_and_tables(tail_pack):
    _, _, tail_case = tail_pack
    # Rows 0-9 of segment 0, 10-11 of segment 1, 12-15 of segment 2: position j * ratio within the segment.
    expected = [4 * j for j in range(10)] + [0, 4] + [0, 4, 8, 12]
    tail = tail_case.tail
    assert tail_case.positions.tolist() == expected and tail.rope_dim == 16 and tail.rope_interleaved
    assert tail.rope_cos.shape == (37, 8) and tail.rope_cos.dtype == torch.float32  # up to the last row's position
    assert torch.allclose(tail.rope_cos[3, 0], torch.tensor(3.0).cos()) and tail.rope_sin[0].abs().max() == 0
    assert tail.norm_weight.shape == (16,) and tail.norm_weight.dtype == torch.float32
    kwargs = tail_case.kwargs()
    assert set(kwargs) == set(bench.TAIL_ARGS) and kwargs["position_start"] is None


@pytest.mark.parametrize("interleaved", [True, False])
def test_torch_tail_is_rmsnorm_then_rope(tail_pack, interleaved):
    from csa_compressor.tail import Tail

    _, pack, tail_case = tail_pack
    inv_freq = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    table = torch.arange(40, dtype=torch.float64)[:, None] * inv_freq[None, :]
    tail = Tail(tail_case.tail.norm_weight, 1e-6, table.cos().float(), table.sin().float(), 8, interleaved)
    out = torch.randn(pack.total_comp, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y = bench.torch_tail(out, bench_calls.TailCase(tail, tail_case.positions))
    x = out.double()
    normed = (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * tail.norm_weight.double()).to(torch.bfloat16)
    # The columns before the rotated ones: the norm alone, computed in fp32 there, so within one bf16 ulp of the
    # fp64 norm rounded once (the two roundings part where fp32 lands next to a bf16 midpoint).
    assert int(bf16_ulp_distance(y[:, :8], normed[:, :8]).max()) <= 1
    rot = normed[:, 8:].double()
    angle = tail_case.positions.double()[:, None] * inv_freq[None, :]
    pairs = torch.complex(rot[:, 0::2], rot[:, 1::2]) if interleaved else torch.complex(rot[:, :4], rot[:, 4:])
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    want = (
        torch.stack((turned.real, turned.imag), -1).flatten(1)
        if interleaved
        else torch.cat((turned.real, turned.imag), -1)
    )
    assert (y[:, 8:].double() - want).abs().max() <= 2**-7 * want.abs().max()  # one bf16 rounding


def test_fused_tail_backward_is_autograds_call(tail_pack, monkeypatch):
    """With a tail the kernel backends' timed backward is autograd's call: the forward's rstd handed over (the
    wrappers take none), gradients within the tail's contract."""
    from csa_compressor import api, dispatch
    from csa_compressor import tail as T

    case, pack, tail = tail_pack
    reason = dispatch.unavailable_reason("triton") or dispatch.backend_module("triton").device_unsupported_reason(
        pack.kv.device
    )
    if reason:
        pytest.skip(reason)
    given = []
    backward = api._pool_backward_tail

    def spy(*args, **kw):
        given.append(kw.get("rstd"))
        return backward(*args, **kw)

    monkeypatch.setattr(api, "_pool_backward_tail", spy)
    fns, _ = bench_calls.callables("triton", pack, case, tail)
    grads = fns["bwd"]()
    assert len(given) == 1 and given[0] is not None and given[0].shape == (pack.total_comp,)
    assert T.contract_report(pack, tail.tail, grads=tuple(grads))["ok"]


def test_fused_tail_is_skipped_until_the_wrappers_take_it(tail_pack, monkeypatch):
    case, pack, tail = tail_pack
    from csa_compressor import api

    missing = bench.fused_tail_missing()
    if missing is None:
        pytest.skip("the installed wrappers take the tail arguments")
    assert "norm_weight" in missing
    with pytest.raises(bench_calls.Skip):
        bench_calls.callables("triton", pack, case, tail)

    def with_tail(*args, norm_weight=None, norm_eps=1e-6, rope_cos=None, rope_sin=None, rope_dim=0,
                  rope_interleaved=True, position_start=None, **kw):  # fmt: skip
        return {"out": None, "softmax_stats": None, "kw": kw}

    monkeypatch.setattr(api, "csa_compressor_forward_wrapper", with_tail)
    monkeypatch.setattr(api, "csa_compressor_backward_wrapper", with_tail)
    assert bench.fused_tail_missing() is None


def test_unfused_tail_chains_agree(tail_pack):
    """Our pooling + PyTorch's tail and the eager chain agree (forward, gradients) within their roundings."""
    case, pack, tail = tail_pack
    ours, _ = bench_calls.callables("reference+torch tail", pack, case, tail)
    eager, _ = bench_calls.callables("eager", pack, case, tail)
    assert set(ours) == set(eager) == {"fwd", "fwd+bwd"}
    out_a, out_e = ours["fwd"](), eager["fwd"]()
    assert out_a.shape == (pack.total_comp, 16) and (out_a.float() - out_e.float()).abs().max() < 0.05
    pooled, _ = bench_calls.callables("eager", pack, case.pooling, None)
    assert (pooled["fwd"]().float() - out_e.float()).abs().max() > 0.1
    grads_a, grads_e = ours["fwd+bwd"](), eager["fwd+bwd"]()
    assert len(grads_a) == 4 and grads_a[3].shape == (16,)
    for a, e in zip(grads_a, grads_e, strict=True):
        assert (a.float() - e.float()).abs().max() <= 0.05 * e.float().abs().max() + 1e-3


# ---------------------------------------------------------------- records, report, chart

META = {
    "device": "NVIDIA H200 (sm_90)",
    "date": "2026-11-30T14:00:00+00:00",
    "commit": "abc123",
    "versions": {"torch": "2.11"},
    "copy_tb_s": 4.2,
    "reps": [10, 20, 20],
}


def _records(tail_fused=True):
    recs = []

    def add(case, backend, direction, cold, warm=None, wall=None, **extra):
        rec = make_record(META, case, backend, direction, 4.2e12)
        rec.update(kernel_us_cold=cold, kernel_us_warm=warm or 0.9 * cold, wall_us=wall or cold + 20, **extra)
        recs.append(rec)

    case = CASES[3]  # 3x8192-d512-r4-c2: cudnn-frontend fwd 43.3, bwd 76.0
    add(case, "cute", "fwd", 30.0, 28.0, 38.0, host_us=9.0)
    add(case, "cute", "bwd", 60.0, 55.0, 70.0)
    add(case, "torch.compile", "fwd", 180.0, 170.0, 200.0)
    add(case, "torch.compile", "fwd+bwd", 450.0, 440.0, 480.0)
    add(case, "eager", "fwd", 800.0, 790.0, 900.0)
    add(case, "eager", "fwd+bwd", 2200.0, 2100.0, 2300.0)
    tail = Case(case.seqlens, case.head_dim, case.ratio, case.coff, True)
    if tail_fused:
        add(tail, "cute", "fwd", 31.5)
        add(tail, "cute", "bwd", 63.0)
    add(tail, "cute+torch tail", "fwd", 60.0)
    add(tail, "cute+torch tail", "fwd+bwd", 190.0)
    add(tail, "torch.compile", "fwd", 200.0)
    add(tail, "torch.compile", "fwd+bwd", 500.0)
    failed = make_record(META, CASES[0], "triton", "fwd", 4.2e12)
    failed["error"] = "RuntimeError: boom"
    recs.append(failed)
    return recs


def test_make_record_has_the_fields():
    rec = make_record(META, CASES[5], "triton", "bwd", 4.2e12)
    for key in bench.RECORD_FIELDS:
        assert key in rec
    assert rec["seqlens"] == [65536] and (rec["head_dim"], rec["ratio"], rec["coff"]) == (512, 128, 2)
    assert rec["floor_us"] == pytest.approx(floor_bytes(CASES[5], "bwd") / 4.2e6)
    assert rec["kernel_us_cold"] is None and rec["tail"] is False
    json.dumps(rec)


def _rows(md: str, title: str) -> list[dict]:
    block = md.split(f"### {title}")[1].split("###")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")]
    return [dict(zip(rows[0], r, strict=True)) for r in rows[1:]]


def test_markdown_summary_and_forward_table():
    md = format_markdown(_records(), META)
    assert "NVIDIA H200" in md and "4.20 TB/s" in md and "cudnn-frontend 1.32" in md
    assert "SPEC" not in md and "seed" not in md
    (summary,) = _rows(md, "Summary")
    assert summary["case"] == "3x8192-d512-r4-c2" and summary["fwd ours (cute)"] == "30.0"
    assert summary["fwd cudnn-frontend"] == "43.3" and summary["fwd+bwd cudnn-frontend"] == "119.3"
    assert summary["fwd+bwd torch.compile"] == "450.0" and summary["fwd+bwd ours (cute)"] == "90.0"
    floor = floor_bytes(CASES[3], "fwd") / 4.2e6
    assert summary["fwd x floor"] == f"{30.0 / floor:.2f}x"
    rows = _rows(md, "Forward")
    cute = next(r for r in rows if r["backend"] == "cute" and r["case"] == "3x8192-d512-r4-c2")
    assert cute["floor"] == f"{floor:.1f}" and cute["cold"] == "30.0" and cute["host"] == "9.0"
    assert cute["vs torch.compile (cold)"] == "6.00x" and cute["cudnn-frontend cold"] == "43.3"
    assert cute["vs cudnn-frontend (cold)"] == f"{43.3 / 30.0:.2f}x"
    assert cute["wall - warm"] == "10.0" and cute["cudnn-frontend wall"] == "95.0"
    eager = next(r for r in rows if r["backend"] == "eager")
    assert eager["vs cudnn-frontend (cold)"] == "—"
    failed = next(r for r in rows if r["backend"] == "triton")
    assert failed["cold"] == "—" and failed["cold / floor"] == "—"


def test_markdown_backward_and_combined_tables():
    md = format_markdown(_records(), META)
    assert {r["backend"] for r in _rows(md, "Backward")} == {"cute"}  # baselines have no backward-only time
    combined = _rows(md, "Forward + backward")
    cute = next(r for r in combined if r["backend"] == "cute" and r["case"] == "3x8192-d512-r4-c2")
    assert cute["cold"] == "90.0" and cute["warm"] == "83.0" and cute["wall"] == "108.0"  # sums of the two calls
    assert cute["vs torch.compile (cold)"] == "5.00x" and cute["vs eager (cold)"] == f"{2200 / 90:.2f}x"
    assert cute["vs cudnn-frontend (cold)"] == f"{(43.3 + 76.0) / 90:.2f}x"
    assert "Failed measurements" in md and "RuntimeError: boom" in md


def test_markdown_fused_tail_tables():
    md = format_markdown(_records(), META)
    (cost,) = _rows(md, "Fused RMSNorm + RoPE tail: cost over")
    assert cost["fwd fused"] == "31.5" and cost["fwd pooling alone"] == "30.0"
    assert cost["fused / pooling (target <= 1.05x)"] == "1.05x" and cost["fused / pooling (target <= 1.10x)"] == "1.05x"
    # The bytes the tail adds (cos and sin, the norm weight): the floors' ratio, from the records' own floors.
    plain, tail = CASES[3], Case(CASES[3].seqlens, CASES[3].head_dim, CASES[3].ratio, CASES[3].coff, True)
    for direction in ("fwd", "bwd"):
        want = floor_bytes(tail, direction) / floor_bytes(plain, direction)
        assert want > 1.0 and cost[f"{direction} floors fused / pooling"] == f"{want:.2f}x"
    (versus,) = _rows(md, "Fused RMSNorm + RoPE tail: against")
    assert versus["fwd (a) pooling + torch tail"] == "60.0" and versus["fwd+bwd fused"] == "94.5"
    assert versus["fwd+bwd (b) torch.compile"] == "500.0"
    head = [k for k in versus if " vs " in k]
    assert [versus[k] for k in head] == ["1.90x", "6.35x", f"{190 / 94.5:.2f}x", f"{500 / 94.5:.2f}x"]
    # Without the fused kernels the unfused chains still show, the fused columns are empty.
    (versus,) = _rows(format_markdown(_records(tail_fused=False), META), "Fused RMSNorm + RoPE tail: against")
    assert versus["fwd fused"] == "—" and versus["fwd (b) torch.compile"] == "200.0"


def test_markdown_of_several_runs_is_the_first_with_the_tails_ranges():
    """A record of two runs: every table shows the first run's times, the fused tail's ratios their range too."""
    first = _records()
    second = [dict(r, date="2026-12-01T09:30:00+00:00") for r in _records()]
    for rec in second:
        if rec["backend"] == "cute" and rec["kernel_us_cold"] is not None:
            rec["kernel_us_cold"] *= 1.1 if rec["tail"] else 1.0  # the fused calls 10 % slower there
    md = format_markdown([*first, *second], META)
    assert "This record holds 2 runs" in md and "This record holds" not in format_markdown(first, META)
    (summary,) = _rows(md, "Summary")
    assert summary["fwd ours (cute)"] == "30.0"
    (cost,) = _rows(md, "Fused RMSNorm + RoPE tail: cost over")
    assert cost["fwd fused"] == "31.5"
    assert cost["fused / pooling (target <= 1.05x)"] == "1.05x (1.05-1.16x over 2 runs)"
    assert cost["fused / pooling (target <= 1.10x)"] == "1.05x (1.05-1.16x over 2 runs)"


def test_markdown_probe_skips_and_failed_walls():
    recs = _records()
    cute = next(r for r in recs if r["backend"] == "cute" and r["direction"] == "fwd")
    cute.update(kernel_us_cold_unqueued=2.2, kernel_us_warm_unqueued=3.9, kernel_us_warm_after_idle=4.0,
                idle_us_warm_unqueued=21.5, wall_us=None, wall_error="RuntimeError: wall boom")  # fmt: skip
    skipped = make_record(META, Case((8192,), 128, 4, 2, True), "triton", "fwd", 4.2e12)
    skipped["skipped"] = "the installed wrapper has no fused tail"
    md = format_markdown([*recs, skipped], META)
    (probe,) = _rows(md, "Timing probe")
    assert probe["cold unqueued"] == "2.2" and probe["warm unqueued"] == "3.9" and probe["warm after idle"] == "4.0"
    assert probe["idle / call, warm unqueued"] == "21.5"
    forward = next(r for r in _rows(md, "Forward") if r["backend"] == "cute")
    assert forward["wall"] == "—" and forward["cold"] == "30.0"
    assert "(wall): RuntimeError: wall boom" in md
    assert "### Skipped" in md and "no fused tail: 1 measurements" in md
    assert "Timing probe" not in format_markdown(_records(), META)


def test_markdown_without_meta_or_published_figures():
    rec = make_record({}, Case((64,), 8, 4, 1), "reference", "fwd", 1e12)
    rec.update(kernel_us_cold=2.0, kernel_us_warm=1.0, wall_us=5.0)
    (row,) = _rows(format_markdown([rec]), "Forward")
    assert row["backend"] == "reference" and row["cudnn-frontend cold"] == "—" and row["wall - warm"] == "4.0"
    assert format_markdown([]) == ""


def _full_records():
    """A record of the whole matrix, tails included: the chart's largest case."""
    recs = []
    for case in [*CASES, *(Case(c.seqlens, c.head_dim, c.ratio, c.coff, True) for c in CASES)]:
        for backend in bench_cases.case_backends(case, ["cute", "triton", "reference", "torch.compile", "eager"]):
            for direction in ("fwd", "bwd"):
                what = bench.measured_direction(backend, direction)
                rec = make_record(META, case, backend, what, 4.1e12)
                scale = 1.2 if backend in ("cute", "triton") else 8.0
                rec.update(kernel_us_cold=rec["floor_us"] * scale, kernel_us_warm=1.0, wall_us=30.0)
                recs.append(rec)
    return recs


def test_write_outputs_and_a_small_chart(tmp_path):
    pytest.importorskip("matplotlib")
    recs = _full_records()
    result = BenchResult(records=recs, markdown=format_markdown(recs, META), meta=META)
    paths = bench.write_outputs(result, tmp_path / "out", "run1")
    text = paths["json"].read_text()
    assert bench.expand_records(json.loads(text)) == _rounded_copy(recs)
    assert sum(line.startswith('{"run":') for line in text.splitlines()) == len(recs)  # one row per line
    kernel = [r["kernel_us_cold"] for r in bench.expand_records(json.loads(text))]
    assert kernel == pytest.approx([r["kernel_us_cold"] for r in recs], rel=1e-5)
    assert paths["markdown"].read_text().startswith("Device:")
    png = paths["chart"].read_bytes()
    assert png[:4] == b"\x89PNG" and 5_000 < len(png) < 40_000  # the tree takes no binary over 40 KB


def test_records_json_keeps_each_run_and_case_once_and_expands_to_the_records():
    later = {**META, "date": "2026-12-01T09:30:00+00:00", "commit": "def456", "spin_wakeup_us": {"queued": 1.5}}
    odd = make_record(META, CASES[1], "cute", "fwd", 4.2e12)  # an older record: fewer fields
    odd = {k: v for k, v in odd.items() if k not in ("rope_dim", "source_digest")}
    old = _rounded_copy([*_full_records(), *_records(), make_record(later, CASES[0], "cute", "fwd", 4e12), odd])
    data = json.loads(bench.run.records_json(old))
    assert bench.expand_records(data) == old and [list(r) for r in bench.expand_records(data)] == [list(r) for r in old]
    # _full_records and _records differ in their copy rate: two runs of one minute, told apart by a suffix
    assert list(data["runs"]) == ["20261130T1400Z", "20261130T1400Z-2", "20261201T0930Z", "20261130T1400Z-3"]
    assert len(data["rows"]) == len(old)
    assert CASES[1].name not in data["cases"] and data["cases"][CASES[0].name]["seqlens"] == [8192]
    assert all("date" not in row and "commit" not in row and row["run"] in data["runs"] for row in data["rows"])
    assert bench.expand_records(old) == old  # the list form of older records is read as it is
    with pytest.raises(ValueError):
        bench.expand_records({"records": []})


def _rounded_copy(recs):
    return bench.run._rounded(json.loads(json.dumps(recs)))


@pytest.mark.parametrize("form", ["list", "compact"])
def test_from_json_renders_either_form(tmp_path, form, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the markdown alone
    recs = _rounded_copy(_records())
    text = json.dumps(recs) if form == "list" else bench.run.records_json(recs)
    (tmp_path / "rec.json").write_text(text)
    assert bench.main(["--from-json", str(tmp_path / "rec.json")]) == 0
    assert (tmp_path / "rec.md").read_text() == format_markdown(recs, bench.report.meta_of(recs)) + "\n"
    assert "4.20 TB/s" in (tmp_path / "rec.md").read_text()
    (tmp_path / "bad.json").write_text('{"records": []}')
    assert bench.main(["--from-json", str(tmp_path / "bad.json")]) == 2  # a usage error, one line


def test_chart_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    msg = bench.draw_chart(_records(), tmp_path / "c.png")
    assert msg and "matplotlib" in msg and not (tmp_path / "c.png").exists()


def test_default_name():
    assert bench.default_name("NVIDIA H200", "2026-11-30T14:12:05+00:00") == "bench_nvidia-h200_20261130T1412Z"


def test_source_digest_follows_the_sources(tmp_path):
    """Same sources, same digest; one changed byte or a renamed file changes it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not a source")
    first = bench.source_digest(pkg)
    assert len(first) == 12 and first == bench.source_digest(pkg)
    (pkg / "notes.txt").write_text("changed, still not a source")
    assert bench.source_digest(pkg) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    changed = bench.source_digest(pkg)
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert changed != first and bench.source_digest(pkg) not in (first, changed)
    import csa_compressor

    assert bench.source_digest() == bench.source_digest(type(tmp_path)(csa_compressor.__file__).parent)


# ---------------------------------------------------------------- run_bench with a stand-in timer


class _FakeTimer:
    """Calls every callable once per measurement and logs the order of walls and kernel timings."""

    log: typing.ClassVar[list] = []

    def __init__(self, device):
        self.flush_bytes = 1 << 20

    def copy_rate(self, reps=10):
        return 4e12

    def sm_clock_mhz(self):
        return 1980.0

    def spin_wakeup_us(self):
        return 6.5, 5.0

    def warm_up(self, fn):
        fn()

    def wall_us(self, fn, calls):
        self.log.append("wall")
        fn()
        if getattr(fn, "wall_fails", False):
            raise RuntimeError("no events")
        return 100.0 + len(self.log)

    def host_us(self, fn, calls):
        return 8.0

    def kernel(self, fn, calls, cold, **kw):
        self.log.append("kernel")
        fn()
        return bench.KernelTime(3.0 if cold else 2.0, 0.5, 1.0, kw.get("idle_before_us") is None)


@pytest.fixture
def fake_gpu(monkeypatch):
    _FakeTimer.log = []
    monkeypatch.setattr(bench_run, "Timer", _FakeTimer)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    props = types.SimpleNamespace(name="Fake GPU", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr("csa_compressor.dispatch.available_backends", lambda device: ["reference"])
    return _FakeTimer.log


def test_run_bench_times_every_wall_before_any_kernel(fake_gpu, monkeypatch):
    """Walls before the first kernel timing; per-record wall and host time; failures and skips recorded per direction."""
    real = bench_calls.callables

    def callables(backend, pack, case, tail, log=None):
        if backend == "torch.compile":
            raise ValueError("cannot build")
        calls, note = real(backend, pack, case, tail)
        if backend == "reference":
            calls["bwd"] = lambda: None
            calls["bwd"].wall_fails = True
        return calls, note

    monkeypatch.setattr(bench_run, "callables", callables)
    cases = [Case((64, 9), 16, 4, 2), Case((64, 9), 16, 4, 2, True)]
    result = bench.run_bench(cases, ["reference", "compile", "eager"], out_dir=None, progress=False,
                             device="cpu", method=bench.Method(reps=(1, 1, 1), timing_probe=True))  # fmt: skip
    log = fake_gpu
    assert log.index("kernel") == 2 + 2 + 2 + 2  # host walls, reference x 2, eager x 2, eager chain with the tail x 2
    assert "wall" not in log[log.index("kernel") :]
    recs = {(r["case"], r["backend"], r["direction"]): r for r in result.records}
    fwd = recs[("64+9-d16-r4-c2", "reference", "fwd")]
    assert fwd["wall_us"] == 103.0 and fwd["host_us"] == 8.0 and fwd["kernel_us_cold"] == 3.0
    assert fwd["kernel_us_warm"] == 2.0 and fwd["idle_us_cold"] == 0.5 and fwd["kernel_us_warm_after_idle"] == 2.0
    bwd = recs[("64+9-d16-r4-c2", "reference", "bwd")]
    assert bwd["wall_us"] is None and "no events" in bwd["wall_error"] and bwd["kernel_us_cold"] == 3.0
    assert "cannot build" in recs[("64+9-d16-r4-c2", "torch.compile", "fwd+bwd")]["error"]
    assert recs[("64+9-d16-r4-c2-tail", "eager", "fwd+bwd")]["kernel_us_cold"] == 3.0
    assert ("64+9-d16-r4-c2-tail", "reference", "fwd") not in recs  # no fused tail in the reference
    assert set(result.records[0]["host_wall_us"]) == {"events only", "x.add_(1)"}
    assert result.meta["sm_clock_mhz"] == [1980.0, 1980.0] and result.meta["timer"] == "queued"
    assert fwd["kernel_us_warm_after_spin"] == 2.0 and fwd["spin_wakeup_us"] == {"after idle": 6.5, "queued": 5.0}
    assert "one short spin kernel takes 6.50 us" in result.markdown


def test_run_bench_skips_the_fused_tail_and_what_the_budget_leaves(fake_gpu, monkeypatch):
    monkeypatch.setattr("csa_compressor.dispatch.available_backends", lambda device: ["triton", "reference"])
    monkeypatch.setattr(bench_calls, "fused_tail_missing", lambda: "no fused tail here")
    spent = iter([False])  # the budget runs out after the first case has started
    monkeypatch.setattr(bench_run._Budget, "spent", lambda self, share=1.0: next(spent, True))
    cases = [Case((64, 9), 16, 4, 2, True), Case((64,), 16, 4, 1)]
    result = bench.run_bench(cases, ["triton"], ["fwd"], out_dir=None, progress=False, device="cpu",
                             method=bench.Method(reps=(1, 1, 1), budget_s=60.0))  # fmt: skip
    recs = {(r["case"], r["backend"]): r for r in result.records}
    assert recs[("64+9-d16-r4-c2-tail", "triton")]["skipped"] == "no fused tail here"
    assert recs[("64+9-d16-r4-c2-tail", "triton+torch tail")]["skipped"] == bench_run.BUDGET_SKIP
    assert recs[("1x64-d16-r4-c1", "triton")]["skipped"] == bench_run.BUDGET_SKIP
    assert not any(r.get("error") for r in result.records)


def test_run_bench_compile_only_calls_each_row_once_and_times_nothing(fake_gpu, monkeypatch):
    called = []

    def callables(backend, pack, case, tail, log=None):
        return {d: (lambda d=d: called.append((backend, d))) for d in ("fwd", "bwd", "fwd+bwd")}, None

    monkeypatch.setattr(bench_run, "callables", callables)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    result = bench.run_bench([Case((64,), 16, 4, 1)], ["reference", "eager"], out_dir=None, progress=False,
                             device="cpu", method=bench.Method(compile_only=True))  # fmt: skip
    assert sorted(called) == [("eager", "fwd"), ("eager", "fwd+bwd"), ("reference", "bwd"), ("reference", "fwd")]
    assert result.records == [] and fake_gpu == []  # no wall, no kernel timing


def test_run_bench_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks the error on a machine without a GPU")
    with pytest.raises(bench.NoGPUError):
        bench.run_bench(out_dir=None)


# ---------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.alone
def test_run_bench_smoke_on_gpu(tmp_path):
    """A small real run: reference and eager, a tail case, the timing probe; every figure present and sane."""
    cases = [CASES[0], Case((8192,), 128, 4, 2, True)]
    result = bench.run_bench(cases, ["reference", "eager"], tail="off", out_dir=tmp_path, name="smoke",
                             progress=False, method=bench.Method(reps=(2, 3, 3), timing_probe=True))  # fmt: skip
    seen = {(r["case"], r["backend"], r["direction"]) for r in result.records}
    assert ("1x8192-d128-r4-c2", "reference", "bwd") in seen and ("1x8192-d128-r4-c2-tail", "eager", "fwd+bwd") in seen
    for rec in result.records:
        assert rec.get("error") is None and rec.get("wall_error") is None, rec
        assert rec["kernel_us_cold"] > 0 and rec["kernel_us_warm"] > 0 and rec["wall_us"] > 0 and rec["host_us"] > 0
        assert rec["kernel_us_cold_unqueued"] > 0 and rec["kernel_us_warm_after_idle"] > 0
        assert rec["kernel_us_warm_after_spin"] > 0
    assert all(1000 < mhz < 3000 for mhz in result.meta["sm_clock_mhz"])
    assert all(v > 0 for v in result.meta["spin_wakeup_us"].values())
    assert (tmp_path / "smoke.json").exists() and (tmp_path / "smoke.md").exists() and (tmp_path / "smoke.png").exists()


@pytest.mark.gpu
@pytest.mark.alone
def test_queued_kernel_time_has_no_idle_gaps():
    """The queue spin covers a host-bound call's enqueueing; unqueued, idle gaps show (relative: shared GPU)."""
    timer = bench.Timer(torch.device("cuda"))
    x = torch.zeros(1 << 10, device="cuda")

    def call():
        for _ in range(20):
            x.add_(1)

    timer.warm_up(call)
    queued = timer.kernel(call, 10, cold=False)
    unqueued = timer.kernel(call, 10, cold=False, queued=False)
    assert queued.queued and not unqueued.queued
    assert unqueued.idle_us > 2 * queued.idle_us


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cute", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_bench_packs_meet_the_contract(backend, case):
    """The contract on the full-size packs the bench times (seed 0)."""
    from csa_compressor import available_backends, csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
    from csa_compressor.testing import contract_report, make_pack

    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available here")
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device="cuda", seed=0)
    kw = dict(ratio=case.ratio, coff=case.coff, backend=backend)
    out = csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"]
    grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
    report = contract_report(pack, out, tuple(grads))
    assert report["ok"], report


@pytest.mark.parametrize("ratio, coff, head_dim", [(4, 2, 32), (128, 1, 16), (128, 2, 8), (2, 1, 12)])
@pytest.mark.parametrize("padding_rows", [0, 3])
def test_flat_gather_pool_is_the_eager_region_bitwise(ratio, coff, head_dim, padding_rows):
    """torch.compile's fallback region computes exactly what the reference's eager region does."""
    from csa_compressor import reference
    from csa_compressor.bench.calls import flat_gather_pool
    from csa_compressor.thd import compute_cu_seqlens_comp

    gen = torch.Generator().manual_seed(ratio + coff + head_dim)
    cu = torch.tensor([0, 3, 700, 700, 1301], dtype=torch.int32)
    cuc = compute_cu_seqlens_comp(cu, ratio)
    total_comp = int(cuc[-1]) + padding_rows
    kv, score = (torch.randn(1301, coff * head_dim, generator=gen).bfloat16() for _ in range(2))
    ape = torch.randn(ratio, coff * head_dim, generator=gen)
    pool = dict(ratio=ratio, coff=coff, total_comp=total_comp)
    want = reference.eager_region(kv, score, ape, cu, cuc, **pool)
    assert torch.equal(flat_gather_pool(kv, score, ape, cu, cuc, **pool), want)
