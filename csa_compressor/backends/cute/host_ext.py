"""The cute backend's host fast path (``host_ext.cpp``): build, load, and bind it to compiled configurations.

The wrappers' per-call work (checks, allocation of the outputs, argument packing, the call of the DSL-compiled
host function) costs ~15-25 us of Python per call on the H200 machine's host; in C++ it is a few us. The
extension is built with ``torch.utils.cpp_extension`` on first use (a C++ compiler and ninja are needed; about
half a minute, cached by torch across processes) and is optional: when it cannot be built, or with
``CSA_COMPRESSOR_HOST_EXT=0``, the wrappers run the Python path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import os
import threading

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ext.cpp")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "module" or "error"


def enabled() -> bool:
    return os.environ.get("CSA_COMPRESSOR_HOST_EXT", "1") != "0"


def module():
    """The compiled extension, or None (``error()`` says why)."""
    if "module" in _STATE or "error" in _STATE:
        return _STATE.get("module")
    with _LOCK:
        if "module" not in _STATE and "error" not in _STATE:
            if not enabled():
                _STATE["error"] = "disabled by CSA_COMPRESSOR_HOST_EXT=0"
            else:
                try:
                    from torch.utils.cpp_extension import load

                    _STATE["module"] = load(
                        name="csa_cute_host", sources=[_SOURCE], extra_cflags=["-O2", "-std=c++17"], verbose=False
                    )
                except Exception as exc:  # no compiler, no ninja, headers missing: the Python path is used
                    _STATE["error"] = f"{type(exc).__name__}: {exc}"
    return _STATE.get("module")


def error() -> str | None:
    return _STATE.get("error")  # type: ignore[return-value]


def make_launch(launcher):
    """A launch record for a ``launch._Launcher`` on the packed (fast) path, or None (the Python path then runs)."""
    ext = module()
    if ext is None or not getattr(launcher, "fast", False):
        return None
    fn = ctypes.cast(launcher.capi, ctypes.c_void_p).value
    n_slots = len(launcher.slots)
    n_extra = len(launcher.packed) - n_slots
    return ext.make_launch(fn, ctypes.addressof(launcher.packed), n_slots, n_extra, int(launcher._ex._has_cuda_result))
