"""THD (packed, ragged) layout helpers.

A THD pack concatenates ``B`` sequences along the token axis; ``cu_seqlens``
(``B + 1`` int32 offsets) delimits them. Compression by ``ratio`` turns segment
``b`` of ``seqlen_b`` tokens into ``seqlen_b // ratio`` output rows, delimited by
``cu_seqlens_comp``.
"""

from __future__ import annotations

import torch

from . import support

__all__ = ["compute_cu_seqlens_comp", "row_layout", "validate_pack"]


def compute_cu_seqlens_comp(cu_seqlens: torch.Tensor, ratio: int) -> torch.Tensor:
    """``cu_seqlens_comp`` for ``cu_seqlens`` at ``ratio``, computed on the device.

    No host synchronisation happens, so this is safe inside CUDA-graph capture.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        raise ValueError(f"ratio must be an int >= 1, got {ratio!r}")
    groups = torch.div(cu_seqlens[1:] - cu_seqlens[:-1], ratio, rounding_mode="floor")
    out = torch.zeros_like(cu_seqlens, dtype=torch.int32)
    torch.cumsum(groups, dim=0, out=out[1:])
    return out


def _wrap_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values as the kernels' int32 arithmetic leaves them (two's complement wrap)."""
    return ((x + 2**31) & (2**32 - 1)) - 2**31


