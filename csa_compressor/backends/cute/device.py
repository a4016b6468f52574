"""What the cute kernels need to know about a GPU: its architecture, SM count and shared memory.

At run time the figures come from the device's properties (``device_spec``); offline builds (no GPU, CI and
``benchmarks/cubins.py``) use the architecture's defaults (``offline_spec``), which are those of the parts the
kernels are tuned on: the H200 for sm_90a and the B200 for sm_100a.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Registers per SM on sm_90 and sm_100 (the launch bounds' residency arithmetic).
REGISTERS_PER_SM = 65536
# Threads per SM on sm_90 and sm_100.
THREADS_PER_SM = 2048


@dataclass(frozen=True)
class DeviceSpec:
    """The architecture the kernels compile for and the figures their tiles and grids are sized by."""

    arch: str  # CuTe-DSL's --gpu-arch: "sm_90a", "sm_100a", ...
    sm_count: int
    shared_memory_per_sm: int  # bytes of the unified L1 / shared memory an SM can give to shared memory
    shared_memory_per_block: int  # bytes one CTA may use (opt-in limit)

    def shared_memory_at(self, carveout_percent: int) -> int:
        """Shared memory per SM at a carveout preference: all a CTA may use at 100, a share of the SM below."""
        if carveout_percent >= 100:
            return self.shared_memory_per_block
        return self.shared_memory_per_sm * carveout_percent // 100


_OFFLINE = {
    "sm_90a": DeviceSpec("sm_90a", sm_count=132, shared_memory_per_sm=228 * 1024, shared_memory_per_block=227 * 1024),
    "sm_100a": DeviceSpec("sm_100a", sm_count=148, shared_memory_per_sm=228 * 1024, shared_memory_per_block=227 * 1024),
}


def arch_of(capability: tuple[int, int]) -> str | None:
    """CuTe-DSL's architecture name for a compute capability the kernels support, else None."""
    major, minor = capability
    if major == 9 and minor == 0:
        return "sm_90a"
    if major == 10:
        return f"sm_10{minor}a"
    return None


def offline_spec(arch: str) -> DeviceSpec:
    """The architecture's default figures (builds without a GPU)."""
    base = _OFFLINE.get(arch) or _OFFLINE["sm_100a" if arch.startswith("sm_10") else "sm_90a"]
    return DeviceSpec(arch, base.sm_count, base.shared_memory_per_sm, base.shared_memory_per_block)


_SPECS: dict[int, DeviceSpec] = {}


def device_spec(index: int) -> DeviceSpec:
    """The figures of CUDA device ``index`` (read once per process)."""
    spec = _SPECS.get(index)
    if spec is None:
        props = torch.cuda.get_device_properties(index)
        arch = arch_of((props.major, props.minor))
        if arch is None:
            raise RuntimeError(f"cute backend: unsupported GPU {props.name} (sm_{props.major}{props.minor})")
        base = offline_spec(arch)
        spec = DeviceSpec(
            arch,
            sm_count=props.multi_processor_count,
            shared_memory_per_sm=getattr(props, "shared_memory_per_multiprocessor", base.shared_memory_per_sm),
            shared_memory_per_block=getattr(props, "shared_memory_per_block_optin", base.shared_memory_per_block),
        )
        _SPECS[index] = spec
    return spec
