"""The side stream that runs the boundary op call beside the interior one (CUDA only).

``fork`` makes the side stream wait for the current stream's work so far, ``join`` makes the current stream
wait for the side stream's; both are ``wait_stream`` (an event each), which is also how a side stream joins
a CUDA-graph capture. The caching allocator stays safe without ``record_stream``: a block of the side
stream's pool is reused only by later side work, which starts with a fork and so runs after every use the
current stream queued; a block of the current stream's pool that side work uses belongs to a tensor the
call holds until after the join (the callers' rule), so its reuse is ordered after the join.

On the CPU there is no side stream: every function here is a no-op and the calls run in program order on the
current stream.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["fork", "join", "on", "side_stream"]

_STREAMS: dict[int, torch.cuda.Stream] = {}
# High priority: the boundary call's small kernels take SMs as the interior's blocks retire, not after them.
_PRIORITY = -1


def side_stream(device: torch.device):
    """The side stream of ``device`` (made on first use), or None on the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index, priority=_PRIORITY)
    return stream


def fork(side):
    """The current stream, after making ``side`` wait for its work so far (None without a side stream)."""
    if side is None:
        return None
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    return main


def on(side):
    """A context that makes ``side`` current (nothing without a side stream)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(main, side) -> None:
    """Make ``main`` wait for ``side``'s work so far."""
    if side is not None:
        main.wait_stream(side)
