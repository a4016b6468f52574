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

from csa_compressor.backends.cute import host_ext  # noqa: E402
from csa_compressor.testing import misaligned_copy  # noqa: E402

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
    record = host_ext.make_launch(launcher) if host_ext.module() is not None else None
    if record is not None:  # the C++ host fast path's own slots and packed array
        host_ext.module().call(record, ptrs, ints, 0)
        calls += 1
    launcher.fast = False  # regular compiled-function call
    launcher.launch((*ptrs, *ints, 0))
    assert _received(capfd) == [expected] * (calls + 1)
    launcher.fast = True
    with pytest.raises(Exception, match="format requires"):
        launcher.launch((*ptrs, *ints[:-1], 2**31, 0))  # an Int32 out of range raises instead of wrapping
    if record is not None:
        with pytest.raises(OverflowError, match="out of range"):
            host_ext.module().call(record, ptrs, (*ints[:-1], 2**31), 0)


def test_host_extension_builds_where_a_compiler_exists():
    """The ABI test above covers the C++ call only when the extension builds: make a failed build visible."""
    import shutil

    if not host_ext.enabled() or shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("host extension disabled, or no C++ compiler / ninja")
    assert host_ext.module() is not None, host_ext.error()


def _cpu_pack():
    """A valid ratio-4 coff-2 head_dim-64 pack on the CPU (the C++ checks accept CPU tensors for device -1)."""
    import torch

    kv = torch.randn(37, 128).to(torch.bfloat16)
    score = torch.randn(37, 128).to(torch.bfloat16)
    ape = torch.randn(4, 128)
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    cuc = torch.tensor([0, 5, 9], dtype=torch.int32)
    return kv, score, ape, cu, cuc


def _host_record(direction):
    """(extension, launch record, launcher) over the printing host function of ``direction`` (the launcher owns
    the compiled function the record calls into, so the caller keeps it)."""
    ext = host_ext.module()
    if ext is None:
        pytest.skip(f"host extension not built: {host_ext.error()}")
    launcher = launch._Launcher(_compile(direction), direction, 0, _Sch(), 132, 0)
    return ext, host_ext.make_launch(launcher), launcher


def _ptrs(tensors):
    return " ".join(str(t.data_ptr()) for t in tensors)


@pytest.mark.parametrize("direction", ["forward", "forward_stats"])
def test_host_forward_packs_what_the_python_path_packs(direction, capfd):
    """The C++ wrapper path end to end on the CPU, through a host-only function that prints its arguments: the
    inputs' and the freshly allocated outputs' pointers (out, then the softmax statistics), B and the row count, in
    the Python path's slot order."""
    import torch

    ext, record, _keep = _host_record(direction)  # _keep: the launcher owning the function the record calls
    stats = direction == "forward_stats"
    cfg = ext.make_config(4, 2, 64, -1, record, None, 1 << 62, None, 0, 1, 1, 0, int(stats))
    inputs = _cpu_pack()
    _received(capfd)
    result = ext.forward(cfg, *inputs, 9, 0)
    outs = result if stats else (result,)
    assert outs[0].shape == (9, 64) and outs[0].dtype == inputs[0].dtype
    if stats:
        assert outs[1].shape == (9, 3, 64) and outs[1].dtype == torch.float32
    assert _received(capfd) == [f"ABI {_ptrs((*inputs, *outs))} | 2 9"]
    assert ext.forward(cfg, *inputs[:4], inputs[4].long(), 9, 0) is None  # rejected: the Python path runs


