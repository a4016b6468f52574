"""A few training steps of a DeepSeek-V4-style compressor block on random data.

The block is ``csa_compressor.Compressor``: the ``wkv`` and ``wgate`` projections, the fused gated pooling
(``compressor_pool``) with ``ape``, RMSNorm over ``head_dim`` and RoPE on the last 64 columns. A student
block learns to reproduce a fixed teacher block's output on ragged THD packs; the loss must fall.

    python examples/train_compressor.py            # GPU if there is one, else the CPU
    python examples/train_compressor.py --ratio 128 --steps 40

On a GPU the pooling runs in the fused kernels (``cute`` on sm_90 / sm_100, else ``triton``); on the CPU it
runs the eager reference backend, which computes the same function.
"""

from __future__ import annotations

import argparse

import torch

from csa_compressor import Compressor


def random_pack(seqlens: list[int], hidden: int, device: torch.device, gen: torch.Generator):
    """``x`` ``(T, hidden)`` bf16 and ``cu_seqlens`` ``(B+1,)`` int32 for one packed batch."""
    x = torch.randn(sum(seqlens), hidden, generator=gen).to(device, torch.bfloat16)
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return x, cu_seqlens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=int, default=4, choices=(2, 4, 128))
    parser.add_argument("--steps", type=int, default=None, help="default: 20 on a GPU, 6 on the CPU")
    opts = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # DeepSeek-V4's main compressor is hidden 7168 -> head_dim 512; the CPU run uses a small block.
    hidden, head_dim, seq = (2048, 512, 8192) if device.type == "cuda" else (64, 128, 64)
    steps = opts.steps or (20 if device.type == "cuda" else 6)
    kw = dict(rope_dim=64, max_position=4 * seq, learned_ape=opts.ratio != 2, device=device)
    torch.manual_seed(0)
    teacher = Compressor(hidden, head_dim, opts.ratio, **kw).requires_grad_(False)
    student = Compressor(hidden, head_dim, opts.ratio, **kw)
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-2)
    print(f"{device.type}: {student}")

    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        # Ragged packs, a short segment included; the row count is known on the host here.
        seqlens = [seq + 3 * step, seq // 2 + 1, opts.ratio - 1, 2 * seq]
        x, cu_seqlens = random_pack(seqlens, hidden, device, gen)
        total_comp = sum(s // opts.ratio for s in seqlens)
        target = teacher(x, cu_seqlens, total_comp=total_comp)
        out = student(x, cu_seqlens, total_comp=total_comp)  # (total_comp, head_dim) bf16
        loss = (out.float() - target.float()).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # through the fused backward: wkv, wgate, ape and the norm weight
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step:2d}  rows {total_comp:5d}  loss {losses[-1]:.4f}")

    if not losses[-1] < 0.9 * losses[0]:
        print(f"FAILED: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
        return 1
    print(f"ok: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
