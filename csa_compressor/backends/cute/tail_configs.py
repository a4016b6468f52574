"""Configurations of the fused tail's kernels (RMSNorm, RoPE): the composed route's row kernels and statistics
forward, and the fused short-window kernels' factories (``select.tail_route`` picks between them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...windows import is_short_window
from .configs import (
    REDUCE_WARPS,
    REGISTERS_PER_SM,
    SHORT_BACKWARD_THREADS,
    ApeReduceConfig,
    BackwardShortConfig,
    BackwardStatsConfig,
    ForwardLongConfig,
    ForwardShortConfig,
    TailSpec,
    forward_for_sm90,
    slots_per_group,
    stats_backward_for_sm90,
    tile_shape,
    vector_width,
)
from .device import DeviceSpec

# ---------------------------------------------------------------- the fused tail (RMSNorm, RoPE)

# Tail kernels: threads per CTA at least, and at most this many per row (a row's column vectors in steps of them).
TAIL_THREADS = 128
TAIL_ROW_THREADS = 256
TAIL_COLUMN_STEPS = 4


@dataclass(frozen=True)
class _TailRows:
    """Whole rows per thread group: ``row_threads`` threads own a row (``vector_width`` columns each, in
    ``column_steps`` steps), ``row_lanes`` rows side by side per CTA. ``source_stride`` / ``source_offset``: the
    fp32 pooled rows' stride and first column (``stats[:, 2]``: 3 * head_dim and 2 * head_dim)."""

    ratio: int
    head_dim: int
    tail: TailSpec
    vector_width: int
    row_threads: int
    row_lanes: int
    source_stride: int
    source_offset: int

    @property
    def threads(self) -> int:
        return self.row_threads * self.row_lanes

    @property
    def vectors(self) -> int:
        """Column vectors of a row."""
        return -(-self.head_dim // self.vector_width)

    @property
    def column_steps(self) -> int:
        return -(-self.vectors // self.row_threads)

    @property
    def padded_columns(self) -> int:
        """Columns of a row's shared-memory row: every thread's columns, past head_dim too."""
        return self.column_steps * self.row_threads * self.vector_width

    @property
    def row_warps(self) -> int:
        """Warps of one row (1 for rows of at most 32 threads)."""
        return max(1, self.row_threads // 32)

    @property
    def reduction_bytes(self) -> int:
        return 4 * self.row_lanes * self.row_warps if self.row_warps > 1 else 0


@dataclass(frozen=True)
class TailForwardConfig(_TailRows):
    """The composed forward's epilogue (``tail_kernels.TailForward``): pooled rows -> out (bf16) and rstd."""

    @property
    def smem_bytes(self) -> int:
        rows = 4 * self.row_lanes * self.padded_columns if self.tail.rope_dim else 0
        return rows + self.reduction_bytes + 64


@dataclass(frozen=True)
class TailGradientConfig(_TailRows):
    """The composed backward's first kernel (``tail_kernels.TailGradient``): grad_out -> dx (fp32) and the norm
    weight's gradient through per-CTA slabs and their reduction, persistent CTAs over row ranges."""

    # The slabs are summed by the statistics backward that follows (``BackwardStatsConfig.norm_slabs``), not by a
    # reduction kernel of this host function.
    norm_summed_after: bool = False

    carveout = 50
    tiles = 1
    whole_tile = False

    @property
    def slab_entries(self) -> int:
        return self.head_dim

    @property
    def smem_bytes(self) -> int:
        lanes = 4 * self.row_lanes * self.padded_columns if self.tail.has_norm and self.row_lanes > 1 else 0
        return lanes + 2 * self.reduction_bytes + 64

    @property
    def reduce(self) -> ApeReduceConfig:
        return ApeReduceConfig.norm_weight(self.head_dim)


def tail_rows(kind, ratio: int, head_dim: int, tail: TailSpec, source_stride: int, source_offset: int):
    """A ``kind`` (TailForwardConfig or TailGradientConfig) of 8- or 16-byte column vectors, at most
    TAIL_COLUMN_STEPS steps per thread up to TAIL_ROW_THREADS threads per row, and rows side by side to
    TAIL_THREADS threads."""
    width = vector_width(head_dim, 4)
    vectors = -(-head_dim // width)
    row_threads = 1
    while row_threads * TAIL_COLUMN_STEPS < vectors and row_threads < TAIL_ROW_THREADS:
        row_threads *= 2
    lanes = max(1, TAIL_THREADS // row_threads)
    return kind(ratio, head_dim, tail, width, row_threads, lanes, source_stride, source_offset)


def sums_norm_slabs(pool: BackwardStatsConfig, tail: TailSpec) -> bool:
    """Whether the composed backward's statistics backward ``pool`` sums TailGradient's norm-weight slabs (a
    ``tail`` with a norm) in CTAs past its tiles (``BackwardStatsConfig.norm_slabs``): its whole-tile form, which
    launches no reduction of its own, with a CTA of at least the reduction's threads, for windows of one slot half
    (coff 1). With two halves the tile's kernel spills beside the summing branch (it spills nothing without it) and
    loses more than the reduction kernel's launch saves, so TailGradient reduces its slabs itself there."""
    return (tail.has_norm and pool.whole_tile and pool.tail is None and pool.threads >= REDUCE_WARPS * 32
            and pool.coff == 1)  # fmt: skip


def stats_forward_for_sm90(ratio: int, coff: int, head_dim: int, device: DeviceSpec) -> ForwardLongConfig:
    """The grouped forward with statistics for any window (the composed tail's x): long windows' own, and for
    short windows of one group the exact forward's tile as one group of one batch."""
    config = forward_for_sm90(ratio, coff, head_dim, device, stats=True)
    if not isinstance(config, ForwardLongConfig):
        width, tc, groups, sg, rows = tile_shape(ratio, coff, head_dim, vcap=4, threads=128, cols_cap=512)
        config = ForwardLongConfig(ratio, coff, head_dim, width, tc, groups, sg, 1, rows, False, True)
    # TailForward, launched behind it, finds its rows' positions, angles and weights while this kernel runs.
    return replace(config, signals_dependents=True)


def stats_forward_for_sm100(ratio: int, coff: int, head_dim: int, device: DeviceSpec) -> ForwardLongConfig:
    return stats_forward_for_sm90(ratio, coff, head_dim, device)


# ---------------------------------------------------------------- the fused tail (RMSNorm, RoPE in the kernels)

# Threads one fused forward row may span (one CTA row), and the fused forward CTA's size when rows are narrower.
FUSED_ROW_THREADS_CAP = 1024
FUSED_FORWARD_THREADS = 128
# Registers per thread of a fused forward whose CTA is one row: the most that the kernel takes without spilling.
ONE_ROW_FORWARD_REGISTERS = 72
# The long-window forward with the tail: threads per CTA at most (whole rows; one CTA per SM at the kernels'
# register budget), and rows per CTA whose sums cross warps at most (one named barrier each).
WHOLE_ROW_THREADS = 512
MAX_ROW_BARRIERS = 15


def fused_row_threads(head_dim: int, width: int) -> int:
    """Threads of a fused row: the smallest power of two covering head_dim in ``width``-column vectors (so that a
    row's threads are a warp's aligned share or whole warps, and its sums go through shuffles in a fixed order)."""
    n = 1
    while n * width < head_dim:
        n *= 2
    return n


def _one_exact_group(ratio: int, coff: int) -> bool:
    """The windows the exact short kernels serve: short, one power-of-two group of slots."""
    window = coff * ratio
    return is_short_window(ratio, coff) and slots_per_group(window, 8) == window


def fused_forward_for_sm90(ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail: TailSpec):
    """The forward with the tail, or None where it cannot fuse it. Short windows of one group: whole rows (one
    column chunk) of a power-of-two thread count, 4-column vectors (8 for rows past FUSED_ROW_THREADS_CAP threads),
    rows side by side up to FUSED_FORWARD_THREADS threads; one-row CTAs of FUSED_FORWARD_THREADS threads with
    interleaved pairs (or no rotation) built for ONE_ROW_FORWARD_REGISTERS registers. Other windows:
    ``long_forward_with_tail``."""
    if not _one_exact_group(ratio, coff):
        return long_forward_with_tail(ratio, coff, head_dim, device, tail)
    for cap in (4, 8):
        width = vector_width(head_dim, cap)
        threads = fused_row_threads(head_dim, width)
        if threads <= FUSED_ROW_THREADS_CAP:
            break
    else:
        return None
    rows = 1
    while threads * rows * 2 <= FUSED_FORWARD_THREADS:
        rows *= 2
    # A one-row CTA waits on its row's barrier and its norm's serial chain: more resident CTAs hide them. The
    # half-split rotation's partner exchange needs more registers than the bound leaves (ptxas would spill).
    one_row = rows == 1 and threads == FUSED_FORWARD_THREADS and tail.rope_interleaved
    ctas = REGISTERS_PER_SM // (ONE_ROW_FORWARD_REGISTERS * threads) if one_row else 0
    return ForwardShortConfig(ratio, coff, head_dim, width, threads, rows_per_cta=rows, ctas_per_sm_cap=ctas,
                              tail=tail)  # fmt: skip


def long_forward_with_tail(ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail: TailSpec,
                           stream_rows: bool = True):  # fmt: skip
    """The long-window forward with the tail, or None (the composed route). Where the statistics forward's tile
    (``stats_forward_for_sm90``) has one batch per group and, widened to whole rows (its column chunks side by side
    in one CTA, in place of its rows where it has several), fits WHOLE_ROW_THREADS threads with one column per
    thread in the tail (``tail_rows``): the pooling's own tile with a row's chunks as adjacent CTAs where its rotary
    pairs allow (``chunk_cluster``), else the widened one. Where the widened tile does not fit a CTA, with ``stream_rows``, a
    row streaming its window through one CTA (``whole_row_stream``). Streaming windows (several batches per group,
    whose CTA would hold a row's whole stream) stay composed."""
    config = stats_forward_for_sm90(ratio, coff, head_dim, device)
    chunks = config.column_chunks
    column_threads = config.column_threads * chunks
    if config.batches > 1 or (chunks > 1 and column_threads & (column_threads - 1)):
        return None
    rows = max(1, config.rows_per_cta // chunks)  # the tile's threads where its rows allow
    whole = replace(config, column_threads=column_threads, rows_per_cta=rows, chunk_major=False,
                    signals_dependents=False, tail=tail)  # fmt: skip
    columns = whole.columns_per_cta
    fits = whole.threads <= WHOLE_ROW_THREADS and whole.threads % columns == 0 and whole.tail_rows >= rows
    if fits and (columns <= 32 or whole.tail_rows <= MAX_ROW_BARRIERS):
        return chunk_cluster(config, tail) or whole
    if stream_rows:
        return whole_row_stream(ratio, coff, head_dim, tail)
    return None


# The most column chunks of a row kept as separate CTAs: the width timed and run on a GPU (wider rows keep the
# whole-row block).
MAX_CLUSTER_CHUNKS = 2


def chunk_cluster(config: ForwardLongConfig, tail: TailSpec):
    """The statistics forward's own tile with the tail, its column chunks of a row adjacent CTAs, or None. With a
    norm they are one cluster (the row's sum of squares summed across them through distributed shared memory:
    ``long_tail.WholeRowTail``); a rotation alone needs nothing from the other chunk. For tiles of 2 to
    MAX_CLUSTER_CHUNKS chunks of an even width whose rotary pairs are neighbouring columns (``TailSpec.pairs_adjacent``:
    each pair in one chunk, in neighbouring lanes): the row keeps the pooling's grid, where widening it to one CTA
    would leave SMs idle."""
    chunks, columns = config.column_chunks, config.columns_per_cta
    pairs_ok = tail.pairs_adjacent(config.head_dim) and columns % 2 == 0
    if not 1 < chunks <= MAX_CLUSTER_CHUNKS or not pairs_ok or config.threads % columns:
        return None
    tile = replace(config, chunk_major=True, signals_dependents=False, tail=tail)
    if tile.tail_rows < config.rows_per_cta or (columns > 32 and tile.tail_rows > MAX_ROW_BARRIERS):
        return None
    return tile


# The whole-row stream: the head_dim it serves (DeepSeek-V4's main compressor), its vectors and slots per batch, and
# the CTAs per SM its launch bound holds (so that one wave holds twice the SMs' rows).
STREAM_HEAD_DIM = 512
STREAM_VECTOR = 4
STREAM_BATCH = 4
STREAM_CTAS_PER_SM = 2


def whole_row_stream(ratio: int, coff: int, head_dim: int, tail: TailSpec):
    """One row per CTA of WHOLE_ROW_THREADS threads, for head_dim STREAM_HEAD_DIM and windows of one slot half up
    to 128 slots: a thread per STREAM_VECTOR columns, the slot groups the rest of the CTA, each folding batches of
    STREAM_BATCH slots (the next one in flight); None for other shapes (two slot halves spill at the launch bound).
    The row's loads are whole token rows, and the tail runs in the CTA, with no second kernel behind the pooling."""
    if head_dim != STREAM_HEAD_DIM or coff != 1:
        return None
    column_threads = head_dim // STREAM_VECTOR
    groups = WHOLE_ROW_THREADS // column_threads
    window = coff * ratio
    if window > 128 or window % (groups * STREAM_BATCH):
        return None
    batches = window // (groups * STREAM_BATCH)
    return ForwardLongConfig(ratio, coff, head_dim, STREAM_VECTOR, column_threads, slot_groups=groups,
                             slots_per_batch=STREAM_BATCH, batches=batches, rows_per_cta=1, chunk_major=False,
                             write_stats=True, tail=tail, ctas_per_sm=STREAM_CTAS_PER_SM)  # fmt: skip


def fused_backward_for_sm90(ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail: TailSpec):
    """The backward with the tail, or None where it cannot fuse it. Short windows of one group: the pooling-only
    backward's 2-column vectors and SHORT_BACKWARD_THREADS-thread CTAs, each row lane a whole row (a power-of-two
    thread count, at most the CTA). Other windows: ``stats_backward_with_tail``."""
    if not _one_exact_group(ratio, coff):
        return stats_backward_with_tail(ratio, coff, head_dim, device, tail)
    width = vector_width(head_dim, 2)
    threads = fused_row_threads(head_dim, width)
    if threads > SHORT_BACKWARD_THREADS:
        return None
    window = coff * ratio
    lanes = SHORT_BACKWARD_THREADS // threads
    return BackwardShortConfig(ratio, coff, head_dim, width, threads, 1, window, lanes, tail=tail)


def stats_backward_with_tail(ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail: TailSpec):
    """The statistics backward's slab form (``stats_backward_for_sm90``) with the tail (``stats_tail.py``: every CTA
    computes its rows' norm terms, then dx of its columns), or None where the composed route serves the window: the
    whole-tile form, whose every CTA would read all rows for their terms. Slot groups of half the slots (twice as
    many, half the row lanes: the same threads and tiles) leave the registers the tail's operands need."""
    config = stats_backward_for_sm90(ratio, coff, head_dim, device)
    if config.whole_tile:
        return None
    row_threads = fused_row_threads(head_dim, config.vector_width)
    in_warp = replace(config, column_threads=row_threads, slot_groups=config.threads // row_threads,
                      slots_per_group=max(1, config.slots_per_group // 2), row_lanes=1)  # fmt: skip
    if row_threads <= 32 and in_warp.window % in_warp.slots_per_cta == 0:
        # A row's columns in one warp: each row step forms the norm's terms by shuffles (terms_in_warp), with the
        # threads and registers per thread of the half-slot form below.
        config = in_warp
    elif config.slots_per_group > 1 and config.row_lanes > 1:
        config = replace(config, slots_per_group=config.slots_per_group // 2, slot_groups=config.slot_groups * 2,
                         row_lanes=config.row_lanes // 2)  # fmt: skip
    config = replace(config, tail=tail)
    return config if config.smem_bytes <= device.shared_memory_per_block else None


def fused_forward_for_sm100(ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail: TailSpec):
    if not _one_exact_group(ratio, coff):
        # The whole-row stream spills at its launch bound on sm_100a: the composed route there.
        return long_forward_with_tail(ratio, coff, head_dim, device, tail, stream_rows=False)
    return fused_forward_for_sm90(ratio, coff, head_dim, device, tail)


def fused_backward_for_sm100(ratio: int, coff: int, head_dim: int, device: DeviceSpec, tail: TailSpec):
    return fused_backward_for_sm90(ratio, coff, head_dim, device, tail)
