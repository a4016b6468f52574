"""One launch path for the Triton kernels: a kernel bound to its compile-time constants on one device.

Triton's ``kernel[grid](*args, **constexprs)`` binds and specialises every argument in Python on every call.
A ``BoundKernel`` takes that path once, at its first launch (which compiles, or finds the compiled kernel), and
from then on calls the compiled kernel's launcher directly, with the runtime arguments followed by the constexpr
values Triton itself passed at that first launch. Reusing them is sound because the callers keep every
argument's specialisation fixed: tensor dtypes are the configuration's, every pointer is 16-byte aligned (the API
checks it; the offset arrays are declared ``do_not_specialize_on_alignment``), every runtime integer fits int32
and is ``do_not_specialize``, and ``stats`` is None or a tensor for the whole life of a plan.

The launcher is an object whose Python call allocates the kernel's scratch memory, if any, and hands everything to
its C launch function. Where the kernel needs none and the object's call is one this module has read
(``_KNOWN_LAUNCHER_CALLS``), the direct launch calls the C launch function itself, with what the object's call
hands it (recorded at the bind: ``_inner_launch``).

Where Triton's launch internals are not what this module expects (``direct_launch_reason``, checked once per
bind), under the interpreter, and on the CPU, the bound launch stays Triton's own ``kernel[grid]`` call: the same
``launch(grid, stream, *args)`` with a different callable behind it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect

import torch

__all__ = ["BoundKernel", "direct_launch_reason"]

# What Triton's JITFunction.run passes to the compiled kernel's launcher (Triton 3.3 to 3.9 at least): the grid,
# the stream, the function handle, the packed metadata, the launch metadata, the two hooks, then every bound
# argument in signature order (constexprs included; the launcher skips them).
_RUN_CALL = (
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
    "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())"
)
_HEAD = 9  # launcher arguments before the kernel's own


def _flat(source: str) -> str:
    return " ".join(source.split())


@functools.cache
def direct_launch_reason() -> str | None:
    """Why a bound kernel cannot launch its compiled kernel directly with the installed Triton (None: it can).

    Reads Triton's sources, not a GPU: the call ``JITFunction.run`` makes, the ``CompiledKernel`` attributes the
    direct launch uses and the launch hooks. A change there turns the direct launch off (the
    plain ``kernel[grid]`` launch remains), and tests/backends/test_triton_launch.py fails on the CPU.
    """
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        run_source = _flat(inspect.getsource(JITFunction.run))
        init_source = _flat(inspect.getsource(CompiledKernel.__init__))
        handles_source = _flat(inspect.getsource(CompiledKernel._init_handles))
        run_property = CompiledKernel.__dict__.get("run")
        getter_source = _flat(inspect.getsource(run_property.fget)) if isinstance(run_property, property) else ""
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        return f"Triton's launch internals are not readable ({type(exc).__name__}: {exc})"
    checks = {
        "JITFunction.run launches with kernel.run(grid, stream, handle, metadata, hooks, *bound_args)": (
            _RUN_CALL in run_source and "return kernel" in run_source
        ),
        "CompiledKernel keeps packed_metadata": "self.packed_metadata =" in init_source,
        "CompiledKernel._init_handles sets function and _run": (
            "self.function" in handles_source and "self._run =" in handles_source
        ),
        "CompiledKernel.run is a property returning _run": "return self._run" in getter_source,
        "CompiledKernel.launch_metadata exists": callable(getattr(CompiledKernel, "launch_metadata", None)),
        "launch hooks are hook chains": all(isinstance(getattr(h, "calls", None), list) for h in hooks),
    }
    failed = [name for name, ok in checks.items() if not ok]
    return f"Triton's launch internals changed: {'; '.join(failed)}" if failed else None


class BoundKernel:
    """``kernel`` with its constexprs and launch options ``consts``, on CUDA device ``index`` (None: the CPU or the
    interpreter, where the launch is always Triton's own).

    ``launch(grid, stream, *args)`` enqueues a 1-D grid of ``grid`` programs with the runtime arguments ``args``
    on ``stream`` (a ``torch.cuda.Stream``, or None for the current stream). The caller has made ``index`` the
    current device.
    """

    __slots__ = ("consts", "direct", "index", "kernel", "launch")

    def __init__(self, kernel, consts: dict, index: int | None):
        self.kernel, self.consts, self.index = kernel, consts, index
        self.direct = False
        self.launch = self._first

    def _plain(self, grid, stream, *args):
        """Triton's own launch (binds, specialises, compiles if needed); returns the compiled kernel."""
        if stream is None:
            return self.kernel[(grid,)](*args, **self.consts)
        with torch.cuda.stream(stream):
            return self.kernel[(grid,)](*args, **self.consts)

    def _first(self, grid, stream, *args):
        compiled = self._plain(grid, stream, *args)
        launch = None
        if self.index is not None and direct_launch_reason() is None:
            launch = _direct(self, compiled, grid, stream, args)
        self.direct = launch is not None
        self.launch = launch if launch is not None else self._plain


def _stream_handle(stream, index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index) if stream is None else stream.cuda_stream


def _recorded_call(bound: BoundKernel, compiled, grid, stream, args):
    """The arguments Triton's own launch hands ``compiled``'s launcher for this call, captured without launching."""
    calls = []
    saved = compiled._run
    compiled._run = lambda *call: calls.append(call)
    try:
        again = bound._plain(grid, stream, *args)
    finally:
        compiled._run = saved
    return calls[0] if len(calls) == 1 and again is compiled else None


def _direct(bound: BoundKernel, compiled, grid, stream, args):
    """The direct launcher of ``compiled``, or None where Triton's own launch would pass something else."""
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return None  # the current-stream query Triton's driver makes (every CUDA build of torch has it)
    call = _recorded_call(bound, compiled, grid, stream, args)
    n = len(args)
    head = (grid, 1, 1, _stream_handle(stream, bound.index), compiled.function, compiled.packed_metadata)
    if call is None or len(call) < _HEAD + n or call[:6] != head:
        return None
    if any(
        got is not arg and not (isinstance(arg, int) and got == arg)
        for got, arg in zip(call[_HEAD : _HEAD + n], args, strict=True)
    ):
        return None
    tail = call[_HEAD + n :]  # the constexpr values, in signature order
    # The tensor arguments go to the launcher as addresses: for a tensor it calls data_ptr() and then asks the
    # driver whether the address is a device pointer, once per pointer and call; the API has checked the devices.
    tensors = {i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)}
    payload = (*(arg.data_ptr() if i in tensors else arg for i, arg in enumerate(args)), *tail)
    inner = _inner_launch(compiled.run, compiled.function, compiled.packed_metadata, payload)
    return _launcher(compiled, bound.index, (n, tensors, tail), inner)


