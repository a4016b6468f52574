"""``compressor_pool_cp`` and ``gather_rows``: the pooling over a context-parallel group, differentiable.

The forward moves only the halo (one ``all_to_all_single`` on the group, skipped when no rank needs a
token of another), runs the single-GPU op on the rank's own tokens in place and on a small boundary pack,
and places the rows. The backward runs the op's backward on both packs, sends the halo's gradients back
to their owners (one ``all_to_all_single``) and adds them. Every index is a device tensor built once per
layout and configuration, so a call makes no host synchronisation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import api
from ..api import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
from ..autograd import compressor_pool
from .layout import CPLayout, _error, validation_requested
from .plan import OpPlan, RankPlan, build_plan

__all__ = ["compressor_pool_cp", "gather_rows"]

_is_compiling = torch.compiler.is_compiling
_DISABLED: dict = {}


def _eager_under_compile(fn):
    """``fn`` as it is in eager mode; under ``torch.compile`` it runs eagerly behind a graph break
    (``torch.compiler.disable``, made on first use: importing this module must not import torch._dynamo,
    which costs seconds). Its host-side plan and collectives are outside what a graph can hold."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_compiling():
            disabled = _DISABLED.get(fn)
            if disabled is None:
                disabled = _DISABLED[fn] = torch.compiler.disable(fn)
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


# torch 2.13 renamed the tensor forms of the two collectives; older releases have only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class _OpPack:
    """One local call of the single-GPU op: offsets, row count, and where its rows go in ``out_local``.

    ``dst``: output position of every op row, extras sent to a dump row ``n_local``; ``src``: the same with
    extras clamped to 0 (the backward's gather); ``extra``: the op rows that are extras, or None.
    """

    cu: torch.Tensor
    cc: torch.Tensor
    rows: int
    dst: torch.Tensor
    src: torch.Tensor
    extra: torch.Tensor | None


@dataclass
class DevicePlan:
    """A ``RankPlan`` as device tensors and the host ints the collectives take."""

    plan: RankPlan
    group_id: int  # id() of the process group the plan was checked on
    interior: _OpPack | None  # None: no real row comes from the rank's own tokens
    boundary: _OpPack | None
    n_local: int
    rows: torch.Tensor  # global indices of out_local's rows, ascending
    plain: bool  # out_local is the interior call's output as it is (no boundary rows, no extras)
    dump: bool  # some op row is an extra: the forward needs the dump row
    # The halo exchange (exchange) or, without it, the boundary pack's local gather (pack_local).
    exchange: bool
    pack_local: torch.Tensor | None
    send_idx: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    perm: torch.Tensor | None  # pack position -> receive-buffer row
    # gather_rows: every rank's rows padded to max_rows; gather_src maps global rows to gathered rows.
    max_rows: int
    gather_src: torch.Tensor | None  # None: the gathered rows are already in global order
    no_rows: torch.Tensor  # int32 [0, 0]: the offsets of a call with no row
    signature: tuple = ()  # shapes, dtypes and devices of the arguments last checked with this plan


def _to_device(tensors: dict, device: torch.device) -> dict:
    """The host tensors on ``device`` in one asynchronous copy through pinned memory (a copy from pageable
    memory would synchronise the stream), each converted back to its dtype."""
    names = [k for k, t in tensors.items() if t is not None]
    if device.type != "cuda" or not names:
        return {k: None if t is None else t.to(device) for k, t in tensors.items()}
    flat = torch.cat([tensors[k].reshape(-1).to(torch.int64) for k in names])
    staged = flat.pin_memory().to(device, non_blocking=True)
    out, pos = dict.fromkeys(tensors), 0
    for k in names:
        n = tensors[k].numel()
        out[k] = staged[pos : pos + n].to(tensors[k].dtype)
        pos += n
    return out


