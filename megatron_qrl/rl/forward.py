"""Which training forward the driver builds: plain, or rollout-aligned (QaRL) + routing replay.

One call, :func:`forward_plan`, turns ``--qrl-train-forward`` / ``--qrl-routing-replay`` into
what :func:`megatron_qrl.rl.trainer.build_policy` needs, through
``megatron_qrl.te_quant.trainer_forward``: the spec hook (aligned linears, replay routers),
the aligned-forward state (its cached quantized weights are invalidated after every
optimizer step and after every external weight change) and the routing-replay context.
A combination the aligned forward cannot build is an error naming the flag — never a silent
fallback to the plain forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ForwardPlan", "ForwardUnavailableError", "forward_plan"]


class ForwardUnavailableError(RuntimeError):
    """A requested training forward cannot be built for this model and format."""


@dataclass
class ForwardPlan:
    """Spec hook, config overrides and the state objects the loop drives."""

    spec_hook: Any = None
    """``models.builder.SpecHook`` or None (upstream spec)."""
    aligned: Any = None
    """``te_quant.AlignedForwardState`` (aligned fake-quant forward) or None."""
    replay: Any = None
    """``moe.RoutingReplay`` (MoE models) or None; its mode decides where ids are replayed."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """``TransformerConfig`` overrides (Transformer Engine recipes)."""

    def weights_changed(self) -> None:
        """Invalidate cached quantized weights (after a load / UAQ; steps do it themselves)."""
        if self.aligned is not None:
            self.aligned.mark_weights_updated()

    def attach(self, optimizer: Any) -> None:
        """Hook the aligned-forward cache to ``optimizer``'s steps."""
        if self.aligned is not None:
            self.aligned.attach_to_optimizer(optimizer)


def forward_plan(configs: dict[str, Any], arch: Any) -> ForwardPlan:
    """Resolve ``--qrl-train-forward`` / ``--qrl-routing-replay`` for ``arch`` (errors name the flag)."""
    train, routing, rollout = configs["train"], configs["routing"], configs["rollout"]
    needed = train.forward == "aligned" or routing.replay != "off" or arch.is_moe
    if not needed:
        return ForwardPlan()
    from megatron_qrl import te_quant  # megatron-core and the aligned linears: when needed

    try:
        fwd = te_quant.trainer_forward(train, rollout.format, routing, arch)
    except ValueError as exc:
        raise ForwardUnavailableError(str(exc)) from None
    return ForwardPlan(fwd.spec_hook, fwd.aligned, fwd.replay, dict(fwd.config_overrides))
