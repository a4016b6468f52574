"""benchmarks/triton_sweep.py on the CPU: its candidate tiles for every mode come out of the backend's names as they
are (the sweep launches through ``backends.triton.launch`` only), and the whole-row tail tiles compute the tail's
contract under the interpreter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from csa_compressor import dispatch
from csa_compressor import tail as T
from csa_compressor.testing import bf16_ulp_distance, make_pack

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="needs triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton runs CPU tensors only interpreted

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("triton_sweep", ROOT / "benchmarks" / "triton_sweep.py")
sweep = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sweep)


@pytest.mark.parametrize(("ratio", "coff", "head_dim"), [(4, 2, 128), (4, 2, 512), (128, 1, 512), (128, 2, 128)])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_candidates_of_every_mode(ratio, coff, head_dim, direction):
    """The default first, then distinct tiles; the tail's span whole rows within the register bound."""
    backend = sweep._Backend()
    found = sweep.candidates(backend, direction, ratio, coff, head_dim)
    assert found[0] == backend.default(direction, ratio, coff, head_dim) and len(set(found)) == len(found) > 1
    if coff * ratio <= 16:
        tiles = sweep.tail_candidates(backend, direction, ratio, coff, head_dim)
        assert tiles[0] == backend.tail_default(direction, ratio, coff, head_dim) and len(set(tiles)) == len(tiles)
        for cfg in tiles:
            assert cfg.block_d >= head_dim and coff * ratio * cfg.vec <= 32, cfg
            assert cfg.block_r * cfg.block_d == 32 * cfg.num_warps * cfg.vec or cfg == tiles[0], cfg


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_tail_tiles_compute_the_contract(direction):
    """A few whole-row tiles of each direction (the first, a middle and the last), launched as the sweep launches
    them, against the tail's fp32 reference and contract."""
    backend = sweep._Backend()
    ratio, coff, head_dim = 4, 2, 64
    pack = make_pack((13, 9, 4), head_dim, ratio, coff, seed=1, device=DEVICE)
    tail = T.random_tail(pack, rope_dim=32, positions=True, seed=2)
    kw = dict(ratio=ratio, coff=coff)
    rstd = torch.empty(pack.total_comp, device=DEVICE)
    tiles = sweep.tail_candidates(backend, direction, ratio, coff, head_dim)
    for cfg in (tiles[0], tiles[len(tiles) // 2], tiles[-1]):
        out = torch.full((pack.total_comp, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        forward_tile = cfg if direction == "forward" else backend.tail_default("forward", ratio, coff, head_dim)
        backend.tail_forward(pack, out, forward_tile, tail, rstd)
        if direction == "forward":
            expected = T.forward(*pack.inputs, tail, total_comp=pack.total_comp, **kw)
            assert int(bf16_ulp_distance(out, expected).max()) <= 1, cfg
            assert T.contract_report(pack, tail, out=out)["ok"], cfg
            continue
        grads = [torch.full_like(t, float("nan")) for t in (pack.kv, pack.score, pack.ape)]
        grads.append(torch.full((head_dim,), float("nan"), device=DEVICE))
        backend.tail_backward(pack, grads, cfg, tail, rstd)
        assert T.contract_report(pack, tail, grads=tuple(grads))["ok"], cfg
