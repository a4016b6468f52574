"""Fused kernels for the DeepSeek-V4-style CSA/HCA compressor pooling (THD packed layout).

Public entry points:

- ``csa_compressor_forward_wrapper`` / ``csa_compressor_backward_wrapper`` and the
  ``CSACompressorForward`` / ``CSACompressorBackward`` classes (``check_support``,
  ``compile``, ``execute``): the kernel API;
- ``compressor_pool`` (autograd + ``torch.library`` custom op) and ``CompressorPool``
  (an ``nn.Module`` owning ``ape``): the training API;
- every one of them with the optional fused tail (RMSNorm, then RoPE; ``tail`` holds its semantics,
  bounds and references);
- ``Compressor``: the whole DeepSeek-V4 compressor (projections, pooling, RMSNorm, RoPE in one fused op) as
  an ``nn.Module``, with ``rope_tables`` for its rotary tables;
- ``compute_cu_seqlens_comp`` / ``validate_pack``: THD helpers;
- ``reference``: the eager references (upstream, fp32, fp64).
"""

from . import reference, tail
from .api import (
    CSACompressorBackward,
    CSACompressorForward,
    TupleDict,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
)
from .autograd import CompressorPool, CompressorPoolFunction, compressor_pool
from .compressor import Compressor, rope_tables
from .dispatch import available_backends
from .thd import compute_cu_seqlens_comp, validate_pack

# The package version, in this one place (pyproject.toml reads it).
__version__ = "0.2.0"

__all__ = [
    "CSACompressorBackward",
    "CSACompressorForward",
    "Compressor",
    "CompressorPool",
    "CompressorPoolFunction",
    "TupleDict",
    "available_backends",
    "compressor_pool",
    "compute_cu_seqlens_comp",
    "csa_compressor_backward_wrapper",
    "csa_compressor_forward_wrapper",
    "reference",
    "rope_tables",
    "tail",
    "validate_pack",
]
