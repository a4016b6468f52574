"""Every script in examples/ runs to its end in a subprocess, as a user would run it (on the CPU here, where each
takes its documented CPU path: the reference backend, the Triton interpreter, the eager fallback of the graphs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_every_example_is_listed_here():
    assert {p.name for p in EXAMPLES} == {"cuda_graphs.py", "megatron_dispatch.py", "train_compressor.py"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The interpreter choice is the script's own (megatron_dispatch sets it when there is no GPU).
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ok"), proc.stdout[-3000:]
