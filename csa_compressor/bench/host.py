"""Host cost per call without a GPU: ``python -m csa_compressor bench --host-only``, or ``host_costs(...)``.

The public wrappers (``csa_compressor_forward_wrapper``, ``csa_compressor_backward_wrapper``) and
``compressor_pool``'s forward and autograd backward run on CPU tensors of the cases' sizes, for the Triton and
the cute backend, through every step of their GPU path (fast-path keys, rechecks, allocation, plan and launcher
lookup, grid sizing, argument packing) up to the device launch, which is a stand-in that counts its calls:

- Triton: the C launch function of the compiled kernel's launcher object (``CompiledKernel.run``, Triton's own
  ``CudaLauncher``, whose Python call runs). Each kernel is bound once through a stand-in for Triton's
  ``kernel[grid]`` that hands the launcher what Triton's own launch hands it, so ``binding.py`` takes its direct
  launch as on a GPU; the plans get the GPU's tiles (the CPU would get the interpreter's).
- cute: the TVM-FFI host function (what ``launch.host_function`` returns), and its priming launch.

Beside those, what only a GPU answers is stubbed: the CUDA runtime queries torch makes in C (current device,
raw stream, capture status, device exchange), cute's device properties (the H200's offline figures) and both
backends' device gates, which refuse CPU tensors. The caches the run fills are the run's own: the process's are
put back afterwards. What this cannot see: the launcher's and the host function's own C work, and the CUDA
caching allocator (CPU allocations stand in for it; ``allocations`` counts them).
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import timeit
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .cases import CASES, Case

__all__ = ["HOST_DIRECTIONS", "HostCost", "format_host_table", "host_costs", "launch_stubs"]

# "pool": compressor_pool's forward and its autograd backward, one call each.
HOST_DIRECTIONS = ("fwd", "bwd", "pool")
_MISSING = object()


@dataclass(frozen=True)
class HostCost:
    """One row: Python microseconds per call (the best of the repeats), launch calls per call (the stand-ins'
    calls: a cute host function may enqueue more than one kernel, as the persistent backward enqueues its
    reduction), and the aten operations one call dispatches, by name (allocations among them)."""

    case: str
    backend: str
    direction: str
    us: float
    launches: int
    ops: tuple[tuple[str, int], ...]

    @property
    def allocations(self) -> int:
        return sum(n for name, n in self.ops if "empty" in name)


class _Patches:
    """Attribute replacements undone in reverse order (a missing attribute is deleted again)."""

    def __init__(self):
        self._undo: list[tuple[object, str, object]] = []

    def set(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def fresh(self, module, *names: str) -> None:
        """Empty caches in place of ``module``'s, for the run alone (those it has: an older revision may lack one)."""
        for name in names:
            if hasattr(module, name):
                self.set(module, name, type(getattr(module, name))())

    def restore(self) -> None:
        while self._undo:
            obj, name, old = self._undo.pop()
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


class _Stubs:
    """The device launches' stand-ins and their count."""

    def __init__(self):
        self.launches = 0
        self.cute = False

    def launch(self, *call) -> None:
        self.launches += 1


