"""Window classes of the pooling, one predicate each, shared by the references and every backend.

A row's window holds ``coff * ratio`` slots. Short windows (at most 8 slots) fit one thread's registers
whole; long windows (more than 16 slots) are where the forward saves softmax statistics for the backward,
because recomputing the row max, sum and output there would cost a second pass over the window.
"""

SHORT_WINDOW_SLOTS = 8
STATS_WINDOW_SLOTS = 16


def window_slots(ratio: int, coff: int) -> int:
    """Slots of one row's window: ``ratio`` own tokens, plus the previous group's with ``coff == 2``."""
    return coff * ratio


def is_short_window(ratio: int, coff: int) -> bool:
    """Whether a row's whole window fits one thread's registers (at most 8 slots)."""
    return window_slots(ratio, coff) <= SHORT_WINDOW_SLOTS


def uses_softmax_stats(ratio: int, coff: int) -> bool:
    """Whether the forward saves softmax statistics for the backward (windows of more than 16 slots)."""
    return window_slots(ratio, coff) > STATS_WINDOW_SLOTS
