"""Every script in examples/ runs to its end in a subprocess (on the CPU here, each on its documented CPU path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


# torch's Gloo process group can abort a worker at interpreter exit, after destroy_process_group and after the
# script's work and checks, now and then when the machine is loaded (std::terminate on a thread still joinable).
TEARDOWN_ABORT = "terminate called without an active exception"


def _start(script: Path, cwd: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _collect(proc: subprocess.Popen) -> tuple:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All examples started at once (each spends most of its time importing torch), then collected; a script
    whose worker aborted in the process group's teardown (``TEARDOWN_ABORT``) runs once more, alone."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The interpreter choice is the script's own (megatron_dispatch sets it when there is no GPU).
    env.pop("TRITON_INTERPRET", None)
    cwd = {script.name: tmp_path_factory.mktemp(script.stem) for script in EXAMPLES}
    procs = {script.name: _start(script, cwd[script.name], env) for script in EXAMPLES}
    results = {name: _collect(proc) for name, proc in procs.items()}
    for script in EXAMPLES:
        returncode, _out, err = results[script.name]
        if returncode != 0 and TEARDOWN_ABORT in err:
            results[script.name] = _collect(_start(script, cwd[script.name], env))
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