@pytest.mark.parametrize("direction", ["backward", "backward_stats"])
def test_host_backward_grid_matches_python(direction, capfd):
    """The C++ backward path computes the persistent grid as ``launch.backward_grid`` does and packs the gradients
    it allocates, the slabs pointer, the softmax statistics (statistics variant) and the grid in the Python path's
    order; too small slabs, or statistics of the wrong shape, send it back to Python."""
    import types

    import torch

    ext, record, _keep = _host_record(direction)  # _keep: the launcher owning the function the record calls
    stats = direction == "backward_stats"
    inputs = _cpu_pack()
    grad_out = torch.randn(9, 64).to(torch.bfloat16)
    st = torch.randn(9, 3, 64) if stats else None
    ws = torch.empty(1 << 16)
    for num_sms, ctas, nchunk, rows_per_step in ((132, 4, 1, 2), (2, 1, 2, 4), (1, 1, 1, 1)):
        fake = types.SimpleNamespace(sch=types.SimpleNamespace(R=rows_per_step, CL=False, WT=False), num_sms=num_sms, ctas_per_sm=ctas,
                                     nchunk=nchunk)  # fmt: skip
        rows_per_cta, num_ctas = launch.backward_grid(fake, 9, inputs[2].numel())
        cfg = ext.make_config(4, 2, 64, -1, None, None, 1 << 62, record, num_sms * ctas, nchunk, rows_per_step,
                              launch.WS_CAP_BYTES, int(stats))  # fmt: skip
        _received(capfd)
        grads = ext.backward(cfg, *inputs, grad_out, st, 0, ws.data_ptr(), ws.numel())
        assert grads is not None and [g.shape for g in grads] == [t.shape for t in inputs[:3]]
        ptrs = _ptrs((*inputs, grad_out, *grads)) + f" {ws.data_ptr()}" + (f" {st.data_ptr()}" if stats else "")
        assert _received(capfd) == [f"ABI {ptrs} | 2 9 37 {rows_per_cta} {num_ctas}"]
        assert ext.backward(cfg, *inputs, grad_out, st, 0, ws.data_ptr(), num_ctas * inputs[2].numel() - 1) is None
    if stats:
        assert ext.backward(cfg, *inputs, grad_out, None, 0, ws.data_ptr(), ws.numel()) is None
        assert ext.backward(cfg, *inputs, grad_out, st[:, :2], 0, ws.data_ptr(), ws.numel()) is None
        assert ext.backward(cfg, *inputs, grad_out, st.double(), 0, ws.data_ptr(), ws.numel()) is None
    else:
        assert ext.backward(cfg, *inputs, grad_out, torch.randn(9, 3, 64), 0, ws.data_ptr(), ws.numel()) is None


@pytest.mark.parametrize("direction", ["forward", "forward_stats"])
def test_host_forward_into_packs_the_callers_buffers(direction, capfd):
    """``forward_into`` (the classes' execute): the caller's out (and statistics buffer) are packed in the Python
    path's order, the row count is out's, zero rows launch nothing; a buffer that ``support._buffer_ok`` /
    ``stats_ok`` would reject, or statistics where the configuration has none (or none where it has), goes back to
    the Python path, which raises."""
    import torch

    from csa_compressor import support

    ext, record, _keep = _host_record(direction)
    stats = direction == "forward_stats"
    cfg = ext.make_config(4, 2, 64, -1, record, None, 1 << 62, None, 0, 1, 1, 0, int(stats))
    inputs = _cpu_pack()
    out = torch.empty(9, 64, dtype=torch.bfloat16)
    st = torch.empty(9, 3, 64) if stats else None
    _received(capfd)
    assert ext.forward_into(cfg, *inputs, out, st, 0) is True
    assert _received(capfd) == [f"ABI {_ptrs((*inputs, out, *((st,) if stats else ())))} | 2 9"]
    empty = out[:0]
    assert ext.forward_into(cfg, *inputs, empty, st[:0] if stats else None, 0) is True
    assert _received(capfd) == []  # zero rows: nothing to launch
    py_cfg = support.Config(4, 2, 64, torch.bfloat16, torch.device("cpu"))
    bad_outs = {
        "float16": out.half(),
        "misaligned": misaligned_copy(out),
        "not contiguous": torch.empty(9, 128, dtype=torch.bfloat16)[:, :64],
        "head_dim": torch.empty(9, 32, dtype=torch.bfloat16),
        "3-d": out.view(9, 1, 64),
    }
    for name, bad in bad_outs.items():
        expected = bad.dim() == 2 and bad.shape[1] == 64 and support._buffer_ok(py_cfg, bad, torch.bfloat16)
        assert not expected, name
        assert ext.forward_into(cfg, *inputs, bad, st, 0) is None, name
    assert ext.forward_into(cfg, *inputs[:4], inputs[4].long(), out, st, 0) is None
    assert ext.forward_into(cfg, *inputs, out, "stats", 0) is None
    if stats:
        assert ext.forward_into(cfg, *inputs, out, None, 0) is None
        for bad in (st[:, :2], st.double(), misaligned_copy(st), torch.empty(8, 3, 64)):
            assert not support.stats_ok(py_cfg, bad, 9)
            assert ext.forward_into(cfg, *inputs, out, bad, 0) is None
    else:
        assert ext.forward_into(cfg, *inputs, out, torch.empty(9, 3, 64), 0) is None
    assert _received(capfd) == []


