"""Exact-zero stores of the backward kernels: every gradient position that no window slot consumes gets an exact 0,
so that callers may pass uninitialised buffers (SPEC section 2). Each position has exactly one owner.

- ``segment_tail``: a segment's last produced row zeroes the group of tokens after its own (all columns; the
  segment's tail) and, for coff 2, the first-half columns of its own tokens (no next row reads them); the calling
  thread owns window slots ``slot0 .. slot0 + count - 1``.
- ``unowned``: CTA ``bx`` zeroes the tokens of the segments ``b = bx mod grid`` that have no produced row (none at
  all, or a first row at or past total_comp), and grid-stride shares of the tokens past ``cu_seqlens[-1]`` and,
  with total_comp below the real row count, of the tokens of the segment cut by total_comp from the second group
  after its last produced row on (the groups its dropped rows would have read; the first is that row's tail),
  spread over ``lanes`` threads. Outside the row loops, so the rare case costs those loops nothing.

Every zeroed range is clamped to ``[0, T)`` whatever the offsets hold (a row's ``t0`` is guarded by
``window.locate_row``, so a tail starts inside it).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .window import find_segment, store_vector


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
        """``t0``: the row's first token (at most T - ratio); ``seg_end``: the segment's end clamped to T."""
        ratio = self.ratio
        for k in cutlass.range_constexpr(count):
            qz = slot0 + k
            if qz < ratio:
                tail_tok = t0 + ratio + qz
                if tail_tok < seg_end:
                    self.token(gkv, gsc, zero, tail_tok, c)
                if cutlass.const_expr(self.coff == 2):
                    own_tok = t0 + qz
                    store_vector(gkv, own_tok * (self.coff * self.head_dim) + c, self.width, zero.load())
                    store_vector(gsc, own_tok * (self.coff * self.head_dim) + c, self.width, zero.load())

    @cute.jit
    def unowned(self, gkv, gsc, zero, seg, T, N, bx, gdx, lane, lanes: cutlass.Constexpr, c):
        """``seg``: the pack's ``Segments``; ``T`` tokens; ``N`` total_comp; CTA ``bx`` of ``gdx``, thread ``lane``
        of ``lanes``."""
        cu_t, cuc_t, B = seg.cu, seg.cuc, seg.count
        for b in cutlass.range(bx, B, gdx):
            if (cuc_t[b + 1] <= cuc_t[b]) | (cuc_t[b] >= N):
                # Clamped to [0, T] before the lane is added: no int32 wrap-around.
                lo = cutlass.min(cutlass.max(cu_t[b], 0), T)
                for t in cutlass.range(lo + lane, cutlass.min(cu_t[b + 1], T), lanes):
                    self.token(gkv, gsc, zero, t, c)
        # Token-capacity padding rows past cu_seqlens[-1], grid-stride.
        self.grid_stride(gkv, gsc, zero, cu_t[B], T, bx, gdx, lane, lanes, c)
        if N < cuc_t[B]:
            # total_comp cuts segment b: its rows past N - 1 are dropped.
            b = find_segment(cuc_t, B, N - 1)
            if N < cuc_t[b + 1]:
                after = cu_t[b] + (N - cuc_t[b] + 1) * self.ratio
                self.grid_stride(gkv, gsc, zero, after, cutlass.min(cu_t[b + 1], T), bx, gdx, lane, lanes, c)

    @cute.jit
    def grid_stride(self, gkv, gsc, zero, start, end, bx, gdx, lane, lanes: cutlass.Constexpr, c):
        """Tokens ``[start, end)`` (``end`` at most T; ``start`` clamped to ``[0, end]`` first: no int32
        wrap-around) over every CTA's ``lanes`` threads."""
        lo = cutlass.min(cutlass.max(start, 0), end)
        for t in cutlass.range(lo + bx * lanes + lane, end, gdx * lanes):
            self.token(gkv, gsc, zero, t, c)
