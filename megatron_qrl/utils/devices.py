"""The GPU's compute capability, where a choice depends on it (kernels, attention backends,
formats a GPU generation serves)."""

from __future__ import annotations

__all__ = ["gpu_capability"]


def gpu_capability(index: int | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of CUDA device ``index`` (the current one by default); None without
    CUDA."""
    import torch  # (the flag checks import this module without needing torch first)

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]
