"""A rank's plan on its device: the index tensors of its two op calls, and how their rows reach ``out_local``.

The rows are placed in one of three ways, chosen when the plan is built (``DevicePlan.placement``):

- ``straight``: the interior call's rows are ``out_local``'s, in order, and there is no boundary call;
- ``patch``: the interior call's real rows sit at a constant offset ``shift`` from their ``out_local`` rows,
  so the call writes into ``out_local``'s buffer at that offset and one ``index_copy_`` adds the boundary
  rows (which land where the interior has no real row: on its dropped rows, or before it);
- ``gather``: both calls write into one buffer (the boundary's part from an aligned row) and one
  ``index_select`` takes ``out_local`` from it.

Every size is a host int of the plan and every index a device tensor built here once, so a call neither
synchronises nor depends on the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import OpPlan, RankPlan

__all__ = ["ROW_ALIGN", "DevicePlan", "OpPack", "aligned_rows", "device_plan"]

# Op operands start at a multiple of this many rows of a buffer: 16 rows of any width and dtype are a
# multiple of the 16 bytes the op's operands need.
ROW_ALIGN = 16


def aligned_rows(rows: int) -> int:
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def rows_aligned(rows: int, width: int, itemsize: int) -> bool:
    """Whether ``rows`` rows of ``width`` elements are a whole number of the op's 16-byte alignment."""
    return rows * width * itemsize % 16 == 0


@dataclass
class OpPack:
    """One local call of the single-GPU op: offsets, row count, and where its rows go in ``out_local``.

    ``dst``: output position of every op row, extras sent to a dump row ``n_local``; ``extra``: the op rows
    that are extras, or None; ``segment`` (int64) and ``first_position`` (int32): per op segment, its global
    segment and its first row's position in it (``OpPlan``).
    """

    cu: torch.Tensor
    cc: torch.Tensor
    rows: int
    dst: torch.Tensor
    extra: torch.Tensor | None
    segment: torch.Tensor
    first_position: torch.Tensor


@dataclass
class DevicePlan:
    """A ``RankPlan`` as device tensors and the host ints the calls and collectives take."""

    plan: RankPlan
    group_id: int  # id() of the process group the plan was checked on
    interior: OpPack | None  # None: no real row comes from the rank's own tokens
    boundary: OpPack | None
    n_local: int
    rows: torch.Tensor  # global indices of out_local's rows, ascending
    placement: str  # "straight", "patch" or "gather" (module docstring)
    shift: int  # straight / patch: interior op row k is out_local row shift + k
    patch_rows: int  # patch: rows of the buffer the interior writes (n_local, and dump rows past it)
    b_start: int  # gather, and the backward's gather: the boundary's first row (an aligned row)
    fwd_src: torch.Tensor | None  # gather: the buffer row of every out_local row
    # The backward's grad_out of both op calls as one gather: the interior's op rows, the boundary's from
    # row b_start, each row's out_local position (extras: 0), then the extras (grad_extra) zeroed.
    grad_src: torch.Tensor | None
    grad_extra: torch.Tensor | None
    # grad_slice: the interior's grad_out is grad_out[shift : shift + rows] (it has no extras), and the
    # boundary's its own gather (b_grad_src, extras b_grad_extra zeroed).
    grad_slice: bool
    b_grad_src: torch.Tensor | None
    b_grad_extra: torch.Tensor | None
    pack_rows: int  # tokens of the boundary pack
    pack_stride: int  # pack_rows rounded up to ROW_ALIGN: kv then score (and their gradients) in one buffer
    # The halo exchange (exchange) or, without it, the boundary pack's local gather (pack_local).
    exchange: bool
    pack_local: torch.Tensor | None
    send_idx: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    sent: int  # sum(send_splits)
    received: int  # sum(recv_splits)
    # kv's and score's rows side by side as one index, each a dim-0 op on a 2-D view (one launch for both):
    # pack_in, the pack's rows (2 * pack_stride, kv then score) in the receive buffer's (2 per token: kv,
    # score), padding read from row 0; pack_out, the other way, padding written to the dump row past the
    # buffer (2 * received); halo_add, the rows of the gradients' buffer (2 * grad_stride: kv then score)
    # that the halo's gradients add to (the pack's, or the send buffer's), padding onto its dump rows.
    pack_in: torch.Tensor | None
    pack_out: torch.Tensor | None
    halo_add: torch.Tensor | None
    grad_stride: int  # tokens, and a dump row where the pack has padding, rounded up to ROW_ALIGN
    # gather_rows: every rank's rows padded to max_rows; gather_src maps global rows to gathered rows.
    max_rows: int
    gather_src: torch.Tensor | None  # None: the gathered rows are already in global order
    # The call is the single-GPU op on the local tensors (no halo on any rank, no row to place): its OpPack
    # (a rank with no row: an op of one empty segment, so that the gradients are zeros, not None).
    direct: OpPack | None
    single: bool  # a world of one rank (no process group, or a group of one)
    signature: tuple = ()  # shapes, dtypes and devices of the arguments last checked with this plan

    @property
    def uses_halo(self) -> bool:
        """The call has a boundary pack or takes part in a halo exchange (the side stream's work)."""
        return self.boundary is not None or self.exchange

    @property
    def side(self) -> bool:
        """The side stream's work runs beside an interior call: alone, forking to it would only add host time."""
        return self.interior is not None and self.uses_halo

    def forward_placement(self, head_dim: int, itemsize: int) -> str:
        """The placement of a call with rows of ``head_dim`` elements of ``itemsize`` bytes: ``patch`` needs
        its shifted interior rows aligned, and is a ``gather`` otherwise."""
        if self.placement == "patch" and not rows_aligned(self.shift, head_dim, itemsize):
            return "gather"
        return self.placement


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


