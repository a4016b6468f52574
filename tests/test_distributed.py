"""csa_compressor.distributed: the CP pooling against the single-process op, bitwise (multi-rank: one gloo group
per world size via tests/cp_worker.py; here: the host plan, layouts, a world of one)."""

import importlib.util
import itertools
import os
import random
import re
from pathlib import Path

import pytest
import torch

from csa_compressor import compressor_pool
from csa_compressor.distributed import CPLayout, compressor_pool_cp, gather_rows
from csa_compressor.distributed.plan import build_plan, expand_runs
from csa_compressor.testing import make_pack, rel_l2

from . import cp_worker

WORLDS = (2, 3, 4)
_RESULTS: dict[int, list[dict]] = {}


def _group_results(world: int) -> list[dict]:
    """Per rank, ``{case: result}``: every world's suite in one set of 4 processes, started once."""
    if not _RESULTS:
        _RESULTS.update(cp_worker.launch(WORLDS, "gloo", timeout_s=110.0))
    return _RESULTS[world]


def _names(world: int) -> list[str]:
    return [item.name for item in cp_worker.suite(world, "gloo")]


@pytest.mark.parametrize(("world", "name"), [(w, n) for w in WORLDS for n in _names(w)])
def test_cp_matches_single_process(world, name):
    """Rows and kv/score gradients bitwise, grad_ape within 1e-6; bad layouts raise on every rank (no hang)."""
    per_rank = _group_results(world)
    problems = []
    for rank, results in enumerate(per_rank):
        for fatal in ("<setup>", "<timeout>"):
            if fatal in results:
                pytest.fail(f"rank {rank}: {results[fatal]['problems']}")
        result = results.get(name)
        if result is None:
            problems.append(f"rank {rank}: no result (an earlier case broke the group?)")
        elif not result["ok"]:
            problems.append(f"rank {rank}: {result['problems']}")
    assert not problems, "\n".join(problems)


def test_suite_covers_the_edge_cases():
    """Across the groups some rank owns no row while holding tokens, and some rank holds no token."""
    seen = {"no rows": False, "no tokens": False}
    for world in WORLDS:
        for results in _group_results(world):
            for result in results.values():
                if "rows" in result:
                    seen["no rows"] |= result["rows"] == 0 and result["tokens"] > 0
                    seen["no tokens"] |= result["tokens"] == 0
    assert all(seen.values()), seen


# ---------------------------------------------------------------- one process


