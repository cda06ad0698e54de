#!/usr/bin/env bash
# Qwen3-30B-A3B GRPO in slime 0.3.1 with megatron_qrl: slime's own scripts/run-qwen3-30B-A3B.sh
# (one node, 8 GPUs, colocated, TP 4 x EP 8) with the rollouts in FP8-block (Hopper), ACR loss,
# slime's R3 routing replay and QaRL error tokens. See docs/SLIME.md for every flag.
#
# Differences from slime's script: `python3 -m megatron_qrl.integrations.slime.launch` instead
# of `python3 train.py` (the same train loop; --qrl-* flags parsed), QRL_ARGS below, --hf-checkpoint
# is the FP8-block export (SGLang starts from it), GRPO_ARGS without --use-kl-loss and the
# --eps-clip* pair (the custom loss owns the clip: --qrl-loss-eps-*), and no `pkill -9` lines
# (stop your previous job yourself: `ray stop`).
#
# Before the first run (from the megatron_qrl checkout):
#   python tools/export_quantized.py --hf-dir /root/Qwen3-30B-A3B --format fp8_block \
#       --out /root/Qwen3-30B-A3B-qrl-fp8_block
#   and slime's own conversion of /root/Qwen3-30B-A3B to /root/Qwen3-30B-A3B_torch_dist.
# Run from slime's repository root (train.py is found beside the slime package) with
# megatron_qrl installed: SLIME_DIR=/root/slime bash examples/slime/run_qwen3_30b_a3b_qrl.sh
#
# STATUS: NEVER RUN end to end (one GPU at most on our machines; this script needs 8). What ran:
# the same integration in slime 0.3.1 on ONE H200 with a random Qwen3-4B shape
# (examples/slime/run_qwen3_4b_qrl_1gpu.sh, QRL=1 LOSS=acr and the QRL=0 baseline, commit 38ae4bb,
# 3 RL steps each, rc 0: launcher, hooks, aligned --spec forward, ACR loss, error tokens, AQN,
# fp8_block weight updates into SGLang 0.5.15.post1; docs/SLIME.md). On CPU against slime
# 0.3.1's unmodified code (tests/integrations/test_integrations_slime*.py): slime's loss_function with the
# custom loss equals megatron_qrl's compute_policy_loss (loss and gradients) for every loss
# kind; slime's policy_loss_function with the custom TIS applies our tis / acr / decoupled
# weight; slime's convert_to_hf (Qwen3-MoE converter) with the installed quantizer returns
# exactly QuantSpec.pack_state_dict for every format; the options, hooks, error-token
# post-process and the launcher's hook filling; slime's own parse_args with our flags (the
# launcher test, on CPU in tools/slime_cpu_site.sh's site). Not run: the MoE model, TP / EP,
# several GPUs or nodes, R3 with the custom loss, a read-back of the engine's weights after an
# update. --qrl-train-forward aligned (add it with --spec, or use the launcher) keeps TE's
# parameter names so slime's converter accepts them (CPU tests; the 1-GPU run above used it).
set -euo pipefail

export PYTHONUNBUFFERED=1
SLIME_DIR=${SLIME_DIR:-/root/slime}
FORMAT=${FORMAT:-fp8_block}

NVLINK_COUNT=$(nvidia-smi topo -m 2>/dev/null | grep -o 'NV[0-9][0-9]*' | wc -l || true)
HAS_NVLINK=$(( NVLINK_COUNT > 0 ? 1 : 0 ))

source "${SLIME_DIR}/scripts/models/qwen3-30B-A3B.sh"   # MODEL_ARGS, slime's own

CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-30B-A3B-qrl-${FORMAT}
   --ref-load /root/Qwen3-30B-A3B_torch_dist
   --load /root/Qwen3-30B-A3B_slime/
   --save /root/Qwen3-30B-A3B_slime/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1
   --global-batch-size 256
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1
)

PERF_ARGS=(
   --tensor-model-parallel-size 4
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 8
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 20480
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --entropy-coef 0.00
)

QRL_ARGS=(
   # loss: every --qrl-loss-kind through slime's custom-loss hook
   --loss-type custom_loss
   --custom-loss-function-path megatron_qrl.integrations.slime.loss.qrl_policy_loss
   --qrl-loss-kind acr
   --qrl-loss-tis-cap 2.0
   --qrl-loss-eps-high 0.28
   --qrl-loss-aggregation token_mean
   --calculate-per-token-loss
   # rollout format: QuantSpec packs in slime's weight sync (init hook installs them)
   --qrl-rollout-format "${FORMAT}"
   --custom-megatron-init-path megatron_qrl.integrations.slime.hooks.qrl_megatron_init
   --custom-megatron-before-log-prob-hook-path megatron_qrl.integrations.slime.hooks.qrl_before_log_prob
   --custom-megatron-before-train-step-hook-path megatron_qrl.integrations.slime.hooks.qrl_before_train_step
   # QaRL error tokens folded into slime's loss masks
   --qrl-error-tokens-action mask
   --rollout-data-postprocess-path megatron_qrl.integrations.slime.postprocess.qrl_rollout_data_postprocess
   # MoE routing replay = slime's R3
   --use-rollout-routing-replay
   --qrl-routing-replay all
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
   --optimizer-cpu-offload
   --overlap-cpu-optimizer-d2h-h2d
   --use-precision-aware-optimizer
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 8
   --sglang-mem-fraction-static 0.7
   --sglang-cuda-graph-bs 1 2 4 8 $(seq 16 8 256)
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus 8 --disable-usage-stats \
   --dashboard-host=0.0.0.0 --dashboard-port=8265

RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"/root/Megatron-LM/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"NCCL_NVLS_ENABLE\": \"${HAS_NVLINK}\"
  }
}"

cd "${SLIME_DIR}"
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 -m megatron_qrl.integrations.slime.launch \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 8 \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${QRL_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}"
