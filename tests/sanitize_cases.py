"""Small forward+backward cases for compute-sanitizer (memcheck, racecheck) on one backend.

    compute-sanitizer --tool memcheck python tests/sanitize_cases.py --backend cute

Each case is checked against the fp32 reference as well, so a clean sanitizer run
is also a correct one. Exit status 1 on a numerics failure. The cases reach every cute kernel class: the exact and
the grouped forward, the short, long and statistics backwards (the whole-tile form at ratio 128 d512) and the
grad_ape reduction.
"""

import argparse
import sys

import torch

from csa_compressor import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases")
    opts = parser.parse_args()
    ok = True
    for ratio, coff, head_dim, seqlens, tok_pad, comp_pad in CASES[: opts.cases]:
        p = make_pack(seqlens, head_dim, ratio, coff, token_padding=tok_pad, comp_padding=comp_pad, device="cuda")
        kw = dict(ratio=ratio, coff=coff, backend=opts.backend)
        out = csa_compressor_forward_wrapper(*p.inputs, total_comp=p.total_comp, **kw)["out"]
        grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, **kw)
        good = contract_report(p, out, tuple(grads))["ok"]
        if uses_softmax_stats(ratio, coff):
            # The softmax-statistics pair as autograd runs it.
            out, stats = csa_compressor_forward_wrapper(
                *p.inputs, total_comp=p.total_comp, return_softmax_stats=True, **kw
            )
            grads = csa_compressor_backward_wrapper(*p.inputs, p.grad_out, softmax_stats=stats, **kw)
            good &= contract_report(p, out, tuple(grads))["ok"]
        ok &= good
        print(f"{opts.backend} r{ratio} c{coff} d{head_dim} {seqlens}: {'ok' if good else 'NUMERICS FAIL'}")
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