def _plain(p, backend="reference", tail=None):
    """The single-GPU op's rows and gradients (``tail``: its keywords; the norm weight's gradient last)."""
    leaves = [t.clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    tail = tail or {}
    out = compressor_pool(*leaves, p.cu_seqlens, p.cu_seqlens_comp, p.ratio, p.coff, p.total_comp, backend, **tail)
    cp_worker._backward(out, p.grad_out)
    return out.detach(), [*(t.grad for t in leaves), *_weight_grad(tail)]


def _weight_grad(tail) -> list:
    weight = (tail or {}).get("norm_weight")
    return [] if weight is None else [weight.grad]


class _Misaligned(torch.autograd.Function):
    """Identity whose backward hands on the gradient at an address 2 bytes past a 16-byte boundary."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        view = grad.new_empty(grad.numel() + 1)[1:].view_as(grad)
        return view.copy_(grad)


def _require_cute():
    """Skip where the cute backend cannot run on this GPU (nvidia-cutlass-dsl missing, an unsupported GPU)."""
    from csa_compressor import dispatch

    if "cute" not in dispatch.available_backends("cuda"):
        pytest.skip(f"cute backend cannot run here: {dispatch.unavailable_reason('cute') or 'unsupported GPU'}")


def _single_rank(p, layout, backend="reference", misaligned=False, before=None, tail=None):
    """The CP call and gather_rows on a world of one, then the backward; ``before`` runs first; ``tail``: the
    call's tail keywords (the norm weight's gradient last)."""
    kv, score = (layout.select_local(t).requires_grad_(True) for t in (p.kv, p.score))
    ape = p.ape.clone().requires_grad_(True)
    if before is not None:
        before(kv, score, ape)
    tail = tail or {}
    out, rows = compressor_pool_cp(kv, score, ape, layout, ratio=p.ratio, coff=p.coff, backend=backend, **tail)
    out_all = gather_rows(_Misaligned.apply(out) if misaligned else out, rows, layout)
    cp_worker._backward(out_all, p.grad_out)
    idx = layout.local_token_index(p.kv.device)
    grad_kv, grad_score = torch.zeros_like(p.kv), torch.zeros_like(p.score)
    grad_kv[idx], grad_score[idx] = kv.grad, score.grad
    return out_all.detach(), [grad_kv, grad_score, ape.grad, *_weight_grad(tail)]


def _assert_plain(p, out, grads, backend="reference", ape_bitwise=False, tail=None):
    """Rows and kv/score gradients bitwise the plain op's; grad_ape (and the norm weight's) bitwise or within
    1e-6."""
    ref_out, ref_grads = _plain(p, backend, tail)
    assert out is None or torch.equal(out, ref_out)
    assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[1], ref_grads[1])
    assert len(grads) == len(ref_grads)
    for got, want in zip(grads[2:], ref_grads[2:], strict=True):
        assert torch.equal(got, want) if ape_bitwise else rel_l2(got, want) <= 1e-6


@pytest.mark.parametrize(("ratio", "coff"), [(4, 2), (4, 1), (2, 1), (8, 2), (1, 2)])
@pytest.mark.parametrize("split", ["whole", "reversed", "single-tokens"])
def test_world_of_one_matches_plain_op(ratio, coff, split):
    """No process group: one rank holds everything, in one piece or in pieces out of order."""
    p = make_pack((37, 3, 20, 1, 50), 6, ratio, coff, seed=ratio + coff)
    _assert_plain(p, *_single_rank(p, CPLayout.from_pieces(p.cu_seqlens, _pieces(sum(p.seqlens), split))))


def _pieces(total: int, split: str) -> list[tuple[int, int]]:
    """One rank's pieces of ``total`` tokens: in one piece, in three out of order, or one token each, reversed."""
    return {
        "whole": [(0, total)],
        "reversed": [(60, total - 60), (5, 55), (0, 5)],
        "single-tokens": [(t, 1) for t in reversed(range(total))],
    }[split]


@pytest.mark.parametrize("tail", list(cp_worker.TAILS))
@pytest.mark.parametrize(("ratio", "coff"), [(4, 2), (4, 1), (2, 1), (8, 2), (16, 2)])
@pytest.mark.parametrize("split", ["whole", "reversed", "single-tokens"])
def test_world_of_one_with_tail_matches_plain_op(tail, ratio, coff, split):
    """The fused tail through the CP op: every row normalised and rotated at its place in its global segment
    (offsets per global segment), rows and kv/score gradients bitwise the plain op's, the norm weight's within
    1e-6."""
    p = make_pack((37, 3, 20, 1, 50, 33), 8, ratio, coff, seed=ratio + coff)
    ref_tail, tail_kw = cp_worker.tail_kwargs(tail, p, seed=ratio)
    layout = CPLayout.from_pieces(p.cu_seqlens, _pieces(sum(p.seqlens), split))
    out, grads = _single_rank(p, layout, tail=tail_kw)
    _assert_plain(p, out, grads, tail=ref_tail)


@pytest.mark.parametrize("identity", [{"norm_eps": 1e-5}, {"rope_interleaved": False}])
@pytest.mark.parametrize("split", ["whole", "reversed"])
def test_world_of_one_identity_tail_is_the_pooling(identity, split):
    """Tail arguments away from their defaults that neither normalise nor rotate take the tail's checked path, as
    in ``compressor_pool``, and give the pooling, bitwise."""
    p = make_pack((37, 3, 20, 1, 50), 8, 4, 2, seed=7)
    layout = CPLayout.from_pieces(p.cu_seqlens, _pieces(sum(p.seqlens), split))
    _assert_plain(p, *_single_rank(p, layout, tail=dict(identity)))


