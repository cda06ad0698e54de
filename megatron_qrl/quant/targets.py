"""Which HF tensors a quantization format touches, and which share a per-tensor scale.

Part of every :class:`~megatron_qrl.quant.spec.QuantSpec`: all linear layers of attention and
of the MLP / experts are quantized; embeddings, norms, the MoE router and ``lm_head`` stay
BF16 (as in the rollout engine). Names are HF Qwen3 / Qwen3-MoE names.
"""

from __future__ import annotations

from ..utils import hf_names

# Layer kinds, used by reports and by per-layer-type switches.
LAYER_KINDS = ("attention", "mlp", "experts", "shared_expert")

# Modules SGLang must leave unquantized (config.json ignore / exclude lists), as HF
# module-name globs.
UNQUANTIZED_MODULE_GLOBS = ("lm_head", "*.mlp.gate", "*.mlp.shared_expert_gate", "*embed_tokens")


is_quantized = hf_names.is_projection_weight
"""``is_quantized(hf_name)``: True for the weight of a linear layer that the rollout runs in low
precision: q/k/v/o, dense gate/up/down, every expert's gate/up/down, a shared expert's
gate/up/down (:func:`megatron_qrl.utils.hf_names.is_projection_weight`)."""


def layer_kind(hf_name: str) -> str | None:
    """``attention`` / ``mlp`` / ``experts`` / ``shared_expert`` for a quantized weight, else None."""
    return hf_names.parse(hf_name).kind if is_quantized(hf_name) else None


def fusion_group(hf_name: str) -> tuple[str, tuple[str, ...]] | None:
    """The fused module the serving engine builds from this weight, and all its members.

    SGLang (like vLLM) fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (and
    into ``w13`` per expert). Formats with ONE per-tensor scale (NVFP4's ``weight_scale_2``)
    must share it across the members, or the engine silently rescales some of them; ModelOpt's
    export does the same (shared amax over the fused group). Returns ``(key, member_names)``
    or None for weights that are not fused (:func:`megatron_qrl.utils.hf_names.fusion_group`).
    """
    return hf_names.fusion_group(hf_name, weights_only=True)


def module_name(hf_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj``."""
    if not hf_name.endswith(".weight"):
        raise ValueError(f"expected a '.weight' tensor name, got {hf_name!r}")
    return hf_name[: -len(".weight")]
