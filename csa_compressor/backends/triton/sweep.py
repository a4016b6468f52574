"""The zero sweep every Triton backward kernel ends its grid with: exact zeros where no produced row consumes a
token's column, so that every element of grad_kv / grad_score is written exactly once (the window programs store
where their slots read; the sweep never touches those positions).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import _real_rows, _segment_of


@triton.jit
def _zero_sweep(
    sweep_pid,
    grad_kv_ptr,
    grad_score_ptr,
    cu_ptr,
    cu_comp_ptr,
    N,
    T,
    B,
    n_iter,
    RATIO: tl.constexpr,
    COFF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SWEEP_T: tl.constexpr,
    SWEEP_D: tl.constexpr,
):
    """Exact zeros at the ``SWEEP_T`` tokens of sweep program ``sweep_pid`` that no produced row consumes.

    A segment's produced groups are its groups whose row is below ``min(cu_seqlens_comp[B], N)``: with total_comp
    under the real row count, the tokens the dropped rows would have read are unconsumed, and a segment whose first
    row is at or past total_comp has none. Every store is a token of ``[0, T)``, whatever the offsets hold.
    """
    W: tl.constexpr = COFF * HEAD_DIM
    gdt = grad_kv_ptr.dtype.element_ty
    toks = sweep_pid * SWEEP_T + tl.arange(0, SWEEP_T)
    tok_ok = toks < T
    seg = _segment_of(toks, cu_ptr, B, n_iter)
    seg_start = tl.load(cu_ptr + seg)
    n_groups = (tl.load(cu_ptr + seg + 1) - seg_start) // RATIO
    n_groups = tl.minimum(n_groups, _real_rows(cu_comp_ptr, B, N) - tl.load(cu_comp_ptr + seg))
    local = toks - seg_start
    consumed = (toks < tl.load(cu_ptr + B)) & (local < n_groups * RATIO)
    # Per token: zero its first d columns / its last (coff-1)*d columns. Row flags broadcast over columns
    # keep the stores vectorised.
    zero_hi = tok_ok & ~consumed
    if COFF == 2:
        # The first d columns of a segment's last produced group would be read by a next group that is not produced.
        zero_lo = zero_hi | (tok_ok & consumed & (local // RATIO == n_groups - 1))
    else:
        zero_lo = zero_hi
    if tl.max(zero_lo.to(tl.int32), axis=0) > 0:
        zeros = tl.zeros([SWEEP_T, SWEEP_D], dtype=gdt)
        for c0 in range(0, HEAD_DIM, SWEEP_D):
            cols = c0 + tl.arange(0, SWEEP_D)
            zmask = zero_lo[:, None] & (cols < HEAD_DIM)[None, :]
            zoffs = toks[:, None] * W + cols[None, :]
            tl.store(grad_kv_ptr + zoffs, zeros, mask=zmask)
            tl.store(grad_score_ptr + zoffs, zeros, mask=zmask)
        if COFF == 2:
            if tl.max(zero_hi.to(tl.int32), axis=0) > 0:
                for c0 in range(0, HEAD_DIM, SWEEP_D):
                    cols = c0 + tl.arange(0, SWEEP_D)
                    zmask = zero_hi[:, None] & (cols < HEAD_DIM)[None, :]
                    zoffs = toks[:, None] * W + HEAD_DIM + cols[None, :]
                    tl.store(grad_kv_ptr + zoffs, zeros, mask=zmask)
                    tl.store(grad_score_ptr + zoffs, zeros, mask=zmask)