@pytest.mark.parametrize("split", ["whole", "reversed"])
def test_a_later_position_start_of_another_length_raises(split):
    """The hot path rechecks what the op's own checks cannot see: position_start is per global segment, the op
    gets positions per op segment, so a later call's offsets of another length raise as the first call's would."""
    p = make_pack((37, 3, 20, 1, 50), 8, 4, 2, seed=8)
    tail = cp_worker.tail_kwargs("full", p, seed=8)[1]
    layout = CPLayout.from_pieces(p.cu_seqlens, _pieces(sum(p.seqlens), split))
    kv, score = layout.select_local(p.kv), layout.select_local(p.score)
    compressor_pool_cp(kv, score, p.ape, layout, ratio=4, coff=2, **tail)
    for start in (tail["position_start"][:-1], torch.cat([tail["position_start"], tail["position_start"][:1]])):
        with pytest.raises(ValueError, match="position_start"):
            compressor_pool_cp(kv, score, p.ape, layout, ratio=4, coff=2, **(tail | {"position_start": start}))
    compressor_pool_cp(kv, score, p.ape, layout, ratio=4, coff=2, **tail)  # the good offsets pass again


@pytest.mark.parametrize(("ratio", "coff"), [(4, 2), (4, 1), (128, 1), (128, 2), (2, 1)])
def test_plan_moves_only_the_halo(ratio, coff):
    """Random splits: bounded halo received and packed per piece boundary; every row planned exactly once."""
    rng, world, rows_seen = random.Random(ratio * 10 + coff), 3, []
    seqlens = [rng.randint(1, 5 * ratio) for _ in range(6)]
    cu = [0, *itertools.accumulate(seqlens)]
    normal = [list(CPLayout.from_pieces(cu, p).pieces) for p in cp_worker._random_pieces(cu[-1], world, rng, 9, None)]
    plans = [build_plan(cu, normal, rank, ratio, coff) for rank in range(world)]
    # Every rank takes the same collective decisions, and what q sends r is what r receives from q.
    assert len({plan.exchange for plan in plans}) == 1
    crossing = any(plan.recv_splits[q] for plan in plans for q in range(world) if q != plan.rank)
    assert plans[0].exchange == crossing
    for q in range(world):
        for r in range(world):
            assert plans[q].send_splits[r] == plans[r].recv_splits[q]
    for rank, plan in enumerate(plans):
        boundaries = len(normal[rank])
        assert plan.boundary is None or plan.boundary.rows <= coff * boundaries
        assert plan.pack_local.numel() <= boundaries * (2 * coff * ratio - 1)
        assert sum(plan.recv_splits) - plan.recv_splits[rank] <= boundaries * (coff * ratio - 1)
        rows_seen += expand_runs(plan.row_first, plan.row_count).tolist()
    assert sorted(rows_seen) == list(range(sum(s // ratio for s in seqlens)))


def _cp_bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cp_bench.py"
    spec = importlib.util.spec_from_file_location("cp_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("ratio", "coff"), [(4, 2), (4, 1), (128, 1), (128, 2)])
@pytest.mark.parametrize("kind", ["contiguous", "load_balanced"])
def test_halo_formula_of_the_docs(ratio, coff, kind):
    """docs/distributed.md's halo formula is what the plan receives, for Megatron's two THD splits."""
    formula = _cp_bench().halo_tokens_formula
    rng = random.Random(ratio + coff)
    for world in (2, 3, 4):
        seqlens = [2 * world * rng.randint(coff * ratio, 4 * ratio) + (kind == "contiguous") * rng.randint(0, 9)
                   for _ in range(3)]  # fmt: skip
        cu = [0, *itertools.accumulate(seqlens)]
        layouts = [getattr(CPLayout, kind)(cu, rank, world) for rank in range(world)]
        for rank, layout in enumerate(layouts):
            plan = build_plan(cu, [lay._pieces_t for lay in layouts], rank, ratio, coff)
            assert formula(cu, layout.pieces, ratio, coff) == sum(plan.recv_splits) - plan.recv_splits[rank]


# Launches the CP path adds per call of a world of one in pieces (docs/distributed.md): halo gather and row placement
# forward; backward also grad_out's gather, extras' zeroing (coff 2), grad_ape sum, one index_add_.
_PIECES_EXTRA_LAUNCHES = {("fwd", 1): 3, ("fwd", 2): 3, ("fwd+bwd", 1): 6, ("fwd+bwd", 2): 7}


@pytest.mark.parametrize(("seqlens", "ratio", "coff"), [((37, 3, 20, 1, 50), 4, 2), ((300, 200, 600), 128, 1)])
def test_cp_call_launches(seqlens, ratio, coff):
    """One piece: the plain op; in pieces a fixed few launches per direction however many pieces, no host sync."""
    bench = _cp_bench()
    p = make_pack(seqlens, 6, ratio, coff, seed=5)
    counts = {}
    for pieces in (1, 2, 8):
        layout = CPLayout.from_pieces(p.cu_seqlens, bench._split_pieces(sum(seqlens), pieces))
        for r in bench.host_record(p, layout, calls=0):
            assert r["syncing_ops"] == [], (pieces, r)
            extra_ops = r["cp_op_launches"] - r["plain_op_launches"]
            extra = r["cp_launches"] - r["plain_launches"]
            if pieces == 1:
                assert (extra_ops, extra, r["extra_aten_ops"]) == (0, 0, {}), r
            else:
                assert extra_ops == (1 if r["direction"] == "fwd" else 2), r
                assert extra == _PIECES_EXTRA_LAUNCHES[r["direction"], coff], r
                counts.setdefault(r["direction"], set()).add(extra)
    assert all(len(c) == 1 for c in counts.values()), counts  # no launch per piece


# World of one splits per row placement: name -> (seqlens, ratio, coff, head_dim, cut, placement, grad_out sliced);
# the pieces: tokens [cut, end) then [0, cut), or the whole pack (cut 0).
_S = (37, 3, 20, 1, 50)
_PLACEMENTS = {
    "straight": (_S, 4, 2, 8, 0, "straight", True),
    "patch-c1": (_S, 4, 1, 8, 2, "patch", True),
    "patch-c1-r128": ((300, 200, 600), 128, 1, 8, 100, "patch", True),
    "patch-c2": (_S, 4, 2, 8, 2, "patch", False),
    "patch-unaligned": (_S, 4, 1, 6, 2, "gather", True),
    "gather-c2": (_S, 4, 2, 8, 16, "gather", False),
    "gather-c1": (_S, 4, 1, 8, 5, "gather", False),
}


def _cut(p, cut):
    end = sum(p.seqlens)
    return CPLayout.from_pieces(p.cu_seqlens, [(cut, end - cut), (0, cut)] if cut else [(0, end)])


def _placement_run(name, backend, misaligned=False, tail=""):
    seqlens, ratio, coff, head_dim, cut, _, _ = _PLACEMENTS[name]
    p = make_pack(seqlens, head_dim, ratio, coff, seed=len(name))
    layout = _cut(p, cut)
    ref_tail, tail_kw = cp_worker.tail_kwargs(tail, p, seed=3)
    plans = layout._plans

    def undirect(kv, score, ape):
        detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in tail_kw.items()}
        compressor_pool_cp(kv.detach(), score.detach(), ape.detach(), layout, ratio=ratio, coff=coff, backend=backend,
                           **detached)  # fmt: skip
        (dp,) = plans.values()
        dp.direct = None  # the autograd node even where the call would be the plain op

    out, grads = _single_rank(p, layout, backend, misaligned, before=undirect, tail=tail_kw)
    return p, next(iter(plans.values())), out, grads, ref_tail


_BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not cp_worker.triton_on_cpu(), reason="triton runs on CPU tensors only under its interpreter"))]  # fmt: skip


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("name", list(_PLACEMENTS))
def test_world_of_one_placements_match_plain_op(name, backend):
    """Each row placement through the autograd node: rows and kv/score gradients bitwise the plain op's, grad_ape
    within 1e-6 and bitwise run to run."""
    if backend == "triton" and name == "patch-unaligned":
        pytest.skip("head_dim 6 is the reference backend's")
    p, dp, out, grads, _ = _placement_run(name, backend)
    expect_kind, expect_slice = _PLACEMENTS[name][5:]
    assert dp.forward_placement(p.head_dim, p.kv.element_size()) == expect_kind
    assert dp.grad_slice == expect_slice
    _assert_plain(p, out, grads, backend)
    again = _placement_run(name, backend)[3]
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


