"""``bf16``: no quantization — the reference run and the rollout of an unquantized engine."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine_facts import EngineFacts, KernelFlags
from ..spec import QuantSpec, register_spec


@register_spec
@dataclass(frozen=True)
class BF16Spec(QuantSpec):
    """Everything stays in the checkpoint's dtype; SGLang runs without ``--quantization``."""

    name: str = "bf16"
    description: str = "no quantization (BF16 weights and activations)"
    weight_format: str = "none"
    granularity: str = "none"
    # SGLang: every sync path loads bf16; the Triton fused-MoE kernel, unquantized; expert
    # adapters on UnquantizedFusedMoEMethod's Triton runner
    engine = EngineFacts(
        sglang_syncs={"tensor": True, "disk": True, "distributed": True},
        te_recipe=None,
        moe_kernel=KernelFlags(),
        lora_experts="adapter")

    def hf_quantization_config(self):
        return None

    def modelopt_config(self):
        raise ValueError("bf16 has no ModelOpt quantization config: nothing is quantized")
