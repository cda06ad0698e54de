"""LoRA serving paths that hold no adapter tensors are ``none`` (so ``merges`` means something
is merged), the Marlin LoRA runner's GPU floor, and the SGLang engine arguments of expert
LoRA on W4A16 (rollout/lora_serving.py, rollout_sglang/lora.py; SGLang 0.5.17 read in its
wheel, the engine itself: tests/gpu/test_sglang_lora.py)."""

from __future__ import annotations

import pytest

from megatron_qrl.rollout.lora_serving import EXPERT_SERVING, resolve_lora_serving

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
GATE = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
EXPERT = "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_B.weight"


@pytest.mark.parametrize("fmt", sorted(EXPERT_SERVING))
@pytest.mark.parametrize("targets", [ATTN, ATTN + MLP])
def test_moe_without_expert_adapters_merges_nothing(fmt, targets):
    """A Qwen3-MoE (no dense MLP) with attention adapters only -- also with the default
    targets, whose gate/up/down find no dense projection -- serves every adapter."""
    s = resolve_lora_serving("sglang", fmt, targets, is_moe=True, experts=False)
    assert not s.merges, s
    assert (s.attention, s.dense_mlp, s.experts) == ("adapter", "none", "none")
    assert s.engine_targets == ATTN  # FusedMoE stays unwrapped
    assert s.split({Q: 1}) == ({Q: 1}, {})


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "w4a16", "nvfp4"])
def test_dense_mlp_adapters_on_moe_without_expert_adapters_are_merged(fmt):
    s = resolve_lora_serving("sglang", fmt, ATTN + MLP, is_moe=True, experts=False,
                             dense_mlp=True)
    assert s.merges and s.dense_mlp == "merge" and s.experts == "none"
    assert s.engine_targets == ATTN
    assert s.split({Q: 1, GATE: 2}) == ({Q: 1}, {GATE: 2})


def test_a_tensor_on_a_path_without_targets_is_one_clear_error():
    s = resolve_lora_serving("sglang", "fp8", ATTN, is_moe=True, experts=False)
    with pytest.raises(ValueError, match="adapts a mlp projection, but this run's LoRA "
                                         "serving has none"):
        s.path_of(GATE)
    with pytest.raises(ValueError, match="adapts a experts projection"):
        s.split({EXPERT: 0})
    mlp_only = resolve_lora_serving("sglang", "fp8", MLP, is_moe=False, experts=False)
    assert mlp_only.attention == "none" and mlp_only.engine_targets == MLP
    with pytest.raises(ValueError, match="adapts a attention projection"):
        mlp_only.path_of(Q)


def test_expert_adapters_need_all_three_mlp_targets():
    with pytest.raises(ValueError, match="gate_proj, up_proj and down_proj"):
        resolve_lora_serving("sglang", "fp8", ATTN + ("down_proj",), is_moe=True, experts=True)


@pytest.mark.parametrize("fmt, cap, want", [
    ("w4a16", (8, 0), "merge"), ("nvfp4", (8, 9), "merge"), ("w4a16", (9, 0), "adapter"),
    ("nvfp4", (9, 0), "adapter"), ("w4a16", (10, 0), "adapter"), ("nvfp4", (10, 0), "merge"),
    ("fp8", (8, 0), "adapter")])
def test_marlin_expert_lora_needs_sm90(fmt, cap, want):
    """``MarlinLoraRunnerCore`` asserts compute capability >= 9 (Triton formats do not)."""
    s = resolve_lora_serving("sglang", fmt, ATTN + MLP, is_moe=True, experts=True,
                             capability=cap)
    assert s.experts == want and s.merges == (want == "merge")
    assert (set(MLP) <= set(s.engine_targets)) == (want == "adapter")


def test_w4a16_expert_lora_starts_the_engine_on_the_marlin_moe_runner():
    from megatron_qrl.rollout_sglang.lora import lora_engine_kwargs

    base = {"enable_lora": True, "max_lora_rank": 8, "max_loras_per_batch": 1}
    assert lora_engine_kwargs(8, ATTN + MLP, "w4a16") == base | {
        "lora_target_modules": list(ATTN + MLP), "moe_runner_backend": "marlin"}
    assert lora_engine_kwargs(8, ATTN, "w4a16") == base | {"lora_target_modules": list(ATTN)}
    for fmt in ("fp8", "nvfp4", "bf16"):  # their MoE methods keep a runner SGLang reads
        assert "moe_runner_backend" not in lora_engine_kwargs(8, ATTN + MLP, fmt)


def test_the_lora_engine_passes_its_format_to_the_engine_arguments(monkeypatch):
    from megatron_qrl.rollout_sglang import engine as engine_mod
    from megatron_qrl.rollout_sglang.lora import SGLangLoraEngine

    seen = {}

    def fake_init(self, model_path, spec_name, options, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(engine_mod.SGLangEngine, "__init__", fake_init)
    SGLangLoraEngine("/nowhere", "w4a16", lora_rank=8, lora_targets=ATTN + MLP,
                     random_seed=0)
    assert seen["moe_runner_backend"] == "marlin" and seen["random_seed"] == 0
