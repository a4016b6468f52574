"""Launch machinery of the CuTe-DSL backend: the five protocol functions of ``csa_compressor.backends``.

Compiled kernels are cached by ``(direction, ratio, coff, head_dim, dtype, arch, schedule)``; the
schedule is a pure function of ``(ratio, coff, head_dim)`` so ``compile()`` builds everything a
later call can pick. The kernels are compiled against raw global pointers and Int32 scalars, so a
call only converts integers: the fast path keeps one block of 8-byte argument slots per
(configuration, device), fills it with one ``struct.pack_into`` and calls the compiled host
function's packed C entry point directly. ``CSA_CUTE_LAUNCH=fast|raw|dsl`` picks the path (see
``_MODE``); ``python -m csa_compressor.backends.cute.launch`` times every path on a GPU.

What the compiled host function does per call (its lowered LLVM IR, nvidia-cutlass-dsl 4.8.1): fill a
``cudaLaunchConfig_t`` on the stack (grid, block, dynamic smem, stream, two launch attributes:
programmatic stream serialization 0 and cooperative 0), then one ``_cudaLaunchKernelEx`` per kernel
with the ``cudaKernel_t`` resolved once by ``compiled.to()`` (``cudaLibraryGetKernel`` plus the
kernel attributes, at load time only). No module loading, function lookup, attribute setting, error
query or stream query per call. ``_cudaLaunchKernelEx`` is a tail jump into a CUDA runtime linked
statically into ``libcute_dsl_runtime.so`` (a second runtime instance beside torch's), which ends
in the driver's launch.

Host functions (one per configuration):
- forward: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, B, N, stream)``;
- backward: ``host(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
  grad_ape, ws, B, N, T, rows_per_cta, num_ctas, stream)`` (two kernels: main + grad_ape reduction),
with bf16/fp32/int32 global pointers (16-byte aligned), ``B = len(cu_seqlens) - 1``, ``N = total_comp``,
``T`` tokens, and the persistent-grid shape of ``backward_grid``. The slabs ``ws`` are kept per (device,
stream) outside CUDA-graph capture (``_Scratch``), so an eager backward call allocates only its gradients.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import struct
import tempfile
import threading
from dataclasses import replace

import torch

from ...windows import uses_softmax_stats
from .. import STREAM_BACKWARD, STREAM_LOADS

_IMPORT_ERROR: str | None = None
try:
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    from .backward import backward_schedule, backward_smem_bytes, build_backward
    from .backward_common import MAX_REGS, REDUCE_WARPS, reduce_grid_x, reduce_slab_lanes
    from .backward_stats import CLUSTER_MAX, stats_backward_schedule
    from .forward import build_forward, forward_schedule, forward_smem_bytes, wide_forward_schedule
except Exception as exc:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR = f"nvidia-cutlass-dsl (CuTe-DSL) is not importable: {type(exc).__name__}: {exc}"

__all__ = ["backward", "compile", "device_unsupported_reason", "forward", "supports_stats", "unavailable_reason"]

# Launch path: "fast" (default: packed ctypes call of the compiled host function; measured ~20 us of
# host time per forward call on the H200 machine before the single-pack_into rewrite), "raw"
# (cuLaunchKernel of the compiled cubin through ctypes libcuda; measured ~40 us there with the previous
# per-argument ctypes writes and a 50 % carveout on every kernel, cause not found, so opt-in), "dsl" (the
# regular compiled-function call, ~55 us). Each falls back to the next when its set-up fails.
_MODE = os.environ.get("CSA_CUTE_LAUNCH", "fast")
_FAST = _MODE in ("raw", "fast") and os.environ.get("CSA_CUTE_FAST_LAUNCH", "1") != "0"
_LOCK = threading.Lock()
_COMPILED: dict[tuple, object] = {}  # key -> compiled function (device independent)
_LAUNCHERS: dict[tuple, _Launcher] = {}  # (key, device index) -> launcher
_FASTMAP: dict[tuple, _Launcher] = {}  # (direction, ratio, coff, head_dim, dtype, device index) -> launcher
_DEVICE_INFO: dict[int, tuple[str, int]] = {}  # device index -> (arch, SM count)
# "forward_stats" / "backward_stats": the softmax-statistics variants (long windows), one more pointer each.
_N_PTR = {"forward": 6, "backward": 10, "forward_stats": 7, "backward_stats": 11}
_N_INT = {"forward": 2, "backward": 5, "forward_stats": 2, "backward_stats": 5}


def _dtypes(direction: str) -> tuple:
    """Element types of the host function's pointers, in order."""
    fwd = (BFloat16, BFloat16, Float32, Int32, Int32, BFloat16)
    base = fwd if direction.startswith("forward") else (*fwd, BFloat16, BFloat16, Float32, Float32)
    return (*base, Float32) if direction.endswith("_stats") else base


