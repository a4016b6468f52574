"""A/B of two variants of the kernels, built from git revisions or patches, timed by the bench.

Each side is a git worktree of a revision, with patches applied on top: ``REV`` or ``REV+PATCH[+PATCH...]``
(``HEAD``, ``main``, ``HEAD+wide.patch``). Both sides are timed by this tree's bench (its ``csa_compressor/bench``
and command line are copied into each side), so only the product code differs; the runs alternate A B B A ...
so that drift of the machine falls on both sides alike, and the report gives the median of each side's runs.

    python benchmarks/revision_ab.py prepare main HEAD+wide.patch     # worktrees in ./csa_compressor_ab/
    python benchmarks/revision_ab.py prepare main HEAD+wide.patch --trim --keep-tests tests/backends/test_cute.py
    python benchmarks/revision_ab.py run --rounds 2 --bench "--cases 3 5 --tail off --backends cute"
    python benchmarks/revision_ab.py compare                          # markdown table, also in ab.md
    python benchmarks/revision_ab.py cubins --arch sm_90a             # offline: are the cubins the same?
    python benchmarks/revision_ab.py all main HEAD --bench "..."      # prepare, run, compare

``prepare`` needs git (run it here); ``run`` needs a GPU: the sides are nested worktrees, so a device call must
carry the folder (``carry: ["csa_compressor_ab"]``); ``--trim`` keeps of each side only the package (and side B's
``--keep-tests`` with the test modules they import), so that several pairs fit beside the CuTe-DSL bundle.
``cubins`` runs ``benchmarks/cubins.py --arch ARCH --out FILE`` in each side (this tree's copy where a side has
none) and compares the two files.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = Path("csa_compressor_ab")
SIDES = ("a", "b")
FIGURES = ("kernel_us_cold", "kernel_us_warm", "wall_us")


def parse_side(spec: str, base: Path | None = None) -> tuple[str, list[Path]]:
    """``REV+PATCH+...`` as (revision, patch files); a patch path is taken relative to ``base`` (default: here)."""
    base = base or Path.cwd()
    rev, *patches = spec.split("+")
    if not rev:
        raise ValueError(f"side {spec!r}: no revision (expected REV or REV+PATCH)")
    paths = [(base / p).resolve() for p in patches]
    for path in paths:
        if not path.is_file():
            raise ValueError(f"side {spec!r}: no patch file {path}")
    return rev, paths


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def overlay_bench(side: Path, tree: Path = ROOT) -> None:
    """This tree's bench and command line in place of the side's, so that both sides are timed alike."""
    pkg = side / "csa_compressor"
    (pkg / "bench.py").unlink(missing_ok=True)  # an older layout: the bench as one module
    shutil.rmtree(pkg / "bench", ignore_errors=True)
    shutil.copytree(tree / "csa_compressor" / "bench", pkg / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(tree / "csa_compressor" / "__main__.py", pkg / "__main__.py")


def prepare(specs: list[str], workdir: Path, repo: Path = ROOT, trim: bool = False, keep_tests=()) -> dict:
    """A worktree per side under ``workdir`` (replacing earlier ones), patches applied, the bench overlaid; with
    ``trim``, each side cut to what a device call runs (``trim_side``: side B keeps ``keep_tests``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    _git("worktree", "prune", cwd=repo)  # forget sides whose folders were deleted by hand, so they can be added again
    sides = {}
    for name, spec in zip(SIDES, specs, strict=True):
        rev, patches = parse_side(spec)
        path = (workdir / name).resolve()
        if path.exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=repo, capture_output=True)
            shutil.rmtree(path, ignore_errors=True)
        _git("worktree", "add", "--detach", str(path), rev, cwd=repo)
        for patch in patches:
            _git("apply", str(patch), cwd=path)
        overlay_bench(path)
        if trim:
            trim_side(path, keep_tests if name == "b" else ())
        commit = _git("rev-parse", "HEAD", cwd=path)
        sides[name] = {"spec": spec, "commit": commit, "patches": [p.name for p in patches]}
    (workdir / "sides.json").write_text(json.dumps(sides, indent=1) + "\n")
    return sides


