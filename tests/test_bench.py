"""The benchmark's pure parts (case selection, floor arithmetic, profiler arithmetic, reports) and its CPU exit."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from csa_compressor import bench
from csa_compressor.bench import (
    CASES,
    SPEC_H200,
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

# SPEC section 6 floors (fwd, bwd), us. The SPEC prints its copy rate rounded (4.22 TB/s); its floors imply
# 4.21-4.22 TB/s depending on the row, so they are matched to 0.6 %.
SPEC_FLOORS = {
    "1x8192-d128-r4-c2": (2.1, 4.1),
    "3x8192-d128-r4-c2": (6.3, 12.3),
    "1x8192-d512-r4-c2": (8.5, 16.4),
    "3x8192-d512-r4-c2": (25.4, 49.2),
    "1x8192-d128-r128-c1": (1.0, 2.0),
    "1x65536-d512-r128-c2": (63.9, 127.7),
    "3x8192-d512-r128-c1": (12.0, 24.0),
}
SPEC_RATE = 4.213e12


# ---------------------------------------------------------------- cases


def test_case_matrix_is_spec_section_6():
    assert [c.name for c in CASES] == list(SPEC_FLOORS)
    assert list(SPEC_H200) == [c.name for c in CASES]
    assert CASES[1].seqlens == (8192, 8192, 8192)
    assert (CASES[5].total_tokens, CASES[5].total_comp) == (65536, 512)


@pytest.mark.parametrize(
    "text",
    ["3x8192-d512-r4-c2", "3x8192 d512 r4 c2", "3x8192_d512_r4_c2", " 3X8192-D512-R4-C2 ", "3x8192d512r4c2"],
)
def test_parse_case_spellings(text):
    assert parse_case(text) == Case((8192,) * 3, 512, 4, 2)


@pytest.mark.parametrize(
    "text", ["", "3x8192", "3x8192-d512-r4", "x8192-d512-r4-c2", "1x8192-d128-r4-c3", "0x8-d8-r4-c1"]
)
def test_parse_case_rejects(text):
    with pytest.raises(ValueError):
        parse_case(text)


def test_case_name_round_trips():
    for case in CASES:
        assert parse_case(case.name) == case
    assert Case((100, 50), 64, 4, 1).name == "100+50-d64-r4-c1"


def test_select_cases():
    assert select_cases(None) == list(CASES)
    assert select_cases([]) == list(CASES)
    assert select_cases(["0", "6"]) == [CASES[0], CASES[6]]
    assert select_cases(["0,3", "3"]) == [CASES[0], CASES[3]]  # comma lists, duplicates dropped
    assert select_cases(["1x65536 d512 r128 c2"]) == [CASES[5]]
    assert select_cases(["2x4096-d256-r8-c2"]) == [Case((4096, 4096), 256, 8, 2)]  # off-matrix cases are allowed
    with pytest.raises(ValueError, match="out of range"):
        select_cases(["7"])


def test_select_backends_default_and_order():
    chosen, skipped = select_backends(None, ["triton", "reference"])
    assert chosen == ["triton", "reference", "torch.compile", "eager"]
    assert skipped == []
    chosen, _ = select_backends(["eager,compile", "reference"], ["cute", "triton", "reference"])
    assert chosen == ["reference", "torch.compile", "eager"]


def test_select_backends_unavailable_and_unknown():
    chosen, skipped = select_backends(["cute", "eager"], ["reference"])
    assert chosen == ["eager"]
    assert len(skipped) == 1 and "cute" in skipped[0] and "reference" in skipped[0]
    with pytest.raises(ValueError, match="unknown backend"):
        select_backends(["cuda"], ["reference"])


def test_select_directions():
    assert select_directions(None) == ["fwd", "bwd"]
    assert select_directions(["bwd"]) == ["bwd"]
    assert select_directions(["bwd,fwd"]) == ["fwd", "bwd"]
    with pytest.raises(ValueError):
        select_directions(["both"])
    assert bench.measured_direction("eager", "bwd") == "fwd+bwd"
    assert bench.measured_direction("torch.compile", "fwd") == "fwd"
    assert bench.measured_direction("triton", "bwd") == "bwd"


# ---------------------------------------------------------------- floor


def test_floor_bytes_formula():
    case = Case((8192,), 128, 4, 2)
    t, width, n, d = 8192, 256, 2048, 128
    assert floor_bytes(case, "fwd") == 2 * t * width * 2 + n * d * 2
    assert floor_bytes(case, "bwd") == 4 * t * width * 2 + n * d * 2
    assert floor_bytes(case, "fwd+bwd") == floor_bytes(case, "fwd") + floor_bytes(case, "bwd")
    # Segment tails belong to no group: N counts only full groups.
    assert floor_bytes(Case((10, 7), 8, 4, 1), "fwd") == 2 * 17 * 8 * 2 + 3 * 8 * 2
    with pytest.raises(ValueError):
        floor_bytes(case, "sideways")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_floor_matches_spec_table(case):
    fwd, bwd = SPEC_FLOORS[case.name]
    assert floor_us(case, "fwd", SPEC_RATE) == pytest.approx(fwd, rel=0.006, abs=0.05)
    assert floor_us(case, "bwd", SPEC_RATE) == pytest.approx(bwd, rel=0.006, abs=0.05)


def test_floor_us_and_copy_rate():
    case = CASES[0]
    assert floor_us(case, "fwd", 1e12) == pytest.approx(floor_bytes(case, "fwd") / 1e6)
    with pytest.raises(ValueError):
        floor_us(case, "fwd", 0.0)
    # 1 GB copied in a median of 0.5 ms: 2 GB moved (read + write) -> 4 TB/s.
    assert bench.copy_rate(10**9, [0.4e-3, 0.5e-3, 0.9e-3]) == pytest.approx(4e12)


# ---------------------------------------------------------------- profiler arithmetic


def test_kernel_us_per_call_subtracts_flush_and_skips_annotations():
    acts = [
        DeviceActivity("flush_fill", 30.0),
        DeviceActivity("fused_fwd", 5.0),
        DeviceActivity("memset", 1.0),
        DeviceActivity("csa_bench.l2_flush", 31.0, is_user_annotation=True),
        DeviceActivity("Torch-Compiled Region: 0/0", 7.0, is_user_annotation=True),
        DeviceActivity("flush_fill", 30.0),
        DeviceActivity("fused_fwd", 7.0),
    ]
    assert kernel_us_per_call(acts, calls=2, flush_us_total=60.0) == pytest.approx(6.5)
    assert kernel_us_per_call(acts[1:3], calls=1) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        kernel_us_per_call(acts, calls=0)
    with pytest.raises(ValueError, match="flush"):
        kernel_us_per_call(acts[1:2], calls=1, flush_us_total=60.0)


def test_flush_device_us_walks_the_range_tree():
    from collections import namedtuple

    kernel = namedtuple("Kernel", "name device duration")

    class Ev:
        def __init__(self, kernels=(), children=()):
            self.kernels = list(kernels)
            self.cpu_children = list(children)

    fill = Ev([kernel("FillFunctor<double>", 0, 25.0)])
    launch = Ev(children=[fill])
    rng = Ev([kernel(bench.FLUSH_RANGE, 0, 26.0)], children=[launch, Ev()])  # its own GPU mirror is skipped
    assert bench.flush_device_us(rng) == pytest.approx(25.0)
    assert bench.flush_device_us(Ev()) == 0.0


def test_flush_device_us_on_real_profiler_events():
    # The attribute names the walk relies on, on this torch version (CPU only: no kernels, so 0).
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(bench.FLUSH_RANGE):
            torch.ones(1000).fill_(2.0)
    ranges = [e for e in prof.events() if e.name == bench.FLUSH_RANGE]
    assert len(ranges) == 1
    assert bench._is_annotation(ranges[0])
    assert any(c.name == "aten::fill_" or c.cpu_children for c in ranges[0].cpu_children)
    assert bench.flush_device_us(ranges[0]) == 0.0


def test_is_annotation():
    class Ev:
        def __init__(self, ann=None, kind=None):
            if ann is not None:
                self.is_user_annotation = ann
            if kind is not None:
                self.activity_type = kind

    assert bench._is_annotation(Ev(ann=True))
    assert bench._is_annotation(Ev(kind="gpu_user_annotation"))
    assert not bench._is_annotation(Ev(ann=False, kind="kernel"))
    assert not bench._is_annotation(Ev())


# ---------------------------------------------------------------- records and reports


META = {
    "device": "NVIDIA H200 (sm_90)",
    "date": "2026-11-30T14:00:00+00:00",
    "commit": "abc123",
    "versions": {"torch": "2.11"},
    "copy_tb_s": 4.2,
    "reps": [10, 20, 20],
}


def _records():
    recs = []

    def add(case, backend, direction, cold, warm, wall):
        rec = make_record(META, case, backend, direction, 4.2e12)
        rec.update(kernel_us_cold=cold, kernel_us_warm=warm, wall_us=wall)
        recs.append(rec)

    case = CASES[3]  # 3x8192-d512-r4-c2: seed fwd 43.3, bwd 76.0 in SPEC
    add(case, "cute", "fwd", 30.0, 28.0, 38.0)
    add(case, "cute", "bwd", 60.0, 55.0, 70.0)
    add(case, "torch.compile", "fwd", 180.0, 170.0, 200.0)
    add(case, "torch.compile", "fwd+bwd", 450.0, 440.0, 480.0)
    add(case, "eager", "fwd", 800.0, 790.0, 900.0)
    add(case, "eager", "fwd+bwd", 2200.0, 2100.0, 2300.0)
    failed = make_record(META, CASES[0], "triton", "fwd", 4.2e12)
    failed["error"] = "RuntimeError: boom"
    recs.append(failed)
    return recs


def test_make_record_has_the_issue_fields():
    rec = make_record(META, CASES[5], "triton", "bwd", 4.2e12)
    for key in bench.RECORD_FIELDS:
        assert key in rec
    assert rec["seqlens"] == [65536]
    assert (rec["head_dim"], rec["ratio"], rec["coff"]) == (512, 128, 2)
    assert rec["floor_us"] == pytest.approx(floor_bytes(CASES[5], "bwd") / 4.2e6)
    assert rec["kernel_us_cold"] is None
    json.dumps(rec)  # serialisable as is


def _rows(md: str, title: str) -> list[list[str]]:
    block = md.split(f"### {title}")[1].split("###")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")]


def test_markdown_forward_table():
    md = format_markdown(_records(), META)
    assert "NVIDIA H200" in md and "4.20 TB/s" in md and "SPEC section 6" in md
    rows = _rows(md, "Forward")
    head = rows[0]
    cute = next(r for r in rows if r[2] == "cute")
    col = dict(zip(head, cute, strict=True))
    floor = floor_bytes(CASES[3], "fwd") / 4.2e6
    assert col["floor"] == f"{floor:.1f}"
    assert col["cold"] == "30.0"
    assert col["cold / floor"] == f"{30.0 / floor:.2f}x"
    assert col["vs torch.compile (cold)"] == "6.00x"
    assert col["seed cold (SPEC)"] == "43.3"
    assert col["vs seed (cold)"] == f"{43.3 / 30.0:.2f}x"
    assert col["wall - warm"] == "10.0" and col["seed wall (SPEC)"] == "95.0"
    eager = dict(zip(head, next(r for r in rows if r[2] == "eager"), strict=True))
    assert eager["vs seed (cold)"] == "—"  # speedups vs the seed are only for kernel backends
    failed = dict(zip(head, next(r for r in rows if r[2] == "triton"), strict=True))
    assert failed["cold"] == "—" and failed["cold / floor"] == "—"


def test_markdown_backward_and_combined_tables():
    md = format_markdown(_records(), META)
    bwd = _rows(md, "Backward")
    assert [r[2] for r in bwd[1:]] == ["cute"]  # baselines have no backward-only time
    combined = _rows(md, "Forward + backward")
    head = combined[0]
    cute = dict(zip(head, next(r for r in combined if r[2] == "cute"), strict=True))
    assert cute["cold"] == "90.0" and cute["warm"] == "83.0" and cute["wall"] == "108.0"  # sums of the two calls
    assert cute["vs torch.compile (cold)"] == "5.00x"
    assert cute["vs eager (cold)"] == f"{2200 / 90:.2f}x"
    assert cute["vs seed (SPEC, cold)"] == f"{(43.3 + 76.0) / 90:.2f}x"
    assert "Failed measurements" in md and "RuntimeError: boom" in md


def test_markdown_and_records_carry_the_host_walls():
    meta = dict(META, host_wall_us={"events only": 7.1, "x.add_(1)": 14.8})
    md = format_markdown(_records(), meta)
    assert "events only 7.1 us; x.add_(1) 14.8 us" in md and "before the run's first profiler session" in md
    rec = make_record(meta, CASES[0], "cute", "fwd", 4e12)
    assert rec["host_wall_us"] == {"events only": 7.1, "x.add_(1)": 14.8}
    assert "events only" not in format_markdown(_records(), META)


def test_markdown_lists_a_failed_wall_and_keeps_the_kernel_times():
    recs = _records()
    cute = next(r for r in recs if r["backend"] == "cute" and r["direction"] == "fwd")
    cute.update(wall_us=None, wall_error="RuntimeError: wall boom")
    md = format_markdown(recs, META)
    col = dict(zip(_rows(md, "Forward")[0], next(r for r in _rows(md, "Forward") if r[2] == "cute"), strict=True))
    assert col["wall"] == "—" and col["cold"] == "30.0"
    assert "(wall): RuntimeError: wall boom" in md


def test_markdown_without_meta_or_seed_numbers():
    rec = make_record({}, Case((64,), 8, 4, 1), "reference", "fwd", 1e12)
    rec.update(kernel_us_cold=2.0, kernel_us_warm=1.0, wall_us=5.0)
    md = format_markdown([rec])
    rows = _rows(md, "Forward")
    col = dict(zip(rows[0], rows[1], strict=True))
    assert col["backend"] == "reference" and col["seed cold (SPEC)"] == "—"  # no SPEC number off the matrix
    assert col["wall - warm"] == "4.0"
    assert format_markdown([]) == ""


def test_write_outputs(tmp_path):
    recs = _records()
    result = BenchResult(records=recs, markdown=format_markdown(recs, META), meta=META)
    paths = bench.write_outputs(result, tmp_path / "out", "run1")
    loaded = json.loads(paths["json"].read_text())
    assert loaded == json.loads(json.dumps(recs))
    assert len(loaded) == len(recs)
    assert paths["markdown"].read_text().startswith("Device:")
    pytest.importorskip("matplotlib")
    assert paths["chart"].stat().st_size > 1000
    assert paths["chart"].read_bytes()[:4] == b"\x89PNG"


def test_chart_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    msg = bench.draw_chart(_records(), tmp_path / "c.png")
    assert msg and "matplotlib" in msg
    assert not (tmp_path / "c.png").exists()


def test_default_name():
    assert bench.default_name("NVIDIA H200", "2026-11-30T14:12:05+00:00") == "bench_nvidia-h200_20261130T1412Z"


def test_source_digest_follows_the_sources(tmp_path):
    """Same sources, same digest; one changed byte or a renamed file changes it (it identifies a result's code
    where a copied tree's commit id may be stale)."""
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
    assert changed != first
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert bench.source_digest(pkg) not in (first, changed)
    assert bench.source_digest() == bench.source_digest()  # the installed package


# ---------------------------------------------------------------- command line


def test_main_source_digest(capsys):
    assert bench.main(["--source-digest"]) == 0
    assert capsys.readouterr().out.strip() == bench.source_digest()


def test_main_list(capsys):
    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "0: 1x8192-d128-r4-c2" in out and "6: 3x8192-d512-r128-c1" in out


def test_main_rejects_bad_selection(capsys):
    assert bench.main(["--cases", "1x8192"]) == 2
    assert "cannot parse case" in capsys.readouterr().err
    assert bench.main(["--backends", "cudnn"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit on a machine without a GPU")
def test_main_without_gpu_exits_cleanly(capsys, tmp_path):
    assert bench.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())
    with pytest.raises(bench.NoGPUError):
        bench.run_bench(out_dir=None)


def test_module_entry_point_reaches_bench(capsys):
    from csa_compressor.__main__ import main as package_main

    assert package_main(["bench", "--list"]) == 0
    assert "1x65536-d512-r128-c2" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_run_bench_smoke_on_gpu(tmp_path):
    result = bench.run_bench(
        ["0"], ["reference", "eager"], None, reps=(2, 2, 2), out_dir=tmp_path, name="smoke", progress=False
    )
    assert {(r["backend"], r["direction"]) for r in result.records} == {
        ("reference", "fwd"),
        ("reference", "bwd"),
        ("eager", "fwd"),
        ("eager", "fwd+bwd"),
    }
    for rec in result.records:
        assert rec.get("error") is None, rec.get("error")
        assert rec["kernel_us_cold"] > 0 and rec["kernel_us_warm"] > 0 and rec["wall_us"] > 0
        assert rec.get("wall_error") is None
        # The walls' pass ran before any profiler session, with the host's own two figures.
        assert set(rec["host_wall_us"]) == {"events only", "x.add_(1)"}
        assert all(v > 0 for v in rec["host_wall_us"].values())
    assert "The same wall on this host: events only" in result.markdown
    assert (tmp_path / "smoke.json").exists() and (tmp_path / "smoke.md").exists()


def test_run_bench_times_every_wall_before_any_profiler_session(monkeypatch):
    """run_bench's two passes on the CPU with a stand-in timer: every wall (and the host's two) is taken before the
    first kernel timing, each record gets its own call's wall, a failed wall keeps the kernel times, and a backend
    that fails to set up is recorded as failed in both directions."""
    import types

    log = []

    class FakeTimer:
        flush_bytes = 1 << 20

        def __init__(self, device, reps):
            self.reps = reps

        def copy_rate(self, reps=10):
            return 4e12

        def warm_up(self, fn):
            fn()

        def wall_us(self, fn, calls):
            log.append("wall")
            if getattr(fn, "wall_fails", False):
                raise RuntimeError("no events")
            return 100.0 + len(log)

        def kernel_times(self, fn):
            log.append("kernel")
            return 3.0, 2.0

    def kernel_callables(backend, pack, case):
        if backend == "broken":
            raise ValueError("cannot build")
        fwd, bwd = (lambda: None), (lambda: None)
        bwd.wall_fails = True
        return {"fwd": fwd, "bwd": bwd}

    monkeypatch.setattr(bench, "_Timer", FakeTimer)
    monkeypatch.setattr(bench, "_kernel_callables", kernel_callables)
    monkeypatch.setattr(bench, "select_backends", lambda names, available: (["reference", "broken"], []))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(name="Fake", major=9, minor=0)
    )
    result = bench.run_bench([Case((64,), 8, 4, 1)], out_dir=None, progress=False, device="cpu", reps=(1, 1, 1))
    assert log[: log.index("kernel")] == ["wall"] * 4  # events only, x.add_, reference fwd, reference bwd
    assert "wall" not in log[log.index("kernel") :]
    recs = {(r["backend"], r["direction"]): r for r in result.records}
    assert recs[("reference", "fwd")]["wall_us"] == 103.0 and recs[("reference", "fwd")]["kernel_us_cold"] == 3.0
    bwd = recs[("reference", "bwd")]
    assert bwd["wall_us"] is None and "no events" in bwd["wall_error"] and bwd["kernel_us_cold"] == 3.0
    for direction in ("fwd", "bwd"):
        assert "cannot build" in recs[("broken", direction)]["error"]
    assert set(result.records[0]["host_wall_us"]) == {"events only", "x.add_(1)"}
