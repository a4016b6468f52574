"""Which part of the fused tail costs the short-window kernels their time: each case's forward and backward built
with the pooling alone, the norm alone, the rotation alone (rope_dim 64, interleaved), both, and both with
per-segment positions; kernel time cold and warm (``csa_compressor.bench.Timer``), the backward as autograd calls
it (the forward's rstd handed over). Needs a GPU; run from the repository root:

    python benchmarks/tail_parts.py [--backend cute] [--cases 1x8192-d128 3x8192-d512]

One line per (case, variant): ``fwd cold / warm  bwd cold / warm`` in microseconds.
"""

from __future__ import annotations

import argparse

import torch

from csa_compressor import api
from csa_compressor import tail as T
from csa_compressor.bench.timer import Timer
from csa_compressor.tail_args import TAIL_ARGS
from csa_compressor.testing import make_pack

RATIO, COFF = 4, 2
CASES = {
    "1x8192-d128": ((8192,), 128),
    "3x8192-d128": ((8192,) * 3, 128),
    "1x8192-d512": ((8192,), 512),
    "3x8192-d512": ((8192,) * 3, 512),
}
VARIANTS = {
    "norm": dict(norm=True, rope_dim=0),
    "rope": dict(norm=False, rope_dim=64),
    "both": dict(norm=True, rope_dim=64),
    "both+pos": dict(norm=True, rope_dim=64, positions=True),
}


def cold_and_warm(timer: Timer, fn) -> list[float]:
    timer.warm_up(fn)
    return [timer.kernel(fn, calls, cold).us for calls, cold in ((10, True), (20, False))]


def line(name: str, variant: str, fwd: list[float], bwd: list[float]) -> str:
    return f"{name} {variant}: fwd {fwd[0]:.2f} / {fwd[1]:.2f}  bwd {bwd[0]:.2f} / {bwd[1]:.2f}"


def time_case(timer: Timer, name: str, backend: str, device: str = "cuda") -> None:
    seqlens, head_dim = CASES[name]
    pack = make_pack(seqlens, head_dim, RATIO, COFF, device=device, seed=1)
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    kw = dict(ratio=RATIO, coff=COFF, total_comp=pack.total_comp, backend=backend)
    fwd = cold_and_warm(timer, lambda: api.csa_compressor_forward_wrapper(*inputs, **kw))
    bwd = cold_and_warm(timer, lambda: api.csa_compressor_backward_wrapper(*inputs, pack.grad_out, **kw))
    print(line(name, "pooling", fwd, bwd), flush=True)
    for variant, options in VARIANTS.items():
        arguments = T.random_tail(pack, interleaved=True, seed=1, **options).arguments()
        fwd, bwd = time_tail(timer, pack, inputs, backend, tuple(arguments[a] for a in TAIL_ARGS))
        print(line(name, variant, fwd, bwd), flush=True)


def time_tail(timer: Timer, pack, inputs: tuple, backend: str, tail_args: tuple) -> tuple[list, list]:
    """The fused forward (rstd saved) and the backward given that rstd."""

    def forward():
        return api._pool_forward_tail(inputs, RATIO, COFF, pack.total_comp, backend, tail_args, return_rstd=True)

    rstd = forward()[1]

    def backward():
        return api._pool_backward_tail(inputs, pack.grad_out, RATIO, COFF, backend, tail_args, rstd=rstd)

    return cold_and_warm(timer, forward), cold_and_warm(timer, backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cute", choices=("cute", "triton"))
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tail_parts.py times kernels: it needs a CUDA GPU")
    timer = Timer(torch.device("cuda"))
    for name in args.cases:
        time_case(timer, name, args.backend)


if __name__ == "__main__":
    main()
