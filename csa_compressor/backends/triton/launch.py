"""Backend protocol (see ``csa_compressor.backends``) over the Triton kernels.

Runs natively on CUDA GPUs of compute capability 8.0 and newer, and on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1``), which CI uses to execute the
kernels' real logic. Launch paths read no device memory on the host and size
their grids from shapes only, so they are CUDA-graph capture safe once
:func:`compile` has built the configuration.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...windows import uses_softmax_stats

__all__ = [
    "STATS_TILE_OVERRIDE",
    "KernelConfig",
    "StatsTile",
    "backward",
    "choose_config",
    "compile",
    "config_unsupported_reason",
    "device_unsupported_reason",
    "forward",
    "stats_tile",
    "supports_stats",
    "unavailable_reason",
]

MAX_RATIO = 256
_SMS_DEFAULT = 132
# Resident small-window backward programs per SM (1 warp, 244 registers with Triton 3.6 for sm_90 at ratio 4).
_SMALL_BWD_RESIDENT = 8


def unavailable_reason() -> str | None:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"triton is not importable ({exc}); install the 'triton' extra"
    return None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_unsupported_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    if device.type == "cpu":
        if _interpret():
            return None
        return "triton runs on the CPU only under its interpreter (set TRITON_INTERPRET=1 before importing triton)"
    if device.type != "cuda":
        return f"triton backend supports CUDA devices (and the CPU interpreter), not {device.type!r}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if _interpret():
        return None
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if (major, minor) < (8, 0):
        return f"triton backend needs compute capability >= 8.0, this GPU has {major}.{minor}"
    return None


def config_unsupported_reason(ratio: int, coff: int, head_dim: int) -> str | None:
    if coff not in (1, 2):
        return f"coff must be 1 or 2, got {coff}"
    if not 1 <= ratio <= MAX_RATIO:
        return f"ratio must be in [1, {MAX_RATIO}], got {ratio}"
    if head_dim < 1:
        return f"head_dim must be >= 1, got {head_dim}"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# --------------------------------------------------------------------------- kernels


_KERNELS: dict[bool, tuple] = {}


def _kernels():
    """(forward module, backward module), decorated in the interpreter mode now in force.

    ``triton.jit`` decides at decoration time whether a kernel is interpreted; if
    the modules were first imported under the other mode they are reloaded once.
    """
    mode = _interpret()
    mods = _KERNELS.get(mode)
    if mods is None:
        from . import backward as bwd_mod
        from . import forward as fwd_mod

        if (type(fwd_mod.csa_fwd_kernel).__name__ == "InterpretedFunction") != mode:
            fwd_mod = importlib.reload(fwd_mod)
            bwd_mod = importlib.reload(bwd_mod)
        mods = _KERNELS[mode] = (fwd_mod, bwd_mod)
    return mods


# --------------------------------------------------------------------------- configuration


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


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def choose_config(direction: str, ratio: int, coff: int, head_dim: int, interpret: bool) -> KernelConfig:
    """Default tiles (GPU values from the H200 sweep in benchmarks/triton_sweep.py)."""
    k = coff * _pow2(ratio)
    d2 = _pow2(head_dim)
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
    if k <= 16:
        # Every slot of a (row, column) in one thread: in-thread, in-order softmax reductions. About 32 window
        # elements per thread (k * vec) keep the backward below 256 registers: 8-byte column accesses at k = 8,
        # still whole 32-byte sectors per warp. One warp per program: on the H200 sweep multi-warp programs were
        # 1.5-4.5x slower at ratio 4.
        vec = min(8, 32 // k)
        block_d = min(32 * vec, d2)
        num_warps = 1
        block_r = max(1, (32 * vec) // block_d) * num_warps
        # dAPE reduction: small windows make many partials (N / 2..32 rows of [ratio, coff*d]); 512 partials per
        # step keep its serial chain at P / 512 steps, 8 fp32 entries (one 32-byte sector per partial) per program.
        dape_block, dape_chunk = 8, 512
    else:
        return _long_config(direction, ratio, coff, head_dim)
    # Slot sums in PyTorch's CUDA reduction order (small windows): same registers and instructions with Triton
    # 3.6 for sm_90. It aims at bitwise equality with the CUDA reference where sum(p*v) or dlogit cancel; not yet
    # measured on the GPU (the sweep of commit 6a984c6 summed in slot order: dKV bitwise, dScore/forward not).
    return KernelConfig(
        block_r,
        block_d,
        num_warps,
        sweep_t=64,
        sweep_d=min(256, d2),
        vec=vec,
        dape_block=dape_block,
        dape_chunk=dape_chunk,
    )


def _long_config(direction: str, ratio: int, coff: int, head_dim: int) -> KernelConfig:
    """GPU tiles for long windows (``coff * next_pow2(ratio) > 16``): 16-byte column vectors (vec = 8), 8-byte ones
    for the small-head_dim forward.

    Registers with Triton 3.6 for sm_90 (ratio 128, no spills): forward 1 warp x 64 columns x 2 slots per thread
    and chunk, 128 registers (16 warps per SM) with one or two chunks in flight at coff 1 (136 at coff 2, where
    ape is offset per half); 4 warps x 32 columns x 4 slots, 128 with 8-byte vectors (180 with 16-byte ones at 2
    warps). Backward ~240
    registers at 32 window elements per thread and input (8 warps: 1 program per SM, 4 warps: 2).
    """
    k = coff * _pow2(ratio)
    d2 = _pow2(head_dim)
    if direction == "forward":
        if head_dim <= 128:
            # Small problems are latency bound: 32-column blocks of 8-byte vectors, 4 warps x 16 lanes x 4 slots =
            # 64-slot chunks, half the window elements per thread of the 16-byte tile (H200 sweep with the bench's
            # profiler timer and statistics, 2026-11-30 late, 1x8192 d128 r128 c1: 4.10 us write flush / 3.39 read
            # flush against 4.78 / 4.36 for 2 warps x 16-byte vectors, on a slower host than the sweep before).
            block_d, num_warps, cs_in, depth, vec = min(32, d2), 4, 4, 1, 4
        elif coff == 2:
            # 64 columns x 1 warp (H200 sweep with the bench's profiler timer and statistics, 2026-11-30 late,
            # 1x65536 d512 r128 c2: 77.0 us write flush / 71.1 read flush; 128 columns x 2 warps 78.1 / 73.2). Two
            # chunks in flight measured 95 / 91 here: this grid is two waves, and the 8 more registers cost a warp.
            block_d, num_warps, cs_in, depth, vec = min(64, d2), 1, 2, 1, 8
        else:
            # 64-column blocks: twice the programs of 128 (3x8192 d512: 1536 programs, one wave of ~12 warps per
            # SM), two chunks in flight (same sweep: 18.1 us write flush / 16.4 read flush; one chunk 18.8 / 18.3).
            block_d, num_warps, cs_in, depth, vec = min(64, d2), 1, 2, 2, 8
        return KernelConfig(
            1,
            block_d,
            num_warps,
            rows_per_prog=1,
            vec=vec,
            slots_per_thread=cs_in,
            sweep_d=min(256, d2),
            prefetch_depth=depth,
        )
    # Backward: 32 elements per thread of each input (CS_IN = 4 slots x 8 columns), 4 warps (H200 sweep
    # 2026-11-30, 1x65536 d512 r128 c2: 211 us; 8 warps 217).
    num_warps = 4
    block_d = max(8, min(d2, 32 * num_warps * 8 * 4 // k))
    return KernelConfig(1, block_d, num_warps, rows_per_prog=0, vec=8, sweep_d=min(256, d2))


def _rows_per_prog(cfg: KernelConfig, direction: str, n_rows: int, n_col: int, k: int, device) -> int:
    """Rows per program: enough programs in flight, and (backward) few enough dAPE partials.

    A partial costs ``1 / (2 * rows_per_prog)`` of the backward's bytes (it is
    ``[ratio, coff*d]`` fp32 against ``rows * ratio * coff*d`` bf16 read and written
    twice), so the long-window backward keeps at least 4 rows and grows to 16 on big problems.
    """
    if cfg.rows_per_prog > 0:
        return cfg.rows_per_prog
    one_tile_programs = _cdiv(n_rows, cfg.block_r) * n_col
    if direction == "forward":
        target, lo, hi = 4096, 1, 4
    elif k <= 16:
        # Small-window backward programs are latency bound (one warp, ~240 registers: 8 resident per SM; every
        # program first pays its segment search, then one load round trip per tile). Exactly one wave of programs,
        # each with the fewest tiles that cover the problem, finishes soonest; 2 tiles at least, so the next
        # tile's load is in flight behind the current one. (Was: 4-32 tiles for ~1024 programs, i.e. 1.5 waves on
        # 3x8192 d128, and P = N/4 partials.)
        slots = _SMS_DEFAULT if device.type != "cuda" else _sm_count(_device_index(device))
        tiles = max(2, min(32, _cdiv(one_tile_programs, slots * _SMALL_BWD_RESIDENT)))
        return tiles * cfg.block_r
    else:
        target, lo, hi = 512, 4, 16
    tiles = max(lo, min(hi, _pow2(one_tile_programs // target + 1) // 2))
    return tiles * cfg.block_r


def _is_long(ratio: int, coff: int) -> bool:
    """Long windows run the ``*_long_kernel``s."""
    return uses_softmax_stats(ratio, coff)


# The autograd function saves softmax statistics for this backend. The statistics forward works in the log2
# domain (forward.py, _online_step): at 9259c20 a per-lane rounding of m * log2e put one dScore element of the
# 1x65536 d512 r128 c2 pair past the contract's fp32 slack; with the log2-domain forward all seven full-size
# packs meet the contract on the H200 (benchmarks/full_numerics.py, 2026-11-30 at b115073).
AUTOGRAD_STATS = True


def supports_stats(ratio: int, coff: int, head_dim: int) -> bool:
    """Softmax statistics (``reference.softmax_stats``) are written and read by the long-window kernels only."""
    return _is_long(ratio, coff)


def _check_stats(stats, ratio: int, coff: int) -> None:
    # Shapes and dtypes are checked by csa_compressor.support; a short-window kernel would silently ignore stats.
    if stats is not None and not _is_long(ratio, coff):
        raise ValueError(
            f"softmax stats are supported for long windows only (coff * ratio > 16), "
            f"got ratio={ratio}, coff={coff}; pass stats=None"
        )


def _long_shape(direction: str, cfg: KernelConfig, ratio: int, coff: int) -> tuple[int, int]:
    """``(LANES, CS_IN)`` of the long-window tile ``[LANES, CS_IN, block_d]`` (powers of two).

    ``LANES``: the threads and warps left over once ``block_d / vec`` threads span the columns (at least 1,
    at most the slots of a half window / the whole window). Forward: ``CS_IN = slots_per_thread`` (a chunk never
    exceeds a half window); backward: the whole window, ``CS_IN = coff * next_pow2(ratio) / LANES``.
    """
    sp = _pow2(ratio)
    vec = max(1, min(cfg.vec, cfg.block_d))
    lanes = max(1, (32 * cfg.num_warps * vec) // cfg.block_d)
    if direction == "forward":
        lanes = min(lanes, sp)
        return lanes, max(1, min(_pow2(cfg.slots_per_thread), sp // lanes))
    lanes = min(lanes, coff * sp)
    return lanes, coff * sp // lanes


def _long_rows(cfg: KernelConfig, direction: str, n_rows: int, n_col: int, device, k: int = 256) -> int:
    """Rows per long-window program. Forward: ``cfg.rows_per_prog`` or 1 (column blocks and rows give enough
    programs). Backward (``k`` window slots): one wave of programs, at least 2 rows (each program writes a
    ``[ratio, block_d]`` slice of an fp32 dAPE partial), at most 64. Resident programs per SM from the sm_90
    registers: ~240 at 32 window elements per thread and input (``8 // num_warps`` programs), 128 at 16."""
    if cfg.rows_per_prog > 0:
        return cfg.rows_per_prog
    if direction == "forward":
        return 1
    slots = _SMS_DEFAULT if device.type != "cuda" else _sm_count(_device_index(device))
    per_thread = k * cfg.block_d // (32 * cfg.num_warps)
    per_sm = max(1, (16 if per_thread <= 16 else 8) // cfg.num_warps)
    # Whole row groups per column block: ceil(n_rows / rows) * n_col programs must fit one wave.
    parts = max(1, (slots * per_sm) // n_col)
    return max(2, min(64, _cdiv(n_rows, parts)))


class StatsTile(NamedTuple):
    """Tile of the softmax-statistics backward (``csa_bwd_stats_kernel``): ``block_d`` columns x ``slots`` window
    slots per program (powers of two), ``num_warps``, ``rows`` rows per program (0: from the problem size)."""

    block_d: int
    slots: int
    num_warps: int
    rows: int = 0


# Statistics-backward tiles that replace stats_tile()'s defaults, keyed by (ratio, coff, head_dim): a StatsTile or a
# (block_d, slots, num_warps, rows) tuple, rows 0 = from the problem size. For GPU sweeps
# (benchmarks/triton_stats_sweep.py) and tests. compile() builds the tile in force when it runs: set it before.
STATS_TILE_OVERRIDE: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}

# Statistics backward, rows per program from the problem size: about one wave of programs (132 SMs x 4 resident at ~125 registers), 2-32 rows each. H200 sweep 2026-11-30
# (benchmarks/triton_stats_sweep.py, cold): 1x65536 d512 r128 c2 rows 16 / 32: 158.4 / 153.0 us; 3x8192 d512
# r128 c1 rows 6 / 12 / 3: 34.5 / 31.9 / 39.0; 1x8192 d128 r128 c1 rows 1 / 2 / 4: 5.1 / 4.3 / 5.1.
_STATS_PROGRAMS = 528
_STATS_ROWS = (2, 32)
_STATS_WORKSPACE_BYTES = 20 << 20


def stats_tile(ratio: int, coff: int, head_dim: int, interpret: bool) -> StatsTile:
    """Tile of the statistics backward: ``STATS_TILE_OVERRIDE``, else the defaults below. Never depends on the
    problem size (only ``rows``, a runtime argument, does), so what compile() builds serves every later call.

    GPU: 64 columns x 32 slots (fewer for smaller problems), 4 warps (best of the H200 sweep): 16-byte
    accesses, 8 threads across the columns, 2 slots x 8 columns = 16 elements per thread of each tile (kv, score,
    ape, the dAPE accumulator; the next row's kv/score in flight); per row 3 x 64 fp32 statistics and 64 bf16
    grad_out shared by the 32 slots. 124 (coff 1) / 128 (coff 2) registers, no spills (Triton 3.9, sm_90 offline):
    4 programs per SM.
    3x8192 d512 r128 c1: 8 column blocks x 4 chunks x 16 row ranges of 12 rows = 512 programs, 4 MB of partials;
    1x65536 d512 r128 c2: 8 x 8 x 16 ranges of 32 rows = 1024 programs, 8 MB.
    Interpreter: whole column range and window, 2 rows per program (few, large programs).
    """
    override = STATS_TILE_OVERRIDE.get((ratio, coff, head_dim))
    if override is not None:
        return StatsTile(*override)
    if interpret:
        return StatsTile(_pow2(head_dim), _pow2(coff * ratio), 1, 2)
    return StatsTile(min(64, max(8, _pow2(head_dim))), min(32, _pow2(coff * ratio)), 4, 0)


def _stats_rows(tile: StatsTile, ratio: int, coff: int, head_dim: int, n_rows: int) -> int:
    """Rows per statistics-backward program: ``tile.rows``, else about ``_STATS_PROGRAMS`` programs with 2-32 rows
    each (a program writes ``slots x block_d`` fp32 of partials, ``1 / (2 * rows)`` of the bytes it moves), and no
    more than ``_STATS_WORKSPACE_BYTES`` of partials."""
    if tile.rows > 0:
        return tile.rows
    units = _cdiv(head_dim, tile.block_d) * _cdiv(coff * ratio, tile.slots)
    lo, hi = _STATS_ROWS
    rows = max(lo, min(hi, _cdiv(n_rows * units, _STATS_PROGRAMS)))
    max_parts = max(1, _STATS_WORKSPACE_BYTES // (ratio * coff * head_dim * 4))
    return max(rows, _cdiv(n_rows, max_parts))


@functools.cache
def _cached_config(direction, ratio, coff, head_dim, dtype, arch) -> KernelConfig:
    return choose_config(direction, ratio, coff, head_dim, arch == "interpret")


def _arch(device: torch.device) -> str:
    if _interpret() or device.type != "cuda":
        return "interpret"
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return f"sm{major}{minor}"


def _config(direction, ratio, coff, head_dim, dtype, device) -> KernelConfig:
    return _cached_config(direction, ratio, coff, head_dim, dtype, _arch(device))


# --------------------------------------------------------------------------- launches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@contextlib.contextmanager
def _launch_context(tensor: torch.Tensor, stream):
    if tensor.device.type != "cuda":
        yield
        return
    with torch.cuda.device(tensor.device):
        if stream is None:
            yield
        else:
            with torch.cuda.stream(stream):
                yield


def _torch_order(cfg: KernelConfig, ratio: int, coff: int) -> bool:
    """Sum slots in PyTorch's order: only where all slots of a column sit in one thread (small windows)."""
    k = coff * _pow2(ratio)
    return cfg.torch_order and k % 4 == 0 and k * cfg.vec <= 32 and cfg.block_d <= 32 * cfg.vec


def _search_iters(num_segments: int) -> int:
    return max(0, num_segments - 1).bit_length()


def launch_forward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, cfg: KernelConfig, stats=None
) -> None:
    """Enqueue the forward kernel with tiles ``cfg`` on the current stream (and fill ``stats``, if given)."""
    _check_stats(stats, ratio, coff)
    n_rows = out.shape[0]
    if n_rows == 0:
        return
    fwd_mod, _ = _kernels()
    head_dim = out.shape[1]
    num_segments = cu_seqlens.shape[0] - 1
    n_col = _cdiv(head_dim, cfg.block_d)
    args = (
        kv,
        score,
        ape,
        cu_seqlens,
        cu_seqlens_comp,
        out,
        n_rows,
        kv.shape[0],
        num_segments,
        _search_iters(num_segments),
    )
    consts = dict(
        RATIO=ratio,
        COFF=coff,
        HEAD_DIM=head_dim,
        BLOCK_D=cfg.block_d,
        VEC=cfg.vec,
        N_COL=n_col,
        MANUAL_RTNE=_interpret(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if _is_long(ratio, coff):
        lanes, cs_in = _long_shape("forward", cfg, ratio, coff)
        rows = _long_rows(cfg, "forward", n_rows, n_col, kv.device)
        nch_half = _cdiv(ratio, lanes * cs_in)
        fwd_mod.csa_fwd_long_kernel[(_cdiv(n_rows, rows) * n_col,)](
            *args,
            rows,
            stats,
            LANES=lanes,
            CS_IN=cs_in,
            NCH_HALF=nch_half,
            WRITE_STATS=stats is not None,
            DEPTH=2 if cfg.prefetch_depth == 2 and coff * nch_half >= 2 else 1,
            **consts,
        )
        return
    tiles = max(1, _rows_per_prog(cfg, "forward", n_rows, n_col, coff * _pow2(ratio), kv.device) // cfg.block_r)
    n_prog = _cdiv(_cdiv(n_rows, cfg.block_r), tiles)
    fwd_mod.csa_fwd_kernel[(n_prog * n_col,)](
        *args,
        tiles,
        SP=_pow2(ratio),
        BLOCK_R=cfg.block_r,
        PRECISE_EXP=cfg.precise_exp and kv.device.type == "cuda" and not _interpret(),
        TORCH_ORDER=_torch_order(cfg, ratio, coff),
        # The reference rounds every product before adding: no fused multiply-adds.
        enable_fp_fusion=False,
        **consts,
    )


def launch_backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, cfg, stats=None
) -> None:
    """Enqueue the backward kernel and the dAPE reduction with tiles ``cfg`` on the current stream (reading the
    forward's ``stats``, if given)."""
    _check_stats(stats, ratio, coff)
    n_rows = grad_out.shape[0]
    if n_rows == 0:
        grad_kv.zero_()
        grad_score.zero_()
        grad_ape.zero_()
        return
    _, bwd_mod = _kernels()
    if stats is not None:
        _launch_stats_backward(
            bwd_mod, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff,
            cfg, stats,
        )  # fmt: skip
        return
    tokens, width = kv.shape
    head_dim = width // coff
    num_segments = cu_seqlens.shape[0] - 1
    n_col = _cdiv(head_dim, cfg.block_d)
    if _is_long(ratio, coff):
        rows_per_part = _long_rows(cfg, "backward", n_rows, n_col, kv.device, coff * _pow2(ratio))
        n_parts = _cdiv(n_rows, rows_per_part)
    else:
        tiles = max(1, _rows_per_prog(cfg, "backward", n_rows, n_col, coff * _pow2(ratio), kv.device) // cfg.block_r)
        n_parts = _cdiv(_cdiv(n_rows, cfg.block_r), tiles)
    n_compute = n_parts * n_col
    grid = (n_compute + _cdiv(tokens, cfg.sweep_t),)  # compute programs, then the zero-sweep programs
    workspace = _workspace((n_parts, ratio, width), kv.device)
    args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, workspace)
    args += (n_rows, tokens, num_segments, _search_iters(num_segments))
    consts = dict(
        RATIO=ratio,
        SP=_pow2(ratio),
        COFF=coff,
        HEAD_DIM=head_dim,
        BLOCK_D=cfg.block_d,
        VEC=cfg.vec,
        N_COL=n_col,
        SWEEP_T=cfg.sweep_t,
        SWEEP_D=cfg.sweep_d,
        MANUAL_RTNE=_interpret(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if _is_long(ratio, coff):
        lanes, cs_in = _long_shape("backward", cfg, ratio, coff)
        bwd_mod.csa_bwd_long_kernel[grid](*args, rows_per_part, n_compute, LANES=lanes, CS_IN=cs_in, **consts)
    else:
        bwd_mod.csa_bwd_kernel[grid](
            *args,
            tiles,
            n_compute,
            BLOCK_R=cfg.block_r,
            PRECISE_EXP=cfg.precise_exp and kv.device.type == "cuda" and not _interpret(),
            TORCH_ORDER=_torch_order(cfg, ratio, coff),
            # The reference rounds every product before adding: no fused multiply-adds.
            enable_fp_fusion=False,
            **consts,
        )
    _reduce_dape(bwd_mod, workspace, grad_ape, n_parts, ratio * width, cfg)


def _launch_stats_backward(
    bwd_mod, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, cfg,
    stats,
) -> None:  # fmt: skip
    """``csa_bwd_stats_kernel`` (tile: :func:`stats_tile`; zero sweep and dAPE reduction: ``cfg``), then the
    reduction of its ``[row ranges, ratio, coff*d]`` dAPE partials."""
    n_rows = grad_out.shape[0]
    tokens, width = kv.shape
    head_dim = width // coff
    num_segments = cu_seqlens.shape[0] - 1
    tile = stats_tile(ratio, coff, head_dim, _arch(kv.device) == "interpret")
    rows = _stats_rows(tile, ratio, coff, head_dim, n_rows)
    n_col = _cdiv(head_dim, tile.block_d)
    n_chunk = _cdiv(coff * ratio, tile.slots)
    n_parts = _cdiv(n_rows, rows)
    n_compute = n_parts * n_chunk * n_col
    workspace = _workspace((n_parts, ratio, width), kv.device)
    grid = (n_compute + _cdiv(tokens, cfg.sweep_t),)  # compute programs, then the zero-sweep programs
    # At most 128 sweep elements per thread (64 x 256 at 4 warps): a larger sweep tile would set the register count
    # of the whole kernel (its compute programs need ~124 at 64 x 32 x 4 warps, Triton 3.9, sm_90).
    sweep_d = min(cfg.sweep_d, max(1, _pow2(4096 * tile.num_warps // cfg.sweep_t + 1) // 2))
    bwd_mod.csa_bwd_stats_kernel[grid](
        kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, workspace, stats,
        n_rows, tokens, num_segments, _search_iters(num_segments), rows, n_compute,
        RATIO=ratio, COFF=coff, HEAD_DIM=head_dim, BLOCK_D=tile.block_d, SLOTS=tile.slots,
        VEC=max(1, min(8, tile.block_d)), N_COL=n_col, N_CHUNK=n_chunk, SWEEP_T=cfg.sweep_t, SWEEP_D=sweep_d,
        MANUAL_RTNE=_interpret(), num_warps=tile.num_warps, num_stages=1,
    )  # fmt: skip
    _reduce_dape(bwd_mod, workspace, grad_ape, n_parts, ratio * width, cfg)


def _workspace(shape, device) -> torch.Tensor:
    """The dAPE partials (every entry is written by the backward kernel; tests fill it with NaN to check that)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _reduce_dape(bwd_mod, workspace, grad_ape, n_parts, size, cfg) -> None:
    # [dape_chunk partials, dape_block entries] per step: a short dependent chain (P / dape_chunk steps) and many
    # programs. Neither constexpr depends on the problem size: compile() warms up on a tiny problem (capture safety).
    block = min(cfg.dape_block, _pow2(size))
    chunk = cfg.dape_chunk
    bwd_mod.dape_reduce_kernel[(_cdiv(size, block),)](
        workspace, grad_ape, n_parts, SIZE=size, BLOCK=block, CHUNK=chunk, num_warps=4, enable_fp_fusion=False
    )


# --------------------------------------------------------------------------- protocol


def compile(direction: str, ratio: int, coff: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """JIT-build ``direction``'s kernels for this configuration by launching them once on a tiny problem.

    The launch uses the same constexprs, dtypes and argument specialisation as
    real calls (runtime integers are ``do_not_specialize``; every tensor the API
    accepts is 16-byte aligned), so later launches only hit Triton's cache.
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = _config(direction, ratio, coff, head_dim, dtype, device)
    _kernels()
    if device.type != "cuda" or _interpret():
        return  # the interpreter has nothing to build
    width = coff * head_dim
    tokens = 2 * ratio
    with torch.cuda.device(device):
        kv = torch.zeros((tokens, width), dtype=dtype, device=device)
        score = torch.zeros_like(kv)
        ape = torch.zeros((ratio, width), dtype=torch.float32, device=device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        cu_comp = torch.tensor([0, 2], dtype=torch.int32, device=device)
        # Long windows: the stats variant too (another specialisation), so that a first call with stats under
        # CUDA-graph capture does not compile either.
        variants = [None]
        if _is_long(ratio, coff):
            variants.append(torch.zeros((2, 3, head_dim), dtype=torch.float32, device=device))
        for stats in variants:
            if direction == "forward":
                out = torch.empty((2, head_dim), dtype=dtype, device=device)
                launch_forward(kv, score, ape, cu, cu_comp, out, ratio, coff, cfg, stats)
            else:
                grad_out = torch.zeros((2, head_dim), dtype=dtype, device=device)
                grads = torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(ape)
                launch_backward(kv, score, ape, cu, cu_comp, grad_out, *grads, ratio, coff, cfg, stats)
        torch.cuda.current_stream(device).synchronize()


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None) -> None:
    """``stats``: None, or a ``(N, 3, d)`` float32 buffer the long-window kernel fills (``reference.softmax_stats``)."""
    if out.shape[0] == 0:
        _check_stats(stats, ratio, coff)
        return
    cfg = _config("forward", ratio, coff, out.shape[1], kv.dtype, kv.device)
    with _launch_context(kv, stream):
        launch_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, cfg, stats)


def backward(
    kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio, coff, stream=None,
    stats=None,
) -> None:  # fmt: skip
    """``stats``: None, or the forward's ``(N, 3, d)`` float32 softmax statistics (long windows only)."""
    cfg = _config("backward", ratio, coff, grad_out.shape[1], kv.dtype, kv.device)
    tensors = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
    with _launch_context(kv, stream):
        launch_backward(*tensors, ratio, coff, cfg, stats)
