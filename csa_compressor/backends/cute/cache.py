"""The persistent compile cache of the cute kernels: compiled host functions exported as object files in the user's
cache folder, so that a second process loads a kernel instead of compiling it.

Folder: ``$CSA_COMPRESSOR_CACHE_DIR``, else ``$XDG_CACHE_HOME/csa_compressor``, else ``~/.cache/csa_compressor``.
Inside it ``cute-<fingerprint>/<entry>.o``: the fingerprint covers the CuTe-DSL and tvm_ffi versions, the Python
version, the machine and the cute backend's sources (a change to any kernel starts a fresh folder); the entry
covers the kernel class, its configuration and the architecture.

Concurrent processes: an entry is written to a temporary file and renamed into place (readers never see a
partial file), and an exclusive per-entry file lock makes one process compile while the others wait and then
load. A file that fails to load is removed and compiled again.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import sys
import tempfile
import threading
from pathlib import Path

import cutlass
import cutlass.cute as cute
import tvm_ffi

ENV_VAR = "CSA_COMPRESSOR_CACHE_DIR"
EXPORT_NAME = "func"  # the exported host function's symbol


def cache_root() -> Path:
    """The cache folder (not created here)."""
    explicit = os.environ.get("CSA_COMPRESSOR_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "csa_compressor"


@functools.cache
def fingerprint() -> str:
    """Hash of what every entry depends on besides its own key: the tool versions and the backend's sources."""
    h = hashlib.sha256()
    for part in (cutlass.__version__, tvm_ffi.__version__, sys.version.split()[0], platform.machine()):
        h.update(part.encode() + b"\0")
    root = Path(__file__).resolve().parent
    for src in sorted(root.glob("*.py")):
        data = src.read_bytes()
        h.update(src.name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:20]


def entry_key(kernel, arch: str) -> str:
    """The entry of one compiled kernel: its class, configuration and architecture."""
    text = repr((type(kernel).__qualname__, kernel.config, arch))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def entry_path(kernel, arch: str) -> Path:
    return cache_root() / f"cute-{fingerprint()}" / f"{entry_key(kernel, arch)}.o"


def load_entry(path: Path):
    """The host function exported to ``path``."""
    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[EXPORT_NAME]


def _try_load(path: Path, remove_bad: bool):
    if not path.is_file():
        return None
    try:
        return load_entry(path)
    except Exception:
        if remove_bad:
            path.unlink(missing_ok=True)  # corrupt or from an incompatible build: compiled again
        return None


def _lock(lock_path: Path) -> int:
    """Take an exclusive advisory lock on ``lock_path`` (blocks until its holder releases it)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _export(compiled, path: Path) -> None:
    """Write ``compiled`` to ``path`` through a temporary file in the same folder and an atomic rename."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        compiled.export_to_c(str(tmp), function_name=EXPORT_NAME)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_PRIVATE_DIR: list[str] = []


def _private_path(name: str) -> Path:
    """A file in a folder of this process only, for when the cache folder cannot be written."""
    if not _PRIVATE_DIR:
        _PRIVATE_DIR.append(tempfile.mkdtemp(prefix="csa_cute_"))
    return Path(_PRIVATE_DIR[0]) / name


def load_or_compile(kernel, arch: str, compile_fn):
    """The host function of ``kernel`` for ``arch``: loaded from the cache, else ``compile_fn()`` exported there
    and loaded back (the same kind of function either way)."""
    path = entry_path(kernel, arch)
    function = _try_load(path, remove_bad=False)
    if function is not None:
        return function
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock(path.with_suffix(".lock"))
    except OSError:  # no writable cache folder: compile into a private folder
        private = _private_path(path.name)
        _export(compile_fn(), private)
        return load_entry(private)
    try:
        function = _try_load(path, remove_bad=True)  # another process may have written it meanwhile
        if function is None:
            _export(compile_fn(), path)
            function = load_entry(path)
    finally:
        _unlock(fd)
    return function