def _launcher_stub(stubs: _Stubs):
    """The launcher object a compiled kernel holds, Triton's own (``CudaLauncher``, whose Python call runs as on a
    GPU) with the stand-in as its C launch function; the stand-in alone where the class cannot be imported."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:
        return stubs.launch
    launcher = object.__new__(CudaLauncher)
    vars(launcher).update(
        launch=stubs.launch, num_ctas=1, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
        profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False, gsan_enabled=False,
        arg_annotations=(), kernel_signature=(),
    )  # fmt: skip
    return launcher


class _StubCompiled:
    """A compiled Triton kernel as ``binding`` reads one: ``run`` (the launcher object) over ``_run``, the
    function handle, the packed metadata, ``launch_metadata``."""

    def __init__(self, stubs: _Stubs):
        self._run = _launcher_stub(stubs)
        self.function, self.packed_metadata = 0, (1, 1, 0)

    @property
    def run(self):
        return self._run

    def launch_metadata(self, grid, stream, *args):
        return None


class _StubJIT:
    """``kernel[grid](*args, **consts)`` as Triton performs it once compiled: the launcher gets the grid, the
    stream, the handle, the metadata, the hooks and every parameter in signature order (the constexprs from
    ``consts`` or their defaults)."""

    def __init__(self, kernel, stubs: _Stubs):
        self.compiled = _StubCompiled(stubs)
        self.params = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters.values())

    def __getitem__(self, grid):
        def runner(*args, **consts):
            from triton import knobs

            rest = [consts.get(p.name, p.default) for p in self.params[len(args) :]]
            c, rt = self.compiled, knobs.runtime
            stream = torch._C._cuda_getCurrentRawStream(0)
            head = (grid[0], 1, 1, stream, c.function, c.packed_metadata, None)
            c.run(*head, rt.launch_enter_hook, rt.launch_exit_hook, *args, *rest)
            return c

        return runner


def _cuda_runtime(p: _Patches) -> None:
    """The CUDA runtime's answers for one device, 0, current and not capturing (torch's Python wrappers around
    them run as on a GPU build)."""
    p.set(torch._C, "_cuda_getDevice", lambda: 0)
    p.set(torch._C, "_cuda_getCurrentRawStream", lambda index: 0)
    p.set(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
    p.set(torch.cuda.graphs, "_cuda_isCurrentStreamCapturing", lambda: False)
    p.set(torch.cuda, "_exchange_device", lambda index: 0)
    p.set(torch.cuda, "_maybe_exchange_device", lambda index: 0)
    p.set(torch.cuda, "_initialized", True)


def _triton(p: _Patches, stubs: _Stubs) -> None:
    import triton.runtime

    from ..backends.triton import binding, config, launch, plans

    # Some launchers' call reads the active driver (which a machine without a GPU has none of) and nothing of it
    # unless the kernel needs scratch memory.
    p.set(triton.runtime.driver, "_active", SimpleNamespace())

    p.fresh(launch, "_PLANS", "_FORWARD", "_BACKWARD")
    p.set(launch, "device_unsupported_reason", lambda device: None)
    p.set(launch, "choose_config", lambda d, r, c, h, interpret: config.choose_config(d, r, c, h, False))
    p.set(launch, "stats_tile", lambda r, c, h, interpret: config.stats_tile(r, c, h, False))
    p.set(plans, "BoundKernel", lambda kernel, consts, index: binding.BoundKernel(_StubJIT(kernel, stubs), consts, 0))
    p.fresh(plans, "_PARTIALS")
    # Bound at import to what a CPU build has (as cute's, below).
    p.set(plans, "_GET_DEVICE", torch._C._cuda_getDevice)
    p.set(plans, "_RAW_STREAM", torch._C._cuda_getCurrentRawStream)
    p.set(plans, "_IS_CAPTURING", torch._C._cuda_isCurrentStreamCapturing)
    if binding.direct_launch_reason() is not None:
        raise RuntimeError(f"the direct launch is off, so the GPU path is not: {binding.direct_launch_reason()}")


def _on_device_zero() -> None:
    """Every Triton plan built so far bound to device 0, as on a GPU (the CPU's have none: no current-device
    test per call)."""
    from ..backends.triton import launch

    for plan in launch._PLANS.values():
        if hasattr(plan, "index"):
            plan.index = 0


def _cute(p: _Patches, stubs: _Stubs) -> bool:
    """The cute backend's stand-ins; False where CuTe-DSL is not importable."""
    from ..backends.cute import launch

    if launch.unavailable_reason() is not None:
        return False
    from ..backends.cute import tail_launch
    from ..backends.cute.device import offline_spec

    p.fresh(launch, "_FUNCTIONS", "_LAUNCHERS", "_SCRATCH")
    p.set(launch, "device_unsupported_reason", lambda device: None)
    p.set(launch, "host_function", lambda kernel_class, config, arch: stubs.launch)
    p.set(launch, "device_spec", lambda index: offline_spec("sm_90a"))
    p.set(launch, "_prime", lambda *args: None)
    # Bound at import to what a CPU build has; a GPU build binds these C functions. CPU tensors' device index is
    # None, so that is the current device here.
    p.set(launch, "_GET_DEVICE", lambda: None)
    p.set(launch, "_RAW_STREAM", torch._C._cuda_getCurrentRawStream)
    p.set(launch, "_IS_CAPTURING", torch._C._cuda_isCurrentStreamCapturing)
    p.fresh(tail_launch, "_ROUTES", "_SPECS")
    p.set(tail_launch, "device_spec", lambda index: offline_spec("sm_90a"))
    p.set(tail_launch, "_prime", lambda *args: None)
    return True


@contextlib.contextmanager
def launch_stubs():
    """The stand-ins and fresh caches of one run: yields the ``_Stubs`` (``launches`` counts the launches,
    ``cute`` says whether the cute backend is there); everything is put back on exit."""
    from .. import api, kernel_api

    p = _Patches()
    try:
        stubs = _Stubs()
        _cuda_runtime(p)
        p.fresh(api, "_OPS", "_FWD_FAST", "_BWD_FAST", "_FWD_TAIL_FAST", "_BWD_TAIL_FAST", "_AUTOGRAD_STATS")
        p.fresh(kernel_api, "_COMPILED")
        _triton(p, stubs)
        stubs.cute = _cute(p, stubs)
        yield stubs
    finally:
        p.restore()


