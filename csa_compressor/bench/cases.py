"""The bench's case matrix, the published figures it quotes, the selections of the command line and the DRAM floor."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "BASELINES",
    "CASES",
    "CUDNN_FRONTEND_H200",
    "DIRECTIONS",
    "KERNEL_BACKENDS",
    "TAIL_MODES",
    "TORCH_TAIL",
    "Case",
    "floor_bytes",
    "floor_us",
    "measured_direction",
    "parse_case",
    "resolve_backends",
    "select_backends",
    "select_cases",
    "select_directions",
]

KERNEL_BACKENDS = ("cute", "triton", "reference")
BASELINES = ("torch.compile", "eager")
# Suffix of the unfused-tail rows: our pooling kernel, then PyTorch's RMSNorm and an eager RoPE.
TORCH_TAIL = "+torch tail"
DIRECTIONS = ("fwd", "bwd")
TAIL_MODES = ("on", "off", "only")
# DeepSeek-V4 rotates the last 64 columns of each compressed row.
ROPE_DIM = 64


@dataclass(frozen=True)
class Case:
    """One problem shape: ``seqlens`` sequences packed THD; ``tail``: the output goes through RMSNorm and RoPE."""

    seqlens: tuple[int, ...]
    head_dim: int
    ratio: int
    coff: int
    tail: bool = False

    @property
    def name(self) -> str:
        lens = set(self.seqlens)
        body = f"{len(self.seqlens)}x{self.seqlens[0]}" if len(lens) == 1 else "+".join(map(str, self.seqlens))
        return f"{body}-d{self.head_dim}-r{self.ratio}-c{self.coff}" + ("-tail" if self.tail else "")

    @property
    def pooling(self) -> Case:
        """The same shape without the tail (the pooling-only case the fused tail is compared with)."""
        return replace(self, tail=False)

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def total_comp(self) -> int:
        return sum(s // self.ratio for s in self.seqlens)

    @property
    def rope_dim(self) -> int:
        """Rotated columns of a tail case (0 without a tail)."""
        return min(ROPE_DIM, self.head_dim - self.head_dim % 2) if self.tail else 0


CASES: tuple[Case, ...] = (
    Case((8192,), 128, 4, 2),
    Case((8192,) * 3, 128, 4, 2),
    Case((8192,), 512, 4, 2),
    Case((8192,) * 3, 512, 4, 2),
    Case((8192,), 128, 128, 1),
    Case((65536,), 512, 128, 2),
    Case((8192,) * 3, 512, 128, 1),
)

# cudnn-frontend 1.32's CuTe-DSL compressor kernels (their sm_100 gate lifted), measured on one H200 with this
# bench's method: cold kernel time and idle wall per call, microseconds. Quoted in the reports, not re-measured.
CUDNN_FRONTEND_H200: dict[str, dict[str, float]] = {
    "1x8192-d128-r4-c2": dict(fwd=6.9, bwd=17.1, wall_fwd=47, wall_bwd=68),
    "3x8192-d128-r4-c2": dict(fwd=14.3, bwd=27.6, wall_fwd=51, wall_bwd=81),
    "1x8192-d512-r4-c2": dict(fwd=17.5, bwd=29.6, wall_fwd=51, wall_bwd=84),
    "3x8192-d512-r4-c2": dict(fwd=43.3, bwd=76.0, wall_fwd=95, wall_bwd=151),
    "1x8192-d128-r128-c1": dict(fwd=11.8, bwd=12.7, wall_fwd=50, wall_bwd=75),
    "1x65536-d512-r128-c2": dict(fwd=98.1, bwd=260.0, wall_fwd=132, wall_bwd=324),
    "3x8192-d512-r128-c1": dict(fwd=28.6, bwd=57.1, wall_fwd=83, wall_bwd=118),
}

_CASE_RE = re.compile(
    r"^(?P<b>\d+)x(?P<l>\d+)[\s_-]*d(?P<d>\d+)[\s_-]*r(?P<r>\d+)[\s_-]*c(?P<c>\d+)(?P<tail>[\s_+-]*tail)?$"
)


def parse_case(text: str) -> Case:
    """A case from its name, e.g. ``"3x8192-d512-r4-c2"`` or ``"3x8192-d512-r4-c2-tail"`` (spaces or underscores
    also separate)."""
    m = _CASE_RE.match(text.strip().lower())
    if m is None:
        raise ValueError(
            f"cannot parse case {text!r}; expected e.g. 3x8192-d512-r4-c2 (sequences x length, head_dim, ratio, "
            "coff), with -tail for the RMSNorm + RoPE tail"
        )
    b, seqlen, d, r, c = (int(m[k]) for k in ("b", "l", "d", "r", "c"))
    if b < 1 or seqlen < 1 or d < 1 or r < 1:
        raise ValueError(f"case {text!r}: sequences, length, head_dim and ratio must be at least 1")
    if c not in (1, 2):
        raise ValueError(f"case {text!r}: coff must be 1 or 2, got {c}")
    return Case((seqlen,) * b, d, r, c, tail=m["tail"] is not None)


def _case_tokens(tokens: Iterable[str] | None) -> list[Case]:
    out: list[Case] = []
    for raw in tokens or ():
        for tok in str(raw).split(","):
            tok = tok.strip()
            if not tok:
                continue
            if tok.isdigit():
                i = int(tok)
                if i >= len(CASES):
                    raise ValueError(f"case index {i} out of range: there are {len(CASES)} cases (0..{len(CASES) - 1})")
                case = CASES[i]
            else:
                case = parse_case(tok)
            if case not in out:
                out.append(case)
    return out


def select_cases(tokens: Iterable[str] | None, tail: str = "off") -> list[Case]:
    """Cases from ``--cases`` tokens (0-based indices into ``CASES``, as ``--list`` shows, or names; default all),
    then by ``tail``: "on" adds the tail twin of every pooling case after the pooling cases, "only" keeps the tails,
    "off" adds none. A name outside the matrix is accepted (it has no published figures)."""
    if tail not in TAIL_MODES:
        raise ValueError(f"unknown tail mode {tail!r}; choose from {', '.join(TAIL_MODES)}")
    named = _case_tokens(tokens) or list(CASES)
    pooling = [c for c in named if not c.tail]
    tails = [c for c in named if c.tail]
    twins = [replace(c, tail=True) for c in pooling if replace(c, tail=True) not in tails]
    if tail == "on":
        return pooling + tails + twins
    if tail == "only":
        return tails + twins
    return pooling + tails


def _backend_tokens(tokens: Iterable[str] | None) -> list[str]:
    aliases = {"compile": "torch.compile", "torch_compile": "torch.compile", "inductor": "torch.compile"}
    wanted: list[str] = []
    for raw in tokens or ("default",):
        for tok in str(raw).split(","):
            tok = aliases.get(tok.strip().lower(), tok.strip().lower())
            if tok and tok not in ("all", "default") and tok not in KERNEL_BACKENDS + BASELINES:
                raise ValueError(
                    f"unknown backend {tok!r}; choose from {', '.join(KERNEL_BACKENDS + BASELINES)} or all"
                )
            if tok:
                wanted.append(tok)
    return wanted


def select_backends(tokens: Iterable[str] | None, available: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(chosen, unavailable)`` from ``--backends`` tokens. ``None``: the available GPU kernel backends (the
    reference backend only where it is the one available: elsewhere the eager baseline times the same PyTorch
    ops) and both baselines; "all": every available backend and both baselines. ``unavailable``: kernel backends
    named explicitly that cannot run here (the caller decides whether that is an error). Order: kernel backends
    in ``KERNEL_BACKENDS`` order, then the baselines."""
    wanted = _backend_tokens(tokens)
    explicit = [b for b in wanted if b in KERNEL_BACKENDS]
    if "all" in wanted:
        wanted += [*available, *BASELINES]
    if "default" in wanted:
        gpu = [b for b in available if b != "reference"]
        wanted += [*(gpu or available), *BASELINES]
    unavailable = [b for b in dict.fromkeys(explicit) if b not in available]
    order = [b for b in KERNEL_BACKENDS if b in available] + list(BASELINES)
    return [b for b in order if b in wanted], unavailable