def _expand_on_device(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``cat(arange(s, s + c))`` on the runs' device; ``total`` (their summed count, a host int) spares a
    synchronisation."""
    device = starts.device
    run = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=total)
    offsets = torch.cumsum(counts, 0) - counts
    return starts[run] + torch.arange(total, device=device) - offsets[run]


def _op_host(op: OpPlan | None, prefix: str) -> dict:
    if op is None:
        return {}
    names = ("cu", "cc", "op_first", "position", "count", "extra")
    return {f"{prefix}_{name}": getattr(op, name) for name in names}


def _op_pack(dev: dict, prefix: str, op: OpPlan | None, n_local: int) -> _OpPack | None:
    """The device tensors of one op call; ``dst`` / ``src`` are expanded from the runs on the device."""
    if op is None:
        return None
    total = int(op.count.sum())
    ops = _expand_on_device(dev[f"{prefix}_op_first"], dev[f"{prefix}_count"], total)
    dst = torch.full((op.rows,), n_local, dtype=torch.int64, device=ops.device)
    dst[ops] = _expand_on_device(dev[f"{prefix}_position"], dev[f"{prefix}_count"], total)
    src = torch.where(dst == n_local, torch.zeros_like(dst), dst)
    return _OpPack(dev[f"{prefix}_cu"], dev[f"{prefix}_cc"], op.rows, dst, src, dev[f"{prefix}_extra"])


def device_plan(plan: RankPlan, device: torch.device, group_id: int) -> DevicePlan:
    n_local = plan.n_local
    host = {"row_first": plan.row_first, "row_count": plan.row_count, "no_rows": torch.zeros(2, dtype=torch.int32)}
    host |= {"gather_dest": plan.gather_dest, "gather_count": plan.gather_count}
    host |= _op_host(plan.interior, "int") | _op_host(plan.boundary, "b")
    if plan.boundary is not None and not plan.exchange:
        host["pack_local"] = plan.pack_local
    if plan.exchange:
        host["send_idx"], host["perm"] = plan.send_idx, plan.perm
    dev = _to_device(host, device)
    interior, boundary = _op_pack(dev, "int", plan.interior, n_local), _op_pack(dev, "b", plan.boundary, n_local)
    gather_src = None
    if plan.gather_dest is not None:
        gather_src = _expand_on_device(dev["gather_dest"], dev["gather_count"], plan.total_rows)
    return DevicePlan(
        plan=plan,
        group_id=group_id,
        interior=interior,
        boundary=boundary,
        n_local=n_local,
        rows=_expand_on_device(dev["row_first"], dev["row_count"], n_local),
        plain=boundary is None and (interior is None or plan.interior.in_order),
        dump=any(p is not None and p.extra is not None for p in (interior, boundary)),
        exchange=plan.exchange,
        pack_local=dev.get("pack_local"),
        send_idx=dev.get("send_idx"),
        send_splits=plan.send_splits,
        recv_splits=plan.recv_splits,
        perm=dev.get("perm"),
        max_rows=max(plan.rows_per_rank),
        gather_src=gather_src,
        no_rows=dev["no_rows"],
    )


# ---------------------------------------------------------------- the halo exchange


def _halo_forward(dp: DevicePlan, kv, score, group):
    """The boundary pack's kv and score: the halo from its owners and the rank's own boundary tokens."""
    if not dp.exchange:
        return kv.index_select(0, dp.pack_local), score.index_select(0, dp.pack_local)
    width = kv.shape[1]
    send = torch.cat((kv.index_select(0, dp.send_idx), score.index_select(0, dp.send_idx)), dim=1)
    recv = send.new_empty((sum(dp.recv_splits), 2 * width))
    dist.all_to_all_single(recv, send, dp.recv_splits, dp.send_splits, group=group)
    if dp.boundary is None:
        return None, None
    return recv[:, :width].index_select(0, dp.perm), recv[:, width:].index_select(0, dp.perm)


def _halo_backward(dp: DevicePlan, grad_kv, grad_score, grad_kv_b, grad_score_b, group) -> None:
    """Add the boundary pack's gradients into the owners' ``grad_kv`` / ``grad_score`` (in place)."""
    if not dp.exchange:
        grad_kv.index_add_(0, dp.pack_local, grad_kv_b)
        grad_score.index_add_(0, dp.pack_local, grad_score_b)
        return
    width = grad_kv.shape[1]
    grad_recv = grad_kv.new_empty((sum(dp.recv_splits), 2 * width))
    if dp.boundary is not None:
        # perm is a bijection onto the receive buffer: every row is written.
        grad_recv[:, :width].index_copy_(0, dp.perm, grad_kv_b)
        grad_recv[:, width:].index_copy_(0, dp.perm, grad_score_b)
    grad_send = grad_kv.new_empty((sum(dp.send_splits), 2 * width))
    dist.all_to_all_single(grad_send, grad_recv, dp.send_splits, dp.recv_splits, group=group)
    # A token sent twice gets two rows; at most one of them is non-zero per column, so the sum is exact.
    grad_kv.index_add_(0, dp.send_idx, grad_send[:, :width])
    grad_score.index_add_(0, dp.send_idx, grad_send[:, width:])


# ---------------------------------------------------------------- the differentiable op


def _forward_call(kv, score, ape, op: _OpPack, ratio, coff, backend, stats: bool):
    res = csa_compressor_forward_wrapper(
        kv, score, ape, op.cu, op.cc, ratio=ratio, coff=coff, total_comp=op.rows, backend=backend,
        return_softmax_stats=stats,
    )  # fmt: skip
    return res["out"], res.get("softmax_stats")


def _backward_call(kv, score, ape, op: _OpPack, grad, ratio, coff, backend, stats):
    res = csa_compressor_backward_wrapper(
        kv, score, ape, op.cu, op.cc, grad, ratio=ratio, coff=coff, backend=backend, softmax_stats=stats
    )
    return res["grad_kv"], res["grad_score"], res["grad_ape"]


def _rows_grad(grad_out, op: _OpPack, n_local: int):
    """The op's grad_out: ``out_local``'s gradient at its rows, zero at the extras."""
    if n_local == 0:
        return grad_out.new_zeros((op.rows, grad_out.shape[1]))
    grad = grad_out.index_select(0, op.src)
    if op.extra is not None:
        grad.index_fill_(0, op.extra, 0)
    return grad


class _PoolCP(torch.autograd.Function):
    """The whole CP pooling of one rank as one node, so that its backward (and the collective in it) runs on
    every rank whose ``out_local`` reaches the loss, whether or not the rank produced a row."""

    @staticmethod
    def forward(ctx, kv, score, ape, dp: DevicePlan, ratio, coff, backend, group, reduce_ape):
        stats = api.autograd_uses_stats(kv, ratio, coff, backend)
        kv_b = score_b = None
        if dp.boundary is not None or dp.exchange:
            kv_b, score_b = _halo_forward(dp, kv, score, group)
        outs, saved_stats = [], []
        for op, k, s in ((dp.interior, kv, score), (dp.boundary, kv_b, score_b)):
            out, st = _forward_call(k, s, ape, op, ratio, coff, backend, stats) if op is not None else (None, None)
            outs.append(out)
            saved_stats.append(st)
        d = kv.shape[1] // coff
        if dp.plain:
            result = outs[0] if outs[0] is not None else kv.new_empty((0, d))
        else:
            buf = kv.new_empty((dp.n_local + int(dp.dump), d))
            for op, out in zip((dp.interior, dp.boundary), outs, strict=True):
                if op is not None:
                    buf.index_copy_(0, op.dst, out)  # extras land on the dump row
            result = buf[: dp.n_local] if dp.dump else buf
        ctx.save_for_backward(kv, score, ape, kv_b, score_b, *saved_stats)
        ctx.dp, ctx.group, ctx.reduce_ape = dp, group, reduce_ape
        ctx.ratio, ctx.coff, ctx.backend = ratio, coff, backend
        return result

    @staticmethod
    def backward(ctx, grad_out):
        kv, score, ape, kv_b, score_b, stats_int, stats_b = ctx.saved_tensors
        dp, ratio, coff, backend = ctx.dp, ctx.ratio, ctx.coff, ctx.backend
        grad_out = grad_out.contiguous()
        if dp.interior is not None:
            grad = grad_out if dp.plain else _rows_grad(grad_out, dp.interior, dp.n_local)
            grad_kv, grad_score, grad_ape = _backward_call(
                kv, score, ape, dp.interior, grad, ratio, coff, backend, stats_int
            )
        else:
            grad_kv, grad_score, grad_ape = torch.zeros_like(kv), torch.zeros_like(score), torch.zeros_like(ape)
        grad_kv_b = grad_score_b = None
        if dp.boundary is not None:
            grad = _rows_grad(grad_out, dp.boundary, dp.n_local)
            grad_kv_b, grad_score_b, grad_ape_b = _backward_call(
                kv_b, score_b, ape, dp.boundary, grad, ratio, coff, backend, stats_b
            )
            grad_ape = grad_ape + grad_ape_b
        if dp.boundary is not None or dp.exchange:
            _halo_backward(dp, grad_kv, grad_score, grad_kv_b, grad_score_b, ctx.group)
        if ctx.reduce_ape:
            dist.all_reduce(grad_ape, group=ctx.group)
        return grad_kv, grad_score, grad_ape, None, None, None, None, None, None


# ---------------------------------------------------------------- entry points


def _call_error(layout: CPLayout, kv, score, ape, ratio, coff) -> str | None:
    """What is wrong with this rank's arguments, checked before any collective (None if nothing)."""
    for name, t in (("kv_local", kv), ("score_local", score), ("ape", ape)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            return f"{name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}"
    if coff not in (1, 2) or type(ratio) is not int or ratio < 1:
        return f"ratio must be a positive int and coff 1 or 2, got ratio={ratio!r}, coff={coff!r}"
    if layout._error is None and kv.shape[0] != layout.local_tokens:
        return f"kv_local has {kv.shape[0]} rows but the layout holds {layout.local_tokens} tokens on this rank"
    if score.shape != kv.shape or kv.shape[1] % coff:
        return f"score_local {tuple(score.shape)} must match kv_local {tuple(kv.shape)}, whose width is coff * head_dim"
    if tuple(ape.shape) != (ratio, kv.shape[1]):
        return f"ape must be (ratio, coff * head_dim) = {(ratio, kv.shape[1])}, got {tuple(ape.shape)}"
    if score.dtype != kv.dtype or ape.dtype != torch.float32 or len({kv.device, score.device, ape.device}) != 1:
        return f"kv_local/score_local must share dtype and device and ape be float32 on it, got {kv.dtype}/{score.dtype}/{ape.dtype}"
    return None


def _resolve_group(group):
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group  # None when there is no process group: a world of one rank


def _signature(kv, score, ape) -> tuple:
    return (kv.shape, score.shape, ape.shape, kv.dtype, score.dtype, ape.dtype, kv.device, score.device, ape.device)


def _device_plan(layout: CPLayout, kv, score, ape, ratio, coff, group, validate) -> DevicePlan:
    """The plan of this call. Hot path: one dict lookup and a comparison with the arguments the plan was
    last used with; the first call on a group, a new configuration or new argument shapes take the checks
    (and the first call on a group, or ``validate``, the collective check of every rank's layout)."""
    device = getattr(kv, "device", None)
    key = (ratio, coff, id(group), device)
    dp = layout._plans.get(key)
    if dp is not None and not validate:
        signature = _signature(kv, score, ape)
        if signature == dp.signature:
            return dp
        error = _call_error(layout, kv, score, ape, ratio, coff)
        if error is not None:
            raise _error(error)
        dp.signature = signature
        return dp
    error = _call_error(layout, kv, score, ape, ratio, coff)
    call = {"ratio": ratio, "coff": coff, "width": kv.shape[-1] if error is None else None, "error": error}
    call["dtype"] = str(getattr(kv, "dtype", None))
    all_pieces = layout.checked_pieces(group, device if error is None else torch.device("cpu"), call, validate)
    if dp is None:
        rank = dist.get_rank(group) if group is not None else 0
        dp = device_plan(build_plan(layout._cu, all_pieces, rank, ratio, coff), device, id(group))
        layout._plans[key] = dp
    dp.signature = _signature(kv, score, ape)
    return dp


@_eager_under_compile
def compressor_pool_cp(
    kv_local: torch.Tensor,
    score_local: torch.Tensor,
    ape: torch.Tensor,
    layout: CPLayout,
    ratio: int = 4,
    coff: int = 2,
    group=None,
    backend: str = "auto",
    reduce_ape_grad: bool = False,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooling of a THD pack split over a context-parallel group; differentiable.

    ``kv_local`` / ``score_local``: ``(layout.local_tokens, coff*d)``, this rank's tokens in the layout's
    local order. Returns ``(out_local, rows)``: the global rows whose last token this rank holds, and their
    global indices (int64, ascending, on kv's device). ``grad_ape`` is this rank's partial sum unless
    ``reduce_ape_grad`` (then all-reduced over ``group``). ``validate`` (default
    ``$CSA_COMPRESSOR_VALIDATE``) gathers and checks every rank's layout and arguments on every call, not
    only on the first one. A collective: every rank of ``group`` must call it, with the same ratio and coff.
    """
    group = _resolve_group(group)
    validate = validation_requested(validate)
    dp = _device_plan(layout, kv_local, score_local, ape, ratio, coff, group, validate)
    single = group is None or dp.plan.world_size == 1
    if dp.plain and not dp.exchange and (single or not reduce_ape_grad):
        # No halo on any rank and no row to place: the single-GPU op on the rank's tokens as they are.
        # No row here: the op with no rows, so that the gradients are zeros rather than None.
        cu, cc, n = (dp.interior.cu, dp.interior.cc, dp.interior.rows) if dp.interior else (dp.no_rows, dp.no_rows, 0)
        return compressor_pool(kv_local, score_local, ape, cu, cc, ratio, coff, n, backend), dp.rows
    out = _PoolCP.apply(kv_local, score_local, ape, dp, ratio, coff, backend, group, reduce_ape_grad and not single)
    return out, dp.rows


def _plan_of(layout: CPLayout, rows) -> DevicePlan:
    for dp in layout._plans.values():
        if dp.rows is rows:
            return dp
    raise _error("gather_rows needs the rows tensor that compressor_pool_cp returned with this layout")


class _GatherRows(torch.autograd.Function):
    """All-gather of every rank's rows into global order; the backward sums each row's gradient over the
    ranks and hands it to the row's owner (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, out_local, dp: DevicePlan, group):
        ctx.dp, ctx.group = dp, group
        world, m, n = dp.plan.world_size, dp.max_rows, dp.n_local
        padded = out_local
        if n < m:
            padded = out_local.new_zeros((m, out_local.shape[1]))
            padded[:n] = out_local
        gathered = out_local.new_empty((world * m, out_local.shape[1]))
        _all_gather_tensor(gathered, padded.contiguous(), group=group)
        if dp.gather_src is None:  # the owners' rows follow each other in global order
            return gathered[: dp.plan.total_rows]
        return gathered.index_select(0, dp.gather_src)

    @staticmethod
    def backward(ctx, grad_all):
        dp, group = ctx.dp, ctx.group
        world, m = dp.plan.world_size, dp.max_rows
        grad_all = grad_all.contiguous()
        if dp.gather_src is None and grad_all.shape[0] == world * m:
            grad_gathered = grad_all
        elif dp.gather_src is None:
            grad_gathered = grad_all.new_zeros((world * m, grad_all.shape[1]))
            grad_gathered[: grad_all.shape[0]] = grad_all
        else:
            grad_gathered = grad_all.new_zeros((world * m, grad_all.shape[1]))
            grad_gathered.index_copy_(0, dp.gather_src, grad_all)
        grad = grad_all.new_empty((m, grad_all.shape[1]))
        _reduce_scatter_tensor(grad, grad_gathered, group=group)
        return grad[: dp.n_local], None, None


@_eager_under_compile
def gather_rows(out_local: torch.Tensor, rows: torch.Tensor, layout: CPLayout, group=None) -> torch.Tensor:
    """Every rank's ``out_local`` in global row order: ``(layout.total_comp(ratio), d)`` on every rank.

    ``rows``: what ``compressor_pool_cp`` returned with ``out_local``. Differentiable: the backward sums each
    row's gradient over the ranks (in the gradient's dtype) and returns it to the row's owner. A collective.
    """
    group = _resolve_group(group)
    dp = _plan_of(layout, rows)
    if dp.group_id != id(group):
        raise _error("gather_rows must run on the process group that compressor_pool_cp used")
    if out_local.dim() != 2 or out_local.shape[0] != dp.n_local:
        raise _error(f"out_local must be ({dp.n_local}, head_dim) for these rows, got {tuple(out_local.shape)}")
    if group is None or dp.plan.world_size == 1:
        return out_local
    return _GatherRows.apply(out_local, dp, group)
