"""Compiling one kernel: its host function traced against placeholder pointers and scalars, lowered by CuTe-DSL
with a TVM-FFI entry point (called with integer pointers, Python ints and the stream as an int).

Host function signatures (``kind`` of the kernel class), the one place that states them (``launch.call_forward``
and ``launch.call_backward`` pass them in this order):

- ``forward``: ``(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stats, segments, total_comp, tokens, stream)``;
- ``backward``: ``(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, slabs,
  stats, segments, total_comp, tokens, rows_per_cta, num_ctas, stream)``,

with 16-byte aligned global pointers, ``segments = len(cu_seqlens) - 1``, ``tokens`` the rows of kv (T: the bounds
guard keeps every access inside kv, score and the gradients whatever the offsets hold); ``stats`` is
the softmax statistics ``(total_comp, 3, head_dim)`` fp32 where the kernel uses them (any value elsewhere),
``slabs`` the grad_ape partials of the persistent backward grid of ``num_ctas`` CTAs x ``rows_per_cta`` rows.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.runtime import make_ptr
from cutlass.cute.typing import AddressSpace

_POINTERS = {
    "forward": (BFloat16, BFloat16, Float32, Int32, Int32, BFloat16, Float32),
    "backward": (BFloat16, BFloat16, Float32, Int32, Int32, BFloat16, BFloat16, BFloat16, Float32, Float32, Float32),
}
_SCALARS = {"forward": 3, "backward": 5}
# The fused tail's pointers (norm_weight, rope_cos, rope_sin, position_start, rstd[, grad_norm_weight]) after the
# kind's scalars, then norm_eps and max_position; a bf16 norm weight is recast in the kernel.
_TAIL_POINTERS = {
    "forward_tail": (Float32, Float32, Float32, Int32, Float32),
    "backward_tail": (Float32, Float32, Float32, Int32, Float32, Float32),
}


def _pointers(types) -> list:
    return [make_ptr(t, 0, AddressSpace.gmem, assumed_align=16) for t in types]


def placeholder_arguments(kind: str) -> list:
    """The host function's arguments to trace with: null pointers of the element types, Int32 scalars, a stream."""
    base = kind.removesuffix("_tail")
    args = [*_pointers(_POINTERS[base]), *([Int32(1)] * _SCALARS[base])]
    if kind != base:
        args += [*_pointers(_TAIL_POINTERS[kind]), Float32(1e-6), Int32(1)]
    return [*args, cuda.CUstream(0)]


def compile_kernel(kernel, arch: str, dump_dir: str | None = None):
    """``kernel`` (a kernel class instance) compiled for ``arch``; with ``dump_dir`` its PTX and cubin are kept
    there and on ``compiled.artifacts``."""
    options = f"--gpu-arch={arch} --enable-tvm-ffi"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir={dump_dir}"
    return cute.compile(kernel, *placeholder_arguments(kernel.kind), options=options)
