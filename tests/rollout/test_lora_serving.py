"""LoRA serving: which adapters an engine serves and which are merged (resolve function, CPU);
the merge path against the reference engine (numerics, CPU); the in-place loader on a model
whose layers SGLang wrapped for LoRA (structure, CPU stand-in for the SGLang model).

The SGLang engine's numerics (quantized base + adapter from tensors) are GPU tests:
tests/gpu/test_sglang_lora.py. The call-sequence tests of ``SGLangLoraEngine`` are in
tests/rollout_sglang/test_sglang_lora_calls.py."""

from __future__ import annotations

import pytest
import torch

from megatron_qrl.rollout.lora_serving import (
    EXPERT_SERVING,
    hf_weight_of,
    resolve_lora_serving,
)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
GATE = "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"
EXPERT = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_A.weight"


@pytest.mark.parametrize("fmt", sorted(EXPERT_SERVING))
def test_dense_model_serves_every_target_as_adapter_in_every_format(fmt):
    s = resolve_lora_serving("sglang", fmt, ALL, is_moe=False, experts=False)
    assert s.engine_targets == ALL and not s.merges
    assert s.path_of(Q) == s.path_of(GATE) == "adapter"


@pytest.mark.parametrize("fmt, cap, want", [
    ("bf16", None, "adapter"), ("int8", None, "adapter"), ("fp8", None, "adapter"),
    ("w4a16", None, "adapter"), ("nvfp4", (9, 0), "adapter"), ("nvfp4", (10, 0), "merge"),
    ("fp8_block", None, "merge")])
def test_expert_adapters_follow_sglangs_moe_runner(fmt, cap, want):
    # a MoE model with dense-MLP projections too (GATE: a dense layer's / shared expert's)
    s = resolve_lora_serving("sglang", fmt, ALL, is_moe=True, experts=True, capability=cap,
                             dense_mlp=True)
    assert s.path_of(EXPERT) == want and s.path_of(GATE) == want and s.path_of(Q) == "adapter"
    # SGLang wraps FusedMoE once gate_up and down are targets: only with served experts
    mlp = {"gate_proj", "up_proj", "down_proj"}
    assert (mlp <= set(s.engine_targets)) == (want == "adapter")
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(s.engine_targets)


def test_moe_without_expert_adapters_starts_the_engine_with_attention_targets_only():
    s = resolve_lora_serving("sglang", "w4a16", ALL, is_moe=True, experts=False, dense_mlp=True)
    assert s.engine_targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert s.path_of(GATE) == "merge"


def test_reference_engine_merges_routed_experts_only():
    s = resolve_lora_serving("reference", "nvfp4", ALL, is_moe=True, experts=True,
                             dense_mlp=True)
    served, merged = s.split({Q: 0, GATE: 1, EXPERT: 2})
    assert served == {Q: 0, GATE: 1} and merged == {EXPERT: 2}


def test_bad_inputs_are_one_clear_error():
    with pytest.raises(ValueError, match="unknown engine"):
        resolve_lora_serving("vllm", "bf16", ALL, is_moe=False, experts=False)
    with pytest.raises(ValueError, match="not a PEFT LoRA tensor name"):
        hf_weight_of("model.layers.0.self_attn.q_proj.weight")
    assert hf_weight_of(EXPERT) == "model.layers.0.mlp.experts.3.down_proj.weight"


# ---- the merge path, reference engine (numerics) ---------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4", "w4a16"])
def test_merged_experts_equal_a_full_sync_of_the_merged_policy(megatron, fmt):
    """Expert adapters go merged + re-quantized (only the touched expert modules), attention
    and shared adapters as adapters; the engine then computes exactly what an engine given
    the whole merged policy computes (bit for bit on the weights, logits to fp32 rounding)."""
    from megatron_qrl.models.lora_config import LoraConfig
    from megatron_qrl.models.lora_io import adapter_tensors, base_hf_tensors, merge_into
    from megatron_qrl.quant import get_spec
    from megatron_qrl.quant.hf_reference import hf_tensors
    from megatron_qrl.rl.lora_sync import LoraSync
    from megatron_qrl.rollout.reference import ReferenceEngine
    from tests.helpers.te_quant_fixtures import ids, tiny_cfg
    from tests.models.test_lora import _freeze, _lora_model, _random_b, _Trainer

    cfg = LoraConfig(rank=4, alpha=8.0, experts=True, base_format=fmt)
    _, arch, _, model = _lora_model(cfg, kind="moe", seed=3)
    _freeze(model, fmt)
    spec, trainer = get_spec(fmt), _Trainer(model, arch)
    serving = resolve_lora_serving("reference", fmt, cfg.targets, is_moe=True, experts=True)
    engine = ReferenceEngine(tiny_cfg("moe"), fmt, seed=0)
    sync = LoraSync(cfg, serving)
    sync.send(trainer, engine, spec, 1, None, 0, 0, 1)
    _random_b(model)
    calls = []
    real = engine.update_packed_tensors
    engine.update_packed_tensors = lambda s, version: real(
        [calls.append(n) or (n, t) for n, t in s], version)
    sync.send(trainer, engine, spec, 2, None, 0, 0, 1)
    assert calls and all(".mlp.experts." in n for n in calls)  # only the touched modules
    adapters = dict(adapter_tensors(model, arch))
    served, _ = serving.split(adapters)
    assert set(engine.held_lora_checksums()) == set(served) and served
    # the same policy as one full sync of merged weights + the served adapters
    twin = ReferenceEngine(tiny_cfg("moe"), fmt, seed=0)
    twin.update_weights(spec.pack_state_dict(merge_into(
        base_hf_tensors(model, arch), {k: v for k, v in adapters.items() if k not in served},
        cfg.scaling)), version=2)
    twin.load_lora_adapter("t", served, cfg.peft_config(), version=2)
    got, want = dict(hf_tensors(engine.model)), dict(hf_tensors(twin.model))
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n
    x = ids(vocab=arch.vocab_size)
    torch.testing.assert_close(engine.model(input_ids=x).logits, twin.model(input_ids=x).logits,
                               rtol=0, atol=1e-5)
    # and the merge changed what the engine computes (B != 0)
    base_only = ReferenceEngine(tiny_cfg("moe"), fmt, seed=0)
    base_only.update_weights(spec.pack_state_dict(base_hf_tensors(model, arch)), version=2)
    name = next(n for n in got if ".experts." in n and n.endswith("down_proj.weight"))
    assert not torch.equal(got[name], dict(hf_tensors(base_only.model))[name])


def test_reference_adapter_reads_the_unquantized_input_under_w8a8():
    """SGLang adds the adapter on the raw input of a W8A8 linear (the base quantizes its
    activations itself): the reference engine's adapter must too."""
    from megatron_qrl.rollout.reference import ReferenceEngine
    from tests.helpers.te_quant_fixtures import tiny_cfg

    eng = ReferenceEngine(tiny_cfg("dense"), "int8", seed=0)
    lin = eng.model.model.layers[0].self_attn.q_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, lin.in_features, generator=g)
    a = torch.randn(4, lin.in_features, generator=g)
    b = torch.randn(lin.out_features, 4, generator=g)
    before = lin(x)
    eng._version = 0
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    eng.load_lora_adapter("v1", {name + "A.weight": a, name + "B.weight": b},
                          {"r": 4, "lora_alpha": 8}, 1)
    torch.testing.assert_close(lin(x) - before, 2.0 * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)
