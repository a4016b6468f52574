"""benchmarks/revision_ab.py on the CPU: sides from revisions and patches in a throwaway repository, the bench of
this tree in each, the alternating order, the medians and the cubin comparison."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("revision_ab", ROOT / "benchmarks" / "revision_ab.py")
ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab)

# A stand-in for benchmarks/cubins.py: its "cubin" is a hash of the kernel source, so a patch changes it.
FAKE_CUBINS = """
import argparse, hashlib, json, pathlib
p = argparse.ArgumentParser(); p.add_argument("--arch"); p.add_argument("--out")
a = p.parse_args()
src = pathlib.Path("csa_compressor/kernel.py").read_bytes()
pathlib.Path(a.out).write_text(json.dumps({"fwd": hashlib.sha256(src).hexdigest(), "arch": a.arch}))
"""


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A repository in the bench's older layout (csa_compressor/bench.py) with one kernel file, and a patch."""
    repo = tmp_path / "repo"
    (repo / "csa_compressor").mkdir(parents=True)
    (repo / "benchmarks").mkdir()
    (repo / "csa_compressor" / "__init__.py").write_text("")
    (repo / "csa_compressor" / "bench.py").write_text("OLD = True\n")
    (repo / "csa_compressor" / "kernel.py").write_text("TILE = 128\n")
    (repo / "benchmarks" / "cubins.py").write_text(FAKE_CUBINS)
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    (repo / "csa_compressor" / "kernel.py").write_text("TILE = 256\n")
    (tmp_path / "wide.patch").write_text(_git(repo, "diff"))
    _git(repo, "checkout", "-q", "--", ".")
    return repo


def test_prepare_trims_sides_for_a_device_call(repo, tmp_path, monkeypatch):
    """--trim: the package in both sides; side B keeps the named tests and the test modules they import."""
    files = {
        "docs/index.md": "",
        "CHANGELOG.md": "",
        "tests/__init__.py": "",
        "tests/conftest.py": "from tests.fixtures import pack\n",
        "tests/fixtures.py": "pack = 1\n",
        "tests/naive.py": "",
        "tests/unused.py": "",
        "tests/test_other.py": "",
        "tests/backends/__init__.py": "",
        "tests/backends/common.py": "from .. import naive\n",
        "tests/backends/test_kernel.py": "from .common import naive\nfrom ..fixtures import pack\n",
    }
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", ".")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "tests")
    monkeypatch.chdir(tmp_path)
    ab.prepare(["HEAD", "HEAD+wide.patch"], tmp_path / "ab", repo=repo, trim=True,
               keep_tests=["tests/backends/test_kernel.py"])  # fmt: skip

    def listing(side):
        root = tmp_path / "ab" / side
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".git" not in p.parts)

    package = ["csa_compressor/__init__.py", "csa_compressor/__main__.py", "csa_compressor/kernel.py"]
    bench = [f"csa_compressor/bench/{p.name}" for p in (ROOT / "csa_compressor" / "bench").glob("*.py")]
    assert listing("a") == sorted(package + bench)
    kept = ["tests/__init__.py", "tests/conftest.py", "tests/fixtures.py", "tests/naive.py",
            "tests/backends/__init__.py", "tests/backends/common.py", "tests/backends/test_kernel.py"]  # fmt: skip
    assert listing("b") == sorted(package + bench + kept)
    assert (tmp_path / "ab" / "b" / "csa_compressor" / "kernel.py").read_text() == "TILE = 256\n"


def test_parse_side(tmp_path):
    (tmp_path / "x.patch").write_text("")
    assert ab.parse_side("HEAD", tmp_path) == ("HEAD", [])
    assert ab.parse_side("main+x.patch", tmp_path) == ("main", [tmp_path / "x.patch"])
    with pytest.raises(ValueError, match="no patch file"):
        ab.parse_side("HEAD+missing.patch", tmp_path)
    with pytest.raises(ValueError, match="no revision"):
        ab.parse_side("+x.patch", tmp_path)


