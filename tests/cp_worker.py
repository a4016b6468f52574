"""Rank processes for tests/test_distributed.py (gloo on the CPU) and the two-GPU run (NCCL): each rank runs every
world's suite and compares with the single-process op on the whole pack, writing ``ok`` per case to a file.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import random
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    seqlens: tuple[int, ...]
    ratio: int
    coff: int
    layout: str  # contiguous | load_balanced | pieces
    backend: str = "reference"
    head_dim: int = 6
    seed: int = 0
    grad: str = "disjoint"  # disjoint: each row's loss weight on one rank; shared: on every rank (world 2)
    reduce_ape: bool = False
    gather: bool = True  # False: the loss on out_local directly
    empty_rank: int | None = None  # pieces: a rank that holds no token
    cuts: int = 0  # pieces: random cuts (0: 2 per rank)


@dataclass
class Bad:
    """A bad layout or call; every rank must raise a ValueError containing ``expect``."""

    name: str
    expect: str
    build: str = field(default="")


def _t(*seqlens):
    return tuple(seqlens)


def suite(world: int, kind: str) -> list:
    """The cases of one process group."""
    if kind == "nccl":
        return _nccl_suite(world)
    cases = [
        Case(f"w{world}-r4c2-contig", _t(37, 3, 29, 1, 18), 4, 2, "contiguous", seed=world),
        Case(f"w{world}-r4c2-pieces", _t(37, 3, 29, 1, 18), 4, 2, "pieces", seed=world + 10, cuts=3 * world),
        Case(
            f"w{world}-r2c1-pieces", _t(13, 1, 22, 5), 2, 1, "pieces", head_dim=5, seed=world + 20, empty_rank=world - 1
        ),
        Case(f"w{world}-r128c1-contig", _t(300, 70, 200), 128, 1, "contiguous", seed=world + 30, head_dim=4),
        Case(
            f"w{world}-r128c2-pieces", _t(400, 100, 150), 128, 2, "pieces", seed=world + 40, head_dim=4, cuts=world + 2
        ),
        Case(f"w{world}-r4c2-tiny", _t(2, 3, 9, 1, 2, 7), 4, 2, "contiguous", seed=world + 50, gather=False),
    ]
    balanced = tuple(2 * world * n for n in (5, 1, 3))
    cases.append(Case(f"w{world}-r4c2-balanced", balanced, 4, 2, "load_balanced", seed=world + 60, reduce_ape=True))
    cases.append(Case(f"w{world}-r128c2-balanced", tuple(2 * world * n for n in (40, 3)), 128, 2, "load_balanced",
                      seed=world + 70, head_dim=4))  # fmt: skip
    if world == 2:
        cases.append(Case("w2-r4c2-shared-grad", _t(21, 14), 4, 2, "pieces", seed=80, grad="shared", cuts=5))
    if world == 2 and triton_on_cpu():
        cases += [
            Case("w2-r4c2-triton", _t(13, 2, 10), 4, 2, "pieces", backend="triton", head_dim=8, seed=81, cuts=4),
            Case("w2-r128c1-triton", (270,), 128, 1, "contiguous", backend="triton", head_dim=8, seed=82),
        ]
    if world == 4:
        cases.append(Case("w4-r4c2-empty-rank", _t(9, 2, 6), 4, 2, "pieces", seed=90, empty_rank=1, cuts=7))
    cases += _random_cases(world, 5)
    bad = [
        Bad("cu-differs", "cu_seqlens differs between ranks"),
        Bad("overlap", "are held by rank"),
        Bad("missing", "are held by no rank"),
        Bad("kinds-disagree", "layouts disagree"),
        Bad("kv-rows", "kv_local has"),
        Bad("world-size", "world_size"),
        Bad("indivisible", "divisible by 2*world_size"),
        Bad("bad-cu-one-rank", "non-decreasing"),
        Bad("validate-per-call", "kv_local has"),
        Bad("second-config", "kv_local has"),
    ]
    # A good case after the bad ones: the group is still in step.
    return [*cases, *bad, Case(f"w{world}-after-errors", _t(17, 11), 4, 2, "pieces", seed=99)]


def _random_cases(world: int, count: int) -> list[Case]:
    """Random packs (segments shorter than ratio included), configurations and layouts."""
    rng = random.Random(7919 * world)
    cases = []
    for i in range(count):
        ratio, coff = rng.choice([(4, 2), (128, 1), (128, 2), (2, 1), (4, 1)])
        layout = rng.choice(["contiguous", "load_balanced", "pieces"])
        seqlens = [rng.randint(1, 3 * ratio) for _ in range(rng.randint(1, 5))]
        if layout == "load_balanced":
            seqlens = [-(-n // (2 * world)) * 2 * world for n in seqlens]
        empty = rng.choice([None, rng.randrange(world)])
        cases.append(Case(f"w{world}-random{i}-r{ratio}c{coff}-{layout}", tuple(seqlens), ratio, coff, layout,
                          head_dim=rng.choice([3, 4, 6, 8]), seed=rng.randrange(1 << 16), empty_rank=empty,
                          cuts=rng.randint(1, 3 * world)))  # fmt: skip
    return cases


def triton_on_cpu() -> bool:
    """Whether triton runs on CPU tensors here (the interpreter; on a GPU machine the NCCL suite covers triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _nccl_suite(world: int) -> list:
    """Issue 28's checks on two GPUs: full head_dim, both GPU backends, Megatron's THD splits and a ragged one."""
    cases = []
    for backend in ("cute", "triton"):
        cases += [
            Case(f"{backend}-r4c2-contig", _t(5000, 1237, 3003, 7), 4, 2, "contiguous", backend, 512, seed=1),
            Case(f"{backend}-r4c2-balanced", tuple(2 * world * n for n in (1001, 37, 499)), 4, 2, "load_balanced",
                 backend, 512, seed=2),
            Case(f"{backend}-r4c2-pieces", _t(3001, 17, 999), 4, 2, "pieces", backend, 512, seed=3, cuts=9),
            Case(f"{backend}-r128c1-contig", _t(9000, 300, 4101), 128, 1, "contiguous", backend, 512, seed=4),
            Case(f"{backend}-r128c1-balanced", tuple(2 * world * n for n in (2001, 97)), 128, 1, "load_balanced",
                 backend, 512, seed=5, reduce_ape=True),
        ]  # fmt: skip
    return [*cases, Bad("cu-differs", "cu_seqlens differs between ranks"), Bad("overlap", "are held by rank")]


# ---------------------------------------------------------------- one rank


def _pack(case: Case, device):
    from csa_compressor.testing import make_pack

    return make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, seed=case.seed, device=device)


