"""check_support: one test per SPEC section 4 bound; each error names the bound and the offending value."""

import pytest
import torch

from csa_compressor import CSACompressorBackward, CSACompressorForward, dispatch
from csa_compressor.testing import make_pack, misaligned_copy


def _fwd_args(ratio=4, coff=2, head_dim=8, seqlens=(12, 5), device="cpu"):
    p = make_pack(seqlens, head_dim, ratio, coff, device=device)
    out = torch.empty(p.total_comp, head_dim, dtype=torch.bfloat16, device=device)
    return [*p.inputs, out], p


def _check(args, match, error=ValueError, **kw):
    kw.setdefault("ratio", 4)
    kw.setdefault("coff", 2)
    kw.setdefault("backend", "reference")
    with pytest.raises(error, match=match):
        CSACompressorForward(*args, **kw).check_support()


def test_accepts_a_valid_pack():
    args, _ = _fwd_args()
    assert CSACompressorForward(*args, ratio=4, coff=2, backend="reference").check_support()


def test_accepts_meta_samples():
    args, _ = _fwd_args()
    meta = [a.to("meta") for a in args]
    assert CSACompressorForward(*meta, ratio=4, coff=2, backend="reference").check_support()


@pytest.mark.parametrize("ratio", [0, 257, 4.0])
def test_rejects_ratio(ratio):
    args, _ = _fwd_args()
    _check(args, r"ratio must be an int in \[1, 256\].*" + str(ratio), ratio=ratio)


def test_rejects_coff():
    args, _ = _fwd_args()
    _check(args, "coff must be 1 or 2.*coff=3", coff=3)


def test_rejects_kv_rank():
    args, _ = _fwd_args()
    args[0] = args[0][:, None]
    _check(args, r"kv must have rank 2.*\(17, 1, 16\)")


def test_rejects_kv_dtype():
    args, _ = _fwd_args()
    args[0] = args[0].float()
    _check(args, "kv dtype must be one of.*float32")


def test_rejects_score_shape():
    args, _ = _fwd_args()
    args[1] = args[1][:-1]
    _check(args, r"score shape must be \(17, 16\).*\(16, 16\)")


def test_rejects_ape_shape_and_dtype():
    args, _ = _fwd_args()
    bad = list(args)
    bad[2] = args[2][:3]
    _check(bad, r"ape shape must be \(4, 16\).*\(3, 16\)")
    bad[2] = args[2].to(torch.bfloat16)
    _check(bad, "ape dtype must be torch.float32.*bfloat16")


def test_rejects_cu_seqlens_too_short():
    args, _ = _fwd_args()
    args[3], args[4] = args[3][:1], args[4][:1]
    _check(args, r"cu_seqlens must have at least 2 entries.*\(1,\)")


def test_rejects_cu_seqlens_shape_mismatch():
    args, _ = _fwd_args()
    args[4] = torch.zeros(5, dtype=torch.int32)
    _check(args, r"cu_seqlens_comp shape must equal cu_seqlens shape.*\(5,\) vs \(3,\)")


def test_rejects_cu_seqlens_dtype():
    args, _ = _fwd_args()
    args[3] = args[3].long()
    _check(args, "cu_seqlens dtype must be torch.int32.*int64")


def test_rejects_head_dim_mismatch():
    args, _ = _fwd_args()
    _check(args, r"kv.shape\[1\] must be coff \* head_dim.*16 != 2 \* 5", head_dim=5)


def test_rejects_out_shape():
    args, _ = _fwd_args()
    args[5] = torch.empty(args[5].shape[0], 7, dtype=torch.bfloat16)
    _check(args, r"out.shape\[1\] must be head_dim=8.*\(4, 7\)")


