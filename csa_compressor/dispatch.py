"""Backend selection: the one place that maps a backend name and a device to kernels."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

from .backends import BACKENDS
from .support import raw_env_reader

__all__ = [
    "ENV_VAR",
    "available_backends",
    "backend_module",
    "env_token",
    "requested_backend",
    "resolve_backend",
    "unavailable_reason",
]

ENV_VAR = "CSA_COMPRESSOR_BACKEND"
_CHOICES = ("auto", *BACKENDS)
# "auto" preference on CUDA, fastest first.
_AUTO_ORDER_CUDA = ("cute", "triton", "reference")


@functools.cache
def _load(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module(f"csa_compressor.backends.{name}.launch")
    except ImportError as exc:  # a missing optional dependency (triton, cutlass)
        return None, f"{name} backend cannot be imported: {exc}"
    reason = module.unavailable_reason()
    return (None, reason) if reason else (module, None)


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` is not installed/usable at all, else None."""
    return _load(name)[1]


def backend_module(name: str) -> ModuleType:
    module, reason = _load(name)
    if module is None:
        raise RuntimeError(f"csa_compressor: backend {name!r} is unavailable ({reason}); {_installed_message()}")
    return module


def _installed_message() -> str:
    installed = [n for n in BACKENDS if _load(n)[0] is not None]
    return f"installed backends: {', '.join(installed) or 'none'}"


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that are installed and can run on ``device``."""
    device = torch.device(device)
    names = []
    for name in BACKENDS:
        module = _load(name)[0]
        if module is not None and module.device_unsupported_reason(device) is None:
            names.append(name)
    return names


def _config_reason(module: ModuleType, ratio: int, coff: int, head_dim: int) -> str | None:
    check = getattr(module, "config_unsupported_reason", None)  # optional part of the protocol
    return check(ratio, coff, head_dim) if check is not None else None


env_token = raw_env_reader(ENV_VAR)
env_token.__doc__ = (
    f"The raw value of ${ENV_VAR} (None when unset), read cheaply on every call: per-call caches key on it "
    "so that a change of the variable is seen; ``requested_backend`` interprets it."
)


def requested_backend(backend: str | None) -> str:
    name = backend if backend not in (None, "auto") else os.environ.get(ENV_VAR, "auto")
    name = name.strip().lower()
    if name not in _CHOICES:
        raise ValueError(
            f"csa_compressor: unknown backend {name!r} (from {'argument' if backend not in (None, 'auto') else ENV_VAR}); "
            f"choose one of {_CHOICES}; {_installed_message()}"
        )
    return name


def resolve_backend(backend: str | None, device: torch.device, ratio: int, coff: int, head_dim: int) -> str:
    """The backend that will run: an explicit choice is checked and honoured, "auto" picks the fastest usable one.

    Explicit choices that cannot run raise RuntimeError naming what is installed.
    ``device.type == "meta"`` (shape-only checks) skips the device test.
    """
    name = requested_backend(backend)
    if name != "auto":
        module = backend_module(name)
        if device.type != "meta":
            reason = module.device_unsupported_reason(device)
            if reason:
                # SPEC 4: host tensors are an input error (ValueError); an unsupported GPU is a RuntimeError.
                error = ValueError if device.type == "cpu" else RuntimeError
                raise error(f"csa_compressor: backend {name!r} cannot run on {device} tensors: {reason}")
        reason = _config_reason(module, ratio, coff, head_dim)
        if reason:
            raise ValueError(f"csa_compressor: backend {name!r} does not support this configuration: {reason}")
        return name
    order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("reference",)
    for candidate in order:
        module = _load(candidate)[0]
        if module is None:
            continue
        if device.type != "meta" and module.device_unsupported_reason(device):
            continue
        if _config_reason(module, ratio, coff, head_dim):
            continue
        return candidate
    raise RuntimeError(f"csa_compressor: no backend can run on {device}; {_installed_message()}")
