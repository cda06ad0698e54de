"""The MoE trainer's expert path: the fast path's TransformerConfig, its flags and refusals.

``config.moe_path.moe_overrides`` is pure; the builds run megatron-core on the CPU (local spec:
no Transformer Engine here), the GPU side is tests/gpu/test_te_grouped.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.config.megatron_flags import parse_megatron_flags
from megatron_qrl.config.moe_path import moe_overrides
from megatron_qrl.rl.cli import parse_configs

BASE = ["--qrl-preset", "tiny-cpu"]


def _settings(*flags: str):
    return parse_megatron_flags(list(flags))[0]


@pytest.fixture
def te_here(monkeypatch):
    """As on a GPU host with Transformer Engine (the flags' TE checks pass)."""
    import megatron_qrl.models.builder as builder

    monkeypatch.setattr(builder, "use_transformer_engine", lambda: True)


def test_30b_preset_turns_the_fast_path_on():
    configs, _, _ = parse_configs(["--qrl-preset", "tiny-cpu,qwen3-30b-a3b", "--qrl-model",
                                   "tiny-moe", "--qrl-rollout-engine", "reference"])
    assert configs["train"].moe_fast_path
    assert configs["train"].moe_experts == "stacked"  # measured: RL step 13.0 s vs 21 s (TE GG)
    configs, _, _ = parse_configs(BASE)
    assert not configs["train"].moe_fast_path and configs["train"].moe_experts == "megatron"


def test_fast_path_on_the_te_spec():
    got, note = moe_overrides(_settings(), True, is_moe=True, lora=False, te_spec=True)
    assert note is None
    assert got == {"moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
                   "moe_permute_fusion": True, "moe_router_fusion": True,
                   "recompute_granularity": "selective",
                   "recompute_modules": ["moe_act"]}


def test_megatron_flags_win_over_the_fast_path():
    full = _settings("--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1", "--moe-token-dispatcher-type", "allgather")
    got, _ = moe_overrides(full, True, is_moe=True, lora=False, te_spec=True)
    assert got["recompute_granularity"] == "full" and "recompute_modules" not in got
    assert got["moe_token_dispatcher_type"] == "allgather" and got["moe_grouped_gemm"]


@pytest.mark.parametrize("lora,te_spec,is_moe,fast,why", [
    (False, False, True, True, "Transformer Engine spec is not built"),
    (True, True, True, True, "LoRA runs on the local spec"),
    (False, True, False, True, None),
    (False, True, True, False, None),
])
def test_fast_path_off_or_unavailable(lora, te_spec, is_moe, fast, why):
    sel = _settings("--recompute-granularity", "selective", "--recompute-modules", "core_attn")
    got, note = moe_overrides(sel, fast, is_moe=is_moe, lora=lora, te_spec=te_spec)
    assert got == {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    assert (note is None) == (why is None)
    if why:
        assert why in note and "--qrl-train-moe-fast-path" in note


def test_fast_path_builds_on_cpu(megatron):
    """CPU (no TE): the fast path resolves to the sequential experts and the model builds."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_qrl.models.builder import resolve_transformer_impl
    from megatron_qrl.models.runtime import build_model
    from tests.helpers.te_quant_fixtures import tiny_hf

    _, arch = tiny_hf("moe")
    over, note = moe_overrides(_settings(), True, is_moe=True, lora=False,
                               te_spec=resolve_transformer_impl("auto"))
    assert note and over == {}
    model = build_model(arch, use_cpu_initialization=True, **over)
    assert isinstance(model.decoder.layers[0].mlp.experts, SequentialMLP)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed: these flags are then honoured")
@pytest.mark.parametrize("flag", ["--moe-permute-fusion", "--moe-router-fusion"])
def test_fusion_flags_need_te(flag):
    with pytest.raises(QrlArgumentError, match=f"{flag} needs Transformer Engine"):
        parse_megatron_flags([flag])


def test_lora_with_grouped_gemm_is_one_error(te_here):
    with pytest.raises(QrlArgumentError, match=r"--moe-grouped-gemm with --qrl-lora-rank > 0.*"
                       "drop --moe-grouped-gemm"):
        parse_configs([*BASE, "--qrl-lora-rank", "8", "--qrl-train-forward", "bf16", "--",
                       "--moe-grouped-gemm"])


@pytest.mark.parametrize("argv,needle", [
    (["--recompute-modules", "moe_act"], "needs --recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attn"], "choose from"),
])
def test_refused_moe_flags(argv, needle):
    with pytest.raises(QrlArgumentError) as info:
        parse_megatron_flags(argv)
    assert needle in str(info.value)


def test_fusions_and_recompute_modules_reach_the_config(te_here):
    settings = _settings("--moe-grouped-gemm", "--moe-permute-fusion", "--moe-router-fusion",
                         "--recompute-granularity", "selective", "--recompute-modules",
                         "moe_act", "core_attn")
    got, _ = moe_overrides(settings, False, is_moe=True, lora=False, te_spec=True)
    assert got == {"moe_grouped_gemm": True, "moe_permute_fusion": True, "moe_router_fusion": True,
                   "recompute_granularity": "selective",
                   "recompute_modules": ["moe_act", "core_attn"]}


def test_moe_act_recompute_needs_grouped_experts(te_here):
    """``--recompute-modules moe_act`` recomputes the activation of TEGroupedMLP and of the
    stacked experts (its subclass); with SequentialMLP it would do nothing: one error."""
    sel = ["--", "--recompute-granularity", "selective", "--recompute-modules", "moe_act"]
    with pytest.raises(QrlArgumentError, match="add --moe-grouped-gemm .or "
                       "--qrl-train-moe-experts stacked"):
        parse_configs([*BASE, *sel])
    configs, _, _ = parse_configs([*BASE, "--qrl-train-moe-experts", "stacked", *sel])
    assert list(dict(configs["megatron"].config_overrides)["recompute_modules"]) == ["moe_act"]


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed: moe_act recompute then runs")
def test_moe_act_recompute_needs_te_to_import():
    """megatron-core 0.16.1's ``CheckpointWithoutOutput`` (``moe_act`` recompute) reads TE's FP8
    state even in BF16 (``fp8 is not None`` for ``fp8=False``): without TE, one error."""
    with pytest.raises(QrlArgumentError, match="moe_act: megatron-core 0.16.1's "
                       "CheckpointWithoutOutput calls Transformer Engine"):
        parse_configs([*BASE, "--qrl-train-moe-experts", "stacked", "--",
                       "--recompute-granularity", "selective", "--recompute-modules", "moe_act"])


def test_fast_path_with_stacked_experts():
    """Stacked experts: on the TE spec the whole fast path; elsewhere nothing more (the fusions
    and megatron-core's ``moe_act`` recompute need TE), with a note saying so."""
    got, note = moe_overrides(_settings(), True, is_moe=True, lora=False, te_spec=True,
                              stacked=True)
    assert note is None and got["moe_permute_fusion"] and got["recompute_modules"] == ["moe_act"]
    got, note = moe_overrides(_settings(), True, is_moe=True, lora=False, te_spec=False,
                              stacked=True)
    assert got == {"moe_grouped_gemm": True}
    assert "stacked experts run with megatron-core's unfused permute" in note
    full = _settings("--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1")
    got, _ = moe_overrides(full, True, is_moe=True, lora=False, te_spec=False, stacked=True)
    assert got["recompute_granularity"] == "full" and "recompute_modules" not in got
    sel = _settings("--recompute-granularity", "selective", "--recompute-modules", "moe_act")
    got, note = moe_overrides(sel, False, is_moe=True, lora=False, te_spec=False, stacked=True)
    assert got["moe_grouped_gemm"] and note is None  # (TransformerConfig's moe_act check)


def test_stacked_experts_build_with_the_fast_path_on_cpu(megatron):
    """The 30B preset's flags with the stacked experts build on the CPU (no TE) and train."""
    from megatron_qrl.models.runtime import build_model
    from megatron_qrl.models.stacked_experts import StackedGroupedMLP, stacked_experts_spec_hook
    from tests.helpers.te_quant_fixtures import tiny_hf

    configs, _, _ = parse_configs(["--qrl-preset", "tiny-cpu,qwen3-30b-a3b", "--qrl-model",
                                   "tiny-moe", "--qrl-rollout-engine", "reference",
                                   "--qrl-train-moe-experts", "stacked"])
    assert configs["train"].moe_fast_path and configs["train"].moe_experts == "stacked"
    _, arch = tiny_hf("moe")
    over, _ = moe_overrides(configs["megatron"], True, is_moe=True, lora=False, te_spec=False,
                            stacked=True)
    model = build_model(arch, spec_hook=stacked_experts_spec_hook, use_te=False,
                        use_cpu_initialization=True, **over)
    experts = model.decoder.layers[0].mlp.experts
    assert isinstance(experts, StackedGroupedMLP) and not experts.activation_recompute
    x = torch.randint(0, arch.vocab_size, (2, 8))
    model(x, torch.arange(8)[None].expand_as(x), attention_mask=None).float().mean().backward()
    assert experts.linear_fc2.weight.grad.abs().sum() > 0
