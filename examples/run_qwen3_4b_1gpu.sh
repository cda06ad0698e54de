#!/usr/bin/env bash
# Qwen3-4B on ONE GPU: Megatron-core trainer (BF16 + fp32 masters) in this process and an
# SGLang engine (FP8 rollouts by default, TP 1) in a Ray actor on the same GPU (colocated: the
# engine's memory is released during recompute + training), TIS correction. Needs an HF
# checkpoint directory. Ray: joins RAY_ADDRESS / a `ray start` cluster, else starts a local one.
#   CKPT=/data/Qwen3-4B bash examples/run_qwen3_4b_1gpu.sh
#   CKPT=... FORMAT=int8 LOSS=acr bash examples/run_qwen3_4b_1gpu.sh
#   CKPT=... MODE=single bash examples/run_qwen3_4b_1gpu.sh   # engine in this process, no Ray
# STATUS: tested on CPU only, with tiny equivalents: --qrl-mode colocated with the reference
# engine in a Ray actor matches --qrl-mode single bit for bit (tests/test_rl_ray.py, also
# 2 torchrun ranks in tests/test_rl_ray_multirank.py); MODEL_ARGS are checked against
# ${CKPT}/config.json (tests of megatron_qrl/config/megatron_flags.py); the SGLang-in-a-Ray-
# actor construction (1-GPU actor, start_job_engine arguments) is unit-tested with a fake
# engine class. NEVER RUN: this script itself — a GPU, SGLang inside a Ray actor, Qwen3-4B.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/models/qwen3_4b.sh"
: "${CKPT:?set CKPT to the Qwen3-4B HF directory}"

PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16)
QRL_ARGS=(
    --qrl-preset qwen3-4b-1gpu --qrl-model checkpoint --qrl-checkpoint "${CKPT}"
    --qrl-rollout-engine sglang
    --qrl-rollout-format "${FORMAT:-fp8}" --qrl-loss-kind "${LOSS:-tis}"
    --qrl-output-dir "${OUT:-qrl_runs/qwen3-4b-${FORMAT:-fp8}}"
)
exec qrl-train --qrl-mode "${MODE:-colocated}" "${QRL_ARGS[@]}" \
    -- "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
