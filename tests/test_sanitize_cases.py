"""The compute-sanitizer script's own logic, on the CPU with the reference backend: the kernels' results come back
to the CPU references and a wrong result is reported (a GPU session must not be the first to run it)."""

import pytest
import torch

from tests import sanitize_cases


def _two_bf16_steps_off(wrapper):
    """``wrapper`` with ``out`` moved two bf16 steps away from zero in its first row (past the 1-ulp contract)."""

    def call(*args, **kwargs):
        result = wrapper(*args, **kwargs)
        if isinstance(result, dict) and "out" in result:
            bits = result["out"].view(torch.int16)
            bits[0] += 2
        return result

    return call


def test_well_formed_cases_pass_on_the_reference_backend():
    assert sanitize_cases.run_pooling_cases("reference", "cpu", len(sanitize_cases.CASES))
    assert sanitize_cases.run_tail_cases("reference", "cpu")


@pytest.mark.parametrize("run", ["pooling", "tail"])
def test_a_wrong_forward_is_reported(run, monkeypatch):
    wrapper = sanitize_cases.csa_compressor_forward_wrapper
    monkeypatch.setattr(sanitize_cases, "csa_compressor_forward_wrapper", _two_bf16_steps_off(wrapper))
    if run == "pooling":
        assert not sanitize_cases.run_pooling_cases("reference", "cpu", 1)
    else:
        assert not sanitize_cases.run_tail_cases("reference", "cpu")
