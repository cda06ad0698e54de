"""Policy losses for quantized-rollout RL: pure tensor functions + one Megatron adapter.

Kinds (``PolicyLossConfig.kind``): ppo_clip, naive_quant, decoupled, tis, acr, tbpo.
Maths: docs/ALGORITHMS.md sections 1, 2, 5. The Megatron adapter lives in
:mod:`megatron_qrl.losses.megatron_adapter` (imported lazily; it needs megatron-core).
"""

from megatron_qrl.losses.advantages import (
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    tokens_from_sequence,
)
from megatron_qrl.losses.config import AGGREGATIONS, LOSS_KINDS, TBPO_MASK_RULES, PolicyLossConfig
from megatron_qrl.losses.error_tokens import (
    ErrorTokenConfig,
    detect_error_tokens,
    filter_error_tokens,
    improbable_token_mask,
    repetition_mask,
)
from megatron_qrl.losses.policy import METRIC_NAMES, compute_policy_loss, k3_kl
from megatron_qrl.losses.reduce import aggregate_token_loss, entropy_from_logits

__all__ = [
    "AGGREGATIONS",
    "LOSS_KINDS",
    "METRIC_NAMES",
    "TBPO_MASK_RULES",
    "ErrorTokenConfig",
    "PolicyLossConfig",
    "aggregate_token_loss",
    "compute_policy_loss",
    "detect_error_tokens",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "filter_error_tokens",
    "group_advantages",
    "grpo_advantages",
    "improbable_token_mask",
    "k3_kl",
    "repetition_mask",
    "tokens_from_sequence",
]
