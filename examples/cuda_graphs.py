"""Capture the pooling's forward and backward in one CUDA graph with a static capacity, replay it on new packs.

A graph replays fixed shapes and fixed addresses, while every pack has its own sequence lengths. So the
buffers are sized for the largest pack and the true sizes live on the device:

- ``kv`` / ``score`` have ``T_MAX`` rows; rows past ``cu_seqlens[-1]`` are never read (their gradients are 0);
- ``cu_seqlens`` has ``B_MAX + 1`` entries; a pack with fewer sequences repeats its last offset (empty
  segments produce no rows);
- ``total_comp = CAP = T_MAX // ratio`` rows always; rows past ``cu_seqlens_comp[-1]`` are padding rows whose
  values are to be ignored and whose ``grad_out`` is ignored.

Nothing in the launch path reads device memory on the host, so a replay with other true sizes needs no new
capture. Each replay is checked against a fresh call sized exactly for its pack.

    python examples/cuda_graphs.py

Without a GPU there is no CUDA graph: the script then runs the same static-capacity step eagerly on the same
static buffers, which checks the part that matters to graph users (the static-capacity results equal the
exact ones), and says so.
"""

from __future__ import annotations

import torch

from csa_compressor import compressor_pool, compute_cu_seqlens_comp
from csa_compressor.testing import rel_l2

RATIO, COFF = 4, 2


class StaticStep:
    """Static buffers and one forward + backward step over them (what the graph captures)."""

    def __init__(self, t_max: int, b_max: int, head_dim: int, device: torch.device) -> None:
        width = COFF * head_dim
        self.capacity = t_max // RATIO
        self.kv = torch.zeros(t_max, width, device=device, dtype=torch.bfloat16, requires_grad=True)
        self.score = torch.zeros(t_max, width, device=device, dtype=torch.bfloat16, requires_grad=True)
        self.ape = torch.zeros(RATIO, width, device=device, requires_grad=True)
        self.cu_seqlens = torch.zeros(b_max + 1, device=device, dtype=torch.int32)
        self.grad_out = torch.zeros(self.capacity, head_dim, device=device, dtype=torch.bfloat16)

    def __call__(self):
        cu_seqlens_comp = compute_cu_seqlens_comp(self.cu_seqlens, RATIO)  # on the device: no host sync
        out = compressor_pool(
            self.kv, self.score, self.ape, self.cu_seqlens, cu_seqlens_comp, ratio=RATIO, coff=COFF,
            total_comp=self.capacity,
        )  # fmt: skip
        return (out, *torch.autograd.grad(out, (self.kv, self.score, self.ape), self.grad_out))

    @torch.no_grad()
    def load(self, pack) -> None:
        """Copy a pack into the static buffers (what a data loader does before each replay)."""
        kv, score, ape, cu_seqlens, grad_out = pack
        tokens, rows, segments = kv.shape[0], grad_out.shape[0], cu_seqlens.numel() - 1
        self.kv[:tokens].copy_(kv)
        self.score[:tokens].copy_(score)
        self.ape.copy_(ape)
        self.cu_seqlens[: segments + 1].copy_(cu_seqlens)
        self.cu_seqlens[segments + 1 :].fill_(int(cu_seqlens[-1]))  # padding segments: empty
        self.grad_out.zero_()
        self.grad_out[:rows].copy_(grad_out)


def random_pack(seqlens, head_dim, device, gen):
    width = COFF * head_dim
    tokens = sum(seqlens)
    kv = torch.randn(tokens, width, generator=gen).to(device, torch.bfloat16)
    score = torch.randn(tokens, width, generator=gen).to(device, torch.bfloat16)
    ape = (0.5 * torch.randn(RATIO, width, generator=gen)).to(device)
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    rows = sum(s // RATIO for s in seqlens)
    grad_out = torch.randn(rows, head_dim, generator=gen).to(device, torch.bfloat16)
    return kv, score, ape, cu_seqlens, grad_out


def exact(pack):
    """The same pack through a call sized for it (its own T, B and row count)."""
    kv, score, ape, cu_seqlens, grad_out = (t.clone() for t in pack)
    leaves = [t.requires_grad_() for t in (kv, score, ape)]
    out = compressor_pool(*leaves, cu_seqlens, compute_cu_seqlens_comp(cu_seqlens, RATIO), ratio=RATIO, coff=COFF,
                          total_comp=grad_out.shape[0])  # fmt: skip
    return (out, *torch.autograd.grad(out, leaves, grad_out))


def check(static_results, pack) -> None:
    out, grad_kv, grad_score, grad_ape = static_results
    want_out, want_kv, want_score, want_ape = exact(pack)
    rows, tokens = want_out.shape[0], want_kv.shape[0]
    assert torch.equal(out[:rows], want_out), "real rows differ"
    assert torch.equal(grad_kv[:tokens], want_kv) and torch.equal(grad_score[:tokens], want_score)
    assert not grad_kv[tokens:].any() and not grad_score[tokens:].any(), "capacity rows got a gradient"
    assert rel_l2(grad_ape, want_ape) <= 1e-5  # a sum over rows: the capacity may change its order


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head_dim, t_max, b_max = (512, 3 * 8192, 8) if device.type == "cuda" else (32, 256, 4)
    packs_seqlens = ([[t_max // 2, t_max // 4 - 5, 7]] if device.type == "cpu" else [[8192, 8192, 8000, 13]]) + [
        [t_max // 3, 2],
        [t_max - 3],
        [1, 2, 3],
    ]
    gen = torch.Generator().manual_seed(0)
    packs = [random_pack(s, head_dim, device, gen) for s in packs_seqlens]
    step = StaticStep(t_max, b_max, head_dim, device)

    if device.type != "cuda":
        print("no CUDA device: CUDA graphs need a GPU. Running the static-capacity step eagerly instead,")
        print("on the same static buffers, and checking it against exact calls.")
        for seqlens, pack in zip(packs_seqlens, packs, strict=True):
            step.load(pack)
            check(step(), pack)
            print(f"  pack {seqlens}: capacity {step.capacity} rows, static results equal the exact ones")
        print("ok (eager fallback; no graph was captured)")
        return 0

    step.load(packs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture: every kernel is built here
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_results = step()
    print(f"captured forward + backward once (capacity {step.capacity} rows, T_max {t_max}, B_max {b_max})")
    for seqlens, pack in zip(packs_seqlens, packs, strict=True):
        step.load(pack)
        graph.replay()
        check(static_results, pack)
        print(f"  replay on pack {seqlens}: equal to an exact call")
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
