"""Test configuration: CPU runs execute Triton kernels under the interpreter; GPU-only tests skip with a reason."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton / CuTe-DSL are first imported anywhere: the Triton kernels run in the
    # interpreter, and CuTe-DSL compiles (but cannot run) for sm_90a without a driver.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def pytest_configure(config):
    # Under pytest-xdist (the GPU session's parallel phase) each worker's CPU references share the cores: one
    # worker's default of every core, times the workers, leaves torch's thread pools waiting on one another.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
