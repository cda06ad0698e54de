"""The qrl policy losses as slime's custom loss, and the qrl importance weight as its custom TIS.

``--loss-type custom_loss --custom-loss-function-path
megatron_qrl.integrations.slime.loss.qrl_policy_loss``: slime's ``loss_function`` calls
``qrl_policy_loss(args, batch, logits, sum_of_sample_mean)`` per micro-batch. Mapping onto slime's
batch (per-sample lists, CP-local except ``loss_masks``):

- pi_theta: log-probs of ``logits`` by slime's own ``get_log_probs_and_entropy`` (temperature,
  CP layout, rollout top-p replay exactly as slime's PPO loss);
- pi_prox: ``batch["log_probs"]`` (slime's recompute; the current log-probs detached when slime
  skipped it, as its PPO loss does); pi_behav: ``batch["rollout_log_probs"]``;
- token kinds (ppo_clip, naive_quant, decoupled, tis, acr): the per-token loss of
  :mod:`megatron_qrl.losses.token_kinds` reduced by slime's ``sum_of_sample_mean`` — so
  ``--qrl-loss-aggregation token_mean`` is slime's ``--calculate-per-token-loss`` and
  ``seq_mean_token_mean`` its per-sample mean (checked by ``options.slime_problems``);
- tbpo (QaRL, docs/ALGORITHMS.md section 5): each sequence's term from
  :func:`megatron_qrl.losses.tbpo.tbpo_loss` on the whole sequence (CP slices gathered with
  slime's differentiable ``all_gather_with_cp``, as its GSPO does), spread over the sequence's
  tokens so ``sum_of_sample_mean`` adds it once per sequence;
- KL: ``--qrl-loss-kl-coef`` x k3(pi_theta || pi_ref) on ``batch["ref_log_probs"]``; slime's
  ``--entropy-coef`` still subtracts its entropy bonus.

Metrics are per-token tensors reduced by the same ``sum_of_sample_mean`` (slime divides them by
its reporting denominator); ``prox_behav_ratio_max`` is left out (slime sums metrics).

``--custom-tis-function-path megatron_qrl.integrations.slime.loss.qrl_tis_function`` (with
slime's ``--use-tis`` / ``--get-mismatch-metrics``) keeps slime's PPO loss and multiplies it by
the qrl weight w of ``--qrl-loss-kind`` decoupled / tis / acr (QuRL eq. 4 / 5 / 9), plus the
mismatch metrics. ACR's adaptive upper clip needs pi_theta, which slime's TIS hook never sees:
it exists only in the custom loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron_qrl.integrations.slime.options import slime_options
from megatron_qrl.losses import PolicyLossConfig, k3_kl
from megatron_qrl.losses.tbpo import band_masks, sequence_log_means, tbpo_loss
from megatron_qrl.losses.token_kinds import TOKEN_KINDS, clipped_surrogate

Reducer = Callable[[Tensor], Tensor]


def local_loss_masks(batch: dict[str, Any]) -> list[Tensor]:
    """slime's full-response ``loss_masks`` cut to this CP rank's tokens (bool, per sample)."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    return [slice_log_prob_with_cp(m, t, r).bool() for m, t, r in
            zip(batch["loss_masks"], batch["total_lengths"], batch["response_lengths"], strict=True)]


def _rollout_log_probs(batch: dict[str, Any]) -> list[Tensor]:
    rollout = batch.get("rollout_log_probs")
    if not rollout:
        raise KeyError("megatron_qrl's slime loss needs pi_behav: slime's batch has no "
                       "rollout_log_probs (the rollout must return the engine's log-probs)")
    return rollout


def mismatch_token_terms(lprox: Tensor, lbehav: Tensor, cfg: PolicyLossConfig) -> dict[str, Tensor]:
    """Per-token train/rollout mismatch (QuRL section 3.2), the terms whose masked means are
    :func:`megatron_qrl.losses.policy.mismatch_metrics`: d > log C, pi_prox/pi_behav,
    k3 KL(pi_behav || pi_prox), |d|, with d = log pi_prox - log pi_behav."""
    d = lprox - lbehav
    return {
        "tis_trunc_frac": (d > math.log(cfg.tis_cap)).float(),
        "prox_behav_ratio_mean": torch.exp(d.clamp(max=50.0)),
        "kl_behav_prox_k3": k3_kl(lbehav, lprox),
        "logp_abs_diff_mean": d.abs(),
    }


