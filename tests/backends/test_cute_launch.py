"""The cute backend's launch path and disk compile cache on the CPU: the loaded TVM-FFI functions' argument kinds
and errors, the cache across (concurrent) processes, a corrupt entry, an unwritable folder, the cache key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from .common import child_env, cute_launch

launch = cute_launch()

from csa_compressor.backends.cute import cache  # noqa: E402
from csa_compressor.backends.cute.device import offline_spec  # noqa: E402
from csa_compressor.backends.cute.select import kernel_for  # noqa: E402

ARCH = "sm_90a"
FORWARD = ("forward", 4, 2, 64)  # a quick compile
BACKWARD = ("backward", 8, 2, 64)
_POINTERS = "kv score ape cu_seqlens cu_seqlens_comp"
FORWARD_SIGNATURE = ", ".join(
    [f"{p}: DataPointer" for p in f"{_POINTERS} out stats".split()]
    + ["segments: int32", "total_comp: int32", "tokens: int32", "stream: Stream"]
)
BACKWARD_SIGNATURE = ", ".join(
    [f"{p}: DataPointer" for p in f"{_POINTERS} grad_out grad_kv grad_score grad_ape slabs stats".split()]
    + [f"{i}: int32" for i in "segments total_comp tokens rows_per_cta num_ctas".split()]
    + ["stream: Stream"]
)

# A fresh process: the host function of FORWARD through the launch path, reporting whether it compiled.
CHILD = """
import json, time
from csa_compressor.backends.cute import cache, launch
from csa_compressor.backends.cute.device import offline_spec
from csa_compressor.backends.cute.select import kernel_for
compiled = []
real = launch.compile_kernel
launch.compile_kernel = lambda kernel, arch: compiled.append(1) or real(kernel, arch)
kernel_class, config = kernel_for("forward", 4, 2, 64, offline_spec("sm_90a"))
t0 = time.perf_counter()
function = launch.host_function(kernel_class, config, "sm_90a")
seconds = time.perf_counter() - t0
try:
    function()
except TypeError as exc:
    signature = str(exc)
print(json.dumps({"compiled": len(compiled), "seconds": seconds, "signature": signature,
                  "path": str(cache.entry_path(kernel_class(config), "sm_90a"))}))
