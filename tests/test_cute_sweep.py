"""benchmarks/cute_sweep.py on the CPU: --tail-parts times every variant's tail through the API, forward and
backward; --tail-tiles times each tile as the fused configuration in effect (the reference backend, a stand-in for
the backend's forward and a stub timer stand in for a GPU's)."""

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


def test_tail_tiles_are_whole_rows_with_the_default_first():
    tool = _tool()
    from csa_compressor.backends.cute import tail_configs
    from csa_compressor.backends.cute.configs import TailSpec
    from csa_compressor.backends.cute.device import offline_spec

    spec = TailSpec(True, True, 64, True, False)
    for head_dim in (128, 512):
        tiles = tool.tail_tiles(head_dim, spec)
        default = tail_configs.fused_forward_for_sm90(4, 2, head_dim, offline_spec("sm_90a"), spec)
        assert tiles[0] == default and len(set(tiles)) == len(tiles)
        assert {t.vector_width for t in tiles} == set(tool.TILE_WIDTHS)
        for tile in tiles:
            assert tile.tail == spec and (tile.ratio, tile.coff, tile.head_dim) == (4, 2, head_dim)
            assert tile.column_threads * tile.vector_width >= head_dim and tile.column_chunks == 1
            assert tile.threads <= tool.TILE_MAX_THREADS and tile.column_threads & (tile.column_threads - 1) == 0


def test_tail_tiles_route_each_tile_then_restore_the_factories(monkeypatch, capsys):
    """Each tile is the fused configuration in effect while its forward runs (a stand-in that caches its route as the
    backend does writes the tail's fp32 reference); a tile that failed to build is reported, not run; the factory
    table and the route cache are restored afterwards."""
    tool = _tool()
    from csa_compressor import tail as T
    from csa_compressor.backends.cute import select, tail_launch
    from csa_compressor.backends.cute.device import offline_spec

    real_callables = tool._kernel_callables
    monkeypatch.setattr(tool, "_kernel_callables", lambda backend, *a: real_callables("reference", *a))
    monkeypatch.setitem(tool.TAIL_PART_CASES, "small", ((40, 9, 23), 128))
    seen = []

    def forward(kv, score, ape, cu, cuc, out, ratio, coff, stream, stats, tail, rstd):
        # As the backend's: the configuration resolved once per shape and kept in the route cache.
        shape = (ratio, coff, out.shape[1], tail_launch.spec_of(tail))
        if shape not in tail_launch._ROUTES:
            dev = offline_spec("sm_90a")
            tail_launch._ROUTES[shape] = select.fused_tail_config("forward", *shape[:3], dev, shape[3])
        seen.append(tail_launch._ROUTES[shape])
        out.copy_(T.forward(kv, score, ape, cu, cuc, tail, ratio=ratio, coff=coff, total_comp=out.shape[0]))

    monkeypatch.setattr(tail_launch, "forward", forward)
    factories = dict(select._FUSED_FACTORIES)
    probe = tool.make_pack((40, 9, 23), 128, 4, 2, device="cpu", seed=1)
    tiles = tool.tail_tiles(128, tail_launch.spec_of(tool.tile_tail(probe)))
    tool.time_tail_tiles(StubTimer(), "small", {tiles[1]: "RuntimeError: no"}, device="cpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "small pooling: 1.00 / 1.00" and len(lines) == 1 + len(tiles)
    assert "not built (RuntimeError: no)" in lines[2]
    assert all(line.endswith("contract ok") for i, line in enumerate(lines[1:]) if i != 1)
    assert list(dict.fromkeys(seen)) == [t for t in tiles if t != tiles[1]]
    assert select._FUSED_FACTORIES == factories and not tail_launch._ROUTES