def test_prepare_builds_each_side_with_this_trees_bench(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sides = ab.prepare(["HEAD", "HEAD+wide.patch"], tmp_path / "ab", repo=repo)
    a, b = tmp_path / "ab" / "a", tmp_path / "ab" / "b"
    assert (a / "csa_compressor" / "kernel.py").read_text() == "TILE = 128\n"
    assert (b / "csa_compressor" / "kernel.py").read_text() == "TILE = 256\n"  # the patch, on top of HEAD
    for side in (a, b):
        assert not (side / "csa_compressor" / "bench.py").exists()
        ours = sorted(p.name for p in (ROOT / "csa_compressor" / "bench").glob("*.py"))
        assert sorted(p.name for p in (side / "csa_compressor" / "bench").glob("*.py")) == ours
        assert (side / "csa_compressor" / "__main__.py").read_bytes() == (
            ROOT / "csa_compressor" / "__main__.py"
        ).read_bytes()
    assert sides["a"]["commit"] == sides["b"]["commit"] and sides["b"]["patches"] == ["wide.patch"]
    assert json.loads((tmp_path / "ab" / "sides.json").read_text()) == sides
    ab.prepare(["HEAD", "HEAD"], tmp_path / "ab", repo=repo)  # again: the earlier worktrees are replaced
    assert (b / "csa_compressor" / "kernel.py").read_text() == "TILE = 128\n"
    # Offline device-code comparison through each side's benchmarks/cubins.py.
    assert ab.cubins(tmp_path / "ab", "sm_90a", 60) == []
    ab.prepare(["HEAD", "HEAD+wide.patch"], tmp_path / "ab", repo=repo)
    assert ab.cubins(tmp_path / "ab", "sm_90a", 60) == ["fwd: differs"]
    shutil.rmtree(tmp_path / "ab")  # sides deleted by hand: their worktrees are still registered in the repo
    ab.prepare(["HEAD", "HEAD+wide.patch"], tmp_path / "ab", repo=repo)
    assert (b / "csa_compressor" / "kernel.py").read_text() == "TILE = 256\n"


def test_run_alternates_and_compare_takes_medians(tmp_path, monkeypatch):
    assert ab.run_order(3) == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    work = tmp_path / "ab"
    work.mkdir()
    (work / "sides.json").write_text(json.dumps({s: {"spec": s.upper(), "commit": "0" * 40} for s in "ab"}))
    order = []
    colds = {"a0": 10.0, "b0": 9.0, "b1": 9.4, "a1": 10.4, "a2": 11.0, "b2": 30.0}

    def fake_run_side(side_dir, out, name, commit, bench_args, timeout_s):
        order.append((side_dir.name, name, bench_args))
        out.mkdir(parents=True, exist_ok=True)
        rec = dict(case="1x8192-d128-r4-c2", backend="cute", direction="fwd", kernel_us_cold=colds[name],
                   kernel_us_warm=1.0, wall_us=None)  # fmt: skip
        record = [rec] if name.startswith("a") else {"runs": {"r": {}}, "cases": {}, "rows": [{"run": "r", **rec}]}
        (out / f"{name}.json").write_text(json.dumps(record))  # an older bench's list, and the compact form
        return 0 if name != "b2" else 3

    monkeypatch.setattr(ab, "run_side", fake_run_side)
    assert ab.run(work, 3, ["--cases", "0"], 60) == ["b2: exit status 3"]
    assert [n for _, n, _ in order] == ["a0", "b0", "b1", "a1", "a2", "b2"] and order[0][2] == ["--cases", "0"]
    text = ab.compare(work)
    row = next(line for line in text.splitlines() if line.startswith("| 1x8192"))
    assert "| 10.4 / 9.4 |" in row and "| 1.0 / 1.0 |" in row and "| — / — |" in row  # medians of three runs
    assert row.endswith(f"| {9.4 / 10.4:.3f} |") and (work / "ab.md").read_text().startswith("A = A")


def test_compare_files(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"fwd": "1", "bwd": "2", "old": "3"}))
    b.write_text(json.dumps({"fwd": "1", "bwd": "9", "new": "4"}))
    assert ab.compare_files(a, b) == ["bwd: differs", "new: only in B", "old: only in A"]
    a.write_bytes(b"\x00\x01")
    b.write_bytes(b"\x00\x01")
    assert ab.compare_files(a, b) == []
    b.write_bytes(b"\x00\x02")
    assert "the files differ" in ab.compare_files(a, b)[0]


def test_command_line_errors_are_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "revision_ab.py"), "--dir", str(tmp_path / "none"), "compare"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "sides.json" in proc.stderr


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's git checkout")
@pytest.mark.parametrize("patch", sorted((ROOT / "benchmarks" / "experiments").glob("*.patch")), ids=lambda p: p.stem)
def test_waiting_experiments_apply_to_this_tree(patch):
    """Each patch waiting for its A/B (benchmarks/experiments/) still applies to this tree: rebase or delete it."""
    result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert patch.stem in (ROOT / "benchmarks" / "experiments" / "README.md").read_text()
