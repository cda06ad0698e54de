#!/usr/bin/env bash
# Qwen3-4B on ONE GPU: colocated trainer (Megatron-core, BF16 masters) + SGLang engine
# (FP8 rollouts by default), TIS correction. Needs an HF checkpoint directory.
#   CKPT=/data/Qwen3-4B bash examples/run_qwen3_4b_1gpu.sh
#   CKPT=... FORMAT=int8 LOSS=acr bash examples/run_qwen3_4b_1gpu.sh
# STATUS: --qrl-mode colocated runs on Ray with the reference engine (tested on CPU), but
# qrl-train does not yet take Megatron flags after `--` nor SGLang engines in Ray modes: it
# stops with an error naming them. The flag arrays below are the intended layout.
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
