"""Handing freed memory back to the system.

glibc keeps the pages of freed tensors in its heap for the next allocation: freed
buffers of a few megabytes (a conversation's cache) do not go back to the system, so a
process's resident memory only grows as caches are replaced or dropped.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable

import torch

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only

# Freed bytes handed back once this many are pending (``freed``): a trim walks the whole
# heap (0.3-0.6 ms with 512 pooled rows of a tiny model), so trimming at every cache that
# joins a pool or fits its buffers cost a step with rows coming and going more than the
# step itself; resident memory stays within this much of its floor.
TRIM_AFTER_BYTES = 64 * 2**20

_pending = 0
_pending_guard = threading.Lock()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the elements of ``tensors`` take (of a view: what it shows)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the system (measured for sessions coming and going:
    tools/measure_sessions_memory.py; for caches joining a ``RowPool``: docs/benchmarks.md)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def freed(nbytes: int) -> None:
    """``nbytes`` of buffers were just freed: handed back with others once
    ``TRIM_AFTER_BYTES`` are pending."""
    global _pending
    with _pending_guard:
        _pending += nbytes
        due = _pending >= TRIM_AFTER_BYTES
        if due:
            _pending = 0
    if due:
        return_freed_memory()
