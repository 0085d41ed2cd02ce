"""The engine's Triton kernels, loaded where they can run: on CUDA, where Triton is
installed (CUDA builds of torch bring it) and builds them on the device; and anywhere
Triton interprets its kernels instead (``TRITON_INTERPRET=1``, which runs them on the
CPU: the tests step whole batches through them so). Each kernel module has a
``probe(device)`` that builds and runs its kernels once; where that raises (Triton
compiles a launcher with the system's C compiler, which a slim image may lack) the
torch path serves, after one warning."""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch


@functools.cache
def load(name: str, device: torch.device) -> ModuleType | None:
    """Kernel module ``name`` of this package (``decode_kernel``, ``evict_kernel``) for
    ``device``, or None where its kernels cannot run there."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None
    try:
        module.probe(device)
    except Exception as err:  # whatever Triton raises where it cannot build or launch
        warnings.warn(f"the {name.replace('_', ' ')} cannot run on {device} ({type(err).__name__}: {err}); "
                      "torch's operations serve instead", RuntimeWarning, stacklevel=2)
        return None
    return module