# What a trimmed side keeps besides its tests: the package (with this tree's bench) and its metadata.
TRIM_KEEPS = ("csa_compressor", "pyproject.toml", ".git")


def needed_tests(side: Path, tests) -> set[Path]:
    """``tests`` (paths in ``side``) and what they need to import, transitively: each test folder's ``__init__.py``
    and ``conftest.py``, and the modules of their relative or ``tests.`` imports."""
    todo = [side / t for t in tests]
    for path in list(todo):
        for folder in path.relative_to(side).parents:
            if folder.parts[:1] == ("tests",):
                todo += [side / folder / "__init__.py", side / folder / "conftest.py"]
    keep: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in keep or not path.is_file():
            continue
        keep.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = path.parent
                for _ in range(node.level - 1):
                    base = base.parent
                if node.level == 0:
                    if not (node.module or "").startswith("tests"):
                        continue
                    base = side
                parts = (node.module or "").split(".") if node.module else []
                target = base.joinpath(*parts)
                todo += [target.with_suffix(".py"), target / "__init__.py"]
                todo += [target / f"{alias.name}.py" for alias in node.names]
    return keep


def trim_side(side: Path, keep_tests=()) -> None:
    """Delete from a side's worktree what a device call does not run (a call carries at most 64 MiB, the CuTe-DSL
    bundle most of it): everything but ``TRIM_KEEPS`` and ``keep_tests`` with the test modules they need."""
    keep = needed_tests(side, keep_tests)
    for entry in side.iterdir():
        if entry.name in TRIM_KEEPS:
            continue
        if entry.name == "tests" and keep:
            for path in sorted(entry.rglob("*"), reverse=True):  # files before their folders
                if path.is_file() and path not in keep:
                    path.unlink()
                elif path.is_dir() and not any(path.iterdir()):
                    path.rmdir()
        elif entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def run_order(rounds: int) -> list[tuple[str, int]]:
    """A B B A A B ...: each side first in half of the rounds."""
    order = []
    for i in range(rounds):
        pair = SIDES if i % 2 == 0 else SIDES[::-1]
        order += [(side, i) for side in pair]
    return order


def run_side(side_dir: Path, out: Path, name: str, commit: str, bench_args: list[str], timeout_s: float) -> int:
    """One bench run in a side's worktree (its package is the one imported)."""
    cmd = [sys.executable, "-m", "csa_compressor", "bench", "--out", str(out), "--name", name, "-q"]
    cmd += ["--commit", commit, *bench_args]
    print(f"[{name}] {' '.join(cmd[3:])}", flush=True)
    return subprocess.run(cmd, cwd=side_dir, timeout=timeout_s, stdout=subprocess.DEVNULL).returncode


def run(workdir: Path, rounds: int, bench_args: list[str], timeout_s: float) -> list[str]:
    sides = json.loads((workdir / "sides.json").read_text())
    out = (workdir / "runs").resolve()
    shutil.rmtree(out, ignore_errors=True)
    failed = []
    for side, i in run_order(rounds):
        name = f"{side}{i}"
        rc = run_side((workdir / side).resolve(), out, name, sides[side]["commit"][:12], bench_args, timeout_s)
        if rc not in (0, 1):  # 1: some measurements failed, and the record lists them
            failed.append(f"{name}: exit status {rc}")
    return failed


