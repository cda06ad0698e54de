"""``bf16``: no quantization — the reference run and the rollout of an unquantized engine."""

from __future__ import annotations

from ..spec import QuantSpec, register_spec


@register_spec
class BF16Spec(QuantSpec):
    """Everything stays in the checkpoint's dtype; SGLang runs without ``--quantization``."""

    name = "bf16"
    description = "no quantization (BF16 weights and activations)"
    weight_format = "none"
    granularity = "none"

    def hf_quantization_config(self):
        return None

    def modelopt_config(self):
        raise ValueError("bf16 has no ModelOpt quantization config: nothing is quantized")
