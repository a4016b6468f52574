"""Small forward+backward cases for compute-sanitizer (memcheck, racecheck, synccheck) on one backend.

    compute-sanitizer --tool memcheck python -m tests.sanitize_cases --backend cute [--malformed | --tail-only]

Well-formed cases (every cute kernel class; ``TAIL_CASES`` the fused and composed tail kernels) are also checked
against the references, which run on the CPU so that only the backend's kernels run under the tool;
``--malformed``: test_triton_safety's malformed offsets between NaN canary rows. Exit status 1 on a numerics
failure or a finding.
"""

import argparse
import sys
from pathlib import Path

import torch

from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
from csa_compressor import tail as tail_ops
from csa_compressor.reference import uses_softmax_stats
from csa_compressor.testing import contract_report, make_pack

# (ratio, coff, head_dim, seqlens, token_padding, comp_padding)
CASES = [
    (4, 2, 512, (37, 3, 0, 64), 5, 2),
    (4, 1, 128, (33, 8), 0, 1),
    (4, 2, 65, (19, 4), 2, 0),
    (128, 1, 512, (300, 17), 3, 1),
    (128, 2, 128, (260, 128), 0, 2),
    (8, 2, 64, (17, 8, 7), 0, 2),
    (3, 2, 36, (20, 7, 2), 1, 1),  # a short window of three slot groups (the grouped kernels)
    (2, 2, 24, (9, 1, 4), 2, 1),
]

# (ratio, coff, head_dim, seqlens, comp_padding, rope_dim, interleaved, norm): the fused routes (the short kernels; the
# whole-row long forward, whose empty rows skip the tail with interleaved pairs and wait at the half-split exchange;
# the statistics backward with the tail, the last case's row ranges spanning two blocks of row terms on 132 SMs), the
# whole-row stream (d512, one slot half; half-split partners through shared memory), the composed one, an odd
# head_dim.
TAIL_CASES = [
    (4, 2, 128, (37, 3, 0, 64), 2, 64, True, True),
    (128, 1, 128, (300, 17, 256), 1, 64, True, True),
    (128, 1, 128, (300, 17, 256), 1, 64, False, True),
    (128, 1, 128, (300, 17, 256), 1, 64, True, False),  # a rotation alone: two chunks, no cluster
    (128, 1, 512, (300, 17, 256), 1, 64, True, True),
    (64, 1, 512, (300, 17, 256), 2, 64, False, True),
    (128, 2, 512, (260, 128), 0, 64, True, True),
    (4, 2, 72, (19, 4), 1, 2, True, True),
    (16, 2, 8, (100000, 40000), 2, 8, True, True),
]

_ALL = "all"
# (ratio, coff, head_dim) -> names of test_triton_safety.MALFORMED run on every cute kernel class; head dims multiples
# of 8 keep the operands 16-byte aligned.
CUTE_MALFORMED_CONFIGS = {
    (4, 2, 8): _ALL,  # exact forward, short backward
    (2, 1, 8): ("beyond_T", "negative", "int32_wrap", "int32_min", "start_past_T"),
    (3, 2, 8): _ALL,  # grouped short forward and backward
    (8, 2, 16): _ALL,  # grouped forward, long backward (no statistics)
    (16, 2, 8): _ALL,  # statistics forward and backward (slab form)
    (17, 1, 8): ("decreasing", "negative", "int32_wrap", "start_past_T"),  # one slot per group
    (128, 1, 512): _ALL,  # long backward, statistics backward in the whole-tile form (the H200's choice)
}


