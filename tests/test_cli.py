"""The command line as a user meets it (subprocesses, CPU): every user error is one line on stderr and exit status
2, never a traceback; ``--help`` says what each command does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")

# name -> arguments of `python -m csa_compressor`: the first as real commands, the rest in one interpreter (torch's
# import is slow).
COMMANDS = {
    "check_help": ["--help"],
    "bench_help": ["bench", "--help"],
    "check_cute_on_cpu": ["--backends", "cute", "--device", "cpu"],
    "bench_without_gpu": ["bench"],
}
IN_ONE_INTERPRETER = {
    "check_unknown_backend": ["--backends", "bogus"],
    "check_cuda_without_cuda": ["--device", "cuda"],
    "check_unknown_device": ["--device", "tpu"],
    "check_stray_argument": ["extra"],
    "bench_unknown_backend": ["bench", "--backends", "bogus"],
    "bench_zero_reps": ["bench", "--reps", "1", "0", "2"],
    "bench_word_reps": ["bench", "--reps", "1", "x", "2"],
    "bench_negative_budget": ["bench", "--budget-s", "-5"],
    "bench_case_index": ["bench", "--cases", "99"],
    "bench_case_name": ["bench", "--cases", "1x8192"],
    "bench_unknown_direction": ["bench", "--directions", "sideways"],
    "bench_cute_without_gpu": ["bench", "--backends", "cute", "--out", "{tmp}/never"],
    "bench_list": ["bench", "--list"],
}
# Their point is a machine without CUDA; on a GPU they would run (a whole bench), so the fixture leaves them out.
WITHOUT_CUDA = {"check_cuda_without_cuda", "bench_without_gpu", "bench_cute_without_gpu"}
# Runs each argument list through the entry point as `python -m` would: exit status, output, any escaped traceback.
DRIVER = """
import contextlib, io, json, sys, traceback
from csa_compressor.__main__ import main
out = {}
for name, argv in json.loads(sys.argv[1]).items():
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            traceback.print_exc()
            rc = "exception"
    out[name] = [rc, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    left_out = WITHOUT_CUDA if torch.cuda.is_available() else set()
    one = {name: [a.format(tmp=tmp) for a in args] for name, args in IN_ONE_INTERPRETER.items() if name not in left_out}
    driver = _start(["-c", DRIVER, json.dumps(one)])
    procs = {name: _start(["-m", "csa_compressor", *args]) for name, args in COMMANDS.items() if name not in left_out}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    out.update({name: tuple(r) for name, r in json.loads(stdout.splitlines()[-1]).items()})
    out["tmp"] = tmp
    return out


def _usage_error(results, name: str, *words: str) -> str:
    rc, stdout, stderr = results[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, (rc, stdout, stderr)
    assert "Traceback" not in stderr + stdout and stdout == ""
    assert len(lines) == 1 and ": error: " in lines[0], stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("check_unknown_backend", ("unknown backend 'bogus'", "cute, triton, reference")),
        ("check_cute_on_cpu", ("backend 'cute' cannot run on cpu",)),
        ("check_unknown_device", ("unknown device 'tpu'",)),
        ("check_stray_argument", ("unrecognized arguments: extra",)),
        ("bench_unknown_backend", ("unknown backend 'bogus'",)),
        ("bench_zero_reps", ("--reps", "at least 1")),
        ("bench_word_reps", ("--reps", "whole number")),
        ("bench_negative_budget", ("--budget-s", "positive")),
        ("bench_case_index", ("case index 99 out of range",)),
        ("bench_case_name", ("cannot parse case '1x8192'",)),
        ("bench_unknown_direction", ("unknown direction 'sideways'",)),
    ],
)
def test_user_errors_are_one_line_and_status_2(results, name, words):
    _usage_error(results, name, *words)


def test_cute_on_cpu_says_why(results):
    """The reason is the one that applies here: CuTe-DSL missing, else the device."""
    from csa_compressor import dispatch

    missing = dispatch.unavailable_reason("cute")
    _usage_error(results, "check_cute_on_cpu", "not importable" if missing else "CUDA")


@NO_CUDA
def test_cuda_requests_without_cuda(results):
    _usage_error(results, "check_cuda_without_cuda", "CUDA is not available")
    _usage_error(results, "bench_without_gpu", "needs a CUDA GPU", "python -m csa_compressor")
    _usage_error(results, "bench_cute_without_gpu", "needs a CUDA GPU")
    assert not (results["tmp"] / "never").exists()  # nothing written


def test_help_says_what_each_command_does(results):
    rc, check, _ = results["check_help"]
    assert rc == 0 and "main job" not in check
    assert "Check that the installed backends compute the compressor pooling correctly" in check
    assert "float64 reference" in check and "bench" in check and "2 on a usage error" in check
    rc, bench, _ = results["bench_help"]
    assert rc == 0 and "Time the fused compressor-pooling kernels on this GPU" in bench
    for words in ("./csa_compressor_bench/", "torch.compile", "cudnn-frontend", "RMSNorm", "--timing-probe"):
        assert words in bench, words
    rc, listing, _ = results["bench_list"]
    assert rc == 0 and "0: 1x8192-d128-r4-c2" in listing and "6: 3x8192-d512-r128-c1" in listing


def test_the_self_check_names_only_backends_that_cannot_run(monkeypatch):
    """A default run leaves out the backends this machine cannot run, with their reasons; never the reference."""
    from csa_compressor import dispatch, selfcheck

    monkeypatch.setattr(dispatch, "available_backends", lambda device: ["triton", "reference"])
    backends, left_out = selfcheck._select(None, torch.device("cpu"))
    assert backends == ["triton", "reference"]
    assert len(left_out) == 1 and "cute" in left_out[0] and "reference" not in left_out[0]
    assert left_out[0].endswith(f"({selfcheck._reason('cute', torch.device('cpu'))})")  # the backend's own reason
    assert selfcheck._select(["reference,triton"], torch.device("cpu")) == (["reference", "triton"], [])
