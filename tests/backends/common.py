"""Set-up shared by the backend tests. Without CUDA the Triton kernels run in the interpreter and CuTe-DSL
compiles for sm_90a without a driver: set before triton / CuTe-DSL are first imported."""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
F32, BF16 = torch.float32, torch.bfloat16
ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)


def triton_skip():
    """A skip mark for when the Triton backend cannot run on DEVICE (the module skips without triton)."""
    pytest.importorskip("triton")
    from csa_compressor.backends.triton import launch

    reason = launch.device_unsupported_reason(DEVICE)
    return pytest.mark.skipif(reason is not None, reason=f"triton backend cannot run here: {reason}")


ROOT = str(Path(__file__).resolve().parents[2])


def child_env(**extra) -> dict:
    """The environment of a child Python process: the repository first on PYTHONPATH, then whatever PYTHONPATH found
    the packages in this process; ``extra`` variables on top."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def cute_launch():
    """The cute launch module; the calling module skips without nvidia-cutlass-dsl or where cute is unavailable."""
    launch = pytest.importorskip("csa_compressor.backends.cute.launch", reason="nvidia-cutlass-dsl not installed")
    if launch.unavailable_reason() is not None:
        pytest.skip(f"cute backend unavailable: {launch.unavailable_reason()}", allow_module_level=True)
    return launch


def cubin_resources(cubin) -> dict:
    """Registers per thread and the largest stack frame (0 without spills) of a cubin's kernels: the reader of
    ``benchmarks/cubins.py``, loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("cubins", Path(__file__).parents[2] / "benchmarks" / "cubins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.resources(bytes(cubin))


def nan(shape, dtype=F32, device=DEVICE):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
