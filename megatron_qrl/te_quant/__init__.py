"""Rollout-aligned training forward (QaRL): the trainer computes with the rollout's quantized weights.

>>> fwd = trainer_forward(TrainForwardConfig("aligned"), "int8", RoutingReplayConfig("all"), arch)
>>> model = build_model(arch, spec_hook=fwd.spec_hook, **fwd.config_overrides)
>>> fwd.aligned.attach_to_optimizer(optimizer)
>>> with fwd.replay.use(rollout_expert_ids, phase="recompute"): ...

or by hand:

>>> state = AlignedForwardState("int8")
>>> model = build_model(arch, spec_hook=aligned_spec_hook(state))   # models.runtime
>>> state.attach_to_optimizer(optimizer)   # cached Q(W) refreshed after each step

On Megatron's Transformer Engine spec the swapped modules keep TE's parameter / state-dict names
(:mod:`.te_names`, :mod:`.te_grouped`). ``te_recipes`` maps formats to Transformer Engine
recipes where TE's numerics equal the spec's.
"""

from megatron_qrl.te_quant.forward import TrainerForward, trainer_forward
from megatron_qrl.te_quant.linears import AlignedColumnParallelLinear, AlignedRowParallelLinear
from megatron_qrl.te_quant.shard_quant import FusionLayout, quantize_shard
from megatron_qrl.te_quant.spec_hook import aligned_spec_hook, compose_hooks
from megatron_qrl.te_quant.state import AlignedForwardState
from megatron_qrl.te_quant.te_grouped import (
    AlignedTEColumnParallelGroupedLinear,
    AlignedTEGroupedMLP,
    AlignedTERowParallelGroupedLinear,
)
from megatron_qrl.te_quant.te_names import (
    AlignedTEColumnParallelLinear,
    AlignedTELayerNormColumnParallelLinear,
    AlignedTERowParallelLinear,
)
from megatron_qrl.te_quant.te_recipes import RECIPES, te_config_overrides, te_recipe_for

__all__ = [
    "AlignedColumnParallelLinear",
    "AlignedForwardState",
    "AlignedRowParallelLinear",
    "AlignedTEColumnParallelGroupedLinear",
    "AlignedTEColumnParallelLinear",
    "AlignedTEGroupedMLP",
    "AlignedTELayerNormColumnParallelLinear",
    "AlignedTERowParallelGroupedLinear",
    "AlignedTERowParallelLinear",
    "FusionLayout",
    "RECIPES",
    "TrainerForward",
    "aligned_spec_hook",
    "compose_hooks",
    "quantize_shard",
    "te_config_overrides",
    "te_recipe_for",
    "trainer_forward",
]
