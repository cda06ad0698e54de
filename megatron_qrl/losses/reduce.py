"""Masked reductions shared by the losses (pure tensor functions, no Megatron)."""

from __future__ import annotations

import torch
from torch import Tensor

LOG_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_CLAMP, LOG_CLAMP] before ``exp`` (exp(20) ~ 4.9e8), so a
token with log-prob -100 on one side cannot produce inf, and inf * 0 cannot produce NaN
gradients. Only pathological tokens reach the clamp; the clipped surrogate ignores them."""


def safe_exp(log_value: Tensor, clamp: float = LOG_CLAMP) -> Tensor:
    """``exp(clamp(x, -clamp, clamp))``: finite for any finite input."""
    return torch.exp(log_value.clamp(-clamp, clamp))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask``; masked entries never contribute (not even NaN)."""
    zeroed = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over ``mask``; 0 (not NaN) where the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1).to(values.dtype)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` over ``mask``; 0 where the mask is empty. No host sync (no boolean
    indexing, no ``bool()``): the loss runs once per micro batch on the GPU."""
    lowest = torch.finfo(values.dtype).min if values.is_floating_point() \
        else torch.iinfo(values.dtype).min
    top = torch.where(mask, values, torch.full((), lowest, dtype=values.dtype,
                                                device=values.device)).max()
    return torch.where(mask.any(), top, torch.zeros((), dtype=values.dtype,
                                                    device=values.device))


def aggregate_token_loss(per_token: Tensor, mask: Tensor, aggregation: str) -> Tensor:
    """Reduce a per-token loss ``[batch, seq]`` to a scalar (docs/ALGORITHMS.md section 1).

    - ``token_mean`` (DAPO): ``sum_{i,t} m l / sum_{i,t} m``.
    - ``seq_mean_token_mean`` (GRPO): ``mean_i (sum_t m l / sum_t m)`` over rows with at
      least one valid token (fully masked rows are left out, never NaN).
    - ``seq_mean_token_sum_norm`` (Dr.GRPO, Liu et al. 2025; docs/ALGORITHMS.md section 1): ``sum_{i,t} m l / (B * S)``
      with ``B`` rows and ``S`` = the padded length (a constant normaliser, no length bias).
    """
    if aggregation == "token_mean":
        return masked_mean(per_token, mask)
    if aggregation == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
        nonempty = mask.any(dim=-1)
        return masked_mean(per_seq, nonempty)
    if aggregation == "seq_mean_token_sum_norm":
        return masked_sum(per_token, mask) / float(mask.shape[0] * mask.shape[-1])
    raise ValueError(
        f"aggregation={aggregation!r}: expected token_mean, seq_mean_token_mean or "
        "seq_mean_token_sum_norm"
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum softmax(z) z`` of full-vocab logits."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    return log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
