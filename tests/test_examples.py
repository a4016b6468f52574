"""Every script in examples/ runs to its end in a subprocess (on the CPU here, each on its documented CPU path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All examples started at once (each spends most of its time importing torch), then collected."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The interpreter choice is the script's own (megatron_dispatch sets it when there is no GPU).
    env.pop("TRITON_INTERPRET", None)
    procs = {
        script.name: subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path_factory.mktemp(script.stem),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script in EXAMPLES
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (proc.returncode, out, err)
    return results


def test_every_example_is_listed_here():
    assert {p.name for p in EXAMPLES} == {
        "context_parallel.py",
        "cuda_graphs.py",
        "megatron_dispatch.py",
        "train_compressor.py",
    }


@pytest.mark.parametrize("script", [p.name for p in EXAMPLES])
def test_example_runs(runs, script):
    returncode, out, err = runs[script]
    assert returncode == 0, out[-3000:] + err[-3000:]
    assert out.strip().splitlines()[-1].startswith("ok"), out[-3000:]
