"""LoRA serving paths that hold no adapter tensors are ``none`` (so ``merges`` means something
is merged), the Marlin LoRA runner's GPU floor, and the SGLang engine arguments of expert
LoRA: W4A16's MoE runner, no CUDA graphs on the Marlin LoRA runner (rollout/lora_serving.py,
rollout_sglang/lora.py; SGLang 0.5.17 read in its wheel, the engine itself:
tests/gpu/test_sglang_lora.py)."""

from __future__ import annotations

import logging

import pytest

from megatron_qrl.rollout.lora_serving import EXPERT_SERVING, expert_path, resolve_lora_serving

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


def _engine_kwargs(fmt, experts, cap=None, targets=ATTN + MLP, is_moe=True):
    from megatron_qrl.rollout_sglang.lora import lora_engine_kwargs

    s = resolve_lora_serving("sglang", fmt, targets, is_moe=is_moe, experts=experts,
                             capability=cap)
    return s, lora_engine_kwargs(8, s)


def test_w4a16_expert_lora_starts_the_engine_on_the_marlin_moe_runner():
    base = {"enable_lora": True, "max_lora_rank": 8, "max_loras_per_batch": 1}
    assert _engine_kwargs("w4a16", True)[1] == base | {
        "lora_target_modules": list(ATTN + MLP), "moe_runner_backend": "marlin",
        "disable_cuda_graph": True}
    assert _engine_kwargs("w4a16", False)[1] == base | {"lora_target_modules": list(ATTN)}
    for fmt in ("fp8", "nvfp4", "bf16"):  # their MoE methods keep a runner SGLang reads
        assert "moe_runner_backend" not in _engine_kwargs(fmt, True)[1]
    # a dense model has no FusedMoE to wrap: its gate/up/down adapters need no MoE runner
    dense = _engine_kwargs("w4a16", False, is_moe=False)[1]
    assert dense == base | {"lora_target_modules": list(ATTN + MLP)}


@pytest.mark.parametrize("fmt, cap, experts, eager", [
    ("w4a16", (9, 0), True, True), ("nvfp4", (9, 0), True, True),
    ("w4a16", (10, 0), True, True),   # moe_runner_backend="marlin" on Blackwell too
    ("nvfp4", (10, 0), True, False),  # expert_path: merge (FlashInfer TRT-LLM), no FusedMoE LoRA
    ("w4a16", (8, 0), True, False),   # merge below sm90
    ("fp8", (9, 0), True, False), ("int8", (9, 0), True, False), ("bf16", (9, 0), True, False),
    ("w4a16", (9, 0), False, False), ("nvfp4", (9, 0), False, False),
    ("fp8", (9, 0), False, False)])
def test_expert_lora_on_the_marlin_moe_runner_runs_without_cuda_graphs(fmt, cap, experts, eager):
    """SGLang 0.5.17 allocates the MoE-LoRA CUDA-graph buffers from ``_quant_info.w13_weight``
    (``lora/backend/base_backend.py`` l. 222), which the Marlin quant info lacks: an engine
    serving expert adapters on the Marlin LoRA runner starts with ``disable_cuda_graph``;
    every other combination keeps CUDA graphs."""
    s, kw = _engine_kwargs(fmt, experts, cap)
    assert s.experts == (expert_path(fmt, cap) if experts else "none")
    assert kw.get("disable_cuda_graph", False) is eager, (s, kw)
    assert (s.eager_reason is not None) == eager
    assert (set(MLP) <= set(kw["lora_target_modules"])) == (s.experts == "adapter")
    if eager:
        assert "w13_weight" in s.eager_reason and "base_backend.py" in s.eager_reason


def _started(monkeypatch, fmt, experts, spec_name=None, **kwargs):
    from megatron_qrl.rollout_sglang import engine as engine_mod
    from megatron_qrl.rollout_sglang.lora import SGLangLoraEngine

    seen = {}

    def fake_init(self, model_path, spec_name, options, **kw):
        seen.update(kw)

    monkeypatch.setattr(engine_mod.SGLangEngine, "__init__", fake_init)
    serving = resolve_lora_serving("sglang", fmt, ATTN + MLP, is_moe=True, experts=experts,
                                   capability=(9, 0))
    SGLangLoraEngine("/nowhere", spec_name or fmt, lora_rank=8, lora_serving=serving, **kwargs)
    return seen


def test_the_lora_engine_passes_its_serving_to_the_engine_arguments(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_qrl.rollout_sglang.lora"):
        seen = _started(monkeypatch, "w4a16", True, random_seed=0)
    assert seen["moe_runner_backend"] == "marlin" and seen["random_seed"] == 0
    assert seen["disable_cuda_graph"] is True
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "run eager" in warned[0] and "w13_weight" in warned[0]


@pytest.mark.parametrize("fmt, experts", [("fp8", True), ("nvfp4", False)])
def test_the_lora_engine_keeps_cuda_graphs_and_warns_nothing_elsewhere(monkeypatch, caplog,
                                                                      fmt, experts):
    with caplog.at_level(logging.WARNING, logger="megatron_qrl.rollout_sglang.lora"):
        seen = _started(monkeypatch, fmt, experts)
    assert "disable_cuda_graph" not in seen and seen["enable_lora"] is True
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_lora_engine_refuses_a_serving_of_another_format(monkeypatch):
    with pytest.raises(ValueError, match="resolved for engine 'sglang', format 'fp8'"):
        _started(monkeypatch, "fp8", True, spec_name="w4a16")
