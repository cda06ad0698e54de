"""TBPO — Trust-Band Policy Optimization (QaRL, docs/ALGORITHMS.md section 5).

Sequence-level objective with dual clipping for negative samples. Per sequence i with
valid-token mask m_{i,t} (n_i = sum_t m_{i,t}):

    r_i  = exp( mean_t (lp - lprox) )                         sequence ratio (geometric mean)
    w~_i = exp( mean_t (lprox - lbehav) ),  w_i = min(w~_i, C_w)    mismatch weight (no grad)
    A_i >= 0:  L_i = min(r_i A_i, clip(r_i, 1-eps_l, 1+eps_h) A_i)
    A_i <  0:  L_i = max(min(r_i A_i, clip(r_i, 1-eps_l_neg, 1+eps_h_neg) A_i), (1+eps_h_neg) A_i)
    J = mean_i (b_i w_i L_i),   loss = -J,   mean over sequences with n_i > 0

b_i is the trust-band mask (our reading; the paper's exact rule is not public), chosen by
``PolicyLossConfig.tbpo_mask``: ``none`` (b = 1), ``band_w`` (b = 0 when the UNCLIPPED w~_i
is outside [1/C_w, C_w]) or ``band_r`` (b = 0 when r_i is outside [1/C_w, C_w]).
C_w is ``PolicyLossConfig.tis_cap``. The band tests compare logs with +-log C_w (exact, no
overflow). Token-level advantages [batch, seq] are reduced to A_i by their masked mean.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_qrl.losses.config import PolicyLossConfig
from megatron_qrl.losses.reduce import LOG_CLAMP, masked_mean, safe_exp


def sequence_log_means(
    lp: Tensor, lprox: Tensor, lbehav: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """``(mean_t(lp - lprox), mean_t(lprox - lbehav))`` per row over the mask; 0 for empty rows."""
    return masked_mean(lp - lprox, mask, dim=-1), masked_mean(lprox - lbehav, mask, dim=-1)


def band_masks(seq_log_ratio: Tensor, seq_log_weight: Tensor, cap: float) -> dict[str, Tensor]:
    """Keep-masks (True = inside the trust band [1/cap, cap]) for each TBPO mask rule."""
    log_cap = math.log(cap)
    return {
        "none": torch.ones_like(seq_log_ratio, dtype=torch.bool),
        "band_w": seq_log_weight.detach().abs() <= log_cap,
        "band_r": seq_log_ratio.detach().abs() <= log_cap,
    }


def tbpo_loss(
    lp: Tensor,
    lprox: Tensor,
    lbehav: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TBPO loss (scalar) and its sequence-level event masks; see the module docstring."""
    nonempty = mask.any(dim=-1)
    if advantages.dim() == 2:
        adv = masked_mean(advantages, mask, dim=-1)
    else:
        adv = advantages
    seq_log_ratio, seq_log_weight = sequence_log_means(lp, lprox, lbehav, mask)
    ratio = safe_exp(seq_log_ratio)
    weight = torch.exp(seq_log_weight.clamp(-LOG_CLAMP, math.log(cfg.tis_cap)))

    pos_lo, pos_hi = 1.0 - cfg.tbpo_eps_low, 1.0 + cfg.tbpo_eps_high
    neg_lo, neg_hi = 1.0 - cfg.tbpo_neg_eps_low, 1.0 + cfg.tbpo_neg_eps_high
    pos = torch.minimum(ratio * adv, ratio.clamp(pos_lo, pos_hi) * adv)
    neg = torch.maximum(torch.minimum(ratio * adv, ratio.clamp(neg_lo, neg_hi) * adv), neg_hi * adv)
    surrogate = torch.where(adv >= 0, pos, neg)

    bands = band_masks(seq_log_ratio, seq_log_weight, cfg.tis_cap)
    keep = bands[cfg.tbpo_mask]
    per_seq = -(keep.to(surrogate.dtype) * weight * surrogate)
    loss = masked_mean(per_seq, nonempty)
    events = {
        "ratio": ratio.detach(),
        "clip_low": (adv < 0) & (ratio < neg_lo),
        "clip_high": (adv > 0) & (ratio > pos_hi),
        "dual_clip": (adv < 0) & (ratio > neg_hi),
        "nonempty": nonempty,
        "keep": keep,
    }
    return loss, events
