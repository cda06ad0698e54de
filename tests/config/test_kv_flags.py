"""--qrl-rollout-kv-cache: from the flag to SGLang's engine arguments, the flag checks, the
trainer forward plan and the per-micro-batch prompt lengths."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_qrl.config import QrlArgumentError, add_qrl_args, qrl_configs_from_args
from megatron_qrl.config.args import validate_qrl_args
from megatron_qrl.rollout_sglang.options import SGLangOptions

HOPPER = (9, 0)


def _parse(*argv: str) -> argparse.Namespace:
    return add_qrl_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(list(argv))


def test_flag_reaches_the_engine_options_and_sglang_arguments(capsys):
    opts = qrl_configs_from_args(_parse("--qrl-rollout-kv-cache", "fp8_e4m3"))["rollout"].sglang
    assert opts.kv_cache == "fp8_e4m3"
    assert opts.kv_engine_kwargs == {"kv_cache_dtype": "fp8_e4m3", "disable_radix_cache": True,
                                     "chunked_prefill_size": -1}
    assert SGLangOptions().kv_engine_kwargs == {"kv_cache_dtype": "bf16"}
    assert opts.resolve("fp8").kv_cache == "fp8_e4m3"  # resolve keeps it
    with pytest.raises(SystemExit):
        _parse("--qrl-rollout-kv-cache", "int4")
    assert "--qrl-rollout-kv-cache: invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--qrl-rollout-kv-cache 'int4'"):
        SGLangOptions(kv_cache="int4")


def test_checks_reference_engine_and_aligned_bf16_weights():
    with pytest.raises(QrlArgumentError, match="--qrl-rollout-kv-cache fp8_e4m3 needs "
                                               "--qrl-rollout-engine sglang"):
        validate_qrl_args(_parse("--qrl-rollout-kv-cache", "fp8_e4m3"), gpu_capability=HOPPER)
    # aligned with BF16 weights: refused without a KV format, accepted with one
    with pytest.raises(QrlArgumentError, match="or --qrl-rollout-kv-cache"):
        validate_qrl_args(_parse("--qrl-train-forward", "aligned", "--qrl-rollout-engine", "sglang"),
                          gpu_capability=HOPPER)
    cfg = validate_qrl_args(_parse("--qrl-train-forward", "aligned", "--qrl-rollout-engine", "sglang",
                                   "--qrl-rollout-kv-cache", "fp8_e4m3"), gpu_capability=HOPPER)
    assert cfg["rollout"].sglang.kv_cache == "fp8_e4m3"


def test_forward_plan_carries_the_kv_state_and_the_trainer_sets_prompt_lengths():
    from megatron_qrl.rl.forward import forward_plan
    from megatron_qrl.rl.trainer import _forward_step
    from tests.helpers.te_quant_fixtures import tiny_hf

    _, arch = tiny_hf("dense")
    cfg = qrl_configs_from_args(_parse("--qrl-train-forward", "aligned", "--qrl-rollout-engine",
                                       "sglang", "--qrl-rollout-kv-cache", "fp8_e4m3"))
    plan = forward_plan(cfg, arch)
    assert plan.kv is not None and plan.kv.fmt.name == "fp8_e4m3" and plan.aligned is None
    assert forward_plan(qrl_configs_from_args(_parse("--qrl-train-forward", "aligned",
                                                     "--qrl-rollout-format", "int8")), arch).kv is None
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens, position_ids, mask):
            seen.append(plan.kv.cache_from.tolist())
            return tokens.float()

    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 2:] = True  # prompt of 3 tokens
    mask[1, 4:] = True  # prompt of 5 tokens
    batch = {"tokens": torch.zeros(2, 6, dtype=torch.long), "position_ids": torch.zeros(2, 6),
             "loss_mask": mask}
    _forward_step(iter([batch]), Model(), loss_fn=lambda b, out: out, replay=None, kv=plan.kv)
    assert seen == [[3, 5]]


def test_sglang_engine_starts_sglang_with_the_kv_arguments(tmp_path, monkeypatch):
    """SGLangEngine -> sglang.Engine(...) with a recording stand-in for sglang."""
    import json
    import types

    from megatron_qrl.rollout_sglang import crash, engine

    got = {}

    class Engine:
        def __init__(self, **kw):
            got.update(kw)

    monkeypatch.setattr(engine, "require", lambda *a, **k: types.SimpleNamespace(Engine=Engine))
    monkeypatch.setattr(crash, "install", lambda eng: False)
    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", "")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    engine.SGLangEngine(tmp_path, "bf16", SGLangOptions(kv_cache="fp8_e4m3"), trainer_device="cpu")
    assert (got["kv_cache_dtype"], got["disable_radix_cache"], got["chunked_prefill_size"]) == (
        "fp8_e4m3", True, -1)
    got.clear()
    engine.SGLangEngine(tmp_path, "bf16", SGLangOptions(), trainer_device="cpu")
    assert got["kv_cache_dtype"] == "bf16" and "disable_radix_cache" not in got
