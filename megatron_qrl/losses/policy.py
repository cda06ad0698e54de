"""``compute_policy_loss``: the one entry point of the policy objectives (pure tensors).

Shapes: ``log_probs`` (pi_theta, with grad), ``old_log_probs`` (pi_prox), ``rollout_log_probs``
(pi_behav) and ``loss_mask`` are ``[batch, seq]``; ``advantages`` is ``[batch]`` or
``[batch, seq]``. Only ``log_probs`` carries gradient: every other input is detached here.
Masked positions are zeroed BEFORE any ``exp``, so garbage (or -inf) there cannot leak.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_qrl.losses.config import PolicyLossConfig
from megatron_qrl.losses.reduce import (
    aggregate_token_loss,
    entropy_from_logits,
    masked_max,
    masked_mean,
)
from megatron_qrl.losses.tbpo import band_masks, sequence_log_means, tbpo_loss
from megatron_qrl.losses.token_kinds import TOKEN_KINDS, clipped_surrogate

METRIC_NAMES = (
    "loss",
    "pg_loss",
    "ratio_mean",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "tis_trunc_frac",
    "prox_behav_ratio_max",
    "prox_behav_ratio_mean",
    "kl_behav_prox_k3",
    "logp_abs_diff_mean",
    "tbpo_seq_mask_frac",
    "tbpo_out_band_w_frac",
    "tbpo_out_band_r_frac",
    "num_tokens",
)
"""Metrics emitted for every kind; ``kl_ref_k3`` is added when ``kl_coef > 0`` and
``entropy`` when entropy or logits are given. Token fractions are over valid tokens; the
``tbpo_*`` fractions are over non-empty sequences (computed for every kind, so runs of
different kinds compare on the same axis)."""


def _check_shapes(log_probs: Tensor, others: dict[str, Tensor | None], advantages: Tensor) -> None:
    for name, value in others.items():
        if value is not None and value.shape != log_probs.shape:
            raise ValueError(
                f"compute_policy_loss: {name} has shape {tuple(value.shape)} but log_probs has "
                f"{tuple(log_probs.shape)}; all per-token inputs must be [batch, seq]."
            )
    if log_probs.dim() != 2:
        raise ValueError(
            f"compute_policy_loss: log_probs must be [batch, seq], got {log_probs.dim()}-D"
        )
    if advantages.shape not in (log_probs.shape[:1], log_probs.shape):
        raise ValueError(
            f"compute_policy_loss: advantages has shape {tuple(advantages.shape)}; expected "
            f"[batch]={tuple(log_probs.shape[:1])} or [batch, seq]={tuple(log_probs.shape)}."
        )


def k3_kl(log_p_sample: Tensor, log_q: Tensor) -> Tensor:
    """k3 estimator of KL(p || q) on samples from p (Schulman 2020, docs/ALGORITHMS.md section 1):
    ``rho - log rho - 1`` with ``rho = q/p``; non-negative per token, unbiased in expectation.
    The exponent is clamped at 20 (finite for log-probs down to -100)."""
    log_rho = log_q - log_p_sample
    return torch.exp(log_rho.clamp(max=20.0)) - log_rho - 1.0


def mismatch_metrics(
    lprox: Tensor, lbehav: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> dict[str, Tensor]:
    """Train/rollout mismatch metrics (QuRL section 3.2): truncation fraction, max/mean of
    pi_prox/pi_behav, k3 KL(pi_behav || pi_prox) on the rollout tokens, mean |d|."""
    d = lprox - lbehav
    ratio = torch.exp(d.clamp(max=50.0))
    return {
        "tis_trunc_frac": masked_mean((d > math.log(cfg.tis_cap)).float(), mask),
        "prox_behav_ratio_max": masked_max(ratio, mask),
        "prox_behav_ratio_mean": masked_mean(ratio, mask),
        "kl_behav_prox_k3": masked_mean(k3_kl(lbehav, lprox), mask),
        "logp_abs_diff_mean": masked_mean(d.abs(), mask),
    }


def _tbpo_band_metrics(
    lp: Tensor, lprox: Tensor, lbehav: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> dict[str, Tensor]:
    nonempty = mask.any(dim=-1)
    seq_log_ratio, seq_log_weight = sequence_log_means(lp.detach(), lprox, lbehav, mask)
    bands = band_masks(seq_log_ratio, seq_log_weight, cfg.tis_cap)
    return {
        "tbpo_seq_mask_frac": masked_mean((~bands[cfg.tbpo_mask]).float(), nonempty),
        "tbpo_out_band_w_frac": masked_mean((~bands["band_w"]).float(), nonempty),
        "tbpo_out_band_r_frac": masked_mean((~bands["band_r"]).float(), nonempty),
    }


def _policy_term(
    lp: Tensor, lprox: Tensor, lbehav: Tensor, adv: Tensor, mask: Tensor, cfg: PolicyLossConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy-gradient loss of ``cfg.kind`` and its clip metrics."""
    if cfg.kind == "tbpo":
        loss, ev = tbpo_loss(lp, lprox, lbehav, adv, mask, cfg)
        event_mask = ev["nonempty"]
    else:
        adv_tok = adv.unsqueeze(-1).expand_as(lp) if adv.dim() == 1 else adv
        per_token, ev = clipped_surrogate(
            TOKEN_KINDS[cfg.kind](lp, lprox, lbehav, cfg), adv_tok, cfg
        )
        loss = aggregate_token_loss(per_token, mask, cfg.aggregation)
        event_mask = mask
    metrics = {
        "pg_loss": loss.detach(),
        "ratio_mean": masked_mean(ev["ratio"], event_mask),
        "clip_frac_low": masked_mean(ev["clip_low"].float(), event_mask),
        "clip_frac_high": masked_mean(ev["clip_high"].float(), event_mask),
        "dual_clip_frac": masked_mean(ev["dual_clip"].float(), event_mask),
    }
    return loss, metrics