def resolve_backends(tokens: Iterable[str] | None, available: Sequence[str]) -> list[str]:
    """``select_backends``, with a kernel backend named explicitly that cannot run here an error (ValueError)."""
    chosen, unavailable = select_backends(tokens, available)
    if unavailable:
        raise ValueError(
            f"backend {', '.join(unavailable)} cannot run on this machine (available here: {', '.join(available) or 'none'})"
        )
    return chosen


def select_directions(tokens: Iterable[str] | None) -> list[str]:
    out: list[str] = []
    for raw in tokens or DIRECTIONS:
        for tok in str(raw).split(","):
            tok = tok.strip().lower()
            if tok and tok not in DIRECTIONS:
                raise ValueError(f"unknown direction {tok!r}; choose from fwd, bwd")
            if tok and tok not in out:
                out.append(tok)
    return [d for d in DIRECTIONS if d in out]


def is_baseline(backend: str) -> bool:
    """Rows timed as forward and forward+backward (autograd) rather than as the two wrapper calls."""
    return backend in BASELINES or backend.endswith(TORCH_TAIL)


def measured_direction(backend: str, direction: str) -> str:
    """What a direction means for a backend: baselines time "bwd" as forward plus backward."""
    return "fwd+bwd" if is_baseline(backend) and direction == "bwd" else direction


