"""``compressor_pool_cp`` and ``gather_rows``: the pooling over a context-parallel group, differentiable.

The forward moves only the halo (one ``all_to_all_single`` on the group, skipped when no rank needs a
token of another), runs the single-GPU op on the rank's own tokens in place and on a small boundary pack,
and places the rows. The backward runs the op's backward on both packs, sends the halo's gradients back
to their owners (one ``all_to_all_single``) and adds them. Every index is a device tensor built once per
layout and configuration, so a call makes no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import api
from ..autograd import compressor_pool
from ..tail import Tail, check_tail, validate_positions
from ..tail_args import TAIL_ARGS, is_default_tail
from ..thd import compute_cu_seqlens_comp
from . import streams
from .device_plan import DevicePlan, OpPack, device_plan
from .layout import CPLayout, _error, validation_requested
from .plan import build_plan

__all__ = ["compressor_pool_cp", "gather_rows"]

_is_compiling = torch.compiler.is_compiling
_DIST = dist.is_available()
_DISABLED: dict = {}


def _eager(fn):
    """``fn`` behind a graph break (``torch.compiler.disable``, made on first use: importing this module must not
    import torch._dynamo, which costs seconds). The entry points call it under ``torch.compile`` only, on
    themselves: their host-side plan and collectives are outside what a graph can hold, and in eager mode they
    pay no wrapper frame."""
    disabled = _DISABLED.get(fn)
    if disabled is None:
        disabled = _DISABLED[fn] = torch.compiler.disable(fn)
    return disabled


# torch 2.13 renamed the tensor forms of the two collectives; older releases have only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------- the halo exchange


def _halves(buf, stride: int, rows: int):
    """The kv and score parts of a ``(2 * stride, width)`` buffer: its rows ``[0, rows)`` and ``stride`` on."""
    return buf[:rows], buf[stride : stride + rows]  # slices: the cheapest views on the host


def _halo_forward(dp: DevicePlan, kv, score, group):
    """The boundary pack's kv and score (None, None without a boundary call): the halo from its owners and
    the rank's own boundary tokens."""
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
    pack = recv.view(-1, width).index_select(0, dp.pack_in)  # kv then score: one gather for both
    return _halves(pack, dp.pack_stride, dp.pack_rows)


def _halo_send_grads(dp: DevicePlan, grad_pack, grad_send, group) -> None:
    """Send the boundary pack's gradients (``grad_pack``, as ``pack``) to their owners, into ``grad_send``."""
    width = grad_send.shape[1] // 2
    grad_recv = grad_send.new_empty((dp.received + 1, 2 * width))  # the last row: pack_out's dump
    if grad_pack is not None:
        # perm is a bijection onto the receive buffer: every row is written.
        grad_recv.view(-1, width).index_copy_(0, dp.pack_out, grad_pack)
    dist.all_to_all_single(grad_send, grad_recv[: dp.received], dp.send_splits, dp.recv_splits, group=group)


def _halo_add_grads(dp: DevicePlan, grads, grad_pack, grad_send) -> None:
    """Add the halo's gradients into the owner's ``grads`` (``(2 * grad_stride, width)``: kv then score) with
    one ``index_add_``. A token of two packs gets two terms; at most one of them is non-zero per element, so
    the sum is exact."""
    source = grad_send.view(-1, grads.shape[1]) if dp.exchange else grad_pack
    grads.index_add_(0, dp.halo_add, source)


# ---------------------------------------------------------------- the op calls and the rows


def _op_tail(tail, op: OpPack | None):
    """The seven tail arguments of one op call (None without a tail or a call): its rows' positions are their
    places in their global segments, ``position_start[segment] + first_position`` per op segment."""
    if tail is None or op is None:
        return None
    norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start = tail
    positions = None
    if rope_dim:
        positions = op.first_position
        if position_start is not None:
            positions = position_start.index_select(0, op.segment).add_(positions)
    return norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, positions


