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

    ``dst``: output position of every op row, extras sent to a dump row ``n_local``; ``extra``: the op rows
    that are extras, or None.
    """

    cu: torch.Tensor
    cc: torch.Tensor
    rows: int
    dst: torch.Tensor
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
    # The backward's grad_out of both op calls as one gather: the interior's op rows, the boundary's from
    # row grad_boundary, each row's out_local position (extras: 0), then the extras (grad_extra) zeroed.
    grad_src: torch.Tensor | None
    grad_extra: torch.Tensor | None
    grad_boundary: int
    # The halo exchange (exchange) or, without it, the boundary pack's local gather (pack_local).
    exchange: bool
    pack_local: torch.Tensor | None
    send_idx: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    sent: int  # sum(send_splits)
    received: int  # sum(recv_splits)
    perm: torch.Tensor | None  # pack position -> receive-buffer row
    # gather_rows: every rank's rows padded to max_rows; gather_src maps global rows to gathered rows.
    max_rows: int
    gather_src: torch.Tensor | None  # None: the gathered rows are already in global order
    # The call is the single-GPU op on the local tensors (no halo on any rank, no row to place): its offsets
    # and row count (a rank with no row: the op with no rows, so that the gradients are zeros, not None).
    direct: tuple | None
    single: bool  # a world of one rank (no process group, or a group of one)
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
    """The device tensors of one op call; ``dst`` is expanded from the runs on the device."""
    if op is None:
        return None
    total = int(op.count.sum())
    ops = _expand_on_device(dev[f"{prefix}_op_first"], dev[f"{prefix}_count"], total)
    dst = torch.full((op.rows,), n_local, dtype=torch.int64, device=ops.device)
    dst[ops] = _expand_on_device(dev[f"{prefix}_position"], dev[f"{prefix}_count"], total)
    return _OpPack(dev[f"{prefix}_cu"], dev[f"{prefix}_cc"], op.rows, dst, dev[f"{prefix}_extra"])


# The boundary call's rows start at a multiple of this many rows of the backward's gather: 16 rows of any
# width and dtype are a multiple of the 16 bytes the op's grad_out alignment needs.
_ROW_ALIGN = 16


def _grad_gather(interior: _OpPack | None, boundary: _OpPack | None, n_local: int):
    """``(grad_src, grad_extra, grad_boundary)`` of the two op calls: the interior's rows, then (from the
    aligned row ``grad_boundary``) the boundary's; the padding between them reads row 0 and goes unused."""
    rows = interior.rows if interior is not None else 0
    start = -(-rows // _ROW_ALIGN) * _ROW_ALIGN if boundary is not None else rows
    dst = [p.dst for p in (interior, boundary) if p is not None]
    if not dst:
        return None, None, 0
    if start > rows:
        dst.insert(1, torch.zeros(start - rows, dtype=torch.int64, device=dst[0].device))
    dst = torch.cat(dst)
    src = torch.where(dst == n_local, torch.zeros_like(dst), dst)
    extras = []
    if interior is not None and interior.extra is not None:
        extras.append(interior.extra)
    if boundary is not None and boundary.extra is not None:
        extras.append(boundary.extra + start)
    return src, torch.cat(extras) if extras else None, start


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
    grad_src, grad_extra, grad_boundary = _grad_gather(interior, boundary, n_local)
    gather_src = None
    if plan.gather_dest is not None:
        gather_src = _expand_on_device(dev["gather_dest"], dev["gather_count"], plan.total_rows)
    plain = boundary is None and (interior is None or plan.interior.in_order)
    direct = None
    if plain and not plan.exchange:
        direct = (interior.cu, interior.cc, interior.rows) if interior else (dev["no_rows"], dev["no_rows"], 0)
    return DevicePlan(
        plan=plan,
        group_id=group_id,
        interior=interior,
        boundary=boundary,
        n_local=n_local,
        rows=_expand_on_device(dev["row_first"], dev["row_count"], n_local),
        plain=plain,
        dump=any(p is not None and p.extra is not None for p in (interior, boundary)),
        grad_src=grad_src,
        grad_extra=grad_extra,
        grad_boundary=grad_boundary,
        exchange=plan.exchange,
        pack_local=dev.get("pack_local"),
        send_idx=dev.get("send_idx"),
        send_splits=plan.send_splits,
        recv_splits=plan.recv_splits,
        sent=sum(plan.send_splits),
        received=sum(plan.recv_splits),
        perm=dev.get("perm"),
        max_rows=max(plan.rows_per_rank),
        gather_src=gather_src,
        direct=direct,
        single=plan.world_size == 1,
    )


# ---------------------------------------------------------------- the halo exchange


def _halo_forward(dp: DevicePlan, kv, score, group):
    """The boundary pack's kv and score: the halo from its owners and the rank's own boundary tokens."""
    if not dp.exchange:
        return kv.index_select(0, dp.pack_local), score.index_select(0, dp.pack_local)
    width = kv.shape[1]
    send = kv.new_empty((dp.sent, 2 * width))  # kv and score side by side: one collective
    torch.index_select(kv, 0, dp.send_idx, out=send[:, :width])
    torch.index_select(score, 0, dp.send_idx, out=send[:, width:])
    recv = send.new_empty((dp.received, 2 * width))
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
    grad_recv = grad_kv.new_empty((dp.received, 2 * width))
    if dp.boundary is not None:
        # perm is a bijection onto the receive buffer: every row is written.
        grad_recv[:, :width].index_copy_(0, dp.perm, grad_kv_b)
        grad_recv[:, width:].index_copy_(0, dp.perm, grad_score_b)
    grad_send = grad_kv.new_empty((dp.sent, 2 * width))
    dist.all_to_all_single(grad_send, grad_recv, dp.send_splits, dp.recv_splits, group=group)
    # A token sent twice gets two rows; at most one of them is non-zero per column, so the sum is exact.
    grad_kv.index_add_(0, dp.send_idx, grad_send[:, :width])
    grad_score.index_add_(0, dp.send_idx, grad_send[:, width:])


# ---------------------------------------------------------------- the differentiable op


def _forward_call(kv, score, ape, op: _OpPack, ratio, coff, backend, stats: bool):
    """``(out, softmax_stats or None)`` of one op call (the forward wrapper's code, as the autograd op's)."""
    if stats:
        return api._pool_forward(kv, score, ape, op.cu, op.cc, ratio, coff, op.rows, backend, return_stats=True)
    return api._pool_forward(kv, score, ape, op.cu, op.cc, ratio, coff, op.rows, backend), None


def _place_rows(dp: DevicePlan, new_empty, out_int, out_b, d: int):
    """``out_local`` from the op calls' rows: one ``index_copy_`` per call, extras onto a dump row past the end."""
    if dp.plain:
        return out_int if out_int is not None else new_empty((0, d))
    buf = new_empty((dp.n_local + dp.dump, d))
    if out_int is not None:
        buf.index_copy_(0, dp.interior.dst, out_int)
    if out_b is not None:
        buf.index_copy_(0, dp.boundary.dst, out_b)
    return buf[: dp.n_local] if dp.dump else buf


def _rows_grads(grad_out, dp: DevicePlan):
    """The two op calls' grad_out: ``out_local``'s gradient at their rows, zero at the extras (one gather
    for both, each call's part a contiguous row range of it)."""
    rows = dp.grad_src.numel()
    if dp.n_local == 0:
        grad = grad_out.new_zeros((rows, grad_out.shape[1]))
    else:
        grad = grad_out.index_select(0, dp.grad_src)
        if dp.grad_extra is not None:
            grad.index_fill_(0, dp.grad_extra, 0)
    return grad[: dp.interior.rows] if dp.interior is not None else None, grad[dp.grad_boundary :]


class _PoolCP(torch.autograd.Function):
    """The whole CP pooling of one rank as one node, so that its backward (and the collective in it) runs on
    every rank whose ``out_local`` reaches the loss, whether or not the rank produced a row."""

    @staticmethod
    def forward(ctx, kv, score, ape, dp: DevicePlan, ratio, coff, backend, group, reduce_ape):
        stats = api.autograd_uses_stats(kv, ratio, coff, backend)
        kv_b = score_b = out_int = out_b = stats_int = stats_b = None
        if dp.boundary is not None or dp.exchange:
            kv_b, score_b = _halo_forward(dp, kv, score, group)
        if dp.interior is not None:
            out_int, stats_int = _forward_call(kv, score, ape, dp.interior, ratio, coff, backend, stats)
        if dp.boundary is not None:
            out_b, stats_b = _forward_call(kv_b, score_b, ape, dp.boundary, ratio, coff, backend, stats)
        ctx.save_for_backward(kv, score, ape, kv_b, score_b, stats_int, stats_b)
        ctx.dp, ctx.call = dp, (ratio, coff, backend, group, reduce_ape)
        return _place_rows(dp, kv.new_empty, out_int, out_b, kv.shape[1] // coff)

    @staticmethod
    def backward(ctx, grad_out):
        kv, score, ape, kv_b, score_b, stats_int, stats_b = ctx.saved_tensors
        dp, (ratio, coff, backend, group, reduce_ape) = ctx.dp, ctx.call
        grad_out = grad_out.contiguous()
        grad_int, grad_b = (grad_out, None) if dp.plain else _rows_grads(grad_out, dp)
        if dp.interior is not None:
            op = dp.interior
            grad_kv, grad_score, grad_ape = api._pool_backward(
                kv, score, ape, op.cu, op.cc, grad_int, ratio, coff, backend, stats=stats_int
            )
        else:
            grad_kv, grad_score, grad_ape = torch.zeros_like(kv), torch.zeros_like(score), torch.zeros_like(ape)
        grad_kv_b = grad_score_b = None
        if dp.boundary is not None:
            op = dp.boundary
            grad_kv_b, grad_score_b, grad_ape_b = api._pool_backward(
                kv_b, score_b, ape, op.cu, op.cc, grad_b, ratio, coff, backend, stats=stats_b
            )
            grad_ape.add_(grad_ape_b)  # the interior's is a fresh tensor of this backward
        if dp.boundary is not None or dp.exchange:
            _halo_backward(dp, grad_kv, grad_score, grad_kv_b, grad_score_b, group)
        if reduce_ape:
            dist.all_reduce(grad_ape, group=group)
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
    dp = _device_plan(layout, kv_local, score_local, ape, ratio, coff, group, validation_requested(validate))
    direct = dp.direct
    if direct is not None and (dp.single or not reduce_ape_grad):
        cu, cc, n = direct
        return compressor_pool(kv_local, score_local, ape, cu, cc, ratio, coff, n, backend), dp.rows
    reduce_ape = reduce_ape_grad and not dp.single
    return _PoolCP.apply(kv_local, score_local, ape, dp, ratio, coff, backend, group, reduce_ape), dp.rows


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