@pytest.mark.parametrize("name", ["patch-c1", "patch-c1-r128", "gather-c2"])
def test_unaligned_grad_out_is_gathered(name):
    """A grad_out the op cannot take as it is: gathered instead of sliced, the same gradients."""
    p, _, _, grads, _ = _placement_run(name, "reference", misaligned=True)
    _assert_plain(p, None, grads)


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("tail", list(cp_worker.TAILS))
@pytest.mark.parametrize("name", ["patch-c1", "patch-c1-r128", "patch-c2", "gather-c2"])
def test_world_of_one_placements_with_tail_match_plain_op(name, tail, backend):
    """Each row placement through the autograd node with the fused tail: both op calls' rows at their places
    in their global segments, the norm weight's gradient the two calls' sum."""
    p, _, out, grads, ref_tail = _placement_run(name, backend, tail=tail)
    _assert_plain(p, out, grads, backend, tail=ref_tail)


def test_side_stream_is_cuda_only():
    from csa_compressor.distributed import streams

    cpu = torch.device("cpu")
    assert streams.side_stream(cpu) is None
    assert streams.fork(cpu) is None
    assert streams.on_side(None, lambda *args: args, 1, 2) == (1, 2)
    streams.join(None)


@pytest.mark.gpu
def test_side_stream_uses_torchs_c_stream_functions():
    """The installed CUDA build of torch has the C functions streams.py switches streams with (a release that renames them makes
    it fall back to torch.cuda's Python layers, slower but the same: this test says so first)."""
    from csa_compressor.distributed import streams

    assert streams._GET_STREAM is torch._C._cuda_getCurrentStream
    assert streams._SET_STREAM is torch._C._cuda_setStream
    assert streams._GET_DEVICE is torch._C._cuda_getDevice


