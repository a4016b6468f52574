"""Triton kernels on malformed inputs: ``total_comp`` below the real row count (gradients equal autograd of the
truncated reference, every kernel family), and malformed offsets in a subprocess, every operand between NaN
canary rows (a read outside shows as non-finite output, a write outside as a changed canary).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from .common import DEVICE, HAS_CUDA, ROOT, child_env, triton_skip
from .common import nan as _nan

pytestmark = triton_skip()

from csa_compressor import reference, testing  # noqa: E402
from csa_compressor.backends.triton import launch  # noqa: E402
from csa_compressor.thd import compute_cu_seqlens_comp  # noqa: E402


def _autograd_truncated(pack: testing.Pack, rows: int, precision: str):
    """Gradients of ``sum(eager(pack)[:rows] * grad_out[:rows])`` by autograd of the reference forward."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (pack.kv, pack.score, pack.ape)]
    kw = dict(ratio=pack.ratio, coff=pack.coff, total_comp=pack.true_comp, precision=precision)
    out = reference.forward(*leaves, pack.cu_seqlens, pack.cu_seqlens_comp, **kw)[:rows]
    return torch.autograd.grad(out, leaves, pack.grad_out[:rows].to(out.dtype))


def _assert_matches_autograd(tpack: testing.Pack, grads) -> None:
    """Kernel gradients vs autograd of the truncated eager region, with the SPEC section 3 tolerances."""
    rows = tpack.total_comp
    g32 = _autograd_truncated(tpack, rows, "fp32")
    g64 = _autograd_truncated(tpack, rows, "fp64")
    _out_scale, score_scale, consumed = testing._cancellation_scales(tpack)
    assert int(testing.bf16_ulp_distance(grads[0], g32[0]).max()) <= 1
    assert testing._beyond(grads[1], g32[1], score_scale, 1)[1] == 0
    unconsumed = ~consumed.to(grads[0].device)
    for got, want in zip(grads[:2], g32[:2], strict=True):
        assert not bool(want[unconsumed].any()), "autograd consumed a position the reference says is unconsumed"
        assert not bool(got.view(torch.int16)[unconsumed].any()), "an unconsumed position is not an exact +0"
    assert testing.rel_l2(grads[2], g64[2]) <= 1e-5


# (seqlens, head_dim, ratio, coff): short windows, long ones, and windows with softmax statistics.
TRUNCATED = [
    ((13, 8, 0, 3, 21), 7, 4, 2),
    ((9, 4, 0, 11), 5, 2, 1),
    ((300, 260), 3, 128, 2),
    ((260, 5, 140), 3, 128, 1),
    ((40, 5, 0, 33, 16), 8, 16, 2),
    ((52, 10, 0, 40), 9, 17, 1),
]


