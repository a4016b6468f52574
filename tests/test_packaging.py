"""Packaging: one version, the extras users are told about, a typed wheel (CI also installs the wheel and the sdist
in a fresh environment and runs the self-check there: .ci/run)."""

import inspect
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import csa_compressor

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_lives_in_one_place():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "csa_compressor.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", csa_compressor.__version__)
    # No other file of the package spells a version out.
    for path in (ROOT / "csa_compressor").rglob("*.py"):
        if path.name != "__init__.py" or path.parent.name != "csa_compressor":
            assert "__version__ =" not in path.read_text(), path
    # The changelog's newest entry is this version.
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert newest and newest.group(1) == csa_compressor.__version__


def test_extras_and_bounds():
    project = PYPROJECT["project"]
    assert project["dependencies"] == ["torch>=2.11"]
    extras = project["optional-dependencies"]
    assert extras["triton"] == ["triton>=3.6"]
    assert extras["cute"] == ["nvidia-cutlass-dsl[cu13]>=4.8.1,<4.9", "apache-tvm-ffi>=0.1.15"]
    assert extras["all"] == ["csa_compressor[triton,cute]"]
    assert {"pytest>=7", "build>=1"} <= set(extras["test"])
    # README names every extra it installs.
    readme = (ROOT / "README.md").read_text()
    for name in ("triton", "cute", "all", "test"):
        assert f"[{name}" in readme or f",{name}" in readme, name


def _annotated(fn) -> bool:
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls") and p.kind != p.VAR_KEYWORD]
    return all(p.annotation is not p.empty for p in params) and sig.return_annotation is not sig.empty


@pytest.mark.parametrize(
    "fn",
    [
        csa_compressor.Compressor.__init__,
        csa_compressor.Compressor.forward,
        csa_compressor.rope_tables,
        csa_compressor.compressor_pool,
        csa_compressor.compute_cu_seqlens_comp,
        csa_compressor.validate_pack,
        csa_compressor.available_backends,
    ],
    ids=lambda fn: fn.__qualname__,
)
def test_public_functions_are_annotated(fn):
    assert _annotated(fn), inspect.signature(fn)


def test_wheel_is_typed_and_carries_the_version(tmp_path):
    # Built from a copy, so that the build leaves nothing in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "csa_compressor", src / "csa_compressor", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("csa_compressor-*.whl")
    assert wheel.name.startswith(f"csa_compressor-{csa_compressor.__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"csa_compressor-{csa_compressor.__version__}.dist-info/METADATA").decode()
    assert "csa_compressor/py.typed" in names and "csa_compressor/compressor.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/", "examples/")) for n in names)
    assert f"Version: {csa_compressor.__version__}" in metadata
    assert "Requires-Dist: torch>=2.11" in metadata
    assert "Provides-Extra: cute" in metadata and "Provides-Extra: triton" in metadata
