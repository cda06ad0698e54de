"""qrl-train with LoRA end to end (reference engine): QeRL and QLoRA modes, resume, bad flags,
tools/merge_lora.py. Jobs run in subprocesses (tests/helpers/rl_run_helper.py), as test_rl_driver.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.rl.cli import parse_configs
from tests.helpers import RL_RUN_HELPER

ROOT = Path(__file__).resolve().parents[2]
HELPER = RL_RUN_HELPER
SMALL = ["--qrl-sft-steps", "4", "--qrl-prompts-per-step", "2",
         "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
         "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "2", "--qrl-save-interval", "0",
         "--qrl-lr", "1e-3", "--qrl-no-progress"]
TIMING = ("time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s", "time_step_s")


def _run(out: Path, preset: str, *extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HELPER), "--qrl-preset", preset, *SMALL,
                           "--qrl-output-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _state(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step_{step:06d}.pt", weights_only=False)


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING}


@pytest.mark.slow
def test_qerl_runs_resumes_and_trains_adapters_only(tmp_path):
    full = _run(tmp_path / "full", "tiny-cpu,qerl", "--qrl-steps", "3")
    assert [r["phase"] for r in full] == ["sft"] * 4 + ["rl"] * 3
    rl = full[4:]
    # the trainer's NVFP4 base + adapter is what the engine computes (AQN is 0 in stage 0)
    assert rl[0]["mismatch_kl"] is not None and rl[0]["mismatch_kl"] < 1e-6
    # AQN's schedule spans --qrl-steps, so a shorter first run is another run: compare
    # resumption without it
    full = _run(tmp_path / "full2", "tiny-cpu,qerl", "--qrl-steps", "3", "--no-qrl-aqn-enabled")
    part = tmp_path / "part"
    _run(part, "tiny-cpu,qerl", "--qrl-steps", "2", "--no-qrl-aqn-enabled")
    resumed = _run(part, "tiny-cpu,qerl", "--qrl-steps", "3", "--qrl-resume",
                   "--no-qrl-aqn-enabled")
    assert _strip(resumed[-1]) == _strip(full[-1])
    a, b = _state(tmp_path / "full2", 7)["trainer"]["model"], _state(part, 7)["trainer"]["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # RL changed the adapters and nothing else (the frozen base codes are the RL start's)
    start = _state(part, 6)["trainer"]["model"]
    changed = {k for k in a if not torch.equal(a[k], start[k])}
    assert changed and all(".lora_B." in k or ".lora_A." in k for k in changed)
    assert any(".qrl_base.codes" in k for k in a)
    assert not any(k.endswith("linear_qkv.weight") for k in a)  # no bf16 copy of the base


@pytest.mark.slow
def test_qlora_mode_runs_and_merge_tool_writes_hf(tmp_path):
    out = tmp_path / "qlora"
    recs = _run(out, "tiny-cpu,rlquant-qlora", "--qrl-steps", "2")
    assert recs[-1]["phase"] == "rl" and recs[-1]["mismatch_kl"] < 1e-6
    state = _state(out, 6)["trainer"]["model"]
    assert any(k.endswith("qrl_base.absmax_q") for k in state)
    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "merge_lora.py"), "--run-dir",
                           str(out), "--out", str(merged)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    tensors = {}
    for f in merged.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    assert (merged / "config.json").is_file() and "model.layers.0.self_attn.q_proj.weight" in tensors
    assert not any("lora" in k for k in tensors)


@pytest.mark.parametrize("argv, match", [
    (["--qrl-preset", "tiny-cpu,qerl", "--qrl-lora-base-format", "nf4"],
     "--qrl-lora-base-format must be the rollout's"),
    (["--qrl-preset", "tiny-cpu,qerl", "--qrl-rollout-format", "int8",
      "--qrl-lora-base-format", "int8"], "do not quantize activations"),
    (["--qrl-preset", "tiny-cpu,qerl", "--qrl-lora-experts"], "fused experts"),
    (["--qrl-preset", "tiny-cpu,qerl", "--qrl-uaq-scale", "1.5"], "UAQ rescales the base"),
    (["--qrl-preset", "tiny-cpu,qerl", "--qrl-mode", "colocated"], "does not serve LoRA"),
    (["--qrl-lora-rank", "4", "--qrl-lora-targets", "q_proj", "--qrl-lora-experts"],
     "gate_proj, up_proj and down_proj"),
    (["--qrl-lora-rank", "4", "--qrl-lora-targets", "qkv"], "unknown qkv"),
    (["--qrl-lora-rank", "4", "--qrl-lora-dropout", "1.0"], "--qrl-lora-dropout"),
    (["--qrl-lora-rank", "-1"], "--qrl-lora-rank"),
])
def test_bad_lora_flags_are_one_clear_error(argv, match):
    with pytest.raises((QrlArgumentError, SystemExit, ValueError), match=match):
        parse_configs(argv)


@pytest.mark.slow
def test_expert_adapters_take_the_merge_path_on_the_reference_engine(tmp_path):
    """--qrl-lora-experts on the reference engine (fused experts): the expert adapters are
    merged into its NVFP4 base and re-quantized each sync, attention adapters served on top
    (rollout/lora_serving.py); with B = 0 at the RL start the engine computes the trainer's
    policy, and RL moves the expert adapters."""
    out = tmp_path / "experts"
    recs = _run(out, "tiny-cpu,qerl", "--qrl-lora-experts", "--qrl-train-forward", "bf16",
                "--no-qrl-aqn-enabled", "--qrl-steps", "2")
    rl = [r for r in recs if r["phase"] == "rl"]
    assert len(rl) == 2 and rl[0]["mismatch_kl"] < 1e-6
    a, start = _state(out, 6)["trainer"]["model"], _state(out, 4)["trainer"]["model"]
    moved = {k for k in a if ".lora_B." in k and k in start and not torch.equal(a[k], start[k])}
    assert any(".experts." in k for k in moved) and any("linear_qkv" in k for k in moved)
