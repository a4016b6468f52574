"""Tiles of the Triton kernels: one frozen config per kernel family, and the sizes derived from a problem.

``KernelConfig`` holds the tiles of the window kernels (short and long windows, both directions) and of the
zero sweep and dAPE reduction; ``StatsTile`` those of the statistics backward. Neither depends on the problem
size: the compile-time constants of a launch come from them alone, so what ``compile()`` builds serves every
later call. The functions at the end derive the runtime integers (rows per program, partials) from the
problem size and the device's SM count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from ...windows import uses_softmax_stats

__all__ = [
    "MAX_RATIO",
    "KernelConfig",
    "StatsTile",
    "cdiv",
    "choose_config",
    "is_long",
    "long_rows",
    "long_shape",
    "pow2",
    "rows_per_prog",
    "search_iters",
    "stats_rows",
    "stats_sweep_d",
    "stats_tile",
    "torch_order",
    "whole_rows",
]

MAX_RATIO = 256
# Resident small-window backward programs per SM (one warp at about 240 registers on sm_90 at ratio 4).
SMALL_BWD_RESIDENT = 8
# Statistics backward, rows per program from the problem size: about one wave of programs (132 SMs x 4 resident at
# about 125 registers), 2-32 rows each, and a bound on the bytes of dAPE partials.
STATS_PROGRAMS = 528
STATS_ROWS = (2, 32)
STATS_WORKSPACE_BYTES = 20 << 20
# The tail's window programs own whole rows; their warps grow with head_dim up to this many.
MAX_TAIL_WARPS = 16
# The statistics backward with a norm reduces each row over at most this many columns at a time.
TAIL_ROW_BLOCK = 512
# Statistics-backward programs with the tail's in-program row sums resident per SM (about 250 registers at 4 warps,
# twice today's): grids up to this many programs per SM run them, larger ones write dx first (csa_tail_dx_kernel)
# and keep the statistics kernel's own occupancy.
STATS_TAIL_RESIDENT = 2
# Rows per program of csa_tail_dx_kernel: about 4096 elements per program.
TAIL_DX_ELEMENTS = 4096
# Rows per program of csa_tail_fwd_kernel (the long-window forward's epilogue): about 2048 elements per program, so
# that the few rows of a ratio-128 pack still spread over the SMs.
TAIL_FWD_ELEMENTS = 2048


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def search_iters(num_segments: int) -> int:
    """Halvings of the device-side binary search over ``num_segments + 1`` offsets."""
    return max(0, num_segments - 1).bit_length()


def is_long(ratio: int, coff: int) -> bool:
    """Long windows (``coff * ratio > 16``, the statistics class of ``windows.py``) run the ``*_long_kernel``s."""
    return uses_softmax_stats(ratio, coff)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape of one configuration.

    ``block_r`` rows x ``block_d`` columns per tile (the window tile is
    ``[coff * next_pow2(ratio), block_r, block_d]``); ``rows_per_prog`` rows per
    program, 0 = from the problem size at launch (backward: it also sets the number of
    dAPE partials); ``sweep_t`` tokens x ``sweep_d`` columns per zero-sweep store;
    ``vec`` columns per thread and access; ``precise_exp``: libdevice expf (the
    reference's exp) instead of ex2.approx; ``torch_order``: sum the slots in
    PyTorch's CUDA reduction order where the slots sit in one thread; ``dape_block`` entries x
    ``dape_chunk`` partials per step of the dAPE reduction (compile-time, never from the problem size);
    ``slots_per_thread``: slots per thread and chunk of the long-window forward, ``prefetch_depth`` the chunks
    it keeps in flight (1 or 2; 2 only where a row has at least two chunks).
    """

    block_r: int
    block_d: int
    num_warps: int
    rows_per_prog: int = 0
    sweep_t: int = 64
    sweep_d: int = 128
    num_stages: int = 1
    vec: int = 8
    precise_exp: bool = True
    torch_order: bool = True
    dape_block: int = 64
    dape_chunk: int = 64
    slots_per_thread: int = 4
    prefetch_depth: int = 1


class StatsTile(NamedTuple):
    """Tile of the softmax-statistics backward (``csa_bwd_stats_kernel``): ``block_d`` columns x ``slots`` window
    slots per program (powers of two), ``num_warps``, ``rows`` rows per program (0: from the problem size)."""

    block_d: int
    slots: int
    num_warps: int
    rows: int = 0