def test_layouts():
    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    assert CPLayout.contiguous(cu, 1, 3).pieces == ((8, 8),)
    balanced = CPLayout.load_balanced(cu, 0, 2)
    # Chunks of 2 and 4; rank 0 holds chunks 0 and 3 of each (chunk 3 of sequence 0 merges with chunk 0 of
    # sequence 1).
    assert balanced.pieces == ((0, 2), (6, 6), (20, 4))
    assert balanced.local_tokens == 12 and balanced.total_comp(4) == 6
    assert torch.equal(balanced.local_token_index(), torch.tensor([0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]))
    assert CPLayout.from_pieces(cu, [(0, 0), (3, 2), (5, 1)]).pieces == ((3, 3),)


@pytest.mark.parametrize(
    ("build", "expect"),
    [
        (lambda cu: CPLayout.load_balanced(cu, 0, 3), "divisible by 2*world_size"),
        (lambda cu: CPLayout.contiguous(cu, 2, 2), "out of range"),
        (lambda cu: CPLayout.from_pieces(cu, [(0, 30)]), "not inside the pack"),
        (lambda cu: CPLayout.from_pieces(cu, [(0, 10), (12, 12)]), "held by no rank"),
        (lambda cu: CPLayout.from_pieces(cu, [(0, 10), (9, 15)]), "held by rank 0 and rank 0"),
        (lambda cu: CPLayout.contiguous(torch.tensor([0, 9, 4, 24]), 0, 1), "non-decreasing"),
        (lambda cu: CPLayout.contiguous(cu.float(), 0, 1), "integer tensor"),
    ],
)
def test_bad_layout_raises_at_the_first_call(build, expect):
    """Construction records the problem; the first call raises it (on every rank: see the group tests)."""
    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    layout = build(cu)
    kv = torch.zeros(24, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(expect)):
        compressor_pool_cp(kv, kv, torch.zeros(4, 16), layout, ratio=4, coff=2)