def row_layout(
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    total_comp: int,
    ratio: int,
    total_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per output row: first token ``t0``, ``is_first`` (previous half masked), ``is_real`` (the row has a gradient).

    The rules every backend follows (docs/safety.md), whatever the offsets hold: a row
    ``r < cu_seqlens_comp[B]`` is real; its segment ``b`` is the last one starting at or before ``r``
    (a binary search, so some ``b`` in ``[0, B-1]`` even on non-monotonic offsets), ``j = r - cu_seqlens_comp[b]``
    and ``t0 = cu_seqlens[b] + j * ratio`` in int32 arithmetic. A real row whose own tokens
    ``[t0, t0 + ratio)`` leave ``[0, total_tokens)`` is computed as a padding row (``t0 = 0``, first group, no
    gradient); the previous half is read only when ``j > 0`` and ``t0 >= ratio``. Every index is therefore
    inside the tensors. ``total_tokens=None``: no upper bound (for well-formed offsets, where it never binds).
    Runs on the device with no host synchronisation.
    """
    device = cu_seqlens.device
    num_segments = min(cu_seqlens.numel(), cu_seqlens_comp.numel()) - 1
    if num_segments < 1:
        raise ValueError("cu_seqlens and cu_seqlens_comp need at least 2 entries each")
    rows = torch.arange(total_comp, device=device, dtype=torch.int64)
    comp = cu_seqlens_comp.to(torch.int64)
    seg = (torch.searchsorted(comp[:num_segments], rows, right=True) - 1).clamp_(0, num_segments - 1)
    j = _wrap_int32(rows - comp[seg])
    t0 = _wrap_int32(cu_seqlens.to(torch.int64)[seg] + j * ratio)
    in_range = t0 >= 0 if total_tokens is None else (t0 >= 0) & (t0 <= total_tokens - ratio)
    is_real = (rows < comp[num_segments]) & in_range
    t0 = torch.where(is_real, t0, torch.zeros_like(t0))
    is_first = ~is_real | (j <= 0) | (t0 < ratio)
    return t0, is_first, is_real


# The content bounds of a pack, in the order they are reported; a violation is found per segment b. The texts
# are formatted with the first offending segment b, its offsets (cs0, cs1, cc0, cc1), T, N and ratio.
_CONTENT_BOUNDS = (
    ("cu_seqlens[0] must be 0", "got {cs0} (segment 0)"),
    ("cu_seqlens must be non-decreasing", "segment {b} runs from {cs0} to {cs1}"),
    ("cu_seqlens[-1] must be <= T (kv.shape[0])", "segment {b} ends at {cs1} > T = {T}"),
    ("cu_seqlens_comp[0] must be 0", "got {cc0} (segment 0)"),
    (
        "cu_seqlens_comp must count seqlen // ratio rows per segment",
        "segment {b} has {seqlen} tokens, {expected} rows at ratio {ratio}, but cu_seqlens_comp gives {count}"
        " ({cc0} to {cc1})",
    ),
    (
        "total_comp must cover the real rows (cu_seqlens_comp[-1] <= total_comp)",
        "segment {b}'s rows end at {cc1} > total_comp = {N}",
    ),
)


def _violations(cs: torch.Tensor, cc: torch.Tensor, ratio: int, total_tokens: int, total_comp) -> torch.Tensor:
    """``(bounds, segments)`` bool, True where segment ``b`` breaks bound ``k`` of ``_CONTENT_BOUNDS``."""
    segments = cs.numel() - 1
    first = torch.arange(segments, device=cs.device) == 0
    seqlens = cs[1:] - cs[:-1]
    counts = cc[1:] - cc[:-1]
    rows_end = cc[1:] > total_comp if total_comp is not None else torch.zeros_like(first)
    return torch.stack(
        [
            first & (cs[0] != 0),
            seqlens < 0,
            cs[1:] > total_tokens,
            first & (cc[0] != 0),
            counts != torch.div(seqlens, ratio, rounding_mode="floor"),
            rows_end,
        ]
    )


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def validate_pack(
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int,
    total_tokens: int,
    total_comp: int | None = None,
) -> None:
    """Check the *contents* of a pack on its device, with one host synchronisation.

    Bounds, reported in this order with the first offending segment: ``cu_seqlens[0] == 0``,
    non-decreasing, ``cu_seqlens[-1] <= total_tokens``, ``cu_seqlens_comp[0] == 0``, each segment's row
    count ``seqlen // ratio``, and ``cu_seqlens_comp[-1] <= total_comp`` (when given). The offset arrays'
    own bounds (int32, 1-D, at least 2 entries, one shape) come first. Raises ``ValueError`` naming the
    bound; ``RuntimeError`` under CUDA-graph capture (validate before capturing). This is what
    ``validate=True`` and ``CSA_COMPRESSOR_VALIDATE=1`` run before a launch.
    """
    support.check_offsets(cu_seqlens, cu_seqlens_comp)
    ratio = support.check_config(ratio, 1)[0]
    total_tokens = support.check_total_tokens(total_tokens)
    if total_comp is not None:
        total_comp = support.check_total_comp(total_comp)
    if _capturing(cu_seqlens.device):
        raise RuntimeError(
            "csa_compressor: offset validation (validate=True, CSA_COMPRESSOR_VALIDATE=1) reads the offsets on "
            "the host, which CUDA-graph capture forbids; validate before capturing (validate_pack() or one "
            "call with validate=True outside the capture), then capture with validation off"
        )
    cs, cc = cu_seqlens.to(torch.int64), cu_seqlens_comp.to(torch.int64)
    bad = _violations(cs, cc, ratio, total_tokens, total_comp)
    segments = bad.shape[1]
    index = torch.arange(segments, device=cs.device)
    first_bad = torch.where(bad, index, segments).amin(dim=1)
    b = first_bad.clamp(max=segments - 1)
    facts = torch.stack([first_bad, cs[b], cs[b + 1], cc[b], cc[b + 1]], dim=1)
    for (bound, found), (segment, cs0, cs1, cc0, cc1) in zip(_CONTENT_BOUNDS, facts.tolist(), strict=True):
        if segment < segments:  # the one host synchronisation is the tolist() above
            seqlen, count = cs1 - cs0, cc1 - cc0
            values = dict(b=segment, cs0=cs0, cs1=cs1, cc0=cc0, cc1=cc1, T=total_tokens, N=total_comp, ratio=ratio)
            support._fail(bound, found.format(seqlen=seqlen, expected=seqlen // ratio, count=count, **values))