def choose_config(direction: str, ratio: int, coff: int, head_dim: int, interpret: bool) -> KernelConfig:
    """Default tiles (GPU values from the H200 sweep in benchmarks/triton_sweep.py)."""
    k = coff * pow2(ratio)
    d2 = pow2(head_dim)
    if interpret and k > 16:
        # Long-window kernels: whole column range, 4 slots per thread and chunk; two rows per program keep the
        # row loop (and the next-row prefetch) and several dAPE partials exercised.
        return KernelConfig(1, d2, 1, rows_per_prog=2, sweep_t=64, sweep_d=d2, vec=1, slots_per_thread=4)
    if interpret:
        # The interpreter pays per numpy op, not per element: big tiles, few programs. Two row tiles per program
        # keep the multi-tile loop and the multi-partial dAPE reduction exercised.
        block_d = d2
        block_r = max(1, min(32, 8192 // (k * block_d)))
        return KernelConfig(block_r, block_d, 1, rows_per_prog=2 * block_r, sweep_t=64, sweep_d=d2)
    if k > 16:
        return _long_config(direction, ratio, coff, head_dim)
    # Every slot of a (row, column) in one thread: in-thread, in-order softmax reductions. About 32 window
    # elements per thread (k * vec) keep the backward below 256 registers: 8-byte column accesses at k = 8,
    # still whole 32-byte sectors per warp. One warp per program: multi-warp programs measured slower at ratio 4.
    vec = min(8, 32 // k)
    block_d = min(32 * vec, d2)
    block_r = max(1, (32 * vec) // block_d)
    # dAPE reduction: small windows make many partials (N / 2..32 rows of [ratio, coff*d]); 512 partials per
    # step keep its serial chain short, 8 fp32 entries (one 32-byte sector per partial) per program.
    return KernelConfig(
        block_r, block_d, 1, sweep_t=64, sweep_d=min(256, d2), vec=vec, dape_block=8, dape_chunk=512
    )  # fmt: skip


def _long_config(direction: str, ratio: int, coff: int, head_dim: int) -> KernelConfig:
    """GPU tiles for long windows (``coff * next_pow2(ratio) > 16``): 16-byte column vectors (vec = 8), 8-byte ones
    for the small-head_dim forward. The register counts these were picked for (sm_90, no spills): forward at most
    about 136, so that a program per warp fits; backward about 240 at 32 window elements per thread and input."""
    k = coff * pow2(ratio)
    d2 = pow2(head_dim)
    if direction == "forward":
        if head_dim <= 128:
            # Small problems are latency bound: 32-column blocks of 8-byte vectors, 4 warps x 16 lanes x 4 slots =
            # 64-slot chunks, half the window elements per thread of the 16-byte tile.
            block_d, num_warps, cs_in, depth, vec = min(32, d2), 4, 4, 1, 4
        elif coff == 2:
            # 64 columns x 1 warp, one chunk in flight: this grid is two waves, and the registers of a second chunk
            # would cost a resident warp.
            block_d, num_warps, cs_in, depth, vec = min(64, d2), 1, 2, 1, 8
        else:
            # 64-column blocks (twice the programs of 128: one wave of about 12 warps per SM at 3x8192 d512), two
            # chunks in flight.
            block_d, num_warps, cs_in, depth, vec = min(64, d2), 1, 2, 2, 8
        return KernelConfig(
            1, block_d, num_warps, rows_per_prog=1, vec=vec, slots_per_thread=cs_in, sweep_d=min(256, d2),
            prefetch_depth=depth,
        )  # fmt: skip
    # Backward: 32 elements per thread of each input (CS_IN = 4 slots x 8 columns), 4 warps (best of the sweep).
    num_warps = 4
    block_d = max(8, min(d2, 32 * num_warps * 8 * 4 // k))
    return KernelConfig(1, block_d, num_warps, rows_per_prog=0, vec=8, sweep_d=min(256, d2))


def whole_rows(cfg: KernelConfig, head_dim: int) -> KernelConfig:
    """``cfg`` widened so that a program owns whole rows (the short-window tail's row reductions need every column):
    ``block_d`` covers ``head_dim`` and the warps grow with it (up to ``MAX_TAIL_WARPS``), so that each thread keeps
    the elements of the tile it had and the window loads keep their width. A ``cfg`` narrower than ``head_dim``
    spans one row tile per warp already (``block_r == 1``)."""
    d2 = pow2(head_dim)
    if cfg.block_d >= d2:
        return cfg
    warps = max(1, min(MAX_TAIL_WARPS, cfg.num_warps * (d2 // cfg.block_d)))
    return dataclasses.replace(cfg, block_d=d2, num_warps=warps)


def stats_tile(ratio: int, coff: int, head_dim: int, interpret: bool) -> StatsTile:
    """Default tile of the statistics backward. Never depends on the problem size (only ``rows``, a runtime
    argument, does), so what compile() builds serves every later call.

    GPU: 64 columns x 32 slots (fewer for smaller problems), 4 warps (best of the H200 sweep): 16-byte
    accesses, 8 threads across the columns, 2 slots x 8 columns = 16 elements per thread of each tile (kv, score,
    ape, the dAPE accumulator; the next row's kv/score in flight); per row 3 x 64 fp32 statistics and 64 bf16
    grad_out shared by the 32 slots, about 125 registers without spills on sm_90: 4 programs per SM.
    Interpreter: whole column range and window, 2 rows per program (few, large programs).
    """
    if interpret:
        return StatsTile(pow2(head_dim), pow2(coff * ratio), 1, 2)
    return StatsTile(min(64, max(8, pow2(head_dim))), min(32, pow2(coff * ratio)), 4, 0)


def stats_sweep_d(tile: StatsTile, cfg: KernelConfig) -> int:
    """Zero-sweep columns of the statistics backward: at most 128 sweep elements per thread, so that the sweep tile
    never sets the register count of the whole kernel (its compute programs need fewer)."""
    return min(cfg.sweep_d, max(1, pow2(4096 * tile.num_warps // cfg.sweep_t + 1) // 2))


def torch_order(cfg: KernelConfig, ratio: int, coff: int) -> bool:
    """Sum slots in PyTorch's order: only where all slots of a column sit in one thread (small windows)."""
    k = coff * pow2(ratio)
    return cfg.torch_order and k % 4 == 0 and k * cfg.vec <= 32 and cfg.block_d <= 32 * cfg.vec * cfg.num_warps


def long_shape(direction: str, cfg: KernelConfig, ratio: int, coff: int) -> tuple[int, int]:
    """``(LANES, CS_IN)`` of the long-window tile ``[LANES, CS_IN, block_d]`` (powers of two).

    ``LANES``: the threads and warps left over once ``block_d / vec`` threads span the columns (at least 1,
    at most the slots of a half window / the whole window). Forward: ``CS_IN = slots_per_thread`` (a chunk never
    exceeds a half window); backward: the whole window, ``CS_IN = coff * next_pow2(ratio) / LANES``.
    """
    sp = pow2(ratio)
    vec = max(1, min(cfg.vec, cfg.block_d))
    lanes = max(1, (32 * cfg.num_warps * vec) // cfg.block_d)
    if direction == "forward":
        lanes = min(lanes, sp)
        return lanes, max(1, min(pow2(cfg.slots_per_thread), sp // lanes))
    lanes = min(lanes, coff * sp)
    return lanes, coff * sp // lanes


# --------------------------------------------------------------------------- sizes from the problem


def rows_per_prog(cfg: KernelConfig, direction: str, n_rows: int, n_col: int, k: int, sm_count: int) -> int:
    """Rows per short-window program: enough programs in flight, and (backward) few enough dAPE partials.

    A partial costs ``1 / (2 * rows_per_prog)`` of the backward's bytes (it is ``[ratio, coff*d]`` fp32 against
    ``rows * ratio * coff*d`` bf16 read and written twice).
    """
    if cfg.rows_per_prog > 0:
        return cfg.rows_per_prog
    # Counted in one-warp programs (the tail's whole-row programs have several warps).
    one_tile_programs = cdiv(n_rows, cfg.block_r) * n_col * cfg.num_warps
    if direction == "forward":
        target, lo, hi = 4096, 1, 4
    elif k <= 16:
        # Small-window backward programs are latency bound (every program first pays its segment search, then one
        # load trip per tile): one wave of programs, each with the fewest tiles that cover the problem, and
        # 2 tiles at least, so that the next tile's load is in flight behind the current one.
        tiles = max(2, min(32, cdiv(one_tile_programs, sm_count * SMALL_BWD_RESIDENT)))
        return tiles * cfg.block_r
    else:
        target, lo, hi = 512, 4, 16
    tiles = max(lo, min(hi, pow2(one_tile_programs // target + 1) // 2))
    return tiles * cfg.block_r


def long_rows(cfg: KernelConfig, direction: str, n_rows: int, n_col: int, sm_count: int, k: int = 256) -> int:
    """Rows per long-window program. Forward: ``cfg.rows_per_prog`` or 1 (column blocks and rows give enough
    programs). Backward (``k`` window slots): one wave of programs, at least 2 rows (each program writes a
    ``[ratio, block_d]`` slice of an fp32 dAPE partial), at most 64. Resident programs per SM from the sm_90
    registers: about 240 at 32 window elements per thread and input (``8 // num_warps`` programs), 128 at 16."""
    if cfg.rows_per_prog > 0:
        return cfg.rows_per_prog
    if direction == "forward":
        return 1
    per_thread = k * cfg.block_d // (32 * cfg.num_warps)
    per_sm = max(1, (16 if per_thread <= 16 else 8) // cfg.num_warps)
    # Whole row groups per column block: ceil(n_rows / rows) * n_col programs must fit one wave.
    parts = max(1, (sm_count * per_sm) // n_col)
    return max(2, min(64, cdiv(n_rows, parts)))


def stats_rows(tile: StatsTile, ratio: int, coff: int, head_dim: int, n_rows: int) -> int:
    """Rows per statistics-backward program: ``tile.rows``, else about ``STATS_PROGRAMS`` programs with 2-32 rows
    each (a program writes ``slots x block_d`` fp32 of partials, ``1 / (2 * rows)`` of the bytes it moves), and no
    more than ``STATS_WORKSPACE_BYTES`` of partials."""
    if tile.rows > 0:
        return tile.rows
    units = cdiv(head_dim, tile.block_d) * cdiv(coff * ratio, tile.slots)
    lo, hi = STATS_ROWS
    rows = max(lo, min(hi, cdiv(n_rows * units, STATS_PROGRAMS)))
    max_parts = max(1, STATS_WORKSPACE_BYTES // (ratio * coff * head_dim * 4))
    return max(rows, cdiv(n_rows, max_parts))
