"""``CPLayout``: which global tokens of a THD pack each context-parallel rank holds, and its validation.

A layout is built on the host once per batch: its constructors read ``cu_seqlens`` to the host (one
device-to-host copy, the only synchronisation a layout costs). Construction never raises for bad values:
a problem is recorded and reported by the first collective call, on every rank, so that one rank's error
cannot leave the others waiting in a collective. The first call on a process group (and every call in the
validation mode) gathers every rank's layout summary with one small ``all_gather_object`` and checks it;
the first call of each further (ratio, coff) gathers and checks the call's arguments.
"""

from __future__ import annotations

import hashlib
from array import array

import torch
import torch.distributed as dist

from .. import support
from ..support import validation_env

__all__ = ["CPLayout"]

_PREFIX = "csa_compressor.distributed"


def _error(message: str) -> ValueError:
    return ValueError(f"{_PREFIX}: {message}")


def _host_offsets(cu_seqlens) -> tuple[torch.Tensor | None, str | None]:
    """``cu_seqlens`` as a host int64 tensor (one device-to-host copy for a device tensor), or why it is bad."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            shape = tuple(cu_seqlens.shape)
            return None, f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape {shape}"
        cu = cu_seqlens.detach().to("cpu", torch.int64)
    else:
        try:
            cu = torch.tensor([int(x) for x in cu_seqlens], dtype=torch.int64)
        except (TypeError, ValueError):
            return None, f"cu_seqlens must be a 1-D integer tensor or sequence, got {type(cu_seqlens).__name__}"
    if cu.numel() < 2:
        return None, f"cu_seqlens must have at least 2 entries, got {cu.numel()}"
    if int(cu[0]) != 0:
        return None, f"cu_seqlens[0] must be 0, got {int(cu[0])}"
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        b = int(torch.nonzero(lengths < 0)[0])
        return None, f"cu_seqlens must be non-decreasing; segment {b} has length {int(lengths[b])}"
    return cu, None


def _rank_error(rank, world_size) -> str | None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (type(value) is not int or value < 0):
            return f"{name} must be a non-negative int, got {value!r}"
    if world_size is not None and world_size < 1:
        return f"world_size must be >= 1, got {world_size}"
    if rank is not None and world_size is not None and rank >= world_size:
        return f"rank {rank} is out of range for world_size {world_size}"
    return None


def _normalise(pieces: torch.Tensor) -> torch.Tensor:
    """``(n, 2)`` pieces without the empty ones, neighbours that follow each other both locally and globally
    merged into one."""
    pieces = pieces[pieces[:, 1] > 0]
    if pieces.shape[0] < 2:
        return pieces
    start, length = pieces[:, 0], pieces[:, 1]
    new = torch.ones_like(start, dtype=torch.bool)
    new[1:] = start[1:] != start[:-1] + length[:-1]
    group = torch.cumsum(new.to(torch.int64), 0) - 1
    merged = torch.zeros(int(group[-1]) + 1, dtype=torch.int64).index_add_(0, group, length)
    return torch.stack([start[new], merged], 1)


def _balanced_pieces(cu: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    chunk = (cu[1:] - cu[:-1]) // (2 * world_size)
    starts = torch.stack([cu[:-1] + rank * chunk, cu[:-1] + (2 * world_size - 1 - rank) * chunk], 1)
    return torch.stack([starts.reshape(-1), chunk.repeat_interleave(2)], 1)


def _pieces_error(pieces, total: int) -> tuple[torch.Tensor | None, str | None]:
    try:
        table = torch.tensor([(int(s), int(n)) for s, n in pieces], dtype=torch.int64).reshape(-1, 2)
    except (TypeError, ValueError):
        return None, "pieces must be a sequence of (global_token_start, length) pairs of ints"
    bad = (table[:, 0] < 0) | (table[:, 1] < 0) | (table.sum(1) > total)
    if bool(bad.any()):
        start, length = table[int(torch.nonzero(bad)[0])].tolist()
        return None, f"piece (start={start}, length={length}) is not inside the pack's {total} tokens"
    return table, None


class CPLayout:
    """The global pack's ``cu_seqlens`` and the pieces of it that this rank holds, in local order.

    Build one with ``contiguous``, ``load_balanced`` or ``from_pieces`` (once per batch); pass it to
    ``compressor_pool_cp`` and ``gather_rows``. ``pieces`` are ``(global_token_start, length)`` pairs
    (empty pieces dropped, neighbours merged), ``local_tokens`` the rows ``kv_local`` must have.
    """

    def __init__(self, kind: str, cu, rank, world_size, pieces, error=None):
        self.kind = kind
        self.rank, self.world_size = rank, world_size
        self._error = error
        self._cu = cu if error is None else torch.zeros(2, dtype=torch.int64)  # host int64
        self._pieces_t = _normalise(pieces) if error is None else torch.zeros(0, 2, dtype=torch.int64)
        self._local_tokens = int(self._pieces_t[:, 1].sum())
        # id(group) -> (group, every rank's pieces, the (ratio, coff) whose first call was checked)
        self._checked: dict[int, tuple[object, list, set]] = {}
        self._plans: dict[tuple, object] = {}  # (ratio, coff, id(group), device, tail key) -> DevicePlan
        self._by_rows: dict[int, object] = {}  # id(plan.rows) -> DevicePlan, for gather_rows
        self._hot: tuple | None = None  # (ratio, coff, group, tail key, argument signature, DevicePlan): the last call

    @classmethod
    def contiguous(cls, cu_seqlens, rank: int, world_size: int) -> CPLayout:
        """Rank ``r`` holds the global tokens ``[r*T//world, (r+1)*T//world)``, ``T = cu_seqlens[-1]``."""
        cu, error = _host_offsets(cu_seqlens)
        error = error or _rank_error(rank, world_size)
        if error is not None:
            return cls("contiguous", cu, rank, world_size, None, error)
        total = int(cu[-1])
        start, end = rank * total // world_size, (rank + 1) * total // world_size
        return cls("contiguous", cu, rank, world_size, torch.tensor([[start, end - start]]))

    @classmethod
    def load_balanced(cls, cu_seqlens, rank: int, world_size: int) -> CPLayout:
        """Transformer Engine's THD split for causal CP: every sequence in ``2*world`` equal chunks, rank ``r``
        holding chunk ``r`` then chunk ``2*world-1-r`` of each sequence in turn (lengths divisible by ``2*world``)."""
        cu, error = _host_offsets(cu_seqlens)
        error = error or _rank_error(rank, world_size)
        if error is None:
            lengths = cu[1:] - cu[:-1]
            bad = torch.nonzero(lengths % (2 * world_size)).flatten()
            if bad.numel():
                b = int(bad[0])
                error = (
                    f"load_balanced needs every sequence length divisible by 2*world_size = {2 * world_size}; "
                    f"sequence {b} has {int(lengths[b])} tokens"
                )
        pieces = _balanced_pieces(cu, rank, world_size) if error is None else None
        return cls("load_balanced", cu, rank, world_size, pieces, error)

    @classmethod
    def from_pieces(cls, cu_seqlens, pieces, rank: int | None = None, world_size: int | None = None) -> CPLayout:
        """Any split: this rank holds ``pieces``, ``[(global_token_start, length), ...]`` in local order. The
        other ranks' pieces are learnt by the first call's collective; ``rank`` / ``world_size`` default to
        the process group's."""
        cu, error = _host_offsets(cu_seqlens)
        error = error or _rank_error(rank, world_size)
        table = None
        if error is None:
            table, error = _pieces_error(pieces, int(cu[-1]))
        return cls("from_pieces", cu, rank, world_size, table, error)

    # ------------------------------------------------------------------ properties

    def _ok(self) -> None:
        if self._error is not None:
            raise _error(self._error)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The global pack's offsets, a host int64 tensor (a copy)."""
        self._ok()
        return self._cu.clone()

    @property
    def total_tokens(self) -> int:
        self._ok()
        return int(self._cu[-1])

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        self._ok()
        return tuple(tuple(p) for p in self._pieces_t.tolist())

    @property
    def local_tokens(self) -> int:
        self._ok()
        return self._local_tokens

    def total_comp(self, ratio: int) -> int:
        """Rows of the global output at ``ratio`` (what ``gather_rows`` returns)."""
        self._ok()
        return int(torch.div(self._cu[1:] - self._cu[:-1], ratio, rounding_mode="floor").sum())

    def local_token_index(self, device=None) -> torch.Tensor:
        """The global token index of every local token, int64, in local order."""
        from .plan import expand_runs

        self._ok()
        return expand_runs(self._pieces_t[:, 0], self._pieces_t[:, 1]).to(device)

    def select_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global ``(T, ...)`` tensor, in local order (a copy)."""
        return x.index_select(0, self.local_token_index(x.device))

    def __repr__(self) -> str:
        if self._error is not None:
            return f"CPLayout({self.kind}, invalid: {self._error})"
        return (
            f"CPLayout({self.kind}, rank={self.rank}, world_size={self.world_size}, tokens={self.total_tokens}, "
            f"segments={self._cu.numel() - 1}, local_tokens={self.local_tokens}, pieces={self._pieces_t.shape[0]})"
        )

    # ------------------------------------------------------------------ validation

    def _summary(self, call) -> dict:
        digest = hashlib.blake2b(array("q", self._cu.tolist()).tobytes(), digest_size=16).hexdigest()
        return {
            "error": self._error,
            "kind": self.kind,
            "rank": self.rank,
            "world_size": self.world_size,
            "digest": digest,
            "tokens": int(self._cu[-1]),
            "segments": self._cu.numel() - 1,
            "pieces": self._pieces_t,
            "call": call,
        }

    def checked_pieces(self, group, device: torch.device, call: dict, validate: bool) -> list[torch.Tensor]:
        """Every rank's pieces (``(n, 2)`` int64), gathered and checked by the first call on ``group``; the
        first call of each (ratio, coff, tail configuration) on it (and every call with ``validate``) gathers and
        checks the call's arguments too. Raises the same ValueError on every rank when anything disagrees."""
        key = id(group)
        hit = self._checked.get(key)
        config = (call["ratio"], call["coff"], call.get("tail"))
        if hit is not None and not validate and config in hit[2]:
            return hit[1]
        full = hit is None or validate  # the layouts too, not only the call
        summary = self._summary(call) if full else {"error": None, "call": call}
        summaries = _gather(summary, group, device)
        message = summaries_error(summaries) if full else _call_summaries_error(summaries)
        if message is not None:
            raise _error(message)
        if full:
            hit = self._checked[key] = (group, [s["pieces"] for s in summaries], set())
        hit[2].add(config)
        return hit[1]


def _gather(summary: dict, group, device: torch.device) -> list[dict]:
    """Every rank's ``summary`` (one ``all_gather_object``; no process group: a world of one rank)."""
    if group is None:
        return [summary]
    summaries = [None] * dist.get_world_size(group)
    if device.type == "cuda":  # with NCCL, all_gather_object moves the pickles through the current device
        with torch.cuda.device(device):
            dist.all_gather_object(summaries, summary, group=group)
    else:
        dist.all_gather_object(summaries, summary, group=group)
    return summaries


def _call_summaries_error(summaries: list[dict]) -> str | None:
    """What is wrong with the call's arguments on any rank, or where ranks disagree on it."""
    errors = [f"rank {q}: {s['call']['error']}" for q, s in enumerate(summaries) if s["call"].get("error")]
    if errors:
        return "; ".join(errors)
    first = summaries[0]
    for q, s in enumerate(summaries[1:], 1):
        if s["call"] != first["call"]:
            return f"ranks disagree on the call: rank 0 {first['call']}, rank {q} {s['call']}"
    return None


def summaries_error(summaries: list[dict]) -> str | None:
    """What is wrong with the gathered layouts of a group, the same text on every rank; None if nothing.

    The layouts first (their own errors, ranks, offsets, coverage), then the call's arguments.
    """
    errors = [f"rank {q}: {s['error']}" for q, s in enumerate(summaries) if s["error"]]
    if errors:
        return "; ".join(errors)
    size = len(summaries)
    for q, s in enumerate(summaries):
        if s["world_size"] not in (None, size):
            return f"rank {q} built its {s['kind']} layout for world_size {s['world_size']}, but the group has {size} ranks"
        if s["rank"] not in (None, q):
            return f"rank {q} of the group built its {s['kind']} layout as rank {s['rank']}"
    first = summaries[0]
    for q, s in enumerate(summaries[1:], 1):
        if s["digest"] != first["digest"]:
            return (
                f"cu_seqlens differs between ranks: rank 0 has {first['tokens']} tokens in {first['segments']} "
                f"segments, rank {q} {s['tokens']} tokens in {s['segments']} segments (or other offsets)"
            )
    return _coverage_error(summaries) or _call_summaries_error(summaries)


def _coverage_error(summaries: list[dict]) -> str | None:
    kinds = ", ".join(f"rank {q} {s['kind']}" for q, s in enumerate(summaries))
    table = torch.cat([s["pieces"] for s in summaries])
    owner = torch.cat([torch.full((s["pieces"].shape[0],), q) for q, s in enumerate(summaries)])
    order = torch.argsort(table[:, 0], stable=True)
    start, end, owner = table[order, 0], table[order].sum(1), owner[order]
    previous_end = torch.cat([torch.zeros(1, dtype=torch.int64), end[:-1]])
    total = summaries[0]["tokens"]
    overlap = torch.nonzero(start < previous_end).flatten()
    if overlap.numel():
        i = int(overlap[0])
        span = f"[{int(start[i])}, {min(int(previous_end[i]), int(end[i]))})"
        return f"layouts disagree: global tokens {span} are held by rank {int(owner[i - 1])} and rank {int(owner[i])} ({kinds})"
    gap = torch.nonzero(start > previous_end).flatten()
    if gap.numel():
        i = int(gap[0])
        return (
            f"layouts disagree: global tokens [{int(previous_end[i])}, {int(start[i])}) are held by no rank ({kinds})"
        )
    covered = int(end[-1]) if end.numel() else 0
    if covered < total:
        return f"layouts disagree: global tokens [{covered}, {total}) are held by no rank ({kinds})"
    return None


def validation_requested(validate: bool | None) -> bool:
    """``validate`` if given, else ``$CSA_COMPRESSOR_VALIDATE`` read as the single-GPU op reads it
    (``support.validation_requested``: 0 or 1)."""
    if validate is not None:
        return bool(validate)
    # Unset on the hot path: one dict lookup.
    return validation_env() is not None and support.validation_requested(False)