# The autograd function saves softmax statistics for this backend (full-size contract checked on the H200).
AUTOGRAD_STATS = True


def supports_stats(ratio: int, coff: int, head_dim: int) -> bool:
    """Softmax statistics for long windows (the long-window kernels' combine writes them)."""
    return uses_softmax_stats(ratio, coff)


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR


def _arch_of(capability: tuple[int, int]) -> str | None:
    major, minor = capability
    if major == 9 and minor == 0:
        return "sm_90a"
    if major == 10:
        return f"sm_10{minor}a"
    return None


def device_unsupported_reason(device: torch.device) -> str | None:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    device = torch.device(device)
    if device.type != "cuda":
        return f"the cute backend needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if _arch_of(cap) is None:
        return (
            f"the cute backend supports compute capability 9.0 (H100/H200, validated) and 10.x "
            f"(Blackwell, not validated here), got {cap[0]}.{cap[1]}"
        )
    return None


def _device_info(index: int) -> tuple[str, int]:
    info = _DEVICE_INFO.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        arch = _arch_of((props.major, props.minor))
        if arch is None:
            raise RuntimeError(f"cute backend: unsupported GPU {props.name} (sm_{props.major}{props.minor})")
        info = (arch, props.multi_processor_count)
        _DEVICE_INFO[index] = info
    return info


# Development hook: (direction, ratio, coff, head_dim) -> Schedule, consulted before the defaults (its EF / ES
# fields are set by the cache policies, as for the defaults).
SCHEDULE_OVERRIDE: dict[tuple, object] = {}


def _default_schedule(direction: str, ratio: int, coff: int, head_dim: int):
    if direction == "forward":
        return forward_schedule(ratio, coff, head_dim)
    if direction == "backward":
        return backward_schedule(ratio, coff, head_dim)
    if direction in ("forward_stats", "backward_stats") and supports_stats(ratio, coff, head_dim):
        if direction == "forward_stats":
            return replace(forward_schedule(ratio, coff, head_dim), ST=True)
        return stats_backward_schedule(ratio, coff, head_dim)
    raise ValueError(f"direction must be 'forward' or 'backward' (or a long window's '*_stats'), got {direction!r}")


def _schedule(direction: str, ratio: int, coff: int, head_dim: int):
    """The tiles (an override's, else the defaults), with the cache policies of ``csa_compressor.backends``."""
    sch = SCHEDULE_OVERRIDE.get((direction, ratio, coff, head_dim))
    if sch is None:
        sch = _default_schedule(direction, ratio, coff, head_dim)
    # Evict-first window loads in the forward kernels only: on the H200 they took the cold (write-flushed) forward
    # 3-16 % down and the backward kernels 2-5 % up, cold and clean alike (benchmarks/variant_ab.py).
    if direction.startswith("forward"):
        return replace(sch, EF=STREAM_LOADS)
    return replace(sch, EF=STREAM_BACKWARD == "all", ES=STREAM_BACKWARD != "none")


def _key(direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, arch: str) -> tuple:
    sch = _schedule(direction, ratio, coff, head_dim)
    return _cache_key(direction, ratio, coff, head_dim, dtype, arch, sch), sch


def _cache_key(direction: str, ratio: int, coff: int, head_dim: int, dtype, arch: str, sch) -> tuple:
    """(direction, ratio, coff, head_dim, dtype, arch, schedule): what a compiled kernel depends on."""
    return (direction, ratio, coff, head_dim, dtype, arch, sch.key())


def _compiled_for(direction: str, ratio: int, coff: int, head_dim: int, dtype, arch: str, sch):
    """The compiled host function of one schedule from the process-wide cache, built on a miss (hold _LOCK)."""
    key = _cache_key(direction, ratio, coff, head_dim, dtype, arch, sch)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = _build(direction, ratio, coff, head_dim, arch, sch)
    return compiled


def _fake_ptr(dtype):
    return make_ptr(dtype, 0, AddressSpace.gmem, assumed_align=16)


_DUMP_DIR: str | None = None


def _dump_dir() -> str:
    """Scratch directory for the DSL's PTX/cubin files: made on the first build, removed at exit."""
    global _DUMP_DIR
    if _DUMP_DIR is None:
        _DUMP_DIR = tempfile.mkdtemp(prefix="csa_cute_")
        atexit.register(shutil.rmtree, _DUMP_DIR, ignore_errors=True)
    return _DUMP_DIR


