"""qrl-train --qrl-model checkpoint: HF and megatron_qrl starting checkpoints, their tokenizers,
the UAQ-once rule; the routing-agreement metric; the SFT panel of the metrics PNG.

RL jobs run in a subprocess (``tests/helpers/rl_run_helper.py``, the reference engine) like
tests/rl/test_rl_driver.py: megatron's process group stays out of the pytest process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_qrl.data import CharTokenizer
from megatron_qrl.rl.cli import parse_configs
from tests.helpers import RL_RUN_HELPER
from tests.helpers.tiny_hf import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]
HELPER = RL_RUN_HELPER
JOB = ["--qrl-preset", "tiny-cpu", "--qrl-prompts-per-step", "2",
       "--qrl-rollout-n-samples-per-prompt", "4", "--qrl-rollout-max-new-tokens", "4",
       "--qrl-micro-batch-size", "4", "--qrl-updates-per-step", "2", "--qrl-save-interval", "0",
       "--qrl-lr", "1e-3", "--qrl-no-progress", "--qrl-steps", "2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(ckpt: Path, out: Path, *extra: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(HELPER), *JOB, "--qrl-model", "checkpoint",
                           "--qrl-checkpoint", str(ckpt), "--qrl-output-dir", str(out), *extra],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_rl(recs: list[dict], n_sft: int) -> None:
    assert [r["phase"] for r in recs] == ["sft"] * n_sft + ["rl"] * 2
    for r in recs[n_sft:]:
        assert r["reward_mean"] is not None and r["mismatch_kl"] >= 0.0
        assert 0.0 <= r["routing_agreement"] <= 1.0  # the tiny HF model is MoE


def _check_start_weights(out: Path, hf: Path) -> None:
    """The trainer after one SFT step at lr 1e-12 holds the checkpoint's weights."""
    model = torch.load(out / "checkpoints" / "step_000001.pt",
                       weights_only=False)["trainer"]["model"]
    ref = load_file(hf / "model.safetensors")
    for ours, theirs in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("output_layer.weight", "lm_head.weight"),
                         ("decoder.final_layernorm.weight", "model.norm.weight")):
        torch.testing.assert_close(model[ours], ref[theirs], atol=1e-6, rtol=0)


def test_hf_dir_with_char_tokenizer_file_starts_from_its_weights(tmp_path):
    hf = make_tiny_hf(tmp_path / "hf", "moe")  # vocab 128 >= the char tokenizer's 100
    CharTokenizer().save(hf, hf=False)  # only qrl_char_tokenizer.json: no HF vocabulary
    _check_rl(_run(hf, tmp_path / "out", "--qrl-sft-steps", "1", "--qrl-sft-lr", "1e-12"), 1)
    _check_start_weights(tmp_path / "out", hf)


def test_megatron_checkpoint_with_hf_tokenizer(tmp_path):
    hf = make_tiny_hf(tmp_path / "hf", "moe", seed=3)
    CharTokenizer().save(hf, hf=True)  # tokenizer.json travels into ckpt/hf/
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_hf_to_megatron.py"),
                           "--hf-dir", str(hf), "--out", str(ckpt)],
                          capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "hf" / "tokenizer.json").is_file()
    _check_rl(_run(ckpt, tmp_path / "out", "--qrl-sft-steps", "1", "--qrl-sft-lr", "1e-12"), 1)
    _check_start_weights(tmp_path / "out", hf)


def _configs(ckpt: Path, *argv: str) -> dict:
    configs, _, _ = parse_configs(["--qrl-train-forward", "bf16", "--qrl-routing-replay", "off",
                                   *argv])
    configs["run"].model, configs["run"].checkpoint = "checkpoint", str(ckpt)
    return configs


def test_directory_without_tokenizer_is_a_clear_error(tmp_path):
    from megatron_qrl.rl.driver import prepare_job

    hf = make_tiny_hf(tmp_path / "hf", "moe")  # tokenizer_config.json only: no vocabulary
    with pytest.raises(FileNotFoundError, match="no tokenizer") as err:
        prepare_job(_configs(hf))
    assert str(hf) in str(err.value) and "qrl_char_tokenizer.json" in str(err.value)


def test_hf_tokenizer_is_used_before_the_char_file(tmp_path):
    from megatron_qrl.rl.driver import prepare_job
    from megatron_qrl.rl.start_model import HFTokenizer

    hf = make_tiny_hf(tmp_path / "hf", "moe")
    CharTokenizer().save(hf, hf=True)
    job = prepare_job(_configs(hf))
    assert isinstance(job.tokenizer, HFTokenizer) and job.arch.is_moe and job.start.kind == "hf"
    char = CharTokenizer()
    assert job.tokenizer.encode("12+3=") == char.encode("12+3=")
    assert (job.tokenizer.bos_id, job.tokenizer.eos_id) == (char.bos_id, char.eos_id)


def test_uaq_is_not_applied_twice(tmp_path):
    from megatron_qrl.quant.uaq import AlreadyScaledError
    from megatron_qrl.rl.driver import prepare_job

    hf = make_tiny_hf(tmp_path / "hf", "moe")
    CharTokenizer().save(hf, hf=False)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "megatron_qrl_uaq_scale": 1.5}))
    assert prepare_job(_configs(hf)).start.uaq_scale == 1.5  # UAQ off: fine
    with pytest.raises(AlreadyScaledError, match="already UAQ-scaled"):
        prepare_job(_configs(hf, "--qrl-uaq-scale", "1.5", "--qrl-lr", "1e-6"))


def test_routing_counts_closed_form():
    from megatron_qrl.moe import RoutingReplay
    from megatron_qrl.rl.trainer import _routing_counts

    # batch 1, seq 3, 2 layers, top-2; megatron order == rollout order for batch 1
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[-1, -1], [-1, -1]]]])
    replay = RoutingReplay("off", 8, 2)
    replay.recorded = {0: torch.tensor([[1, 0], [4, 6], [0, 0]]),   # 2/2, 1/2, (unrouted)
                       1: torch.tensor([[2, 5], [0, 1], [3, 3]])}   # 1/2, 0/2, (unrouted)
    total, n = _routing_counts(replay, {"routed_experts": rollout})  # device tensors
    assert int(n) == 2 and float(total) == pytest.approx((1.0 + 0.5 + 0.5 + 0.0) / 4 * 2)
    assert _routing_counts(replay, {}) is None


def test_plot_shows_the_sft_loss(tmp_path):
    from megatron_qrl.utils.metrics import sft_panel_points

    base = {"reward_mean": None, "mismatch_kl": None, "clip_frac": None}
    recs = [{"step": 0, "phase": "sft", "sft_loss": 2.0, **base},
            {"step": 1, "phase": "sft", "sft_loss": 1.5, **base},
            {"step": 2, "phase": "rl", **base, "reward_mean": 0.25}]
    assert sft_panel_points(recs) == ("SFT loss", [(0, 2.0), (1, 1.5)])
    recs[1]["reward_mean"] = 0.5  # an SFT phase that logs rewards plots them instead
    assert sft_panel_points(recs) == ("SFT reward", [(1, 0.5)])
