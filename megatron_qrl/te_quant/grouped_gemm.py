"""Straight-through gradient of a stacked quantized expert weight into per-expert masters.

The grouped GEMM itself is :mod:`megatron_qrl.models.grouped_gemm` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_qrl.models.grouped_gemm import grouped_mm, padded_grouped_mm, torch_grouped_mm

__all__ = ["grouped_mm", "padded_grouped_mm", "stacked_ste", "torch_grouped_mm"]


class _StackSTE(torch.autograd.Function):
    """Forward: the cached stacked ``Q_w(W)`` ``[E, out, in]``; backward: expert ``e``'s slice of
    the gradient straight into master ``W_e`` (Bengio et al. 2013, STE)."""

    @staticmethod
    def forward(ctx, quantized, *weights):  # noqa: D401
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad):
        return (None, *grad.unbind(0))


def stacked_ste(quantized: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``quantized`` (stacked ``Q_w`` of ``weights``) with the straight-through gradient into
    each of ``weights`` (no copy of the masters in the forward)."""
    if quantized.shape[0] != len(weights):
        raise ValueError(f"stacked_ste: {quantized.shape[0]} quantized experts for "
                         f"{len(weights)} weights")
    return _StackSTE.apply(quantized, *weights)