"""


def _env(cache_dir) -> dict:
    return child_env(CSA_COMPRESSOR_CACHE_DIR=str(cache_dir), CUTE_DSL_ARCH=ARCH)


def _child(cache_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD], env=_env(cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _signature(function) -> str:
    """The parameter list a loaded host function names when called without arguments."""
    with pytest.raises(TypeError, match="Expects") as info:
        function()
    text = str(info.value)
    return text[text.index("__call__(") + len("__call__(") : text.rindex(")")]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache folder and an empty in-process function cache."""
    monkeypatch.setenv("CSA_COMPRESSOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "_FUNCTIONS", {})
    return tmp_path / "cache"


def _host_function(direction, ratio, coff, head_dim):
    kernel_class, config = kernel_for(direction, ratio, coff, head_dim, offline_spec(ARCH))
    return launch.host_function(kernel_class, config, ARCH), kernel_class(config)


def test_argument_kinds_and_errors(fresh_cache):
    """Pointers as ints, Int32 scalars, the stream; a wrong count or kind, an out-of-range int32 or no driver raise."""
    forward, _ = _host_function(*FORWARD)
    assert _signature(forward) == FORWARD_SIGNATURE
    backward, _ = _host_function(*BACKWARD)
    assert _signature(backward) == BACKWARD_SIGNATURE
    with pytest.raises(TypeError, match="Expects 11 parameters"):
        forward(0, 0, 0)
    with pytest.raises(TypeError, match="argument #7"):
        forward(*([0] * 7), 1.5, 1, 4, 0)
    with pytest.raises(TypeError, match="argument #0"):
        forward("kv", *([0] * 6), 1, 1, 4, 0)
    with pytest.raises(ValueError, match="Out of bound value on argument #8"):
        forward(*([0] * 7), 1, 2**31, 4, 0)
    with pytest.raises(ValueError, match="Out of bound value on argument #9"):
        forward(*([0] * 7), 1, 1, 2**31, 0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"(?i)cuda"):
            forward(*([0] * 7), 1, 1, 4, 0)


def test_concurrent_processes_compile_once_and_a_later_one_loads(tmp_path):
    """Two processes on an empty folder: one compiles under the lock, the other loads; no temp file left; a later
    process loads, faster than the compile."""
    together = [_result(p) for p in [_child(tmp_path) for _ in range(2)]]
    assert sorted(r["compiled"] for r in together) == [0, 1]
    path = together[0]["path"]
    assert all(r["path"] == path for r in together) and os.path.isfile(path)
    folder = os.path.dirname(path)
    assert sorted(f for f in os.listdir(folder) if not f.endswith(".lock")) == [os.path.basename(path)]
    later = _result(_child(tmp_path))
    assert later["compiled"] == 0 and later["path"] == path
    assert all(r["signature"] == later["signature"] for r in together) and FORWARD_SIGNATURE in later["signature"]
    compiled = next(r for r in together if r["compiled"])
    assert later["seconds"] < compiled["seconds"]
    print(f"first call: compile {compiled['seconds']:.2f} s, load {later['seconds']:.3f} s")


def test_a_corrupt_entry_is_compiled_again(fresh_cache, monkeypatch):
    kernel_class, config = kernel_for(*FORWARD, offline_spec(ARCH))
    path = cache.entry_path(kernel_class(config), ARCH)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an object file")
    compiled = []
    real = launch.compile_kernel
    monkeypatch.setattr(launch, "compile_kernel", lambda kernel, arch: compiled.append(1) or real(kernel, arch))
    function = launch.host_function(kernel_class, config, ARCH)
    assert compiled == [1] and _signature(function) == FORWARD_SIGNATURE
    assert _signature(cache.load_entry(path)) == FORWARD_SIGNATURE  # the entry was replaced by a good one


def test_an_unwritable_cache_folder_still_compiles(fresh_cache, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CSA_COMPRESSOR_CACHE_DIR", str(blocker / "cache"))  # a folder under a file: mkdir fails
    function, _ = _host_function(*FORWARD)
    assert _signature(function) == FORWARD_SIGNATURE


def test_the_entry_key_covers_config_and_arch():
    kernel_class, config = kernel_for(*FORWARD, offline_spec(ARCH))
    key = cache.entry_key(kernel_class(config), ARCH)
    assert cache.entry_key(kernel_class(replace(config)), ARCH) == key  # equal configurations share an entry
    assert cache.entry_key(kernel_class(replace(config, rows_per_cta=config.rows_per_cta * 2)), ARCH) != key
    assert cache.entry_key(kernel_class(config.wide()), ARCH) != key
    assert cache.entry_key(kernel_class(config), "sm_100a") != key
    other_class, other = kernel_for("forward", 4, 2, 128, offline_spec(ARCH))
    assert cache.entry_key(other_class(other), ARCH) != key


def test_the_fingerprint_covers_the_tool_versions(monkeypatch):
    base = cache.fingerprint.__wrapped__()
    assert base == cache.fingerprint()
    monkeypatch.setattr(cache.cutlass, "__version__", "0.0.0")
    assert cache.fingerprint.__wrapped__() != base
    monkeypatch.undo()
    monkeypatch.setattr(cache.tvm_ffi, "__version__", "0.0.0")
    assert cache.fingerprint.__wrapped__() != base


def test_cache_folder_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("CSA_COMPRESSOR_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("CSA_COMPRESSOR_CACHE_DIR")
    assert cache.cache_root() == tmp_path / "xdg" / "csa_compressor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "csa_compressor"


class _Recorder:
    """A stand-in host function: records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def host_path(monkeypatch):
    """The per-call path of launch.forward / launch.backward with recording host functions (no CUDA here)."""
    monkeypatch.setattr(launch, "_GET_DEVICE", lambda: None)  # CPU tensors' device index
    monkeypatch.setattr(launch, "_RAW_STREAM", lambda index: 0x5EED)
    monkeypatch.setattr(launch, "_IS_CAPTURING", lambda: False)
    monkeypatch.setattr(launch, "_LAUNCHERS", {})
    monkeypatch.setattr(launch, "_SCRATCH", {})
    return launch._LAUNCHERS


def _ptrs(*tensors):
    return tuple(t.data_ptr() for t in tensors)


@pytest.mark.parametrize("stats", [False, True])
def test_forward_passes_pointers_sizes_and_stream(host_path, stats):
    from csa_compressor.testing import make_pack

    ratio, coff, d = (128, 1, 64) if stats else (4, 2, 64)
    pack = make_pack((300, 9, 130), d, ratio, coff, token_padding=3, comp_padding=2, seed=1)  # T past cu_seqlens[-1]
    kv, score, ape, cu, cuc = pack.inputs
    n = pack.total_comp
    fake = launch.ForwardLauncher.__new__(launch.ForwardLauncher)
    fake.function, fake.wide, fake.wide_rows = _Recorder(), _Recorder(), n + 1
    host_path[("forward_stats" if stats else "forward", ratio, coff, d, kv.dtype, None)] = fake
    out = torch.empty((n, d), dtype=kv.dtype)
    st = torch.empty((n, 3, d)) if stats else None
    launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None, st)
    # build.py's order: pointers, segments, total_comp, tokens (T: the kernels' bounds guard), the stream.
    stats_ptr = st.data_ptr() if stats else 0
    expected = (*_ptrs(kv, score, ape, cu, cuc, out), stats_ptr, cu.shape[0] - 1, n, kv.shape[0], 0x5EED)
    assert fake.function.calls == [expected] and fake.wide.calls == []
    fake.wide_rows = n  # a launch of wide_rows rows takes the register-capped build
    launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None, st)
    assert fake.wide.calls == [expected]


@pytest.mark.parametrize("whole_tile", [False, True])
def test_backward_passes_the_grid_and_reuses_the_stream_scratch(host_path, whole_tile):
    from types import SimpleNamespace

    from csa_compressor.testing import make_pack

    pack = make_pack((300, 9, 130), 64, 4, 2, token_padding=3, comp_padding=2, seed=2)
    kv, score, ape, cu, cuc = pack.inputs
    grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape))
    fake = launch.BackwardLauncher.__new__(launch.BackwardLauncher)
    fake.config, fake.function = SimpleNamespace(whole_tile=whole_tile), _Recorder()
    fake.row_lanes, fake.tiles, fake.capacity = 4, 2, 2 if whole_tile else 16
    host_path[("backward", 4, 2, 64, kv.dtype, None)] = fake
    for _ in range(2):
        launch.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, 4, 2, None)
    n = pack.total_comp
    rows_per_cta, num_ctas = launch.backward_grid(fake, n, ape.numel())
    assert rows_per_cta % 4 == 0 and rows_per_cta * num_ctas >= n and num_ctas * 2 <= max(fake.capacity, 2)
    first, second = fake.function.calls
    head = _ptrs(kv, score, ape, cu, cuc, pack.grad_out, *grads)
    tail = (0, cu.shape[0] - 1, n, kv.shape[0], rows_per_cta, num_ctas, 0x5EED)
    assert first[:9] == head and first[10:] == tail and second == first
    if whole_tile:
        assert first[9] == 0 and not launch._SCRATCH  # grad_ape written by the one kernel: no slabs
    else:
        entry = launch._SCRATCH[(None, 0x5EED)]
        assert first[9] == entry.ptr and entry.numel >= num_ctas * ape.numel()  # one scratch per (device, stream)