def _random_pieces(total: int, world: int, rng: random.Random, cuts: int, empty_rank):
    bounds = sorted(rng.sample(range(1, total), min(cuts or 2 * world, total - 1)))
    spans = [(a, b - a) for a, b in zip([0, *bounds], [*bounds, total], strict=True)]
    ranks = [r for r in range(world) if r != empty_rank]
    pieces = [[] for _ in range(world)]
    for i, span in enumerate(spans):  # every holding rank gets one span, the rest at random
        pieces[ranks[i] if i < len(ranks) else rng.choice(ranks)].append(span)
    for p in pieces:
        rng.shuffle(p)
    return pieces


def _layout(case: Case, cu, rank: int, world: int):
    from csa_compressor.distributed import CPLayout

    if case.layout == "contiguous":
        return CPLayout.contiguous(cu, rank, world)
    if case.layout == "load_balanced":
        return CPLayout.load_balanced(cu, rank, world)
    pieces = _random_pieces(int(cu[-1]), world, random.Random(case.seed), case.cuts, case.empty_rank)
    return CPLayout.from_pieces(cu, pieces[rank])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _weights(case: Case, rows: int, d: int, rank: int, world: int, device):
    """This rank's loss weights on the gathered rows, and their sum over the ranks (the reference's)."""
    gen = torch.Generator().manual_seed(1000 + case.seed)
    full = torch.randn(world, rows, d, generator=gen).to(torch.bfloat16)
    if case.grad == "disjoint":
        owner = torch.arange(rows) % world
        full = full * (owner[None, :, None] == torch.arange(world)[:, None, None])
        return full[rank].to(device), full.sum(0).to(device)
    return full[rank].to(device), (full[0].float() + full[1].float()).to(torch.bfloat16).to(device)


