"""qrl-train end to end on the tiny model (test engine double), resume, bad flags.

The job is the tiny-cpu preset (INT8 rollouts, aligned forward, routing replay in the
recompute, ACR) made small. Each job runs in a subprocess (``tests/helpers/rl_run_helper.py``): megatron's process group and the
CPU shim stay out of the pytest process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from megatron_qrl.rl.cli import parse_configs
from megatron_qrl.utils.metrics import REQUIRED_KEYS
from tests.helpers import RL_RUN_HELPER

HELPER = RL_RUN_HELPER
TINY = ["--qrl-preset", "tiny-cpu", "--qrl-sft-steps", "4", "--qrl-prompts-per-step", "2",
        "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
        "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "2", "--qrl-save-interval", "0",
        "--qrl-lr", "1e-3", "--qrl-no-progress"]
TIMING = ("time_rollout_s", "time_recompute_s", "time_train_s", "time_sync_s", "time_step_s")


def _run(out: Path, *extra: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HELPER), *TINY, "--qrl-output-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _strip(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING}


def _model(out: Path, step: int) -> dict:
    state = torch.load(out / "checkpoints" / f"step_{step:06d}.pt", weights_only=False)
    return state["trainer"]["model"]


@pytest.mark.slow
def test_tiny_job_end_to_end_and_resume_reproduces_next_step(tmp_path):
    full = _run(tmp_path / "full", "--qrl-steps", "3")
    assert [r["phase"] for r in full] == ["sft"] * 4 + ["rl"] * 3
    assert [r["step"] for r in full] == list(range(7))
    for r in full:
        assert set(REQUIRED_KEYS) <= set(r)
    rl = full[4:]
    assert all(r["mismatch_kl"] is not None and r["mismatch_kl"] >= 0 for r in rl)
    assert full[0]["sft_loss"] > full[3]["sft_loss"]  # the warm-up learns
    assert (tmp_path / "full" / "metrics.png").is_file()

    part = tmp_path / "part"
    _run(part, "--qrl-steps", "2")
    resumed = _run(part, "--qrl-steps", "3", "--qrl-resume")
    assert [r["step"] for r in resumed] == list(range(7))
    assert _strip(resumed[6]) == _strip(full[6])
    a, b = _model(tmp_path / "full", 7), _model(part, 7)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and the RL steps did change the weights
    assert any(not torch.equal(a[k], _model(tmp_path / "full", 4)[k]) for k in a)


def test_resume_without_checkpoint_and_changed_flags(tmp_path):
    from megatron_qrl.rl.checkpoint import load_driver_checkpoint, save_driver_checkpoint

    with pytest.raises(FileNotFoundError, match="--qrl-resume"):
        load_driver_checkpoint(tmp_path, {})
    save_driver_checkpoint(tmp_path, 3, {"model": {}}, {"qrl_lr": 1e-3, "qrl_steps": 5})
    assert load_driver_checkpoint(tmp_path, {"qrl_lr": 1e-3, "qrl_steps": 9})["next_step"] == 3
    with pytest.raises(ValueError, match="--qrl-lr"):
        load_driver_checkpoint(tmp_path, {"qrl_lr": 2e-3, "qrl_steps": 5})


@pytest.mark.parametrize("argv, match", [
    (["--qrl-mode", "colocated", "--", "--tensor-model-parallel-size", "2"],
     "--qrl-mode colocated"),
    (["--qrl-compare", "--qrl-resume"], "--qrl-compare cannot be combined"),
    (["--", "--num-layers", "2", "--tp", "2"], "Megatron flags after '--': --tp 2 not supported"),
    (["--", "--tensor-model-parallel-size", "2"], "torchrun --nproc-per-node 2"),
    (["--qrl-rollout-engine", "sglang"], "--qrl-rollout-engine sglang"),
    (["--qrl-loss-kind", "tbpo", "--qrl-loss-aggregation", "token_mean"], "--qrl-loss-aggregation"),
    (["--qrl-micro-batch-size", "5"], "--qrl-micro-batch-size"),
])
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(QrlArgumentError, match=match):
        parse_configs(argv)


def test_cli_defaults_to_tiny_cpu_preset():
    configs, flags, _ = parse_configs([])
    assert flags["qrl_preset"] == "tiny-cpu"
    assert configs["rollout"].format == "int8" and configs["run"].sft_steps > 0


def test_forward_plan_follows_the_flags():
    from megatron_qrl.data import CharTokenizer, tiny_dense_config, tiny_moe_config
    from megatron_qrl.models import arch_from_dict
    from megatron_qrl.rl.forward import forward_plan

    vocab = CharTokenizer().vocab_size
    moe, dense = arch_from_dict(tiny_moe_config(vocab)), arch_from_dict(tiny_dense_config(vocab))
    configs, _, _ = parse_configs([])
    assert configs["train"].forward == "aligned" and configs["routing"].replay == "recompute"
    plan = forward_plan(configs, moe)
    assert plan.spec_hook is not None and plan.aligned is not None
    assert plan.replay is not None and plan.replay.mode == "recompute"
    assert plan.aligned.spec.name == "int8"
    plain, _, _ = parse_configs(["--qrl-model", "tiny-dense", "--qrl-train-forward", "bf16",
                                 "--qrl-routing-replay", "off"])
    p = forward_plan(plain, dense)
    assert p.spec_hook is None and p.aligned is None and p.replay is None
    version = plan.aligned.version
    plan.weights_changed()
    assert plan.aligned.version == version + 1


def test_existing_output_dir_is_a_one_line_error(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, str(HELPER), "--double", *TINY, "--qrl-sft-steps", "1",
            "--qrl-steps", "0", "--qrl-output-dir", str(out)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert "qrl-train: error:" in again.stderr and "--qrl-resume" in again.stderr
    assert "Traceback" not in again.stderr
