"""Handing freed memory back to the system.

glibc keeps the pages of freed tensors in its heap for the next allocation: freed
buffers of a few megabytes (a conversation's cache) do not go back to the system, so a
process's resident memory only grows as caches are replaced or dropped.
"""

from __future__ import annotations

import ctypes

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only


def return_freed_memory() -> None:
    """Hand freed heap pages back to the system (measured for sessions coming and going:
    tools/measure_sessions_memory.py; for caches joining a ``RowPool``: docs/benchmarks.md)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
