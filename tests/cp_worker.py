"""Rank processes for tests/test_distributed.py (gloo, CPU) and the two-GPU run (NCCL): each rank runs every world's
suite against the single-process op on the whole pack, writing ``ok`` per case to a file."""

from __future__ import annotations

import faulthandler
import os
import pickle
import random
import tempfile
import time
import traceback
from dataclasses import dataclass
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
    grad: str = "disjoint"  # each row's loss weight on one rank; shared: on every rank (world 2)
    reduce_ape: bool = False
    gather: bool = True  # False: the loss on out_local directly
    empty_rank: int | None = None  # pieces: a rank that holds no token
    cuts: int = 0  # pieces: random cuts (0: 2 per rank)
    tail: str = ""  # the fused tail (TAILS), "" for none


@dataclass
class Bad:
    """A bad layout or call; every rank must raise a ValueError containing ``expect``."""

    name: str
    expect: str


# Fused tails of the cases (csa_compressor.tail.random_tail's arguments).
TAILS = {
    "full": dict(rope_dim=4, positions=True),  # fp32 norm, interleaved pairs, per-segment offsets
    "rope-half": dict(norm=False, rope_dim=8, interleaved=False),  # the whole row rotated, half-split pairs
    "norm-bf16": dict(norm_dtype=torch.bfloat16),
}
# DeepSeek-V4's tail on the GPU cases: 64 rotary columns.
GPU_TAILS = {"v4": dict(rope_dim=64, positions=True), "v4-half-bf16": dict(norm_dtype=torch.bfloat16, rope_dim=64,
                                                                          interleaved=False)}  # fmt: skip

# Bad layouts or calls (see run_bad): name -> what the error says.
BAD = {
    "cu-differs": "cu_seqlens differs between ranks",
    "overlap": "are held by rank",
    "missing": "are held by no rank",
    "kinds-disagree": "layouts disagree",
    "kv-rows": "kv_local has",
    "world-size": "world_size",
    "indivisible": "divisible by 2*world_size",
    "bad-cu-one-rank": "non-decreasing",
    "validate-per-call": "kv_local has",
    "second-config": "kv_local has",
    "tail-offsets": "position_start shape",
    "tail-after-plain": "position_start shape",
    "tail-positions": "row positions must lie in",
}


