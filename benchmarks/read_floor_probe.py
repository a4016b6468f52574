"""How fast can any kernel read a forward's bytes under the benchmark's cold method? (GPU)

::

    python3 benchmarks/read_floor_probe.py [--cases NAME,...] [--reps 20] [--out FILE.json]

SPEC 6's floor divides the bytes by a copy rate (4.22 TB/s; 3.9-4.1 measured in our runs with a 512 MiB copy).
The forwards read ``2*T*coff*d*2`` bytes and write almost nothing, after a flush that leaves L2 full of dirty
lines. This probe times, with the benchmark's own timer (``bench._Timer``: cold = write flush, clean = write
flush then a read of another 2x-L2 buffer, warm = back to back), kernels that do nothing but stream the same
number of bytes:

- ``triton read BxW``: a Triton kernel whose programs each sum one block of B bf16 (16-byte evict-first loads,
  W warps) of one buffer the size of kv + score, one float out per program;
- ``triton read BxW pP``: the same as a grid-stride loop over P programs per SM;
- ``torch sum``: ``buf.sum(dtype=float32)``;
- ``copy half``: ``dst.copy_(src)`` of half the bytes (the same DRAM traffic, half of it written);
- ``triton tile read RxC wW`` (ratio-128 coff-1 cases): programs reading one (ratio tokens x C columns) tile of kv
  and of score each, chunk-major (the cute forward's access pattern); ``triton softmax``: the same with the
  forward's softmax over the tokens per column (no ape), C floats out per program;

next to the cute forward (``bench._kernel_callables``) of the same case. ``--direction bwd``: the backward's
traffic instead (``triton 2 in 2 out``: kv and score read, two tensors as large written; ``copy kv + score``) next
to the cute backward; ``floor_bytes`` is then the backward's floor bytes (grad_out, 1-6 % of them, is not
moved by the probes). Prints one JSON line per (case, probe) and a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SPEC_COPY_RATE = 4.22e12  # SPEC 6, read + write bytes per second


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(src, out, n_blocks, BLOCK: tl.constexpr, PERSISTENT: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if PERSISTENT:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for b in range(pid, n_blocks, tl.num_programs(0)):
                x = tl.load(src + b * BLOCK + offs, eviction_policy="evict_first")
                acc += x.to(tl.float32)
            tl.store(out + pid, tl.sum(acc, axis=0))
        else:
            x = tl.load(src + pid * BLOCK + offs, eviction_policy="evict_first")
            tl.store(out + pid, tl.sum(x.to(tl.float32), axis=0))

    return read_sum


def _tile_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def tile_read(kv, score, out, n_chunks, WIDTH: tl.constexpr, TOK: tl.constexpr, CW: tl.constexpr,
                  SOFTMAX: tl.constexpr):  # fmt: skip
        # Program = (row of TOK tokens, chunk of CW columns), chunk-major as the cute forward orders its CTAs:
        # the forward's access pattern (TOK pieces of CW * 2 bytes at a stride of WIDTH * 2 bytes per tensor).
        pid = tl.program_id(0)
        row = pid // n_chunks
        chunk = pid % n_chunks
        t = tl.arange(0, TOK)[:, None]
        c = tl.arange(0, CW)[None, :]
        offs = (row * TOK + t) * WIDTH + chunk * CW + c
        v = tl.load(kv + offs, eviction_policy="evict_first").to(tl.float32)
        x = tl.load(score + offs, eviction_policy="evict_first").to(tl.float32)
        if SOFTMAX:  # the forward's arithmetic without ape: a softmax over the tokens per column
            y = x * 1.4426950408889634
            m = tl.max(y, axis=0)
            e = tl.exp2(y - m[None, :])
            res = tl.sum(e * v, axis=0) / tl.sum(e, axis=0)
            tl.store(out + pid * CW + tl.arange(0, CW), res)
        else:
            tl.store(out + pid, tl.sum(tl.sum(v * x, axis=1), axis=0))

    return tile_read


# (columns per tile, warps, with the softmax) of the tile probes
TILE_CONFIGS = ((64, 4, 0), (64, 8, 0), (128, 8, 0), (256, 8, 0), (512, 8, 0), (64, 8, 1), (256, 8, 1))


def tile_probes(case, dev, configs=TILE_CONFIGS):
    """name -> callable reading a case's kv and score in the forward's tiles (ratio-128 cases), one per config."""
    import torch

    tile_read = _tile_kernel()
    width = case.coff * case.head_dim
    tokens = case.total_tokens
    kv = torch.randn(tokens, width, dtype=torch.bfloat16, device=dev)
    score = torch.randn_like(kv)
    out = torch.empty(tokens * width // case.ratio, dtype=torch.float32, device=dev)
    calls = {}
    for cw, warps, softmax in configs:
        if width % cw:
            continue
        n_chunks = width // cw
        grid = (tokens // case.ratio * n_chunks,)
        name = f"triton {'softmax' if softmax else 'tile read'} {case.ratio}x{cw} w{warps}"
        calls[name] = lambda g=grid, n=n_chunks, cw=cw, w=warps, sm=softmax: tile_read[g](
            kv, score, out, n, WIDTH=width, TOK=case.ratio, CW=cw, SOFTMAX=sm, num_warps=w
        )
    return calls


def _stream_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def two_in_two_out(a, b, x, y, BLOCK: tl.constexpr):
        # The backward's main traffic with no arithmetic to speak of: read two tensors, write two of the same size.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        u = tl.load(a + offs, eviction_policy="evict_first").to(tl.float32)
        v = tl.load(b + offs, eviction_policy="evict_first").to(tl.float32)
        tl.store(x + offs, (u * v).to(tl.bfloat16))
        tl.store(y + offs, (u + v).to(tl.bfloat16))

    return two_in_two_out


def backward_probes(case, dev):
    """name -> callable moving a backward's bytes with no real work (kv and score read, two as large written)."""
    import torch

    stream = _stream_kernel()
    n = -(-case.total_tokens * case.coff * case.head_dim // 8192) * 8192
    a, b = (torch.randn(n, dtype=torch.bfloat16, device=dev) for _ in range(2))
    x, y = torch.empty_like(a), torch.empty_like(b)
    calls = {}
    for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
        calls[f"triton 2 in 2 out {block}x{warps}"] = lambda bl=block, w=warps: stream[(n // bl,)](
            a, b, x, y, BLOCK=bl, num_warps=w
        )
    src = torch.randn(2 * n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    calls["copy kv + score"] = lambda: dst.copy_(src)
    return calls


def probes(buf, sms: int):
    """name -> callable reading all of ``buf`` (bf16, length a multiple of 16384)."""
    import torch

    read_sum = _read_kernel()
    n = buf.numel()
    out = torch.empty(max(n // 1024, sms * 16), dtype=torch.float32, device=buf.device)
    calls = {}
    for block, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8)):
        grid = (n // block,)
        calls[f"triton read {block}x{warps}"] = lambda g=grid, b=block, w=warps: read_sum[g](
            buf, out, n // b, BLOCK=b, PERSISTENT=False, num_warps=w
        )
    for block, warps, per_sm in ((4096, 8, 4), (2048, 4, 8), (8192, 8, 2)):
        grid = (min(sms * per_sm, n // block),)
        calls[f"triton read {block}x{warps} p{per_sm}"] = lambda g=grid, b=block, w=warps: read_sum[g](
            buf, out, n // b, BLOCK=b, PERSISTENT=True, num_warps=w
        )
    calls["torch sum"] = lambda: buf.sum(dtype=torch.float32)
    half = buf[: n // 2]
    dst = torch.empty_like(half)
    calls["copy half"] = lambda: dst.copy_(half)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="3x8192-d512-r128-c1,3x8192-d128-r4-c2,3x8192-d512-r4-c2,1x65536-d512-r128-c2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--direction",
        choices=("fwd", "bwd"),
        default="fwd",
        help="bwd: the backward's traffic (kv, score read; two as large written) next to the cute backward",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch

    from csa_compressor import available_backends
    from csa_compressor.bench import _kernel_callables, _Timer, floor_bytes, select_cases
    from csa_compressor.testing import make_pack

    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    timer = _Timer(dev, (args.reps, args.reps, 1))
    copy_rate = timer.copy_rate()
    rows = []
    direction = args.direction
    for case in select_cases(args.cases.split(",")):
        read_bytes = 2 * case.total_tokens * case.coff * case.head_dim * 2
        if direction == "fwd":
            n = -(-read_bytes // 2 // 16384) * 16384
            buf = torch.randn(n, dtype=torch.bfloat16, device=dev)
            calls = probes(buf, sms)
            if case.ratio >= 16 and case.coff == 1:
                calls.update(tile_probes(case, dev))
        else:
            buf = None
            calls = backward_probes(case, dev)
        if "cute" in available_backends(dev):
            pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=dev, seed=3)
            name = "cute forward" if direction == "fwd" else "cute backward"
            calls = {name: _kernel_callables("cute", pack, case)[direction], **calls}
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize(dev)
            rec = dict(case=case.name, probe=name, read_mb=round(read_bytes / 1e6, 2),
                       floor_bytes=floor_bytes(case, direction))  # fmt: skip
            for mode in ("cold", "clean", "warm"):
                rec[mode] = round(timer.kernel_us(fn, args.reps, cold=mode != "warm", clean=mode == "clean"), 2)
            rec["cold_x_spec_floor"] = round(rec["cold"] / (rec["floor_bytes"] / SPEC_COPY_RATE * 1e6), 3)
            rec["cold_x_run_floor"] = round(rec["cold"] / (rec["floor_bytes"] / copy_rate * 1e6), 3)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
        del buf, calls
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(dev), "copy_tb_s": round(copy_rate / 1e12, 3), "reps": args.reps,
            "direction": direction}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    print(f"\n{meta}")
    print(f"{'case':22s} {'probe':26s} {'MB':>6s} {'cold':>7s} {'clean':>7s} {'warm':>7s} {'xSPEC':>6s} {'xrun':>6s}")
    for r in rows:
        print(f"{r['case']:22s} {r['probe']:26s} {r['read_mb']:6.1f} {r['cold']:7.2f} {r['clean']:7.2f} "
              f"{r['warm']:7.2f} {r['cold_x_spec_floor']:6.3f} {r['cold_x_run_floor']:6.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
