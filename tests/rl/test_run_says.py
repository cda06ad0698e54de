"""A run says what it does: the LoRA setup and the adapter bytes of each sync, how the
engine serves a step's requests; and the first LoRA refusal suggests flags that pass."""

from __future__ import annotations

import pytest

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.rl.cli import parse_configs

SMALL = ["--qrl-sft-steps", "1", "--qrl-prompts-per-step", "2",
         "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
         "--qrl-micro-batch-size", "8", "--qrl-updates-per-step", "1", "--qrl-lr", "1e-3",
         "--qrl-no-progress", "--no-qrl-tensorboard", "--qrl-steps", "2"]


def test_the_first_lora_refusal_suggests_flags_that_pass():
    with pytest.raises(QrlArgumentError) as info:
        parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-lora-rank", "8"])
    msg = str(info.value)
    assert "--qrl-lora-base-format int8" not in msg
    fixes = [["--qrl-train-forward", "bf16"],
             ["--qrl-rollout-format", "w4a16", "--qrl-lora-base-format", "w4a16"]]
    for fix in fixes:
        assert " ".join(fix) in msg
        parse_configs(["--qrl-preset", "tiny-cpu", "--qrl-lora-rank", "8", *fix])


@pytest.mark.slow
def test_a_lora_run_prints_its_setup_and_logs_adapter_bytes(tmp_path):
    from megatron_qrl.models.runtime import single_process_megatron
    from megatron_qrl.rl.driver import run_job

    configs, flags, _ = parse_configs(["--qrl-preset", "tiny-cpu,qerl", *SMALL,
                                       "--qrl-output-dir", str(tmp_path / "run")])
    said: list[str] = []
    with single_process_megatron():
        recs = run_job(configs, flags, progress=False, log=said.append)
    lora = [m for m in said if m.startswith("[qrl-train] LoRA:")]
    assert len(lora) == 1, said
    assert "rank 32" in lora[0] and "q_proj" in lora[0] and "base format nvfp4" in lora[0]
    assert "trainable in RL:" in lora[0] and "%" in lora[0]
    assert any(m.startswith("[qrl-train] rollout: 8 requests per step") for m in said), said
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["sync_adapter_bytes"] > 0 for r in rl] == [True, True]
    assert rl[0]["sync_adapter_bytes"] == rl[1]["sync_adapter_bytes"]
    assert all("sync_adapter_bytes" not in r for r in recs if r["phase"] == "sft")