def _forward_call(kv, score, ape, op: OpPack, out, call, tail_args):
    """``(softmax statistics, rstd)`` (each None where absent) of one op call writing ``out`` (the forward
    wrapper's code); ``call``: ``(ratio, coff, backend, group, whether the backward takes the statistics)``;
    ``tail_args``: the call's tail (``_op_tail``) or None."""
    ratio, coff, backend, _, stats = call
    softmax_stats = rstd = None
    if stats:
        softmax_stats = torch.empty((op.rows, 3, out.shape[1]), dtype=torch.float32, device=kv.device)
    if tail_args is None:
        api._pool_forward_into(kv, score, ape, op.cu, op.cc, out, ratio, coff, backend, softmax_stats)
        return softmax_stats, None
    if tail_args[0] is not None:
        rstd = torch.empty((op.rows,), dtype=torch.float32, device=kv.device)
    inputs = (kv, score, ape, op.cu, op.cc)
    api._pool_forward_tail_into(inputs, out, ratio, coff, backend, tail_args, softmax_stats, rstd)
    return softmax_stats, rstd


def _out_buffers(dp: DevicePlan, kind: str, new_empty, d: int):
    """``(buffer, interior's out, boundary's out)`` of a forward with placement ``kind``, all allocated on the
    current stream (streams.py)."""
    rows_int = dp.interior.rows if dp.interior is not None else 0
    rows_b = dp.boundary.rows if dp.boundary is not None else 0
    if kind == "straight":
        buf = new_empty((rows_int, d))
        return buf, buf, None
    if kind == "patch":
        buf = new_empty((dp.patch_rows, d))
        return buf, buf[dp.shift : dp.shift + rows_int], new_empty((rows_b, d))
    buf = new_empty((dp.b_start + rows_b, d))
    out_int, _, out_b = buf.split_with_sizes((rows_int, dp.b_start - rows_int, rows_b))  # one call for both views
    return buf, out_int, out_b


def _place_rows(dp: DevicePlan, kind: str, buf, out_b):
    """``out_local`` from the op calls' rows: as they are, patched by one ``index_copy_`` of the boundary's
    rows (extras onto a dump row past the end), or one gather."""
    if kind == "straight":
        return buf
    if kind == "patch":
        buf.index_copy_(0, dp.boundary.dst, out_b)
        return buf[: dp.n_local] if buf.shape[0] > dp.n_local else buf
    return buf.index_select(0, dp.fwd_src)


def _grad_rows(grad_out, start: int, rows: int):
    """``grad_out[start : start + rows]`` where that is a view the op takes (16-byte aligned), else None."""
    if (grad_out.data_ptr() + start * grad_out.shape[1] * grad_out.element_size()) % 16:
        return None
    return grad_out[start : start + rows]


def _gather_grads(grad_out, src, extra, rows: int):
    """``grad_out``'s rows ``src`` with the rows ``extra`` zeroed (the dropped rows' gradient)."""
    if grad_out.shape[0] == 0:
        return grad_out.new_zeros((rows, grad_out.shape[1]))
    grad = grad_out.index_select(0, src)
    if extra is not None:
        grad.index_fill_(0, extra, 0)
    return grad


def _rows_grads(grad_out, dp: DevicePlan):
    """The two op calls' grad_out: the interior's a slice of ``grad_out`` where it has no dropped row (the
    boundary's then gathered later, beside the interior call: None here), else both in one gather."""
    if dp.placement == "straight":
        return grad_out, None
    if dp.grad_slice:
        grad_int = _grad_rows(grad_out, dp.shift, dp.interior.rows)
        if grad_int is not None:
            return grad_int, None
    grad = _gather_grads(grad_out, dp.grad_src, dp.grad_extra, dp.grad_src.numel())
    if dp.interior is None:
        return None, grad[dp.b_start :]
    rows = dp.interior.rows
    grad_int, _, grad_b = grad.split_with_sizes((rows, dp.b_start - rows, grad.shape[0] - dp.b_start))
    return grad_int, grad_b


