"""benchmarks/cute_sweep.py's --tail-parts on the CPU: every variant's tail reaches the API and is timed, forward and
backward (the reference backend and a stub timer stand in for a GPU's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("cute_sweep", ROOT / "benchmarks" / "cute_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StubTimer:
    """Calls each timed function once per measurement and counts the calls; every time reads 1 us."""

    def __init__(self):
        self.calls = 0

    def warm_up(self, fn, calls=3):
        fn()

    def kernel(self, fn, calls, cold):
        self.calls += 1
        result = fn()
        assert result is not None
        return SimpleNamespace(us=1.0)


def test_every_variant_is_timed_forward_and_backward(capsys):
    tool = _tool()
    timer = StubTimer()
    tool.time_tail_parts(timer, "1x8192-d128", "reference", device="cpu")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"1x8192-d128 {v}" for v in ("pooling", *tool.TAIL_PART_VARIANTS)]
    assert all(line.endswith("fwd 1.00 / 1.00  bwd 1.00 / 1.00") for line in lines)
    assert timer.calls == 4 * len(lines)  # cold and warm, forward and backward


def test_it_needs_a_gpu_and_known_cases(monkeypatch, capsys):
    tool = _tool()
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["cute_sweep.py", "--tail-parts"])
    assert tool.main() == 2 and "needs a GPU" in capsys.readouterr().err
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tool, "available_backends", lambda device: ("cute",))
    monkeypatch.setattr("sys.argv", ["cute_sweep.py", "--tail-parts", "--cases", "1x8192-d128,1x65536-d512"])
    assert tool.main() == 2 and "['1x65536-d512'] are not among" in capsys.readouterr().err
