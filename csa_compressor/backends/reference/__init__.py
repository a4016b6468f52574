"""The eager PyTorch backend: ``csa_compressor.reference`` at fp32 precision, on any device."""