class _PoolCP(torch.autograd.Function):
    """The whole CP pooling of one rank as one node, so that its backward (and the collective in it) runs on
    every rank whose ``out_local`` reaches the loss, whether or not the rank produced a row. The boundary
    call (and the halo exchange) runs on the side stream, beside the interior call (``DevicePlan.side``)."""

    @staticmethod
    def forward(ctx, kv, score, ape, norm_weight, args):
        # args: (plan, ratio, coff, backend, group, reduce_ape, tail), one argument (apply costs host time per
        # argument); tail: the seven tail arguments or None. The norm weight (tail[0]) is also an input, for its
        # gradient.
        dp, ratio, coff, backend, group, _, tail = args
        call = (ratio, coff, backend, group, api.autograd_uses_stats(kv, ratio, coff, backend))
        d = kv.shape[1] // coff
        kind = dp.forward_placement(d, kv.element_size())
        buf, out_int, out_b = _out_buffers(dp, kind, kv.new_empty, d)
        tails = _op_tail(tail, dp.interior), _op_tail(tail, dp.boundary)  # before the fork: the side waits on them
        forked = streams.fork(kv.device) if dp.side else None
        stats_int = rstd_int = None
        if dp.interior is not None:
            stats_int, rstd_int = _forward_call(kv, score, ape, dp.interior, out_int, call, tails[0])
        boundary = streams.on_side(forked, _boundary_forward, dp, kv, score, ape, out_b, call, tails[1])
        streams.join(forked)
        kv_b, score_b, stats_b, rstd_b = boundary
        ctx.save_for_backward(kv, score, ape, kv_b, score_b, stats_int, stats_b, rstd_int, rstd_b)
        ctx.args, ctx.tails = args, tails
        return _place_rows(dp, kind, buf, out_b)

    @staticmethod
    def backward(ctx, grad_out):
        kv, score, ape, kv_b, score_b, stats_int, stats_b, rstd_int, rstd_b = ctx.saved_tensors
        dp, group, reduce_ape = ctx.args[0], ctx.args[4], ctx.args[5]
        grad_out = grad_out.contiguous()
        grad_int, grad_b = _rows_grads(grad_out, dp)
        # Every buffer is allocated here, on the current stream, before the side stream forks (streams.py).
        grads, grad_kv, grad_score, pack_grads = _grad_buffers(dp, kv)
        tail = ctx.args[6]
        params_int, params_b = _param_grads(dp, ape, None if tail is None else tail[0])
        grad_send = kv.new_empty((dp.sent, 2 * kv.shape[1])) if dp.exchange else None
        forked = streams.fork(kv.device) if dp.side else None
        if dp.interior is not None:
            inputs, saved = (kv, score, ape, dp.interior.cu, dp.interior.cc), (stats_int, rstd_int)
            _backward_call(inputs, grad_int, (grad_kv, grad_score), params_int, ctx.args, ctx.tails[0], saved)
        side_args = (grad_out, grad_b, (kv_b, score_b, ape), pack_grads, params_b, grad_send, (stats_b, rstd_b))
        streams.on_side(forked, _side_backward, ctx.args, ctx.tails[1], *side_args)
        streams.join(forked)
        if dp.boundary is not None:
            for grad, part in zip(params_int, params_b, strict=True):
                if grad is not None:
                    grad.add_(part)  # always interior + boundary: a fixed order, the same bits every run
        if dp.uses_halo:
            _halo_add_grads(dp, grads, pack_grads, grad_send)
        if reduce_ape:
            for grad in params_int:
                if grad is not None:
                    dist.all_reduce(grad, group=group)
        return grad_kv, grad_score, *params_int, None


