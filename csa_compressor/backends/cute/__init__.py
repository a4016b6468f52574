"""CuTe-DSL backend (nvidia-cutlass-dsl): fused forward/backward kernels for sm_90 (validated on H200) and sm_100
(dispatched, not validated here). The protocol functions live in ``launch``."""
