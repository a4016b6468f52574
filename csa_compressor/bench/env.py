"""Facts about the environment a bench run records: the sources' digest, the commit, the versions."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

__all__ = ["git_commit", "source_digest", "versions"]


def source_digest(package: Path | None = None) -> str:
    """First 12 hex digits of a SHA-256 over the package's ``.py`` files (relative path and content, in path
    order). Unlike the commit it cannot go stale in a copy of the tree: the same sources give the same digest,
    so a result can be matched to a commit by checking it out and recomputing (``--source-digest``)."""
    package = package or Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_commit(repo: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding this package (``-dirty`` if it has changes), or None."""
    repo = repo or Path(__file__).resolve().parent.parent.parent
    if not (repo / "pyproject.toml").is_file():
        return None  # an installed copy, not a source checkout: no commit of ours to name
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        commit = head.stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return commit + ("-dirty" if status.returncode == 0 and status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # a broken triton install should not stop a benchmark of the other backends
        out["triton"] = None
    out["cutlass-dsl"] = None
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base"):
            try:
                out["cutlass-dsl"] = version(dist)
                break
            except PackageNotFoundError:
                continue
    except ImportError:
        pass
    if out["cutlass-dsl"] is None and "cutlass" in sys.modules:
        out["cutlass-dsl"] = getattr(sys.modules["cutlass"], "__version__", None)
    out["driver"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if smi.returncode == 0 and smi.stdout.strip():
            out["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return out
