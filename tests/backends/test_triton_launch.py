"""The Triton backend's launch path (binding.py, plans.py): the Triton internals it relies on, the direct launch
against a stand-in, the fallback; ``python -m tests.backends.test_triton_launch`` times the per-call host work.
"""

from __future__ import annotations

import os
import sys
import timeit

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from csa_compressor.backends.triton import binding, launch, plans  # noqa: E402
from csa_compressor.testing import make_pack  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


class _FakeCompiled:
    """A compiled kernel as ``binding`` sees one."""

    def __init__(self):
        self.calls = []
        self._run = lambda *call: self.calls.append(call)
        self.function, self.packed_metadata = 0xF00, (1, 1, 0)

    @property
    def run(self):
        return self._run

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid, "stream": stream}


class _FakeJIT:
    """``kernel[grid](*args, **consts)`` as Triton 3.6-3.9 performs it once compiled; ``shuffle``: another argument
    order (the direct launch must refuse it)."""

    def __init__(self, constexprs, shuffle=False):
        self.compiled, self.constexprs, self.shuffle, self.binds = _FakeCompiled(), constexprs, shuffle, 0

    def __getitem__(self, grid):
        def runner(*args, **consts):
            self.binds += 1
            values = tuple(consts[name] for name in self.constexprs)
            rt = triton.knobs.runtime
            bound = (*values, *args) if self.shuffle else (*args, *values)
            c = self.compiled
            stream = torch._C._cuda_getCurrentRawStream(0)
            c.run(
                grid[0],
                1,
                1,
                stream,
                c.function,
                c.packed_metadata,
                None,
                rt.launch_enter_hook,
                rt.launch_exit_hook,
                *bound,
            )
            return c

        return runner


@pytest.fixture
def fake_cuda(monkeypatch):
    """The raw current-stream query the direct launch makes (no GPU here): stream 77 on every device."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)


def test_direct_launch_internals_match_the_installed_triton():
    """Fails when the installed Triton's launch internals change (binding.py would fall back to the plain launch)."""
    assert binding.direct_launch_reason() is None, binding.direct_launch_reason()


def test_changed_internals_turn_the_direct_launch_off(monkeypatch):
    binding.direct_launch_reason.cache_clear()
    monkeypatch.setattr(binding, "_RUN_CALL", "kernel.run(grid, stream, *non_constexpr_vals)")
    try:
        reason = binding.direct_launch_reason()
    finally:
        binding.direct_launch_reason.cache_clear()
    assert reason is not None and "JITFunction.run" in reason


@pytest.mark.parametrize("hooked", [False, True], ids=["no-profiler", "profiler"])
def test_direct_launch_passes_what_triton_passes(fake_cuda, monkeypatch, hooked):
    """First launch Triton's own; later launches go to the compiled launcher with the same arguments, never the
    binder; with a profiler's hook, hooks and metadata are passed as Triton would."""
    if hooked:
        monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [lambda meta: None])
    jit = _FakeJIT(["BLOCK", "FLAG", "PTR"])
    bound = binding.BoundKernel(jit, {"BLOCK": 64, "FLAG": True, "PTR": None}, index=0)
    x, y = torch.zeros(3), torch.ones(2)
    bound.launch(5, None, x, 3, y, None)
    assert bound.direct and jit.binds == 2 and len(jit.compiled.calls) == 1
    first = jit.compiled.calls[0]
    bound.launch(7, None, y, 4, x, None)
    assert jit.binds == 2, "a later launch went through Triton's binder"
    later = jit.compiled.calls[1]
    assert later[:6] == (7, 1, 1, 77, 0xF00, (1, 1, 0))
    assert first[9:] == (x, 3, y, None, 64, True, None)
    if hooked:
        # Triton's own arguments, tensors included, beside its launch metadata and hooks.
        assert later[9:] == (y, 4, x, None, 64, True, None)
        assert later[6] == {"grid": (7, 1, 1), "stream": 77} and later[7] is triton.knobs.runtime.launch_enter_hook
    else:
        # The tensors as their addresses (the launcher then skips its pointer query); None stays None.
        assert later[9:] == (y.data_ptr(), 4, x.data_ptr(), None, 64, True, None)
        assert later[6:9] == (None, None, None)