def _full(x: Tensor, total: int, response: int) -> Tensor:
    """A sample's whole-response tensor from this CP rank's slice (identity at CP = 1)."""
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

    return all_gather_with_cp(x, total, response)


def _sequence_terms(lp: Tensor, det: Tensor, mask: Tensor, cfg: PolicyLossConfig,
                    with_loss: bool) -> tuple[Tensor | None, dict[str, Tensor]]:
    """One sequence (whole response, 1-D): its TBPO term and the per-sequence metrics."""
    lp, lprox, lbehav, adv = lp[None], det[None, :, 0], det[None, :, 1], det[None, :, 2]
    m = mask[None]
    seq_log_ratio, seq_log_weight = sequence_log_means(lp.detach(), lprox, lbehav, m)
    bands = band_masks(seq_log_ratio, seq_log_weight, cfg.tis_cap)
    metrics = {
        "tbpo_seq_mask_frac": (~bands[cfg.tbpo_mask]).float()[0],
        "tbpo_out_band_w_frac": (~bands["band_w"]).float()[0],
        "tbpo_out_band_r_frac": (~bands["band_r"]).float()[0],
    }
    if not with_loss:
        return None, metrics
    loss, ev = tbpo_loss(lp, lprox, lbehav, adv, m, cfg)
    metrics.update(ratio_mean=ev["ratio"][0], clip_frac_low=ev["clip_low"].float()[0],
                   clip_frac_high=ev["clip_high"].float()[0],
                   dual_clip_frac=ev["dual_clip"].float()[0])
    return loss, metrics


def _per_sequence(t: dict[str, Tensor], batch: dict[str, Any], cfg: PolicyLossConfig,
                  with_loss: bool) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Sequence-level terms spread over each sample's local tokens (``[local tokens]`` each)."""
    lengths = [int(m.numel()) for m in t["local_masks"]]
    cols = [t["lprox"], t["lbehav"], t["adv"]] + ([] if with_loss else [t["lp"].detach()])
    det = torch.stack(cols, dim=-1)  # one gather per sample for every detached input
    losses, metrics = [], {}
    for lp_i, det_i, n_i, full_mask, total, resp in zip(
            t["lp"].split(lengths), det.split(lengths), lengths, batch["loss_masks"],
            batch["total_lengths"], batch["response_lengths"], strict=True):
        det_full = _full(det_i, total, resp)
        lp_full = _full(lp_i, total, resp) if with_loss else det_full[:, 3]
        loss_i, m_i = _sequence_terms(lp_full, det_full, full_mask.bool(), cfg, with_loss)
        if with_loss:
            losses.append(loss_i.expand(n_i))
        for k, v in m_i.items():
            metrics.setdefault(k, []).append(v.detach().expand(n_i))
    cat = {k: torch.cat(v) for k, v in metrics.items()}
    return (torch.cat(losses) if with_loss else None), cat


