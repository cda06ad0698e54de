#!/usr/bin/env bash
# Qwen3-4B on ONE GPU: Megatron-core trainer (BF16 + fp32 masters; Transformer Engine layers
# where TE imports, else the local spec with SDPA attention) and an SGLang engine (FP8 rollouts
# by default, TP 1) on the same GPU. MODE=single (default): the engine runs in this process;
# colocated: in a Ray actor. Either way the engine's memory is released after each rollout
# (recompute + training get the GPU) and resumed before the weight sync.
#   CKPT=/data/Qwen3-4B bash examples/run_qwen3_4b_1gpu.sh
#   CKPT=... FORMAT=int8 LOSS=acr bash examples/run_qwen3_4b_1gpu.sh
#   CKPT=... MODE=colocated bash examples/run_qwen3_4b_1gpu.sh   # engine in a Ray actor
# No checkpoint at hand? A random Qwen3-4B with the char tokenizer (~8 GB, ~1 min on a GPU):
#   python tools/make_random_checkpoint.py --config qwen3_4b --out /tmp/qwen3-4b-random
#   CKPT=/tmp/qwen3-4b-random STEPS=3 SAVE_INTERVAL=-1 bash examples/run_qwen3_4b_1gpu.sh
# Memory on a 141 GB H200 (why these defaults): trainer BF16 weights + fp32 grads + fp32 masters
# + Adam ~72 GB; activations of micro batches of 4 with TE's fused attention ~20 GB (no activation
# recompute: trainer peak 92.6 GiB measured, bench/results/rl_step_run3_4b_mfu_7ed221d.jsonl);
# the engine at MEM_FRACTION 0.3 (SGLang 0.5.17 sizes its KV pool as 0.3 x the memory free at its
# start minus its weights) releases its weights and KV cache after each rollout (torch_memory_saver)
# so recompute + training get the GPU. Knobs: MEM_FRACTION, MAX_NEW_TOKENS, MICRO_BATCH,
# RECOMPUTE=1 (full activation recompute, one layer at a time: ~10 GB less, 33% instead of 43%
# trainer MFU; use it without Transformer Engine or with RELEASE=0),
# OFFLOAD=1 (--use-distributed-optimizer --optimizer-cpu-offload: masters + Adam on the CPU),
# RELEASE=0 (keep the engine resident: no torch_memory_saver), SYNC (--qrl-rollout-sglang-sync;
# unset: inplace for quantized formats; direct: the trainer's weights quantized straight into
# the engine's tensors — by the engine from the trainer's CUDA IPC handles while its memory
# saver is on, by the trainer with RELEASE=0; SYNC=direct RECOMPUTE=1 ran on one H200 at
# 9676a5c, local spec: sync 0.23-0.24 s in 3 requests, the trainer's parameters held by the
# engine (c5849b0: 0.31-0.38 s; in place 0.80-0.89 s),
# bench/results/example4b_single_direct_9676a5c.jsonl; RELEASE=0 SYNC=direct not run here),
# STEPS, SAVE_INTERVAL (-1: no checkpoint; a checkpoint with Adam state is ~70 GB), TIMPL
# (--transformer-impl local|transformer_engine; unset: TE where it imports).
# SLEEP=on|off|auto (--qrl-trainer-sleep; default off, as the preset): on puts the trainer to
# sleep while the engine decodes (fp32 masters and Adam state in pinned host memory, grad
# buffers released, the BF16 weights kept; docs/LAUNCH.md "The trainer asleep during rollout"),
# so the engine starts beside a sleeping trainer with MEM_FRACTION default 0.6 instead of 0.3
# (its KV pool for all 256 samples at once); the sync then runs beside the trainer's BF16 weights
# only. Not yet run with SLEEP=on on the H200.
# Not with RELEASE=0. metrics.jsonl: time_sleep_s, time_wake_s, trainer_gpu_gib_asleep.
# STATUS: RAN AS SHIPPED on one H200 (2026-12-02, commit 3b72f6b, `bash bench/h200.sh example4b`
# and `MODE=colocated bash bench/h200.sh example4b`: default flags, random Qwen3-4B from
# tools/make_random_checkpoint.py, TE spec): 3 RL steps in each mode. MODE=single: rollout
# 15.5-16.5 s, pi_prox recompute 0.002 s, train 16.0-17.2 s, sync 0.80-0.89 s, trainer peak
# 92.7 GiB; MODE=colocated: the same but sync 9.4-10.5 s (gloo through host memory on a shared
# GPU; since then the colocated default is the ipc transport, CUDA IPC handles: its GPU test passed,
# this script not re-run with it) (bench/results/example4b_run2_{single,colocated}_3b72f6b.jsonl).
# Not run on a GPU: OFFLOAD=1 with this script (bench/h200.sh rlstep-offload measured the flags),
# RECOMPUTE=1 at these defaults (it ran as the default on 2026-12-01: 3 steps, local spec).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/models/qwen3_4b.sh"
: "${CKPT:?set CKPT to the Qwen3-4B HF directory (or make one: tools/make_random_checkpoint.py)}"

PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16)
MEMORY_ARGS=()
if [ "${RECOMPUTE:-0}" = 1 ]; then
    MEMORY_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi
if [ "${OFFLOAD:-0}" = 1 ]; then
    MEMORY_ARGS+=(--use-distributed-optimizer --optimizer-cpu-offload)
fi
if [ -n "${TIMPL:-}" ]; then MEMORY_ARGS+=(--transformer-impl "${TIMPL}"); fi
RELEASE_ARGS=()
if [ "${RELEASE:-1}" = 0 ]; then RELEASE_ARGS+=(--no-qrl-rollout-sglang-release-memory); fi
if [ -n "${SYNC:-}" ]; then RELEASE_ARGS+=(--qrl-rollout-sglang-sync "${SYNC}"); fi
SLEEP=${SLEEP:-off}
if [ "${SLEEP}" = on ]; then MEM_FRACTION=${MEM_FRACTION:-0.6}; fi
QRL_ARGS=(
    --qrl-preset qwen3-4b-1gpu --qrl-model checkpoint --qrl-checkpoint "${CKPT}"
    --qrl-rollout-engine sglang
    --qrl-rollout-format "${FORMAT:-fp8}" --qrl-loss-kind "${LOSS:-tis}"
    --qrl-rollout-sglang-mem-fraction "${MEM_FRACTION:-0.3}"
    --qrl-rollout-max-new-tokens "${MAX_NEW_TOKENS:-1024}"
    --qrl-micro-batch-size "${MICRO_BATCH:-4}" "${RELEASE_ARGS[@]}"
    --qrl-trainer-sleep "${SLEEP}"
    --qrl-output-dir "${OUT:-qrl_runs/qwen3-4b-${FORMAT:-fp8}}"
)
if [ -n "${STEPS:-}" ]; then QRL_ARGS+=(--qrl-steps "${STEPS}"); fi
if [ -n "${SAVE_INTERVAL:-}" ]; then QRL_ARGS+=(--qrl-save-interval "${SAVE_INTERVAL}"); fi
if command -v qrl-train >/dev/null 2>&1; then TRAIN=(qrl-train); else
    TRAIN=(python3 -m megatron_qrl.rl.cli); fi  # a checkout on PYTHONPATH, not installed
exec "${TRAIN[@]}" --qrl-mode "${MODE:-single}" "${QRL_ARGS[@]}" \
    -- "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${MEMORY_ARGS[@]}" "$@"
