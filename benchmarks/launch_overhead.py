"""Host overhead of one call, broken down: a plain torch op, a bare backend launch, the class API, the wrapper.

    python3 benchmarks/launch_overhead.py [--out FILE.json]

Wall time = CUDA events around one call started on an idle device (median of 200), so it is host time
plus the (tiny) kernel. Puts the SPEC target (kernel + 10 us forward, + 15 us backward) in the context of
what a single launch costs on the machine at hand.
"""

import argparse
import json
import statistics
import sys

import torch

from csa_compressor import (
    CSACompressorBackward,
    CSACompressorForward,
    available_backends,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    dispatch,
)
from csa_compressor.testing import make_pack


def wall_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the figures as JSON here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    p = make_pack((8192,), 128, 4, 2, device="cuda")
    x = torch.zeros(1, device="cuda")
    rows = {
        "torch x.add_(1)": wall_us(lambda: x.add_(1)),
        "torch.empty(1) + add_": wall_us(lambda: torch.empty(1, device="cuda").add_(1)),
    }
    out = torch.empty(p.total_comp, 128, dtype=torch.bfloat16, device="cuda")
    grads = [torch.empty_like(p.kv), torch.empty_like(p.score), torch.empty_like(p.ape)]
    for name in available_backends("cuda"):
        if name == "reference":
            continue
        module = dispatch.backend_module(name)
        fwd = CSACompressorForward(*p.inputs, out, ratio=4, coff=2, backend=name)
        bwd = CSACompressorBackward(*p.inputs, p.grad_out, *grads, ratio=4, coff=2, backend=name)
        fwd.compile()
        bwd.compile()
        rows[f"{name}: bare launch, forward"] = wall_us(lambda m=module: m.forward(*p.inputs, out, 4, 2, None))
        rows[f"{name}: class execute, forward"] = wall_us(lambda f=fwd: f.execute(*p.inputs, out))
        rows[f"{name}: wrapper, forward"] = wall_us(
            lambda n=name: csa_compressor_forward_wrapper(
                *p.inputs, ratio=4, coff=2, total_comp=p.total_comp, backend=n
            )
        )
        rows[f"{name}: bare launch, backward"] = wall_us(
            lambda m=module: m.backward(*p.inputs, p.grad_out, *grads, 4, 2, None)
        )
        rows[f"{name}: class execute, backward"] = wall_us(lambda b=bwd: b.execute(*p.inputs, p.grad_out, *grads))
        rows[f"{name}: wrapper, backward"] = wall_us(
            lambda n=name: csa_compressor_backward_wrapper(*p.inputs, p.grad_out, ratio=4, coff=2, backend=n)
        )
    print(f"wall us per call, {torch.cuda.get_device_name()} (1x8192 d128 r4 c2):")
    for key, value in rows.items():
        print(f"  {key:40s} {value:8.1f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "wall_us": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
