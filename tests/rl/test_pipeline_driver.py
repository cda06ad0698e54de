"""qrl-train with ``--pipeline-model-parallel-size 2`` under torchrun (gloo), and its refusals.

End to end: the tiny Qwen3-MoE HF checkpoint (``-- --load DIR``; routing replay on the
recompute, BF16 rollouts, one process as the reference) trained for two warm-up and two RL
steps on two pipeline stages: every record (SFT loss and accuracy, reward, grad norm, mismatch
KL, routing agreement, entropy, samples — which depend on the weights each sync streamed from
both stages into the engine) equals the one-process run's up to fp32 summation order. The
run is cut after the first RL step and resumed on PP 2 from its checkpoint (every stage's
state in one file): the resumed step equals the uninterrupted run's. Tolerances as in
tests/rl/test_rl_multirank.py (1e-5 relative; lr 1e-5, aux loss off). PP 2 x TP 2 and
PP 2 x EP 2 (4 ranks) match the same run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qrl.compat.distributed import free_port
from megatron_qrl.config import QrlArgumentError
from megatron_qrl.data import CharTokenizer
from megatron_qrl.models.stages import PipelineStage, global_name, is_tied_output_copy
from tests.helpers import RL_RUN_HELPER
from tests.helpers.tiny_hf import make_tiny_hf
from tests.rl.run_records import assert_records_close, read_records

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-rollout-format", "bf16", "--qrl-train-forward", "bf16",
       "--qrl-sft-steps", "2", "--qrl-prompts-per-step", "2",
       "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
       "--qrl-micro-batch-size", "2", "--qrl-updates-per-step", "1", "--qrl-save-interval", "1",
       "--qrl-sft-lr", "1e-5", "--qrl-no-progress", "--no-qrl-tensorboard"]
COMPARED = ("sft_loss", "sft_token_acc", "reward_mean", "accuracy", "grad_norm", "mismatch_kl",
            "routing_agreement", "clip_frac", "entropy", "response_len", "sample")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def test_stage_names():
    stage = PipelineStage.of(1, 2, 4)
    assert (stage.layer_offset, stage.first, stage.last) == (2, False, True)
    assert global_name("module.decoder.layers.1.mlp.linear_fc1.weight", stage) == \
        "module.decoder.layers.3.mlp.linear_fc1.weight"
    assert global_name("decoder.final_layernorm.weight", stage) == "decoder.final_layernorm.weight"
    assert global_name("decoder.layers.1.x", None) == "decoder.layers.1.x"
    assert is_tied_output_copy("output_layer.weight", True, stage)
    assert not is_tied_output_copy("output_layer.weight", False, stage)
    assert not is_tied_output_copy("output_layer.weight", True, PipelineStage())
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 3 must divide"):
        PipelineStage.of(0, 3, 4)


def test_refusals_name_the_flag():
    from megatron_qrl.rl.cli import parse_configs

    pp = ["--", "--pipeline-model-parallel-size", "2"]
    for flags, named in ((["--qrl-pack-sequences"], "--qrl-pack-sequences"),
                         (["--qrl-max-tokens-per-micro-batch", "64"],
                          "--qrl-max-tokens-per-micro-batch"),
                         (["--qrl-log-prob-max-tokens", "64"], "--qrl-log-prob-max-tokens"),
                         (["--qrl-uaq-scale", "1.5", "--qrl-lr", "1e-6"], "--qrl-uaq-scale 1.5")):
        with pytest.raises(QrlArgumentError, match=f"{named}.*--pipeline-model-parallel-size 2"):
            parse_configs([*flags, *pp])
    for virtual in ("--num-layers-per-virtual-pipeline-stage",
                    "--num-virtual-stages-per-pipeline-rank"):
        with pytest.raises(QrlArgumentError, match=f"{virtual} 1: .*non-interleaved 1F1B.*"
                                                   "takes V chunks per rank"):
            parse_configs([*pp, virtual, "1"])
    lora = ["--qrl-model", "tiny-dense", "--qrl-routing-replay", "off", "--qrl-train-forward",
            "bf16", "--qrl-lora-rank", "4"]  # LoRA streams its stages (rl.lora_sync)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WORLD_SIZE", "2")  # (torchrun's two ranks: one a stage)
        assert parse_configs([*lora, *pp])[0]["lora"].enabled
    with pytest.raises(QrlArgumentError, match="--pipeline-model-parallel-size 2 .*divisible "
                                               "by 2.*--nproc-per-node 2"):
        parse_configs(pp)  # one process cannot hold two stages
    with pytest.raises(QrlArgumentError, match="--pipeline-model-parallel-size must be >= 1"):
        parse_configs(["--", "--pipeline-model-parallel-size", "0"])


def test_layout_of_the_flags():
    from megatron_qrl.config.megatron_flags import parse_megatron_flags
    from megatron_qrl.models.builder import ParallelLayout
    from megatron_qrl.models.hf_config import arch_from_dict
    from tests.helpers.tiny_hf import tiny_config

    settings = parse_megatron_flags(["--pipeline-model-parallel-size", "2",
                                     "--tensor-model-parallel-size", "2"])[0]
    assert settings.layout().pp == 2 and settings.model_parallel_size == 4
    assert settings.describe() == "tp=2,ep=1,etp=2,sp=0,pp=2"
    settings.check_world(4)
    with pytest.raises(QrlArgumentError, match="divisible by 4"):
        settings.check_world(2)
    assert parse_megatron_flags([])[0].describe() == "tp=1,ep=1,etp=1,sp=0"  # (old checkpoints)
    with pytest.raises(ValueError, match="pp=3 must divide num_hidden_layers=2"):
        ParallelLayout(pp=3).check(arch_from_dict(tiny_config("dense"), source="tiny"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    hf = make_tiny_hf(tmp_path_factory.mktemp("hf") / "moe", "moe", router_aux_loss_coef=0.0)
    CharTokenizer().save(hf, hf=False)
    return hf


def _run(out: Path, qrl: tuple[str, ...], megatron: tuple[str, ...], ranks: int) -> list[dict]:
    head = [sys.executable, str(RL_RUN_HELPER)] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m",
        "megatron_qrl.rl.cli"]
    proc = subprocess.run([*head, *JOB, *qrl, "--qrl-output-dir", str(out), "--", *megatron],
                          capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_records(out)


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory) -> list[dict]:
    """The one-process run: two warm-up and two RL steps."""
    ref = _run(tmp_path_factory.mktemp("one") / "run", (),
               ("--load", str(hf_dir), "--lr", "1e-5", "--train-iters", "2"), 1)
    assert [r["phase"] for r in ref] == ["sft", "sft", "rl", "rl"]
    return ref


@pytest.mark.slow
def test_pp2_matches_one_process_and_resumes(hf_dir, reference, tmp_path):
    import torch

    layout, ref = ("--load", str(hf_dir), "--lr", "1e-5"), reference
    pp = ("--pipeline-model-parallel-size", "2")
    part = _run(tmp_path / "pp", (), (*layout, "--train-iters", "1", *pp), 2)
    assert_records_close(ref[:3], part, COMPARED, skip_missing=True)
    state = torch.load(tmp_path / "pp" / "checkpoints" / "step_000003.pt", weights_only=False)
    assert state["flags"]["megatron_layout"] == "tp=1,ep=1,etp=1,sp=0,pp=2"
    first, last = (set(s["model"]) for s in state["rank_states"])
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert "decoder.layers.1.self_attention.linear_qkv.weight" not in first | last  # 1 a stage
    resumed = _run(tmp_path / "pp", ("--qrl-resume",), (*layout, "--train-iters", "2", *pp), 2)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert_records_close(ref[3:], resumed[3:], COMPARED, skip_missing=True)


@pytest.mark.slow
@pytest.mark.parametrize("other", [("--tensor-model-parallel-size", "2", "--sequence-parallel"),
                                   ("--expert-model-parallel-size", "2")], ids=["tp2", "ep2"])
def test_pp2_times_tp2_or_ep2_matches_one_process(hf_dir, reference, tmp_path, other):
    """4 ranks: PP 2 x TP 2 (sequence parallel), PP 2 x EP 2 (data parallel 2 for the dense
    layers: each rank trains half of every step's micro batches); one RL step."""
    got = _run(tmp_path / "run", (), ("--load", str(hf_dir), "--lr", "1e-5", "--train-iters", "1",
                                      "--pipeline-model-parallel-size", "2", *other), 4)
    assert_records_close(reference[:3], got, COMPARED, skip_missing=True)


@pytest.mark.slow
def test_lora_pp2_matches_one_process(hf_dir, tmp_path):
    """LoRA (adapters on each stage, the frozen base and then adapters streamed stage by stage
    into the engine by ``rl.lora_sync``): warm-up and one RL step on PP 2 equal the
    one-process run (refused before the LoRA sync streamed stages): the RL step's samples and
    rewards come from the engine the stages synced. Not the grad norm: each stage draws its
    adapters' A from the seeded RNG in its own build order, so the runs hold other A (B = 0:
    the same policy until the first update; tests/rl/test_pipeline_parity.py sets A by name
    and compares the gradients and the update)."""
    lora = ("--qrl-lora-rank", "4")
    layout = ("--load", str(hf_dir), "--lr", "1e-5", "--train-iters", "1")
    ref = _run(tmp_path / "one", lora, layout, 1)
    got = _run(tmp_path / "pp", lora, (*layout, "--pipeline-model-parallel-size", "2"), 2)
    assert [r["phase"] for r in got] == ["sft", "sft", "rl"]
    assert_records_close(ref, got, [k for k in COMPARED if k != "grad_norm"],
                         skip_missing=True)
