"""RoPE fusion: TE's fused kernel with the TE spec on a GPU, off with Megatron's --no-rope-fusion."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.config.megatron_flags import parse_megatron_flags
from megatron_qrl.models.builder import transformer_config
from megatron_qrl.models.hf_config import arch_from_dict

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
        "tie_word_embeddings": True}


def test_flag_becomes_a_config_override_only_when_given():
    assert dict(parse_megatron_flags(["--no-rope-fusion"])[0].config_overrides) == {
        "apply_rope_fusion": False}
    assert "apply_rope_fusion" not in dict(parse_megatron_flags([])[0].config_overrides)


def test_local_spec_and_cpu_keep_the_unfused_rope(monkeypatch):
    arch = arch_from_dict(TINY, source="test")
    assert transformer_config(arch, use_te=False).apply_rope_fusion is False
    if not torch.cuda.is_available():
        assert transformer_config(arch, use_te=True).apply_rope_fusion is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU host: pretends a GPU is present")
def test_te_spec_on_a_gpu_asks_for_the_fused_rope(monkeypatch):
    arch = arch_from_dict(TINY, source="test")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:  # without TE, megatron-core refuses the fused kernel: the request reached it
        assert transformer_config(arch, use_te=True).apply_rope_fusion is True
    except ValueError as exc:
        assert "apply_rope_fusion" in str(exc)
    # --no-rope-fusion wins over the default
    assert transformer_config(arch, use_te=True, apply_rope_fusion=False).apply_rope_fusion \
        is False
