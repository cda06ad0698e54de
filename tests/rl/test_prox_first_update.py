"""--qrl-prox-from-first-update: the first update's pi_prox is its own forward (no recompute pass)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import QrlArgumentError
from tests.helpers.mp_utils import run_distributed
from tests.rl.run_records import assert_records_close, read_records

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-model", "tiny-dense", "--qrl-rollout-format", "bf16",
       "--qrl-train-forward", "bf16", "--qrl-routing-replay", "off", "--qrl-sft-steps", "2",
       "--qrl-steps", "2", "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt",
       "4", "--qrl-rollout-max-new-tokens", "6", "--qrl-micro-batch-size", "2",
       "--qrl-updates-per-step", "2", "--qrl-loss-kind", "tis", "--qrl-save-interval", "-1",
       "--qrl-sft-lr", "1e-5", "--qrl-no-progress", "--no-qrl-tensorboard"]
COMPARED = ("reward_mean", "grad_norm", "mismatch_kl", "clip_frac", "response_len", "sample",
            "error_token_rate", "rollout_nll")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _loss_body(rank, world_size, port):
    from megatron_qrl.compat import cpu_device_mode, destroy_cpu_distributed, init_cpu_distributed
    from megatron_qrl.losses import ErrorTokenConfig, PolicyLossConfig
    from megatron_qrl.losses.megatron_adapter import PolicyLossFunc

    init_cpu_distributed(rank, world_size, port, tp=1, seed=1234)
    try:
        with cpu_device_mode():
            g = torch.Generator().manual_seed(0)
            logits = torch.randn(3, 9, 40, generator=g) * 3
            labels = torch.randint(0, 40, (3, 9), generator=g)
            mask = torch.rand(3, 9, generator=g) > 0.3
            fn = PolicyLossFunc(PolicyLossConfig(kind="tis"), ErrorTokenConfig(tau=-3.0),
                                return_num_tokens=True)
            lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
            batch = {"labels": labels, "loss_mask": mask, "advantages": torch.randn(3, generator=g),
                     "rollout_log_probs": lp + 0.4 * torch.randn(3, 9, generator=g)}
            out = []
            for old in (None, lp):
                x = logits.clone().requires_grad_()
                loss, _, metrics = fn({**batch, "old_log_probs": old}, x)
                (grad,) = torch.autograd.grad(loss, x)
                out.append({"loss": loss.detach(), "grad": grad,
                            **{k: v for k, v in metrics.items()}})
        return out
    finally:
        destroy_cpu_distributed()


def test_none_means_this_forwards_own_log_probs():
    ((none, given),) = run_distributed(_loss_body, 1)
    assert none.keys() == given.keys()
    for key in none:
        torch.testing.assert_close(none[key], given[key], rtol=1e-5, atol=1e-6, msg=key)
    assert none["grad"].abs().sum() > 0


def test_refused_with_routing_replay_in_the_recompute_only():
    from megatron_qrl.rl.cli import parse_configs

    for replay in ("all", "off"):
        run = parse_configs(["--qrl-prox-from-first-update", "--qrl-routing-replay", replay])
        assert run[0]["run"].prox_from_first_update
    with pytest.raises(QrlArgumentError, match="--qrl-prox-from-first-update"):
        parse_configs(["--qrl-prox-from-first-update", "--qrl-routing-replay", "recompute"])


def _job(out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megatron_qrl.rl.cli", *JOB, "--qrl-output-dir", str(out),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [r for r in read_records(out) if r["phase"] == "rl"]


@pytest.mark.slow
def test_job_matches_the_recompute_of_every_update(tmp_path):
    ref = _job(tmp_path / "ref")
    got = _job(tmp_path / "first", "--qrl-prox-from-first-update")
    assert len(ref) == 2
    assert_records_close(ref, got, COMPARED, tol=1e-4)
    # the mismatch KL of the first update is pi_behav vs pi_prox either way: not zero
    assert all(r["mismatch_kl"] is not None for r in got)
