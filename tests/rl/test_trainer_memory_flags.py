"""Megatron's memory flags in qrl-train: activation recompute, distributed optimizer, offload.

Each flag changes where memory goes, never the maths: a qrl-train job with it must reproduce
the plain job's metrics (SFT loss, grad norm, reward, KL, clip fraction) up to fp32 summation
order, on one process and at TP=2 (sequence parallel) / DP=2 under torchrun on gloo. The
distributed optimizer's checkpoint (each rank's shard of masters and moments) must resume to
the uninterrupted run. Flags that cannot work are one error naming the flag.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.config import QrlArgumentError
from megatron_qrl.config.megatron_flags import parse_megatron_flags
from megatron_qrl.data import CharTokenizer
from megatron_qrl.rl.trainer import TrainerOptions
from tests.helpers.tiny_hf import make_tiny_hf
from tests.rl.run_records import assert_records_close, read_records

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
       "--qrl-routing-replay", "off", "--qrl-sft-steps", "2", "--qrl-steps", "2",
       "--qrl-prompts-per-step", "2", "--qrl-rollout-n-samples-per-prompt", "4",
       "--qrl-rollout-max-new-tokens", "4", "--qrl-micro-batch-size", "2",
       "--qrl-save-interval", "1", "--qrl-sft-lr", "1e-5", "--qrl-no-progress"]
COMPARED = ("sft_loss", "sft_token_acc", "reward_mean", "grad_norm", "mismatch_kl", "clip_frac",
            "response_len", "sample")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
RECOMPUTE_FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1")


@pytest.mark.parametrize("argv,match", [
    (["--recompute-granularity", "full"], "--recompute-method"),
    (["--recompute-method", "block"], "--recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "selective"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "0"], ">= 1"),
    (["--optimizer-cpu-offload"], "--use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--optimizer-offload-fraction", "0.5"],
     "--optimizer-cpu-offload"),
])
def test_memory_flag_errors_name_the_flag(argv, match):
    with pytest.raises(QrlArgumentError, match=match):
        parse_megatron_flags(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-host refusals")
def test_cpu_host_refuses_offload_and_transformer_engine():
    with pytest.raises(QrlArgumentError, match="CUDA"):
        parse_megatron_flags(["--use-distributed-optimizer", "--optimizer-cpu-offload"])
    with pytest.raises(QrlArgumentError, match="--transformer-impl"):
        parse_megatron_flags(["--transformer-impl", "transformer_engine"])


def test_flags_reach_the_trainer_options_and_config():
    s, _, _ = parse_megatron_flags([*RECOMPUTE_FULL, "--use-distributed-optimizer",
                                    "--transformer-impl", "local"])
    assert dict(s.config_overrides) == {"recompute_granularity": "full",
                                        "recompute_method": "uniform", "recompute_num_layers": 1}
    opts = TrainerOptions.from_flags(s, per_token_loss=True)
    assert opts.distributed_optimizer and opts.transformer_impl == "local" and opts.per_token_loss
    assert TrainerOptions.from_flags(parse_megatron_flags([])[0]).transformer_impl == "auto"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    hf = make_tiny_hf(tmp_path_factory.mktemp("hf") / "dense", "dense")
    CharTokenizer().save(hf, hf=False)
    return hf


def _run(out: Path, hf: Path, megatron: tuple[str, ...], ranks: int = 1,
         qrl: tuple[str, ...] = ()) -> list[dict]:
    args = [*JOB, "--qrl-model", "checkpoint", "--qrl-checkpoint", str(hf), *qrl,
            "--qrl-output-dir", str(out), "--", *megatron]
    cmd = [sys.executable, "-m", "megatron_qrl.rl.cli", *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "megatron_qrl.rl.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_records(out)


@pytest.fixture(scope="module")
def plain(hf_dir, tmp_path_factory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("plain"), hf_dir, ())


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    RECOMPUTE_FULL,
    ("--recompute-granularity", "full", "--recompute-method", "block",
     "--recompute-num-layers", "1"),
    ("--recompute-granularity", "selective"),
    ("--use-distributed-optimizer",),
], ids=["full-uniform", "full-block", "selective", "distopt"])
def test_one_process_flag_equals_plain(plain, hf_dir, tmp_path, flags):
    assert_records_close(plain, _run(tmp_path, hf_dir, flags), COMPARED)


@pytest.mark.slow
def test_distributed_optimizer_resumes(plain, hf_dir, tmp_path):
    """Stop after the first RL step, resume: the second RL step equals the full run's."""
    out = tmp_path / "run"
    part = _run(out, hf_dir, ("--use-distributed-optimizer",),
                qrl=("--qrl-steps", "1"))
    assert_records_close(plain[:3], part, COMPARED)
    whole = _run(out, hf_dir, ("--use-distributed-optimizer",), qrl=("--qrl-resume",))
    assert_records_close(part, whole[:len(part)], COMPARED)  # the resume appends
    assert_records_close(plain[3:], whole[len(part):], COMPARED)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ("--tensor-model-parallel-size", "2", "--sequence-parallel", *RECOMPUTE_FULL),
    ("--use-distributed-optimizer", *RECOMPUTE_FULL),
], ids=["tp2-sp-recompute", "dp2-distopt-recompute"])
def test_two_ranks_with_flags_equal_plain(plain, hf_dir, tmp_path, flags):
    assert_records_close(plain, _run(tmp_path, hf_dir, flags, ranks=2), COMPARED)
