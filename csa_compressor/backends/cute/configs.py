"""Compile-time configurations of the cute kernels: one frozen dataclass per kernel class, with factories per
architecture. A configuration and the architecture identify one compiled kernel (the compile caches' key).

Common terms: a thread owns ``vector_width`` contiguous columns of a row; ``column_threads`` threads cover a CTA's
column chunk (``columns_per_cta`` columns, ``column_chunks`` chunks per row); a row's ``window = coff * ratio``
slots are split into ``slot_groups`` groups, each visited in batches (``slots_per_batch``) or whole
(``slots_per_group``); several rows are worked on side by side (``rows_per_cta`` in the forwards, ``row_lanes``
in the persistent backwards).

Blackwell (``for_sm100``) takes the Hopper tiles: nothing has been measured there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...windows import is_short_window
from .device import REGISTERS_PER_SM, DeviceSpec

# Per-thread register budget of the kernels with launch bounds: the residency the backward grids assume.
MAX_REGISTERS = 128
# Register-capped build of the 8-slot short-window forward: CTAs per SM it is capped for.
WIDE_CTAS_PER_SM = 6
# Threads per CTA of the short-window backward: the 128-thread tile's row lanes x 4 (one CTA per SM by registers,
# a quarter of the grad_ape slabs).
SHORT_BACKWARD_THREADS = 512
# Statistics backward: at least this many window slots per CTA, and at most this many slot chunks, so that a row's
# statistics and grad_out are not read by too many CTAs.
STATS_MIN_SLOTS = 8
STATS_CHUNKS = 16
# Statistics backward, whole-tile form: one CTA of this many threads per tile where the tiles fill at least this
# share of the SMs (below it the slab form's row ranges keep the GPU busy).
WHOLE_TILE_THREADS = 512
WHOLE_TILE_FILL = 0.72
# Statistics backward with the fused tail: rows whose norm terms a CTA computes per pass (one warp per row).
STATS_TAIL_TERM_ROWS = 64
# grad_ape reduction: warps per CTA and slabs per walker step (their loads are all in flight before the adds).
REDUCE_WARPS = 8
REDUCE_UNROLL = 8


def vector_width(head_dim: int, cap: int = 8) -> int:
    """Widest element vector (<= cap) that divides head_dim: every row offset stays aligned."""
    for v in (8, 4, 2, 1):
        if v <= cap and head_dim % v == 0:
            return v
    return 1


def slots_per_group(window: int, cap: int = 8) -> int:
    """Largest power of two <= cap dividing the window (so that groups tile it exactly)."""
    sg = 1
    while sg * 2 <= cap and window % (sg * 2) == 0:
        sg *= 2
    return sg


def launch_bound(threads: int) -> int:
    """Resident CTAs per SM that MAX_REGISTERS per thread allow (the kernels' launch bound)."""
    return max(1, REGISTERS_PER_SM // (threads * MAX_REGISTERS))


@dataclass(frozen=True)
class _Tile:
    """Fields every kernel configuration has: the problem and the column tiling."""

    ratio: int
    coff: int
    head_dim: int
    vector_width: int
    column_threads: int

    @property
    def window(self) -> int:
        return self.coff * self.ratio

    @property
    def columns_per_cta(self) -> int:
        return self.column_threads * self.vector_width

    @property
    def column_chunks(self) -> int:
        return -(-self.head_dim // self.columns_per_cta)

    @property
    def columns_exact(self) -> bool:
        """Whether the chunks tile head_dim exactly (no column test)."""
        return self.head_dim % self.columns_per_cta == 0

    @property
    def ape_size(self) -> int:
        return self.ratio * self.coff * self.head_dim


def tile_shape(ratio, coff, head_dim, vcap, threads, cols_cap, sg_cap=8):
    """(vector_width, column_threads, slot_groups, slots_per_group, rows) of ``threads``-thread CTAs with at most
    ``cols_cap`` columns each; odd head_dims of one group take one chunk instead of a ragged second one."""
    width = vector_width(head_dim, vcap)
    window = coff * ratio
    sg = slots_per_group(window, sg_cap)
    groups = window // sg
    col_threads = -(-head_dim // width)
    tc = 1
    while tc * 2 <= col_threads and tc * 2 * groups <= threads and tc * 2 * width <= cols_cap:
        tc *= 2
    if groups == 1 and col_threads <= threads and col_threads * width <= cols_cap and col_threads < 2 * tc:
        tc = col_threads
    rows = 1
    while tc * groups * rows * 2 <= threads:
        rows *= 2
    return width, tc, groups, sg, rows


@dataclass(frozen=True)
class ForwardShortConfig(_Tile):
    """The short-window forward (``forward_short.py``): a thread holds a row's whole window (one group)."""

    rows_per_cta: int
    ctas_per_sm_cap: int = 0  # register-capped build: launch bound of this many CTAs per SM (0: none)
    tail: TailSpec | None = None  # the fused tail (whole rows: one column chunk, ``fused_forward_for_sm90``)

    @property
    def threads(self) -> int:
        return self.column_threads * self.rows_per_cta

    def wide(self) -> ForwardShortConfig | None:
        """The register-capped build for launches of more than one wave, where it holds more CTAs per SM: 8-slot
        windows at 128 threads with more than one row per CTA, without a fused tail (whose registers the cap
        would spill)."""
        if self.window != 8 or self.ctas_per_sm_cap or self.threads != 128 or self.rows_per_cta < 2 or self.tail:
            return None
        return replace(self, ctas_per_sm_cap=WIDE_CTAS_PER_SM)


@dataclass(frozen=True)
class ForwardLongConfig(_Tile):
    """The grouped forward (``forward_long.py``): slot groups fold their batches online and combine through shared
    memory; long windows, and short ones whose slots do not form one power-of-two group."""

    slot_groups: int
    slots_per_batch: int
    batches: int  # per group: slot_groups * slots_per_batch * batches == window
    rows_per_cta: int
    chunk_major: bool  # the column chunks of one row block are adjacent CTAs (a token row is read at once)
    write_stats: bool = False  # also write the softmax statistics for the backward
    # Let the next kernel of the stream start its prologue while this one runs (programmatic dependent launch):
    # the composed tail's forward, which reads the rows only after griddepcontrol.wait.
    signals_dependents: bool = False
    # The fused tail (whole rows in one column chunk: ``tail_configs.long_forward_with_tail``); statistics are then
    # written where the launch passes them.
    tail: TailSpec | None = None
    # The launch bound's CTAs per SM (0: as many as MAX_REGISTERS per thread allow).
    ctas_per_sm: int = 0

    @property
    def threads(self) -> int:
        return self.column_threads * self.slot_groups * self.rows_per_cta

    @property
    def launch_ctas_per_sm(self) -> int:
        return self.ctas_per_sm or launch_bound(self.threads)

    @property
    def smem_bytes(self) -> int:
        """The cross-group combine buffers: (max, sum e, sum e*v) per group, row lane and column."""
        return 3 * self.rows_per_cta * self.slot_groups * self.columns_per_cta * 4 + 64

    @property
    def tail_rows(self) -> int:
        """With the tail, a CTA's threads as rows of ``columns_per_cta`` threads, one column each (the rows past
        ``rows_per_cta`` hold no row: ``long_tail.WholeRowTail``)."""
        return self.threads // self.columns_per_cta


def forward_for_sm90(ratio: int, coff: int, head_dim: int, device: DeviceSpec, stats: bool = False):
    """The forward's configuration: short windows of one power-of-two group the exact kernel (128 threads);
    windows up to 128 slots 64-column chunks with one batch of 8 slots per group (more CTAs for the few rows of
    large ratios); longer windows stream batches of 4 slots through 256-column chunks."""
    window = coff * ratio
    if is_short_window(ratio, coff):
        width, tc, groups, sg, rows = tile_shape(ratio, coff, head_dim, vcap=4, threads=128, cols_cap=512)
        if groups == 1:
            return ForwardShortConfig(ratio, coff, head_dim, width, tc, rows_per_cta=rows)
        return ForwardLongConfig(ratio, coff, head_dim, width, tc, groups, sg, 1, rows, False, stats)
    if window <= 128:
        width, tc, groups, sg, rows = tile_shape(ratio, coff, head_dim, vcap=4, threads=256, cols_cap=64)
        return ForwardLongConfig(ratio, coff, head_dim, width, tc, groups, sg, 1, rows, True, stats)
    return _streaming_forward(ratio, coff, head_dim, stats)


def _streaming_forward(ratio, coff, head_dim, stats, threads=256, cols_cap=256) -> ForwardLongConfig:
    """16-byte column vectors, wide column chunks, at most 8 slot groups each streaming batches of 4 slots."""
    window = coff * ratio
    width = vector_width(head_dim, 8)
    sg = slots_per_group(window, 4)
    batches = window // sg
    groups = max(g for g in range(1, 9) if batches % g == 0)
    col_threads = -(-head_dim // width)
    tc = 1
    while tc * 2 <= col_threads and tc * 2 * groups <= threads and tc * 2 * width <= cols_cap:
        tc *= 2
    rows = 1
    while tc * groups * rows * 2 <= threads:
        rows *= 2
    return ForwardLongConfig(ratio, coff, head_dim, width, tc, groups, sg, batches // groups, rows, True, stats)


def forward_for_sm100(ratio: int, coff: int, head_dim: int, device: DeviceSpec, stats: bool = False):
    return forward_for_sm90(ratio, coff, head_dim, device, stats)


@dataclass(frozen=True)
class ApeReduceConfig:
    """The grad_ape reduction (``reduce.py``): a fixed-order sum of the backward's per-CTA slabs."""

    ape_size: int
    slab_lanes: int  # lanes of a warp that walk different slabs
    norm_entries: int = 0  # slab entries after grad_ape's: the fused tail's grad_norm_weight partials

    @property
    def slab_size(self) -> int:
        """Floats per slab: grad_ape's entries, then the norm weight's."""
        return self.ape_size + self.norm_entries

    @classmethod
    def norm_weight(cls, head_dim: int) -> ApeReduceConfig:
        """The composed tail's sum of TailGradient's norm-weight slabs, whichever kernel runs it (its own reduction
        or the whole-tile statistics backward's CTAs past the tiles): one order, so the same bits."""
        return cls(head_dim, slab_lanes=1)

    @property
    def vector(self) -> int:
        """Entries per thread: 16-byte vectors where the slab size allows (never across the two parts)."""
        return 4 if self.ape_size % 4 == 0 and self.norm_entries % 4 == 0 else 1

    @property
    def entry_vectors(self) -> int:
        """Entry vectors per CTA."""
        return 32 // self.slab_lanes

    @property
    def grid(self) -> int:
        return (self.slab_size // self.vector + self.entry_vectors - 1) // self.entry_vectors

    @property
    def threads(self) -> int:
        return REDUCE_WARPS * 32

    @property
    def smem_bytes(self) -> int:
        return REDUCE_WARPS * 32 * 4 * self.vector + 64


@dataclass(frozen=True)
class BackwardShortConfig(_Tile):
    """The short-window backward (``backward_short.py``): persistent CTAs keep a row's window in registers
    between its passes, with the next row's loads in flight (double buffer) and the ape entries held."""

    slot_groups: int
    slots_per_group: int
    row_lanes: int
    tail: TailSpec | None = None  # the fused tail (one group, whole rows: ``fused_backward_for_sm90``)

    @property
    def threads(self) -> int:
        return self.column_threads * self.slot_groups * self.row_lanes

    @property
    def smem_bytes(self) -> int:
        """The row-lane reduction of grad_ape, and the cross-group buffers where there are groups (with a tail:
        its row sums' partials)."""
        cw = self.columns_per_cta
        cross = 2 * self.row_lanes * self.slot_groups * cw + 3 * self.row_lanes * cw if self.slot_groups > 1 else 0
        if self.tail is not None:
            cross += tail_sum_floats(self.column_threads, self.row_lanes, 2, buffers=2)
        return (self.threads * self.vector_width + cross) * 4 + 128

    @property
    def slab_entries(self) -> int:
        """Floats per CTA slab: grad_ape's entries, then (a fused norm) the norm weight's gradient."""
        return self.ape_size + (self.head_dim if self.tail is not None and self.tail.has_norm else 0)

    carveout = 50  # percent of the unified L1 / shared memory asked for as shared memory
    whole_tile = False

    @property
    def tiles(self) -> int:
        """CTAs along grid y: the column chunks."""
        return self.column_chunks

    @property
    def reduce(self) -> ApeReduceConfig:
        # Many small slabs from the persistent grid: four slab walkers per warp keep more slab loads in flight.
        return ApeReduceConfig(self.ape_size, slab_lanes=4, norm_entries=self.slab_entries - self.ape_size)


@dataclass(frozen=True)
class BackwardLongConfig(_Tile):
    """The long-window backward (``backward_long.py``): two passes over each row's window, streamed in batches,
    grad_ape accumulated per (slot, column) in shared memory."""

    slot_groups: int
    slots_per_batch: int
    batches: int
    prefetch_next_row: bool  # the next row's window goes to L2 during this row's second pass

    @property
    def threads(self) -> int:
        return self.column_threads * self.slot_groups

    @property
    def smem_bytes(self) -> int:
        """grad_ape accumulator (window x columns) + group partials + per-column row results, fp32."""
        cw = self.columns_per_cta
        return (self.window * cw + 3 * self.slot_groups * cw + 3 * cw) * 4 + 128

    carveout = 100
    row_lanes = 1
    whole_tile = False

    @property
    def tiles(self) -> int:
        """CTAs along grid y: the column chunks."""
        return self.column_chunks

    @property
    def slab_entries(self) -> int:
        """fp32 entries of one CTA's slab (the grad_ape partials)."""
        return self.ape_size

    @property
    def reduce(self) -> ApeReduceConfig:
        # Few large slabs: one slab walker per warp lane leaves no lane idle.
        return ApeReduceConfig(self.ape_size, slab_lanes=1)


@dataclass(frozen=True)
class BackwardStatsConfig(_Tile):
    """The backward given the forward's softmax statistics (``backward_stats.py``): every element's gradient is
    independent, so a CTA owns a chunk of window slots and columns of a range of rows, no barrier per row."""

    slot_groups: int  # per CTA
    slots_per_group: int
    row_lanes: int
    whole_tile: bool  # one CTA per tile over all rows writes grad_ape itself (no slabs, no reduction kernel)
    grad_float32: bool = False  # grad_out is fp32 (the composed tail's dx) instead of bf16
    tail: TailSpec | None = None  # the fused tail (``stats_tail.py``; ``tail_configs.stats_backward_with_tail``)
    # The composed tail's whole-tile form: CTAs past the tiles sum TailGradient's norm-weight slabs into
    # grad_norm_weight (``norm_reduce``'s order), so that no reduction kernel runs between the two kernels.
    norm_slabs: bool = False

    @property
    def threads(self) -> int:
        return self.column_threads * self.slot_groups * self.row_lanes

    @property
    def slots_per_cta(self) -> int:
        return self.slot_groups * self.slots_per_group

    @property
    def tiles(self) -> int:
        """CTAs along grid y: column chunks x slot chunks."""
        return self.column_chunks * (self.window // self.slots_per_cta)

    @property
    def has_norm(self) -> bool:
        return self.tail is not None and self.tail.has_norm

    @property
    def terms_in_warp(self) -> bool:
        """Whether a row's columns lie in one warp's aligned lanes (one column chunk of at most 32 threads), so that
        each row step forms the norm's terms by shuffles instead of a block of rows' terms in shared memory. Only
        with one row lane: several would run different row counts, and a warp's lanes of a lane with no row left
        would never join the shuffles of a lane with one (the kernel hangs)."""
        return self.has_norm and self.row_lanes == 1 and self.column_chunks == 1 and self.column_threads <= 32

    @property
    def term_rows(self) -> int:
        """Rows whose norm terms a CTA of the fused tail computes at once: a multiple of the row lanes."""
        return -(-STATS_TAIL_TERM_ROWS // self.row_lanes) * self.row_lanes

    @property
    def smem_bytes(self) -> int:
        """The fixed-order combine of the row lanes' grad_ape accumulators, fp32; with a norm, the rows' terms and
        the combine of the norm weight's gradient."""
        tile = self.slots_per_cta * self.columns_per_cta * 4
        lanes = self.row_lanes > 1
        total = 128 + (self.row_lanes * tile if lanes else 0)
        if self.has_norm:
            terms = 0 if self.terms_in_warp else 2 * self.term_rows * 4
            total += terms + (self.row_lanes * self.columns_per_cta * 4 if lanes else 0) + 32
        return total

    carveout = 100

    @property
    def slab_entries(self) -> int:
        """fp32 entries of one CTA's slab: the grad_ape partials, then with a fused norm the weight's."""
        return self.ape_size + (self.head_dim if self.has_norm else 0)

    @property
    def reduce(self) -> ApeReduceConfig | None:
        if self.whole_tile:
            return None
        return ApeReduceConfig(self.ape_size, 1, self.slab_entries - self.ape_size)

    @property
    def norm_reduce(self) -> ApeReduceConfig:
        """With ``norm_slabs``, the sum of the norm-weight slabs (``ApeReduceConfig.norm_weight``)."""
        return ApeReduceConfig.norm_weight(self.head_dim)

    @property
    def summing_ctas(self) -> int:
        """CTAs past the tiles along grid y: ``norm_reduce``'s grid with ``norm_slabs``, else none."""
        return self.norm_reduce.grid if self.norm_slabs else 0


def backward_for_sm90(ratio: int, coff: int, head_dim: int, device: DeviceSpec):
    """Short windows: 2-column vectors (the double-buffered rows, the ape entries and the grad_ape accumulators
    fit the registers), the 128-thread tile in SHORT_BACKWARD_THREADS-thread CTAs. Long windows: 16-byte vectors,
    64 columns per CTA (the grad_ape accumulator is window x columns of shared memory), batches of 4 slots (2 where
    two 16-byte batches in flight would not fit the registers), the next row prefetched up to 128-slot windows."""
    window = coff * ratio
    if is_short_window(ratio, coff):
        width, tc, groups, sg, rows = tile_shape(ratio, coff, head_dim, vcap=2, threads=128, cols_cap=128)
        lanes = max(1, rows * SHORT_BACKWARD_THREADS // (tc * groups * rows))
        return BackwardShortConfig(ratio, coff, head_dim, width, tc, groups, sg, lanes)
    width = vector_width(head_dim, 8)
    col_threads = -(-head_dim // width)
    tc = 1
    while tc * 2 <= col_threads and tc * 2 * width <= 64:
        tc *= 2
    for sg_cap in (4, 2):
        sg = slots_per_group(window, sg_cap)
        batches = window // sg
        groups = max(g for g in range(1, min(batches, 32) + 1) if batches % g == 0 and tc * g <= 256)
        if batches // groups == 1 or width < 8:
            break
    config = BackwardLongConfig(ratio, coff, head_dim, width, tc, groups, sg, batches // groups, window <= 128)
    if config.smem_bytes > device.shared_memory_per_block:
        raise ValueError(
            f"cute backend: the long-window backward of {config} does not fit {device.arch}'s shared memory"
        )
    return config


def backward_for_sm100(ratio: int, coff: int, head_dim: int, device: DeviceSpec):
    return backward_for_sm90(ratio, coff, head_dim, device)


def stats_backward_for_sm90(ratio: int, coff: int, head_dim: int, device: DeviceSpec) -> BackwardStatsConfig:
    """64 columns (8-byte vectors) x slot groups of 4 slots x row lanes in 128 threads: 4 slots of 4 columns per
    thread keep the double-buffered rows, the statistics and the grad_ape accumulators within the registers, and
    load a row's statistics and grad_out once per 4 slots. Row lanes side by side divide the grad_ape slabs by
    their number at the same CTA count; the whole-tile form where the tiles nearly fill the GPU."""
    window = coff * ratio
    slots_cap = max(STATS_MIN_SLOTS, window // STATS_CHUNKS)
    width = vector_width(head_dim, 4)
    col_threads = -(-head_dim // width)
    tc = 1
    while tc * 2 <= col_threads and tc * 2 * width <= 64:
        tc *= 2
    sg = 4 if window % 4 == 0 else 1
    groups = max(1, min(128 // tc, slots_cap // sg))
    while groups > 1 and window % (groups * sg):
        groups //= 2
    lanes = max(1, 128 // (tc * groups))
    slab = BackwardStatsConfig(ratio, coff, head_dim, width, tc, groups, sg, lanes, whole_tile=False)
    if slab.tiles < math.ceil(WHOLE_TILE_FILL * device.sm_count):
        return slab
    lanes = max(1, lanes * WHOLE_TILE_THREADS // slab.threads)
    return BackwardStatsConfig(ratio, coff, head_dim, width, tc, groups, sg, lanes, whole_tile=True)


def stats_backward_for_sm100(ratio: int, coff: int, head_dim: int, device: DeviceSpec) -> BackwardStatsConfig:
    return stats_backward_for_sm90(ratio, coff, head_dim, device)


# ---------------------------------------------------------------- the fused tail's facts (tail_configs.py: its kernels)


@dataclass(frozen=True)
class TailSpec:
    """What a kernel with the fused tail is compiled for (``csa_compressor.tail.TailConfig`` in scalars): a norm
    and its weight's dtype, the rotary block and its pair convention, whether ``position_start`` is given."""

    has_norm: bool
    norm_weight_float32: bool
    rope_dim: int
    rope_interleaved: bool
    has_positions: bool

    def pairs_adjacent(self, head_dim: int) -> bool:
        """Whether every rotary pair is two neighbouring columns starting at an even one (interleaved pairs from an
        even first column) or there is no rotation: then no pair crosses an even-sized group of columns."""
        return self.rope_dim == 0 or (self.rope_interleaved and (head_dim - self.rope_dim) % 2 == 0)

    @classmethod
    def of(cls, tail_config) -> TailSpec:
        """The spec of a ``TailConfig``; fields without effect take one value (no rotation: no pair convention,
        no positions), so that equal kernels have equal specs."""
        norm = tail_config.norm_dtype
        rope = tail_config.rope_dim > 0
        return cls(
            has_norm=norm is not None,
            norm_weight_float32=norm is not None and norm.is_floating_point and norm.itemsize == 4,
            rope_dim=int(tail_config.rope_dim),
            rope_interleaved=bool(tail_config.rope_interleaved) or not rope,
            has_positions=bool(tail_config.has_positions) and rope,
        )


def tail_sum_floats(row_threads: int, rows: int, sums: int, buffers: int = 1) -> int:
    """Shared floats of the fused tail's row sums across warps: (buffer, row, sum, warp of the row); none where a
    row fits a warp (shuffles alone)."""
    warps = row_threads // 32
    return buffers * rows * sums * warps if warps > 1 else 0
