"""The side stream that runs the boundary op call beside the interior one (CUDA only).

``fork`` makes the side stream wait for the current stream's work so far, ``join`` makes the current stream
wait for the side stream's; each records an event on one stream and makes the other wait for it, which is also
how a side stream joins a CUDA-graph capture. The events are made once per thread and device and recorded
again on every call: a wait takes the event's state when it is queued, and a thread queues each wait right
after its record. ``on_side`` runs a function with the side stream current (set through torch's C function,
a cheaper switch than ``torch.cuda.stream``'s context, where the current device is the stream's).

The caching allocator stays safe without ``record_stream``: a block of the side stream's pool is reused only by
later side work, which starts with a fork and so runs after every use the current stream queued; a block of
the current stream's pool that side work uses belongs to a tensor the call holds until after the join (the
callers' rule), so its reuse is ordered after the join.

On the CPU there is no side stream: ``fork`` returns None, ``on_side`` calls the function and ``join`` does
nothing, so the calls run in program order on the current stream.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["fork", "join", "on_side", "side_stream"]

_STREAMS: dict[int, torch.cuda.Stream] = {}
# High priority: the boundary call's small kernels take SMs as the interior's blocks retire, not after them.
_PRIORITY = -1
_LOCAL = threading.local()  # .events: device index -> (fork event, join event) of this thread
_MAIN: dict[tuple, torch.cuda.Stream] = {}  # (stream id, device index, device type) -> its Stream object
# torch's C functions behind torch.cuda.current_stream / set_stream / current_device (the public ones where a
# release lacks them: tests/test_distributed.py says when).
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def side_stream(device: torch.device):
    """The side stream of ``device`` (made on first use), or None on the CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index, priority=_PRIORITY)
    return stream


def _events(index: int) -> tuple:
    table = getattr(_LOCAL, "events", None)
    if table is None:
        table = _LOCAL.events = {}
    pair = table.get(index)
    if pair is None:
        pair = table[index] = (torch.cuda.Event(), torch.cuda.Event())
    return pair


def _current_stream(index: int):
    """The current stream of device ``index`` through torch's C functions (``torch.cuda.current_stream`` and
    ``set_stream`` are several Python calls each, as much host time as the rest of a fork); its Stream object
    made once per stream."""
    if _GET_STREAM is None:
        return torch.cuda.current_stream(index)
    key = _GET_STREAM(index)
    stream = _MAIN.get(key)
    if stream is None:
        stream = _MAIN[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def fork(device: torch.device):
    """``(current stream, side stream, join event)`` of ``device`` after making the side stream wait for the
    current stream's work so far; None without a side stream (the CPU)."""
    side = side_stream(device)
    if side is None:
        return None
    main = _current_stream(side.device_index)
    forked, joined = _events(side.device_index)
    forked.record(main)
    forked.wait(side)
    return main, side, joined


def on_side(forked, fn, *args):
    """``fn(*args)`` with the side stream of ``forked`` current (in place without one)."""
    if forked is None:
        return fn(*args)
    main, side = forked[0], forked[1]
    if _SET_STREAM is None or _GET_DEVICE() != side.device_index:  # setting it would also switch the device
        with torch.cuda.stream(side):
            return fn(*args)
    _SET_STREAM(side.stream_id, side.device_index, side.device_type)
    try:
        return fn(*args)
    finally:
        _SET_STREAM(main.stream_id, main.device_index, main.device_type)


def join(forked) -> None:
    """Make the current stream of ``forked`` wait for its side stream's work so far."""
    if forked is not None:
        main, side, joined = forked
        joined.record(side)
        joined.wait(main)
