"""Group-relative advantages: GRPO and Dr.GRPO (docs/ALGORITHMS.md section 1).

Responses are grouped by an index tensor (``group_index[i]`` = the prompt of response i;
any integer ids, groups need not be contiguous or equal-sized).

- GRPO (Shao et al. 2024, DeepSeekMath section 4.1.2, outcome supervision):
  ``A_i = (r_i - mean_g r) / (std_g r + eps)``.
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean_g r``.

A group whose rewards are all equal (including a group of one) gets exactly zero advantage,
never NaN: it carries no learning signal.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-response (mean, unbiased std, is_constant, group size) of its group."""
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"group advantages: rewards {tuple(rewards.shape)} and group_index "
            f"{tuple(group_index.shape)} must both be 1-D of the same length"
        )
    if group_index.dtype.is_floating_point:
        raise ValueError("group advantages: group_index must be an integer tensor of group ids")
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    total = torch.zeros_like(count).index_add_(0, inverse, r)
    mean = (total / count)[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, (r - mean) ** 2)
    std = (sq / (count - 1).clamp_min(1)).sqrt()[inverse]
    hi = torch.full_like(count, -torch.inf).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full_like(count, torch.inf).scatter_reduce(0, inverse, r, "amin")
    constant = (hi == lo)[inverse]
    return mean, std, constant, count[inverse]


def group_advantages(
    rewards: Tensor,
    group_index: Tensor,
    mode: str = "grpo",
    eps: float = 1e-6,
) -> Tensor:
    """Advantages ``[N]`` for ``rewards [N]`` grouped by ``group_index [N]``.

    ``mode``: ``"grpo"`` (divide by the unbiased group std + eps) or ``"dr_grpo"`` (no std).
    Returned in ``rewards.dtype`` (float32 if rewards are integer).
    """
    if mode not in ("grpo", "dr_grpo"):
        raise ValueError(f"group_advantages: mode={mode!r}; expected 'grpo' or 'dr_grpo'")
    mean, std, constant, _ = _group_stats(rewards, group_index)
    centred = rewards.double() - mean
    adv = centred / (std + eps) if mode == "grpo" else centred
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    return adv.to(out_dtype)


def grpo_advantages(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(r - mean_g) / (std_g + eps)``; see :func:`group_advantages`."""
    return group_advantages(rewards, group_index, "grpo", eps)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr.GRPO: ``r - mean_g``; see :func:`group_advantages`."""
    return group_advantages(rewards, group_index, "dr_grpo")


def tokens_from_sequence(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages ``[B]`` to ``[B, S]``, zero where masked."""
    return advantages.unsqueeze(-1) * loss_mask.to(advantages.dtype)
