"""HF config dicts of the tiny Qwen3-MoE / Qwen3 models of the CPU default job.

Sized so that EVERY registered QuantSpec applies to every quantized linear: all q/k/v/o,
gate/up/down in- and out-dims are multiples of 128 (fp8_block's 128x128 blocks and 1x128
activation groups, w4a16's group 128, nvfp4's block 16). Hence head_dim 128 with 2 query
heads and 1 KV head (q_proj 128 -> 256, k/v_proj 128 -> 128, o_proj 256 -> 128), hidden 128,
2 layers, 8 experts top-2 with expert FFN 128 (dense FFN 256). The vocabulary is the
tokenizer's, rounded up to a multiple of 64 (padding ids are never produced).
"""

from __future__ import annotations

__all__ = ["VOCAB_MULTIPLE", "padded_vocab_size", "tiny_dense_config", "tiny_moe_config"]

VOCAB_MULTIPLE = 64


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple``."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size and multiple must be >= 1, got {vocab_size}, {multiple}")
    return -(-vocab_size // multiple) * multiple


def _common(vocab_size: int) -> dict:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": 128,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": padded_vocab_size(vocab_size),
    }


def tiny_moe_config(vocab_size: int) -> dict:
    """HF ``Qwen3MoeForCausalLM`` config dict of the CPU default job's model."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_common(vocab_size),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    }


def tiny_dense_config(vocab_size: int) -> dict:
    """HF ``Qwen3ForCausalLM`` config dict: the dense variant of :func:`tiny_moe_config`."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_common(vocab_size)}
