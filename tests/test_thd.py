"""THD helpers: cu_seqlens_comp on the device, pack validation, row layout."""

import pytest
import torch

from csa_compressor import compute_cu_seqlens_comp, validate_pack
from csa_compressor.thd import row_layout


@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_cu_seqlens_comp_matches_python(ratio):
    seqlens = [0, 3, 4, 131, 9, 0, 256]
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    got = compute_cu_seqlens_comp(cu, ratio)
    expected = [0]
    for n in seqlens:
        expected.append(expected[-1] + n // ratio)
    assert got.dtype == torch.int32 and got.tolist() == expected


def test_cu_seqlens_comp_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 2 entries"):
        compute_cu_seqlens_comp(torch.zeros(1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="ratio must be an int >= 1, got 0"):
        compute_cu_seqlens_comp(torch.zeros(2, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"ratio must be an int >= 1, got 4\.0"):
        compute_cu_seqlens_comp(torch.zeros(2, dtype=torch.int32), 4.0)


@pytest.mark.gpu
def test_cu_seqlens_comp_captures_in_a_cuda_graph():
    cu = torch.tensor([0, 5, 13, 13, 40], dtype=torch.int32, device="cuda")
    compute_cu_seqlens_comp(cu, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # would fail on a host synchronisation
        out = compute_cu_seqlens_comp(cu, 4)
    cu.copy_(torch.tensor([0, 8, 8, 9, 30], dtype=torch.int32))
    graph.replay()
    assert out.tolist() == [0, 2, 2, 2, 7]


def test_validate_pack_accepts_and_names_broken_invariants():
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)
    comp = compute_cu_seqlens_comp(cu, 4)
    validate_pack(cu, comp, 4, total_tokens=13, total_comp=3)
    with pytest.raises(ValueError, match=r"count seqlen // ratio rows per segment: segment 1 has 8 tokens, 2 rows"):
        validate_pack(cu, torch.tensor([0, 1, 2], dtype=torch.int32), 4, total_tokens=13)
    with pytest.raises(ValueError, match="non-decreasing: segment 1 runs from 5 to 3"):
        validate_pack(torch.tensor([0, 5, 3], dtype=torch.int32), comp, 4, total_tokens=13)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be <= T .*segment 1 ends at 13 > T = 12"):
        validate_pack(cu, comp, 4, total_tokens=12)
    with pytest.raises(
        ValueError, match=r"total_comp must cover the real rows.*segment 1's rows end at 3 > total_comp = 2"
    ):
        validate_pack(cu, comp, 4, total_tokens=13, total_comp=2)
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0: got 1"):
        validate_pack(torch.tensor([1, 5, 13], dtype=torch.int32), comp, 4, total_tokens=13)


def test_row_layout_padding_and_empty_segments():
    cu = torch.tensor([0, 9, 9, 11, 19], dtype=torch.int32)  # an empty and a short segment
    comp = compute_cu_seqlens_comp(cu, 4)  # [0, 2, 2, 2, 4]
    t0, first, real = row_layout(cu, comp, 6, 4, 19)
    assert [t.tolist() for t in row_layout(cu, comp, 6, 4)] == [t0.tolist(), first.tolist(), real.tolist()]
    assert t0.tolist() == [0, 4, 11, 15, 0, 0]
    assert first.tolist() == [True, False, True, False, True, True]
    assert real.tolist() == [True, True, True, True, False, False]


def test_row_layout_needs_two_offsets():
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens and cu_seqlens_comp need at least 2 entries each"):
        row_layout(one, one, 2, 4, 8)