def _build(direction: str, ratio: int, coff: int, head_dim: int, arch: str, sch):
    # PTX (kernel names and parameter lists) and cubin are kept for the raw driver launch path.
    options = f"--gpu-arch={arch} --keep-ptx --keep-cubin --dump-dir={_dump_dir()}"
    build = build_forward if direction.startswith("forward") else build_backward
    host = build(ratio, coff, head_dim, sch)
    args = [_fake_ptr(t) for t in _dtypes(direction)] + [Int32(1)] * _N_INT[direction]
    return cute.compile(host, *args, cuda.CUstream(0), options=options)


_ENTRY_RE = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)


def _ptx_entries(ptx: str) -> dict[str, str]:
    """Kernel name -> parameter kinds ('p' for a 64-bit pointer, 'i' for a 32-bit int), from the PTX."""
    out = {}
    for name, params in _ENTRY_RE.findall(ptx):
        kinds = []
        for line in params.split(","):
            line = line.strip()
            if not line:
                continue
            if ".u64" in line or ".b64" in line:
                kinds.append("p")
            elif ".u32" in line or ".b32" in line or ".s32" in line:
                kinds.append("i")
            else:
                kinds.append("?")
        out[name] = "".join(kinds)
    return out


_CU_INIT = False


_LIBCUDA = None