def malformed_results(backend: str, device: str = "cuda"):
    """(case name, {check: held}) of every malformed case on ``backend``'s kernels on ``device``."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # run as a script: the repository's tests package
        sys.path.insert(0, root)
    from unittest import mock

    from csa_compressor import dispatch
    from tests.backends import test_triton_safety as safety

    configs = safety.MALFORMED_CONFIGS if backend == "triton" else CUTE_MALFORMED_CONFIGS
    # test_triton_safety's runner calls its module's ``launch``: the other backend's protocol takes the same
    # arguments.
    with mock.patch.object(safety, "launch", dispatch.backend_module(backend)):
        for (ratio, coff, head_dim), names in configs.items():
            for name in safety.MALFORMED if names == _ALL else names:
                result = safety._malformed(name, ratio, coff, head_dim, device)
                yield f"{name}-r{ratio}c{coff}d{head_dim}", result


def run_malformed(backend: str) -> int:
    bad = 0
    for case, result in malformed_results(backend):
        good = all(result.values())
        bad += not good
        print(f"{backend} {case}: {'ok' if good else f'FINDING {result}'}", flush=True)
    torch.cuda.synchronize()
    return 1 if bad else 0


def _moved(tensors, device):
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in tensors]


def run_pooling_cases(backend: str, device: str, count: int) -> bool:
    ok = True
    for ratio, coff, head_dim, seqlens, tok_pad, comp_pad in CASES[:count]:
        # The pack and the references stay on the CPU: under compute-sanitizer the oracle's eager kernels would be
        # instrumented too, and only the backend's kernels are under test.
        p = make_pack(seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad)
        inputs, grad_out = _moved(p.inputs, device), p.grad_out.to(device)
        kw = dict(ratio=ratio, coff=coff, backend=backend)
        out = csa_compressor_forward_wrapper(*inputs, total_comp=p.total_comp, **kw)["out"]
        grads = csa_compressor_backward_wrapper(*inputs, grad_out, **kw)
        good = contract_report(p, out.cpu(), tuple(_moved(grads, "cpu")))["ok"]
        if uses_softmax_stats(ratio, coff):
            # The softmax-statistics pair as autograd runs it.
            out, stats = csa_compressor_forward_wrapper(
                *inputs, total_comp=p.total_comp, return_softmax_stats=True, **kw
            )
            grads = csa_compressor_backward_wrapper(*inputs, grad_out, softmax_stats=stats, **kw)
            good &= contract_report(p, out.cpu(), tuple(_moved(grads, "cpu")))["ok"]
        ok &= good
        print(f"{backend} r{ratio} c{coff} d{head_dim} {seqlens}: {'ok' if good else 'NUMERICS FAIL'}", flush=True)
    return ok


def run_tail_cases(backend: str, device: str) -> bool:
    ok = True
    for ratio, coff, head_dim, seqlens, comp_pad, rope_dim, interleaved, norm in TAIL_CASES:
        p = make_pack(seqlens, head_dim, ratio, coff, comp_padding=comp_pad)  # on the CPU, as above
        tail = tail_ops.random_tail(p, norm=norm, rope_dim=rope_dim, interleaved=interleaved, positions=True,
                                    seed=ratio)  # fmt: skip
        inputs, grad_out = _moved(p.inputs, device), p.grad_out.to(device)
        tail_kw = dict(zip(tail.arguments(), _moved(tail.arguments().values(), device), strict=True))
        kw = dict(ratio=ratio, coff=coff, backend=backend, **tail_kw)
        out = csa_compressor_forward_wrapper(*inputs, total_comp=p.total_comp, **kw)["out"]
        g = csa_compressor_backward_wrapper(*inputs, grad_out, **kw)
        grads = _moved((g["grad_kv"], g["grad_score"], g["grad_ape"], g.get("grad_norm_weight")), "cpu")
        good = tail_ops.contract_report(p, tail, out.cpu(), tuple(grads))["ok"]
        ok &= good
        pairs = "interleaved" if interleaved else "half-split"
        pairs += "" if norm else ", no norm"
        print(f"{backend} tail r{ratio} c{coff} d{head_dim} {seqlens} {pairs}: {'ok' if good else 'NUMERICS FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device", default="cuda", help="where the backend runs (cpu: the script's own test)")
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    parser.add_argument("--malformed", action="store_true", help="the malformed-offset cases instead")
    parser.add_argument("--tail-only", action="store_true", help="the fused-tail cases (TAIL_CASES) alone")
    opts = parser.parse_args()
    if opts.malformed:
        return run_malformed(opts.backend)
    ok = run_pooling_cases(opts.backend, opts.device, 0 if opts.tail_only else opts.cases)
    ok &= run_tail_cases(opts.backend, opts.device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
