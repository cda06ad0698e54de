"""QaRL error tokens in a slime run: ``--rollout-data-postprocess-path
megatron_qrl.integrations.slime.postprocess.qrl_rollout_data_postprocess``.

slime calls ``(args, rollout_id, rollout_data)`` on every trainer rank after the log-prob
recompute and the advantages, before training. Per sample, the response tokens, pi_prox
(``log_probs``), pi_behav (``rollout_log_probs``; both gathered over CP with slime's
``all_gather_with_cp``) and the loss mask go through
:func:`megatron_qrl.losses.filter_error_tokens` (``--qrl-error-tokens-*``); the new mask replaces
``loss_masks[i]`` (same dtype / device), so every loss — ours or slime's — skips the flagged
tokens. The reducer's denominators stay slime's precomputed ``rollout_mask_sums`` (as for
slime's own rejection sampling in TIS), so a dropped token lowers its sample's mean rather than
re-weighting the rest. Per-sample rates are added as ``qrl_error_*`` lists, which slime's
``log_rollout_data`` reports (as sample means) under ``rollout/``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_qrl.integrations.slime.options import slime_options
from megatron_qrl.losses import filter_error_tokens

RATE_KEYS = {
    "error_token_rate": "qrl_error_token_rate",
    "error_repetition_rate": "qrl_error_repetition_rate",
    "error_improbable_rate": "qrl_error_improbable_rate",
    "error_seq_rate": "qrl_error_seq_rate",
    "error_dropped_token_frac": "qrl_error_dropped_token_frac",
}


def _full(x: torch.Tensor, total: int, response: int) -> torch.Tensor:
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

    return all_gather_with_cp(x.detach().float(), total, response)


def qrl_rollout_data_postprocess(args: Any, rollout_id: int, rollout_data: dict[str, Any]) -> None:
    """Fold the error-token mask into ``rollout_data["loss_masks"]`` in place; add the rates."""
    from megatron.core import mpu

    cfg = slime_options(args).error_tokens
    if not mpu.is_pipeline_last_stage() or not rollout_data.get("loss_masks"):
        return  # the loss (and slime's log-probs) live on the last pipeline stage only
    missing = [k for k in ("log_probs", "rollout_log_probs") if not rollout_data.get(k)]
    if missing:
        raise KeyError(f"--qrl-error-tokens-action {cfg.action}: slime's rollout data lacks "
                       f"{missing} (pi_prox is slime's recompute, so drop --use-rollout-logprobs; "
                       "pi_behav is the rollout engine's log-probs)")
    rates: dict[str, list[float]] = {k: [] for k in RATE_KEYS.values()}
    masks = rollout_data["loss_masks"]
    for i, (tokens, total, resp) in enumerate(zip(
            rollout_data["tokens"], rollout_data["total_lengths"], rollout_data["response_lengths"],
            strict=True)):
        lprox = _full(rollout_data["log_probs"][i], total, resp)
        lbehav = _full(rollout_data["rollout_log_probs"][i], total, resp)
        response_ids = torch.as_tensor(tokens)[total - resp:total].to(lprox.device)
        new_mask, metrics = filter_error_tokens(response_ids[None], lprox[None], lbehav[None],
                                                masks[i].to(lprox.device)[None].bool(), cfg)
        masks[i] = new_mask[0].to(device=masks[i].device, dtype=masks[i].dtype)
        for name, key in RATE_KEYS.items():
            rates[key].append(float(metrics[name]))
    rollout_data.update(rates)
