"""Cost of the context-parallel pooling (``csa_compressor.distributed``) on GPUs.

One GPU (issue 27)::

    python3 benchmarks/cp_bench.py --out $OUT/cp_one_gpu

runs a world of one rank without a process group: ``whole`` (the layout holds the pack in one piece: the
CP call is the plain op behind the layout's checks) and ``pieces2`` / ``pieces8`` (the pack cut into 2 or 8
pieces at offsets that split groups, held in reverse order: the boundary pack, the self halo and the row
placement all run, with no collective). Per case, split and direction it reports the plain op's and the
CP call's wall (CUDA events around one call on an idle device, median) and warm kernel time (profiler),
and their differences: the host and the device cost that the halo assembly adds per call; the JSON records
also carry ``extra_kernels``, the device activities the CP call adds by name ([count, us] per call).

Two GPUs (issue 28, on nvidia-h200-x2)::

    python3 benchmarks/cp_bench.py --world 2 --out $OUT/cp_two_gpus

spawns one process per GPU (NCCL) and measures, for a sequence of 2x8192 and one of 2x65536 tokens split
over the two GPUs (contiguous, load-balanced, and cut so that a group straddles the ranks): the CP op
forward and forward+backward (with and without ``gather_rows``), the single-GPU op on one rank's share (a
sequence of half the tokens), the NCCL kernels' own time in the halo exchange and in ``gather_rows``
(profiler), and the bytes the exchange moved against the formula of docs/distributed.md.

Both write ``<out>/cp_bench.json`` (records) and ``<out>/cp_bench.md`` (tables) and print the tables.

Host only (CPU, no GPU needed)::

    python3 benchmarks/cp_bench.py --host-only --out /tmp/cp_host

the one-GPU cases' configurations on small CPU packs with the reference backend, every op's kernel launch
stubbed out: per split and direction, the op launches and the other launches (top-level aten ops that would
launch a kernel on a GPU) of the plain op and of the CP call, the host-synchronising ops among them, and the
host time per call of both (``<out>/cp_host.json`` / ``.md``). tests/test_distributed.py holds the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ONE_GPU_CASES = (  # name, seqlens, head_dim, ratio, coff
    ("1x8192-d512-r4-c2", (8192,), 512, 4, 2),
    ("3x8192-d512-r4-c2", (8192, 8192, 8192), 512, 4, 2),
    ("1x8192-d128-r128-c1", (8192,), 128, 128, 1),
    ("1x65536-d512-r128-c2", (65536,), 512, 128, 2),
)
TWO_GPU_CASES = (  # one sequence of world x share tokens
    ("2x8192-d512-r4-c2", (16384,), 512, 4, 2),
    ("2x8192-d512-r128-c1", (16384,), 512, 128, 1),
    ("2x65536-d512-r4-c2", (131072,), 512, 4, 2),
    ("2x65536-d512-r128-c1", (131072,), 512, 128, 1),
)
# contiguous: the sequence cut in the middle (a group boundary); load_balanced: Transformer Engine's
# 2*world chunks; straddling: cut one token after the middle, so that a group straddles the ranks.
TWO_GPU_LAYOUTS = ("contiguous", "load_balanced", "straddling")


def halo_tokens_formula(cu: list[int], pieces, ratio: int, coff: int) -> int:
    """The halo one rank receives, by the formula of docs/distributed.md: a piece starting ``o`` tokens into
    a segment, whose first row (group ``o // ratio``) it owns, needs ``o % ratio`` tokens of that group and,
    with coff 2 and ``o >= ratio``, the previous group's ``ratio``."""
    import bisect

    total = 0
    for start, length in pieces:
        b = bisect.bisect_right(cu, start) - 1
        offset = start - cu[b]
        if offset == 0:
            continue
        group = offset // ratio
        owned = group < (cu[b + 1] - cu[b]) // ratio and cu[b] + (group + 1) * ratio <= start + length
        if owned:
            total += offset % ratio + (ratio if coff == 2 and offset >= ratio else 0)
    return total


def _split_pieces(total: int, count: int) -> list[tuple[int, int]]:
    """``count`` pieces cut one token after the even split points (so that groups straddle), reversed."""
    cuts = [0] + [min(total, i * total // count + 1) for i in range(1, count)] + [total]
    return [(a, b - a) for a, b in itertools.pairwise(cuts)][::-1]


def _timer(device):
    from csa_compressor.bench import Timer

    return Timer(device)


def _callables(pack, layout, backend: str, group=None, gather: bool = True):
    """(plain fwd, plain fwd+bwd, cp fwd, cp fwd+bwd) on leaves that require grad."""
    from csa_compressor import compressor_pool
    from csa_compressor.distributed import compressor_pool_cp, gather_rows

    leaves = [t.detach().clone().requires_grad_(True) for t in (pack.kv, pack.score, pack.ape)]
    local = [layout.select_local(t).requires_grad_(True) for t in (pack.kv, pack.score)] + [leaves[2]]
    args = (pack.cu_seqlens, pack.cu_seqlens_comp, pack.ratio, pack.coff, pack.total_comp, backend)

    def plain():
        return compressor_pool(*leaves, *args)

    def cp():
        out, rows = compressor_pool_cp(*local, layout, ratio=pack.ratio, coff=pack.coff, group=group, backend=backend)
        return gather_rows(out, rows, layout, group=group) if gather else out

    def plain_bwd():
        return torch.autograd.grad(plain(), leaves, pack.grad_out)

    grad = pack.grad_out

    def cp_bwd():
        out = cp()
        return torch.autograd.grad(out, local, grad if gather else torch.ones_like(out))

    return plain, plain_bwd, cp, cp_bwd


def _kernel_count(timer, fn) -> int:
    activities, _ = timer.device_activity(fn, 1, cold=False)
    return sum(1 for a in activities if not a.is_user_annotation)


def _kernels_by_name(timer, fn, calls: int = 10) -> dict[str, list[float]]:
    """Per device activity name: [count, us] per call (warm)."""
    activities, _ = timer.device_activity(fn, calls, cold=False)
    table: dict[str, list[float]] = {}
    for a in activities:
        if not a.is_user_annotation:
            entry = table.setdefault(a.name[:120], [0.0, 0.0])
            entry[0] += 1 / calls
            entry[1] += a.duration_us / calls
    return table


def _extra_kernels(plain: dict, cp: dict) -> dict[str, list[float]]:
    """What the CP call's device activity adds to the plain op's, by name: [count, us] per call."""
    names = sorted({*plain, *cp})
    diff = {n: [round(cp.get(n, [0, 0])[i] - plain.get(n, [0, 0])[i], 2) for i in (0, 1)] for n in names}
    return {n: d for n, d in diff.items() if d != [0, 0]}


ONE_GPU_SPLITS = {"whole": 1, "pieces2": 2, "pieces8": 8}


def one_gpu(backends, splits=tuple(ONE_GPU_SPLITS)) -> list[dict]:
    """Every wall and host time first, then every profiler session (after one, CUPTI's callbacks add host time to
    every later CUDA call: csa_compressor/bench.py). Host time: the caller's per call, calls back to back, plain and
    CP in turns (a shared host's load hits both alike); the walls' difference also holds the extra kernels'."""
    from csa_compressor.distributed import CPLayout
    from csa_compressor.testing import make_pack

    device = torch.device("cuda", torch.cuda.current_device())
    timer = _timer(device)
    runs = []
    for name, seqlens, head_dim, ratio, coff in ONE_GPU_CASES:
        pack = make_pack(seqlens, head_dim, ratio, coff, device=device, seed=1)
        for split in splits:
            layout = CPLayout.from_pieces(pack.cu_seqlens, _split_pieces(sum(seqlens), ONE_GPU_SPLITS[split]))
            for backend in backends:
                fns = _callables(pack, layout, backend)
                same = bool(torch.equal(fns[0]().detach(), fns[2]().detach()))
                for direction, plain, cp in (("fwd", fns[0], fns[2]), ("fwd+bwd", fns[1], fns[3])):
                    meta = {"case": name, "split": split, "backend": backend, "direction": direction}
                    runs.append((meta | {"output_bitwise_equal": same}, plain, cp))
    for meta, plain, cp in runs:
        timer.warm_up(plain)
        timer.warm_up(cp)
        meta["plain_wall_us"], meta["cp_wall_us"] = timer.wall_us(plain, 20), timer.wall_us(cp, 20)
        meta["host_overhead_us"] = meta["cp_wall_us"] - meta["plain_wall_us"]
        hosts = [[], []]
        for _ in range(5):
            for i, fn in enumerate((plain, cp)):
                hosts[i].append(timer.host_us(fn, 40))
        meta["plain_host_us"], meta["cp_host_us"] = min(hosts[0]), min(hosts[1])
    for meta, plain, cp in runs:
        meta["plain_kernel_us"] = timer.kernel_us(plain, 20, cold=False)
        meta["cp_kernel_us"] = timer.kernel_us(cp, 20, cold=False)
        meta["device_overhead_us"] = meta["cp_kernel_us"] - meta["plain_kernel_us"]
        meta["plain_kernels"], meta["cp_kernels"] = _kernel_count(timer, plain), _kernel_count(timer, cp)
        meta["extra_kernels"] = _extra_kernels(_kernels_by_name(timer, plain), _kernels_by_name(timer, cp))
        print(_row(meta), flush=True)
    return [meta for meta, _, _ in runs]


def _row(r: dict) -> str:
    keys = ("plain_wall_us", "cp_wall_us", "host_overhead_us", "plain_host_us", "cp_host_us", "plain_kernel_us",
            "cp_kernel_us", "device_overhead_us")  # fmt: skip
    values = " | ".join(f"{r[k]:.1f}" for k in keys)
    return (
        f"| {r['case']} | {r['split']} | {r['backend']} | {r['direction']} | {values} | "
        f"{r['plain_kernels']} / {r['cp_kernels']} | {r['output_bitwise_equal']} |"
    )


ONE_GPU_HEADER = (
    "| case | split | backend | direction | plain wall | CP wall | wall + | plain host | CP host | plain kernel "
    "| CP kernel | device + | kernels plain / CP | out bitwise |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


# ---------------------------------------------------------------- host only (CPU)

# The one-GPU cases' ratios and coffs on small packs: on the CPU the aten ops compute too, and small tensors keep
# that below their dispatch cost (the count of launches does not depend on the sizes).
HOST_CASES = (
    ("1x1024-d16-r4-c2", (1024,), 16, 4, 2),
    ("3x1024-d16-r4-c2", (1024, 1024, 1024), 16, 4, 2),
    ("1x2048-d16-r128-c1", (2048,), 16, 128, 1),
    ("1x4096-d16-r128-c2", (4096,), 16, 128, 2),
)
# Top-level aten ops that launch no kernel on a GPU: allocations and views.
NO_LAUNCH = frozenset(
    "aten::" + name
    for name in ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "slice", "view",
                 "as_strided", "alias", "detach", "select", "reshape", "_reshape_alias", "_unsafe_view", "expand",
                 "unsqueeze", "squeeze", "narrow", "t", "transpose", "contiguous", "lift_fresh", "resize_", "split",
                 "split_with_sizes", "unbind")
)  # fmt: skip
# Top-level aten ops that wait for the device (a host synchronisation on a GPU).
SYNCING = frozenset(f"aten::{n}" for n in ("item", "_local_scalar_dense", "nonzero", "tolist", "equal", "unique"))


@contextlib.contextmanager
def kernels_stubbed():
    """Every compiled op's kernel launch replaced by a counter (nothing computes): what is left of a call is its
    host work and the aten ops around the kernels. Yields ``[launches so far]``; ops compile outside it."""
    from csa_compressor import api

    launches = [0]

    def stub(*args, **kwargs):
        launches[0] += 1

    saved = {op: op._launch for op in api._OPS.values()}
    for op in saved:
        op._launch = stub
    try:
        yield launches
    finally:
        for op, launch in saved.items():
            op._launch = launch


def launch_count(fn) -> tuple[int, dict[str, int]]:
    """(op kernel launches, {aten op: count}) of one call of ``fn`` inside ``kernels_stubbed``: the aten ops
    are the top-level ones a GPU would launch a kernel for (``NO_LAUNCH`` aside)."""
    from torch.profiler import ProfilerActivity, profile

    with kernels_stubbed() as launches, profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None and event.name not in NO_LAUNCH:
            counts[event.name] = counts.get(event.name, 0) + 1
    return launches[0], counts


def _host_us(fns, calls: int, repeats: int = 40) -> list[float]:
    """Host time of one call of each of ``fns`` with the kernels stubbed: the best of ``repeats`` means over
    ``calls`` calls, the callables taking turns (a shared machine's load then hits them alike)."""
    import time

    best = [float("inf")] * len(fns)
    with kernels_stubbed():
        for fn in fns:
            for _ in range(max(1, calls // 10)):
                fn()
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
    return best


def host_record(pack, layout, calls: int) -> list[dict]:
    """Per direction, the plain op's and the CP call's launches and host time (reference backend, CPU)."""
    plain, plain_bwd, cp, cp_bwd = _callables(pack, layout, "reference")
    records = []
    for direction, a, b in (("fwd", plain, cp), ("fwd+bwd", plain_bwd, cp_bwd)):
        a(), b()  # compile the ops (outside the stubs)
        (plain_ops, plain_aten), (cp_ops, cp_aten) = launch_count(a), launch_count(b)
        extra = {k: cp_aten.get(k, 0) - plain_aten.get(k, 0) for k in sorted({*plain_aten, *cp_aten})}
        record = {"direction": direction, "plain_op_launches": plain_ops, "cp_op_launches": cp_ops}
        record |= {"plain_launches": sum(plain_aten.values()), "cp_launches": sum(cp_aten.values())}
        record["extra_aten_ops"] = {k: v for k, v in extra.items() if v}
        record["syncing_ops"] = sorted(k for k in cp_aten if k in SYNCING)
        if calls:
            record["plain_host_us"], record["cp_host_us"] = _host_us((a, b), calls)
            record["host_overhead_us"] = record["cp_host_us"] - record["plain_host_us"]
        records.append(record)
    return records


def host_only(calls: int) -> list[dict]:
    """CPU, reference backend, a world of one: the one-GPU cases' launches and host time around the kernels."""
    from csa_compressor.distributed import CPLayout
    from csa_compressor.testing import make_pack

    torch.set_num_threads(1)
    records = []
    for name, seqlens, head_dim, ratio, coff in HOST_CASES:
        pack = make_pack(seqlens, head_dim, ratio, coff, seed=1)
        for split, count in ONE_GPU_SPLITS.items():
            layout = CPLayout.from_pieces(pack.cu_seqlens, _split_pieces(sum(seqlens), count))
            for record in host_record(pack, layout, calls):
                records.append({"case": name, "split": split} | record)
                print(_host_row(records[-1]), flush=True)
    return records


HOST_HEADER = (
    "| case | split | direction | op launches plain / CP | other launches plain / CP | extra aten ops | "
    "host plain us | host CP us | host + us |\n|---|---|---|---|---|---|---|---|---|"
)


def _host_row(r: dict) -> str:
    extra = ", ".join(f"{k.removeprefix('aten::')} {v:+d}" for k, v in r["extra_aten_ops"].items()) or "-"
    times = " | ".join(f"{r[k]:.1f}" for k in ("plain_host_us", "cp_host_us", "host_overhead_us"))
    return (
        f"| {r['case']} | {r['split']} | {r['direction']} | {r['plain_op_launches']} / {r['cp_op_launches']} | "
        f"{r['plain_launches']} / {r['cp_launches']} | {extra} | {times} |"
    )


# ---------------------------------------------------------------- two GPUs


def _nccl_us(timer, fn) -> float:
    """Device time of the NCCL kernels of one call (the collectives' own time), mean over 10 calls."""
    activities, _ = timer.device_activity(fn, 10, cold=False)
    return sum(a.duration_us for a in activities if "nccl" in a.name.lower() and not a.is_user_annotation) / 10


def _synced_wall(fn, calls: int, group) -> float:
    """Median CUDA-event time of one call that both ranks start together (a barrier, then an idle device)."""
    import torch.distributed as dist

    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


_PACKS: dict = {}


def _two_gpu_case(case, layout_kind: str, backend: str, rank: int, world: int, device):
    """The record's constant part and the callables of one case (the measurements come later)."""
    from csa_compressor.distributed import CPLayout
    from csa_compressor.testing import make_pack

    name, seqlens, head_dim, ratio, coff = case
    if name not in _PACKS:  # the same packs for every layout and backend of a case (building one takes seconds)
        _PACKS.clear()
        share = tuple(s // world for s in seqlens)
        _PACKS[name] = (make_pack(seqlens, head_dim, ratio, coff, device=device, seed=2),
                        make_pack(share, head_dim, ratio, coff, device=device, seed=3))  # fmt: skip
    pack, share = _PACKS[name]
    if layout_kind == "straddling":
        cuts = [0] + [q * sum(seqlens) // world + 1 for q in range(1, world)] + [sum(seqlens)]
        layout = CPLayout.from_pieces(pack.cu_seqlens, [(cuts[rank], cuts[rank + 1] - cuts[rank])])
    else:
        build = CPLayout.contiguous if layout_kind == "contiguous" else CPLayout.load_balanced
        layout = build(pack.cu_seqlens, rank, world)
    fns = _callables(pack, layout, backend)
    op_only = _callables(pack, layout, backend, gather=False)
    share_fns = _callables(share, CPLayout.contiguous(share.cu_seqlens, 0, 1), backend)
    record = {"case": name, "layout": layout_kind, "backend": backend, "rank": rank}
    record["out_bitwise_equal"] = _check_two_gpu(pack, layout, backend)
    dp = next(iter(layout._plans.values()))
    width_bytes = 2 * coff * head_dim * 2  # kv and score rows, bf16
    received = sum(dp.recv_splits) - dp.recv_splits[rank]
    record["halo_tokens_received"] = received
    record["halo_bytes_fwd"] = received * width_bytes
    record["halo_bytes_bwd"] = (sum(dp.send_splits) - dp.send_splits[rank]) * width_bytes
    formula = halo_tokens_formula(layout.cu_seqlens.tolist(), layout.pieces, ratio, coff)
    record["halo_bytes_formula"] = formula * width_bytes
    record["gather_bytes_fwd"] = (world - 1) * dp.max_rows * head_dim * 2
    synced = {"cp_fwd": fns[2], "cp_fwd_bwd": fns[3], "op_fwd": op_only[2], "op_fwd_bwd": op_only[3]}
    alone = {"share_fwd": share_fns[0], "share_fwd_bwd": share_fns[1]}
    return record, synced, alone


def _measure_two_gpu(runs, timer) -> None:
    """Walls of every case first (both ranks start each call together), then the profiler sessions."""
    for record, synced, alone in runs:
        for fn in (*synced.values(), *alone.values()):
            timer.warm_up(fn)
        for label, fn in synced.items():
            record[f"{label}_wall_us"] = _synced_wall(fn, 20, None)
        for label, fn in alone.items():
            record[f"{label}_wall_us"] = timer.wall_us(fn, 20)
    for record, synced, alone in runs:
        for label in ("op_fwd", "op_fwd_bwd"):
            record[f"{label}_kernel_us"] = timer.kernel_us(synced[label], 10, cold=False)
        for label, fn in alone.items():
            record[f"{label}_kernel_us"] = timer.kernel_us(fn, 10, cold=False)
        record["halo_nccl_fwd_us"] = _nccl_us(timer, synced["op_fwd"])
        record["halo_nccl_fwd_bwd_us"] = _nccl_us(timer, synced["op_fwd_bwd"])
        record["gather_nccl_fwd_bwd_us"] = _nccl_us(timer, synced["cp_fwd_bwd"]) - record["halo_nccl_fwd_bwd_us"]


def _check_two_gpu(pack, layout, backend) -> bool:
    from csa_compressor import compressor_pool
    from csa_compressor.distributed import compressor_pool_cp, gather_rows

    ref = compressor_pool(*pack.inputs, pack.ratio, pack.coff, pack.total_comp, backend)
    out, rows = compressor_pool_cp(
        layout.select_local(pack.kv), layout.select_local(pack.score), pack.ape, layout,
        ratio=pack.ratio, coff=pack.coff, backend=backend,
    )  # fmt: skip
    return bool(torch.equal(gather_rows(out, rows, layout), ref))


def _rank_main(rank: int, world: int, backends, store: str, result: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    timer = _timer(device)
    runs, records = [], []
    for case in TWO_GPU_CASES:
        for layout_kind in TWO_GPU_LAYOUTS:
            for backend in backends:
                try:
                    runs.append(_two_gpu_case(case, layout_kind, backend, rank, world, device))
                except Exception as exc:  # one failed case keeps the others (it fails on every rank alike)
                    records.append({"case": case[0], "layout": layout_kind, "backend": backend, "rank": rank,
                                    "error": f"{type(exc).__name__}: {exc}"[:400]})  # fmt: skip
    _measure_two_gpu(runs, timer)
    records += [record for record, _, _ in runs]
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    if rank == 0:
        with open(result, "w") as f:
            json.dump([r for per_rank in gathered for r in per_rank], f)
    dist.destroy_process_group()


def two_gpus(world: int, backends) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "records.json")
        mp.spawn(_rank_main, args=(world, backends, os.path.join(tmp, "store"), result), nprocs=world)
        with open(result) as f:
            return json.load(f)


TWO_GPU_KEYS = (
    "cp_fwd_wall_us", "cp_fwd_bwd_wall_us", "op_fwd_wall_us", "op_fwd_bwd_wall_us", "share_fwd_wall_us",
    "share_fwd_bwd_wall_us", "op_fwd_kernel_us", "op_fwd_bwd_kernel_us", "share_fwd_kernel_us",
    "share_fwd_bwd_kernel_us", "halo_nccl_fwd_us", "halo_nccl_fwd_bwd_us", "gather_nccl_fwd_bwd_us",
)  # fmt: skip


def two_gpu_markdown(records: list[dict]) -> str:
    lines = [
        "| case | layout | backend | rank | " + " | ".join(k.removesuffix("_us") for k in TWO_GPU_KEYS)
        + " | halo bytes fwd / bwd / formula | gather bytes fwd | out bitwise |",
        "|" + "---|" * (len(TWO_GPU_KEYS) + 7),
    ]  # fmt: skip
    for r in records:
        head = f"| {r['case']} | {r['layout']} | {r['backend']} | {r['rank']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} |")
            continue
        values = " | ".join(f"{r[k]:.1f}" for k in TWO_GPU_KEYS)
        halo = f"{r['halo_bytes_fwd']} / {r['halo_bytes_bwd']} / {r['halo_bytes_formula']}"
        lines.append(f"{head} {values} | {halo} | {r['gather_bytes_fwd']} | {r['out_bitwise_equal']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1, help="1: one GPU, no process group; 2+: one process per GPU")
    parser.add_argument("--backends", nargs="+", default=["cute", "triton"])
    parser.add_argument("--out", type=Path, default=Path("csa_compressor_bench/cp"))  # beside the bench's reports
    parser.add_argument("--host-only", action="store_true", help="CPU: launches and host time around the kernels")
    parser.add_argument(
        "--splits",
        nargs="+",
        choices=tuple(ONE_GPU_SPLITS),
        default=list(ONE_GPU_SPLITS),
        help="--world 1: the rank's pieces (whole: no halo; piecesN: N pieces in reverse order)",
    )
    parser.add_argument("--calls", type=int, default=30, help="--host-only: calls per timing (best of 40)")
    args = parser.parse_args(argv)
    if args.host_only:
        args.out.mkdir(parents=True, exist_ok=True)
        print(HOST_HEADER)
        records = host_only(args.calls)
        (args.out / "cp_host.json").write_text(json.dumps(records, indent=1))
        (args.out / "cp_host.md").write_text(HOST_HEADER + "\n" + "\n".join(_host_row(r) for r in records) + "\n")
        return 0
    if not torch.cuda.is_available():
        print("cp_bench needs a CUDA GPU; nothing measured")
        return 0
    from csa_compressor import available_backends

    backends = [b for b in args.backends if b in available_backends("cuda")]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.world == 1:
        print(ONE_GPU_HEADER)
        records = one_gpu(backends, args.splits)
        table = ONE_GPU_HEADER + "\n" + "\n".join(_row(r) for r in records)
    else:
        if torch.cuda.device_count() < args.world:
            print(f"--world {args.world} needs {args.world} GPUs, this machine has {torch.cuda.device_count()}")
            return 1
        records = two_gpus(args.world, backends)
        table = two_gpu_markdown(records)
        print(table)
    (args.out / "cp_bench.json").write_text(json.dumps(records, indent=1))
    (args.out / "cp_bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
