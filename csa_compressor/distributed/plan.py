"""Host-side plan of the context-parallel pooling for one rank: its two local packs and its halo exchange.

Every global compressed row is produced by the rank that holds the row's last token. A rank produces its
rows with at most two calls of the single-GPU op:

- the *interior* call runs on the rank's own ``kv_local`` / ``score_local`` as they are (no copy): its local
  segments follow the global segments inside each piece, so every row whose whole window lies inside one
  piece comes out right;
- the *boundary* call runs on a small pack of the rows whose window starts before their piece: for each
  piece that starts inside a segment, at most two rows (one with coff 1), with the halo (at most
  ``coff * ratio - 1`` tokens before the piece) and the row's own tokens.

A local segment that starts at a group other than its segment's first reads no previous group, so with
coff 2 its first row is wrong; such rows are *extra*: computed, dropped from the output, given a zero
gradient (they are always rows of the boundary pack too). Everything here is plain Python on host ints,
built once per layout and configuration; ``device_plan`` turns it into index tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

__all__ = ["RankPlan", "build_plan", "owned_row_runs"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Pack:
    """One local pack being built: segment offsets, row counts and where its rows go.

    ``row_runs``: ``(op_row, count, global_row)`` for the real rows; every other op row is an extra.
    """

    cu: list[int] = field(default_factory=lambda: [0])
    cc: list[int] = field(default_factory=lambda: [0])
    row_runs: list[tuple[int, int, int]] = field(default_factory=list)

    def add(self, length: int, rows: int = 0, first_real: int = 0, global_row: int = 0) -> None:
        """A local segment of ``length`` tokens with ``rows`` groups, of which rows ``first_real..`` are real
        (global rows ``global_row..``)."""
        if length == 0:
            return
        op_row = self.cc[-1]
        self.cu.append(self.cu[-1] + length)
        self.cc.append(op_row + rows)
        if rows > first_real:
            self.row_runs.append((op_row + first_real, rows - first_real, global_row))

    @property
    def rows(self) -> int:
        return self.cc[-1]


def _first_real(jstart: int, coff: int) -> int:
    """The first row of a local segment starting at group ``jstart`` that reads its whole window."""
    return 1 if coff == 2 and jstart > 0 else 0


def _boundary_segment(cu, b: int, gs: int, ge: int, ratio: int, coff: int):
    """The rows of the piece ``[gs, ge)`` that start inside segment ``b`` whose window begins before ``gs``.

    Returns ``(A, E, jstart, first)``: the local segment's global token range (``A`` is the start of group
    ``jstart``) and the first of those rows, or None when there are none. With coff 2 the segment starts one
    group early (the first row's previous group), which is an extra row, or a row another piece owns.
    """
    start = cu[b]
    groups = (cu[b + 1] - start) // ratio
    j0 = _ceil_div(gs - start, ratio)  # the first group starting at or after gs
    candidates = (j0 - 1, j0) if coff == 2 else (j0 - 1,)
    rows = [j for j in candidates if 0 <= j < groups and gs <= start + (j + 1) * ratio - 1 < ge]
    # j0 - 1 straddles gs (when it ends at or after gs); with coff 2, row j0 reads group j0 - 1.
    if not rows:
        return None
    jstart = rows[0] - _first_real(rows[0], coff)
    return start + jstart * ratio, start + (rows[-1] + 1) * ratio, jstart, rows[0]


def _segments_of(cu, gs: int, ge: int):
    """Indices ``b`` of the non-empty segments that overlap ``[gs, ge)``."""
    b = bisect.bisect_right(cu, gs) - 1
    last = len(cu) - 2
    while b <= last and cu[b] < ge:
        if cu[b + 1] > cu[b]:
            yield b
        b += 1


def owned_row_runs(cu, cc, gs: int, ge: int, ratio: int):
    """``(global_row, count)`` runs of the rows whose last token lies in ``[gs, ge)``."""
    for b in _segments_of(cu, gs, ge):
        start, groups = cu[b], (cu[b + 1] - cu[b]) // ratio
        j_lo = max(0, _ceil_div(gs - start - ratio + 1, ratio))
        j_hi = min(groups - 1, (ge - start - ratio) // ratio)
        if j_hi >= j_lo:
            yield cc[b] + j_lo, j_hi - j_lo + 1


def _interior(pack: _Pack, cu, cc, gs: int, ge: int, ratio: int, coff: int) -> None:
    """Local segments over the piece's own tokens ``[gs, ge)``, in order; they tile the piece."""
    pos = gs
    for b in _segments_of(cu, gs, ge):
        start = cu[b]  # pos == start after the first segment: the segments tile the pack
        end = min(ge, cu[b + 1])
        jstart = _ceil_div(pos - start, ratio)
        aligned = min(start + jstart * ratio, end)
        pack.add(aligned - pos)  # shorter than ratio: no row
        rows = (end - aligned) // ratio
        pack.add(end - aligned, rows, _first_real(jstart, coff), cc[b] + jstart + _first_real(jstart, coff))
        pos = end
    pack.add(ge - pos)


@dataclass
class RankPlan:
    """Everything one rank needs, in host ints and lists (``device_plan`` makes the tensors).

    - ``interior`` / ``boundary``: the two local packs;
    - ``pack_sources``: ``(src_rank, src_local_start, count)`` runs, the boundary pack's tokens in order;
    - ``send`` / ``recv``: per peer, the local token runs this rank sends, and the pack positions the runs
      it receives fill (in the peer's send order);
    - ``rows``: ``(global_row, count)`` runs of the rows this rank produces, ascending;
    - ``rows_per_rank``, ``row_owner_runs``: for ``gather_rows``: every rank's row count, and for every rank
      its ``(global_row, count)`` runs;
    - ``exchange``: whether any rank receives tokens from another (else no collective runs).
    """

    rank: int
    world_size: int
    local_tokens: int
    total_rows: int
    interior: _Pack
    boundary: _Pack
    pack_sources: list[tuple[int, int, int]]
    send: list[list[tuple[int, int]]]
    recv: list[list[tuple[int, int]]]
    rows: list[tuple[int, int]]
    rows_per_rank: list[int]
    row_owner_runs: list[list[tuple[int, int]]]
    exchange: bool


class _TokenMap:
    """Global token -> (rank, local index), over every rank's pieces."""

    def __init__(self, all_pieces):
        entries = []
        for rank, pieces in enumerate(all_pieces):
            local = 0
            for start, length in pieces:
                entries.append((start, length, rank, local))
                local += length
        entries.sort()
        self.starts = [e[0] for e in entries]
        self.entries = entries

    def runs(self, a: int, e: int):
        """``(rank, local_start, count)`` runs covering the global tokens ``[a, e)``."""
        i = bisect.bisect_right(self.starts, a) - 1
        out = []
        while a < e:
            start, length, rank, local = self.entries[i]
            count = min(e, start + length) - a
            if count > 0:
                out.append((rank, local + a - start, count))
                a += count
            i += 1
        return out


def _boundary_runs(cu, pieces, token_map: _TokenMap, ratio: int, coff: int, pack: _Pack | None, cc=None):
    """The boundary pack of one rank's pieces: its token source runs (and, with ``pack``, its segments)."""
    runs = []
    for gs, length in pieces:
        b = bisect.bisect_right(cu, gs) - 1
        if cu[b] == gs:
            continue  # the piece starts a segment (or a run of empty ones): no window reaches before it
        seg = _boundary_segment(cu, b, gs, gs + length, ratio, coff)
        if seg is None:
            continue
        a, e, jstart, first = seg
        runs.extend(token_map.runs(a, e))
        if pack is not None:
            pack.add(e - a, (e - a) // ratio, first - jstart, cc[b] + first)
    return runs


def build_plan(cu, all_pieces, rank: int, ratio: int, coff: int) -> RankPlan:
    """The plan of ``rank`` given the global ``cu`` (host ints) and every rank's pieces (normalised)."""
    world = len(all_pieces)
    cc = [0]
    for b in range(len(cu) - 1):
        cc.append(cc[-1] + (cu[b + 1] - cu[b]) // ratio)
    token_map = _TokenMap(all_pieces)
    interior, boundary = _Pack(), _Pack()
    for gs, length in all_pieces[rank]:
        _interior(interior, cu, cc, gs, gs + length, ratio, coff)
    send: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    recv: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    exchange = False
    pack_sources: list[tuple[int, int, int]] = []
    for q in range(world):
        runs = _boundary_runs(cu, all_pieces[q], token_map, ratio, coff, boundary if q == rank else None, cc)
        if q == rank:
            pack_sources = runs
        for src, local, count in runs:
            exchange = exchange or src != q
            if src == rank:
                send[q].append((local, count))
    pos = 0
    for src, _, count in pack_sources:
        recv[src].append((pos, count))
        pos += count
    row_owner_runs = [
        [run for gs, length in pieces for run in owned_row_runs(cu, cc, gs, gs + length, ratio)]
        for pieces in all_pieces
    ]
    produced = sum(r[1] for pack in (interior, boundary) for r in pack.row_runs)
    if produced != sum(c for _, c in row_owner_runs[rank]):
        raise RuntimeError(f"csa_compressor.distributed: internal error, rank {rank} plans {produced} rows")
    return RankPlan(
        rank=rank,
        world_size=world,
        local_tokens=sum(length for _, length in all_pieces[rank]),
        total_rows=cc[-1],
        interior=interior,
        boundary=boundary,
        pack_sources=pack_sources,
        send=send,
        recv=recv,
        rows=sorted(row_owner_runs[rank]),
        rows_per_rank=[sum(c for _, c in runs) for runs in row_owner_runs],
        row_owner_runs=row_owner_runs,
        exchange=exchange,
    )


def expand_runs(starts, counts) -> torch.Tensor:
    """``cat(arange(s, s + c) for s, c in zip(starts, counts))`` as one int64 tensor, without a Python loop
    over the elements."""
    counts_t = torch.tensor(list(counts), dtype=torch.int64)
    total = int(counts_t.sum()) if counts_t.numel() else 0
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    starts_t = torch.tensor(list(starts), dtype=torch.int64)
    offsets = torch.cumsum(counts_t, 0) - counts_t
    run = torch.repeat_interleave(torch.arange(counts_t.numel()), counts_t)
    return starts_t[run] + torch.arange(total) - offsets[run]
