"""``bf16``: no quantization — the reference run and the rollout of an unquantized engine."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import QuantSpec, register_spec


@register_spec
@dataclass(frozen=True)
class BF16Spec(QuantSpec):
    """Everything stays in the checkpoint's dtype; SGLang runs without ``--quantization``."""

    name: str = "bf16"
    description: str = "no quantization (BF16 weights and activations)"
    weight_format: str = "none"
    granularity: str = "none"

    def hf_quantization_config(self):
        return None

    def modelopt_config(self):
        raise ValueError("bf16 has no ModelOpt quantization config: nothing is quantized")
