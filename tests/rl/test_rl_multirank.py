"""qrl-train under torchrun: 2 ranks at TP=2 (sequence parallel) and EP=2 on gloo.

Every job starts from the same tiny HF Qwen3-MoE checkpoint (``-- --load DIR``), so the
multi-rank runs must reproduce the one-process run's metrics (SFT loss, reward, grad norm,
mismatch KL, routing agreement) up to fp32 summation order. The jobs use the BF16 training
forward at lr 1e-5: quantized (fake-quant) forwards turn fp32 reduction-order noise into
whole quantization steps, and Adam's first steps are sign-like, so a bit-level difference in
a near-zero gradient moves a weight by the full lr. The router aux-loss coefficient is 0:
sequence parallelism pads the sequence to a multiple of TP, and the padding tokens would
enter the load-balancing loss. EP=2 on 2 ranks is also data-parallel 2 for the dense layers,
so each rank trains on half of every step's micro batches. A part + resume EP=2 run must
equal the full EP=2 run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.data import CharTokenizer
from tests.helpers import RL_RUN_HELPER
from tests.helpers.tiny_hf import make_tiny_hf
from tests.rl.run_records import assert_records_close, read_records

ROOT = Path(__file__).resolve().parents[2]
HELPER = RL_RUN_HELPER
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
       "--qrl-sft-steps", "2", "--qrl-prompts-per-step", "2",
       "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
       "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "1", "--qrl-save-interval", "1",
       "--qrl-sft-lr", "1e-5", "--qrl-no-progress"]
COMPARED = ("sft_loss", "sft_token_acc", "reward_mean", "accuracy", "grad_norm", "mismatch_kl",
            "routing_agreement", "clip_frac", "entropy", "response_len", "sample")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    hf = make_tiny_hf(tmp_path_factory.mktemp("hf") / "moe", "moe", router_aux_loss_coef=0.0)
    CharTokenizer().save(hf, hf=False)
    return hf


def _one_process(out: Path, *megatron: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(HELPER), *JOB, "--qrl-output-dir", str(out),
                           "--", *megatron], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_records(out)


def _torchrun(out: Path, qrl: tuple[str, ...], *megatron: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "megatron_qrl.rl.cli", *JOB, *qrl, "--qrl-output-dir", str(out), "--", *megatron]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_records(out)


@pytest.mark.slow
def test_tp2_and_ep2_match_one_process_and_ep2_resumes(hf_dir, tmp_path):
    ref = _one_process(tmp_path / "one", "--load", str(hf_dir), "--lr", "1e-5",
                       "--train-iters", "2")
    assert [r["phase"] for r in ref] == ["sft", "sft", "rl", "rl"]
    assert all(r["routing_agreement"] == 1.0 for r in ref[2:])  # replay on the recompute
    layout = ("--load", str(hf_dir), "--lr", "1e-5", "--train-iters", "2")
    tp = _torchrun(tmp_path / "tp", (), *layout, "--tensor-model-parallel-size", "2",
                   "--sequence-parallel")
    assert_records_close(ref, tp, COMPARED, skip_missing=True)
    ep = _torchrun(tmp_path / "ep", (), *layout, "--expert-model-parallel-size", "2")
    assert_records_close(ref, ep, COMPARED, skip_missing=True)
    # checkpoints: one file per step with every rank's state; resume continues exactly
    import torch

    state = torch.load(tmp_path / "ep" / "checkpoints" / "step_000004.pt", weights_only=False)
    assert len(state["rank_states"]) == 2 and state["flags"]["megatron_layout"] == \
        "tp=1,ep=2,etp=1,sp=0"
    experts = [k for k in state["rank_states"][1]["model"] if ".experts." in k]
    assert experts and all(not k.endswith("local_experts.4.linear_fc1.weight") for k in experts)
    part = tmp_path / "part"
    _torchrun(part, (), "--load", str(hf_dir), "--lr", "1e-5", "--train-iters", "1",
              "--expert-model-parallel-size", "2")
    resumed = _torchrun(part, ("--qrl-resume",), *layout, "--expert-model-parallel-size", "2")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert_records_close(ep[3:], resumed[3:], COMPARED, tol=0.0, skip_missing=True)


def test_data_parallel_share_of_micro_batches():
    from megatron_qrl.models.runtime import RankWorld

    mbs = list(range(8))
    assert RankWorld().local(mbs, 2) is mbs
    assert RankWorld(1, 4, dp_rank=1, dp_size=2).local(mbs, 2) == [2, 3, 6, 7]
    assert RankWorld(0, 4, dp_rank=0, dp_size=4).local(mbs, 1) == [0, 1]
    with pytest.raises(ValueError, match="--qrl-micro-batch-size"):
        RankWorld(0, 2, dp_rank=0, dp_size=2).local(list(range(6)), 2)