@pytest.mark.parametrize("direction", ["backward", "backward_stats"])
def test_host_backward_into_packs_the_callers_gradients(direction, capfd):
    """``backward_into``: the caller's three gradients in the Python path's order with the same grid as
    ``launch.backward_grid``; gradients of the wrong shape, dtype, layout or alignment, too small slabs and zero rows
    go back to the Python path."""
    import types

    import torch

    ext, record, _keep = _host_record(direction)
    stats = direction == "backward_stats"
    inputs = _cpu_pack()
    grad_out = torch.randn(9, 64).to(torch.bfloat16)
    st = torch.randn(9, 3, 64) if stats else None
    ws = torch.empty(1 << 16)
    grads = [torch.empty_like(t) for t in inputs[:3]]
    fake = types.SimpleNamespace(
        sch=types.SimpleNamespace(R=2, CL=False, WT=False), num_sms=132, ctas_per_sm=4, nchunk=1
    )
    rows_per_cta, num_ctas = launch.backward_grid(fake, 9, inputs[2].numel())
    cfg = ext.make_config(4, 2, 64, -1, None, None, 1 << 62, record, 132 * 4, 1, 2, launch.WS_CAP_BYTES, int(stats))
    _received(capfd)
    assert ext.backward_into(cfg, *inputs, grad_out, *grads, st, 0, ws.data_ptr(), ws.numel()) is True
    ptrs = _ptrs((*inputs, grad_out, *grads)) + f" {ws.data_ptr()}" + (f" {st.data_ptr()}" if stats else "")
    assert _received(capfd) == [f"ABI {ptrs} | 2 9 37 {rows_per_cta} {num_ctas}"]
    small = num_ctas * inputs[2].numel() - 1
    assert ext.backward_into(cfg, *inputs, grad_out, *grads, st, 0, ws.data_ptr(), small) is None
    empty_out = grad_out[:0]
    assert ext.backward_into(cfg, *inputs, empty_out, *grads, st[:0] if stats else None, 0, ws.data_ptr(),
                             ws.numel()) is None  # fmt: skip
    bad = {
        0: (grads[0][:-1], grads[0].half(), misaligned_copy(grads[0])),
        1: (torch.empty(37, 256, dtype=torch.bfloat16)[:, :128], grads[1].float()),
        2: (grads[2].double(), grads[2][:, :64], misaligned_copy(grads[2])),
    }
    for k, variants in bad.items():
        for v in variants:
            args = list(grads)
            args[k] = v
            assert ext.backward_into(cfg, *inputs, grad_out, *args, st, 0, ws.data_ptr(), ws.numel()) is None, (k, v)
    other = None if stats else torch.randn(9, 3, 64)
    assert ext.backward_into(cfg, *inputs, grad_out, *grads, other, 0, ws.data_ptr(), ws.numel()) is None
    assert _received(capfd) == []
