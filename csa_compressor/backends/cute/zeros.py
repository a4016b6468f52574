"""Exact-zero stores of the backward kernels: every gradient position that no window slot consumes gets an exact 0,
so that callers may pass uninitialised buffers (SPEC section 2). Each position has exactly one owner.

- ``segment_tail``: a segment's last produced row zeroes its segment's tokens after its own group (all columns)
  and, for coff 2, the first-half columns of its own tokens (no next row reads them); the calling thread owns
  window slots ``slot0 .. slot0 + count - 1``. With total_comp below the real row count the last produced row is
  not the segment's last group, and the tokens after it are those the dropped rows would have read.
- ``unowned``: CTA ``bx`` zeroes the tokens of the segments ``b = bx mod grid`` that have no produced row (none at
  all, or a first row at or past total_comp), and a grid-stride share of the tokens past ``cu_seqlens[-1]``,
  spread over ``lanes`` threads.

Every zeroed range is clamped to ``[0, T)``, whatever the offsets hold (the rows' ``t0`` are guarded by
``window.locate_row``, so a tail starts inside it).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .window import store_vector


class ZeroStores:
    """Exact zeros of ``width`` columns from column ``c`` of grad_kv and grad_score."""

    def __init__(self, ratio: int, coff: int, head_dim: int, width: int):
        self.ratio, self.coff, self.head_dim, self.width = ratio, coff, head_dim, width

    @cute.jit
    def token(self, gkv, gsc, zero, t, c):
        """Both halves of token ``t`` (all coff * head_dim columns of the thread's column vector)."""
        for h in cutlass.range_constexpr(self.coff):
            store_vector(gkv, t * (self.coff * self.head_dim) + h * self.head_dim + c, self.width, zero.load())
            store_vector(gsc, t * (self.coff * self.head_dim) + h * self.head_dim + c, self.width, zero.load())

    @cute.jit
    def segment_tail(self, gkv, gsc, zero, t0, seg_end, slot0, count: cutlass.Constexpr, c):
        """``seg_end``: the segment's end, at most T; ``t0``: the row's first token, at most T - ratio."""
        ratio = self.ratio
        for k in cutlass.range_constexpr(count):
            qz = slot0 + k
            if qz < ratio:
                # One token per step unless rows were dropped (then the tokens of every dropped group).
                for tail_tok in cutlass.range(t0 + ratio + qz, seg_end, ratio):
                    self.token(gkv, gsc, zero, tail_tok, c)
                if cutlass.const_expr(self.coff == 2):
                    own_tok = t0 + qz
                    store_vector(gkv, own_tok * (self.coff * self.head_dim) + c, self.width, zero.load())
                    store_vector(gsc, own_tok * (self.coff * self.head_dim) + c, self.width, zero.load())

    @cute.jit
    def unowned(self, gkv, gsc, zero, seg, T, nreal, bx, gdx, lane, lanes: cutlass.Constexpr, c):
        """``seg``: the pack's ``Segments``; ``T`` tokens; ``nreal`` the produced real rows (``window.real_rows``);
        CTA ``bx`` of ``gdx``, thread ``lane`` of ``lanes``."""
        cu_t, cuc_t, B = seg.cu, seg.cuc, seg.count
        for b in cutlass.range(bx, B, gdx):
            if (cuc_t[b + 1] <= cuc_t[b]) | (cuc_t[b] >= nreal):
                # Clamped to [0, T) before the lane is added: no int32 wrap-around.
                lo = cutlass.min(cutlass.max(cu_t[b], 0), T)
                for t in cutlass.range(lo + lane, cutlass.min(cu_t[b + 1], T), lanes):
                    self.token(gkv, gsc, zero, t, c)
        # Token-capacity padding rows past cu_seqlens[-1]: grid-stride.
        lo = cutlass.min(cutlass.max(cu_t[B], 0), T)
        for t in cutlass.range(lo + bx * lanes + lane, T, gdx * lanes):
            self.token(gkv, gsc, zero, t, c)