def _cuts(pack: testing.Pack) -> list[int]:
    """total_comp one row short, and at the start of the last segment with rows."""
    starts = [int(c) for c in pack.cu_seqlens_comp[:-1].tolist()]
    last_start = max(s for s, n in zip(starts, [s // pack.ratio for s in pack.seqlens], strict=True) if n > 0)
    return sorted({pack.true_comp - 1, max(1, last_start)})


@pytest.mark.parametrize("case", TRUNCATED, ids=[f"r{c[2]}c{c[3]}d{c[1]}" for c in TRUNCATED])
def test_undersized_total_comp_matches_truncated_autograd(case):
    seqlens, head_dim, ratio, coff = case
    pack = testing.make_pack(seqlens, head_dim, ratio, coff, token_padding=3, device=DEVICE, seed=ratio + coff)
    stats_too = launch.supports_stats(ratio, coff, head_dim)
    for rows in _cuts(pack):
        assert 0 < rows < pack.true_comp
        tpack = dataclasses.replace(pack, total_comp=rows, grad_out=pack.grad_out[:rows].contiguous())
        out = _nan((rows, head_dim), pack.kv.dtype)
        stats = _nan((rows, 3, head_dim), torch.float32) if stats_too else None
        launch.forward(*pack.inputs, out, ratio, coff, None, stats)
        testing.assert_contract(tpack, out=out)
        for saved in (None, stats) if stats_too else (None,):
            grads = tuple(_nan(t.shape, t.dtype) for t in (pack.kv, pack.score, pack.ape))
            launch.backward(*pack.inputs, tpack.grad_out, *grads, ratio, coff, None, saved)
            _assert_matches_autograd(tpack, grads)


# --------------------------------------------------------------------------- malformed offsets, in a subprocess

CANARY = 3  # NaN rows before and after every operand

# name -> (cu_seqlens, cu_seqlens_comp, total_comp) for T = 44 tokens at ratio 4 (scaled in _malformed); None:
# computed from cu_seqlens.
MALFORMED = {
    "beyond_T": ([0, 16, 80], None, 20),
    "comp_over_count": ([0, 16, 32], [0, 9, 20], 21),
    "decreasing": ([0, 24, 8, 36], [0, 6, 2, 9], 9),
    "negative": ([0, -12, 20], [0, -3, 5], 6),
    "comp_start_not_zero": ([0, 16, 40], [3, 7, 13], 12),
    "int32_wrap": ([0, 2**31 - 5, 2**31 - 1], [0, 2**29, 2**30], 7),
    "int32_min": ([0, -(2**31), 2**31 - 1], [0, -(2**31), 2**31 - 1], 5),
    "undersized_and_beyond": ([0, 28, 120], None, 9),
    "start_past_T": ([50, 60, 70], [0, 2, 4], 4),
}
# (ratio, coff, head_dim) -> the cases run: every case at coff 2, a subset at coff 1 (same guards); long-window packs
# keep at most LONG_ROWS rows (the interpreter's cost).
MALFORMED_CONFIGS = {
    (4, 2, 8): tuple(MALFORMED),
    (2, 1, 5): ("beyond_T", "negative", "int32_wrap", "int32_min", "start_past_T"),
    (16, 2, 4): tuple(MALFORMED),
    (17, 1, 3): ("decreasing", "negative", "int32_wrap", "start_past_T"),
}
LONG_ROWS = 8


def _in_canaries(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s values as a contiguous view into a buffer with ``CANARY`` NaN rows on either side: (view, buffer)."""
    flat = t.reshape(t.shape[0], -1)
    buf = torch.full((flat.shape[0] + 2 * CANARY, flat.shape[1]), float("nan"), dtype=t.dtype, device=t.device)
    buf[CANARY : CANARY + flat.shape[0]] = flat
    return buf[CANARY : CANARY + flat.shape[0]].view(t.shape), buf


def _canaries_intact(buf: torch.Tensor) -> bool:
    return bool(torch.isnan(buf[:CANARY]).all()) and bool(torch.isnan(buf[-CANARY:]).all())


def _malformed(name: str, ratio: int, coff: int, head_dim: int, device="cpu") -> dict:
    """Forward (with statistics where the window has them) and backward (with and without) on one malformed pack."""
    cu, cu_comp, rows = MALFORMED[name]
    scale = ratio // 4 if ratio > 4 else 1
    if launch.supports_stats(ratio, coff, head_dim):
        rows = min(rows, LONG_ROWS)
    big = [v * scale if abs(v) < 2**20 else v for v in cu]
    tokens = 44 * scale
    gen = torch.Generator().manual_seed(len(name))
    width = coff * head_dim

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    kv, kv_buf = _in_canaries(randn(tokens, width))
    score, score_buf = _in_canaries(randn(tokens, width))
    ape = randn(ratio, width, dtype=torch.float32)
    cu_t = torch.tensor(big, dtype=torch.int32)
    cu_comp_t = compute_cu_seqlens_comp(cu_t, ratio) if cu_comp is None else torch.tensor(cu_comp, dtype=torch.int32)
    cu_t, cu_comp_t = cu_t.to(device), cu_comp_t.to(device)
    grad_out = randn(rows, head_dim)
    inputs = (kv, score, ape, cu_t, cu_comp_t)
    stats_too = launch.supports_stats(ratio, coff, head_dim)
    out, out_buf = _in_canaries(torch.zeros(rows, head_dim, dtype=torch.bfloat16, device=device))
    stats = torch.zeros(rows, 3, head_dim, device=device) if stats_too else None
    if stats_too:
        stats, stats_buf = _in_canaries(stats)
    launch.forward(*inputs, out, ratio, coff, None, stats)
    result = {"out_finite": bool(torch.isfinite(out).all()), "canaries": _canaries_intact(out_buf)}
    if stats_too:
        result["stats_finite"] = bool(torch.isfinite(stats).all())
        result["canaries"] &= _canaries_intact(stats_buf)
    grads_finite = True
    for saved in (None, stats) if stats_too else (None,):
        gkv, gkv_buf = _in_canaries(torch.zeros_like(kv))
        gsc, gsc_buf = _in_canaries(torch.zeros_like(score))
        gape = torch.zeros_like(ape)
        launch.backward(*inputs, grad_out, gkv, gsc, gape, ratio, coff, None, saved)
        grads_finite &= all(bool(torch.isfinite(g).all()) for g in (gkv, gsc, gape))
        result["canaries"] &= _canaries_intact(gkv_buf) and _canaries_intact(gsc_buf)
    result["grads_finite"] = grads_finite
    result["canaries"] &= _canaries_intact(kv_buf) and _canaries_intact(score_buf)
    return result


class _AccessChecker:
    """Checks every masked-in access of the interpreter against the launch's tensors; an outside access is recorded, not done."""

    def __init__(self):
        import numpy as np
        from triton.runtime import interpreter

        self.np, self.interp = np, interpreter
        self.ranges: list[tuple[int, int]] = []
        self.violations: list[str] = []

    def __enter__(self):
        interp, checker = self.interp, self
        self.saved = (interp.GridExecutor.__call__, interp.InterpreterBuilder.create_masked_load,
                      interp.InterpreterBuilder.create_masked_store)  # fmt: skip
        call, load, store = self.saved

        def grid_call(executor, *args, **kwargs):
            checker.ranges = [
                (a.data_ptr(), a.data_ptr() + a.numel() * a.element_size())
                for a in (*args, *kwargs.values())
                if isinstance(a, torch.Tensor)
            ]
            return call(executor, *args, **kwargs)

        def masked_load(builder, ptrs, mask, other, cache_policy, is_volatile):
            size = self.np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
            return load(builder, ptrs, checker.keep(ptrs, mask, size, "load"), other, cache_policy, is_volatile)

        def masked_store(builder, ptrs, value, mask, cache_policy):
            size = value.data.dtype.itemsize
            return store(builder, ptrs, value, checker.keep(ptrs, mask, size, "store"), cache_policy)

        interp.GridExecutor.__call__ = grid_call
        interp.InterpreterBuilder.create_masked_load = masked_load
        interp.InterpreterBuilder.create_masked_store = masked_store
        return self

    def __exit__(self, *exc):
        interp = self.interp
        (interp.GridExecutor.__call__, interp.InterpreterBuilder.create_masked_load,
         interp.InterpreterBuilder.create_masked_store) = self.saved  # fmt: skip

    def keep(self, ptrs, mask, size, kind):
        np = self.np
        addr = np.broadcast_to(ptrs.data, mask.data.shape).astype(np.uint64)
        inside = np.zeros(mask.data.shape, dtype=bool)
        for lo, hi in self.ranges:
            inside |= (addr >= lo) & (addr + size <= hi)
        bad = mask.data & ~inside
        if bad.any():
            self.violations.append(f"{kind} of {int(bad.sum())} elements outside the operands")
            mask = type(mask)(mask.data & inside, mask.dtype)
        return mask


def _child(device: str) -> int:
    """Every malformed case on ``device``, one JSON line each; returns the number of cases with a finding."""
    checker = _AccessChecker() if device == "cpu" else contextlib.nullcontext()
    bad = 0
    with checker:
        for (ratio, coff, head_dim), names in MALFORMED_CONFIGS.items():
            for name in names:
                if device == "cpu":
                    checker.violations = []
                result = _malformed(name, ratio, coff, head_dim, device)
                if device == "cpu":
                    result["inside"] = not checker.violations
                    result["oob"] = checker.violations[:3]
                bad += not all(v for k, v in result.items() if k != "oob")
                print(json.dumps({"case": f"{name}-r{ratio}c{coff}d{head_dim}", **result}), flush=True)
    return bad


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's accesses are host memory; on the GPU use compute-sanitizer")
def test_malformed_offsets_stay_inside_the_operands():
    env = child_env(TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.backends.test_triton_safety"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in results if not all(v for k, v in r.items() if k not in ("case", "oob"))]
    assert not bad, bad
    expected = sum(len(names) for names in MALFORMED_CONFIGS.values())
    assert proc.returncode == 0 and len(results) == expected, (
        f"the child crashed ({proc.returncode}) after {len(results)} of {expected} cases: {proc.stderr[-3000:]}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_malformed_offsets_keep_the_canaries():
    """The malformed cases natively on the GPU: finite results, canaries intact."""
    for (ratio, coff, head_dim), names in MALFORMED_CONFIGS.items():
        for name in names:
            result = _malformed(name, ratio, coff, head_dim, "cuda")
            assert all(result.values()), (name, ratio, coff, head_dim, result)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run the malformed-offset cases; exit status 1 on a finding.")
    parser.add_argument("--device", default="cpu", help="cpu (the interpreter, with the access checker) or cuda")
    sys.exit(1 if _child(parser.parse_args().device) else 0)
