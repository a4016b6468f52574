"""The DeepSeek-V4 compressor as one ``nn.Module``: projections, gated pooling, RMSNorm and RoPE.

The pooling and its tail (RMSNorm over ``head_dim``, then the rotary embedding of the last ``rope_dim``
columns at each row's position) run in the same kernels: one ``compressor_pool`` call with the fused tail's
arguments (docs/tail.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .autograd import compressor_pool
from .thd import compute_cu_seqlens_comp

__all__ = ["Compressor", "rope_tables"]


def rope_tables(
    rope_dim: int, max_position: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(max_position, rope_dim // 2)`` float32: angle ``p * theta**(-2i / rope_dim)``.

    Frequency scaling (YaRN and the like) is the caller's: build the tables with it and pass them to
    ``Compressor.forward``.
    """
    if rope_dim % 2 != 0 or rope_dim < 0:
        raise ValueError(f"csa_compressor: rope_dim must be even and >= 0, got {rope_dim}")
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def _two_d(x: torch.Tensor) -> torch.Tensor:
    """A ``(T, 1, hidden)`` input as ``(T, hidden)``."""
    if x.shape[1] != 1:
        raise ValueError(f"csa_compressor: 3-D x must be (T, 1, hidden), got {tuple(x.shape)}")
    return x.reshape(x.shape[0], x.shape[2])


