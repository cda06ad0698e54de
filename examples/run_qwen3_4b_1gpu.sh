#!/usr/bin/env bash
# Qwen3-4B on ONE GPU: colocated trainer (Megatron-core, BF16 masters) + SGLang engine
# (FP8 rollouts by default), TIS correction. Needs an HF checkpoint directory.
#   CKPT=/data/Qwen3-4B bash examples/run_qwen3_4b_1gpu.sh
#   CKPT=... FORMAT=int8 LOSS=acr bash examples/run_qwen3_4b_1gpu.sh
# STATUS: the Megatron flags after `--` are parsed (megatron_qrl/config/megatron_flags.py):
# MODEL_ARGS are checked against ${CKPT}/config.json (a disagreeing flag is an error naming
# it), TP/PP sizes set the trainer layout. --qrl-mode colocated runs on Ray with the
# reference engine (tested on CPU); SGLang engines inside the Ray modes are not wired yet, so
# with --qrl-rollout-engine sglang the job stops with an error naming that. --bf16 trains BF16
# parameters with fp32 master weights (megatron's mixed-precision optimizer).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/models/qwen3_4b.sh"
: "${CKPT:?set CKPT to the Qwen3-4B HF directory}"

PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16)
QRL_ARGS=(
    --qrl-preset qwen3-4b-1gpu --qrl-model checkpoint --qrl-checkpoint "${CKPT}"
    --qrl-rollout-format "${FORMAT:-fp8}" --qrl-loss-kind "${LOSS:-tis}"
    --qrl-output-dir "${OUT:-qrl_runs/qwen3-4b-${FORMAT:-fp8}}"
)
exec qrl-train --qrl-mode colocated "${QRL_ARGS[@]}" -- "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
