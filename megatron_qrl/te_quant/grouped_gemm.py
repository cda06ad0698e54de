"""Straight-through gradient of a stacked quantized expert weight into per-expert masters.

The grouped GEMM itself is :mod:`megatron_qrl.models.grouped_gemm` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_qrl.models.grouped_gemm import grouped_mm, padded_grouped_mm, torch_grouped_mm

__all__ = ["grouped_mm", "grouped_mm_grads", "padded_grouped_mm", "stacked_ste",
           "torch_grouped_mm"]


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


def _like(t: torch.Tensor | None, shape: tuple[int, ...], ref: torch.Tensor) -> torch.Tensor:
    """``t``, or a tensor of ``shape`` with ``ref``'s dtype and device and no storage (only
    looked at by the grouped GEMM's dispatch)."""
    if t is not None:
        return t
    return torch.empty_strided(shape, (0,) * len(shape), dtype=ref.dtype, device=ref.device)


def grouped_mm_grads(x: torch.Tensor | None, w: torch.Tensor | None, grad: torch.Tensor,
                     counts: Sequence[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dW)`` of ``y = grouped_mm(x, w, counts)`` for the output gradient ``grad``, without
    running the forward GEMM: the two GEMMs autograd runs for :func:`grouped_mm`, with the same
    operands in the same layouts, so the results are its gradients bit for bit. ``x`` None:
    no ``dW``; ``w`` None: no ``dx`` (the other operand is not needed for it).

    ``dx_e = g_e @ W_e`` and ``dW_e = g_e^T @ x_e`` (the expert layer's gradient, Shazeer et al.
    2017): ``torch._grouped_mm`` as torch's derivative formulas call it (``_grouped_mm_mat1/2
    _backward``; ``mat2`` = ``w^T`` is column-major, so ``dW = _grouped_mm(g^T, x)``), else the
    padded batched GEMM's ``bmm`` backward (``g_pad @ W``, ``x_pad^T @ g_pad``)."""
    from megatron_qrl.models.grouped_gemm import _use_torch_grouped, group_offsets, padded_index

    counts = [int(c) for c in counts]
    grad = grad.contiguous()
    m, n = grad.shape
    k = (x if x is not None else w).shape[-1]
    if _use_torch_grouped(_like(x, (m, k), grad), _like(w, (len(counts), n, k), grad)):
        offs = group_offsets(counts, grad.device)
        dx = torch._grouped_mm(grad, w.contiguous(), offs=offs) if w is not None else None
        dw = torch._grouped_mm(grad.t(), x.contiguous(), offs=offs) if x is not None else None
        return dx, dw
    n_exp, rows = len(counts), max(counts, default=0)
    expert, pos = padded_index(counts, m, grad.device)
    gpad = grad.new_zeros(n_exp, rows, n).index_put((expert, pos), grad)
    dx = torch.bmm(gpad, w)[expert, pos] if w is not None else None
    dw = None
    if x is not None:
        xpad = x.new_zeros(n_exp, rows, k).index_put((expert, pos), x)
        dw = torch.bmm(xpad.transpose(1, 2), gpad).transpose(1, 2)
    return dx, dw
