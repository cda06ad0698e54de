#!/usr/bin/env bash
# slime 0.3.1 GRPO on ONE GPU (H200), colocated (trainer and one SGLang engine share the GPU),
# random Qwen3-4B-shaped weights (LAYERS of its 36 layers) on the synthetic addition task, 3
# rollouts: slime as its users run it, with megatron_qrl's flags (QRL=1, the default) or
# without them (QRL=0: the baseline, slime's own PPO loss on the BF16 checkpoint).
#
# STATUS: both variants RAN as shipped on one H200 (2026-12-03, commit 38ae4bb, slime 0.3.1 on
# SGLang 0.5.15.post1 with slime's patches, Megatron-LM 1dcf0da, TE 2.20.2, through
# bench/h200.sh slime-*): QRL=1 LOSS=acr and QRL=0, 3 rollouts + 3 train steps each, rc 0;
# docs/SLIME.md has the step table (step ~17 s either way, bound by slime's colocated offload).
# Open: with QRL=1 the |train - rollout| log-prob gap is 9x the baseline's (docs/SLIME.md).
# LOSS=tbpo has run on CPU only (tests/integrations/test_integrations_slime_walk.py).
#
# QRL=1 adds (docs/SLIME.md): fp8_block rollouts (--hf-checkpoint is the fp8_block export:
# SGLang starts from it; every weight sync sends QuantSpec.pack of the trainer's weights), the
# rollout-aligned training forward (--spec ... qrl_layer_spec), the LOSS (acr or tbpo) through
# slime's custom-loss hook, QaRL error tokens, AQN on the rollout copy. Both runs use our
# reward (--custom-rm-path ...reward.qrl_math_reward) on the prompts the checkpoint carries.
#
# Before the first run (from the megatron_qrl checkout; ~1 min on the GPU):
#   python3 tools/make_random_checkpoint.py --config qwen3_4b --layers 8 --out $CKPT
#   python3 tools/export_quantized.py --hf-dir $CKPT --format fp8_block --out $CKPT-fp8_block
# Then: SLIME_DIR=/root/slime CKPT=... [QRL=0] [LOSS=tbpo] [AQN=0] [TRAIN_FORWARD=bf16] bash examples/slime/run_qwen3_4b_qrl_1gpu.sh
# (AQN=0 / TRAIN_FORWARD=bf16: QRL=1 without AQN noise / with the BF16 training forward, the
# mismatch diagnostics of docs/SLIME.md)
# slime loads the HF weights itself (--load is an HF directory: slime 0.3.1's hf_to_megatron).
# The driver runs here against a local Ray head (no `ray job submit`: no dashboard needed); the
# trainer and rollout actors inherit PYTHONPATH, so export Megatron-LM's tree there first.
set -euo pipefail

export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SLIME_DIR=${SLIME_DIR:-/root/slime}
CKPT=${CKPT:?CKPT=dir of tools/make_random_checkpoint.py (+ its -fp8_block export)}
QRL=${QRL:-1}
LOSS=${LOSS:-acr}
LAYERS=${LAYERS:-8}
ROLLOUTS=${ROLLOUTS:-3}
AQN=${AQN:-1}                   # QRL=1: 0 drops --qrl-aqn-enabled (rollouts without AQN noise)
TRAIN_FORWARD=${TRAIN_FORWARD:-aligned}   # QRL=1: bf16 = the BF16 training forward, no --spec swap
SAVE=${SAVE:-}                  # a dir: save there every SAVE_INTERVAL rollouts (Megatron needs both)

source "${HERE}/examples/models/qwen3_4b.sh"   # MODEL_ARGS (Qwen3-4B's shape)
MODEL_ARGS+=(--num-layers "${LAYERS}")        # the checkpoint's layers (last value wins)

CKPT_ARGS=(
   --hf-checkpoint "${CKPT}"
   --load "${CKPT}"
)
[ -n "${SAVE}" ] && CKPT_ARGS+=(--save "${SAVE}" --save-interval "${SAVE_INTERVAL:-20}")

ROLLOUT_ARGS=(
   --prompt-data "${CKPT}/prompts.jsonl"
   --input-key prompt
   --label-key answer
   --rollout-shuffle
   --custom-rm-path megatron_qrl.integrations.slime.reward.qrl_math_reward
   --num-rollout "${ROLLOUTS}"
   --rollout-batch-size 16
   --n-samples-per-prompt 8
   --rollout-max-response-len 256
   --rollout-temperature 1
   --global-batch-size 128
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 8192
)
# Megatron fuses the weight-gradient accumulation with apex's CUDA extension by default;
# without apex (the H200 image has none) it refuses to start, so turn the fusion off there.
python3 -c "import fused_weight_gradient_mlp_cuda" 2>/dev/null \
   || PERF_ARGS+=(--no-gradient-accumulation-fusion)

GRPO_ARGS=(
   --advantage-estimator grpo
   --entropy-coef 0.00
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.4
   --sglang-attention-backend triton   # the staged SGLang site has no FA3 kernels
   --sglang-grammar-backend none
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --seed 1234
)

QRL_ARGS=(
   --hf-checkpoint "${CKPT}-fp8_block"   # SGLang starts from the export (last value wins)
   --loss-type custom_loss
   --custom-loss-function-path megatron_qrl.integrations.slime.loss.qrl_policy_loss
   --qrl-loss-kind "${LOSS}"
   --qrl-loss-tis-cap 2.0
   --qrl-loss-aggregation seq_mean_token_mean   # slime's per-sample mean (TBPO needs it)
   --qrl-rollout-format fp8_block
   --qrl-train-forward "${TRAIN_FORWARD}"
   --custom-megatron-init-path megatron_qrl.integrations.slime.hooks.qrl_megatron_init
   --custom-megatron-before-log-prob-hook-path megatron_qrl.integrations.slime.hooks.qrl_before_log_prob
   --custom-megatron-before-train-step-hook-path megatron_qrl.integrations.slime.hooks.qrl_before_train_step
   --qrl-error-tokens-action mask
   --rollout-data-postprocess-path megatron_qrl.integrations.slime.postprocess.qrl_rollout_data_postprocess
)
if [ "${TRAIN_FORWARD}" = aligned ]; then
   QRL_ARGS+=(--spec megatron_qrl.integrations.slime.model qrl_layer_spec)
fi
if [ "${AQN}" = 1 ]; then QRL_ARGS+=(--qrl-aqn-enabled); fi
BASELINE_ARGS=(
   --eps-clip 0.2
   --eps-clip-high 0.28
   # no --get-mismatch-metrics: slime 0.3.1 asserts a --custom-tis-function-path with it; its
   # train/train_rollout_logprob_abs_diff (|train - rollout| log-prob) is logged either way
)

if [ "${QRL}" = 1 ]; then
   entry=(-m megatron_qrl.integrations.slime.launch); EXTRA=("${QRL_ARGS[@]}")
   # fp8_block rollouts: SGLang's Triton block-FP8 GEMM, not DeepGEMM's JIT kernels (slime turns
   # their precompile off, so they would compile at first use inside the engine); the ray head
   # started below passes the environment on to slime's engines. =1 to try DeepGEMM.
   export SGLANG_ENABLE_JIT_DEEPGEMM=${SGLANG_ENABLE_JIT_DEEPGEMM:-0}
else
   entry=(train.py); EXTRA=("${BASELINE_ARGS[@]}")
fi

ray start --head --num-gpus 1 --include-dashboard=false --disable-usage-stats
trap 'ray stop' EXIT
cd "${SLIME_DIR}"
RAY_ADDRESS=auto python3 "${entry[@]}" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${EXTRA[@]}"