def _pack(case: Case) -> SimpleNamespace:
    """The case's tensors on the CPU, uninitialised (nothing reads them: the launches are stand-ins), and what
    ``tail.random_tail`` reads of a pack."""
    width, n = case.coff * case.head_dim, len(case.seqlens)
    kv = torch.empty(case.total_tokens, width, dtype=torch.bfloat16)
    lens = torch.tensor(case.seqlens, dtype=torch.int32)
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu_comp = torch.zeros(n + 1, dtype=torch.int32)
    cu_comp[1:] = (lens // case.ratio).cumsum(0)
    return SimpleNamespace(
        kv=kv, score=torch.empty_like(kv), ape=torch.empty(case.ratio, width), cu_seqlens=cu, cu_seqlens_comp=cu_comp,
        grad_out=torch.empty(case.total_comp, case.head_dim, dtype=torch.bfloat16), total_comp=case.total_comp,
        head_dim=case.head_dim, ratio=case.ratio, seqlens=case.seqlens,
    )  # fmt: skip


def _pool_call(backend: str, pack, case: Case, tail):
    """compressor_pool's forward on leaves (with the tail case's tail), then its autograd backward."""
    from ..autograd import compressor_pool

    leaves = [t.detach().requires_grad_(True) for t in (pack.kv, pack.score, pack.ape)]
    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)
    kw = tail.kwargs() if tail is not None else {}

    def pool():
        out = compressor_pool(*leaves, *offsets, case.ratio, case.coff, pack.total_comp, backend, **kw)
        return torch.autograd.grad(out, leaves, pack.grad_out)

    return pool


def _calls(backend: str, case: Case, pack) -> dict:
    """The bench's two wrapper calls of the case (``bench.calls``: long windows hand the forward's statistics to
    the backward, as autograd does; tail cases run the bench's tail) and compressor_pool's forward and backward."""
    from .calls import _kernel_callables, make_tail

    tail = make_tail(case, pack) if case.tail else None
    calls = _kernel_callables(backend, pack, case, tail)
    calls["pool"] = _pool_call(backend, pack, case, tail)
    return calls


def _ops(fn) -> tuple[tuple[str, int], ...]:
    """The aten operations one call of ``fn`` dispatches itself (not those inside another aten operation)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = Counter(
        e.name for e in prof.events() if e.name.startswith("aten::") and not _inside_aten(e)
    )  # fmt: skip
    return tuple(sorted(names.items()))


def _inside_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _keep_freed_blocks() -> None:
    """glibc serves large blocks by mapping fresh pages and unmaps them when freed, per call; the CUDA caching
    allocator keeps its blocks. Told to keep freed blocks too, the CPU's allocations cost about what a cached
    block does, the same for every call."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is not None:
        mallopt(-4, 0)  # M_MMAP_MAX: no mapped blocks
        mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD (an int): keep the heap's top


def _launches(fn, stubs: _Stubs) -> int:
    """Launches per call of ``fn``, after the calls that build its configuration (stand-in kernels) and bind
    their launches."""
    fn()
    _on_device_zero()
    fn()
    before = stubs.launches
    fn()
    return stubs.launches - before


def host_costs(
    cases: Iterable[Case] = CASES, backends: Sequence[str] = ("triton", "cute"),
    directions: Sequence[str] = HOST_DIRECTIONS, number: int = 200, repeat: int = 15,
) -> list[HostCost]:  # fmt: skip
    """One ``HostCost`` per case, backend (cute left out where CuTe-DSL is not importable) and direction: the
    best of ``repeat`` rounds of ``number`` calls, every call timed once per round (a busy host slows them
    alike); ``number=0`` counts without timing. Timing changes the process's allocator settings
    (``_keep_freed_blocks``): a run for a process of its own."""
    if number:
        _keep_freed_blocks()
    with launch_stubs() as stubs:
        names = [b for b in backends if b != "cute" or stubs.cute]
        jobs = []
        for case in cases:
            pack = _pack(case)
            for backend in names:
                calls = _calls(backend, case, pack)
                jobs += [((case.name, backend, d), calls[d], _launches(calls[d], stubs)) for d in directions]
        best = [float("inf") if number else float("nan")] * len(jobs)
        for _ in range(repeat if number else 0):
            for k, (_key, fn, _n) in enumerate(jobs):
                best[k] = min(best[k], timeit.timeit(fn, number=number) / number * 1e6)
        return [HostCost(*key, us, n, _ops(fn)) for (key, fn, n), us in zip(jobs, best, strict=True)]


def _ops_text(ops) -> str:
    return " ".join(f"{name[6:]}x{n}" if n > 1 else name[6:] for name, n in ops) or "-"


def format_host_table(rows: Sequence[HostCost]) -> str:
    """A markdown table: per case and direction, each backend's us, launches and aten operations per call."""
    backends = list(dict.fromkeys(r.backend for r in rows))
    head = ["case", "dir"] + [f"{b} {k}" for b in backends for k in ("us", "launches", "ops")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keyed = {(r.case, r.direction, r.backend): r for r in rows}
    for case, direction in dict.fromkeys((r.case, r.direction) for r in rows):
        cells = [case, direction]
        for b in backends:
            r = keyed.get((case, direction, b))
            cells += [f"{r.us:.1f}", str(r.launches), _ops_text(r.ops)] if r else ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    totals = {b: statistics.fmean(r.us for r in rows if r.backend == b) for b in backends}
    lines.append("")
    lines.append("mean us per call: " + ", ".join(f"{b} {v:.1f}" for b, v in totals.items()))
    return "\n".join(lines)
