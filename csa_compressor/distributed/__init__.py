"""Context parallelism for the compressor pooling: a THD pack split over the ranks of a process group.

::

    from csa_compressor.distributed import CPLayout, compressor_pool_cp, gather_rows

    layout = CPLayout.load_balanced(cu_seqlens, rank, world_size)  # once per batch (one device-to-host copy)
    out_local, rows = compressor_pool_cp(kv_local, score_local, ape, layout, ratio=4, coff=2, group=group)
    out_all = gather_rows(out_local, rows, layout, group=group)  # (total_comp, head_dim) on every rank

Each global row is produced by the rank that holds its last token; only the halo (at most
``coff*ratio - 1`` tokens of kv and score per piece boundary) moves. See docs/distributed.md.
"""

from .layout import CPLayout
from .ops import compressor_pool_cp, gather_rows

__all__ = ["CPLayout", "compressor_pool_cp", "gather_rows"]
