"""The host functions the persistent backwards share: ``PersistentBackward`` (``BackwardShortWindow``,
``BackwardLongWindow``): the main kernel over ``[num_ctas, tiles]`` CTAs, each with its fp32 slab of grad_ape
partials, then the fixed-order reduction of the slabs (``ApeReduce``); ``FusedTailHost``, the same with the fused
tail (``BackwardShortWindow``, ``BackwardWithStats``); ``launch_tiles``, the main-kernel launch of every
backward."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .configs import launch_bound


class PersistentBackward:
    """A backward kernel class whose ``kernel`` takes the pooling's pointers, the slabs and the four scalars, with
    ``config`` and ``reduce`` set by the subclass."""

    kind = "backward"

    @cute.jit
    def __call__(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                 cu_seqlens_comp: cute.Pointer, grad_out: cute.Pointer, grad_kv: cute.Pointer,
                 grad_score: cute.Pointer, grad_ape: cute.Pointer, slabs: cute.Pointer, stats: cute.Pointer,
                 segments: Int32, total_comp: Int32, tokens: Int32, rows_per_cta: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):  # fmt: skip
        """Host function (arguments: ``build.py``): the main kernel over ``[num_ctas, column_chunks]`` CTAs, then the
        grad_ape reduction; ``stats`` is not read."""
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, slabs)
        launch_tiles(self.config, self.kernel(*args, segments, total_comp, tokens, rows_per_cta), num_ctas, stream)
        self.reduce.launch(slabs, grad_ape, num_ctas, stream)


def launch_tiles(config, kernel_call, num_ctas: Int32, stream: cuda.CUstream, tiles=None, smem=None) -> None:
    """Launch a backward's main kernel (``kernel_call``: the kernel applied to its arguments) over ``[num_ctas,
    tiles]`` CTAs of ``config.threads`` threads (default ``config.tiles``), with ``smem`` bytes of shared memory
    (default the config's) and the config's carveout."""
    kernel_call.launch(
        grid=[num_ctas, config.tiles if tiles is None else tiles, 1],
        block=[config.threads, 1, 1],
        smem=config.smem_bytes if smem is None else smem,
        stream=stream,
        min_blocks_per_mp=launch_bound(config.threads),
        preferred_smem_carveout=config.carveout,
    )


class FusedTailHost:
    """The host function of a persistent backward with the fused tail (``config.tail``): its ``fused_kernel`` takes
    the pooling's pointers, the slabs, with ``fused_reads_stats`` the statistics, the four scalars and the tail's
    block without grad_norm_weight; the reduction of the slabs writes grad_ape and, with a norm, grad_norm_weight
    (the slabs' last ``head_dim`` entries)."""

    fused_reads_stats = False

    @cute.jit
    def fused_host(self, kv: cute.Pointer, score: cute.Pointer, ape: cute.Pointer, cu_seqlens: cute.Pointer,
                   cu_seqlens_comp: cute.Pointer, grad_out: cute.Pointer, grad_kv: cute.Pointer,
                   grad_score: cute.Pointer, grad_ape: cute.Pointer, slabs: cute.Pointer, stats: cute.Pointer,
                   segments: Int32, total_comp: Int32, tokens: Int32, rows_per_cta: Int32, num_ctas: Int32,
                   norm_weight: cute.Pointer, rope_cos: cute.Pointer, rope_sin: cute.Pointer,
                   position_start: cute.Pointer, rstd: cute.Pointer, grad_norm_weight: cute.Pointer,
                   norm_eps: Float32, max_position: Int32, stream: cuda.CUstream):  # fmt: skip
        """Host function with the tail (arguments: ``build.py``): ``grad_out`` is the gradient of the tail's output,
        ``rstd`` (0: recomputed) the forward's."""
        cfg = self.config
        args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, slabs)
        if cutlass.const_expr(self.fused_reads_stats):
            args = (*args, stats)
        tail_args = (norm_weight, rope_cos, rope_sin, position_start, rstd, norm_eps, max_position)
        launch_tiles(cfg, self.fused_kernel(*args, segments, total_comp, tokens, rows_per_cta, *tail_args), num_ctas,
                     stream)  # fmt: skip
        if cutlass.const_expr(cfg.tail.has_norm):
            self.reduce.launch_with_norm(slabs, grad_ape, grad_norm_weight, num_ctas, stream)
        else:
            self.reduce.launch(slabs, grad_ape, num_ctas, stream)