def expand_on_device(starts: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``cat(arange(s, s + c))`` on the runs' device; ``total`` (their summed count, a host int) spares a
    synchronisation."""
    device = starts.device
    run = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=total)
    offsets = torch.cumsum(counts, 0) - counts
    return starts[run] + torch.arange(total, device=device) - offsets[run]


def _op_host(op: OpPlan | None, prefix: str) -> dict:
    if op is None:
        return {}
    names = ("cu", "cc", "op_first", "position", "count", "extra", "segment", "first_position")
    return {f"{prefix}_{name}": getattr(op, name) for name in names}


def _op_pack(dev: dict, prefix: str, op: OpPlan | None, n_local: int) -> OpPack | None:
    """The device tensors of one op call; ``dst`` is expanded from the runs on the device."""
    if op is None:
        return None
    total = int(op.count.sum())
    ops = expand_on_device(dev[f"{prefix}_op_first"], dev[f"{prefix}_count"], total)
    dst = torch.full((op.rows,), n_local, dtype=torch.int64, device=ops.device)
    dst[ops] = expand_on_device(dev[f"{prefix}_position"], dev[f"{prefix}_count"], total)
    place = dev[f"{prefix}_segment"], dev[f"{prefix}_first_position"]
    return OpPack(dev[f"{prefix}_cu"], dev[f"{prefix}_cc"], op.rows, dst, dev[f"{prefix}_extra"], *place)


def _shift(op: OpPlan | None) -> int | None:
    """The offset of out_local row over op row, when it is the same for every real row and not negative."""
    if op is None:
        return None
    offsets = op.position - op.op_first
    if offsets.numel() == 0 or int(offsets[0]) < 0 or not bool((offsets == offsets[0]).all()):
        return None
    return int(offsets[0])


def _placement(plan: RankPlan) -> tuple[str, int | None]:
    shift = _shift(plan.interior)
    if plan.boundary is None and (plan.interior is None or plan.interior.in_order):
        return "straight", 0
    if plan.interior is not None and plan.boundary is not None and shift is not None:
        return "patch", shift
    return "gather", shift


def _zero_dump(dst: torch.Tensor, n_local: int) -> torch.Tensor:
    return torch.where(dst == n_local, torch.zeros_like(dst), dst)


def _gathers(interior: OpPack | None, boundary: OpPack | None, n_local: int, b_start: int) -> dict:
    """The combined buffer's index tensors: ``fwd_src`` (its row of every out_local row), ``grad_src`` (the
    out_local row of each of its rows, 0 for extras and the padding before ``b_start``) and ``grad_extra``."""
    parts = [p for p in (interior, boundary) if p is not None]
    if not parts:
        return {"fwd_src": None, "grad_src": None, "grad_extra": None}
    device = parts[0].dst.device
    rows = interior.rows if interior is not None else 0
    dst = [p.dst for p in parts]
    if b_start > rows:
        dst.insert(1, torch.full((b_start - rows,), n_local, dtype=torch.int64, device=device))
    dst = torch.cat(dst)
    fwd_src = torch.empty(n_local + 1, dtype=torch.int64, device=device)  # extras and padding: the dump row
    fwd_src[dst] = torch.arange(dst.numel(), device=device)
    extras = []
    if interior is not None and interior.extra is not None:
        extras.append(interior.extra)
    if boundary is not None and boundary.extra is not None:
        extras.append(boundary.extra + b_start)
    grad_extra = torch.cat(extras) if extras else None
    return {"fwd_src": fwd_src[:n_local], "grad_src": _zero_dump(dst, n_local), "grad_extra": grad_extra}


def _pad(index: torch.Tensor, length: int, value: int) -> torch.Tensor:
    return torch.cat([index, torch.full((length - index.numel(),), value, dtype=index.dtype, device=index.device)])


def _halo_indices(dev: dict, plan: RankPlan, tokens: int, pack_rows: int) -> dict:
    """``pack_in``, ``pack_out``, ``halo_add`` and ``grad_stride`` (``DevicePlan``)."""
    stride = aligned_rows(pack_rows)
    grad_stride = aligned_rows(tokens + (stride > pack_rows))
    out = {"pack_in": None, "pack_out": None, "halo_add": None, "grad_stride": grad_stride}
    if plan.exchange:
        send = dev["send_idx"]
        out["halo_add"] = torch.stack([send, send + grad_stride], 1).reshape(-1)
        if plan.boundary is not None:
            perm, received = 2 * dev["perm"], sum(plan.recv_splits)
            out["pack_in"] = torch.cat([_pad(perm, stride, 0), _pad(perm + 1, stride, 0)])
            out["pack_out"] = torch.cat([_pad(perm, stride, 2 * received), _pad(perm + 1, stride, 2 * received)])
    elif plan.boundary is not None:
        local = dev["pack_local"]
        out["halo_add"] = torch.cat(
            [_pad(local, stride, tokens), _pad(local + grad_stride, stride, grad_stride + tokens)]
        )
    return out


def device_plan(plan: RankPlan, device: torch.device, group_id: int, tokens: int) -> DevicePlan:
    """The plan on ``device``; ``tokens``: the rank's local tokens."""
    n_local = plan.n_local
    host = {"row_first": plan.row_first, "row_count": plan.row_count, "no_rows": torch.zeros(2, dtype=torch.int32)}
    host |= {"no_segment": torch.zeros(1, dtype=torch.int64), "no_position": torch.zeros(1, dtype=torch.int32)}
    host |= {"gather_dest": plan.gather_dest, "gather_count": plan.gather_count}
    host |= _op_host(plan.interior, "int") | _op_host(plan.boundary, "b")
    if plan.boundary is not None and not plan.exchange:
        host["pack_local"] = plan.pack_local
    if plan.exchange:
        host["send_idx"], host["perm"] = plan.send_idx, plan.perm
    dev = _to_device(host, device)
    interior, boundary = _op_pack(dev, "int", plan.interior, n_local), _op_pack(dev, "b", plan.boundary, n_local)
    placement, shift = _placement(plan)
    rows_int = interior.rows if interior is not None else 0
    b_start = aligned_rows(rows_int) if boundary is not None else rows_int
    gathers = _gathers(interior, boundary, n_local, b_start) if placement != "straight" else {}
    grad_slice = interior is not None and interior.extra is None and shift is not None
    pack_rows = int(plan.boundary.cu[-1]) if plan.boundary is not None else 0
    gather_src = None
    if plan.gather_dest is not None:
        gather_src = expand_on_device(dev["gather_dest"], dev["gather_count"], plan.total_rows)
    direct = None
    if placement == "straight" and not plan.exchange:
        nothing = dev["no_rows"].new_empty((0,), dtype=torch.int64)
        empty = OpPack(dev["no_rows"], dev["no_rows"], 0, nothing, None, dev["no_segment"], dev["no_position"])
        direct = interior if interior is not None else empty
    return DevicePlan(
        plan=plan,
        group_id=group_id,
        interior=interior,
        boundary=boundary,
        n_local=n_local,
        rows=expand_on_device(dev["row_first"], dev["row_count"], n_local),
        placement=placement,
        shift=shift or 0,
        patch_rows=max(n_local + (boundary is not None and boundary.extra is not None), (shift or 0) + rows_int),
        b_start=b_start,
        fwd_src=gathers.get("fwd_src"),
        grad_src=gathers.get("grad_src"),
        grad_extra=gathers.get("grad_extra"),
        grad_slice=grad_slice,
        b_grad_src=_zero_dump(boundary.dst, n_local) if grad_slice and boundary is not None else None,
        b_grad_extra=boundary.extra if grad_slice and boundary is not None else None,
        pack_rows=pack_rows,
        pack_stride=aligned_rows(pack_rows),
        exchange=plan.exchange,
        pack_local=dev.get("pack_local"),
        send_idx=dev.get("send_idx"),
        send_splits=plan.send_splits,
        recv_splits=plan.recv_splits,
        sent=sum(plan.send_splits),
        received=sum(plan.recv_splits),
        **_halo_indices(dev, plan, tokens, pack_rows),
        max_rows=max(plan.rows_per_rank),
        gather_src=gather_src,
        direct=direct,
        single=plan.world_size == 1,
    )