def test_unexpected_launch_convention_falls_back_to_triton(fake_cuda):
    jit = _FakeJIT(["BLOCK"], shuffle=True)
    bound = binding.BoundKernel(jit, {"BLOCK": 64}, index=0)
    bound.launch(5, None, 1, 2)
    bound.launch(5, None, 1, 2)
    assert not bound.direct and jit.binds == 3 and len(jit.compiled.calls) == 2


def test_interpreter_plans_launch_through_triton():
    """Under the interpreter (and on the CPU) the bound launch is Triton's own: the kernels' real logic runs."""
    if HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter path is the CPU's")
    pack = make_pack((21, 6), 8, 4, 2, token_padding=2, device=DEVICE)
    out = torch.empty((pack.total_comp, 8), dtype=pack.kv.dtype, device=DEVICE)
    launch.forward(*pack.inputs, out, 4, 2, None)
    plan = launch._FORWARD[4, 2, 8, pack.kv.dtype, pack.kv.device, False]
    assert plan.index is None and plan.kernel.launch == plan.kernel._plain and not plan.kernel.direct


def test_plans_and_sizes_are_built_once():
    pack = make_pack((33, 6), 8, 4, 2, device=DEVICE)
    out = torch.empty((pack.total_comp, 8), dtype=pack.kv.dtype, device=DEVICE)
    launch.forward(*pack.inputs, out, 4, 2, None)
    plan = launch._FORWARD[4, 2, 8, pack.kv.dtype, pack.kv.device, False]
    sizes = dict(plan._sizes)
    launch.forward(*pack.inputs, out, 4, 2, None)
    assert launch._FORWARD[4, 2, 8, pack.kv.dtype, pack.kv.device, False] is plan and plan._sizes == sizes


def _tail_problem(ratio, coff, d, seed):
    """A pack with a norm + rope tail (positions given), its TailConfig, and NaN gradient buffers."""
    from csa_compressor import tail as T

    pack = make_pack((9 * ratio + 2, 4 * ratio + 1), d, ratio, coff, comp_padding=1, device=DEVICE, seed=seed)
    tail = T.random_tail(pack, rope_dim=d - d % 2, positions=True, seed=seed)
    return pack, tail


def _tail_backward(fn, pack, tail, ratio, coff):
    nan = float("nan")
    grads = [torch.full_like(t, nan) for t in (pack.kv, pack.score, pack.ape)]
    grad_w = torch.full((pack.head_dim,), nan, device=DEVICE)
    fn(*pack.inputs, pack.grad_out, *grads, ratio, coff, None, None, tail, grad_w, None)
    return (*grads, grad_w)


def test_bind_with_a_tail_calls_its_plans(monkeypatch):
    """A tail configuration's bound functions launch its plans without the module's lookup, with its results."""
    ratio, coff, d = 4, 2, 6
    pack, tail = _tail_problem(ratio, coff, d, seed=3)
    shape = (ratio, coff, d, pack.kv.dtype, DEVICE)
    for direction in ("forward", "backward"):
        launch.compile(direction, *shape, tail.config)
    bound = [launch.bind(direction, *shape, tail.config) for direction in ("forward", "backward")]
    assert bound[0] is not launch.forward and bound[1] is not launch.backward
    out = [torch.full((pack.total_comp, d), float("nan"), dtype=pack.kv.dtype, device=DEVICE) for _ in range(2)]
    launch.forward(*pack.inputs, out[0], ratio, coff, None, None, tail)
    want = _tail_backward(launch.backward, pack, tail, ratio, coff)
    # The bound functions must not look their plans up.
    monkeypatch.setattr(launch, "_FORWARD", {})
    monkeypatch.setattr(launch, "_BACKWARD", {})
    bound[0](*pack.inputs, out[1], ratio, coff, None, None, tail)
    got = _tail_backward(bound[1], pack, tail, ratio, coff)
    assert torch.equal(out[0], out[1]) and not out[1].isnan().any()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="needs grad_norm_weight"):
        grads = [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)]
        bound[1](*pack.inputs, pack.grad_out, *grads, ratio, coff, None, None, tail, None, None)


