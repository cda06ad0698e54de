"""MoE support: routing replay (the trainer uses the rollout's top-k experts) and its metrics."""

from megatron_qrl.moe.replay import (
    ReplayTopKRouter,
    RoutingReplay,
    check_replay_config,
    recorded_ids,
    replay_spec_hook,
    routing_agreement,
    tokens_from_batch,
)

__all__ = [
    "ReplayTopKRouter",
    "RoutingReplay",
    "check_replay_config",
    "recorded_ids",
    "replay_spec_hook",
    "routing_agreement",
    "tokens_from_batch",
]