class Compressor(nn.Module):
    """The compressor of DeepSeek-V4-style attention (CSA and HCA) over a THD pack.

    ``x`` ``(T, hidden_size)`` (or ``(T, 1, hidden_size)``) -> ``kv = wkv(x)``, ``score = wgate(x)``, the
    fused gated pooling with ``ape`` over groups of ``ratio`` tokens (``coff = 2``: overlapping windows),
    RMSNorm over ``head_dim`` with ``norm.weight``, and the rotary embedding of the last ``rope_dim``
    columns at each row's position -> ``(total_comp, head_dim)`` (``(total_comp, 1, head_dim)`` for 3-D ``x``).
    Pooling, norm and rotation are one fused op, fp32 inside with one rounding at the end.

    DeepSeek-V4's configurations: ``ratio=4`` (coff 2, the CSA compressors), ``ratio=128`` (coff 1, HCA),
    ``ratio=2, coff=1, learned_ape=False`` (a zero ``ape`` buffer instead of a parameter).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int = 4,
        *,
        coff: int | None = None,
        rope_dim: int = 64,
        norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position: int = 65536,
        rope_interleaved: bool = True,
        learned_ape: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        coff = (2 if ratio == 4 else 1) if coff is None else coff
        if not 0 <= rope_dim <= head_dim:
            raise ValueError(f"csa_compressor: rope_dim must be in [0, head_dim={head_dim}], got {rope_dim}")
        self.hidden_size, self.head_dim, self.ratio, self.coff = hidden_size, head_dim, ratio, coff
        self.rope_dim, self.rope_interleaved, self.backend = rope_dim, rope_interleaved, backend
        width = coff * head_dim
        self.wkv = nn.Linear(hidden_size, width, bias=False, device=device, dtype=dtype)
        self.wgate = nn.Linear(hidden_size, width, bias=False, device=device, dtype=dtype)
        ape = torch.zeros(ratio, width, dtype=torch.float32, device=device)
        if learned_ape:
            self.ape = nn.Parameter(ape)
        else:
            self.register_buffer("ape", ape)
        self.norm = nn.RMSNorm(head_dim, eps=norm_eps, device=device, dtype=torch.float32)
        cos, sin = rope_tables(rope_dim, max_position if rope_dim else 0, rope_theta, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Projections as ``nn.Linear`` initialises them; ``ape`` normal with std ``1/sqrt(head_dim)`` (zero when
        not learned); the norm weight ones."""
        self.wkv.reset_parameters()
        self.wgate.reset_parameters()
        if isinstance(self.ape, nn.Parameter):
            nn.init.normal_(self.ape, std=1.0 / math.sqrt(self.head_dim))
        self.norm.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, ratio={self.ratio}, coff={self.coff}, "
            f"rope_dim={self.rope_dim}, backend={self.backend!r}"
        )

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cu_seqlens_comp: torch.Tensor | None = None,
        total_comp: int | None = None,
        position_start: torch.Tensor | None = None,
        rope_cos: torch.Tensor | None = None,
        rope_sin: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compress a THD pack.

        ``cu_seqlens`` ``(B+1,)`` int32; ``cu_seqlens_comp`` (computed on the device when None);
        ``total_comp``: output rows (an int capacity for CUDA graphs and ``torch.compile``; None reads
        ``cu_seqlens_comp[-1]``, one host synchronisation); ``position_start`` ``(B,)`` integers: position of
        each segment's first token (default 0); ``rope_cos`` / ``rope_sin``: tables ``(max_position,
        rope_dim // 2)`` float32 in place of the module's own (``rope_tables``). A real row whose position lies
        outside the tables is not rotated (the validation mode rejects it instead).
        """
        three_d = x.dim() == 3
        if three_d:
            x = _two_d(x)
        if cu_seqlens_comp is None:
            cu_seqlens_comp = compute_cu_seqlens_comp(cu_seqlens, self.ratio)
        if total_comp is None:
            total_comp = int(cu_seqlens_comp[-1].item())
        kv, score = self.wkv(x), self.wgate(x)
        out = self._pool_and_tail(
            kv, score, cu_seqlens, cu_seqlens_comp, total_comp, position_start, rope_cos, rope_sin
        )
        return out.unsqueeze(1) if three_d else out

    def forward_cp(
        self,
        x_local: torch.Tensor,
        layout,
        group=None,
        position_start: torch.Tensor | None = None,
        rope_cos: torch.Tensor | None = None,
        rope_sin: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compress a THD pack split over a context-parallel group (docs/distributed.md).

        ``x_local`` ``(layout.local_tokens, hidden_size)`` (or with a middle dimension of 1, as ``forward``'s ``x``,
        and ``out_local`` then too): this rank's tokens in the layout's local order; the
        projections run on them, then ``compressor_pool_cp`` with the fused tail (``position_start``: one offset
        per segment of the global pack). Returns ``(out_local, rows)``: the global rows whose last token this rank
        holds, and their global indices; ``gather_rows`` gives every rank all of them. Every parameter's
        gradient is this rank's partial sum, as for any parameter under CP: trainers reduce them over the CP group.
        """
        from .distributed import compressor_pool_cp

        three_d = x_local.dim() == 3
        if three_d:
            x_local = _two_d(x_local)
        kv, score = self.wkv(x_local), self.wgate(x_local)
        tail = self._tail_arguments(position_start, rope_cos, rope_sin)
        out, rows = compressor_pool_cp(kv, score, self.ape, layout, self.ratio, self.coff, group, self.backend, **tail)
        return (out.unsqueeze(1) if three_d else out), rows

    def _tail_arguments(self, position_start, cos, sin) -> dict:
        """The fused tail's keyword arguments: the module's norm, and its rotary tables unless given."""
        rope = self.rope_dim > 0
        if rope and position_start is not None and position_start.dtype != torch.int32:
            position_start = position_start.to(torch.int32)  # the op's dtype; a device-side cast, no sync
        return {
            "norm_weight": self.norm.weight,
            "norm_eps": self.norm.eps if self.norm.eps is not None else 1e-6,
            "rope_cos": (self.rope_cos if cos is None else cos) if rope else None,
            "rope_sin": (self.rope_sin if sin is None else sin) if rope else None,
            "rope_dim": self.rope_dim,
            "rope_interleaved": self.rope_interleaved,
            "position_start": position_start if rope else None,
        }

    def _pool_and_tail(self, kv, score, cu_seqlens, cu_seqlens_comp, total_comp, position_start, cos, sin):
        tail = self._tail_arguments(position_start, cos, sin)
        return compressor_pool(kv, score, self.ape, cu_seqlens, cu_seqlens_comp, ratio=self.ratio, coff=self.coff,
                               total_comp=total_comp, backend=self.backend, **tail)  # fmt: skip
