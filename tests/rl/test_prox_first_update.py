"""--qrl-prox-from-first-update: the first update's pi_prox is its own forward (no recompute pass).

Unset (auto) it is on wherever the update forward is pi_prox's forward; with
``--qrl-routing-replay recompute`` or ``--qrl-lora-dropout`` > 0 the run falls back to the
recompute pass (one log line), and asking for it there is an error naming both flags.
"""

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
STEP = ["--qrl-preset", "tiny-cpu", "--qrl-rollout-format", "int8", "--qrl-train-forward",
        "bf16", "--qrl-sft-steps", "0", "--qrl-steps", "2", "--qrl-prompts-per-step", "2",
        "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "6",
        "--qrl-micro-batch-size", "2", "--qrl-loss-kind", "tis", "--qrl-lr", "1e-3"]
"""In-process RL steps (no warm-up) of :func:`_rl_steps`; model, replay and updates added."""
DENSE = ["--qrl-model", "tiny-dense", "--qrl-routing-replay", "off"]
MOE_ALL = ["--qrl-model", "tiny-moe", "--qrl-routing-replay", "all"]
CASES = {"dense-tis": DENSE,
         "moe-replay-all-tis": MOE_ALL,
         "moe-aligned-replay-all-acr": [*MOE_ALL, "--qrl-train-forward", "aligned",
                                        "--qrl-loss-kind", "acr"],
         "dense-tbpo": [*DENSE, "--qrl-loss-kind", "tbpo", "--qrl-loss-aggregation",
                        "seq_mean_token_mean"],
         "dense-packed-token-budget-drop-seq": [
             *DENSE, "--qrl-pack-sequences", "--qrl-max-tokens-per-micro-batch", "64",
             "--qrl-loss-aggregation", "token_mean", "--qrl-error-tokens-action",
             "drop_sequence"]}
"""Every consumer of pi_prox on the path: decoupled TIS / ACR / TBPO, error tokens (on in
every case), the mismatch metrics, the aligned forward, routing replay, packing and
token-budget micro batches."""
PARAM_TOL = 1e-6
"""Largest |difference| allowed between the updated parameters of the two paths (fp32 CPU; the
two paths' log-probs and parameters come out bit-equal here, the bound leaves room for
another BLAS)."""


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


def test_auto_explicit_and_refusals():
    from megatron_qrl.config import prox_first_blocker, prox_from_first_update
    from megatron_qrl.rl.cli import parse_configs

    def resolved(*argv: str) -> tuple[bool, str | None]:
        configs = parse_configs(list(argv))[0]
        return prox_from_first_update(configs), prox_first_blocker(configs)

    for replay in ("all", "off"):  # unset (auto) and asked for: on
        assert resolved("--qrl-routing-replay", replay) == (True, None)
        assert resolved("--qrl-prox-from-first-update", "--qrl-routing-replay", replay)[0]
    assert resolved("--qrl-routing-replay", "all", "--no-qrl-prox-from-first-update") == (
        False, None)
    on, why = resolved("--qrl-routing-replay", "recompute")  # the tiny-cpu preset's
    assert not on and "--qrl-routing-replay recompute" in why
    lora = ["--qrl-routing-replay", "off", "--qrl-train-forward", "bf16", "--qrl-lora-rank", "4"]
    on, why = resolved(*lora, "--qrl-lora-dropout", "0.1")
    assert not on and "--qrl-lora-dropout 0.1" in why
    assert resolved(*lora)[0]  # no dropout: on
    with pytest.raises(QrlArgumentError, match="--qrl-prox-from-first-update.*"
                                               "--qrl-routing-replay recompute"):
        parse_configs(["--qrl-prox-from-first-update", "--qrl-routing-replay", "recompute"])
    with pytest.raises(QrlArgumentError, match="--qrl-prox-from-first-update.*"
                                               "--qrl-lora-dropout 0.1"):
        parse_configs(["--qrl-prox-from-first-update", *lora, "--qrl-lora-dropout", "0.1"])


def _rl_steps(argv: list[str]) -> dict:
    """Two RL steps of ``qrl-train``'s own step code in this process: the records, the
    updated parameters and the micro batches each pi_prox recompute was given."""
    from megatron_qrl.models.runtime import RankWorld
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import _build, _start_rl, prepare_job
    from megatron_qrl.rl.steps import rl_step
    from megatron_qrl.rl.sync import make_engine

    configs = parse_configs(argv)[0]
    data = prepare_job(configs)
    ctx = _build(configs, data, make_engine, None, RankWorld())
    recomputed: list[int] = []
    log_probs = ctx.trainer.log_probs

    def counted(mbs, loss_fn):  # this trainer object only
        recomputed.append(len(mbs))
        return log_probs(mbs, loss_fn)

    ctx.trainer.log_probs = counted
    try:
        _start_rl(ctx, data, 0, False)
        records = [rl_step(ctx, step, step) for step in range(2)]
    finally:
        ctx.engine.shutdown()
    params = {n: p.detach().clone() for n, p in ctx.trainer.module.named_parameters()}
    return {"records": records, "params": params, "recomputed": recomputed}


