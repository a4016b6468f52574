"""Fuzzing with malformed packs: hypothesis draws them (every malformation of offsets and total_comp, alone and
in pairs), tests/fuzz_worker.py runs them in a subprocess (a crash fails the test) and checks each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from csa_compressor import dispatch

from .backends.common import child_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "fuzz_worker.py"
KINDS = (
    "truncated",
    "beyond_T",
    "negative",
    "decreasing",
    "int32_extremes",
    "counts",
    "comp_start",
    "short_T",
    "longer",
    "lengths_differ",
)
INT32_MAX = 2**31 - 1


def _cumsum(values):
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


@st.composite
def _mutation(draw, kind, case):
    """Apply one malformation ``kind`` to ``case`` (a dict, changed in place)."""
    cu, comp, ratio = case["cu_seqlens"], case["cu_seqlens_comp"], case["ratio"]
    b = draw(st.integers(1, min(len(cu), len(comp)) - 1))
    if kind == "truncated":
        if comp[-1] <= 0:  # rows to drop: a first segment of two groups and a tail
            # At most 2 * ratio + 1 tokens more: after an int32 extreme cu[1] - cu[0] may be near -2**31.
            grow = min(max(2 * ratio + 1 - (cu[1] - cu[0]), 0), 2 * ratio + 1)
            cu[1:] = [v + grow for v in cu[1:]]
            comp[1:] = [v + 2 for v in comp[1:]]
            case["tokens"] += grow
        # Below the real rows; capped, since a malformed comp[-1] may be near 2**31 (the output has total_comp rows).
        case["total_comp"] = draw(st.integers(0, min(max(comp[-1] - 1, 0), 64)))
    elif kind == "beyond_T":
        delta = draw(st.integers(1, 3 * ratio))
        cu[b:] = [v + delta for v in cu[b:]]
        if draw(st.booleans()):  # counts consistent with the new lengths: only the T bound is broken
            comp[:] = _cumsum((cu[i + 1] - cu[i]) // ratio for i in range(len(cu) - 1))
    elif kind == "negative":
        cu[draw(st.integers(0, len(cu) - 1))] = -draw(st.integers(1, 3 * ratio))
    elif kind == "decreasing":
        cu[b] = cu[b - 1] - draw(st.integers(1, 2 * ratio))
    elif kind == "int32_extremes":
        target = draw(st.sampled_from([cu, comp]))
        target[draw(st.integers(0, len(target) - 1))] = draw(
            st.sampled_from([INT32_MAX, INT32_MAX - ratio, -(2**31), 2**30])
        )
    elif kind == "counts":
        comp[b] += draw(st.sampled_from([-2, -1, 1, 2, 50]))
    elif kind == "comp_start":
        comp[0] = draw(st.integers(1, 3))
    elif kind == "short_T":
        case["tokens"] = draw(st.integers(0, ratio - 1))
        cu[:] = [min(v, case["tokens"]) for v in cu]
        comp[:] = [0] * len(cu)
        case["total_comp"] = draw(st.integers(0, 2))
    elif kind == "longer":  # trailing entries: repeats of the end (well-formed) or anything
        extra = draw(st.integers(1, 3))
        if draw(st.booleans()):
            cu.extend([cu[-1]] * extra)
            comp.extend([comp[-1]] * extra)
        else:
            cu.extend(draw(st.lists(st.integers(-8, 4 * ratio + 40), min_size=extra, max_size=extra)))
            comp.extend(draw(st.lists(st.integers(-2, 12), min_size=extra, max_size=extra)))
    elif kind == "lengths_differ":
        cu.append(cu[-1])
    return case


@st.composite
def cases(draw, first: str | None):
    """One case for the worker: a well-formed pack, then malformation ``first`` (None: none) and maybe another."""
    ratio = draw(st.sampled_from([1, 2, 3, 4, 8, 128]))
    seqlens = draw(st.lists(st.integers(0, 3 * ratio + 2), min_size=1, max_size=4))
    cu = _cumsum(seqlens)
    case = {
        "ratio": ratio,
        "coff": draw(st.sampled_from([1, 2])),
        "head_dim": draw(st.integers(1, 9)),
        "tokens": cu[-1] + draw(st.integers(0, 3)),
        "cu_seqlens": cu,
        "cu_seqlens_comp": _cumsum(s // ratio for s in seqlens),
        "seed": draw(st.integers(0, 2**16)),
    }
    case["total_comp"] = case["cu_seqlens_comp"][-1] + draw(st.integers(0, 2))
    if case["total_comp"] > 0 and case["tokens"] < ratio:
        case["tokens"] = ratio  # well-formed: padding rows read tokens 0..ratio-1
    kinds = [first] if first else []
    if draw(st.booleans()):
        kinds.append(draw(st.sampled_from(KINDS)))
    for kind in kinds:
        draw(_mutation(kind, case))
    for key in ("cu_seqlens", "cu_seqlens_comp"):  # a second malformation may push an int32 extreme past it
        case[key] = [min(max(v, -(2**31)), INT32_MAX) for v in case[key]]
    case["kinds"] = kinds
    return case


def _draw_from(first: str | None, examples: int) -> list[dict]:
    drawn: list[dict] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        derandomize=bool(os.environ.get("CI")),
    )
    @given(case=cases(first))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[:examples]


def _draw(count: int) -> list[dict]:
    """About ``count`` cases, as many from each malformation (and none); the same every CI run (reproducible)."""
    firsts = (None, *KINDS)
    return [case for first in firsts for case in _draw_from(first, -(-count // len(firsts)))]


def _run_worker(backend: str, device: str, cases_: list[dict], timeout: int) -> list[str]:
    """Run the cases in a subprocess; the failures it reports, or why it did not finish."""
    env = child_env()
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, str(WORKER), "--backend", backend, "--device", device]
    proc = subprocess.run(
        command, input=json.dumps(cases_), capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )
    begun, problems = -1, []
    for line in proc.stdout.splitlines():
        if line.startswith("BEGIN "):
            begun = int(line.split()[1])
        elif line.startswith("{"):
            result = json.loads(line)
            problems += [f"case {json.dumps(cases_[result['case']])}: {f}" for f in result["failures"]]
    if proc.returncode != 0:
        case = json.dumps(cases_[begun]) if begun >= 0 else "(before the first case)"
        problems.append(f"worker exited with {proc.returncode} during case {case}; stderr: {proc.stderr[-2000:]}")
    return problems


# A triton case runs its kernels in the interpreter, slow on a CPU; the reference is cheap.
CPU_RUNS = [("reference", 154), ("triton", 22)]


@pytest.mark.parametrize("backend,count", CPU_RUNS, ids=[b for b, _ in CPU_RUNS])
def test_malformed_packs_on_the_cpu(backend, count):
    reason = dispatch.unavailable_reason(backend)
    if backend == "triton" and not reason:  # the worker runs it interpreted
        reason = dispatch.backend_module(backend).interpreter_unsupported_reason()
    if reason:
        pytest.skip(reason)
    problems = _run_worker(backend, "cpu", _draw(count), timeout=600)
    assert not problems, "\n".join(problems[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cute", "triton", "reference"])
def test_malformed_packs_on_the_gpu(backend):
    """The same on CUDA tensors (run it under compute-sanitizer for the memory checks: see docs/safety.md)."""
    reason = dispatch.unavailable_reason(backend) or dispatch.backend_module(backend).device_unsupported_reason(
        torch.device("cuda")
    )
    if reason:
        pytest.skip(reason)
    problems = _run_worker(backend, "cuda", _draw(44), timeout=540)  # each new configuration compiles
    assert not problems, "\n".join(problems[:10])


if __name__ == "__main__":  # cases for a manual run, e.g. under compute-sanitizer: python -m tests.test_fuzz 60
    print(json.dumps(_draw(int(sys.argv[1]) if len(sys.argv) > 1 else 60)))