@pytest.mark.parametrize("tail", ["", "full"])
def test_torch_compile_breaks_the_graph_around_the_op(tail):
    """Under torch.compile the CP calls run eagerly behind a graph break; the eager result, gradients included
    (with the fused tail, the norm weight's)."""
    p = make_pack((37, 3, 20), 8, 4, 2, seed=4)
    layout = CPLayout.from_pieces(p.cu_seqlens, [(30, 30), (0, 30)])
    tail_kw = cp_worker.tail_kwargs(tail, p, seed=4)[1]
    weight = tail_kw.pop("norm_weight", None)

    def loss(kv, score, ape, *norm_weight):
        weight_arg = norm_weight[0] if norm_weight else None
        out, rows = compressor_pool_cp(kv * 1.0, score, ape, layout, ratio=4, coff=2, norm_weight=weight_arg, **tail_kw)
        return (gather_rows(out, rows, layout).float() * p.grad_out.float()).sum()

    results = []
    for fn in (loss, torch.compile(loss, backend="eager")):
        leaves = [layout.select_local(p.kv), layout.select_local(p.score), p.ape.clone()]
        leaves += [] if weight is None else [weight.detach().clone()]
        leaves = [t.requires_grad_(True) for t in leaves]
        value = fn(*leaves)
        value.backward()
        results.append([value.detach(), *(t.grad for t in leaves)])
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


def test_gather_rows_needs_the_returned_rows():
    p = make_pack((12,), 6, 4, 2)
    layout = CPLayout.contiguous(p.cu_seqlens, 0, 1)
    out, rows = compressor_pool_cp(p.kv, p.score, p.ape, layout, ratio=4, coff=2)
    with pytest.raises(ValueError, match="rows tensor"):
        gather_rows(out, rows.clone(), layout)
    with pytest.raises(ValueError, match="kv_local has 11 rows"):
        compressor_pool_cp(p.kv[:11], p.score[:11], p.ape, layout, ratio=4, coff=2)


@pytest.mark.gpu
def test_nccl_two_gpus_match_single_gpu():
    """One process per GPU with NCCL, cute and triton, every split (tests/cp_worker.py, ``_nccl_suite``)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    per_rank = cp_worker.launch((2,), "nccl", timeout_s=float(os.environ.get("CP_NCCL_TIMEOUT", "400")))[2]
    problems = [
        f"rank {rank} {name}: {result['problems']}"
        for rank, results in enumerate(per_rank)
        for name, result in results.items()
        if not result["ok"]
    ]
    seconds = {name: round(result.get("seconds", 0.0), 1) for name, result in per_rank[0].items()}
    print("case seconds on rank 0:", seconds)
    assert not problems, "\n".join(problems)
    assert len(per_rank[0]) == len(cp_worker.suite(2, "nccl"))


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["whole", "pieces"])
@pytest.mark.parametrize(("ratio", "coff", "head_dim"), [(4, 2, 512), (4, 2, 128), (128, 1, 512), (128, 2, 128)])
def test_world_of_one_cute_equals_plain_op(split, ratio, coff, head_dim):
    """The cute CP op on a world of one is the plain op, bitwise (grad_ape too in one piece)."""
    _require_cute()
    p = make_pack((4096, 1000, 3000), head_dim, ratio, coff, device="cuda", seed=3)
    total = sum(p.seqlens)
    pieces = [(0, total)] if split == "whole" else [(5000, total - 5000), (1999, 3001), (0, 1999)]
    layout = CPLayout.from_pieces(p.cu_seqlens, pieces)
    _assert_plain(p, *_single_rank(p, layout, "cute"), "cute", ape_bitwise=split == "whole")


@pytest.mark.gpu
@pytest.mark.parametrize("tail", list(cp_worker.GPU_TAILS))
@pytest.mark.parametrize("split", ["whole", "pieces"])
@pytest.mark.parametrize(("ratio", "coff", "head_dim"), [(4, 2, 512), (4, 2, 128), (128, 1, 128), (128, 2, 512)])
def test_world_of_one_cute_with_tail_equals_plain_op(split, ratio, coff, head_dim, tail):
    """The cute CP op with DeepSeek-V4's tail on a world of one: the plain op's rows and kv/score gradients
    bitwise, grad_ape and the norm weight's within 1e-6 (bitwise in one piece)."""
    _require_cute()
    p = make_pack((4096, 1000, 3000), head_dim, ratio, coff, device="cuda", seed=4)
    total = sum(p.seqlens)
    pieces = [(0, total)] if split == "whole" else [(5000, total - 5000), (1999, 3001), (0, 1999)]
    layout = CPLayout.from_pieces(p.cu_seqlens, pieces)
    ref_tail, tail_kw = cp_worker.tail_kwargs(tail, p, seed=5)
    out, grads = _single_rank(p, layout, "cute", tail=tail_kw)
    _assert_plain(p, out, grads, "cute", ape_bitwise=split == "whole", tail=ref_tail)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["patch-c1-r128", "patch-c2", "gather-c2"])