@pytest.mark.parametrize(
    ("tokens", "width", "rows", "head_dim", "match"),
    [
        (2**31 // 8192, 8192, 1, 4096, r"T \* coff \* head_dim < 2\*\*31.*262144 \* 8192"),
        (16, 1024, 2**22, 512, r"total_comp \* head_dim < 2\*\*31.*4194304 \* 512"),
    ],
    ids=["token-offset", "row-offset"],
)
def test_rejects_offset_overflow(tokens, width, rows, head_dim, match):
    meta = dict(device="meta")
    args = [
        torch.empty(tokens, width, dtype=torch.bfloat16, **meta),
        torch.empty(tokens, width, dtype=torch.bfloat16, **meta),
        torch.empty(4, width, **meta),
        torch.empty(2, dtype=torch.int32, **meta),
        torch.empty(2, dtype=torch.int32, **meta),
        torch.empty(rows, head_dim, dtype=torch.bfloat16, **meta),
    ]
    _check(args, match)


def test_rejects_rows_without_enough_tokens():
    args, _ = _fwd_args(seqlens=(3,))
    args[5] = torch.empty(1, 8, dtype=torch.bfloat16)  # a padding row needs tokens 0..ratio-1
    _check(args, "total_comp > 0 needs T >= ratio.*total_comp=1, T=3, ratio=4")


def test_rejects_non_contiguous():
    args, _ = _fwd_args()
    args[0] = torch.empty(16, args[0].shape[0], dtype=torch.bfloat16).t()
    _check(args, "kv must be contiguous")


def test_rejectsmisaligned_copy():
    args, _ = _fwd_args()
    storage = torch.empty(args[0].numel() + 1, dtype=torch.bfloat16)
    args[0] = storage[1:].view(args[0].shape)
    _check(args, "kv must be 16-byte aligned.*= 2")


def test_rejects_mixed_devices():
    args, _ = _fwd_args()
    args[2] = args[2].to("meta")
    _check(args, "all tensors must be on one device")


def test_rejects_host_tensors_for_gpu_backend(monkeypatch):
    if dispatch.unavailable_reason("triton"):
        pytest.skip("the triton backend is not installed here")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args, _ = _fwd_args()
    _check(args, "backend 'triton' cannot run on cpu tensors", backend="triton")


def test_unknown_backend_names_installed():
    args, _ = _fwd_args()
    _check(args, "unknown backend 'cudnn'.*installed backends: .*reference", backend="cudnn")


def test_env_var_selects_backend(monkeypatch):
    args, _ = _fwd_args()
    monkeypatch.setenv(dispatch.ENV_VAR, "nonsense")
    _check(args, f"unknown backend 'nonsense' \\(from {dispatch.ENV_VAR}\\)", backend="auto")
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    op = CSACompressorForward(*args, ratio=4, coff=2)
    op.check_support()
    assert op.backend == "reference"


def test_unavailable_backend_names_installed(monkeypatch):
    real_load = dispatch._load
    monkeypatch.setattr(
        dispatch, "_load", lambda name: (None, "cute is not installed") if name == "cute" else real_load(name)
    )
    args, _ = _fwd_args()
    _check(
        args,
        "backend 'cute' is unavailable \\(cute is not installed\\); installed backends: ",
        RuntimeError,
        backend="cute",
    )


def test_backward_rejects_grad_buffers():
    _, p = _fwd_args()
    grads = [torch.empty_like(p.kv), torch.empty_like(p.score), torch.empty_like(p.ape)]
    base = [*p.inputs, p.grad_out]
    assert CSACompressorBackward(*base, *grads, ratio=4, coff=2, backend="reference").check_support()
    bad = [grads[0][:-1], grads[1], grads[2]]
    with pytest.raises(ValueError, match=r"grad_kv shape must be \(17, 16\)"):
        CSACompressorBackward(*base, *bad, ratio=4, coff=2, backend="reference").check_support()
    bad = [grads[0], grads[1], grads[2].double()]
    with pytest.raises(ValueError, match=r"grad_ape dtype must be torch\.float32"):
        CSACompressorBackward(*base, *bad, ratio=4, coff=2, backend="reference").check_support()
    with pytest.raises(ValueError, match=r"grad_out.shape\[1\] must be head_dim=8"):
        CSACompressorBackward(
            *p.inputs, p.grad_out[:, :4].contiguous(), *grads, ratio=4, coff=2, backend="reference"
        ).check_support()


def test_execute_rechecks_per_call_tensors():
    args, _ = _fwd_args()
    op = CSACompressorForward(*args, ratio=4, coff=2, backend="reference")
    op.compile()
    with pytest.raises(ValueError, match="kv must be contiguous"):
        bad = list(args)
        bad[0] = torch.empty(16, args[0].shape[0], dtype=torch.bfloat16).t()
        op.execute(*bad)
    with pytest.raises(ValueError, match="execute\\(\\) tensors must match the configuration"):
        other, _ = _fwd_args(head_dim=4)
        op.execute(*other)


def test_unsupported_gpu_is_a_runtime_error(monkeypatch):
    """Dispatch turns a backend's "cannot run on this GPU" into RuntimeError (host tensors: ValueError)."""

    class OldGpuOnly:
        @staticmethod
        def device_unsupported_reason(device):
            return "needs compute capability >= 9.0, this GPU has 7.5"

    monkeypatch.setattr(dispatch, "_load", lambda name: (OldGpuOnly, None))
    with pytest.raises(RuntimeError, match="backend 'cute' cannot run on cuda:0 tensors: needs compute capability"):
        dispatch.resolve_backend("cute", torch.device("cuda:0"), 4, 2, 128)
    with pytest.raises(ValueError, match="backend 'cute' cannot run on cpu tensors"):
        dispatch.resolve_backend("cute", torch.device("cpu"), 4, 2, 128)


@pytest.mark.gpu
def test_backends_name_the_architectures_they_reject(monkeypatch):
    if dispatch.unavailable_reason("cute") is None:
        from csa_compressor.backends.cute import launch as cute

        assert cute.arch_of((9, 0)) == "sm_90a" and cute.arch_of((10, 0)) == "sm_100a"
        assert cute.arch_of((8, 0)) is None and cute.arch_of((9, 1)) is None
        assert cute.device_unsupported_reason(torch.device("cuda")) is None  # the H200 here
    if dispatch.unavailable_reason("triton") is None:
        from csa_compressor.backends.triton import launch as triton_launch

        monkeypatch.setattr(triton_launch, "_capability", lambda index: (7, 5))
        assert ">= 8.0" in triton_launch.device_unsupported_reason(torch.device("cuda"))


# ------------------------------------------------------------------- per-call fast paths keep every check


def _wrapper_pack():
    return _fwd_args()[1]


def _warm(p):
    from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper

    kw = dict(ratio=4, coff=2, backend="reference")
    csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **kw)
    csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **kw)
    return kw