def run_case(case: Case, rank: int, world: int, group, device) -> dict:
    from csa_compressor import compressor_pool
    from csa_compressor.distributed import compressor_pool_cp, gather_rows

    p = _pack(case, device)
    mine, total = _weights(case, p.total_comp, case.head_dim, rank, world, device)
    leaves = [t.clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    ref = compressor_pool(*leaves, p.cu_seqlens, p.cu_seqlens_comp, case.ratio, case.coff, p.total_comp, case.backend)
    _backward(ref, total)
    layout = _layout(case, p.cu_seqlens, rank, world)
    idx = layout.local_token_index(device)
    kv, score = (layout.select_local(t).requires_grad_(True) for t in (p.kv, p.score))
    ape = p.ape.clone().requires_grad_(True)
    out, rows = compressor_pool_cp(
        kv, score, ape, layout, ratio=case.ratio, coff=case.coff, group=group, backend=case.backend,
        reduce_ape_grad=case.reduce_ape,
    )  # fmt: skip
    problems = []
    last_token = _row_last_tokens(p, case.ratio)
    expected_rows = torch.nonzero(torch.isin(last_token, idx)).flatten()
    if not torch.equal(rows, expected_rows):
        problems.append(
            f"rows {rows.tolist()[:8]}... != rows whose last token is local {expected_rows.tolist()[:8]}..."
        )
    if not _bits_equal(out.detach(), ref.detach()[expected_rows]):
        problems.append("out_local differs from the single-process rows")
    if case.gather:
        out_all = gather_rows(out, rows, layout, group=group)
        if not _bits_equal(out_all.detach(), ref.detach()):
            problems.append("gather_rows differs from the single-process output")
        _backward(out_all, mine)
    else:
        _backward(out, total[rows])
    for name, got, want in (("kv", kv.grad, leaves[0].grad[idx]), ("score", score.grad, leaves[1].grad[idx])):
        if not _bits_equal(got, want):
            bad = int((got != want).any(1).sum())
            problems.append(f"grad_{name}: {bad} of {got.shape[0]} local tokens differ")
    problems += _check_ape(ape.grad, leaves[2].grad, case, group)
    return {"ok": not problems, "problems": problems, "rows": int(rows.numel()), "tokens": int(kv.shape[0])}


def _backward(out: torch.Tensor, weights: torch.Tensor) -> None:
    """Backward with ``weights`` as the output's gradient, as a loss (``out.backward(weights)`` imports sympy: slow)."""
    (out.float() * weights.float()).sum().backward()


def _row_last_tokens(p, ratio: int) -> torch.Tensor:
    from csa_compressor.thd import row_layout

    t0, _, _ = row_layout(p.cu_seqlens, p.cu_seqlens_comp, p.total_comp, ratio)
    return t0 + ratio - 1


def _check_ape(grad, ref, case: Case, group) -> list[str]:
    summed = grad.double().clone()
    if not case.reduce_ape:
        dist.all_reduce(summed, group=group)
    err = float((summed - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return [] if err <= 1e-6 else [f"grad_ape relative error {err:.3g} > 1e-6"]


def run_bad(bad: Bad, rank: int, world: int, group, device) -> dict:
    """Build the bad layout (or call) of ``bad`` and report whether this rank raised the expected error."""
    from csa_compressor.distributed import CPLayout, compressor_pool_cp

    seqlens = [2 * world * 3, 2 * world * 2 + 1] if bad.name == "indivisible" else [2 * world * 3, 2 * world * 2]
    cu = torch.tensor([0, seqlens[0], sum(seqlens)], dtype=torch.int32, device=device)
    total = int(cu[-1])
    width, validate = 8, False
    rows = None
    if bad.name == "cu-differs":
        layout = CPLayout.contiguous(
            cu if rank else cu - torch.tensor([0, 1, 0], dtype=torch.int32, device=device), rank, world
        )
    elif bad.name in ("overlap", "missing"):  # rank 0 also holds rank 1's first token / the last token is lost
        start, end = rank * total // world, (rank + 1) * total // world
        end += (bad.name == "overlap" and rank == 0) - (bad.name == "missing" and rank == world - 1)
        layout = CPLayout.from_pieces(cu, [(start, end - start)])
    elif bad.name == "kinds-disagree":
        layout = (CPLayout.contiguous if rank == 0 else CPLayout.load_balanced)(cu, rank, world)
    elif bad.name == "world-size":
        layout = CPLayout.contiguous(cu, rank, world + (rank == world - 1))
    elif bad.name == "indivisible":
        layout = CPLayout.load_balanced(cu, rank, world)
    elif bad.name == "bad-cu-one-rank":
        wrong = torch.tensor([0, seqlens[0] + 3, seqlens[0]], dtype=torch.int32, device=device)
        layout = CPLayout.contiguous(wrong if rank == 0 else cu, rank, world)
    else:  # kv-rows, validate-per-call, second-config
        layout = CPLayout.contiguous(cu, rank, world)
        validate = bad.name == "validate-per-call"
    local = layout.local_tokens if layout._error is None else 4
    kv = torch.randn(local, 2 * width, device=device).to(torch.bfloat16)
    ape = torch.zeros(4, 2 * width, device=device)
    ratio, coff = 4, 2
    if bad.name in ("validate-per-call", "second-config"):
        # A good first call; then a bad one on the last rank (checked by validate=True, or as another
        # configuration's first call).
        compressor_pool_cp(kv, kv, ape, layout, ratio=4, coff=2, group=group, validate=validate)
        if bad.name == "second-config":
            ratio, coff, ape = 2, 1, torch.zeros(2, 2 * width, device=device)
    if bad.name in ("kv-rows", "validate-per-call", "second-config") and rank == world - 1:
        kv = kv[:-1]
    try:
        out, rows = compressor_pool_cp(
            kv, kv, ape, layout, ratio=ratio, coff=coff, group=group, validate=validate or None
        )
    except ValueError as exc:
        message = str(exc)
        return {"ok": bad.expect in message, "problems": [] if bad.expect in message else [message], "message": message}
    return {"ok": False, "problems": [f"no ValueError (got {tuple(out.shape)} rows {rows.numel()})"]}


def main(rank: int, worlds, kind: str, store_path: str, result_dir: str, only, stack_after_s: float) -> None:
    """One rank of the largest world: every suite in turn; a rank still running after ``stack_after_s`` dumps its stack."""
    torch.set_num_threads(1)
    stack_file = open(os.path.join(result_dir, f"stack{rank}.txt"), "w")  # left open: the dump may come at any time
    faulthandler.dump_traceback_later(stack_after_s, file=stack_file)
    results: dict[int, dict] = {w: {} for w in worlds}
    try:
        size = max(worlds)
        if kind == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=size,
                                    timeout=timedelta(seconds=120), device_id=device)  # fmt: skip
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size,
                                    timeout=timedelta(seconds=100))  # fmt: skip
        for world in worlds:
            group = dist.new_group(list(range(world))) if world < size else dist.group.WORLD
            if rank < world:
                _run_suite(results[world], world, kind, rank, group, device, only)
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # reported to the parent, which fails every case
        for world in worlds:
            results[world]["<setup>"] = {"ok": False, "problems": [traceback.format_exc(limit=8)]}
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def _run_suite(results: dict, world: int, kind: str, rank: int, group, device, only) -> None:
    for item in suite(world, kind):
        if only and item.name not in only:
            continue
        start = time.perf_counter()
        try:
            runner = run_bad if isinstance(item, Bad) else run_case
            results[item.name] = runner(item, rank, world, group, device)
        except Exception:  # reported to the parent, which fails the case
            results[item.name] = {"ok": False, "problems": [traceback.format_exc(limit=8)]}
        results[item.name]["seconds"] = time.perf_counter() - start


def launch(worlds=(2, 3, 4), kind: str = "gloo", timeout_s: float = 100.0, only=None) -> dict[int, list[dict]]:
    """Run the suites of ``worlds`` on ``max(worlds)`` processes; per world, per rank, ``{case: result}``; a rank past
    ``timeout_s`` is killed and reported as ``<timeout>``."""
    import torch.multiprocessing as mp

    if kind == "nccl":  # fresh interpreters: a forked rank could inherit an initialised CUDA context
        ctx = mp.get_context("spawn")
    else:
        # A fork server that has imported torch once: every rank forks from it (a fresh interpreter costs
        # seconds).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.cp_worker", "csa_compressor.distributed", "csa_compressor.testing"])
    size = max(worlds)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        args = (tuple(worlds), kind, store, tmp, only, max(1.0, timeout_s - 5.0))
        procs = [ctx.Process(target=main, args=(r, *args), daemon=True) for r in range(size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        per_rank = []
        for r in range(size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    per_rank.append(pickle.load(f))
            else:
                why = "hung (killed at the timeout)" if r in hung else f"exited {procs[r].exitcode} without results"
                stack = os.path.join(tmp, f"stack{r}.txt")
                if os.path.exists(stack):
                    with open(stack) as f:
                        why += "; its stack:\n" + f.read()[-3000:]
                per_rank.append({w: {"<timeout>": {"ok": False, "problems": [f"rank {r} {why}"]}} for w in worlds})
        return {w: [per_rank[r][w] for r in range(w)] for w in worlds}
