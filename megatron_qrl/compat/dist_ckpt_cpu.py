"""Shim: megatron-core 0.16.1 ``dist_checkpointing.save`` on a machine without CUDA.

Why: ``strategies/filesystem_async.py::FileSystemWriterAsync.preload_tensors`` is always
called with ``non_blocking=True`` and then calls ``torch.cuda.synchronize()``, which raises
"Torch not compiled with CUDA enabled" on a CPU-only torch, so no torch_dist checkpoint can
be saved on CPU. With no CUDA there is nothing to synchronise: inside
:func:`cuda_synchronize_noop` the call does nothing. Scoped (restored on exit) and a no-op
wherever CUDA is available. Versions: megatron-core 0.16.1 with torch 2.13 (CPU build).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def cuda_synchronize_noop() -> Iterator[None]:
    """Within the block, ``torch.cuda.synchronize`` is a no-op if CUDA is unavailable."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original