def _libcuda_launch():
    """``cuLaunchKernel`` of the driver through ctypes (no per-call argument conversion by cuda-python)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        fn.restype = ctypes.c_int
        _LIBCUDA = fn
    return _LIBCUDA


def _handle_value(obj) -> int:
    try:
        return int(obj)
    except TypeError:
        return ctypes.c_void_p.from_address(obj.getPtr()).value


class _RawKernel:
    """One kernel of the cubin loaded in a device's context; parameters live in one reusable 8-byte-slot block.

    Attributes mirror what the DSL's CUDA-dialect loader (``cuda_load_to_device``) sets on its own copy:
    non-portable cluster sizes allowed and the opt-in dynamic shared memory limit minus static shared
    memory; no carveout (the DSL records ``preferred_smem_carveout`` in ``kernel_info`` only, which its
    CUDA-dialect executor does not apply).
    """

    def __init__(self, module, name: str, kinds: str, block: int, smem: int, device_index: int):
        err, self.func = cuda.cuModuleGetFunction(module, name.encode())
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuModuleGetFunction({name}): {err}")
        attr = cuda.CUfunction_attribute
        err, optin = cuda.cuDeviceGetAttribute(
            cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, cuda.CUdevice(device_index)
        )
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuDeviceGetAttribute: {err}")
        err, static = cuda.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.func)
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuFuncGetAttribute: {err}")
        for key, value in (
            (attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static),
            (attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
        ):
            (err,) = cuda.cuFuncSetAttribute(self.func, key, value)
            if err != cuda.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuFuncSetAttribute({key}): {err}")
        self.fptr = _handle_value(self.func)
        if not self.fptr:
            raise RuntimeError("null CUfunction")
        self.launch = _libcuda_launch()
        if "?" in kinds:
            raise RuntimeError(f"unsupported kernel parameter kinds {kinds}")
        # The driver copies each parameter's size (8 for pointers, 4 for Int32) from its slot.
        self.slots = (ctypes.c_uint64 * len(kinds))()
        base = ctypes.addressof(self.slots)
        self.params = (ctypes.c_void_p * len(kinds))(*[base + 8 * i for i in range(len(kinds))])
        self.params_addr = ctypes.addressof(self.params)
        self._pack = struct.Struct("=" + "".join("Q" if k == "p" else "i4x" for k in kinds)).pack_into
        self._call_lock = threading.Lock()
        self.block = block
        self.smem = smem

    def __call__(self, values, grid, stream_handle: int) -> None:
        with self._call_lock:  # the slots are shared across threads; the driver copies them at launch
            self._pack(self.slots, 0, *values)
            err = self.launch(
                self.fptr, grid[0], grid[1], 1, self.block, 1, 1, self.smem, stream_handle, self.params_addr, None
            )
        if err != 0:
            raise RuntimeError(f"cute backend: cuLaunchKernel failed with CUDA error {err}")


class _Launcher:
    """One compiled configuration bound to one device, with a reusable ctypes argument block."""

    def __init__(self, compiled, direction: str, device_index: int, sch, num_sms: int, smem_bytes: int = 0):
        self.compiled = compiled
        self.direction = direction
        self.sch = sch
        self.num_sms = num_sms
        # `fast` and `raw` are properties: assigning either re-binds `launch` (the dev script flips them).
        self._fast = False
        self._raw = None
        self._call_lock = threading.Lock()
        self.launch = self._launch_slow
        self.fast_error: str | None = None
        self.ctas_per_sm = 2
        self.nchunk = 1
        # Short-window forward: the register-capped build that one call takes from `wide_rows` rows on.
        self.wide: _Launcher | None = None
        self.wide_rows = 1 << 62
        try:
            ex = compiled.to(device_index)
            self._ex = ex
            # One 8-byte slot per host-function argument (pointers, Int32 scalars, stream), written by a
            # single struct.pack_into per call; the packed array holds the slot addresses, then the DSL's
            # extra arguments (the CUDA-result cell, kernel handles on the non-CUDA-dialect executor).
            n_ptr, n_int = _N_PTR[direction], _N_INT[direction]
            n = n_ptr + n_int + 1
            self.slots = (ctypes.c_uint64 * n)()
            base = ctypes.addressof(self.slots)
            packed = (ctypes.c_void_p * (n + ex._num_extra_args))()
            for i in range(n):
                packed[i] = base + 8 * i
            idx = n
            if ex._has_cuda_result:
                packed[idx] = ex._cuda_result_addr
                idx += 1
            for kp in ex._kernel_ptrs or []:
                packed[idx] = kp.value if isinstance(kp, ctypes.c_void_p) else kp
                idx += 1
            if idx != len(packed):
                raise RuntimeError(f"packed argument count {idx} != {len(packed)}")
            if ex.cuda_result is None:
                raise RuntimeError("compiled host function has no CUDA result cell")
            # Int32 scalars: native int32 + 4 pad bytes (the host function reads 4 bytes at the
            # slot address); out-of-range values raise instead of wrapping.
            self._pack = struct.Struct("=" + "Q" * n_ptr + "i4x" * n_int + "Q").pack_into
            self.packed = packed
            self.capi = ex.capi_func
            self.cuda_result = ex.cuda_result
            self.fast = _FAST
        except Exception as exc:  # pragma: no cover - DSL internals changed: use the regular call path
            self.fast = False
            self.fast_error = f"{type(exc).__name__}: {exc}"
        self.raw = None
        self.raw_error: str | None = None
        self.reduce_grid = 0  # backward, raw path: CTAs of the grad_ape reduction (set with the configuration)
        if _MODE == "raw":
            try:
                self._init_raw(device_index, smem_bytes)
            except Exception as exc:  # pragma: no cover - falls back to the compiled host function
                self.raw = None
                self.raw_error = f"{type(exc).__name__}: {exc}"
        # Resident CTAs per SM of the backward kernel: its launch bounds cap registers at MAX_REGS, so
        # MIN_BLOCKS CTAs fit by registers; shared memory (50% carveout) may allow fewer.
        if direction.startswith("backward"):
            by_regs = sch.MB or max(1, 65536 // (sch.threads * MAX_REGS))
            # The long-window kernel asks for all of the unified L1/shared memory (227 KB per SM on sm_90).
            smem_cap = 227 if getattr(sch, "LONG", False) else 114
            by_smem = max(1, (smem_cap * 1024) // (smem_bytes + 1024))
            self.ctas_per_sm = max(1, min(by_regs, by_smem, 2048 // sch.threads))

    @property
    def fast(self) -> bool:
        return self._fast

    @fast.setter
    def fast(self, value: bool) -> None:
        self._fast = bool(value)
        self._bind()

    @property
    def raw(self):
        return self._raw

    @raw.setter
    def raw(self, value) -> None:
        self._raw = value
        self._bind()

    def _bind(self) -> None:
        # The packed host-function call is taken directly only when nothing else is selected.
        self.launch = self._launch_fast if self._fast and self._raw is None else self._launch_slow

    def _init_raw(self, device_index: int, smem_bytes: int) -> None:
        global _CU_INIT
        art = self.compiled.artifacts
        ptx, cubin = art.PTX, art.CUBIN
        if not isinstance(ptx, str) or not isinstance(cubin, (bytes, bytearray)) or not ptx.lstrip().startswith("//"):
            raise RuntimeError("PTX/cubin artifacts not available")
        entries = _ptx_entries(ptx)
        main = [n for n in entries if "reduce_kernel" not in n]
        red = [n for n in entries if "reduce_kernel" in n]
        expect = "pppppp" + "ii" if self.direction == "forward" else "p" * 9 + "iiii"
        if len(main) != 1 or entries[main[0]] != expect:
            raise RuntimeError(f"unexpected kernel signature {entries}")
        if self.direction == "backward" and (len(red) != 1 or entries[red[0]] != "ppi"):
            raise RuntimeError(f"unexpected reduce kernel signature {entries}")
        if not _CU_INIT:
            (err,) = cuda.cuInit(0)
            _CU_INIT = True
        with torch.cuda.device(device_index):
            torch.cuda.init()
            torch.empty(1, device=f"cuda:{device_index}")  # the primary context is current from here on
            err, module = cuda.cuModuleLoadData(bytes(cubin))
            if err != cuda.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuModuleLoadData: {err}")
            self._module = module
            kernels = [_RawKernel(module, main[0], entries[main[0]], self.sch.threads, smem_bytes, device_index)]
            if self.direction == "backward":
                red_smem = REDUCE_WARPS * 32 * 4 * 4 + 64  # the largest reduce_vector (the APE size is set later)
                kernels.append(_RawKernel(module, red[0], "ppi", REDUCE_WARPS * 32, red_smem, device_index))
        self.raw = kernels

    def _launch_fast(self, args) -> None:
        """``args``: the host function's arguments in order (pointers, Int32 scalars, stream handle)."""
        # The slots and the result cell are shared by every thread using this launcher, and ctypes drops
        # the GIL during the call: the lock keeps another thread's arguments out until they are consumed.
        with self._call_lock:
            self._pack(self.slots, 0, *args)
            self.capi(self.packed)
            err = self.cuda_result.value
        if err != 0:
            raise RuntimeError(f"cute backend: kernel launch failed with CUDA error {err}")

    def _launch_slow(self, args) -> None:
        n_ptr = _N_PTR[self.direction]
        self(args[:n_ptr], args[n_ptr:-1], args[-1])

    def __call__(self, ptrs, ints, stream_handle: int):
        raw = self.raw
        if raw is not None:
            if self.direction == "forward":
                blocks = (ints[1] + self.sch.R - 1) // self.sch.R
                # Chunk-major schedules (CM) put the column chunks on grid x, as the host function does.
                grid = (blocks * self.nchunk, 1) if self.sch.CM else (blocks, self.nchunk)
                raw[0]((*ptrs, *ints), grid, stream_handle)
            else:
                b, n, t, rows_per_cta, num_ctas = ints
                raw[0]((*ptrs[:6], *ptrs[6:8], ptrs[9], b, n, t, rows_per_cta), (num_ctas, self.nchunk), stream_handle)
                raw[1]((ptrs[9], ptrs[8], num_ctas), (self.reduce_grid, 1), stream_handle)
            return
        if self.fast:
            self._launch_fast((*ptrs, *ints, stream_handle))
            return
        dts = _dtypes(self.direction)
        args = [make_ptr(dt, p, AddressSpace.gmem, assumed_align=16) for dt, p in zip(dts, ptrs, strict=False)]
        args += [Int32(v) for v in ints]
        self.compiled(*args, cuda.CUstream(stream_handle))


