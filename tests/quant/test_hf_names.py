"""quant/hf_names: the one parser of HF Qwen3 / Qwen3-MoE tensor names (closed-form cases)."""

import pytest

from megatron_qrl.quant import hf_names, targets
from megatron_qrl.quant.hf_names import HFName, parse

L3 = "model.layers.3."


@pytest.mark.parametrize("name, parts", [
    (L3 + "self_attn.q_proj.weight", (L3, "self_attn", None, "q_proj", "weight")),
    (L3 + "self_attn.o_proj.weight_scale", (L3, "self_attn", None, "o_proj", "weight_scale")),
    (L3 + "mlp.down_proj.weight", (L3, "mlp", None, "down_proj", "weight")),
    (L3 + "mlp.experts.17.up_proj.weight", (L3, "mlp.experts", 17, "up_proj", "weight")),
    (L3 + "mlp.experts.*.gate_proj.input_scale",
     (L3, "mlp.experts", "*", "gate_proj", "input_scale")),
    (L3 + "mlp.shared_expert.gate_proj.weight",
     (L3, "mlp.shared_expert", None, "gate_proj", "weight")),
])
def test_parse_splits_a_projection_name_and_gives_it_back(name, parts):
    p = parse(name)
    assert tuple(p) == parts and str(p) == name and p.layer == 3


@pytest.mark.parametrize("name", [
    "model.embed_tokens.weight", "lm_head.weight", L3 + "input_layernorm.weight",
    L3 + "mlp.gate.weight", L3 + "self_attn.q_norm.weight", L3 + "mlp.shared_expert_gate.weight",
    L3 + "self_attn.gate_proj.weight", L3 + "mlp.q_proj.weight", "q_proj.weight",
    L3 + "mlp.experts.x.up_proj.weight",
])
def test_other_tensors_are_not_projections(name):
    assert parse(name) is None and not hf_names.is_projection_weight(name)
    assert hf_names.fusion_group(name) is None and hf_names.stacked_name(name) == name


def test_kind_owner_and_engine_module():
    q = parse(L3 + "self_attn.k_proj.weight")
    e = parse(L3 + "mlp.experts.5.down_proj.weight_scale")
    s = parse(L3 + "mlp.shared_expert.up_proj.weight")
    assert (q.kind, e.kind, s.kind) == ("attention", "experts", "shared_expert")
    assert q.owner == L3 + "self_attn" and e.owner == L3 + "mlp.experts.5"
    assert q.engine_module == L3 + "self_attn.qkv_proj"
    assert e.engine_module == L3 + "mlp.experts" == e.experts_module
    assert s.engine_module == L3 + "mlp.shared_expert.gate_up_proj"
    assert parse(L3 + "self_attn.o_proj.weight").engine_module == L3 + "self_attn.o_proj"
    assert q.experts_module is None and parse("vision.self_attn.q_proj.weight").layer is None


def test_fusion_groups():
    base = L3 + "self_attn."
    assert hf_names.fusion_group(base + "v_proj.weight_scale") == (
        base, tuple(base + f"{x}_proj.weight_scale" for x in "qkv"))
    ex = L3 + "mlp.experts.2."
    assert hf_names.fusion_group(ex + "up_proj.weight") == (
        ex, (ex + "gate_proj.weight", ex + "up_proj.weight"))
    assert hf_names.fusion_group(ex + "down_proj.weight") is None
    assert hf_names.fusion_group(base + "o_proj.weight") is None
    # quant.targets: weights only (no packed tensors, no stacks)
    assert targets.fusion_group(ex + "gate_proj.weight") == hf_names.fusion_group(
        ex + "gate_proj.weight")
    assert targets.fusion_group(base + "q_proj.weight_scale") is None
    assert targets.fusion_group(L3 + "mlp.experts.*.up_proj.weight") is None


def test_stacked_names():
    one = L3 + "mlp.experts.17.up_proj.weight_scale"
    stack = L3 + "mlp.experts.*.up_proj.weight_scale"
    assert hf_names.stacked_name(one) == stack == hf_names.stacked_name(stack)
    assert hf_names.expert_name(stack, 4) == L3 + "mlp.experts.4.up_proj.weight_scale"
    assert hf_names.expert_name(one, 0) == L3 + "mlp.experts.0.up_proj.weight_scale"
    assert parse(stack).is_stacked and not parse(one).is_stacked
    with pytest.raises(ValueError, match="not an expert tensor"):
        hf_names.expert_name(L3 + "mlp.up_proj.weight", 1)
    assert hf_names.layer_prefix(one) == L3 and hf_names.layer_prefix("lm_head.weight") is None


def test_quantized_weights_are_projection_weights():
    assert targets.is_quantized(L3 + "mlp.experts.0.gate_proj.weight")
    assert not targets.is_quantized(L3 + "mlp.experts.*.gate_proj.weight")
    assert not targets.is_quantized(L3 + "self_attn.q_proj.weight_scale")
    assert targets.layer_kind(L3 + "mlp.shared_expert.down_proj.weight") == "shared_expert"
    assert targets.layer_kind(L3 + "mlp.gate.weight") is None
    assert HFName(L3, "mlp", None, "up_proj", "weight")._replace(leaf="bias").leaf == "bias"


def test_expert_names_are_the_rows_of_a_stack():
    stack = L3 + "mlp.experts.*.down_proj.weight_scale_inv"
    names = hf_names.expert_names(stack, 3)
    assert names == [L3 + f"mlp.experts.{e}.down_proj.weight_scale_inv" for e in range(3)]
    assert [parse(n).expert for n in names] == [0, 1, 2]
    assert all(hf_names.stacked_name(n) == stack for n in names)
    assert hf_names.expert_names(L3 + "mlp.experts.9.up_proj.weight", 1) == [
        L3 + "mlp.experts.0.up_proj.weight"]
    assert hf_names.expert_names(stack, 0) == []
    with pytest.raises(ValueError, match="not an expert tensor"):
        hf_names.expert_names(L3 + "mlp.shared_expert.up_proj.weight", 2)


@pytest.mark.parametrize("name, module", [
    (L3 + "self_attn.v_proj.weight_scale", L3 + "self_attn.qkv_proj"),
    (L3 + "mlp.experts.7.gate_proj.weight", L3 + "mlp.experts"),
    (L3 + "mlp.experts.*.down_proj.input_scale", L3 + "mlp.experts"),
    (L3 + "mlp.shared_expert.up_proj.weight", L3 + "mlp.shared_expert.gate_up_proj"),
    (L3 + "input_layernorm.weight", L3 + "input_layernorm"),
    (L3 + "mlp.gate.weight", L3 + "mlp.gate"),
    ("lm_head.weight", "lm_head"),
])
def test_the_sync_reads_names_with_this_parser(name, module):
    """The in-place sync's module keys, stacked names and direct-load targets come from
    :func:`parse` (no expert-name grammar of its own)."""
    from megatron_qrl.rollout_sglang.sync import protocol

    assert protocol.module_key(name) == module
    p = parse(name)
    stacked = protocol.parse_stacked(name)
    assert (stacked is not None) == (p is not None and p.is_stacked)
    if stacked:
        assert stacked == (p.experts_module, p.proj, p.leaf)
        assert protocol.expert_names(name, 2) == hf_names.expert_names(name, 2)
