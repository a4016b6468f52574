"""check_support: one test per SPEC section 4 bound; each error names the bound and the offending value."""

import pytest
import torch

from csa_compressor import CSACompressorBackward, CSACompressorForward, dispatch
from csa_compressor.testing import make_pack


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


def test_rejects_token_offset_overflow():
    width = 2 * 4096
    tokens = 2**31 // width
    meta = dict(device="meta")
    args = [
        torch.empty(tokens, width, dtype=torch.bfloat16, **meta),
        torch.empty(tokens, width, dtype=torch.bfloat16, **meta),
        torch.empty(4, width, **meta),
        torch.empty(2, dtype=torch.int32, **meta),
        torch.empty(2, dtype=torch.int32, **meta),
        torch.empty(1, 4096, dtype=torch.bfloat16, **meta),
    ]
    _check(args, r"T \* coff \* head_dim < 2\*\*31.*262144 \* 8192")


def test_rejects_row_offset_overflow():
    meta = dict(device="meta")
    args = [
        torch.empty(16, 1024, dtype=torch.bfloat16, **meta),
        torch.empty(16, 1024, dtype=torch.bfloat16, **meta),
        torch.empty(4, 1024, **meta),
        torch.empty(2, dtype=torch.int32, **meta),
        torch.empty(2, dtype=torch.int32, **meta),
        torch.empty(2**22, 512, dtype=torch.bfloat16, **meta),
    ]
    _check(args, r"total_comp \* head_dim < 2\*\*31.*4194304 \* 512")


def test_rejects_rows_without_enough_tokens():
    args, _ = _fwd_args(seqlens=(3,))
    args[5] = torch.empty(1, 8, dtype=torch.bfloat16)  # a padding row needs tokens 0..ratio-1
    _check(args, "total_comp > 0 needs T >= ratio.*total_comp=1, T=3, ratio=4")


def test_rejects_non_contiguous():
    args, _ = _fwd_args()
    args[0] = torch.empty(16, args[0].shape[0], dtype=torch.bfloat16).t()
    _check(args, "kv must be contiguous")


def test_rejects_misaligned():
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

        assert cute._arch_of((9, 0)) == "sm_90a" and cute._arch_of((10, 0)) == "sm_100a"
        assert cute._arch_of((8, 0)) is None and cute._arch_of((9, 1)) is None
        assert cute.device_unsupported_reason(torch.device("cuda")) is None  # the H200 here
    if dispatch.unavailable_reason("triton") is None:
        from csa_compressor.backends.triton import launch as triton_launch

        monkeypatch.setattr(triton_launch, "_capability", lambda index: (7, 5))
        assert ">= 8.0" in triton_launch.device_unsupported_reason(torch.device("cuda"))
