"""Named ``--qrl-*`` flag sets: ``--qrl-preset NAME[,NAME...]``.

A preset maps flag names to (already typed) values. Presets apply BEFORE the user's flags:
a flag given on the command line always wins, whatever its position. Several presets apply
in order (later ones win), so a machine preset combines with a paper mode, e.g.
``--qrl-preset qwen3-4b-1gpu,qurl``.

Machine / job presets:

* ``tiny-cpu``: the CPU default job. Tiny Qwen3-MoE on the char tokenizer, synthetic
  addition whose warm-up demonstrations have a spurious trailing "0" half of the time
  (``--qrl-task-demo-noise 0.5``: the warm-up leaves headroom that the reward, on the true
  sum, lets RL close),
  supervised warm-up then RL with INT8 rollouts, aligned forward and ACR.
* ``qwen3-4b-1gpu``: Qwen3-4B on one GPU, SGLang rollouts (needs ``--qrl-checkpoint``).
* ``qwen3-30b-a3b``: Qwen3-30B-A3B, multi-node, FP8-block SGLang rollouts, routing replay,
  the stacked experts (``--qrl-train-moe-experts stacked``: one stacked weight and one torch
  grouped GEMM per expert linear, with or without TE; ``--qrl-train-moe-experts megatron`` is
  the fallback: TE's grouped GEMM, and what a LoRA run must name) and the fast MoE trainer
  path on a GPU with TE (``--qrl-train-moe-fast-path``: alltoall, fused permute / router,
  selective recompute; config/moe_path.py) (needs ``--qrl-checkpoint``; TP/EP layout are
  Megatron flags in examples/). Measured on one H200, 4-layer slice, local spec
  (docs/BENCHMARKS.md): RL step 13.0 s at micro batch 16 vs 21 s with TE's grouped GEMM; the
  stacked experts on the TE spec are not measured.

Paper modes (docs/ALGORITHMS.md):

* ``qurl`` (QuRL, seed 000): INT8 W8A8 rollouts, ACR (eq. 9), UAQ s=1.5 (eq. 10-12).
  QuRL uses UAQ at lr 1e-6 only (validation warns at lr >= 1e-5). Paper modes never set
  the learning rate: it belongs to the model/machine preset.
* ``qerl`` (QeRL, seed 002): NVFP4 (W4A16) rollouts + AQN with TIS correcting the noise,
  LoRA r=32 alpha=32 on every attention / dense-MLP projection over an NVFP4 frozen base (the
  engine's base; adapters only over the wire). QeRL's lr 1e-5 belongs to the model preset.
* ``rlquant-qlora`` (rlquant, seed 003): QLoRA, NF4 double-quantized frozen base, LoRA r=8
  alpha=16 dropout 0.05, lr 1e-4 (the paper's; this paper mode sets it). NF4 is trainer
  storage only: BF16 rollouts of the dequantized base, so trainer and engine hold one base.
* ``rlquant-qaft`` (rlquant, seed 003): QAFT-STE read as the aligned forward with INT8
  weights (our int8 is per output channel, the paper's STE scale is per tensor) and plain
  GRPO (ppo_clip, sequence-mean aggregation). PTQ-after-RL is a tool, not a run mode.
* ``qarl`` (QaRL, seed 004): rollout-aligned forward + TBPO (sequence-level) with FP8
  rollouts, error tokens masked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["PRESETS", "preset_names"]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-cpu": {
        "--qrl-model": "tiny-moe",
        "--qrl-rollout-format": "int8",
        "--qrl-rollout-engine": "reference",
        "--qrl-rollout-n-samples-per-prompt": 8,
        "--qrl-rollout-max-new-tokens": 8,
        "--qrl-train-forward": "aligned",
        "--qrl-routing-replay": "recompute",
        "--qrl-loss-kind": "acr",
        "--qrl-loss-eps-high": 0.28,
        "--qrl-task-digits-min": 1,
        "--qrl-task-digits-max": 2,
        "--qrl-task-num-prompts": 512,
        "--qrl-task-demo-noise": 0.5,
        "--qrl-steps": 150,
        "--qrl-sft-steps": 600,
        "--qrl-lr": 3e-4,
        "--qrl-sft-lr": 3e-3,
        "--qrl-prompts-per-step": 16,
        "--qrl-micro-batch-size": 32,
        "--qrl-updates-per-step": 2,
        "--qrl-save-interval": 10,
        "--qrl-max-update-ratio": 10.0,
    },
    "qwen3-4b-1gpu": {
        "--qrl-model": "checkpoint",
        "--qrl-rollout-engine": "sglang",
        "--qrl-rollout-format": "fp8",
        "--qrl-rollout-n-samples-per-prompt": 8,
        "--qrl-rollout-max-new-tokens": 1024,
        "--qrl-loss-kind": "tis",
        "--qrl-steps": 200,
        "--qrl-lr": 1e-6,
        "--qrl-prompts-per-step": 32,
        "--qrl-micro-batch-size": 4,
        "--qrl-save-interval": 50,
        # the trainer stays resident through the rollout until the H200 run with
        # examples/run_qwen3_4b_1gpu.sh SLEEP=on (mem fraction 0.6) shows the sleep pays
        "--qrl-trainer-sleep": "off",
    },
    "qwen3-30b-a3b": {
        "--qrl-model": "checkpoint",
        "--qrl-rollout-engine": "sglang",
        "--qrl-rollout-format": "fp8_block",
        "--qrl-rollout-n-samples-per-prompt": 8,
        "--qrl-rollout-max-new-tokens": 4096,
        "--qrl-routing-replay": "all",
        "--qrl-train-moe-fast-path": True,
        "--qrl-train-moe-experts": "stacked",
        "--qrl-loss-kind": "tis",
        "--qrl-steps": 300,
        "--qrl-lr": 1e-6,
        "--qrl-prompts-per-step": 64,
        # 1 for the 48-layer model at 4,096 new tokens (the 4-layer slice's micro batch 16 at
        # 1,024 peaked at 73 GiB on one H200; 48 layers x 4x the tokens would not fit)
        "--qrl-micro-batch-size": 1,
        "--qrl-updates-per-step": 4,
        "--qrl-save-interval": 25,
    },
    "qurl": {
        "--qrl-rollout-format": "int8",
        "--qrl-loss-kind": "acr",
        "--qrl-loss-tis-cap": 2.0,
        "--qrl-uaq-scale": 1.5,
    },
    "qerl": {
        "--qrl-rollout-format": "nvfp4",
        "--qrl-aqn-enabled": True,
        "--qrl-loss-kind": "tis",
        "--qrl-lora-rank": 32,
        "--qrl-lora-alpha": 32.0,
        "--qrl-lora-base-format": "nvfp4",
    },
    "rlquant-qlora": {
        "--qrl-lora-rank": 8,
        "--qrl-lora-alpha": 16.0,
        "--qrl-lora-dropout": 0.05,
        "--qrl-lora-base-format": "nf4",
        "--qrl-rollout-format": "bf16",
        "--qrl-train-forward": "bf16",
        "--qrl-lr": 1e-4,
    },
    "rlquant-qaft": {
        "--qrl-rollout-format": "int8",
        "--qrl-train-forward": "aligned",
        "--qrl-loss-kind": "ppo_clip",
        "--qrl-loss-aggregation": "seq_mean_token_mean",
    },
    "qarl": {
        "--qrl-rollout-format": "fp8",
        "--qrl-train-forward": "aligned",
        "--qrl-loss-kind": "tbpo",
        "--qrl-loss-aggregation": "seq_mean_token_mean",
        "--qrl-error-tokens-action": "mask",
    },
}
"""name -> {flag: value}; values are typed as the flag's dataclass field."""


def preset_names(value: str, presets: Mapping[str, Mapping[str, Any]] = PRESETS) -> list[str]:
    """The preset names in ``--qrl-preset`` ``value`` (comma-separated), each checked."""
    names = [n.strip() for n in value.split(",")]
    for n in names:
        if n not in presets:
            raise ValueError(f"--qrl-preset {n!r} is unknown; choose from {', '.join(presets)} "
                             "(several: comma-separated)")
    return names
