"""Triton backend: one fused forward kernel, one fused backward kernel (+ a deterministic dAPE reduction).

``launch`` implements the backend protocol of :mod:`csa_compressor.backends` over per-configuration launch
plans (``plans``), whose kernels launch through one path (``binding``) with tiles from ``config``;
``forward``, ``forward_long``, ``forward_tail`` (the long-window forward's tail epilogue) and ``backward`` hold
the ``@triton.jit`` kernels. Importing this package does not import triton, so :func:`launch.unavailable_reason`
can report its absence.
"""
