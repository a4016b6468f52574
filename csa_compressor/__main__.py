"""The command line: ``python -m csa_compressor`` checks the installed backends on this machine,
``python -m csa_compressor bench`` times them on a GPU.

Both commands share the helpers below: a user error (an unknown name, a device this machine lacks, a bad number)
ends in one line on stderr and exit status 2, never in a traceback.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["CommandParser", "UsageError", "main", "parse_device", "positive_float", "positive_int"]


class UsageError(Exception):
    """A user error on the command line: reported as one line, exit status 2."""


class CommandParser(argparse.ArgumentParser):
    """``argparse`` with its errors as one line (the usage block is what ``--help`` is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def fail(self, exc: BaseException) -> int:
        print(f"{self.prog}: error: {exc}", file=sys.stderr)
        return 2


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parse_device(text: str):
    """``cpu``, ``cuda`` or ``cuda:N`` as a ``torch.device`` this machine has; UsageError otherwise."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {text!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UsageError(f"device {text!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        raise UsageError(f"device {text!r}: CUDA is not available on this machine")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise UsageError(f"device {text!r}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return device


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from csa_compressor.bench.cli import main as bench_main

        return bench_main(argv[1:])
    from csa_compressor.selfcheck import main as selfcheck_main

    return selfcheck_main(argv)


if __name__ == "__main__":
    sys.exit(main())