def test_norm_partials_follow_the_dape_partials(monkeypatch):
    """On a GPU's path (a device index, not capturing) a backward with a norm takes its norm weight's partials from
    the stream's reusable buffer, 16-byte aligned after the dAPE partials: no allocation once it has grown, and the
    gradients of partials of the call's own."""
    ratio, coff, d = 3, 1, 5  # dAPE partials of an odd number of floats
    pack, tail = _tail_problem(ratio, coff, d, seed=4)
    want = _tail_backward(launch.backward, pack, tail, ratio, coff)
    # The plans are keyed by the tensors' device (cuda:0 on a GPU, not DEVICE's bare "cuda").
    plan = launch._BACKWARD[ratio, coff, d, pack.kv.dtype, pack.kv.device, False, tail.config, False]
    allocations = []

    def workspace(shape, device):
        allocations.append(shape)
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)

    monkeypatch.setattr(plans, "_workspace", workspace)
    monkeypatch.setattr(plans, "_PARTIALS", {})
    monkeypatch.setattr(plans, "_GET_DEVICE", lambda: 0)
    monkeypatch.setattr(plans, "_RAW_STREAM", lambda index: 0)
    monkeypatch.setattr(plans, "_IS_CAPTURING", lambda: False)
    monkeypatch.setattr(plan, "index", 0)
    for _ in range(2):
        got = _tail_backward(launch.backward, pack, tail, ratio, coff)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    (entry,) = plans._PARTIALS.values()
    assert len(allocations) == 1 and entry.tensor.numel() == allocations[0][0]
    (view,) = entry._views.values()
    assert view.data_ptr() % 16 == 0 and view.data_ptr() > entry.tensor.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_direct_launch_is_bound_and_equals_the_plain_launch():
    """After compile() every kernel launches directly, bitwise the results of Triton's own launch."""
    for ratio, coff, d in ((4, 2, 128), (128, 1, 128), (128, 2, 64)):
        pack = make_pack((300 * ratio // 4 + 3, 97), d, ratio, coff, token_padding=5, comp_padding=2, device=DEVICE)
        for direction in ("forward", "backward"):
            launch.compile(direction, ratio, coff, d, torch.bfloat16, DEVICE)
        stats = torch.empty((pack.total_comp, 3, d), device=DEVICE) if launch.supports_stats(ratio, coff, d) else None
        results = []
        for direct in (True, False):
            keys = [(ratio, coff, d, pack.kv.dtype, pack.kv.device, s) for s in (False, stats is not None)]
            bound = [launch._FORWARD[k].kernel for k in keys] + [launch._BACKWARD[k].kernel for k in keys]
            bound += [launch._BACKWARD[k].dape for k in keys]
            assert all(b.direct for b in bound) or not direct
            if not direct:
                for b in bound:
                    b.launch = b._plain
            out = torch.empty((pack.total_comp, d), dtype=pack.kv.dtype, device=DEVICE)
            launch.forward(*pack.inputs, out, ratio, coff, None, stats)
            grads = torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape)
            launch.backward(*pack.inputs, pack.grad_out, *grads, ratio, coff, None, stats)
            torch.cuda.synchronize()
            results.append((out, *grads))
            if not direct:
                for b in bound:
                    b.launch = b._first  # bind again on the next call
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------- host micro-benchmark (CPU)

CASES = [
    ("3x8192 d128 r4 c2", 3, 8192, 128, 4, 2, False),
    ("3x8192 d512 r128 c1", 3, 8192, 512, 128, 1, False),
    ("1x65536 d512 r128 c2 stats", 1, 65536, 512, 128, 2, True),
]


def _problem(n, seqlen, d, ratio, coff, stats):
    tokens, width, rows = n * seqlen, coff * d, n * seqlen // ratio
    kv = torch.empty(tokens, width, dtype=torch.bfloat16)
    cu = torch.arange(n + 1, dtype=torch.int32) * seqlen
    out = torch.empty(rows, d, dtype=torch.bfloat16)
    inputs = (kv, torch.empty_like(kv), torch.empty(ratio, width), cu, cu // ratio)
    grads = (torch.empty_like(kv), torch.empty_like(kv), torch.empty(ratio, width))
    return inputs, out, grads, torch.empty(rows, 3, d) if stats else None


def _us(fn, number=200) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=60)) / number * 1e6