def suite(world: int, kind: str) -> list:
    """The cases of one process group."""
    if kind == "nccl":
        return _nccl_suite(world)
    w, balanced = world, lambda *ns: tuple(2 * world * n for n in ns)
    cases = [
        Case(f"w{w}-r4c2-contig", (37, 3, 29, 1, 18), 4, 2, "contiguous", seed=w),
        Case(f"w{w}-r4c2-pieces", (37, 3, 29, 1, 18), 4, 2, "pieces", seed=w + 10, cuts=3 * w),
        Case(f"w{w}-r2c1-pieces", (13, 1, 22, 5), 2, 1, "pieces", head_dim=5, seed=w + 20, empty_rank=w - 1),
        Case(f"w{w}-r128c1-contig", (300, 70, 200), 128, 1, "contiguous", seed=w + 30, head_dim=4),
        Case(f"w{w}-r128c2-pieces", (400, 100, 150), 128, 2, "pieces", seed=w + 40, head_dim=4, cuts=w + 2),
        Case(f"w{w}-r4c2-tiny", (2, 3, 9, 1, 2, 7), 4, 2, "contiguous", seed=w + 50, gather=False),
        Case(f"w{w}-r4c2-balanced", balanced(5, 1, 3), 4, 2, "load_balanced", seed=w + 60, reduce_ape=True),
        Case(f"w{w}-r128c2-balanced", balanced(40, 3), 128, 2, "load_balanced", seed=w + 70, head_dim=4),
        Case(f"w{w}-r4c2-pieces-tail", (37, 3, 29, 1, 18), 4, 2, "pieces", head_dim=8, seed=w + 100, cuts=3 * w,
             tail="full"),
        Case(f"w{w}-r128c1-contig-tail", (300, 70, 200), 128, 1, "contiguous", head_dim=8, seed=w + 110,
             tail="rope-half"),
        Case(f"w{w}-r4c2-balanced-tail", balanced(5, 1, 3), 4, 2, "load_balanced", head_dim=8, seed=w + 120,
             reduce_ape=True, tail="norm-bf16"),
        Case(f"w{w}-r128c2-pieces-tail", (400, 100, 150), 128, 2, "pieces", head_dim=8, seed=w + 130, cuts=w + 2,
             tail="full"),
        Case(f"w{w}-r4c2-pieces-norm-bf16", (21, 6, 13), 4, 2, "pieces", head_dim=8, seed=w + 140, cuts=2 * w,
             tail="norm-bf16"),
    ]  # fmt: skip
    if world == 2:
        cases.append(Case("w2-r4c2-shared-grad", (21, 14), 4, 2, "pieces", seed=80, grad="shared", cuts=5))
    if world == 2 and triton_on_cpu():
        cases += [
            Case("w2-r4c2-triton", (13, 2, 10), 4, 2, "pieces", backend="triton", head_dim=8, seed=81, cuts=4),
            Case("w2-r128c1-triton", (270,), 128, 1, "contiguous", backend="triton", head_dim=8, seed=82),
            Case("w2-r4c2-triton-tail", (13, 2, 10), 4, 2, "pieces", backend="triton", head_dim=8, seed=83, cuts=4,
                 tail="full"),
        ]  # fmt: skip
    if world == 4:
        cases.append(Case("w4-r4c2-empty-rank", (9, 2, 6), 4, 2, "pieces", seed=90, empty_rank=1, cuts=7))
    cases += _random_cases(world, 8)
    # A good case after the bad ones: the group is still in step.
    return [*cases, *(Bad(*kv) for kv in BAD.items()), Case(f"w{w}-after-errors", (17, 11), 4, 2, "pieces", seed=99)]