def case_backends(case: Case, backends: Sequence[str]) -> list[str]:
    """The rows of one case: pooling cases as chosen; tail cases without the reference backend (it has no fused
    tail) and with, for each GPU kernel backend, its pooling followed by PyTorch's tail."""
    if not case.tail:
        return list(backends)
    kernels = [b for b in backends if b in KERNEL_BACKENDS and b != "reference"]
    return kernels + [b + TORCH_TAIL for b in kernels] + [b for b in backends if b in BASELINES]


# --------------------------------------------------------------------------------------------------------------------
# The DRAM floor


def floor_bytes(case: Case, direction: str) -> int:
    """Bytes that must cross DRAM.

    Forward reads kv and score once and writes out: ``2*T*coff*d*2 + N*d*2``. Backward reads kv, score and
    grad_out and writes grad_kv and grad_score: ``4*T*coff*d*2 + N*d*2``. ``"fwd+bwd"`` is their sum. A tail case
    also reads each row's cos and sin (``N*rope_dim*4``) and the norm weight, and its backward writes the norm
    weight's fp32 gradient. T and N are the real token and row counts (no padding); kv and score are bf16.
    """
    width = case.coff * case.head_dim
    rows = case.total_comp * case.head_dim * 2
    tail = case.total_comp * case.rope_dim * 4 + case.head_dim * 2 if case.tail else 0
    if direction == "fwd":
        return 2 * case.total_tokens * width * 2 + rows + tail
    if direction == "bwd":
        return 4 * case.total_tokens * width * 2 + rows + (tail + case.head_dim * 4 if case.tail else 0)
    if direction == "fwd+bwd":
        return floor_bytes(case, "fwd") + floor_bytes(case, "bwd")
    raise ValueError(f"unknown direction {direction!r}")


def floor_us(case: Case, direction: str, copy_bytes_per_s: float) -> float:
    """Floor in microseconds at a copy rate counted as read + write bytes per second."""
    if not copy_bytes_per_s > 0:
        raise ValueError(f"copy rate must be positive, got {copy_bytes_per_s}")
    return floor_bytes(case, direction) / copy_bytes_per_s * 1e6