def compute_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss of ``cfg.kind`` (+ ``kl_coef`` * k3 KL to ``ref_log_probs``) and metrics.

    Token kinds (``ppo_clip``, ``naive_quant``, ``decoupled``, ``tis``, ``acr``): per token
    ``-w * min(R A, clip(R, 1-eps_low, U) A)``, see :mod:`megatron_qrl.losses.token_kinds`
    (QuRL eq. 3/4/5/9), reduced by ``cfg.aggregation``. ``tbpo``: the sequence-level QaRL
    objective, see :mod:`megatron_qrl.losses.tbpo` (its own mean over sequences).
    KL term (docs/ALGORITHMS.md section 1): ``kl_coef * agg(exp(lr - lp) - (lr - lp) - 1)``.

    ``entropy`` ([batch, seq]) or full-vocab ``logits`` ([batch, seq, vocab]) only feed the
    ``entropy`` metric. Returns ``(loss scalar, {name: detached scalar})``; names in
    :data:`METRIC_NAMES`.
    """
    mask = loss_mask.bool()
    _check_shapes(
        log_probs,
        {
            "old_log_probs": old_log_probs,
            "rollout_log_probs": rollout_log_probs,
            "loss_mask": loss_mask,
            "ref_log_probs": ref_log_probs,
            "entropy": entropy,
        },
        advantages,
    )
    zero = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    # Zero masked positions first: nothing below can see -inf / garbage there.
    lp = torch.where(mask, log_probs.float(), zero)
    lprox = torch.where(mask, old_log_probs.detach().float(), zero)
    lbehav = torch.where(mask, rollout_log_probs.detach().float(), zero)
    adv = advantages.detach().float()
    if adv.dim() == 2:
        adv = torch.where(mask, adv, zero)

    loss, metrics = _policy_term(lp, lprox, lbehav, adv, mask, cfg)
    if cfg.kl_coef > 0:
        if ref_log_probs is None:
            raise ValueError(
                f"compute_policy_loss: PolicyLossConfig.kl_coef={cfg.kl_coef} > 0 needs "
                "ref_log_probs= (log-probs of the reference policy); pass them or set kl_coef=0."
            )
        lref = torch.where(mask, ref_log_probs.detach().float(), zero)
        k3 = k3_kl(lp, lref)
        metrics["kl_ref_k3"] = masked_mean(k3.detach(), mask)
        loss = loss + cfg.kl_coef * aggregate_token_loss(k3, mask, cfg.aggregation)
    metrics.update(mismatch_metrics(lprox, lbehav, mask, cfg))
    metrics.update(_tbpo_band_metrics(lp, lprox, lbehav, mask, cfg))
    if entropy is None and logits is not None:
        entropy = entropy_from_logits(logits.detach())
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach().float(), mask)
    metrics["num_tokens"] = mask.sum().float()
    metrics["loss"] = loss.detach()
    # A copy: Megatron's schedule scales the returned loss IN PLACE, and a metric that is the
    # loss itself (or a view of it) would follow. One stacked copy, not one kernel per metric.
    vals = [v.detach().float() for v in metrics.values()]
    if all(v.dim() == 0 for v in vals):
        return loss, dict(zip(metrics, torch.stack(vals).unbind(0)))
    return loss, {k: v.clone() for k, v in zip(metrics, vals)}