def _mock_direct(plan) -> None:
    """Bind ``plan``'s kernels directly to a stand-in whose launcher does nothing."""
    plan.index = 0
    for name in ("kernel", "dape"):
        bound = getattr(plan, name, None)
        if bound is not None:
            jit = _FakeJIT([k for k in bound.consts if k[0].isupper()])
            jit.compiled._run = lambda *call: None
            mock = binding.BoundKernel(jit, bound.consts, 0)
            mock.launch(1, None, 0)
            assert mock.direct
            setattr(plan, name, mock)


def host_costs() -> list[dict]:
    """Per-call host microseconds of launch.forward / launch.backward (launcher mocked), and Triton's own binder's."""
    rows = []
    torch.cuda.current_device = lambda: 0  # the plan's current-device check, as on a one-GPU host
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    # A small allocation per backward, as the CUDA caching allocator serves it (a large CPU one would map pages).
    plans._workspace = lambda shape, device: torch.empty(16, device=device)
    for name, n, seqlen, d, ratio, coff, stats in CASES:
        inputs, out, grads, st = _problem(n, seqlen, d, ratio, coff, stats)
        key = (ratio, coff, d, out.dtype, out.device, stats)
        _mock_direct(launch._forward_plan(*key))
        _mock_direct(launch._backward_plan(*key))
        fwd = _us(lambda: launch.forward(*inputs, out, ratio, coff, None, st))  # noqa: B023
        bwd = _us(lambda: launch.backward(*inputs, out, *grads, ratio, coff, None, st))  # noqa: B023
        rows.append(dict(case=name, forward_us=fwd, backward_us=bwd, triton_bind_us=_triton_bind_us(inputs, out)))
    return rows


def _triton_bind_us(inputs, out) -> float:
    """Triton's per-launch Python work (binder, cache key) for the short-window forward, sm_90 target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    from csa_compressor.backends.triton import forward

    kernel = forward.csa_fwd_kernel
    if not hasattr(kernel, "signature"):
        return float("nan")  # interpreted: no binder
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    consts = dict(
        RATIO=4, SP=4, COFF=2, HEAD_DIM=128, BLOCK_R=1, BLOCK_D=128, VEC=4, N_COL=1, PRECISE_EXP=True,
        MANUAL_RTNE=False, TORCH_ORDER=True, num_warps=1, num_stages=1, enable_fp_fusion=False, debug=False,
        instrumentation_mode="",
    )  # fmt: skip
    args = (*inputs, out, out.shape[0], inputs[0].shape[0], 3, 2, 4)
    cache: dict = {}

    def bind():
        _bound, spec, options = binder(*args, **consts)
        compute_cache_key(cache, spec, options)

    return _us(bind, 500)


def main() -> None:
    calibration = _us(lambda: None, 100000)
    print(f"an empty Python call: {calibration:.3f} us (scale the figures below by the host's load)")
    for row in host_costs():
        print(
            f"{row['case']}: forward {row['forward_us']:.2f} us, backward {row['backward_us']:.2f} us per call; "
            f"Triton's own launch adds {row['triton_bind_us']:.2f} us per kernel launch"
        )


def _cpu_reason_interpreted(monkeypatch) -> str | None:
    """The triton backend's reason to refuse the CPU under TRITON_INTERPRET=1, the cached check recomputed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch.interpreter_unsupported_reason.cache_clear()
    try:
        return launch.device_unsupported_reason(torch.device("cpu"))
    finally:
        launch.interpreter_unsupported_reason.cache_clear()


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "refused"),
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.0", False), ("3.10.1", "2.5.0", False)],
)
def test_interpreters_that_cannot_run_the_kernels_are_refused(monkeypatch, triton_version, numpy_version, refused):
    """Triton 3.6's interpreter takes a runtime loop bound with int() of a one-element array, an error from NumPy
    2.4 on: the CPU is then unsupported, with the versions and the way out in the reason."""
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    reason = _cpu_reason_interpreted(monkeypatch)
    assert (reason is not None) == refused, reason
    if refused:
        assert triton_version in reason and numpy_version in reason and "triton >= 3.7" in reason


def test_an_interpreter_without_numpy_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    reason = _cpu_reason_interpreted(monkeypatch)
    assert reason is not None and "numpy" in reason


if __name__ == "__main__":
    main()
