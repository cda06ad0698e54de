"""``PolicyLossConfig``: which off-policy objective to train with, and its constants.

Maths: docs/ALGORITHMS.md sections 1 (PPO/GRPO baselines), 2 (QuRL: naive,
decoupled PPO, TIS, ACR) and 5 (QaRL: TBPO). The field docstrings become ``--qrl-*`` help.
"""

from __future__ import annotations

from dataclasses import dataclass

LOSS_KINDS = ("ppo_clip", "naive_quant", "decoupled", "tis", "acr", "tbpo")
TBPO_MASK_RULES = ("none", "band_w", "band_r")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass
class PolicyLossConfig:
    """Policy-gradient objective selection (one flag picks the paper) and its constants."""

    kind: str
    """Objective: ppo_clip (GRPO/DAPO, ratio vs pi_prox), naive_quant (QuRL eq. 3, ratio vs
    pi_behav; known-bad ablation), decoupled (QuRL eq. 4), tis (QuRL eq. 5 / FlashRL),
    acr (QuRL eq. 9), tbpo (QaRL sequence-level trust band)."""

    eps_low: float = 0.2
    """PPO clip: lower bound is 1 - eps_low (token-level kinds)."""

    eps_high: float = 0.2
    """PPO clip: upper bound is 1 + eps_high (0.28 for DAPO clip-higher); ACR divides it by r."""

    dual_clip_c: float | None = None
    """Dual clip for negative advantages (token-level kinds): max(surrogate, c*A) for A<0;
    None disables, 3.0 is the usual value. Must be > 1."""

    tis_cap: float = 2.0
    """C: cap on the importance weight pi_prox/pi_behav for tis/acr (QuRL eq. 5/9); also
    TBPO's C_w (cap and trust band [1/C_w, C_w] of the sequence mismatch weight)."""

    tbpo_eps_low: float = 3e-4
    """TBPO: sequence-ratio clip lower bound 1 - eps for A >= 0."""

    tbpo_eps_high: float = 4e-4
    """TBPO: sequence-ratio clip upper bound 1 + eps for A >= 0."""

    tbpo_neg_eps_low: float = 3e-4
    """TBPO: sequence-ratio clip lower bound 1 - eps for A < 0."""

    tbpo_neg_eps_high: float = 7e-4
    """TBPO: sequence-ratio clip upper bound 1 + eps for A < 0, also the dual-clip bound
    (1 + eps) * A."""

    tbpo_mask: str = "band_w"
    """TBPO trust-band sequence mask (our reading; the paper's rule is not public): none,
    band_w (drop sequences whose unclipped mismatch weight pi_prox/pi_behav, geometric mean
    over tokens, is outside [1/C_w, C_w]) or band_r (same test on the sequence ratio r_i)."""

    aggregation: str = "token_mean"
    """Loss reduction: token_mean (DAPO), seq_mean_token_mean (GRPO) or
    seq_mean_token_sum_norm (Dr.GRPO: token sums over a constant max length)."""

    kl_coef: float = 0.0
    """Coefficient of the k3 KL(pi_theta || pi_ref) penalty; > 0 needs ref_log_probs
    (1e-3 is the usual value when enabled)."""

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"PolicyLossConfig.{field}={getattr(self, field)!r}: {why}")

        if self.kind not in LOSS_KINDS:
            raise bad("kind", f"must be one of {', '.join(LOSS_KINDS)}")
        if self.tbpo_mask not in TBPO_MASK_RULES:
            raise bad("tbpo_mask", f"must be one of {', '.join(TBPO_MASK_RULES)}")
        if self.aggregation not in AGGREGATIONS:
            raise bad("aggregation", f"must be one of {', '.join(AGGREGATIONS)}")
        for name in ("eps_low", "tbpo_eps_low", "tbpo_neg_eps_low"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise bad(name, "must be in [0, 1) so the lower clip bound stays positive")
        for name in ("eps_high", "tbpo_eps_high", "tbpo_neg_eps_high", "kl_coef"):
            if getattr(self, name) < 0.0:
                raise bad(name, "must be >= 0")
        if self.tis_cap <= 1.0:
            raise bad("tis_cap", "must be > 1 (a cap below 1 would down-weight on-policy tokens)")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise bad("dual_clip_c", "must be > 1 or None (disabled)")
