"""The evict-first switches (``CSA_COMPRESSOR_STREAM_LOADS``, ``CSA_COMPRESSOR_STREAM_BACKWARD``): read once at
import, so every case runs in a fresh interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    # The repository first, then whatever PYTHONPATH found the packages in this process (the GPU machine's
    # CuTe-DSL bundle is on PYTHONPATH, not installed).
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    full = {**os.environ, "PYTHONPATH": path, **env}
    full.setdefault("CUTE_DSL_ARCH", "sm_90a")
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_unknown_backward_policy_raises():
    res = _run("import csa_compressor.backends", CSA_COMPRESSOR_STREAM_BACKWARD="sometimes")
    assert res.returncode != 0
    assert "CSA_COMPRESSOR_STREAM_BACKWARD must be none, stores or all" in res.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize(
    "policy,grad,window", [("none", "", ""), ("stores", "evict_first", ""), ("all", "evict_first", "evict_first")]
)
def test_triton_backward_policies(policy, grad, window):
    code = (
        "from csa_compressor.backends.triton import backward as b, forward as f\n"
        "print(repr(b.GRAD_EVICT.value), repr(b.BWD_WINDOW_EVICT.value), repr(f.WINDOW_EVICT.value))"
    )
    res = _run(code, CSA_COMPRESSOR_STREAM_BACKWARD=policy, TRITON_INTERPRET="1")
    assert res.returncode == 0, res.stderr
    # The forward's loads keep their own switch (on by default).
    assert res.stdout.split() == [repr(grad), repr(window), repr("evict_first")]


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl")
@pytest.mark.parametrize("policy", ["none", "stores", "all"])
def test_cute_schedules_follow_the_policies(policy):
    code = (
        "from csa_compressor.backends.cute import launch as l\n"
        "from csa_compressor.backends.cute.backward_stats import stats_backward_schedule as sbs\n"
        "for d, r, c in (('forward', 4, 2), ('backward', 4, 2), ('backward', 128, 1), ('backward_stats', 128, 1)):\n"
        "    s = l._schedule(d, r, c, 128)\n"
        "    print(d, int(s.EF), int(s.ES))\n"
        "l.SCHEDULE_OVERRIDE[('backward_stats', 128, 1, 128)] = sbs(128, 1, 128, 16)\n"
        "s = l._schedule('backward_stats', 128, 1, 128)\n"
        "print('override', s.SC, int(s.EF), int(s.ES))"
    )
    res = _run(code, CSA_COMPRESSOR_STREAM_BACKWARD=policy, CSA_COMPRESSOR_STREAM_LOADS="1")
    assert res.returncode == 0, res.stderr
    ef, es = int(policy == "all"), int(policy != "none")
    assert res.stdout.split("\n")[:5] == [
        "forward 1 0",
        f"backward {ef} {es}",
        f"backward {ef} {es}",
        f"backward_stats {ef} {es}",
        # A schedule override replaces the tiles; the policies apply to it as to the defaults.
        f"override 16 {ef} {es}",
    ]
