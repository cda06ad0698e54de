#!/usr/bin/env bash
# Qwen3-30B-A3B on 2+ nodes of 8 GPUs: disaggregated Megatron trainer (TP 2 x EP 8 per node
# group) and SGLang rollout engines on Ray, FP8-block (Hopper) or NVFP4 (W4A16 on Hopper,
# W4A4 on Blackwell) rollouts, routing replay, TIS (fp8) / QeRL AQN + TIS (nvfp4).
#
#   head node:    ROLE=head   CKPT=/data/Qwen3-30B-A3B bash examples/run_qwen3_30b_a3b.sh
#   other nodes:  ROLE=worker HEAD_ADDR=10.0.0.1 bash examples/run_qwen3_30b_a3b.sh
#   variants:     VARIANT=fp8 (default) | nvfp4 | nvfp4-w4a4 (Blackwell) | qarl
# STATUS: the Megatron flags after `--` are parsed (megatron_qrl/config/megatron_flags.py) and
# MODEL_ARGS are checked against ${CKPT}/config.json. The multi-rank TP x EP trainer runs under
# torchrun with --qrl-mode single (rank 0 owns the rollout engine; TP=2 and EP=2 tested on CPU
# gloo, matching the one-process metrics), e.g.
#   torchrun --nproc-per-node 8 -m megatron_qrl.rl.cli --qrl-mode single "${QRL_ARGS[@]}" -- ...
# The Ray modes keep the trainer in ONE process, so this disaggregated script stops with an
# error naming --qrl-mode and the TP/EP flags until a Ray trainer group exists; SGLang engines
# are not wired into qrl-train yet either. Refused in this build (clear error each):
# --use-distributed-optimizer, --fp16, --pipeline-model-parallel-size > 1.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/models/qwen3_30b_a3b.sh"

ROLE="${ROLE:-head}"
RAY_PORT="${RAY_PORT:-6379}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"

if [[ "${ROLE}" == worker ]]; then
    : "${HEAD_ADDR:?set HEAD_ADDR to the head node address}"
    exec ray start --address "${HEAD_ADDR}:${RAY_PORT}" --num-gpus "${GPUS_PER_NODE}" --block
fi
: "${CKPT:?set CKPT to the Qwen3-30B-A3B HF directory}"
ray start --head --port "${RAY_PORT}" --num-gpus "${GPUS_PER_NODE}"
trap 'ray stop' EXIT

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --expert-model-parallel-size 8
    --expert-tensor-parallel-size 1 --pipeline-model-parallel-size 1
    --sequence-parallel --bf16
)
case "${VARIANT:-fp8}" in
    fp8)        VARIANT_ARGS=(--qrl-rollout-format fp8_block --qrl-loss-kind tis) ;;
    nvfp4)      VARIANT_ARGS=(--qrl-preset qwen3-30b-a3b,qerl) ;;
    nvfp4-w4a4) VARIANT_ARGS=(--qrl-preset qwen3-30b-a3b,qerl --qrl-rollout-nvfp4-w4a4) ;;
    qarl)       VARIANT_ARGS=(--qrl-preset qwen3-30b-a3b,qarl --qrl-rollout-format fp8_block) ;;
    *) echo "VARIANT must be fp8, nvfp4, nvfp4-w4a4 or qarl, got ${VARIANT}" >&2; exit 2 ;;
esac
QRL_ARGS=(
    --qrl-preset qwen3-30b-a3b --qrl-model checkpoint --qrl-checkpoint "${CKPT}"
    --qrl-routing-replay all --qrl-rollout-engine sglang
    --qrl-output-dir "${OUT:-qrl_runs/qwen3-30b-a3b-${VARIANT:-fp8}}"
)
qrl-train --qrl-mode disaggregated "${QRL_ARGS[@]}" "${VARIANT_ARGS[@]}" \
    -- "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
