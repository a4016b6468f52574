"""``CPLayout``: which global tokens of a THD pack each context-parallel rank holds, and its validation.

A layout is built on the host once per batch: its constructors read ``cu_seqlens`` to the host (one
device-to-host copy, the only synchronisation a layout costs). Construction never raises for bad values:
a problem is recorded and reported by the first collective call, on every rank, so that one rank's error
cannot leave the others waiting in a collective. The first call on a process group (and every call in the
validation mode) gathers every rank's layout summary with one small ``all_gather_object`` and checks it.
"""

from __future__ import annotations

import hashlib
import os
from array import array

import torch
import torch.distributed as dist

__all__ = ["CPLayout"]

_PREFIX = "csa_compressor.distributed"


def _error(message: str) -> ValueError:
    return ValueError(f"{_PREFIX}: {message}")


def _host_offsets(cu_seqlens) -> tuple[list[int] | None, str | None]:
    """``cu_seqlens`` as host ints (one device-to-host copy for a device tensor), or the reason it is bad."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            return (
                None,
                f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}",
            )
        cu = cu_seqlens.tolist()
    else:
        try:
            cu = [int(x) for x in cu_seqlens]
        except (TypeError, ValueError):
            return None, f"cu_seqlens must be a 1-D integer tensor or sequence, got {type(cu_seqlens).__name__}"
    if len(cu) < 2:
        return None, f"cu_seqlens must have at least 2 entries, got {len(cu)}"
    if cu[0] != 0:
        return None, f"cu_seqlens[0] must be 0, got {cu[0]}"
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            return None, f"cu_seqlens must be non-decreasing; segment {b} has length {cu[b + 1] - cu[b]}"
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


def _normalise(pieces) -> list[tuple[int, int]]:
    """Drop empty pieces and merge pieces that follow each other both locally and globally."""
    out: list[tuple[int, int]] = []
    for start, length in pieces:
        if length == 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def _contiguous_pieces(total: int, world_size: int) -> list[list[tuple[int, int]]]:
    return [
        [(r * total // world_size, (r + 1) * total // world_size - r * total // world_size)] for r in range(world_size)
    ]


def _balanced_pieces(cu: list[int], world_size: int) -> list[list[tuple[int, int]]]:
    chunks = 2 * world_size
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for b in range(len(cu) - 1):
        chunk = (cu[b + 1] - cu[b]) // chunks
        for r in range(world_size):
            pieces[r] += [(cu[b] + r * chunk, chunk), (cu[b] + (chunks - 1 - r) * chunk, chunk)]
    return pieces


def _pieces_error(pieces, total: int) -> str | None:
    try:
        pairs = [(int(s), int(n)) for s, n in pieces]
    except (TypeError, ValueError):
        return "pieces must be a sequence of (global_token_start, length) pairs of ints"
    for start, length in pairs:
        if start < 0 or length < 0 or start + length > total:
            return f"piece (start={start}, length={length}) is not inside the pack's {total} tokens"
    return None


class CPLayout:
    """The global pack's ``cu_seqlens`` and the pieces of it that this rank holds, in local order.

    Build one with ``contiguous``, ``load_balanced`` or ``from_pieces`` (once per batch); pass it to
    ``compressor_pool_cp`` and ``gather_rows``. ``pieces`` are ``(global_token_start, length)`` pairs
    (empty pieces dropped, neighbours merged), ``local_tokens`` the rows ``kv_local`` must have.
    """

    def __init__(self, kind: str, cu, rank, world_size, pieces, all_pieces=None, error=None):
        self.kind = kind
        self.rank, self.world_size = rank, world_size
        self._cu = tuple(cu) if cu is not None else (0, 0)
        self._error = error
        self._pieces = tuple(_normalise(pieces)) if error is None else ()
        self._all_pieces = [_normalise(p) for p in all_pieces] if all_pieces is not None and error is None else None
        self._checked: dict[int, tuple[object, list]] = {}  # id(group) -> (group, every rank's pieces)
        self._plans: dict[tuple, object] = {}  # (ratio, coff, id(group), device) -> DevicePlan

    @classmethod
    def contiguous(cls, cu_seqlens, rank: int, world_size: int) -> CPLayout:
        """Rank ``r`` holds the global tokens ``[r*T//world, (r+1)*T//world)``, ``T = cu_seqlens[-1]``."""
        cu, error = _host_offsets(cu_seqlens)
        error = error or _rank_error(rank, world_size)
        all_pieces = _contiguous_pieces(cu[-1], world_size) if error is None else None
        return cls("contiguous", cu, rank, world_size, all_pieces[rank] if all_pieces else (), all_pieces, error)

    @classmethod
    def load_balanced(cls, cu_seqlens, rank: int, world_size: int) -> CPLayout:
        """Transformer Engine's THD split for causal CP: every sequence in ``2*world`` equal chunks, rank ``r``
        holding chunk ``r`` then chunk ``2*world-1-r`` of each sequence in turn (lengths divisible by ``2*world``)."""
        cu, error = _host_offsets(cu_seqlens)
        error = error or _rank_error(rank, world_size)
        if error is None:
            for b in range(len(cu) - 1):
                if (cu[b + 1] - cu[b]) % (2 * world_size):
                    error = (
                        f"load_balanced needs every sequence length divisible by 2*world_size = {2 * world_size}; "
                        f"sequence {b} has {cu[b + 1] - cu[b]} tokens"
                    )
                    break
        all_pieces = _balanced_pieces(cu, world_size) if error is None else None
        return cls("load_balanced", cu, rank, world_size, all_pieces[rank] if all_pieces else (), all_pieces, error)

    @classmethod
    def from_pieces(cls, cu_seqlens, pieces, rank: int | None = None, world_size: int | None = None) -> CPLayout:
        """Any split: this rank holds ``pieces``, ``[(global_token_start, length), ...]`` in local order. The
        other ranks' pieces are learnt by the first call's collective; ``rank`` / ``world_size`` default to
        the process group's."""
        cu, error = _host_offsets(cu_seqlens)
        error = error or _rank_error(rank, world_size) or _pieces_error(pieces, cu[-1])
        pairs = [(int(s), int(n)) for s, n in pieces] if error is None else ()
        return cls("from_pieces", cu, rank, world_size, pairs, None, error)

    # ------------------------------------------------------------------ properties

    def _ok(self) -> None:
        if self._error is not None:
            raise _error(self._error)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """The global pack's offsets, host ints."""
        self._ok()
        return self._cu

    @property
    def total_tokens(self) -> int:
        self._ok()
        return self._cu[-1]

    @property
    def pieces(self) -> tuple[tuple[int, int], ...]:
        self._ok()
        return self._pieces

    @property
    def local_tokens(self) -> int:
        self._ok()
        return sum(length for _, length in self._pieces)

    def total_comp(self, ratio: int) -> int:
        """Rows of the global output at ``ratio`` (what ``gather_rows`` returns)."""
        self._ok()
        return sum((self._cu[b + 1] - self._cu[b]) // ratio for b in range(len(self._cu) - 1))

    def local_token_index(self, device=None) -> torch.Tensor:
        """The global token index of every local token, int64, in local order."""
        from .plan import expand_runs

        self._ok()
        return expand_runs([s for s, _ in self._pieces], [n for _, n in self._pieces]).to(device)

    def select_local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global ``(T, ...)`` tensor, in local order (a copy)."""
        return x.index_select(0, self.local_token_index(x.device))

    def __repr__(self) -> str:
        if self._error is not None:
            return f"CPLayout({self.kind}, invalid: {self._error})"
        return (
            f"CPLayout({self.kind}, rank={self.rank}, world_size={self.world_size}, tokens={self._cu[-1]}, "
            f"segments={len(self._cu) - 1}, local_tokens={self.local_tokens}, pieces={len(self._pieces)})"
        )

    # ------------------------------------------------------------------ validation

    def _summary(self, call) -> dict:
        digest = hashlib.blake2b(array("q", self._cu).tobytes(), digest_size=16).hexdigest()
        return {
            "error": self._error,
            "kind": self.kind,
            "rank": self.rank,
            "world_size": self.world_size,
            "digest": digest,
            "tokens": self._cu[-1],
            "segments": len(self._cu) - 1,
            "pieces": self._pieces,
            "call": call,
        }

    def checked_pieces(self, group, device: torch.device, call: dict, validate: bool) -> list:
        """Every rank's pieces, gathered and checked on the first call on ``group`` (and on every call with
        ``validate``); raises the same ValueError on every rank when anything disagrees."""
        key = id(group)
        hit = self._checked.get(key)
        if hit is not None and not validate:
            return hit[1]
        if group is None:  # no process group: one rank, nothing to gather
            summaries = [self._summary(call)]
        else:
            summaries = [None] * dist.get_world_size(group)
            # all_gather_object moves the pickles through the current CUDA device with NCCL.
            if device.type == "cuda":
                with torch.cuda.device(device):
                    dist.all_gather_object(summaries, self._summary(call), group=group)
            else:
                dist.all_gather_object(summaries, self._summary(call), group=group)
        message = summaries_error(summaries)
        if message is not None:
            raise _error(message)
        all_pieces = [list(s["pieces"]) for s in summaries]
        self._checked[key] = (group, all_pieces)
        return all_pieces


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
    message = _coverage_error(summaries)
    if message is not None:
        return message
    errors = [f"rank {q}: {s['call']['error']}" for q, s in enumerate(summaries) if s["call"].get("error")]
    if errors:
        return "; ".join(errors)
    for q, s in enumerate(summaries[1:], 1):
        if s["call"] != first["call"]:
            return f"ranks disagree on the call: rank 0 {first['call']}, rank {q} {s['call']}"
    return None


def _coverage_error(summaries: list[dict]) -> str | None:
    kinds = ", ".join(f"rank {q} {s['kind']}" for q, s in enumerate(summaries))
    spans = sorted((start, start + length, q) for q, s in enumerate(summaries) for start, length in s["pieces"])
    total = summaries[0]["tokens"]
    pos, holder = 0, None
    for start, end, q in spans:
        if start < pos:
            return f"layouts disagree: global tokens [{start}, {min(pos, end)}) are held by rank {holder} and rank {q} ({kinds})"
        if start > pos:
            return f"layouts disagree: global tokens [{pos}, {start}) are held by no rank ({kinds})"
        pos, holder = end, q
    if pos < total:
        return f"layouts disagree: global tokens [{pos}, {total}) are held by no rank ({kinds})"
    return None


def validation_requested(validate: bool | None) -> bool:
    """``validate`` if given, else ``$CSA_COMPRESSOR_VALIDATE`` (set and not ``0``)."""
    if validate is not None:
        return bool(validate)
    return os.environ.get("CSA_COMPRESSOR_VALIDATE", "0").strip() not in ("", "0")
