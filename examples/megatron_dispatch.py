"""Megatron-LM's fused-compressor dispatch, served by csa_compressor.

Megatron-LM's ``Compressor._forward_thd`` asks ``maybe_compress_thd_fused(...)`` (in
``megatron/core/transformer/experimental_attention_variant/csa_utils/fused_compressor.py``) for the pooled
rows and keeps its eager region when the answer is ``None``. The function below has the same signature
and contract, so it can replace that one (or be called from it). Unlike a dispatch gated on compute
capability 10, it serves:

- sm_90 (Hopper) and sm_100 (Blackwell) with the ``cute`` kernels, other GPUs of compute capability 8.0
  or newer with ``triton``;
- deterministic mode (``torch.use_deterministic_algorithms(True)``): every output, ``grad_ape`` included,
  is bitwise reproducible, so there is nothing to fall back from;
- ``torch.compile`` (``fullgraph=True`` too): the pooling is a ``torch.library`` custom op.

    python examples/megatron_dispatch.py

checks it against the eager region on random packs, in deterministic mode and under ``torch.compile``. On
a machine without a GPU the Triton kernels run on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the CPU runs the kernels' logic

from csa_compressor import available_backends, compressor_pool, compute_cu_seqlens_comp, reference
from csa_compressor.testing import rel_l2

# The configurations the kernels are validated for (Megatron's Compressor makes (4, 2) and (128, 1)).
_RATIOS = frozenset({2, 4, 8, 128})
_INT32_LIMIT = 2**31


@torch.compiler.assume_constant_result
def _kernel_backend(device_type: str, index: int) -> str:
    """The fused backend for a device ("" for none): cute where it runs (sm_90, sm_100), else triton.

    Evaluated once per device while tracing, so ``torch.compile`` sees a constant.
    """
    device = torch.device(device_type, index) if device_type == "cuda" else torch.device(device_type)
    usable = available_backends(device)
    return next((name for name in ("cute", "triton") if name in usable), "")


def maybe_compress_thd_fused(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    total_comp: int,
    ratio: int,
    head_dim: int,
    coff: int,
    enabled: bool = True,
) -> torch.Tensor | None:
    """The pooled ``(total_comp, 1, head_dim)`` bf16 rows of ``kv``/``score`` ``(T, 1, coff*head_dim)``, or None
    when the caller should keep its eager region (disabled, no fused backend on the device, a configuration
    or dtype outside the validated envelope)."""
    if not enabled or ratio not in _RATIOS or coff not in (1, 2):
        return None
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != coff * head_dim or score.shape != kv.shape:
        return None
    if kv.dtype != torch.bfloat16 or score.dtype != torch.bfloat16 or ape.dtype != torch.float32:
        return None
    tokens = kv.shape[0]
    if total_comp <= 0 or tokens < ratio or tokens * coff * head_dim >= _INT32_LIMIT:
        return None
    backend = _kernel_backend(kv.device.type, kv.device.index if kv.device.index is not None else 0)
    if not backend:
        return None
    out = compressor_pool(
        kv.reshape(tokens, coff * head_dim).contiguous(),
        score.reshape(tokens, coff * head_dim).contiguous(),
        ape.contiguous(),
        cu_seqlens.to(torch.int32).contiguous(),
        cu_seqlens_comp.to(torch.int32).contiguous(),
        ratio=ratio,
        coff=coff,
        total_comp=int(total_comp),
        backend=backend,
    )
    return out.unsqueeze(1)


# ---------------------------------------------------------------- the checks


def _pack(seqlens, ratio, coff, head_dim, device, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens, width = sum(seqlens), coff * head_dim
    kv = torch.randn(tokens, 1, width, generator=gen).to(device, torch.bfloat16).requires_grad_()
    score = (2 * torch.randn(tokens, 1, width, generator=gen)).to(device, torch.bfloat16).requires_grad_()
    ape = (0.5 * torch.randn(ratio, width, generator=gen)).to(device).requires_grad_()
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return kv, score, ape, cu_seqlens, compute_cu_seqlens_comp(cu_seqlens, ratio)


def _fused_and_grads(args, grad, fn=maybe_compress_thd_fused):
    kv, score, ape = args[:3]
    out = fn(*args)
    assert out is not None, "the dispatch kept eager where it should serve"
    out.backward(grad)
    grads = [t.grad.clone() for t in (kv, score, ape)]
    for t in (kv, score, ape):
        t.grad = None
    return out.detach(), grads


def check_against_eager(ratio, coff, head_dim, seqlens, device) -> None:
    kv, score, ape, cu_seqlens, cu_seqlens_comp = _pack(seqlens, ratio, coff, head_dim, device, seed=ratio)
    total_comp = sum(s // ratio for s in seqlens)
    args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, ratio, head_dim, coff)
    grad = torch.randn(total_comp, 1, head_dim, device=device).to(torch.bfloat16)
    fused, (d_kv, d_score, d_ape) = _fused_and_grads(args, grad)

    # The eager region Megatron-LM keeps otherwise (softmax in fp32, products and sum in bf16), and autograd of it.
    flat = (kv.reshape(kv.shape[0], -1), score.reshape(kv.shape[0], -1), ape, cu_seqlens, cu_seqlens_comp)
    eager = reference.eager_region(*flat, ratio=ratio, coff=coff, total_comp=total_comp)
    e_kv, e_score, e_ape = torch.autograd.grad(eager, (kv, score, ape), grad.squeeze(1))
    oracle = reference.forward(
        *(t.detach() for t in flat), ratio=ratio, coff=coff, total_comp=total_comp, precision="fp64"
    )

    assert fused.shape == (total_comp, 1, head_dim) and fused.dtype == torch.bfloat16
    fused_err = (fused.squeeze(1).double() - oracle).abs().max().item()
    eager_err = (eager.detach().double() - oracle).abs().max().item()
    assert fused_err <= eager_err, (fused_err, eager_err)  # fp32 with one rounding: at least as accurate
    for name, got, want in (("grad_kv", d_kv, e_kv), ("grad_score", d_score, e_score), ("grad_ape", d_ape, e_ape)):
        assert rel_l2(got, want) < 1e-2, (name, rel_l2(got, want))
    print(
        f"  ratio {ratio:3d} coff {coff} head_dim {head_dim}: max error vs fp64 {fused_err:.2e} "
        f"(eager region {eager_err:.2e}); gradients within {max(rel_l2(d_kv, e_kv), rel_l2(d_ape, e_ape)):.1e}"
    )


def check_deterministic_mode(device) -> None:
    args5 = _pack((67, 40), 4, 2, 64, device, seed=7)
    args = (*args5, 26, 4, 64, 2)
    grad = torch.randn(26, 1, 64, device=device).to(torch.bfloat16)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, grads1 = _fused_and_grads(args, grad)
        second, grads2 = _fused_and_grads(args, grad)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(first, second) and all(torch.equal(a, b) for a, b in zip(grads1, grads2, strict=True))
    print("  deterministic mode: served, forward and gradients bitwise equal run to run")


def check_torch_compile(device) -> None:
    args5 = _pack((45, 20), 4, 2, 32, device, seed=11)
    args = (*args5, 16, 4, 32, 2)
    grad = torch.randn(16, 1, 32, device=device).to(torch.bfloat16)
    # The CPU run checks tracing (fullgraph) without Inductor's C++ build; a GPU compiles with Inductor.
    compiled = torch.compile(
        maybe_compress_thd_fused, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager"
    )
    out, grads = _fused_and_grads(args, grad, compiled)
    ref_out, ref_grads = _fused_and_grads(args, grad)
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    print("  torch.compile(fullgraph=True): served, bitwise equal to the eager call")


def check_gates(device) -> None:
    kv, score, ape, cu_seqlens, cu_seqlens_comp = _pack((16,), 4, 2, 32, device, seed=3)
    args = [kv, score, ape, cu_seqlens, cu_seqlens_comp, 4, 4, 32, 2]
    assert maybe_compress_thd_fused(*args, enabled=False) is None
    assert maybe_compress_thd_fused(kv.float(), score.float(), *args[2:]) is None  # fp32 activations: eager
    assert maybe_compress_thd_fused(*args[:6], 3, 32, 2) is None  # a ratio outside the validated set
    print("  gates: disabled, fp32 activations and unvalidated ratios keep eager")


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = _kernel_backend(device.type, 0)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"maybe_compress_thd_fused on {where}: backend {backend or 'none (eager)'}")
    if not backend:
        print("no fused backend on this device: Megatron-LM keeps its eager region")
        return 0
    big = device.type == "cuda"
    check_against_eager(4, 2, 512 if big else 64, (8192, 8190, 3) if big else (67, 3, 30), device)
    check_against_eager(128, 1, 512 if big else 16, (8192, 300) if big else (300, 130), device)
    check_deterministic_mode(device)
    check_torch_compile(device)
    check_gates(device)
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
