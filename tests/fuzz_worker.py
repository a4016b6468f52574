"""Runs fuzz cases (tests/test_fuzz.py) on one backend in a process of its own, so that a crash is a failure.

    python tests/fuzz_worker.py --backend reference [--device cpu] < cases.json

Per case: ``BEGIN <i>``, then ``{"case": i, "failures": [...]}``; exit 0 when every case ran. Operands sit in
NaN guard buffers. Checked: validation raises exactly where ``expected_violation`` finds a broken bound; without
it only documented ``ValueError``s, finite results, guards intact; well-formed offsets match the reference on
``testing.truncated_pack`` (bitwise for the reference backend, else the SPEC contract), dropped tokens zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

if "--device" not in sys.argv or "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on the CPU

import torch

from csa_compressor import CSACompressorBackward, CSACompressorForward, reference
from csa_compressor.testing import Pack, contract_report, truncated_pack

GUARD = 64  # elements of NaN on each side of every operand (a multiple of 8: keeps 16-byte alignment)
# (bound, as validate_pack names it) in validate_pack's order; expected_violation returns an index into this.
CONTENT_BOUNDS = (
    "cu_seqlens[0] must be 0",
    "cu_seqlens must be non-decreasing",
    "cu_seqlens[-1] must be <= T",
    "cu_seqlens_comp[0] must be 0",
    "cu_seqlens_comp must count seqlen // ratio rows per segment",
    "total_comp must cover the real rows",
)


def expected_violation(case) -> tuple[int, int] | None:
    """(bound index, first offending segment) of the first content bound the offsets break, else None."""
    cu, comp, ratio = case["cu_seqlens"], case["cu_seqlens_comp"], case["ratio"]
    segments = range(len(cu) - 1)
    tests = (
        lambda b: b == 0 and cu[0] != 0,
        lambda b: cu[b + 1] < cu[b],
        lambda b: cu[b + 1] > case["tokens"],
        lambda b: b == 0 and comp[0] != 0,
        lambda b: comp[b + 1] - comp[b] != (cu[b + 1] - cu[b]) // ratio,
        lambda b: comp[b + 1] > case["total_comp"],
    )
    for index, broken in enumerate(tests):
        for b in segments:
            if broken(b):
                return index, b
    return None


def host_error(case) -> str | None:
    """The host-side bound (check_support) the case breaks, else None."""
    if len(case["cu_seqlens"]) != len(case["cu_seqlens_comp"]):
        return "cu_seqlens_comp shape must equal cu_seqlens shape"
    if len(case["cu_seqlens"]) < 2:
        return "cu_seqlens must have at least 2 entries"
    if case["total_comp"] > 0 and case["tokens"] < case["ratio"]:
        return "total_comp > 0 needs T >= ratio"
    return None


def guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` copied into the middle of a NaN-filled buffer: (the operand, the whole buffer)."""
    buffer = torch.full((values.numel() + 2 * GUARD,), float("nan"), dtype=values.dtype, device=values.device)
    operand = buffer[GUARD : GUARD + values.numel()].view(values.shape)
    operand.copy_(values)
    return operand, buffer


def guards_intact(buffer: torch.Tensor) -> bool:
    edges = torch.cat([buffer[:GUARD], buffer[-GUARD:]])
    return bool(torch.isnan(edges).all())


def build(case, device) -> tuple[Pack, list]:
    """The case's pack, every tensor guarded (offsets too, with huge guard values), and the guard buffers."""
    gen = torch.Generator().manual_seed(case["seed"])
    ratio, coff, d, tokens, rows = case["ratio"], case["coff"], case["head_dim"], case["tokens"], case["total_comp"]
    kv, kv_buf = guarded(torch.randn(tokens, coff * d, generator=gen).to(torch.bfloat16).to(device))
    score, score_buf = guarded(torch.randn(tokens, coff * d, generator=gen).to(torch.bfloat16).to(device))
    ape, ape_buf = guarded((torch.randn(ratio, coff * d, generator=gen) * 0.5).to(device))
    grad_out, grad_buf = guarded(torch.randn(rows, d, generator=gen).to(torch.bfloat16).to(device))
    offsets = []
    for values in (case["cu_seqlens"], case["cu_seqlens_comp"]):
        buffer = torch.full((len(values) + 2 * GUARD,), 2**30, dtype=torch.int32, device=device)
        operand = buffer[GUARD : GUARD + len(values)]
        operand.copy_(torch.tensor(values, dtype=torch.int32))
        offsets.append(operand)
    pack = Pack(kv, score, ape, *offsets, grad_out, ratio, coff, d, rows, ())
    return pack, [kv_buf, score_buf, ape_buf, grad_buf]


