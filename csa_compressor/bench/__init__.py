"""The bench of the compressor pooling: ``python -m csa_compressor bench``, or ``run_bench(...)`` from Python.

It runs the DeepSeek-V4 case matrix (``CASES``, with and without the RMSNorm + RoPE tail) for every available
kernel backend and for PyTorch baselines (the eager region and its torch.compile; for tail cases also our pooling
followed by PyTorch's tail), and reports kernel time (cold and warm), wall and host time per call against the DRAM
floor, beside cudnn-frontend's published figures. Modules:

- ``cases``: the matrix, the quoted figures, the command line's selections, the floor;
- ``timer``: the one timer (also used by every script in ``benchmarks/``);
- ``calls``: the callables each row times;
- ``run``: the two passes and the output files; ``report`` and ``chart``: the markdown and the PNG;
- ``env``: the sources' digest, the commit and the versions a run records; ``cli``: the command line.
"""

from .calls import TAIL_ARGS, TailCase, fused_tail_missing, make_tail, torch_tail
from .cases import (
    BASELINES,
    CASES,
    CUDNN_FRONTEND_H200,
    DIRECTIONS,
    KERNEL_BACKENDS,
    TORCH_TAIL,
    Case,
    floor_bytes,
    floor_us,
    measured_direction,
    parse_case,
    resolve_backends,
    select_backends,
    select_cases,
    select_directions,
)
from .chart import draw_chart
from .cli import main
from .env import git_commit, source_digest, versions
from .report import RECORD_FIELDS, compact_records, expand_records, format_markdown, make_record
from .run import FULL_REPS, QUICK_REPS, BenchResult, Method, NoGPUError, default_name, run_bench, write_outputs
from .timer import (
    DeviceActivity,
    KernelTime,
    Timer,
    busy_us,
    copy_rate,
    device_idle,
    kernel_us_per_call,
    range_device_us,
)

__all__ = [
    "BASELINES",
    "CASES",
    "CUDNN_FRONTEND_H200",
    "DIRECTIONS",
    "FULL_REPS",
    "KERNEL_BACKENDS",
    "QUICK_REPS",
    "RECORD_FIELDS",
    "TAIL_ARGS",
    "TORCH_TAIL",
    "BenchResult",
    "Case",
    "DeviceActivity",
    "KernelTime",
    "Method",
    "NoGPUError",
    "TailCase",
    "Timer",
    "busy_us",
    "compact_records",
    "copy_rate",
    "default_name",
    "device_idle",
    "draw_chart",
    "expand_records",
    "floor_bytes",
    "floor_us",
    "format_markdown",
    "fused_tail_missing",
    "git_commit",
    "kernel_us_per_call",
    "main",
    "make_record",
    "make_tail",
    "measured_direction",
    "parse_case",
    "range_device_us",
    "resolve_backends",
    "run_bench",
    "select_backends",
    "select_cases",
    "select_directions",
    "source_digest",
    "torch_tail",
    "versions",
    "write_outputs",
]
