"""From the ``--qrl-*`` configs to the trainer's model spec: aligned forward + routing replay.

``trainer_forward(TrainForwardConfig, rollout_format, RoutingReplayConfig, arch)`` returns the
one ``spec_hook`` to pass to ``models.runtime.build_model`` plus the two state objects the RL
loop drives: :class:`AlignedForwardState` (attach to the optimizer; ``only(())`` gives the
plain forward) and :class:`~megatron_qrl.moe.RoutingReplay` (``use(expert_ids, phase)``
around the pi_prox recompute and the update forward/backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_qrl.models.hf_config import ModelArch
from megatron_qrl.te_quant.spec_hook import SpecHook, aligned_spec_hook, compose_hooks
from megatron_qrl.te_quant.state import AlignedForwardState
from megatron_qrl.te_quant.te_recipes import te_config_overrides


@dataclass
class TrainerForward:
    """What the RL loop needs to build and drive the trainer model."""

    spec_hook: SpecHook | None
    """Pass to ``build_model(..., spec_hook=...)``; None: upstream spec."""
    aligned: AlignedForwardState | None
    """Set for ``--qrl-train-forward aligned`` on the fake-quant path."""
    replay: Any
    """``moe.RoutingReplay`` for MoE models (also in mode ``off``: it records the trainer's
    routing for the agreement metric); None for dense models."""
    config_overrides: dict[str, str]
    """``TransformerConfig`` fields of the Transformer Engine path (empty otherwise)."""


def trainer_forward(train: Any, rollout_format: str, routing: Any, arch: ModelArch,
                    te_recipe: bool | str = False) -> TrainerForward:
    """Build the trainer forward from ``TrainForwardConfig`` / ``RoutingReplayConfig``.

    ``te_recipe``: serve the aligned forward with a Transformer Engine recipe instead of the
    fake-quant linears; raises one clear error if no recipe reproduces ``rollout_format`` on
    this GPU (see :mod:`megatron_qrl.te_quant.te_recipes`); ``"approximate"`` also takes a
    recipe that differs only by rounding (speed measurements).
    """
    from megatron_qrl.moe import RoutingReplay, replay_spec_hook

    aligned = None
    overrides: dict[str, str] = {}
    if train.forward == "aligned":
        state = AlignedForwardState(rollout_format)
        if not state.spec.quantizes_weights:
            raise ValueError(f"--qrl-train-forward aligned needs a quantized --qrl-rollout-format,"
                             f" got {rollout_format!r}")
        if te_recipe:
            overrides = te_config_overrides(rollout_format, approximate=te_recipe == "approximate")
        else:
            aligned = state
    elif te_recipe:
        raise ValueError("a TE recipe serves only --qrl-train-forward aligned")
    replay = None
    if arch.is_moe:
        replay = RoutingReplay(routing.replay, arch.num_experts, arch.moe_top_k)
    elif routing.replay != "off":
        raise ValueError(f"--qrl-routing-replay {routing.replay} needs an MoE model; "
                         f"{arch.architecture} is dense (use off)")
    hook = compose_hooks(aligned and aligned_spec_hook(aligned),
                         replay and replay_spec_hook(replay))
    return TrainerForward(hook, aligned, replay, overrides)
