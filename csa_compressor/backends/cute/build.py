"""Compiling one kernel: its host function traced against placeholder pointers and scalars, lowered by CuTe-DSL
with a TVM-FFI entry point (called with integer pointers, Python ints and floats, and the stream as an int).

Host function signatures (``kind`` of the kernel class), the one place that states them (``launch.call_forward``,
``launch.call_backward`` and the tail's launches pass them in this order):

- ``forward``: ``(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, segments, total_comp, tokens, stream)``;
- ``backward``: ``(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, slabs,
  stats, segments, total_comp, tokens, rows_per_cta, num_ctas, stream)``;
- ``tail_forward`` (``tail_kernels.TailForward``): ``(x, cu_seqlens, cu_seqlens_comp, out, segments, total_comp,
  tokens, <tail>, stream)``;
- ``tail_gradient`` (``tail_kernels.TailGradient``): ``(grad_out, x, cu_seqlens, cu_seqlens_comp, dx, slabs,
  segments, total_comp, tokens, rows_per_cta, num_ctas, <tail>, stream)``;
- ``summing_backward`` (``BackwardWithStats`` with ``norm_slabs``): ``backward``'s with ``slabs`` the
  norm-weight slabs of TailGradient, ``grad_norm_weight`` after ``stats`` and the slabs' count after ``num_ctas``,

with 16-byte aligned global pointers, ``segments = len(cu_seqlens) - 1``, ``tokens`` the rows of kv (T: the bounds
guard keeps every access inside kv, score and the gradients whatever the offsets hold); ``stats`` is
the softmax statistics ``(total_comp, 3, head_dim)`` fp32 where the kernel uses them (any value elsewhere),
``slabs`` the grad_ape partials of the persistent backward grid of ``num_ctas`` CTAs x ``rows_per_cta`` rows
(``config.slab_entries`` floats per CTA).

A configuration with a ``tail`` (``configs.TailSpec``) takes the tail's block ``<tail>`` after those arguments and
before ``stream``: ``norm_weight, rope_cos, rope_sin, position_start, rstd`` (pointers, 0 where absent), for the
backward kinds also ``grad_norm_weight``, then ``norm_eps`` (Float32) and ``max_position`` (Int32). A backward
configuration with ``grad_float32`` takes grad_out as fp32.
"""

from __future__ import annotations

import re

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import AddressSpace

_POINTERS = {
    "forward": (BFloat16, BFloat16, Float32, Int32, Int32, BFloat16, Float32),
    "backward": (BFloat16, BFloat16, Float32, Int32, Int32, BFloat16, BFloat16, BFloat16, Float32, Float32, Float32),
    "tail_forward": (Float32, Int32, Int32, BFloat16),
    "tail_gradient": (BFloat16, Float32, Int32, Int32, Float32, Float32),
}
_POINTERS["summing_backward"] = (*_POINTERS["backward"], Float32)
_SCALARS = {"forward": 3, "backward": 5, "tail_forward": 3, "tail_gradient": 5, "summing_backward": 6}
_GRADIENT_KINDS = ("backward", "tail_gradient")
_GRAD_OUT = {"backward": 5, "tail_gradient": 0, "summing_backward": 5}  # grad_out's position among the pointers


def _pointer(dtype, align: int = 16):
    return make_ptr(dtype, 0, AddressSpace.gmem, assumed_align=align)


def tail_block(kind: str, tail) -> list:
    """The placeholders of the tail's block (``configs.TailSpec`` ``tail``) of a ``kind`` host function."""
    weight = BFloat16 if tail.has_norm and not tail.norm_weight_float32 else Float32
    pointers = [_pointer(weight), _pointer(Float32), _pointer(Float32), _pointer(Int32, 4), _pointer(Float32, 4)]
    if kind in _GRADIENT_KINDS:
        pointers.append(_pointer(Float32))
    return [*pointers, Float32(1.0), Int32(1)]


def placeholder_arguments(kernel) -> list:
    """The host function's arguments to trace with: null pointers of the element types, Int32 scalars, the tail's
    block where the configuration has a tail, a stream."""
    kind, cfg = kernel.kind, kernel.config
    types = list(_POINTERS[kind])
    if getattr(cfg, "grad_float32", False):
        types[_GRAD_OUT[kind]] = Float32
    args = [_pointer(t) for t in types] + [Int32(1)] * _SCALARS[kind]
    tail = getattr(cfg, "tail", None)
    if tail is not None:
        args += tail_block(kind, tail)
    return [*args, cuda.CUstream(0)]


def compile_kernel(kernel, arch: str, dump_dir: str | None = None):
    """``kernel`` (a kernel class instance) compiled for ``arch``; with ``dump_dir`` its PTX and cubin are kept
    there and on ``compiled.artifacts``."""
    options = f"--gpu-arch={arch} --enable-tvm-ffi"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir={dump_dir}"
    compiled = cute.compile(kernel, *placeholder_arguments(kernel), options=options)
    check_shared_memory(compiled, type(kernel).__name__)
    return compiled


# The DSL checks a launch's shared memory against what its kernel lays out and against the architecture's most only
# when the launch runs, each by a print under that comparison; where the launch is right the compiler folds the
# comparison and drops the print. The prints' texts, and what a print left in the host code means:
_SHARED_MEMORY_PRINTS = {
    "shared memory usage in": "the launch gives less shared memory than the kernel lays out",
    "kernel '[^']*' launch shared memory exceeds": "the launch asks for more shared memory than the architecture has",
}


def check_shared_memory(compiled, name: str) -> None:
    """Refuse a build whose launch gives less shared memory than its kernel uses (it would write past it) or more
    than the architecture allows (the launch would fail): the DSL's run-time print is still in the host code."""
    module = getattr(compiled, "ir_module", None)  # the DSL versions pyproject allows have it (tests hold to it)
    host = "" if module is None else str(module)
    for text, fault in _SHARED_MEMORY_PRINTS.items():
        for symbol in re.findall(rf'llvm\.mlir\.global internal constant @(\w+)\("\\0AError: {text}', host):
            if re.search(rf"llvm\.mlir\.addressof @{symbol}\b", host):
                raise RuntimeError(f"{name}: {fault} (its config's smem_bytes)")
