#!/usr/bin/env bash
# The CPU default job: tiny Qwen3-MoE, SFT warm-up on synthetic addition, then RL with INT8
# rollouts on the reference engine. Single process, no Ray, no GPU. <= 10 min on 2 cores.
#   bash examples/run_tiny_cpu.sh                 # seed 1234 -> qrl_runs/tiny-cpu-seed1234
#   SEED=7 bash examples/run_tiny_cpu.sh
#   COMPARE=1 bash examples/run_tiny_cpu.sh       # bf16 / int8 x losses / nvfp4: one table
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/models/tiny_qwen3_moe.sh"

SEED="${SEED:-1234}"
OUT="${OUT:-qrl_runs/tiny-cpu-seed${SEED}}"

JOB_ARGS=(--qrl-preset tiny-cpu --qrl-seed "${SEED}" --qrl-output-dir "${OUT}")
# FORWARD_ARGS: the preset runs the QaRL aligned forward + routing replay in the recompute;
# e.g. FORWARD_ARGS="--qrl-train-forward bf16 --qrl-loss-kind tis" for the plain forward.
read -r -a FORWARD_ARGS <<< "${FORWARD_ARGS:-}"
EXTRA_ARGS=()
if [[ "${COMPARE:-0}" == 1 ]]; then EXTRA_ARGS+=(--qrl-compare); fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec qrl-train "${QRL_MODEL_ARGS[@]}" "${JOB_ARGS[@]}" "${FORWARD_ARGS[@]}" "${EXTRA_ARGS[@]}" "$@"