def outputs(pack: Pack, fill: float):
    """Caller-owned guarded output buffers: ``out`` NaN inside, the gradients ``fill`` (NaN where all must be written)."""
    made = [
        guarded(torch.full((pack.total_comp, pack.head_dim), float("nan"), dtype=pack.kv.dtype, device=pack.kv.device)),
        guarded(torch.full_like(pack.kv, fill)),
        guarded(torch.full_like(pack.score, fill)),
        guarded(torch.full_like(pack.ape, fill)),
    ]
    return [t for t, _ in made], [b for _, b in made]


def run_validated(op, args, expected, failures, direction):
    """execute(validate=True): a ValueError naming the expected bound and segment, or a launch."""
    try:
        op.execute(*args, validate=True)
    except ValueError as exc:
        if expected is None:
            failures.append(f"{direction}: validation rejected well-formed offsets: {exc}")
        elif CONTENT_BOUNDS[expected[0]] not in str(exc) or f"segment {expected[1]}" not in str(exc):
            failures.append(f"{direction}: validation named the wrong bound or segment: {exc}; expected {expected}")
        return False
    if expected is not None:
        failures.append(f"{direction}: validation accepted offsets breaking {CONTENT_BOUNDS[expected[0]]!r}")
    return True


def check_against_reference(backend, pack, out, grads, failures):
    """Well-formed offsets: the results equal the reference on the truncated pack."""
    short, keep = truncated_pack(pack)
    dropped = torch.ones(pack.kv.shape[0], dtype=torch.bool, device=keep.device)
    dropped[keep] = False
    for name, grad in zip(("grad_kv", "grad_score"), grads[:2], strict=True):
        if bool(grad[dropped].view(torch.int16).any()):
            failures.append(f"{name}: tokens of dropped rows or tails are not exact zeros")
    mine = (grads[0][keep], grads[1][keep], grads[2])
    if backend != "reference":
        report = contract_report(short, out, mine)
        if not report["ok"]:
            failures.append(f"not within the contract of the truncated pack's reference: {report}")
        return
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    want_out = reference.forward(*short.inputs, total_comp=short.total_comp, precision="fp32", **kw)
    want = reference.backward(*short.inputs, short.grad_out, precision="fp32", **kw)
    for name, got, expected in zip(
        ("out", "grad_kv", "grad_score", "grad_ape"), (out, *mine), (want_out, *want), strict=True
    ):
        if not torch.equal(got, expected):
            failures.append(f"{name} differs from the truncated pack's reference")


def run_case(case, backend, device) -> list[str]:
    failures: list[str] = []
    pack, input_buffers = build(case, device)
    host = host_error(case)
    expected = expected_violation(case) if host is None else None
    defined = expected is None or CONTENT_BOUNDS[expected[0]].startswith("total_comp")
    kw = dict(ratio=pack.ratio, coff=pack.coff, backend=backend)
    (out, grad_kv, grad_score, grad_ape), buffers = outputs(pack, float("nan") if defined else 0.0)
    try:
        fwd = CSACompressorForward(*pack.inputs, out, **kw)
        bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, grad_kv, grad_score, grad_ape, **kw)
        fwd.check_support()
        bwd.check_support()
    except ValueError as exc:
        if host is None or host not in str(exc):
            failures.append(f"unexpected host error: {exc}; expected {host!r}")
        return failures
    if host is not None:
        return [f"host bound {host!r} not reported"]
    grads = (grad_kv, grad_score, grad_ape)
    if not run_validated(fwd, (*pack.inputs, out), expected, failures, "forward"):
        fwd.execute(*pack.inputs, out)
    if not run_validated(bwd, (*pack.inputs, pack.grad_out, *grads), expected, failures, "backward"):
        bwd.execute(*pack.inputs, pack.grad_out, *grads)
    if not bool(torch.isfinite(out).all()):
        failures.append("forward output not finite (a read outside the operands, or an unwritten row)")
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        failures.append("gradients not finite (a read outside the operands, or an unwritten position)")
    if not all(guards_intact(b) for b in (*buffers, *input_buffers)):
        failures.append("a write outside the operands (a guard changed)")
    if defined and not failures:
        check_against_reference(backend, pack, out, grads, failures)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args()
    cases = json.load(sys.stdin)
    for index, case in enumerate(cases):
        print(f"BEGIN {index}", flush=True)
        try:
            failures = run_case(case, opts.backend, torch.device(opts.device))
        except Exception:  # an undocumented error is a failure of this case, not of the run
            failures = [f"undocumented error: {traceback.format_exc(limit=4)}"]
        print(json.dumps({"case": index, "failures": failures}), flush=True)
    if opts.device == "cuda":
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
