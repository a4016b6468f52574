"""Host-side plan of the context-parallel pooling for one rank: its two local packs and its halo exchange.

Every global compressed row is produced by the rank that holds the row's last token. A rank produces its
rows with at most two calls of the single-GPU op:

- the *interior* call runs on the rank's own ``kv_local`` / ``score_local`` as they are (no copy): its local
  segments follow the global segments inside each piece, with a filler of fewer than ``ratio`` tokens
  where a piece starts inside a group, so every row whose whole window lies inside one piece comes out
  right;
- the *boundary* call runs on a small pack of the rows whose window starts before their piece: for each
  piece that starts inside a segment, at most two rows (one with coff 1), with the halo (at most
  ``coff * ratio - 1`` tokens before the piece) and the row's own tokens.

A local segment that starts at a group other than its segment's first reads no previous group, so with
coff 2 its first row is wrong; such rows are *extra*: computed, dropped from the output, given a zero
gradient. The plan is vectorised host tensor work (int64 on the CPU), built once per layout and
configuration: linear in the tokens and rows of the pack, with no Python loop over pieces or segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OpPlan", "RankPlan", "build_plan", "expand_runs"]

_I64 = torch.int64


def expand_runs(starts, counts) -> torch.Tensor:
    """``cat(arange(s, s + c) for s, c in zip(starts, counts))`` as one int64 tensor."""
    return _expand(torch.as_tensor(starts, dtype=_I64), torch.as_tensor(counts, dtype=_I64))[0]


def _expand(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs ``[s, s + c)`` concatenated, and the run index of every element."""
    run = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    offsets = torch.cumsum(counts, 0) - counts
    return starts[run] + torch.arange(run.numel()) - offsets[run], run


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=_I64), torch.cumsum(lengths, 0)])


@dataclass
class OpPlan:
    """One call of the single-GPU op: ``cu`` / ``cc`` (int32 offsets) and ``rows`` (its row count); its real
    rows as runs, ``count[i]`` op rows from ``op_first[i]`` landing in ``out_local`` from ``position[i]``;
    ``extra``: the other op rows, None when there are none; ``in_order``: op row ``k`` is output row ``k``;
    per op segment, the global segment it lies in (``segment``) and its first row's position in it
    (``first_position``: group index times ratio), which place its rows for the rotary tail."""

    cu: torch.Tensor
    cc: torch.Tensor
    rows: int
    op_first: torch.Tensor
    position: torch.Tensor
    count: torch.Tensor
    extra: torch.Tensor | None
    in_order: bool
    segment: torch.Tensor
    first_position: torch.Tensor


@dataclass
class RankPlan:
    """Everything one rank needs, as host tensors and ints (``ops.device_plan`` moves them), each linear in
    the pieces and the halo (the row-sized index tensors are expanded from runs on the device).

    ``pack_local``: owner-local index of every boundary-pack token (used when nothing crosses ranks);
    ``send_idx``: the local tokens this rank sends, grouped by receiver (``send_splits``);
    ``perm``: for every pack position, its row in the receive buffer (grouped by sender, ``recv_splits``);
    ``row_first`` / ``row_count``: runs of the global rows this rank produces, ascending (``n_local`` rows);
    ``gather_dest`` / ``gather_count``: runs, in global row order, of the rows' places in the all-gather of
    every rank's rows padded to ``max(rows_per_rank)`` (None: already in global order);
    ``exchange``: whether any rank needs a token of another (else no collective runs).
    """

    rank: int
    world_size: int
    total_rows: int
    n_local: int
    interior: OpPlan | None
    boundary: OpPlan | None
    pack_local: torch.Tensor
    send_idx: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    perm: torch.Tensor
    row_first: torch.Tensor
    row_count: torch.Tensor
    rows_per_rank: list[int]
    gather_dest: torch.Tensor | None
    gather_count: torch.Tensor | None
    exchange: bool


