"""The one check that a tensor holds no NaN / Inf, with an error naming the tensor.

Used by the quantizers (a non-finite weight would poison a whole scale block) and by the
HF <-> Megatron conversions (which would otherwise carry a broken weight through silently).
"""

from __future__ import annotations

__all__ = ["NonFiniteError", "require_finite"]


class NonFiniteError(ValueError):
    """A tensor holds NaN or Inf values."""


def require_finite(tensor, what: str, fix: str) -> None:
    """Raise :class:`NonFiniteError` ``"{what} has N non-finite values (NaN/Inf); {fix}"``
    when ``tensor`` (a torch tensor) holds any NaN or Inf."""
    import torch

    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise NonFiniteError(f"{what} has {bad} non-finite values (NaN/Inf); {fix}")