def _param_grads(dp: DevicePlan, ape, weight) -> tuple:
    """The parameters' gradient buffers ``(grad_ape, grad_norm_weight)`` of the interior call (zeros without
    one: a rank with no row has zero gradients, not None) and of the boundary call (None without one);
    grad_norm_weight None without a norm (``weight``)."""

    def buffers(new):
        return new(ape), None if weight is None else new(weight, dtype=torch.float32)

    params_int = buffers(torch.empty_like if dp.interior is not None else torch.zeros_like)
    params_b = buffers(torch.empty_like) if dp.boundary is not None else (None, None)
    return params_int, params_b


def _backward_call(inputs, grad_out, grads, params, args, tail_args, saved) -> None:
    """One op call's backward into the caller's buffers: ``grads`` (kv's and score's), ``params`` (ape's and,
    with a norm, the norm weight's); ``saved``: the forward's softmax statistics and rstd (each None where
    absent)."""
    _, ratio, coff, backend = args[:4]
    stats, rstd = saved
    grad_ape, grad_weight = params
    if tail_args is None:
        api._pool_backward_into(*inputs, grad_out, (*grads, grad_ape), ratio, coff, backend, stats)
    else:
        api._pool_backward_tail_into(inputs, grad_out, (*grads, grad_ape), ratio, coff, backend, tail_args, stats,
                                     rstd, grad_weight)  # fmt: skip


def _boundary_forward(dp: DevicePlan, kv, score, ape, out_b, call, tail_args):
    """The side stream's forward: the boundary pack (the halo exchanged where it crosses ranks) and its call
    into ``out_b``; ``(kv_b, score_b, softmax statistics, rstd)``, each None where absent."""
    kv_b = score_b = stats_b = rstd_b = None
    if dp.uses_halo:
        kv_b, score_b = _halo_forward(dp, kv, score, call[3])
    if dp.boundary is not None:
        stats_b, rstd_b = _forward_call(kv_b, score_b, ape, dp.boundary, out_b, call, tail_args)
    return kv_b, score_b, stats_b, rstd_b


def _grad_buffers(dp: DevicePlan, kv):
    """``(grads, grad_kv, grad_score, pack_grads)``: kv's and score's gradients in one buffer ``grads``
    (``(2 * grad_stride, width)``, so that the halo's are added with one ``index_add_``) and, with a boundary
    call, the pack's (``pack_grads``, kv then score from ``pack_stride``) behind it in the same allocation."""
    tokens, width = kv.shape
    stride, pack_stride = dp.grad_stride, dp.pack_stride if dp.boundary is not None else 0
    new = kv.new_empty if dp.interior is not None else kv.new_zeros
    buf = new((2 * (stride + pack_stride), width))
    if not pack_stride:
        return buf, *_halves(buf, stride, tokens), None
    grads, pack_grads = buf.split_with_sizes((2 * stride, 2 * pack_stride))
    return grads, *_halves(grads, stride, tokens), pack_grads


def _side_backward(args, tail_args, grad_out, grad_b, inputs, pack_grads, params_b, grad_send, saved):
    """The side stream's backward: the boundary call's (its grad_out gathered here when the interior's was a
    slice, ``grad_b`` None) into ``pack_grads`` / ``params_b``, then the halo's gradients to their owners."""
    dp, group = args[0], args[4]
    op = dp.boundary
    if op is not None:
        if grad_b is None:
            grad_b = _gather_grads(grad_out, dp.b_grad_src, dp.b_grad_extra, op.rows)
        grads = _halves(pack_grads, dp.pack_stride, dp.pack_rows)
        _backward_call((*inputs, op.cu, op.cc), grad_b, grads, params_b, args, tail_args, saved)
    if dp.exchange:
        _halo_send_grads(dp, pack_grads, grad_send, group)


# ---------------------------------------------------------------- entry points