@dataclass
class _Pieces:
    """Every rank's pieces, flattened in rank order then local order."""

    start: torch.Tensor
    length: torch.Tensor
    rank: torch.Tensor
    local: torch.Tensor  # offset of the piece in its rank's local tokens
    by_start: torch.Tensor  # the pieces in global order
    sorted_start: torch.Tensor  # start[by_start]

    @classmethod
    def of(cls, all_pieces) -> _Pieces:
        tables = [torch.as_tensor(p, dtype=_I64).reshape(-1, 2) for p in all_pieces]
        start, length = (torch.cat([t[:, i] for t in tables]) for i in (0, 1))
        sizes = torch.tensor([t.shape[0] for t in tables], dtype=_I64)
        rank = torch.repeat_interleave(torch.arange(len(tables)), sizes)
        totals = torch.stack([t[:, 1].sum() for t in tables]) if tables else torch.zeros(0, dtype=_I64)
        # A piece's local offset: the lengths before it, minus those of the ranks before its own.
        local = torch.cumsum(length, 0) - length - (torch.cumsum(totals, 0) - totals)[rank]
        by_start = torch.argsort(start)
        return cls(start, length, rank, local, by_start, start[by_start])

    def locate(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Owner rank and owner-local index of global ``tokens``."""
        i = self.by_start[torch.searchsorted(self.sorted_start, tokens, right=True) - 1]
        return self.rank[i], self.local[i] + tokens - self.start[i]


def _rows_before(cu, cc, x: torch.Tensor, ratio: int) -> torch.Tensor:
    """The number of global rows whose last token is before token ``x`` (rows are ordered by last token)."""
    b = (torch.searchsorted(cu, x, right=True) - 1).clamp_max(cu.numel() - 2)
    groups = cc[b + 1] - cc[b]
    complete = torch.div(x - cu[b], ratio, rounding_mode="floor")  # groups of b whose last token is before x
    return cc[b] + complete.clamp(0, None).minimum(groups)


def _piece_rows(cu, cc, pieces: _Pieces, ratio: int, world: int):
    """Per piece: its first row and row count (the rows whose last token it holds: a contiguous range), and
    the position of that range among its rank's rows; per rank, its row count."""
    first = _rows_before(cu, cc, pieces.start, ratio)
    count = _rows_before(cu, cc, pieces.start + pieces.length, ratio) - first
    order = torch.argsort(pieces.rank * (cu[-1] + 1) + pieces.start)  # by rank, then global position
    offset = torch.empty_like(count)
    ordered = count[order]
    per_rank = torch.bincount(pieces.rank, weights=count.double(), minlength=world).to(_I64)
    rank_start = torch.cumsum(per_rank, 0) - per_rank
    offset[order] = torch.cumsum(ordered, 0) - ordered - rank_start[pieces.rank[order]]
    return first, count, offset, per_rank


def _interior(cu, cc, gs, ge, ratio: int, coff: int):
    """The interior pack over pieces ``[gs, ge)`` (local order): per piece and overlapping segment, a filler
    up to the first group that starts in the piece, then the groups. Returns the op's offsets and, per
    segment part, its first real op row, real row count, first real global row and piece, and per op segment
    its global segment and first group."""
    b_first = torch.searchsorted(cu, gs, right=True) - 1
    b_last = torch.searchsorted(cu, ge - 1, right=True) - 1
    b, piece = _expand(b_first, b_last - b_first + 1)
    a = torch.maximum(gs[piece], cu[b])
    e = torch.minimum(ge[piece], cu[b + 1])
    jstart = torch.div(a - cu[b] + ratio - 1, ratio, rounding_mode="floor")
    aligned = torch.minimum(cu[b] + jstart * ratio, e)
    groups = torch.div(e - aligned, ratio, rounding_mode="floor")
    skip = (jstart > 0).to(_I64) if coff == 2 else torch.zeros_like(jstart)  # the segment's first row is extra
    lengths = torch.stack([aligned - a, e - aligned], 1).reshape(-1)
    rows = torch.stack([torch.zeros_like(groups), groups], 1).reshape(-1)
    cc_local = _offsets(rows)
    op_first = cc_local[1:-1:2] + skip
    place = torch.stack([b, b], 1).reshape(-1), torch.stack([torch.zeros_like(jstart), jstart], 1).reshape(-1)
    return _offsets(lengths), cc_local, op_first, (groups - skip).clamp_min(0), cc[b] + jstart + skip, piece, place


def _boundary(cu, cc, pieces: _Pieces, ratio: int, coff: int):
    """Per piece (of every rank): the boundary segment ``[A, E)`` of its rows whose window starts before the
    piece (length 0 when none), its first real row offset, real row count, first real global row, and its
    global segment and first group."""
    gs, ge = pieces.start, pieces.start + pieces.length
    b = torch.searchsorted(cu, gs, right=True) - 1
    start, groups = cu[b], torch.div(cu[b + 1] - cu[b], ratio, rounding_mode="floor")
    j0 = torch.div(gs - start + ratio - 1, ratio, rounding_mode="floor")  # the first group starting in the piece

    def owned(j):  # a complete group of the segment whose last token is in the piece, starting before it
        last = start + (j + 1) * ratio - 1
        return (start < gs) & (j >= 0) & (j < groups) & (last >= gs) & (last < ge)

    straddles, next_reads_back = owned(j0 - 1), owned(j0) & (coff == 2)
    exists = straddles | next_reads_back
    first = torch.where(straddles, j0 - 1, j0)
    last = torch.where(next_reads_back, j0, j0 - 1)
    jstart = first - ((first > 0) & (coff == 2)).to(_I64)  # coff 2: from the first row's previous group
    seg_start = torch.where(exists, start + jstart * ratio, gs)
    length = torch.where(exists, (last + 1 - jstart) * ratio, torch.zeros_like(gs))
    real = torch.where(exists, last - first + 1, 0)
    return seg_start, length, first - jstart, real, cc[b] + first, (b, torch.where(exists, jstart, 0))


def _op(cu_local: torch.Tensor, cc_local: torch.Tensor, op_first, count, position, n_local: int, place,
        ratio: int) -> OpPlan:  # fmt: skip
    """An op call whose real rows are runs: ``count`` op rows from ``op_first`` land at ``position``; ``place``:
    per op segment, its global segment and first group."""
    rows = int(cc_local[-1])
    keep = count > 0
    op_first, count, position = op_first[keep], count[keep], position[keep]
    gap_start = torch.cat([torch.zeros(1, dtype=_I64), op_first + count])
    gap_count = torch.cat([op_first, torch.tensor([rows])]) - gap_start
    extra = _expand(gap_start, gap_count)[0]
    in_order = rows == n_local and bool(torch.equal(op_first, position))
    segment, group = place
    return OpPlan(cu_local.to(torch.int32), cc_local.to(torch.int32), rows, op_first, position, count,
                  extra if extra.numel() else None, in_order, segment, (group * ratio).to(torch.int32))  # fmt: skip


def _overlaps_rank(pieces: _Pieces, a: torch.Tensor, e: torch.Tensor, rank: int) -> torch.Tensor:
    """Whether the global token ranges ``[a, e)`` overlap any piece of ``rank``."""
    mine = pieces.by_start[pieces.rank[pieces.by_start] == rank]
    if mine.numel() == 0:
        return torch.zeros_like(a, dtype=torch.bool)
    ends = pieces.start[mine] + pieces.length[mine]
    i = torch.searchsorted(ends, a, right=True).clamp_max(mine.numel() - 1)  # the first of its pieces ending after a
    return (pieces.start[mine][i] < e) & (ends[i] > a)


def _any_crosses(pieces: _Pieces, seg_start: torch.Tensor, length: torch.Tensor) -> bool:
    """Whether some piece's halo ``[seg_start, start)`` holds a token of another rank: the same answer on every
    rank, from every rank's pieces. A halo stays on its rank when the pieces it spans (consecutive in global
    order) are one run of that rank's pieces."""
    order = pieces.by_start
    ranks = pieces.rank[order]
    run = torch.cumsum(torch.cat([torch.zeros(1, dtype=_I64), (ranks[1:] != ranks[:-1]).to(_I64)]), 0)
    halo = (length > 0) & (seg_start < pieces.start)
    if not bool(halo.any()):
        return False
    first = torch.searchsorted(pieces.sorted_start, seg_start[halo], right=True) - 1
    last = torch.searchsorted(pieces.sorted_start, pieces.start[halo] - 1, right=True) - 1
    own = (run[first] == run[last]) & (ranks[last] == pieces.rank[halo])
    return not bool(own.all())


def build_plan(cu, all_pieces, rank: int, ratio: int, coff: int) -> RankPlan:
    """The plan of ``rank`` from the global offsets (host int64) and every rank's (normalised, checked)
    pieces."""
    world = len(all_pieces)
    cu = torch.as_tensor(cu, dtype=_I64)
    cc = _offsets(torch.div(cu[1:] - cu[:-1], ratio, rounding_mode="floor"))
    pieces = _Pieces.of(all_pieces)
    first, count, offset, per_rank = _piece_rows(cu, cc, pieces, ratio, world)
    mine = torch.nonzero(pieces.rank == rank).flatten()  # in local order
    n_local = int(per_rank[rank])
    by_start = mine[torch.argsort(pieces.start[mine])]
    interior = None
    if mine.numel():
        gs, ge = pieces.start[mine], pieces.start[mine] + pieces.length[mine]
        cu_int, cc_int, op_first, real, global_first, part_piece, place = _interior(cu, cc, gs, ge, ratio, coff)
        if int(real.sum()):
            p = mine[part_piece]
            position = offset[p] + global_first - first[p]
            interior = _op(cu_int, cc_int, op_first, real, position, n_local, place, ratio)
    seg_start, length, first_off, real_b, global_b, place_b = _boundary(cu, cc, pieces, ratio, coff)
    boundary = None
    if int(real_b[mine].sum()):
        lengths = length[mine]
        cc_b = _offsets(torch.div(lengths, ratio, rounding_mode="floor"))
        position = offset[mine] + global_b[mine] - first[mine]
        place = (place_b[0][mine], place_b[1][mine])
        boundary = _op(_offsets(lengths), cc_b, cc_b[:-1] + first_off[mine], real_b[mine], position, n_local,
                       place, ratio)  # fmt: skip
    # The boundary packs this rank takes part in: its own, and those whose tokens it holds.
    involved = (pieces.rank == rank) | _overlaps_rank(pieces, seg_start, seg_start + length, rank)
    tokens, piece = _expand(seg_start[involved], length[involved])  # receiver by receiver, in pack order
    receiver = pieces.rank[involved][piece]
    tok_owner, tok_local = pieces.locate(tokens)
    sending = tok_owner == rank
    pack_owner = tok_owner[receiver == rank]
    order = torch.argsort(pack_owner, stable=True)  # the receive buffer: by sender, then pack order
    perm = torch.empty_like(order)
    perm[order] = torch.arange(order.numel())
    produced = sum(int(p.count.sum()) for p in (interior, boundary) if p is not None)
    if produced != n_local:
        raise RuntimeError(
            f"csa_compressor.distributed: internal error, rank {rank} plans {produced} of {n_local} rows"
        )
    gather_dest, gather_count = _gather_runs(pieces, first, count, offset, int(per_rank.max()) if world else 0)
    return RankPlan(
        rank=rank,
        world_size=world,
        total_rows=int(cc[-1]),
        n_local=n_local,
        interior=interior,
        boundary=boundary,
        pack_local=tok_local[receiver == rank],
        send_idx=tok_local[sending],
        send_splits=torch.bincount(receiver[sending], minlength=world).tolist(),
        recv_splits=torch.bincount(pack_owner, minlength=world).tolist(),
        perm=perm,
        row_first=first[by_start],
        row_count=count[by_start],
        rows_per_rank=per_rank.tolist(),
        gather_dest=gather_dest,
        gather_count=gather_count,
        exchange=_any_crosses(pieces, seg_start, length),
    )


def _gather_runs(pieces: _Pieces, first, count, offset, max_rows: int):
    """Runs, in global row order, of where the rows sit in the all-gather (rank ``q``'s rows at
    ``q * max_rows``); ``(None, None)`` when that is the identity (each rank's rows follow the previous
    rank's)."""
    by_start = torch.argsort(pieces.start)
    dest, count = (pieces.rank * max_rows + offset)[by_start], count[by_start]
    if bool(torch.equal(dest, first[by_start])):
        return None, None
    return dest, count