# The launcher objects whose call the direct launch makes itself where the kernel needs no scratch memory
# (CudaLauncher.__call__: the kernel's global and profile scratch, then the C launch function with its own
# constants), by the digest of the call's flattened source: those of Triton 3.6 and 3.9. Another Triton's is called
# as before until its call has been read (tests/backends/test_triton_launch.py fails on the CPU meanwhile).
_KNOWN_LAUNCHER_CALLS = frozenset({"b5e4d84a36af22ef", "6ac1fdd62dbc8cde"})


@functools.cache
def _known_launcher(cls) -> bool:
    try:
        source = _flat(inspect.getsource(cls.__call__))
    except (OSError, TypeError, AttributeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest()[:16] in _KNOWN_LAUNCHER_CALLS


def _same(got, want) -> bool:
    return len(got) == len(want) and all(
        a is b or (type(a) is int and type(b) is int and a == b) for a, b in zip(got, want, strict=True)
    )


def _inner_launch(run, function, packed, payload):
    """``(C launch function, the constants of its call, payload flat)`` of the launcher object ``run``: two calls of
    ``run`` (grids and streams apart) recorded where it hands them to its C launch, not launched. Only the grid
    (first) and the stream (fourth) may differ between them, and the payload must come last, flat or as one tuple;
    None otherwise, or where ``run`` is not a launcher whose call has been read, or the kernel needs scratch."""
    inner = vars(run).get("launch") if hasattr(run, "__dict__") else None
    if inner is None or not _known_launcher(type(run)):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None  # scratch is allocated per launch, by the launcher object
    calls = []
    run.launch = lambda *call: calls.append(call)
    try:
        for grid, stream in ((3, 101), (5, 202)):
            run(grid, 1, 1, stream, function, packed, None, None, None, *payload)
    except Exception:  # a launcher that needs what a recording does not give it
        return None
    finally:
        run.launch = inner
    if len(calls) != 2 or len(calls[0]) != len(calls[1]):
        return None
    flat = len(calls[0]) > 4 + len(payload) and _same(calls[0][len(calls[0]) - len(payload) :], payload)
    if not flat and not (isinstance(calls[0][-1], tuple) and _same(calls[0][-1], payload)):
        return None
    size = len(calls[0]) - (len(payload) if flat else 1)
    heads = [c[:size] for c in calls]
    if size < 4 or heads[0][0::3][:2] != (3, 101) or heads[1][0::3][:2] != (5, 202):
        return None
    if not all(_same(h[1:3] + h[4:], heads[0][1:3] + heads[0][4:]) for h in heads):
        return None
    return inner, heads[0], flat


_LAUNCH_SOURCE = """
def launch(grid, stream{params}):
    handle = raw_stream(index) if stream is None else stream.cuda_stream
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):
        meta = compiled.launch_metadata((grid, 1, 1), handle{params}{consts})
        run(grid, 1, 1, handle, function, packed, meta, enter, leave{params}{consts})
        return
    {call}
"""


def _launcher(compiled, index: int, arguments: tuple, inner):
    """The direct launch of ``compiled``, written out for this kernel (a call builds no argument list and runs no
    loop). ``arguments``: (the number of runtime arguments, the positions of the tensors among them, passed as
    addresses, the constexpr values); ``inner``: ``_inner_launch``'s, to call the C launch function itself, or None
    (the launcher object). A profiler's hooks get Triton's launch metadata and its own arguments, tensors included."""
    from triton import knobs

    n, tensors, tail = arguments
    params = "".join(f", a{i}" for i in range(n))
    # The constants go in as tuples, unpacked: cheaper than a name each.
    values = [f"a{i}.data_ptr()" if i in tensors else f"a{i}" for i in range(n)] + ["*CONSTS"]
    namespace = dict(
        raw_stream=torch._C._cuda_getCurrentRawStream, index=index, runtime=knobs.runtime, compiled=compiled,
        run=compiled.run, function=compiled.function, packed=compiled.packed_metadata, CONSTS=tuple(tail),
    )  # fmt: skip
    if inner is None:
        call = f"run(grid, 1, 1, handle, function, packed, None, None, None, {', '.join(values)})"
    else:
        c_launch, head, flat = inner
        namespace.update(c_launch=c_launch, K1=head[1], K2=head[2], HEAD=tuple(head[4:]))
        words = ["grid", "K1", "K2", "handle", "*HEAD"]
        words += values if flat else ["(" + ", ".join(values) + ",)"]
        call = f"c_launch({', '.join(words)})"
    source = _LAUNCH_SOURCE.format(params=params, consts=", *CONSTS", call=call)
    exec(compile(source, f"<csa_compressor direct launch of {n} arguments>", "exec"), namespace)
    return namespace["launch"]
