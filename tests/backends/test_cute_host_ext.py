"""CPU tests of the cute backend's C++ host fast path (``csa_compressor/backends/cute/host_ext.cpp``).

The extension is built here as on the GPU machine (torch.utils.cpp_extension: a C++ compiler and ninja). Its
input checks must accept exactly what the Python per-call checks accept (``support._inputs_ok``): anything it
accepts goes straight to the kernels, anything it rejects takes the Python path, which raises the error. The
packed call's slot layout is checked in ``test_cute_launch_abi.py``; the launches themselves in the GPU tests.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from csa_compressor import support
from csa_compressor.testing import misaligned_copy

host_ext = pytest.importorskip("csa_compressor.backends.cute.host_ext")

if not host_ext.enabled():
    pytest.skip("CSA_COMPRESSOR_HOST_EXT=0", allow_module_level=True)
if shutil.which("c++") is None or shutil.which("ninja") is None:
    pytest.skip("needs a C++ compiler and ninja to build the extension", allow_module_level=True)

RATIO, COFF, D = 4, 2, 64
W = COFF * D


def _ext():
    ext = host_ext.module()
    assert ext is not None, host_ext.error()  # a build failure is a test failure where a compiler exists
    return ext


def _pack(tokens=37, segments=(20, 17), dtype=torch.bfloat16):
    kv = torch.randn(tokens, W).to(dtype)
    score = torch.randn(tokens, W).to(dtype)
    ape = torch.randn(RATIO, W)
    cu = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
    cuc = torch.tensor([0, *torch.tensor([s // RATIO for s in segments]).cumsum(0).tolist()], dtype=torch.int32)
    return [kv, score, ape, cu, cuc]


def _variants():
    base = _pack()
    rows = int(base[4][-1])
    yield "valid", base, rows
    yield "no rows", base, 0
    yield "rows x head_dim past int32", base, 2**31 // D + 1
    yield "fewer tokens than ratio", _pack(tokens=3, segments=(3,)), 1
    yield "fewer tokens than ratio, no rows", _pack(tokens=3, segments=(3,)), 0
    for k, name in enumerate(("kv", "score", "ape")):
        args = list(base)
        args[k] = misaligned_copy(base[k])
        yield f"{name} misaligned", args, rows
        args = list(base)
        args[k] = torch.cat([base[k], base[k]], dim=1)[:, : base[k].shape[1]]
        yield f"{name} not contiguous", args, rows
        args = list(base)
        args[k] = base[k].to(torch.float16)
        yield f"{name} float16", args, rows
    args = list(base)
    args[0] = torch.randn(37, W + 2).to(torch.bfloat16)
    yield "kv wider", args, rows
    args = list(base)
    args[1] = base[1][:-1]
    yield "score fewer tokens", args, rows
    args = list(base)
    args[2] = torch.randn(RATIO + 1, W)
    yield "ape shape", args, rows
    args = list(base)
    args[3] = base[3].long()
    yield "cu_seqlens int64", args, rows
    args = list(base)
    args[4] = torch.cat([base[4], base[4][-1:]])
    yield "cu_seqlens_comp longer", args, rows
    args = list(base)
    args[3], args[4] = base[3][:1], base[4][:1]
    yield "one offset", args, rows
    args = list(base)
    args[3] = base[3].view(1, -1)
    yield "cu_seqlens 2-d", args, rows
    args = list(base)
    args[0] = None
    yield "kv None", args, rows


@pytest.mark.parametrize("name,args,rows", list(_variants()), ids=[v[0] for v in _variants()])
def test_checks_accept_what_python_accepts(name, args, rows):
    ext = _ext()
    cfg = support.Config(RATIO, COFF, D, torch.bfloat16, torch.device("cpu"))
    capsule = ext.make_config(RATIO, COFF, D, -1, None, None, 1 << 62, None, 0, 1, 1, 0, 0)
    try:
        expected = support._inputs_ok(cfg, *args, rows, D)
    except support._PER_CALL_ERRORS:  # the Python recheck treats these as "not ok" too
        expected = False
    assert ext.check(capsule, *args, rows) is bool(expected), name


def test_valid_variant_is_accepted():
    """The parity test above would pass with a check that rejects everything: the common case must be taken."""
    ext = _ext()
    capsule = ext.make_config(RATIO, COFF, D, -1, None, None, 1 << 62, None, 0, 1, 1, 0, 0)
    base = _pack()
    assert ext.check(capsule, *base, int(base[4][-1])) is True


def test_forward_without_a_launch_record_takes_the_python_path():
    ext = _ext()
    capsule = ext.make_config(RATIO, COFF, D, -1, None, None, 1 << 62, None, 0, 1, 1, 0, 0)
    base = _pack()
    assert ext.forward(capsule, *base, int(base[4][-1]), 0) is None
    assert ext.backward(capsule, *base, torch.zeros(2, D, dtype=torch.bfloat16), None, 0, 0, 0) is None