def compile(direction, ratio, coff, head_dim, dtype, device) -> None:
    """Build ``direction``'s kernel and, for long windows, its softmax-statistics variant."""
    ratio, coff, head_dim, device = int(ratio), int(coff), int(head_dim), torch.device(device)
    _get_launcher(direction, ratio, coff, head_dim, dtype, device)
    if direction in ("forward", "backward") and supports_stats(ratio, coff, head_dim):
        _get_launcher(f"{direction}_stats", ratio, coff, head_dim, dtype, device)


def _get_launcher(direction: str, ratio: int, coff: int, head_dim: int, dtype, device: torch.device) -> _Launcher:
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch, num_sms = _device_info(index)
    key, sch = _key(direction, ratio, coff, head_dim, dtype, arch)
    lk = (key, index)
    launcher = _LAUNCHERS.get(lk)
    if launcher is not None:
        _FASTMAP[(direction, ratio, coff, head_dim, dtype, index)] = launcher  # the calls' one-lookup path
        return launcher
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cute backend: the {direction} kernel for ratio={ratio}, coff={coff}, head_dim={head_dim} on "
            f"cuda:{index} is not compiled and cannot be compiled during CUDA-graph capture; call compile() "
            "(or run the operation once) before capturing"
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"cute backend: only bfloat16 kv/score are supported, got {dtype}")
    with _LOCK:
        compiled = _compiled_for(direction, ratio, coff, head_dim, dtype, arch, sch)
        launcher = _LAUNCHERS.get(lk)
        if launcher is None:
            smem = forward_smem_bytes(sch) if direction.startswith("forward") else backward_smem_bytes(sch)
            launcher = _Launcher(compiled, direction, index, sch, num_sms, smem)
            launcher.nchunk = -(-head_dim // (sch.TC * sch.V))
            if getattr(sch, "SC", 0):
                launcher.nchunk *= coff * ratio // sch.SC  # grid y: column chunks x slot chunks
            launcher.reduce_grid = reduce_grid_x(ratio * coff * head_dim, reduce_slab_lanes(sch))
            wide = wide_forward_schedule(sch) if direction == "forward" else None
            if wide is not None:
                compiled_w = _compiled_for(direction, ratio, coff, head_dim, dtype, arch, wide)
                launcher.wide = _Launcher(compiled_w, direction, index, wide, num_sms, smem)
                launcher.wide.nchunk = launcher.nchunk
                # More row blocks than one wave of the default build: the capped one holds a CTA more per SM.
                launcher.wide_rows = num_sms * (wide.MB - 1) * sch.R + 1
            _LAUNCHERS[lk] = launcher
            _FASTMAP[(direction, ratio, coff, head_dim, dtype, index)] = launcher
    return launcher


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# Current device without torch.cuda.current_device()'s lazy-init check (a launcher exists only after
# _device_info initialised CUDA).
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _stream_handle(stream, device: torch.device) -> int:
    if stream is not None:
        return stream.cuda_stream
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats=None) -> None:
    n = out.shape[0]
    if n == 0:
        return
    device = kv.device
    index = device.index
    direction = "forward" if stats is None else "forward_stats"
    launcher = _FASTMAP.get((direction, ratio, coff, out.shape[1], kv.dtype, index))
    if launcher is None:
        launcher = _get_launcher(direction, ratio, coff, out.shape[1], kv.dtype, device)
    ptrs = (
        kv.data_ptr(),
        score.data_ptr(),
        ape.data_ptr(),
        cu_seqlens.data_ptr(),
        cu_seqlens_comp.data_ptr(),
        out.data_ptr(),
    )
    if stats is not None:
        ptrs += (stats.data_ptr(),)
    if n >= launcher.wide_rows:
        launcher = launcher.wide
    args = (*ptrs, cu_seqlens.shape[0] - 1, n, _stream_handle(stream, device))
    # Kernels launch into the current CUDA context: switch only when the tensors live elsewhere.
    if index is None or index == _GET_DEVICE():
        launcher.launch(args)
    else:
        with torch.cuda.device(index):
            launcher.launch(args)