def _call_error(layout: CPLayout, kv, score, ape, ratio, coff, tail=None, validate=False) -> str | None:
    """What is wrong with this rank's arguments (``tail``: the seven tail arguments, or None; with ``validate``
    its rows' positions too, as the single-GPU op's validation mode checks them), checked before any collective
    (None if nothing)."""
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
    if tail is not None:
        tail = Tail(*tail)
        try:  # position_start is per global segment, as for the single-GPU op on the whole pack
            check_tail(tail, head_dim=kv.shape[1] // coff, batch=layout._cu.numel() - 1, device=kv.device)
            if validate:
                validate_positions(tail, compute_cu_seqlens_comp(layout._cu, ratio), ratio)
        except ValueError as exc:
            return str(exc).removeprefix("csa_compressor: ")
    return None


def _resolve_group(group):
    if group is None and _DIST and dist.is_initialized():
        return dist.group.WORLD
    return group  # None when there is no process group: a world of one rank


def _signature(kv, score, ape, tail) -> tuple:
    """What a call's check depends on and the op's own checks do not see: the inputs' shapes, dtypes and devices,
    and position_start's (the op gets the positions gathered per op segment, not the global offsets)."""
    signature = (kv.shape, score.shape, ape.shape, kv.dtype, score.dtype, ape.dtype, kv.device, score.device,
                 ape.device)  # fmt: skip
    start = None if tail is None else tail[6]
    return signature if start is None else (*signature, start.shape, start.dtype, start.device)


def _device_plan(layout: CPLayout, kv, score, ape, ratio, coff, group, validate, tail=None) -> DevicePlan:
    """The plan of this call. Hot path: the layout's last call (its configuration, group, tail configuration and
    checked argument signature) compared with this one, no dict lookup; else the plan of the configuration, whose
    arguments are checked when they differ from its last ones (and the first call on a group or configuration,
    a tail configuration's included, or ``validate``, checks every rank's layout and call collectively)."""
    hot = layout._hot
    tail_key = None if tail is None else (getattr(tail[0], "dtype", None), tail[4], tail[5], tail[6] is None)
    if hot is not None and not validate and type(ratio) is int and hot[0] == ratio and hot[1] == coff:
        if hot[2] is group and hot[3] == tail_key and _signature(kv, score, ape, tail) == hot[4]:
            return hot[5]
    device = getattr(kv, "device", None)
    key = (ratio, coff, id(group), device, tail_key)
    dp = layout._plans.get(key)
    if dp is None or validate:
        dp = _checked_plan(layout, dp, key, kv, score, ape, group, validate, tail)
    else:
        signature = _signature(kv, score, ape, tail)
        if signature != dp.signature:
            error = _call_error(layout, kv, score, ape, ratio, coff, tail)
            if error is not None:
                raise _error(error)
            dp.signature = signature
    layout._hot = (ratio, coff, group, tail_key, dp.signature, dp)
    return dp


def _checked_plan(layout: CPLayout, dp, key: tuple, kv, score, ape, group, validate, tail) -> DevicePlan:
    """The collective check of this call (and, on a group's first call or with ``validate``, of every rank's
    layout); the plan of ``key`` built if ``dp`` is None."""
    ratio, coff, _, device, tail_key = key
    error = _call_error(layout, kv, score, ape, ratio, coff, tail, validate)
    call = {"ratio": ratio, "coff": coff, "tail": tail_key, "width": kv.shape[-1] if error is None else None}
    call["error"] = error
    call["dtype"] = str(getattr(kv, "dtype", None))
    all_pieces = layout.checked_pieces(group, device if error is None else torch.device("cpu"), call, validate)
    if dp is None:
        rank = dist.get_rank(group) if group is not None else 0
        plan = build_plan(layout._cu, all_pieces, rank, ratio, coff)
        dp = layout._plans[key] = device_plan(plan, device, id(group), layout.local_tokens)
        layout._by_rows[id(dp.rows)] = dp
    dp.signature = _signature(kv, score, ape, tail)
    return dp


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
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    rope_cos: torch.Tensor | None = None,
    rope_sin: torch.Tensor | None = None,
    rope_dim: int = 0,
    rope_interleaved: bool = True,
    position_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooling of a THD pack split over a context-parallel group; differentiable.

    ``kv_local`` / ``score_local``: ``(layout.local_tokens, coff*d)``, this rank's tokens in the layout's
    local order. Returns ``(out_local, rows)``: the global rows whose last token this rank holds, and their
    global indices (int64, ascending, on kv's device). ``grad_ape`` is this rank's partial sum unless
    ``reduce_ape_grad`` (then all-reduced over ``group``). ``validate`` (default
    ``$CSA_COMPRESSOR_VALIDATE``) gathers and checks every rank's layout and arguments on every call, not
    only on the first one. A collective: every rank of ``group`` must call it, with the same ratio and coff.
    Under ``torch.compile`` it runs eagerly behind a graph break.

    ``norm_weight`` .. ``position_start``: the fused tail of ``compressor_pool`` (docs/tail.md), each row placed
    in its global segment (``position_start``: one offset per segment of the global pack); the norm weight's
    gradient is this rank's partial sum, all-reduced with ape's under ``reduce_ape_grad``.
    """
    tail = (norm_weight, norm_eps, rope_cos, rope_sin, rope_dim, rope_interleaved, position_start)
    if is_default_tail(*tail):
        tail = None
    if _is_compiling():
        args = (ratio, coff, group, backend, reduce_ape_grad, validate)
        return _eager(compressor_pool_cp)(kv_local, score_local, ape, layout, *args, *(tail or ()))
    group = _resolve_group(group)
    dp = _device_plan(layout, kv_local, score_local, ape, ratio, coff, group, validation_requested(validate), tail)
    direct = dp.direct
    if direct is not None and (dp.single or not reduce_ape_grad):
        out = compressor_pool(kv_local, score_local, ape, direct.cu, direct.cc, ratio, coff, direct.rows, backend,
                              **_tail_kwargs(tail, direct))  # fmt: skip
        return out, dp.rows
    reduce_ape = reduce_ape_grad and not dp.single
    args = (dp, ratio, coff, backend, group, reduce_ape, tail)
    return _PoolCP.apply(kv_local, score_local, ape, norm_weight, args), dp.rows


def _tail_kwargs(tail, op: OpPack) -> dict:
    """``compressor_pool``'s tail keywords for a call on ``op`` (none without a tail)."""
    return {} if tail is None else dict(zip(TAIL_ARGS, _op_tail(tail, op), strict=True))


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


def gather_rows(out_local: torch.Tensor, rows: torch.Tensor, layout: CPLayout, group=None) -> torch.Tensor:
    """Every rank's ``out_local`` in global row order: ``(layout.total_comp(ratio), d)`` on every rank.

    ``rows``: what ``compressor_pool_cp`` returned with ``out_local``. Differentiable: the backward sums each
    row's gradient over the ranks (in the gradient's dtype) and returns it to the row's owner. A collective;
    under ``torch.compile`` it runs eagerly behind a graph break.
    """
    if _is_compiling():
        return _eager(gather_rows)(out_local, rows, layout, group)
    group = _resolve_group(group)
    dp = layout._by_rows.get(id(rows))  # the plans hold their rows: an id names one while the layout lives
    if dp is None or dp.rows is not rows:
        raise _error("gather_rows needs the rows tensor that compressor_pool_cp returned with this layout")
    if dp.group_id != id(group):
        raise _error("gather_rows must run on the process group that compressor_pool_cp used")
    if out_local.dim() != 2 or out_local.shape[0] != dp.n_local:
        raise _error(f"out_local must be ({dp.n_local}, head_dim) for these rows, got {tuple(out_local.shape)}")
    if dp.single:
        return out_local
    return _GatherRows.apply(out_local, dp, group)