def _token_kind(t: dict[str, Tensor], cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss ``-w min(R A, clip(R) A)`` of a token kind and its per-token events."""
    terms = TOKEN_KINDS[cfg.kind](t["lp"], t["lprox"], t["lbehav"], cfg)
    per_token, ev = clipped_surrogate(terms, t["adv"], cfg)
    return per_token, {"ratio_mean": ev["ratio"], "clip_frac_low": ev["clip_low"].float(),
                       "clip_frac_high": ev["clip_high"].float(),
                       "dual_clip_frac": ev["dual_clip"].float()}


def _inputs(args: Any, batch: dict[str, Any], logits: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """Concatenated CP-local tensors, zeroed where the mask is off (before any exp)."""
    from slime.backends.megatron_utils.loss import (
        get_log_probs_and_entropy,
        get_rollout_top_p_logprob_kwargs,
    )

    _, out = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
        with_entropy=True, **get_rollout_top_p_logprob_kwargs(args, batch))
    lp_list = out["log_probs"]
    prox_list = batch.get("log_probs") or [x.detach() for x in lp_list]
    local_masks = local_loss_masks(batch)
    mask = torch.cat(local_masks)
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    t = {
        "lp": torch.cat(lp_list).float(),
        "lprox": torch.cat(prox_list).detach().float(),
        "lbehav": torch.cat(_rollout_log_probs(batch)).detach().float(),
        "adv": torch.cat(batch["advantages"]).detach().float(),
    }
    t = {k: torch.where(mask, v, zero) for k, v in t.items()}
    t["mask"], t["local_masks"] = mask, local_masks
    return t, torch.cat(out["entropy"])


def qrl_policy_loss(args: Any, batch: dict[str, Any], logits: Tensor,
                    sum_of_sample_mean: Reducer) -> tuple[Tensor, dict[str, Tensor]]:
    """slime custom loss: ``--qrl-loss-kind`` on slime's batch (see the module docstring)."""
    cfg = slime_options(args).loss
    t, entropy = _inputs(args, batch, logits)
    seq_loss, token_metrics = _per_sequence(t, batch, cfg, with_loss=cfg.kind == "tbpo")
    if cfg.kind == "tbpo":
        per_token = seq_loss
    else:
        per_token, events = _token_kind(t, cfg)
        token_metrics.update(events)
    pg_loss = sum_of_sample_mean(per_token)
    loss = pg_loss
    metrics: dict[str, Tensor] = {"pg_loss": pg_loss}
    if cfg.kl_coef > 0:
        ref = batch.get("ref_log_probs")
        if not ref:
            raise KeyError(f"--qrl-loss-kl-coef {cfg.kl_coef} needs ref_log_probs in slime's "
                           "batch: add --ref-load (slime's reference model)")
        lref = torch.where(t["mask"], torch.cat(ref).detach().float(), 0.0)
        k3 = k3_kl(t["lp"], lref)
        metrics["kl_ref_k3"] = sum_of_sample_mean(k3.detach())
        loss = loss + cfg.kl_coef * sum_of_sample_mean(k3)
    entropy_loss = sum_of_sample_mean(entropy)
    metrics["entropy"] = entropy_loss
    if getattr(args, "entropy_coef", 0.0):
        loss = loss - args.entropy_coef * entropy_loss
    if t["lp"].numel() == 0:  # keep the graph connected, as slime's own losses do
        loss = loss + 0 * logits.sum()
    token_metrics.update(mismatch_token_terms(t["lprox"], t["lbehav"], cfg))
    metrics.update({k: sum_of_sample_mean(v.detach()) for k, v in token_metrics.items()})
    metrics["loss"] = loss
    return loss, {k: v.detach().float().clone() for k, v in metrics.items()}


def qrl_tis_function(args: Any, *, pg_loss: Tensor, train_log_probs: list[Tensor],
                     rollout_log_probs: list[Tensor], loss_masks: list[Tensor],
                     total_lengths: list[int], response_lengths: list[int], **_: Any
                     ) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
    """slime custom TIS: ``pg_loss * w`` with w of ``--qrl-loss-kind`` decoupled / tis / acr.

    w = pi_prox / pi_behav (decoupled, QuRL eq. 4, exp clamped at +-20) or min(that, C)
    (tis / acr, QuRL eq. 5 / 9, C = ``--qrl-loss-tis-cap``); masked tokens get d = 0. Returns
    slime's ``(pg_loss, loss_masks, per-token metrics)``; no token is rejected.
    """
    cfg = slime_options(args).loss
    mask = torch.cat(local_loss_masks({"loss_masks": loss_masks, "total_lengths": total_lengths,
                                       "response_lengths": response_lengths}))
    lprox = torch.where(mask, torch.cat(train_log_probs).detach().float(), 0.0)
    lbehav = torch.where(mask, torch.cat(rollout_log_probs).detach().float(), 0.0)
    weight = TOKEN_KINDS[cfg.kind](lprox, lprox, lbehav, cfg).weight
    metrics = {"tis": torch.exp((lprox - lbehav).clamp(max=50.0)), "tis_weight": weight,
               **mismatch_token_terms(lprox, lbehav, cfg)}
    return pg_loss * weight, loss_masks, {k: v.detach().clone() for k, v in metrics.items()}