@pytest.mark.parametrize(
    "index,bad,match",
    [
        (0, lambda t: t.float(), "kv dtype must be one of.*float32"),
        (1, lambda t: t.float(), "score dtype must be torch.bfloat16.*float32"),
        (1, lambda t: t[:-1], r"score shape must be \(17, 16\).*\(16, 16\)"),
        (1, lambda t: torch.empty(16, t.shape[0], dtype=t.dtype).t(), "score must be contiguous"),
        (2, misaligned_copy, "ape must be 16-byte aligned"),
        (2, lambda t: t.to("meta"), "all tensors must be on one device"),
        (3, lambda t: t.long(), "cu_seqlens dtype must be torch.int32"),
        (4, lambda t: torch.zeros(5, dtype=torch.int32), r"cu_seqlens_comp shape must equal cu_seqlens shape"),
    ],
)
def test_wrapper_cache_hit_still_rejects_bad_tensors(index, bad, match):
    """After a first call has cached the op, a bad tensor gets the same error as check_support gives."""
    from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper

    p = _wrapper_pack()
    kw = _warm(p)
    args = list(p.inputs)
    args[index] = bad(args[index])
    with pytest.raises(ValueError, match=match):
        csa_compressor_forward_wrapper(*args, total_comp=p.total_comp, **kw)
    with pytest.raises(ValueError, match=match):
        csa_compressor_backward_wrapper(*args, p.grad_out, **kw)


