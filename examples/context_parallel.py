"""Training steps of a DeepSeek-V4-style compressor block over a context-parallel group.

Each rank holds its share of every sequence (Transformer Engine's load-balanced THD split: chunk ``r`` and chunk
``2*world-1-r``), projects its own tokens, and ``Compressor.forward_cp`` pools them with the fused RMSNorm and RoPE,
moving only the halo between ranks. ``gather_rows`` gives every rank all compressed rows (as Megatron's all-gather of
the compressed KV does); the parameter gradients are each rank's partial sums, all-reduced over the group before the
optimizer step as a trainer's data- and context-parallel reduction does. The first step is checked against the
module run on the whole pack in one process: the same loss bitwise, the reduced gradients up to their order of
summation.

    python examples/context_parallel.py                       # two CPU processes, gloo
    torchrun --nproc-per-node 2 examples/context_parallel.py  # one process per GPU, NCCL
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from csa_compressor import Compressor
from csa_compressor.distributed import CPLayout, gather_rows

STEPS = 3


def build(device: torch.device):
    """The same block, pack and target on every rank (one seed)."""
    torch.manual_seed(0)
    on_gpu = device.type == "cuda"
    hidden, head_dim, rope_dim = (1024, 512, 64) if on_gpu else (32, 16, 8)
    seqlens = (4096, 2048, 1024) if on_gpu else (48, 16, 32)  # divisible by 2 * world for the balanced split
    block = Compressor(hidden, head_dim, ratio=4, rope_dim=rope_dim, max_position=8192, device=device,
                       backend="auto" if on_gpu else "reference")  # fmt: skip
    x = torch.randn(sum(seqlens), hidden, device=device).to(torch.bfloat16)
    cu_seqlens = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    position_start = torch.arange(len(seqlens), dtype=torch.int32, device=device) * 100
    rows = sum(n // 4 for n in seqlens)
    target = torch.randn(rows, head_dim, device=device).to(torch.bfloat16)
    return block, x, cu_seqlens, position_start, target


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).square().mean()


def train(rank: int, world: int, device: torch.device) -> None:
    block, x, cu_seqlens, position_start, target = build(device)
    layout = CPLayout.load_balanced(cu_seqlens, rank, world)
    x_local = layout.select_local(x)  # in a real job each rank loads only its own tokens
    if rank == 0:  # the reference: the whole pack in one process, first step only
        reference = Compressor(x.shape[1], block.head_dim, ratio=4, rope_dim=block.rope_dim, max_position=8192,
                               device=device, backend=block.backend)  # fmt: skip
        reference.load_state_dict(block.state_dict())
        ref_loss = loss_of(reference(x, cu_seqlens, position_start=position_start), target)
        ref_loss.backward()
    optimizer = torch.optim.SGD(block.parameters(), lr=0.5)
    for step in range(STEPS):
        out_local, rows = block.forward_cp(x_local, layout, position_start=position_start)
        out = gather_rows(out_local, rows, layout)  # every compressed row on every rank
        loss = loss_of(out, target)
        optimizer.zero_grad()
        # Each rank's share of the loss (in attention: its own queries' terms), so that the shares sum to the loss;
        # gather_rows's backward sums the rows' gradients over the ranks.
        (loss / world).backward()
        for p in block.parameters():  # the trainer's reduction of parameter gradients over the CP group
            dist.all_reduce(p.grad)
        if step == 0 and rank == 0:
            assert torch.equal(loss, ref_loss), (loss, ref_loss)
            for (name, p), q in zip(block.named_parameters(), reference.parameters(), strict=True):
                err = (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm().clamp_min(1e-30)
                assert err < (1e-5 if p.dtype == torch.float32 else 2e-2), (name, float(err))
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f}", flush=True)


def worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train(rank, world, torch.device("cpu"))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:  # under torchrun
        on_gpu = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu else torch.device("cpu")
        if on_gpu:
            torch.cuda.set_device(device)  # before the process group: NCCL binds each rank to its device
        dist.init_process_group("nccl" if on_gpu else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        train(rank, world, device)
        dist.barrier()
        dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(2, os.path.join(tmp, "init")), nprocs=2)
    if "RANK" not in os.environ or int(os.environ["RANK"]) == 0:
        print("ok: the CP steps' first loss equals the one-process module's, gradients agree")


if __name__ == "__main__":
    main()
