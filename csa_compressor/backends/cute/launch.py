"""The cute backend's protocol functions (``csa_compressor.backends``): compile, forward, backward.

One launch path: every kernel's host function is compiled with a TVM-FFI entry point, kept in the disk cache
(``cache.py``) and called with integer pointers, Python ints and the stream handle as an int. A launcher binds one
(direction, configuration) to one device: the loaded function, and for the backward the persistent grid's
geometry. Kernels launch into the current device's context, so a call switches device only when the tensors live
on another one. The backward's grad_ape slabs are kept per (device, stream) for eager calls (``_Scratch``) and
come from the graph's pool under CUDA-graph capture. Calls with the fused tail: ``tail_launch``.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ...windows import uses_softmax_stats

_IMPORT_ERROR: str | None = None
try:
    from . import cache, tail_launch
    from .build import compile_kernel
    from .configs import ForwardShortConfig, launch_bound
    from .device import THREADS_PER_SM, arch_of, device_spec
    from .select import kernel_for
except Exception as exc:  # pragma: no cover - depends on the environment
    _IMPORT_ERROR = f"nvidia-cutlass-dsl (CuTe-DSL) is not importable: {type(exc).__name__}: {exc}"

__all__ = [
    "AUTOGRAD_STATS",
    "backward",
    "backward_arguments",
    "backward_grid",
    "bind",
    "call_backward",
    "call_forward",
    "compile",
    "device_unsupported_reason",
    "forward",
    "grid_capacity",
    "host_function",
    "release_scratch",
    "slab_space",
    "supports_stats",
    "supports_tail",
    "unavailable_reason",
]

# The autograd function saves softmax statistics for this backend.
AUTOGRAD_STATS = True
# The grad_ape slabs of one backward stay L2-resident between its two kernels.
WS_CAP_BYTES = 20 << 20

_LOCK = threading.RLock()
_FUNCTIONS: dict[tuple, object] = {}  # (kernel class, configuration, arch) -> loaded host function
_LAUNCHERS: dict[tuple, object] = {}  # (direction, ratio, coff, head_dim, dtype, device index) -> launcher
# With the tail: tail_launch's routes, keyed by the TailSpec too.


def supports_stats(ratio: int, coff: int, head_dim: int) -> bool:
    """Softmax statistics for long windows (the grouped forward's combine writes them)."""
    return uses_softmax_stats(ratio, coff)


# The tail's kernels hold a row's columns in registers: at most this many (16 per thread per operand).
MAX_TAIL_HEAD_DIM = 4096


def supports_tail(ratio: int, coff: int, head_dim: int, tail_config) -> bool:
    """The fused tail (``csa_compressor.tail``) in every window class (``select.tail_route``: fused where the
    pooling kernel takes it, composed elsewhere) up to MAX_TAIL_HEAD_DIM columns, norm weights fp32 or bf16."""
    if head_dim > MAX_TAIL_HEAD_DIM or tail_config.norm_dtype not in (None, torch.float32, torch.bfloat16):
        return False
    return 0 <= tail_config.rope_dim <= head_dim and tail_config.rope_dim % 2 == 0


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR


def device_unsupported_reason(device: torch.device) -> str | None:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    device = torch.device(device)
    if device.type != "cuda":
        return f"the cute backend needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if arch_of(cap) is None:
        return (
            f"the cute backend supports compute capability 9.0 (H100/H200, validated) and 10.x "
            f"(Blackwell, not validated here), got {cap[0]}.{cap[1]}"
        )
    return None


def host_function(kernel_class, config, arch: str):
    """The loaded host function of one kernel (process-wide; from the disk cache, compiled on a miss)."""
    key = (kernel_class.__qualname__, config, arch)
    function = _FUNCTIONS.get(key)
    if function is None:
        with _LOCK:
            function = _FUNCTIONS.get(key)
            if function is None:
                kernel = kernel_class(config)
                function = cache.load_or_compile(kernel, arch, lambda: compile_kernel(kernel, arch))
                _FUNCTIONS[key] = function
    return function


class ForwardLauncher:
    """A forward configuration on one device: its host function and, for the short-window forward of 8-slot
    windows, the register-capped build's (``wide``) that launches of at least ``wide_rows`` rows take."""

    __slots__ = ("config", "function", "wide", "wide_rows")

    def __init__(self, kernel_class, config, spec):
        self.config = config
        self.function = host_function(kernel_class, config, spec.arch)
        self.wide = None
        self.wide_rows = 1 << 62
        wide = config.wide() if isinstance(config, ForwardShortConfig) else None
        if wide is not None:
            self.wide = host_function(kernel_class, wide, spec.arch)
            # More row blocks than one wave of the capped build at one CTA less per SM.
            self.wide_rows = spec.sm_count * (wide.ctas_per_sm_cap - 1) * config.rows_per_cta + 1


class BackwardLauncher:
    """A backward configuration on one device and the CTA slots of its persistent grid (one wave)."""

    __slots__ = ("capacity", "config", "function", "row_lanes", "tiles")

    def __init__(self, kernel_class, config, spec):
        self.config = config
        self.function = host_function(kernel_class, config, spec.arch)
        self.row_lanes = config.row_lanes
        self.tiles = config.tiles
        self.capacity = grid_capacity(config, spec)


def grid_capacity(config, spec) -> int:
    """CTA slots of a persistent backward grid: one wave of resident CTAs (the whole-tile form: one per tile)."""
    if config.whole_tile:
        return config.tiles
    # The launch bound caps the registers; the shared memory at the kernel's carveout (each CTA also reserves
    # 1 KB) may allow fewer CTAs per SM.
    by_smem = max(1, spec.shared_memory_at(config.carveout) // (config.smem_bytes + 1024))
    return spec.sm_count * max(1, min(launch_bound(config.threads), by_smem, THREADS_PER_SM // config.threads))


def backward_grid(launcher: BackwardLauncher, n: int, slab_entries: int) -> tuple[int, int]:
    """(rows_per_cta, num_ctas): fill the resident CTA slots once, with at most WS_CAP_BYTES of slabs of
    ``slab_entries`` floats; ``rows_per_cta`` is a multiple of the row lanes."""
    lanes = launcher.row_lanes
    row_blocks = -(-n // lanes)
    slabs_cap = max(1, WS_CAP_BYTES // (4 * slab_entries))
    target_x = max(1, min(row_blocks, launcher.capacity // launcher.tiles, slabs_cap))
    rows_per_cta = -(-row_blocks // target_x) * lanes
    return rows_per_cta, -(-n // rows_per_cta)


_IS_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The current device without torch.cuda.current_device()'s lazy-init check (launchers exist only once CUDA is up).
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _launcher(direction: str, ratio: int, coff: int, head_dim: int, dtype, index: int):
    """The launcher of one configuration on device ``index``, created (compiled or loaded, then primed) on a miss."""
    key = (direction, ratio, coff, head_dim, dtype, index)
    launcher = _LAUNCHERS.get(key)
    if launcher is not None:
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
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            spec = device_spec(index)
            kernel_class, config = kernel_for(direction, ratio, coff, head_dim, spec)
            kind = ForwardLauncher if kernel_class.kind == "forward" else BackwardLauncher
            launcher = kind(kernel_class, config, spec)
            with torch.cuda.device(index):
                _prime(launcher, direction, ratio, coff, head_dim, index)
            _LAUNCHERS[key] = launcher
    return launcher


def _prime(launcher, direction: str, ratio: int, coff: int, head_dim: int, index: int) -> None:
    """One launch of each function on a one-row problem: a loaded function loads its kernels into the device at
    its first call, which must not happen under CUDA-graph capture."""
    dev = torch.device("cuda", index)
    kv = torch.zeros((ratio, coff * head_dim), dtype=torch.bfloat16, device=dev)
    ape = torch.zeros((ratio, coff * head_dim), dtype=torch.float32, device=dev)
    cu = torch.tensor([0, ratio], dtype=torch.int32, device=dev)
    cuc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    stats = torch.zeros((1, 3, head_dim), dtype=torch.float32, device=dev) if direction.endswith("_stats") else None
    if direction.startswith("forward"):
        out = torch.empty((1, head_dim), dtype=torch.bfloat16, device=dev)
        functions = [launcher.function] + ([launcher.wide] if launcher.wide is not None else [])
        for function in functions:
            call_forward(function, kv, kv, ape, cu, cuc, out, stats, None)
    else:
        grad_out = torch.zeros((1, head_dim), dtype=torch.bfloat16, device=dev)
        grads = (torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(ape))
        call_backward(launcher, (kv, kv, ape, cu, cuc, grad_out, *grads), None, stats, scratch=False)


def _stream_handle(stream, index: int) -> int:
    if stream is not None:
        return stream.cuda_stream
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


def call_forward(function, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, stream, tail_block=()) -> None:
    """One launch of a forward host function (of any configuration) on the current device (arguments: ``build.py``;
    ``tail_block``: the fused tail's, ``tail_arguments``, for a configuration with a tail)."""
    function(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(),
             out.data_ptr(), 0 if stats is None else stats.data_ptr(), cu_seqlens.shape[0] - 1, out.shape[0],
             kv.shape[0], *tail_block, _stream_handle(stream, kv.device.index))  # fmt: skip


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats=None, tail=None,
            rstd=None) -> None:  # fmt: skip
    """Write every row of ``out`` (``N > 0`` rows: the API handles empty outputs); with a ``tail``
    (``csa_compressor.tail.Tail``) the tail's rows, and ``rstd`` (given: ``(N,)`` fp32) each row's rstd."""
    if tail is not None:
        return tail_launch.forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream, stats,
                                   tail, rstd)  # fmt: skip
    if rstd is not None:
        tail_launch.fill_ones(rstd, stream)
    index = kv.device.index
    direction = "forward" if stats is None else "forward_stats"
    launcher = _LAUNCHERS.get((direction, ratio, coff, out.shape[1], kv.dtype, index))
    if launcher is None:
        launcher = _launcher(direction, ratio, coff, out.shape[1], kv.dtype, index)
    function = launcher.function if out.shape[0] < launcher.wide_rows else launcher.wide
    if index == _GET_DEVICE():
        call_forward(function, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, stream)
    else:
        with torch.cuda.device(index):
            call_forward(function, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, stream)


def backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff,
             stream, stats=None, tail=None, grad_norm_weight=None, rstd=None) -> None:  # fmt: skip
    """Overwrite the three gradients (``N > 0`` rows: the API handles empty outputs); with a ``tail``, grad_out is
    the gradient of the tail's rows and ``grad_norm_weight`` (with a norm: ``(head_dim,)`` fp32) is overwritten."""
    if tail is not None:
        return tail_launch.backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                                    grad_ape, ratio, coff, stream, stats, tail, grad_norm_weight, rstd)  # fmt: skip
    index = kv.device.index
    direction = "backward" if stats is None else "backward_stats"
    head_dim = grad_out.shape[1]
    launcher = _LAUNCHERS.get((direction, ratio, coff, head_dim, kv.dtype, index))
    if launcher is None:
        launcher = _launcher(direction, ratio, coff, head_dim, kv.dtype, index)
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
    if index == _GET_DEVICE():
        call_backward(launcher, tensors, stream, stats)
    else:
        with torch.cuda.device(index):
            call_backward(launcher, tensors, stream, stats)


def bind(direction, ratio, coff, head_dim, dtype, device, tail_config=None):
    """``forward`` or ``backward`` (as ``direction`` says) for one compiled configuration (the backends' optional
    ``bind``): with a ``tail_config``, ``tail_launch.bind``'s, whose calls skip the route's lookup; without one, the
    module's function."""
    if tail_config is not None:
        return tail_launch.bind(direction, ratio, coff, head_dim, dtype, device, tail_config)
    return forward if direction == "forward" else backward


def call_backward(launcher, tensors, stream, stats, scratch: bool = True, tail_block=()) -> None:
    """``backward`` on the tensors' device, which is the current device here (the host function's arguments:
    ``build.py``). ``tensors``: (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
    grad_ape); ``scratch``: the slabs may come from the stream's reusable scratch (eager calls); ``tail_block``: the
    fused tail's arguments (``tail_arguments``) of a configuration with a tail, whose CTA slabs have
    ``config.slab_entries`` floats (without a tail: grad_ape's entries)."""
    kv, ape, grad_out = tensors[0], tensors[2], tensors[5]
    device = kv.device
    slab_entries = launcher.config.slab_entries if tail_block else ape.numel()
    rows_per_cta, num_ctas = backward_grid(launcher, grad_out.shape[0], slab_entries)
    handle = _stream_handle(stream, device.index)
    args = [*backward_arguments(tensors, 0, stats, rows_per_cta, num_ctas), *tail_block, handle]
    if launcher.config.whole_tile:
        launcher.function(*args)  # one kernel that writes grad_ape itself: no slabs
        return
    args[9], _owner, lock = slab_space(device, stream, handle, num_ctas * slab_entries, scratch)
    # The lock keeps another thread's launches on this stream from landing between this call's two kernels.
    with lock:
        launcher.function(*args)


def backward_arguments(tensors, slabs: int, stats, rows_per_cta: int, num_ctas: int) -> list:
    """The ``backward`` host function's arguments up to ``num_ctas`` (``build.py``), ``slabs`` a pointer."""
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape = tensors
    return [kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(),
            grad_out.data_ptr(), grad_kv.data_ptr(), grad_score.data_ptr(), grad_ape.data_ptr(), slabs,
            0 if stats is None else stats.data_ptr(), cu_seqlens.shape[0] - 1, grad_out.shape[0], kv.shape[0],
            rows_per_cta, num_ctas]  # fmt: skip


_NO_LOCK = contextlib.nullcontext()


def slab_space(device, stream, handle: int, numel: int, scratch: bool = True) -> tuple:
    """(pointer, owner, lock) of ``numel`` fp32 slabs for one backward call's launches, which run under ``lock``:
    the stream's reusable scratch (``scratch``, eager calls), else a tensor of this call alone (``owner``, to keep
    until the launches are queued; inside a CUDA graph from the graph's pool)."""
    explicit = stream is not None and handle != _stream_handle(None, device.index)
    if not scratch or _capturing(stream, explicit):
        ws = torch.empty(numel, dtype=torch.float32, device=device)
        if explicit:
            ws.record_stream(stream)
        return ws.data_ptr(), ws, _NO_LOCK
    entry = _SCRATCH.get((device.index, handle))
    if entry is None or entry.numel < numel:
        entry = _grow_scratch(device, stream, handle, numel, explicit)
    return entry.ptr, entry, entry.lock


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


_SCRATCH: dict[tuple[int, int], _Scratch] = {}  # (device index, stream handle) -> _Scratch


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
        entry = _Scratch(tensor)
        if old is not None:
            entry.lock = old.lock  # a launch holding the old entry's lock still orders against this one
        _SCRATCH[(device.index, handle)] = entry
        return entry


def release_scratch() -> None:
    """Drop the backward's per-stream slabs (their memory goes back to the caching allocator)."""
    with _LOCK:
        _SCRATCH.clear()


def compile(direction, ratio, coff, head_dim, dtype, device, tail_config=None) -> None:
    """Build (or load) ``direction``'s kernels for the device and, for long windows, the softmax-statistics pair,
    so that no later call compiles or loads anything; with a ``tail_config`` (``csa_compressor.tail.TailConfig``)
    every kernel of a call with that tail."""
    ratio, coff, head_dim, device = int(ratio), int(coff), int(head_dim), torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if tail_config is not None:
        tail_launch.compile(direction, ratio, coff, head_dim, dtype, index, tail_config)
        return
    _launcher(direction, ratio, coff, head_dim, dtype, index)
    if direction in ("forward", "backward") and supports_stats(ratio, coff, head_dim):
        _launcher(f"{direction}_stats", ratio, coff, head_dim, dtype, index)
