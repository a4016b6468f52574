"""CPU-only check of the cute backend's packed host-function call (no GPU needed, only nvidia-cutlass-dsl).

``_Launcher`` writes the forward/backward host arguments into 8-byte slots with one ``struct.pack_into``
and calls the DSL's packed C entry point directly. A host-only ``@cute.jit`` function with the same
signature prints what it received, so the slot layout (pointers, Int32 scalars, stream) is checked against
the DSL's own argument decoding, for the fast path and the regular compiled call alike.
"""

from __future__ import annotations

import ctypes

import pytest

launch = pytest.importorskip("csa_compressor.backends.cute.launch")
if launch.unavailable_reason() is not None:
    pytest.skip(launch.unavailable_reason(), allow_module_level=True)

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

_LIBC = ctypes.CDLL(None)


class _Sch:
    R, TC, V, threads, MB = 4, 32, 4, 128, 0


@cute.jit
def _host_fwd(a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, d: cute.Pointer, e: cute.Pointer, f: cute.Pointer,
              n_seg: Int32, n_rows: Int32, stream: cuda.CUstream):  # fmt: skip
    cute.printf("ABI {} {} {} {} {} {} | {} {}", a.toint(), b.toint(), c.toint(), d.toint(), e.toint(), f.toint(),
                n_seg, n_rows)  # fmt: skip


@cute.jit
def _host_bwd(a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, d: cute.Pointer, e: cute.Pointer, f: cute.Pointer,
              g: cute.Pointer, h: cute.Pointer, i: cute.Pointer, j: cute.Pointer,
              n_seg: Int32, n_rows: Int32, n_tok: Int32, rows_per_cta: Int32, num_ctas: Int32,
              stream: cuda.CUstream):  # fmt: skip
    cute.printf("ABI {} {} {} {} {} {} {} {} {} {} | {} {} {} {} {}", a.toint(), b.toint(), c.toint(), d.toint(),
                e.toint(), f.toint(), g.toint(), h.toint(), i.toint(), j.toint(),
                n_seg, n_rows, n_tok, rows_per_cta, num_ctas)  # fmt: skip


@cute.jit
def _host_fwd_st(a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, d: cute.Pointer, e: cute.Pointer,
                 f: cute.Pointer, g: cute.Pointer, n_seg: Int32, n_rows: Int32, stream: cuda.CUstream):  # fmt: skip
    cute.printf("ABI {} {} {} {} {} {} {} | {} {}", a.toint(), b.toint(), c.toint(), d.toint(), e.toint(), f.toint(),
                g.toint(), n_seg, n_rows)  # fmt: skip


@cute.jit
def _host_bwd_st(a: cute.Pointer, b: cute.Pointer, c: cute.Pointer, d: cute.Pointer, e: cute.Pointer, f: cute.Pointer,
                 g: cute.Pointer, h: cute.Pointer, i: cute.Pointer, j: cute.Pointer, k: cute.Pointer,
                 n_seg: Int32, n_rows: Int32, n_tok: Int32, rows_per_cta: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):  # fmt: skip
    cute.printf("ABI {} {} {} {} {} {} {} {} {} {} {} | {} {} {} {} {}", a.toint(), b.toint(), c.toint(), d.toint(),
                e.toint(), f.toint(), g.toint(), h.toint(), i.toint(), j.toint(), k.toint(),
                n_seg, n_rows, n_tok, rows_per_cta, num_ctas)  # fmt: skip


_HOSTS = {"forward": _host_fwd, "backward": _host_bwd, "forward_stats": _host_fwd_st, "backward_stats": _host_bwd_st}


def _compile(direction):
    """A host-only function with ``direction``'s host-function signature (launch._dtypes, launch._N_INT)."""
    args = [launch._fake_ptr(t) for t in launch._dtypes(direction)] + [Int32(1)] * launch._N_INT[direction]
    return cute.compile(_HOSTS[direction], *args, cuda.CUstream(0))


def _received(capfd) -> list[str]:
    _LIBC.fflush(None)  # the host function prints through the C stdio buffer
    return [line for line in capfd.readouterr().out.splitlines() if line.startswith("ABI")]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_packed_call_slot_layout(direction, capfd):
    compiled = _compile(direction)
    launcher = launch._Launcher(compiled, direction, 0, _Sch(), 132, 0)
    assert launcher.fast, launcher.fast_error
    n_ptr, n_int = launch._N_PTR[direction], launch._N_INT[direction]
    ptrs = tuple((0x7F00_0000_0000 + 0x10 * (k + 1)) << 4 for k in range(n_ptr))
    ints = tuple([1, 2**31 - 1, 70000, 8, 264][:n_int])
    expected = "ABI " + " ".join(map(str, ptrs)) + " | " + " ".join(map(str, ints))
    _received(capfd)
    launcher.launch((*ptrs, *ints, 0))  # fast path
    launcher(ptrs, ints, 0)  # compatibility entry
    calls = 2
    launcher.fast = False  # regular compiled-function call
    launcher.launch((*ptrs, *ints, 0))
    assert _received(capfd) == [expected] * (calls + 1)
    launcher.fast = True
    with pytest.raises(Exception, match="format requires"):
        launcher.launch((*ptrs, *ints[:-1], 2**31, 0))  # an Int32 out of range raises instead of wrapping