@pytest.mark.parametrize("case", list(CASES))
def test_default_one_update_runs_no_recompute_and_equals_it(megatron, case):
    """One update per step: the default runs no pi_prox forward at all, and its losses,
    metrics and updated parameters equal those of --no-qrl-prox-from-first-update."""
    argv = [*STEP, *CASES[case], "--qrl-updates-per-step", "1"]
    got = _rl_steps(argv)
    ref = _rl_steps([*argv, "--no-qrl-prox-from-first-update"])
    assert got["recomputed"] == [] and len(ref["recomputed"]) == 2  # one pass a step
    assert all(r["recomputed_tokens"] == 0 < r["trained_tokens"] for r in got["records"])
    keys = ("loss", "pg_loss", "grad_norm", "mismatch_kl", "kl_behav_prox_k3", "ratio_mean",
            "clip_frac", "tis_trunc_frac", "tbpo_seq_mask_frac", "error_token_rate",
            "error_dropped_token_frac", "entropy", "num_tokens", "sample", "routing_agreement")
    assert_records_close(ref["records"], got["records"], keys, tol=1e-6)
    if "aligned" not in case:  # int8 rollouts, BF16 trainer: pi_behav differs from pi_prox
        assert all(r["mismatch_kl"] > 0 for r in ref["records"])
    worst = max(float((got["params"][n] - p).abs().max()) for n, p in ref["params"].items())
    moved = max(float((ref["params"][n] - p).abs().max()) for n, p in
                _start_params(argv).items())
    assert worst <= PARAM_TOL < moved  # the updates moved the weights, both paths alike
    if "moe" in case:  # measured on the update forward that gave pi_prox
        assert all(r["routing_agreement"] is not None for r in got["records"])
    print(f"[prox-first] {case}: max |param diff| {worst:.3g} (updates moved {moved:.3g})")


def _start_params(argv: list[str]) -> dict:
    from megatron_qrl.models.runtime import RankWorld
    from megatron_qrl.rl.cli import parse_configs
    from megatron_qrl.rl.driver import _build, prepare_job
    from megatron_qrl.rl.sync import make_engine

    configs = parse_configs(argv)[0]
    ctx = _build(configs, prepare_job(configs), make_engine, None, RankWorld())
    ctx.engine.shutdown()
    return {n: p.detach().clone() for n, p in ctx.trainer.module.named_parameters()}


def test_two_updates_recompute_the_second_mini_batch_only(megatron):
    argv = [*STEP, *MOE_ALL, "--qrl-updates-per-step", "2"]
    got = _rl_steps(argv)
    ref = _rl_steps([*argv, "--no-qrl-prox-from-first-update"])
    assert got["recomputed"] == [2, 2] and ref["recomputed"] == [4, 4]  # 2 x 2 micro batches
    for r in got["records"]:
        assert 2 * r["recomputed_tokens"] == r["trained_tokens"]
    # the first update's pi_prox and ratio are the same either way; the second update of both
    # paths runs on the same weights and pi_prox
    assert_records_close(ref["records"], got["records"], (
        "loss", "grad_norm", "mismatch_kl", "clip_frac", "sample", "routing_agreement"),
        tol=1e-6)


FALLBACKS = {"replay-recompute": ["--qrl-model", "tiny-moe", "--qrl-routing-replay", "recompute"],
             "lora-dropout": [*DENSE, "--qrl-rollout-format", "bf16", "--qrl-lora-rank", "4",
                              "--qrl-lora-dropout", "0.1"]}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_auto_falls_back_where_the_update_forward_is_not_pi_prox(megatron, case):
    """--qrl-routing-replay recompute (the tiny-cpu preset's) / --qrl-lora-dropout > 0: every
    micro batch recomputed, as with --no-qrl-prox-from-first-update."""
    got = _rl_steps([*STEP, *FALLBACKS[case], "--qrl-updates-per-step", "1"])
    assert got["recomputed"] == [4, 4]
    assert all(r["recomputed_tokens"] == r["trained_tokens"] for r in got["records"])


def _job(out: Path, *extra: str, base: list[str] = JOB) -> tuple[list[dict], str]:
    cmd = [sys.executable, "-m", "megatron_qrl.rl.cli", *base, "--qrl-output-dir", str(out),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [r for r in read_records(out) if r["phase"] == "rl"], proc.stdout


def test_run_log_says_when_auto_falls_back(tmp_path):
    """One info line in the run log, only where auto falls back."""
    base = [*JOB[:JOB.index("--qrl-routing-replay")], *JOB[JOB.index("--qrl-sft-steps"):]]
    base = [*base, "--qrl-steps", "1", "--qrl-model", "tiny-moe"]
    _, log = _job(tmp_path / "replay", "--qrl-routing-replay", "recompute", base=base)
    line = [x for x in log.splitlines() if "pi_prox" in x]
    assert len(line) == 1 and "--qrl-prox-from-first-update unset" in line[0] and \
        "--qrl-routing-replay recompute" in line[0], log
    _, log = _job(tmp_path / "all", "--qrl-routing-replay", "all", base=base)
    assert "pi_prox" not in log


@pytest.mark.slow
def test_job_matches_the_recompute_of_every_update(tmp_path):
    ref, _ = _job(tmp_path / "ref", "--no-qrl-prox-from-first-update")
    got, _ = _job(tmp_path / "first")  # the default: the first update's own forward
    assert len(ref) == 2
    assert_records_close(ref, got, COMPARED, tol=1e-4)
    # the mismatch KL of the first update is pi_behav vs pi_prox either way: not zero
    assert all(r["mismatch_kl"] is not None for r in got)