@pytest.mark.parametrize("head_dim", [128, 512])
def test_world_of_one_side_stream_equals_plain_op(monkeypatch, name, head_dim):
    """The boundary call on the side stream: bitwise the plain op's rows and kv/score gradients, and the results
    with the side stream off."""
    _require_cute()
    from csa_compressor.distributed import streams

    seqlens, ratio, coff, _, cut, _, _ = _PLACEMENTS[name]
    seqlens = tuple(64 * n for n in seqlens)  # long enough that the two calls overlap
    p = make_pack(seqlens, head_dim, ratio, coff, device="cuda", seed=7)
    layout = _cut(p, cut)
    results = [_single_rank(p, layout, "cute")]
    assert streams._STREAMS, "the side stream was not used"
    monkeypatch.setattr(streams, "side_stream", lambda device: None)  # every call in order on one stream
    results.append(_single_rank(p, layout, "cute"))
    out, grads = results[0]
    _assert_plain(p, out, grads, "cute")
    for a, b in zip([out, *grads], [results[1][0], *results[1][1]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_world_of_one_side_stream_in_a_cuda_graph():
    """The pieces path captured in a CUDA graph and replayed on new inputs: the rows of an eager call."""
    _require_cute()
    p = make_pack((4096, 1000, 3000), 512, 4, 2, device="cuda", seed=8)
    total = sum(p.seqlens)
    layout = CPLayout.from_pieces(p.cu_seqlens, [(5000, total - 5000), (1999, 3001), (0, 1999)])
    kv, score = (layout.select_local(t).clone() for t in (p.kv, p.score))
    args = dict(ratio=p.ratio, coff=p.coff, backend="cute")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm), torch.no_grad():
        for _ in range(3):  # plan, kernels and side stream made outside the capture
            compressor_pool_cp(kv, score, p.ape, layout, **args)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        captured, _ = compressor_pool_cp(kv, score, p.ape, layout, **args)
    kv.copy_(kv.flip(0))
    score.copy_(score.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager, _ = compressor_pool_cp(kv, score, p.ape, layout, **args)
    assert torch.equal(captured, eager)


@pytest.mark.parametrize(
    ("validate", "env", "expected"),
    [(None, None, False), (None, "0", False), (None, "1", True), (False, "1", False), (True, None, True),
     (None, "yes", ValueError)],
)  # fmt: skip
def test_validation_mode_reads_the_variable_as_the_single_gpu_op(monkeypatch, validate, env, expected):
    """``validate`` overrides; else $CSA_COMPRESSOR_VALIDATE as for the single-GPU op (0/1, else an error)."""
    from csa_compressor.distributed.layout import validation_requested

    if env is None:
        monkeypatch.delenv("CSA_COMPRESSOR_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("CSA_COMPRESSOR_VALIDATE", env)
    if expected is ValueError:
        with pytest.raises(ValueError, match="CSA_COMPRESSOR_VALIDATE"):
            validation_requested(validate)
    else:
        assert validation_requested(validate) is expected
