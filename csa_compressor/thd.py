"""THD (packed, ragged) layout helpers.

A THD pack concatenates ``B`` sequences along the token axis; ``cu_seqlens``
(``B + 1`` int32 offsets) delimits them. Compression by ``ratio`` turns segment
``b`` of ``seqlen_b`` tokens into ``seqlen_b // ratio`` output rows, delimited by
``cu_seqlens_comp``.
"""

from __future__ import annotations

import torch

__all__ = ["compute_cu_seqlens_comp", "row_layout", "validate_pack"]


def compute_cu_seqlens_comp(cu_seqlens: torch.Tensor, ratio: int) -> torch.Tensor:
    """``cu_seqlens_comp`` for ``cu_seqlens`` at ``ratio``, computed on the device.

    No host synchronisation happens, so this is safe inside CUDA-graph capture.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if ratio < 1:
        raise ValueError(f"ratio must be >= 1, got {ratio}")
    groups = torch.div(cu_seqlens[1:] - cu_seqlens[:-1], ratio, rounding_mode="floor")
    out = torch.zeros_like(cu_seqlens, dtype=torch.int32)
    torch.cumsum(groups, dim=0, out=out[1:])
    return out


def row_layout(
    cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, total_comp: int, ratio: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per output row: first token ``t0``, ``is_first`` (no previous group), ``is_real``.

    Padding rows (``r >= cu_seqlens_comp[-1]``) get ``t0 = 0`` and behave as the
    first group of a segment, as the eager code does. Runs on the device with no
    host synchronisation.
    """
    device = cu_seqlens.device
    rows = torch.arange(total_comp, device=device, dtype=torch.int64)
    comp = cu_seqlens_comp.to(torch.int64)
    num_segments = comp.numel() - 1
    # right=True picks the last segment starting at or before r, which skips empty segments.
    seg = (torch.searchsorted(comp, rows, right=True) - 1).clamp_(0, max(num_segments - 1, 0))
    j = rows - comp[seg]
    t0 = cu_seqlens.to(torch.int64)[seg] + j * ratio
    is_real = rows < comp[-1]
    t0 = torch.where(is_real, t0, torch.zeros_like(t0))
    is_first = torch.where(is_real, j == 0, torch.ones_like(is_real))
    return t0, is_first, is_real


def validate_pack(
    cu_seqlens: torch.Tensor,
    cu_seqlens_comp: torch.Tensor,
    ratio: int,
    total_tokens: int,
    total_comp: int | None = None,
) -> None:
    """Check the *contents* of a pack (synchronises with the device).

    ``check_support`` only checks shapes and dtypes because reading device
    memory would stall the stream; call this once when debugging a data path.
    Raises ``ValueError`` naming the broken invariant.
    """
    cs = cu_seqlens.detach().to("cpu", torch.int64)
    cc = cu_seqlens_comp.detach().to("cpu", torch.int64)
    if cs.dim() != 1 or cs.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cs.shape)}")
    if cc.shape != cs.shape:
        raise ValueError(f"cu_seqlens_comp shape {tuple(cc.shape)} != cu_seqlens shape {tuple(cs.shape)}")
    if int(cs[0]) != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {int(cs[0])}")
    if int(cc[0]) != 0:
        raise ValueError(f"cu_seqlens_comp[0] must be 0, got {int(cc[0])}")
    seqlens = cs[1:] - cs[:-1]
    if bool((seqlens < 0).any()):
        b = int(torch.nonzero(seqlens < 0)[0])
        raise ValueError(f"cu_seqlens must be non-decreasing; segment {b} has length {int(seqlens[b])}")
    if int(cs[-1]) > total_tokens:
        raise ValueError(f"cu_seqlens[-1] = {int(cs[-1])} exceeds the token count T = {total_tokens}")
    groups = cc[1:] - cc[:-1]
    bad = groups != torch.div(seqlens, ratio, rounding_mode="floor")
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"cu_seqlens_comp is inconsistent with cu_seqlens at ratio {ratio}: segment {b} has "
            f"{int(seqlens[b])} tokens but {int(groups[b])} rows (expected {int(seqlens[b]) // ratio})"
        )
    if total_comp is not None and int(cc[-1]) > total_comp:
        raise ValueError(f"cu_seqlens_comp[-1] = {int(cc[-1])} exceeds total_comp = {total_comp}")