def test_wrapper_cache_hit_still_checks_rows_and_grad_out():
    from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper

    p = _wrapper_pack()
    kw = _warm(p)
    with pytest.raises(ValueError, match=r"total_comp \* head_dim < 2\*\*31"):
        csa_compressor_forward_wrapper(*p.inputs, total_comp=2**28, **kw)
    short = make_pack((3,), 8, 4, 2)
    with pytest.raises(ValueError, match="total_comp > 0 needs T >= ratio"):
        csa_compressor_forward_wrapper(*short.inputs, total_comp=1, **kw)
    with pytest.raises(ValueError, match=r"grad_out.shape\[1\] must be head_dim=8"):
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out[:, :4].contiguous(), **kw)
    with pytest.raises(ValueError, match=r"grad_out dtype must be torch\.bfloat16"):
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out.float(), **kw)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(ratio=4.0), r"ratio must be an int in \[1, 256\].*4\.0"),
        (dict(coff=True), "coff must be 1 or 2.*coff=True"),
        (dict(backend="cudnn"), "unknown backend 'cudnn'"),
    ],
)
def test_wrapper_cache_hit_still_validates_arguments(kw, match):
    """4.0 == 4 and True == 1 as dict keys: the fast cache must not let them through."""
    from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper

    p = make_pack((12, 5), 8, 4, 1)
    base = dict(ratio=4, coff=1, backend="reference")
    csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **base)
    csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **base)
    with pytest.raises(ValueError, match=match):
        csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **{**base, **kw})
    with pytest.raises(ValueError, match=match):
        csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **{**base, **kw})


def test_wrapper_sees_env_var_changes(monkeypatch):
    from csa_compressor import csa_compressor_forward_wrapper

    p = _wrapper_pack()
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    csa_compressor_forward_wrapper(*p.inputs, ratio=4, coff=2, total_comp=p.total_comp)
    monkeypatch.setenv(dispatch.ENV_VAR, "nonsense")
    with pytest.raises(ValueError, match=f"unknown backend 'nonsense' \\(from {dispatch.ENV_VAR}\\)"):
        csa_compressor_forward_wrapper(*p.inputs, ratio=4, coff=2, total_comp=p.total_comp)
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert dispatch.env_token() is None


def test_wrapper_head_dim_from_a_new_width():
    """head_dim=None is derived per call: a second width gets its own op, not a mismatch error."""
    from csa_compressor import csa_compressor_forward_wrapper

    for head_dim in (8, 4, 8):
        p = make_pack((12, 5), head_dim, 4, 2)
        (out,) = csa_compressor_forward_wrapper(
            *p.inputs, ratio=4, coff=2, total_comp=p.total_comp, backend="reference"
        )
        assert out.shape == (p.total_comp, head_dim)


def test_execute_after_compile_rechecks_out_and_grad_buffers():
    """The class API's buffers are the caller's: execute reads all of them on every call."""
    args, p = _fwd_args()
    op = CSACompressorForward(*args, ratio=4, coff=2, backend="reference")
    op.compile()
    op.execute(*args)
    bad = list(args)
    bad[5] = args[5].float()
    with pytest.raises(ValueError, match=r"out dtype must be torch\.bfloat16"):
        op.execute(*bad)
    bad[5] = misaligned_copy(args[5])
    with pytest.raises(ValueError, match="out must be 16-byte aligned"):
        op.execute(*bad)
    grads = [torch.empty_like(p.kv), torch.empty_like(p.score), torch.empty_like(p.ape)]
    bwd = CSACompressorBackward(*p.inputs, p.grad_out, *grads, ratio=4, coff=2, backend="reference")
    bwd.compile()
    bwd.execute(*p.inputs, p.grad_out, *grads)
    for i, (bad_grad, match) in enumerate(
        [
            (grads[0][:-1], r"grad_kv shape must be \(17, 16\)"),
            (torch.empty(16, 17, dtype=torch.bfloat16).t(), "grad_score must be contiguous"),
            (grads[2].double(), r"grad_ape dtype must be torch\.float32"),
        ]
    ):
        bad_grads = list(grads)
        bad_grads[i] = bad_grad
        with pytest.raises(ValueError, match=match):
            bwd.execute(*p.inputs, p.grad_out, *bad_grads)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        bwd.execute(*p.inputs, p.grad_out, grads[0], grads[1], grads[2].to("meta"))


def test_compile_binds_the_fast_path_once():
    args, _ = _fwd_args()
    op = CSACompressorForward(*args, ratio=4, coff=2, backend="reference")
    assert op._launch is None
    op.execute(*args)  # compiles on first use
    assert op._launch is dispatch.backend_module("reference").forward
    assert (op._ratio, op._coff, op._head_dim) == (4, 2, 8)
