"""Rollout-aligned training forward (QaRL): the trainer computes with the rollout's quantized weights.

>>> state = AlignedForwardState("int8")
>>> model = build_model(arch, spec_hook=aligned_spec_hook(state))   # models.runtime
>>> state.attach_to_optimizer(optimizer)   # cached Q(W) refreshed after each step

``te_recipes`` maps formats to Transformer Engine recipes where TE's numerics equal the spec's.
"""

from megatron_qrl.te_quant.linears import AlignedColumnParallelLinear, AlignedRowParallelLinear
from megatron_qrl.te_quant.shard_quant import FusionLayout, quantize_shard
from megatron_qrl.te_quant.spec_hook import aligned_spec_hook, compose_hooks
from megatron_qrl.te_quant.state import AlignedForwardState

__all__ = [
    "AlignedColumnParallelLinear",
    "AlignedForwardState",
    "AlignedRowParallelLinear",
    "FusionLayout",
    "aligned_spec_hook",
    "compose_hooks",
    "quantize_shard",
]
