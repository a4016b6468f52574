"""The README and docs/ as a user reads them: every ```python block runs (on the CPU here), the API reference
names exactly the public names, relative links resolve, and the two copies of the performance table agree."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import csa_compressor

from .backends.common import child_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Link targets other work produces that may not be on this branch yet; empty this set once they are on main.
PENDING: set[str] = set()


def _python_pages():
    return [p for p in PAGES if BLOCK.search(p.read_text())]


@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page, tmp_path):
    """A page's blocks run in order as one script, as a reader pastes them into one session: in a fresh interpreter,
    since a block may fork ranks (autograd's threads from earlier tests forbid it) or torch.compile a function of
    its own (whose module Dynamo imports)."""
    blocks = [m.group(1) for m in BLOCK.finditer(page.read_text())]
    script = tmp_path / "blocks.py"
    script.write_text("".join(f"# {page.name}, python block {n}\n{code}\n" for n, code in enumerate(blocks, 1)))
    env = child_env()
    env.pop("CSA_COMPRESSOR_BACKEND", None)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, f"{page.name}:\n{run.stderr[-4000:]}"


def _documented(pattern: str, text: str) -> set[str]:
    return set(re.findall(pattern, text, re.M))


def test_api_reference_names_every_public_name():
    api = (ROOT / "docs" / "api.md").read_text()
    documented = _documented(r"^#{2,4} `csa_compressor\.(\w+)`", api)
    assert documented == set(csa_compressor.__all__), (
        f"undocumented: {sorted(set(csa_compressor.__all__) - documented)}; "
        f"not public: {sorted(documented - set(csa_compressor.__all__))}"
    )
    assert _documented(r"^#{2,4} `reference\.(\w+)`", api) == set(csa_compressor.reference.__all__)


def test_distributed_names_are_documented():
    try:
        distributed = importlib.import_module("csa_compressor.distributed")
    except ModuleNotFoundError:
        pytest.skip("csa_compressor.distributed is not part of this tree")
    text = "".join((ROOT / "docs" / name).read_text() for name in ("distributed.md", "api.md"))
    missing = [name for name in distributed.__all__ if f"`{name}" not in text and f"{name}(" not in text]
    assert not missing, f"csa_compressor.distributed names missing from docs/distributed.md: {missing}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path = (page.parent / target).resolve()
        if not path.exists() and str(path.relative_to(ROOT)) not in PENDING:
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files {broken}"


def _perf_table(path: Path) -> str:
    match = re.search(r"<!-- perf-table:start -->\n(.*?)<!-- perf-table:end -->", path.read_text(), re.S)
    assert match, f"{path.name} has no perf-table markers"
    return match.group(1)


def test_performance_tables_agree():
    assert _perf_table(ROOT / "README.md") == _perf_table(ROOT / "docs" / "performance.md")


def test_no_lab_notebook_in_user_pages():
    """Run ids, rounds, A/B talk and internal document names stay out of the README and the user docs."""
    banned = re.compile(
        r"\bT\d{4}Z\b|\d{8}T\d{4}Z|\b\w+(?:st|nd|rd|th) round\b|\bround \d+\b|\bA/B\b|\bSPEC\b|\bthe seed\b"
        r"|\bseed's\b|NOTES_cute|_h200_\d{8}"
    )
    for page in PAGES:
        if page.name in ("history.md",):
            continue
        hits = [m.group(0) for m in banned.finditer(page.read_text())]
        assert not hits, f"{page.relative_to(ROOT)}: {sorted(set(hits))}"


def test_documented_environment_variables_are_the_product_ones():
    env = (ROOT / "docs" / "env.md").read_text()
    names = set(re.findall(r"^\| `(CSA_[A-Z_]+)`", env, re.M))
    assert names == {"CSA_COMPRESSOR_BACKEND", "CSA_COMPRESSOR_VALIDATE", "CSA_COMPRESSOR_CACHE_DIR"}
