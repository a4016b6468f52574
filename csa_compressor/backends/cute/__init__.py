"""CuTe-DSL backend (nvidia-cutlass-dsl): fused forward and backward kernels for sm_90 (validated on the H200) and
sm_100 (dispatched, not validated).

Layout:

- ``launch``: the protocol functions of ``csa_compressor.backends`` (compile, forward, backward) and the launchers;
  ``tail_launch``: their calls with the fused tail (RMSNorm, RoPE), fused or composed (``select.tail_route``);
- ``select``: which kernel class and configuration serve a (direction, ratio, coff, head_dim, device);
- ``configs``: the configurations (frozen dataclasses) and their per-architecture factories, ``tail_configs``
  those of the fused tail's kernels and routes; ``device``: the figures of a GPU they are sized by;
- kernels: ``forward`` (``ForwardShortWindow``, ``ForwardLongWindow``; the short one fuses the tail),
  ``backward_short`` (``BackwardShortWindow``, which fuses it too), ``backward_long``
  (``BackwardLongWindow``), ``backward_stats`` (``BackwardWithStats``), ``reduce`` (``ApeReduce``, the grad_ape
  reduction inside the backwards), ``persistent`` (the host function of the two persistent backwards),
  ``tail_kernels`` (``TailForward``, ``TailGradient``: the composed tail's kernels over whole rows);
- device helpers: ``ptx`` (inline PTX), ``window`` (window loads, widening, segment lookup), ``softmax`` (the
  exact and the online softmax), ``zeros`` (exact-zero stores), ``norm_rope`` (the fused tail's row sums,
  rotation and table reads);
- ``build`` (compiling one kernel with its TVM-FFI entry point) and ``cache`` (the persistent compile cache).
"""