def _launch_on(device: torch.device, launcher: _Launcher, ptrs, ints, stream_handle: int) -> None:
    """Compatibility entry (ptrs, ints, stream) of the launch helpers; forward/backward call launcher.launch."""
    args = (*ptrs, *ints, stream_handle)
    if device.index is None or device.index == _GET_DEVICE():
        launcher.launch(args)
    else:
        with torch.cuda.device(device.index):
            launcher.launch(args)


WS_CAP_BYTES = 20 << 20  # grad_ape partial slabs stay L2-resident between the two kernels


def backward_capacity(launcher: _Launcher) -> int:
    """The backward grid's CTA slots: one wave of resident CTAs; for the cluster form (``Schedule.CL``) at most
    CLUSTER_MAX row ranges per tile (one cluster spans the grid's x dimension); for the whole-tile form
    (``Schedule.WT``) one row range per tile."""
    if launcher.sch.WT:
        return launcher.nchunk  # whole-tile form: one CTA per tile, grid x is 1
    capacity = launcher.num_sms * launcher.ctas_per_sm
    if launcher.sch.CL:
        capacity = min(capacity, CLUSTER_MAX * launcher.nchunk)
    return capacity


def backward_grid(launcher: _Launcher, n: int, ape_numel: int) -> tuple[int, int]:
    """(rows_per_cta, num_ctas): fill the resident CTA slots once, with at most WS_CAP_BYTES of slabs.

    ``rows_per_cta`` is a multiple of R; every CTA of the x dimension writes one grad_ape slab (the cluster form:
    sums grad_ape with the others of its cluster).
    """
    sch = launcher.sch
    capacity = backward_capacity(launcher)
    row_blocks = -(-n // sch.R)
    slabs_cap = max(1, WS_CAP_BYTES // (4 * ape_numel))
    target_x = max(1, min(row_blocks, capacity // launcher.nchunk, slabs_cap))
    iters = -(-row_blocks // target_x)
    rows_per_cta = iters * sch.R
    return rows_per_cta, -(-n // rows_per_cta)


def backward(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    grad_kv,
    grad_score,
    grad_ape,
    ratio,
    coff,
    stream,
    stats=None,
) -> None:
    device = kv.device
    n = grad_out.shape[0]
    head_dim = grad_out.shape[1]
    direction = "backward" if stats is None else "backward_stats"
    launcher = _FASTMAP.get((direction, ratio, coff, head_dim, kv.dtype, device.index))
    if launcher is None:
        launcher = _get_launcher(direction, ratio, coff, head_dim, kv.dtype, device)
    if n == 0:
        grad_kv.zero_()
        grad_score.zero_()
        grad_ape.zero_()
        return
    args = (launcher, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream,
            stats, n)  # fmt: skip
    index = device.index
    if index is None or index == _GET_DEVICE():
        _launch_backward(*args)
    else:
        with torch.cuda.device(index):
            _launch_backward(*args)


def _launch_backward(
    launcher, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream, stats, n
) -> None:
    """``backward`` on the tensors' device, which is the current device here."""
    device = kv.device
    rows_per_cta, num_ctas = backward_grid(launcher, n, ape.numel())
    handle = _stream_handle(stream, device)
    ptrs = (
        kv.data_ptr(),
        score.data_ptr(),
        ape.data_ptr(),
        cu_seqlens.data_ptr(),
        cu_seqlens_comp.data_ptr(),
        grad_out.data_ptr(),
        grad_kv.data_ptr(),
        grad_score.data_ptr(),
        grad_ape.data_ptr(),
    )
    tail = (cu_seqlens.shape[0] - 1, n, kv.shape[0], rows_per_cta, num_ctas, handle)
    if stats is not None:
        tail = (stats.data_ptr(), *tail)
    if launcher.sch.single_kernel:
        # Cluster and whole-tile forms: one kernel that writes grad_ape itself, no slabs.
        launcher.launch((*ptrs, 0, *tail))
        return
    ws_numel = num_ctas * ape.numel()
    explicit = stream is not None and handle != _stream_handle(None, device)
    if not CACHE_SLABS or _capturing(stream, explicit):
        # Inside a CUDA graph: slabs from the graph's pool, owned by this launch alone.
        ws = torch.empty(ws_numel, dtype=torch.float32, device=device)
        if explicit:
            ws.record_stream(stream)
        launcher.launch((*ptrs, ws.data_ptr(), *tail))
        return
    scratch = _SCRATCH.get((device.index, handle))
    if scratch is None or scratch.numel < ws_numel:
        scratch = _grow_scratch(device, stream, handle, ws_numel, explicit)
    # The lock keeps another thread's launches on this stream from landing between this call's two kernels.
    with scratch.lock:
        launcher.launch((*ptrs, scratch.ptr, *tail))


class _Scratch:
    """The backward's grad_ape slabs for one (device, stream), reused by every eager call on that stream.

    Launches on one stream run in order, and the slabs are dead once the reduction kernel (same host function,
    same stream) has read them, so the next call may overwrite them: a call then allocates only its gradients.
    """

    __slots__ = ("lock", "numel", "ptr", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor
        self.numel = tensor.numel()
        self.ptr = tensor.data_ptr()
        self.lock = threading.Lock()


# (device index, stream handle) -> _Scratch; release_scratch() empties it. CACHE_SLABS = False (a development
# switch, read per call) allocates the slabs per call instead, as before the per-stream scratch.
CACHE_SLABS = True
_SCRATCH: dict[tuple[int, int], _Scratch] = {}
_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _capturing(stream, explicit: bool) -> bool:
    """Whether the launch stream is capturing a CUDA graph."""
    if not explicit:
        return _IS_CAPTURING()
    with torch.cuda.stream(stream):
        return _IS_CAPTURING()


def _grow_scratch(device, stream, handle: int, ws_numel: int, explicit: bool) -> _Scratch:
    """A scratch entry of at least ``ws_numel`` fp32 for the stream, allocated on that stream (the caching
    allocator then hands the block to no other stream until the stream's queued work has run)."""
    with _LOCK:
        old = _SCRATCH.get((device.index, handle))
        if old is not None and old.numel >= ws_numel:
            return old
        numel = max(ws_numel, old.numel if old is not None else 0)
        if explicit:
            with torch.cuda.stream(stream):
                tensor = torch.empty(numel, dtype=torch.float32, device=device)
        else:
            tensor = torch.empty(numel, dtype=torch.float32, device=device)
        scratch = _Scratch(tensor)
        if old is not None:
            scratch.lock = old.lock  # a launch holding the old entry's lock still orders against this one
        _SCRATCH[(device.index, handle)] = scratch
        return scratch


def release_scratch() -> None:
    """Drop the backward's per-stream slabs (their memory goes back to the caching allocator)."""
    with _LOCK:
        _SCRATCH.clear()


def _probe(reps: int = 2000) -> dict[str, tuple[float, float]]:
    """Host microseconds per call of each launch path on cuda:0 (development aid; needs a GPU).

    ``python -m csa_compressor.backends.cute.launch``: back-to-back mean over ``reps`` calls (host time only,
    the queue never fills with these tiny kernels) and the median of single calls started on an idle device,
    for a plain torch op, the bare packed host function (no Python argument work), the fast path, the
    regular compiled call and the raw cuLaunchKernel path.
    """
    import statistics
    import time

    from csa_compressor.testing import make_pack

    dev = torch.device("cuda", 0)
    p = make_pack((8192,), 128, 4, 2, device=dev, seed=0)
    kv, score, ape, cu, cuc = p.inputs
    out = torch.empty((p.total_comp, 128), dtype=torch.bfloat16, device=dev)
    gkv, gsc, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    x = torch.zeros(1, device=dev)
    compile("forward", 4, 2, 128, torch.bfloat16, dev)
    compile("backward", 4, 2, 128, torch.bfloat16, dev)
    lf = _FASTMAP[("forward", 4, 2, 128, torch.bfloat16, 0)]
    lb = _FASTMAP[("backward", 4, 2, 128, torch.bfloat16, 0)]

    def fwd():
        forward(kv, score, ape, cu, cuc, out, 4, 2, None)

    def bwd():
        backward(kv, score, ape, cu, cuc, p.grad_out, gkv, gsc, gape, 4, 2, None)

    def timed(fn) -> tuple[float, float]:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        loop = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize()
        single = []
        for _ in range(100):
            torch.cuda.synchronize()
            time.sleep(0.0002)
            h0 = time.perf_counter()
            fn()
            single.append((time.perf_counter() - h0) * 1e6)
        torch.cuda.synchronize()
        return loop, statistics.median(single)

    res: dict[str, tuple[float, float]] = {}
    res["torch x.add_(1)"] = timed(lambda: x.add_(1))
    stream = _stream_handle(None, dev)
    b = cu.shape[0] - 1
    rows_per_cta, num_ctas = backward_grid(lb, p.total_comp, ape.numel())
    ws = _grow_scratch(dev, None, stream, num_ctas * ape.numel(), False).tensor
    bare = (
        (lf, (kv, score, ape, cu, cuc, out), (b, p.total_comp)),
        (
            lb,
            (kv, score, ape, cu, cuc, p.grad_out, gkv, gsc, gape, ws),
            (b, p.total_comp, kv.shape[0], rows_per_cta, num_ctas),
        ),
    )
    for la, tensors, ints in bare:
        if la.fast:  # the bare packed host function on fixed, live arguments: no Python argument work
            la._pack(la.slots, 0, *[t.data_ptr() for t in tensors], *ints, stream)
            res[f"bare packed host function, {la.direction}"] = timed(lambda la=la: la.capi(la.packed))
    for mode in ("fast", "dsl", "raw"):
        saved = (lf.fast, lb.fast, lf.raw, lb.raw)
        try:
            if mode != "raw":
                lf.raw = lb.raw = None
            if mode == "dsl":
                lf.fast = lb.fast = False
            if mode == "raw":
                for la in (lf, lb):
                    if la.raw is None:
                        la._init_raw(0, forward_smem_bytes(la.sch) if la is lf else backward_smem_bytes(la.sch))
            res[f"{mode}: forward"] = timed(fwd)
            res[f"{mode}: backward"] = timed(bwd)
        except Exception as exc:  # report and go on with the other paths
            res[f"{mode}: error {type(exc).__name__}: {exc}"] = (0.0, 0.0)
        finally:
            lf.fast, lb.fast, lf.raw, lb.raw = saved
    torch.cuda.synchronize()
    return res


if __name__ == "__main__":  # pragma: no cover - development aid
    print(f"{'path':45s} {'back-to-back us':>16s} {'single us':>10s}")
    for name, (loop, single) in _probe().items():
        print(f"{name:45s} {loop:16.1f} {single:10.1f}")