def _random_cases(world: int, count: int) -> list[Case]:
    """Random packs (segments shorter than ratio included), configurations, layouts, tails (the rotations where
    head_dim allows them), in-op reductions and losses on the gathered or the local rows."""
    rng = random.Random(7919 * world)
    cases = []
    for i in range(count):
        ratio, coff = rng.choice([(4, 2), (128, 1), (128, 2), (2, 1), (4, 1), (3, 2), (8, 1)])
        layout = rng.choice(["contiguous", "load_balanced", "pieces"])
        seqlens = [rng.randint(1, 3 * ratio) for _ in range(rng.randint(1, 5))]
        if layout == "load_balanced":
            seqlens = [-(-n // (2 * world)) * 2 * world for n in seqlens]
        empty = rng.choice([None, rng.randrange(world)])
        head_dim = rng.choice([3, 4, 6, 8, 10])
        tail = rng.choice(["", *TAILS] if head_dim >= 8 else ["", "norm-bf16"])
        cases.append(Case(f"w{world}-random{i}-r{ratio}c{coff}-{layout}{'-' + tail if tail else ''}", tuple(seqlens),
                          ratio, coff, layout, head_dim=head_dim, seed=rng.randrange(1 << 16), empty_rank=empty,
                          cuts=rng.randint(1, 3 * world), tail=tail, reduce_ape=rng.random() < 0.3,
                          gather=rng.random() < 0.8))  # fmt: skip
    return cases


def triton_on_cpu() -> bool:
    """Whether triton runs on CPU tensors here (the interpreter; on a GPU machine the NCCL suite covers triton)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _nccl_suite(world: int) -> list:
    """Issue 28's checks on two GPUs: full head_dim, both GPU backends, Megatron's THD splits and a ragged one."""
    cases, balanced = [], lambda *ns: tuple(2 * world * n for n in ns)
    for b in ("cute", "triton"):
        cases += [
            Case(f"{b}-r4c2-contig", (5000, 1237, 3003, 7), 4, 2, "contiguous", b, 512, seed=1),
            Case(f"{b}-r4c2-balanced", balanced(1001, 37, 499), 4, 2, "load_balanced", b, 512, seed=2),
            Case(f"{b}-r4c2-pieces", (3001, 17, 999), 4, 2, "pieces", b, 512, seed=3, cuts=9),
            Case(f"{b}-r128c1-contig", (9000, 300, 4101), 128, 1, "contiguous", b, 512, seed=4),
            Case(f"{b}-r128c1-balanced", balanced(2001, 97), 128, 1, "load_balanced", b, 512, seed=5, reduce_ape=True),
            Case(f"{b}-r4c2-pieces-tail", (3001, 17, 999), 4, 2, "pieces", b, 512, seed=6, cuts=9, tail="v4"),
            Case(f"{b}-r128c1-contig-tail", (9000, 300, 4101), 128, 1, "contiguous", b, 128, seed=7,
                 tail="v4-half-bf16"),
        ]  # fmt: skip
    return [*cases, *(Bad(n, BAD[n]) for n in ("cu-differs", "overlap"))]


# ---------------------------------------------------------------- one rank


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

    if case.layout == "pieces":
        pieces = _random_pieces(int(cu[-1]), world, random.Random(case.seed), case.cuts, case.empty_rank)
        return CPLayout.from_pieces(cu, pieces[rank])
    return getattr(CPLayout, case.layout)(cu, rank, world)  # contiguous | load_balanced


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
    from csa_compressor.testing import bitwise_equal, make_pack
    from csa_compressor.thd import row_layout

    p = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, seed=case.seed, device=device)
    mine, total = _weights(case, p.total_comp, case.head_dim, rank, world, device)
    leaves = [t.clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    ref_tail, tail = tail_kwargs(case.tail, p, case.seed)
    ref = compressor_pool(*leaves, p.cu_seqlens, p.cu_seqlens_comp, case.ratio, case.coff, p.total_comp, case.backend,
                          **ref_tail)  # fmt: skip
    _backward(ref, total)
    layout = _layout(case, p.cu_seqlens, rank, world)
    idx = layout.local_token_index(device)
    kv, score = (layout.select_local(t).requires_grad_(True) for t in (p.kv, p.score))
    ape = p.ape.clone().requires_grad_(True)
    out, rows = compressor_pool_cp(kv, score, ape, layout, ratio=case.ratio, coff=case.coff, group=group,
                                   backend=case.backend, reduce_ape_grad=case.reduce_ape, **tail)  # fmt: skip
    problems = []
    first_token = row_layout(p.cu_seqlens, p.cu_seqlens_comp, p.total_comp, case.ratio)[0]
    expected_rows = torch.nonzero(torch.isin(first_token + case.ratio - 1, idx)).flatten()
    if not torch.equal(rows, expected_rows):
        problems.append(
            f"rows {rows.tolist()[:8]}... != rows whose last token is local {expected_rows.tolist()[:8]}..."
        )
    if not bitwise_equal(out.detach(), ref.detach()[expected_rows]):
        problems.append("out_local differs from the single-process rows")
    if case.gather:
        out_all = gather_rows(out, rows, layout, group=group)
        if not bitwise_equal(out_all.detach(), ref.detach()):
            problems.append("gather_rows differs from the single-process output")
        _backward(out_all, mine)
    else:
        _backward(out, total[rows])
    for name, got, want in (("kv", kv.grad, leaves[0].grad[idx]), ("score", score.grad, leaves[1].grad[idx])):
        if not bitwise_equal(got, want):
            problems.append(f"grad_{name}: {int((got != want).any(1).sum())} of {got.shape[0]} local tokens differ")
    params = [("grad_ape", ape.grad, leaves[2].grad)]
    if tail.get("norm_weight") is not None:
        params.append(("grad_norm_weight", tail["norm_weight"].grad, ref_tail["norm_weight"].grad))
    for name, got, want in params:
        if got is None:  # still in the collective below, so that the group stays in step
            problems.append(f"{name} is None")
            got = torch.full_like(want, float("nan"))
        summed = got.double().clone()
        if not case.reduce_ape:
            dist.all_reduce(summed, group=group)
        err = float((summed - want.double()).norm() / want.double().norm().clamp_min(1e-30))
        # A bf16 weight's partial gradient is rounded to bf16 on each rank unless the op reduces it first.
        bound = 1e-6 if got.dtype == torch.float32 or case.reduce_ape else world * 2**-8
        if err > bound:
            problems.append(f"{name} relative error {err:.3g} > {bound:.3g}")
    return {"ok": not problems, "problems": problems, "rows": int(rows.numel()), "tokens": int(kv.shape[0])}


def tail_kwargs(name: str, p, seed: int) -> tuple[dict, dict]:
    """The tail ``TAILS[name]`` as two sets of keywords, the reference's and the CP call's (each with its own
    norm weight leaf); two empty ones for ``name`` "" (no tail)."""
    if not name:
        return {}, {}
    from csa_compressor.tail import random_tail

    kw = random_tail(p, seed=seed, **(TAILS | GPU_TAILS)[name]).arguments()
    weight = kw["norm_weight"]
    if weight is None:
        return kw, dict(kw)
    return ({**kw, "norm_weight": weight.clone().requires_grad_(True)},
            {**kw, "norm_weight": weight.clone().requires_grad_(True)})  # fmt: skip


def _backward(out: torch.Tensor, weights: torch.Tensor) -> None:
    """Backward with ``weights`` as the output's gradient, as a loss (``out.backward(weights)`` imports sympy: slow)."""
    (out.float() * weights.float()).sum().backward()


def run_bad(bad: Bad, rank: int, world: int, group, device) -> dict:
    """Build the bad layout (or call) of ``bad`` and report whether this rank raised the expected error."""
    from csa_compressor.distributed import CPLayout, compressor_pool_cp

    name, last, validate = bad.name, rank == world - 1, False
    seqlens = [2 * world * 3, 2 * world * 2 + (name == "indivisible")]
    cu = torch.tensor([0, seqlens[0], sum(seqlens)], dtype=torch.int32, device=device)
    if name == "cu-differs":
        shifted = cu - torch.tensor([0, 1, 0], dtype=torch.int32, device=device)
        layout = CPLayout.contiguous(cu if rank else shifted, rank, world)
    elif name in ("overlap", "missing"):  # rank 0 also holds rank 1's first token / the last token is lost
        total = int(cu[-1])
        start, end = rank * total // world, (rank + 1) * total // world
        end += (name == "overlap" and rank == 0) - (name == "missing" and last)
        layout = CPLayout.from_pieces(cu, [(start, end - start)])
    elif name == "kinds-disagree":
        layout = (CPLayout.contiguous if rank == 0 else CPLayout.load_balanced)(cu, rank, world)
    elif name == "world-size":
        layout = CPLayout.contiguous(cu, rank, world + last)
    elif name == "indivisible":
        layout = CPLayout.load_balanced(cu, rank, world)
    elif name == "bad-cu-one-rank":
        wrong = torch.tensor([0, seqlens[0] + 3, seqlens[0]], dtype=torch.int32, device=device)
        layout = CPLayout.contiguous(wrong if rank == 0 else cu, rank, world)
    else:  # kv-rows, validate-per-call, second-config
        layout = CPLayout.contiguous(cu, rank, world)
        validate = name == "validate-per-call"
    kv = torch.randn(layout.local_tokens if layout._error is None else 4, 16, device=device).to(torch.bfloat16)
    ape, ratio, coff = torch.zeros(4, 16, device=device), 4, 2
    if name in ("validate-per-call", "second-config", "tail-after-plain"):
        # A good first call, then a bad one on the last rank (found by validate=True, or as another
        # configuration's first call, a tail's included).
        compressor_pool_cp(kv, kv, ape, layout, ratio=4, coff=2, group=group, validate=validate)
        if name == "second-config":
            ratio, coff, ape = 2, 1, torch.zeros(2, 16, device=device)
    if name in ("kv-rows", "validate-per-call", "second-config") and last:
        kv = kv[:-1]
    tail = {}
    if name in ("tail-offsets", "tail-after-plain"):  # one offset per global segment, one too few on the last rank
        table = torch.ones(64, 4, device=device)
        tail = dict(rope_cos=table, rope_sin=table, rope_dim=8, position_start=torch.zeros(2 - last, dtype=torch.int32,
                                                                                              device=device))  # fmt: skip
    if name == "tail-positions":  # the validation mode: a segment's rows past the tables (on every rank's call)
        table = torch.ones(64, 4, device=device)
        start = torch.tensor([0, 60], dtype=torch.int32, device=device)
        tail, validate = dict(rope_cos=table, rope_sin=table, rope_dim=8, position_start=start), True
    try:
        out, rows = compressor_pool_cp(kv, kv, ape, layout, ratio=ratio, coff=coff, group=group,
                                       validate=validate or None, **tail)  # fmt: skip
    except ValueError as exc:
        ok = bad.expect in str(exc)
        return {"ok": ok, "problems": [] if ok else [str(exc)], "message": str(exc)}
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
            extra = dict(timeout=timedelta(seconds=120), device_id=device)
        else:
            device, extra = torch.device("cpu"), dict(timeout=timedelta(seconds=100))
        dist.init_process_group(kind, init_method=f"file://{store_path}", rank=rank, world_size=size, **extra)
        for world in worlds:
            group = dist.new_group(list(range(world))) if world < size else dist.group.WORLD
            for item in suite(world, kind) if rank < world else ():
                if only and item.name not in only:
                    continue
                start = time.perf_counter()
                try:
                    runner = run_bad if isinstance(item, Bad) else run_case
                    results[world][item.name] = runner(item, rank, world, group, device)
                except Exception:  # reported to the parent, which fails the case
                    results[world][item.name] = {"ok": False, "problems": [traceback.format_exc(limit=8)]}
                results[world][item.name]["seconds"] = time.perf_counter() - start
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # reported to the parent, which fails every case
        for world in worlds:
            results[world]["<setup>"] = {"ok": False, "problems": [traceback.format_exc(limit=8)]}
    with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def launch(worlds=(2, 3, 4), kind: str = "gloo", timeout_s: float = 100.0, only=None) -> dict[int, list[dict]]:
    """Run the suites of ``worlds`` on ``max(worlds)`` processes; per world, per rank, ``{case: result}``; a rank past
    ``timeout_s`` is killed and reported as ``<timeout>``."""
    import torch.multiprocessing as mp

    if kind == "nccl":  # fresh interpreters: a forked rank could inherit an initialised CUDA context
        ctx = mp.get_context("spawn")
    else:  # every rank forks from a server that has imported torch once (a fresh interpreter costs seconds)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.cp_worker", "csa_compressor.distributed", "csa_compressor.testing"])
    size = max(worlds)
    with tempfile.TemporaryDirectory() as tmp:
        args = (tuple(worlds), kind, os.path.join(tmp, "store"), tmp, only, max(1.0, timeout_s - 5.0))
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
            path, stack = os.path.join(tmp, f"rank{r}.pkl"), os.path.join(tmp, f"stack{r}.txt")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    per_rank.append(pickle.load(f))
                continue
            why = "hung (killed at the timeout)" if r in hung else f"exited {procs[r].exitcode} without results"
            if os.path.exists(stack):
                with open(stack) as f:
                    why += "; its stack:\n" + f.read()[-3000:]
            per_rank.append({w: {"<timeout>": {"ok": False, "problems": [f"rank {r} {why}"]}} for w in worlds})
        return {w: [per_rank[r][w] for r in range(w)] for w in worlds}
