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

from megatron_qrl.config.configs import QrlConfigs

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
    lora: Any = None
    """``models.lora.LoraState`` of a LoRA run (``--qrl-lora-rank`` > 0), else None. Its frozen
    base in the rollout format IS the aligned forward of the base (no aligned linears)."""
    prepare_model: Any = None
    """``(bare GPTModel) -> None`` run by ``build_policy`` before megatron DDP wraps the model
    (LoRA without warm-up: only the adapters require grad, so DDP buffers only theirs)."""
    kv: Any = None
    """``te_quant.KVAlignState`` (``--qrl-train-forward aligned`` with a rounding
    ``--qrl-rollout-kv-cache``) or None; the trainer sets its prompt lengths per micro batch."""

    def weights_changed(self) -> None:
        """Invalidate cached quantized weights (after a load / UAQ; steps do it themselves)."""
        if self.aligned is not None:
            self.aligned.mark_weights_updated()

    def attach(self, optimizer: Any) -> None:
        """Hook the aligned-forward cache to ``optimizer``'s steps."""
        if self.aligned is not None:
            self.aligned.attach_to_optimizer(optimizer)


def forward_plan(configs: QrlConfigs, arch: Any) -> ForwardPlan:
    """Resolve ``--qrl-train-forward`` / ``--qrl-routing-replay`` for ``arch`` (errors name the flag)."""
    train, routing, rollout = configs.train, configs.routing, configs.rollout
    lora = configs.lora
    if lora is not None and lora.enabled:
        return _lora_plan(configs, arch)
    needed = (train.forward == "aligned" or routing.replay != "off" or arch.is_moe
              or train.moe_experts == "stacked")
    if not needed:
        return ForwardPlan()
    from megatron_qrl import te_quant  # megatron-core and the aligned linears: when needed

    try:
        fwd = te_quant.trainer_forward(train, rollout.format, routing, arch,
                                       kv_cache=rollout.sglang.kv_cache)
    except ValueError as exc:
        raise ForwardUnavailableError(str(exc)) from None
    return ForwardPlan(fwd.spec_hook, fwd.aligned, fwd.replay, dict(fwd.config_overrides),
                       kv=fwd.kv)


def _lora_plan(configs: QrlConfigs, arch: Any) -> ForwardPlan:
    """LoRA: every linear a LoRA linear (``models.lora``), routing replay as usual."""
    import dataclasses

    from megatron_qrl.models.lora import LoraState, freeze_all_but_adapters, lora_spec_hook
    from megatron_qrl.te_quant import compose_hooks, trainer_forward

    state = LoraState(configs.lora)
    train = dataclasses.replace(configs.train, forward="bf16")
    try:
        fwd = trainer_forward(train, configs.rollout.format, configs.routing, arch)
    except ValueError as exc:
        raise ForwardUnavailableError(str(exc)) from None
    # the LoRA linears swap into megatron-core's local spec (use_te goes to config_and_spec)
    run = configs.run
    no_warmup = run is not None and run.sft_steps == 0
    return ForwardPlan(compose_hooks(lora_spec_hook(state), fwd.spec_hook), None, fwd.replay,
                       {**fwd.config_overrides, "use_te": False}, state,
                       freeze_all_but_adapters if no_warmup else None)