def medians(runs: list[list[dict]]) -> dict[tuple[str, str, str], dict[str, float]]:
    """Per (case, backend, direction): the median of each figure over the runs that measured it."""
    values: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    for records in runs:
        for rec in records:
            slot = values.setdefault((rec["case"], rec["backend"], rec["direction"]), {})
            for key in FIGURES:
                if rec.get(key) is not None:
                    slot.setdefault(key, []).append(rec[key])
    return {k: {f: statistics.median(v) for f, v in figs.items()} for k, figs in values.items()}


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def compare(workdir: Path) -> str:
    """Markdown: A and B medians of cold, warm and wall per measurement, and B / A of the cold time."""
    sides = json.loads((workdir / "sides.json").read_text())
    sys.path.insert(0, str(ROOT))  # the records' one reader, this tree's (its bench wrote both sides' records)
    from csa_compressor.bench.report import expand_records

    paths = {s: sorted((workdir / "runs").glob(f"{s}[0-9]*.json")) for s in SIDES}
    runs = {s: [expand_records(json.loads(p.read_text())) for p in paths[s]] for s in SIDES}
    a, b = medians(runs["a"]), medians(runs["b"])
    lines = [f"A = {sides['a']['spec']} ({sides['a']['commit'][:12]}), B = {sides['b']['spec']} "
             f"({sides['b']['commit'][:12]}); medians of {len(runs['a'])} / {len(runs['b'])} runs, us", "",
             "| case | backend | dir | cold A / B | warm A / B | wall A / B | cold B / A |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for key in a:
        if key not in b:
            continue
        pair = [f"{_fmt(a[key].get(f))} / {_fmt(b[key].get(f))}" for f in FIGURES]
        cold_a, cold_b = a[key].get("kernel_us_cold"), b[key].get("kernel_us_cold")
        ratio = f"{cold_b / cold_a:.3f}" if cold_a and cold_b else "—"
        lines.append(f"| {' | '.join(key)} | {' | '.join(pair)} | {ratio} |")
    text = "\n".join(lines)
    (workdir / "ab.md").write_text(text + "\n")
    return text


def compare_files(a: Path, b: Path) -> list[str]:
    """Differences between two cubin records: per entry for JSON objects (names to hashes or bytes), else whole."""
    try:
        da, db = json.loads(a.read_text()), json.loads(b.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        da = db = None
    if isinstance(da, dict) and isinstance(db, dict):
        return [f"{k}: only in {'A' if k in da else 'B'}" if (k in da) != (k in db) else f"{k}: differs"
                for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]  # fmt: skip
    digest = [hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in (a, b)]
    return [] if digest[0] == digest[1] else [f"the files differ (sha256 {digest[0]} / {digest[1]})"]


def cubins(workdir: Path, arch: str, timeout_s: float) -> list[str]:
    """benchmarks/cubins.py in each side (this tree's where the side has none), then the comparison."""
    outs = []
    for side in SIDES:
        side_dir = (workdir / side).resolve()
        script = side_dir / "benchmarks" / "cubins.py"
        if not script.is_file():
            shutil.copy2(ROOT / "benchmarks" / "cubins.py", script)
        out = (workdir / f"cubins_{side}.json").resolve()
        cmd = [sys.executable, "benchmarks/cubins.py", "--arch", arch, "--out", str(out)]
        subprocess.run(cmd, cwd=side_dir, check=True, timeout=timeout_s)
        outs.append(out)
    return compare_files(*outs)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the sides' folder (default ./%(default)s)")
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("prepare", "all"):
        p = sub.add_parser(name)
        p.add_argument("a", help="side A: REV or REV+PATCH[+PATCH...]")
        p.add_argument("b", help="side B, the same form")
        p.add_argument("--trim", action="store_true", help="cut each side to the package (for a device call)")
        p.add_argument("--keep-tests", nargs="*", default=[], metavar="TEST",
                       help="with --trim: test files side B keeps (with the test modules they import)")  # fmt: skip
    for name in ("run", "all"):
        p = sub.choices[name] if name in sub.choices else sub.add_parser(name)
        p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating (default 2: A B B A)")
        p.add_argument(
            "--bench",
            default="--tail off --backends cute triton",
            help="arguments of every bench run (default: %(default)s)",
        )
        p.add_argument("--timeout-s", type=float, default=900, help="limit of one bench run")
    sub.add_parser("compare")
    p = sub.add_parser("cubins")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--timeout-s", type=float, default=600)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("prepare", "all"):
            print(json.dumps(prepare([args.a, args.b], args.dir, trim=args.trim, keep_tests=args.keep_tests), indent=1))
        if args.command in ("run", "all"):
            failed = run(args.dir, args.rounds, args.bench.split(), args.timeout_s)
            for line in failed:
                print(f"run failed: {line}", file=sys.stderr)
        if args.command in ("compare", "all"):
            print(compare(args.dir))
        if args.command == "cubins":
            diffs = cubins(args.dir, args.arch, args.timeout_s)
            print("cubins identical" if not diffs else "\n".join(diffs))
            return 0 if not diffs else 1
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or ""
        print(f"revision_ab: {exc} {detail}".strip(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
