"""Pure parts of megatron_qrl.models: config parsing, layouts, name mapping, parameter counts."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.models import CONFIG_DIR, load_hf_config
from megatron_qrl.models import layout as L
from megatron_qrl.models.builder import ParallelLayout, SequenceParallelRMSNorm, config_and_spec
from megatron_qrl.models.hf_config import UnsupportedModelError, arch_from_dict
from megatron_qrl.models.mapping import (
    canonical_name,
    count_parameters,
    expected_hf_shapes,
    rule_for,
)
from tests.helpers.tiny_hf import tiny_config


def _rows(n: int, width: int = 3) -> torch.Tensor:
    """Row i is filled with the value i: the layout shows in the first column."""
    return torch.arange(n, dtype=torch.float32)[:, None].expand(n, width).clone()


def test_fuse_qkv_is_interleaved_per_query_group():
    # 4 q heads, 2 kv heads, head_dim 1: group g = [q(2g), q(2g+1), k(g), v(g)]
    q, k, v = _rows(4), _rows(2) + 10, _rows(2) + 20
    fused = L.fuse_qkv(q, k, v, num_heads=4, num_kv_heads=2, head_dim=1)
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = L.split_qkv(fused, 4, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_tp_shards_hold_whole_groups_and_round_trip():
    q, k, v = torch.randn(8 * 4, 5), torch.randn(2 * 4, 5), torch.randn(2 * 4, 5)
    shards = [L.shard_qkv(q, k, v, 8, 2, 4, r, 2) for r in range(2)]
    assert L.split_qkv(shards[1], 4, 1, 4)[1].equal(k[4:])  # rank 1 holds kv head 1
    assert all(torch.equal(a, b) for a, b in zip(L.unshard_qkv(shards, 8, 2, 4), (q, k, v)))
    with pytest.raises(ValueError, match="query groups"):
        L.shard_qkv(q, k, v, 8, 2, 4, 0, 4)


def test_gate_up_shard_is_gate_r_then_up_r():
    gate, up = _rows(4), _rows(4) + 100
    shards = [L.shard_gate_up(gate, up, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 100, 101]
    assert shards[1][:, 0].tolist() == [2, 3, 102, 103]
    g, u = L.unshard_gate_up(shards)
    assert g.equal(gate) and u.equal(up)


def test_row_and_column_shards():
    w = torch.arange(24.0).reshape(4, 6)
    assert L.shard(w, 1, 1, 2).equal(w[:, 3:]) and L.shard(w, 0, 1, 2).equal(w[2:])
    with pytest.raises(ValueError, match="not divisible"):
        L.shard(w, 0, 0, 3)
    assert L.global_expert_index(1, ep_rank=3, num_local_experts=4) == 13


def test_rules_local_te_and_experts():
    _, arch = load_hf_config(CONFIG_DIR / "tiny_qwen3_moe.json")
    r = rule_for("decoder.layers.1.self_attention.linear_qkv.weight", arch)
    assert r.kind == "qkv" and r.hf_names[1] == "model.layers.1.self_attn.k_proj.weight"
    te = rule_for("module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", arch)
    assert te.hf_names == ("model.layers.0.input_layernorm.weight",)
    e = rule_for("decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight", arch,
                 ep_rank=1, num_local_experts=4)
    assert e.expert and e.kind == "gate_up"
    assert e.hf_names == ("model.layers.0.mlp.experts.6.gate_proj.weight",
                          "model.layers.0.mlp.experts.6.up_proj.weight")
    assert canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight3") == \
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"
    assert rule_for("module.module.embedding.word_embeddings.weight", arch).kind == "column"
    assert rule_for("decoder.layers.0.mlp.router.weight", arch).hf_names == (
        "model.layers.0.mlp.gate.weight",)
    with pytest.raises(KeyError, match="linear_fc1"):
        rule_for("decoder.layers.0.mlp.linear_fc1.weight", arch)  # MoE has no dense MLP


def test_tied_embeddings_have_no_output_layer_rule():
    arch = arch_from_dict(tiny_config("dense", tie_word_embeddings=True))
    with pytest.raises(KeyError, match="output_layer"):
        rule_for("output_layer.weight", arch)
    assert "lm_head.weight" not in expected_hf_shapes(arch)


@pytest.mark.parametrize("bad, match", [
    ({"architectures": ["Qwen3ForCausalLMv2"]}, "unknown architecture"),
    ({"architectures": ["Qwen3"]}, "unknown architecture"),
    ({"architectures": ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]}, "exactly one"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_config_errors(bad, match):
    with pytest.raises(UnsupportedModelError, match=match):
        arch_from_dict(tiny_config("dense", **bad))


def test_config_moe_spellings_and_mixed_layers():
    v5 = tiny_config("moe", rope_parameters={"rope_type": "default", "rope_theta": 5.0})
    v5["num_local_experts"] = v5.pop("num_experts")
    v5.pop("rope_theta")
    arch = arch_from_dict(v5)
    assert arch.num_experts == 8 and arch.rope_theta == 5.0 and arch.moe_top_k == 2
    with pytest.raises(UnsupportedModelError, match="mixed dense/MoE"):
        arch_from_dict(tiny_config("moe", mlp_only_layers=[0]))


def test_parameter_counts_closed_form():
    _, tiny = load_hf_config(CONFIG_DIR / "tiny_qwen3_moe.json")
    h, f, v, e = 64, 32, 128, 8
    layer = 2 * h + 2 * 16 + h * (64 + 2 * 32) + 64 * h + e * h + e * 3 * h * f
    assert count_parameters(tiny) == (2 * v * h + h + 2 * layer,
                                      2 * v * h + h + 2 * (layer - (e - 2) * 3 * h * f))
    _, big = load_hf_config(CONFIG_DIR / "qwen3_30b_a3b.json")
    total, active = count_parameters(big)
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 1) == 3.4
    assert (total, active) == (30_532_122_624, 3_353_032_704)


def test_parallel_layout_checks():
    _, arch = load_hf_config(CONFIG_DIR / "tiny_qwen3_moe.json")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ParallelLayout(tp=4).check(arch)
    with pytest.raises(ValueError, match="num_experts"):
        ParallelLayout(ep=3).check(arch)
    with pytest.raises(ValueError, match=">= 1"):
        ParallelLayout(tp=0)


def test_config_and_spec_fields_and_hook():
    _, arch = load_hf_config(CONFIG_DIR / "tiny_qwen3_moe.json")
    seen = []

    def hook(spec, config):
        seen.append(config)
        spec.submodules.self_attention.submodules.linear_proj = "SWAPPED"
        return spec

    config, block = config_and_spec(arch, ParallelLayout(tp=2), spec_hook=hook)
    assert seen == [config] and config.sequence_parallel and config.qk_layernorm
    assert config.moe_router_dtype == "fp32" and not config.moe_router_pre_softmax
    assert config.kv_channels == 16 and config.num_query_groups == 2
    assert len(block.layer_specs) == 2 and block.layer_norm is SequenceParallelRMSNorm
    layer = block.layer_specs[0].submodules
    assert layer.self_attention.submodules.linear_proj == "SWAPPED"
    assert layer.input_layernorm is SequenceParallelRMSNorm
    arch_nonorm = arch_from_dict(tiny_config("moe", norm_topk_prob=False))
    assert config_and_spec(arch_nonorm)[0].moe_router_pre_softmax
