#!/usr/bin/env bash
# Qwen3-30B-A3B: Megatron trainer on 2 nodes x 8 GPUs under torchrun (TP 2 x EP 8, sequence
# parallel, BF16 + fp32 masters) and a fleet of ENGINES SGLang rollout engines of ENGINE_TP
# GPUs each (default 8 x TP 1) in Ray actors that trainer rank 0 drives
# (--qrl-rollout-num-engines / -engine-tp / -engine-ep, sizing in docs/LAUNCH.md). FP8-block
# (Hopper) or NVFP4 (W4A16 on Hopper, W4A4 on Blackwell) rollouts, routing replay, TIS (fp8) /
# QeRL AQN + TIS (nvfp4).
#
# Sizing the fleet (ENGINES x ENGINE_TP engine GPUs; checked before Ray places anything):
#   ENGINES=8 ENGINE_TP=1 (default): 8 engines of one GPU. FP8-block weights are ~31 GB, so one
#       engine fits an 80 GB+ GPU with room for the KV cache; more, narrower engines decode
#       more tokens/s than fewer wide ones (no TP all-reduce per layer).
#   ENGINES=4 ENGINE_TP=2 ENGINE_EP=2: the same 8 GPUs as 4 engines (experts split 2 ways,
#       64 each); for long responses whose KV cache does not fit next to the weights.
#   ENGINES=1 ENGINE_TP=8 ENGINE_EP=8 DP_ATTENTION=1: one engine over a node, experts 16 per
#       GPU, attention data-parallel over the 8 ranks (SGLang --enable-dp-attention,
#       dp_size 8; without it the 4 KV heads are replicated on 8 ranks).
#   Engine TP must divide the 32 heads and divide or be divided by the 4 KV heads, engine EP
#   the 128 experts and engine TP; the expert width 768 must split over TP / EP.
#   MEM_FRACTION (SGLang mem_fraction_static, default 0.6 disaggregated / 0.4 colocated) is
#   each engine's share of its GPU; colocated, the trainer needs the rest while the engines
#   are released (they are, after every rollout).
#
# MODE=disaggregated (default): 3 nodes. The Ray cluster holds the ENGINES' GPUs only; the
# trainer's GPUs are torchrun's, not Ray's (Ray must not hand them to the engine actor):
#   engine node:     ROLE=engine  HEAD_ADDR=10.0.0.1 bash examples/run_qwen3_30b_a3b.sh
#   trainer node 0:  ROLE=head    CKPT=/data/Qwen3-30B-A3B bash examples/run_qwen3_30b_a3b.sh
#   trainer node 1:  ROLE=trainer NODE_RANK=1 HEAD_ADDR=10.0.0.1 CKPT=... bash examples/...
# (ROLE=head starts the Ray head with 0 GPUs, so rank 0 has a local raylet to join with
# ray.init(); start the engine node after it, then both trainer nodes.)
# MODE=colocated: 2 nodes, no engine node; the Ray head on trainer node 0 is given its 8
# GPUs and ENGINES x ENGINE_TP must tile them (TP 1: ENGINES a multiple of 8, several engines
# per GPU each with MEM_FRACTION / engines-per-GPU), shared with the trainer ranks there (engine
# memory released during recompute + training). ENGINES=1 is the single engine actor of before.
#   variants:        VARIANT=fp8 (default) | nvfp4 | nvfp4-w4a4 (Blackwell) | qarl
#
# STATUS: tested on CPU only, with tiny equivalents (tests/rl/test_rl_ray_multirank.py): 2
# torchrun ranks (gloo), TP 2 + sequence parallel, the reference engine in a Ray actor
# (--qrl-mode disaggregated and colocated, and a ray.kill of the actor mid-run) give metrics
# bit-identical to the same 2-rank --qrl-mode single run; TP=2 / EP=2 multi-rank training
# matches one process (tests/rl/test_rl_multirank.py). The SGLang-in-a-Ray-actor construction
# (EngineSpec, actor options of engine-TP GPUs, start_job_engine arguments) is unit-tested with a fake
# engine class. On one H200: qrl-train with an in-process SGLang engine (single mode, int8
# in place) and every format's in-place weight sync ran (docs/BENCHMARKS.md). Weights reach
# the engine actor over a process-group broadcast (--qrl-ray-weight-transport broadcast, the
# disaggregated default): NCCL when the actor has its own GPU (the engine node must reach
# rank 0's node on a free TCP port for the group's store), gloo through host memory when
# colocated (same GPU) with --qrl-ray-weight-transport broadcast; colocated defaults to ipc
# (CUDA IPC handles to buckets that stay on the GPU); objectstore uses Ray's object store.
# NEVER RUN: this script itself — NCCL, SGLang inside a Ray actor, multi-node torchrun or a
# multi-node Ray cluster, SGLang engines of TP > 1 (the layout checks and the tp_size /
# ep_size / DP-attention engine arguments are unit-tested on CPU; tests/rollout/test_fleet_engine_tp.py).
# Weight sync: trainer rank 0 gathers the full model and broadcasts it once to every engine
# (the EP ranks' own-expert send, megatron_qrl/rl/ep_send.py, is tested on CPU but not yet
# wired into qrl-train). Refused in this build (clear error each): --fp16,
# --pipeline-model-parallel-size > 1. --use-distributed-optimizer is accepted (pass it after
# the script's name: extra arguments are Megatron flags).
# Knobs as in run_qwen3_4b_1gpu.sh: STEPS, SAVE_INTERVAL (-1: no checkpoint), MAX_NEW_TOKENS.
# One node, colocated, on a random checkpoint (issue 21's 8-GPU run; bench/run_30b_example.sh
# sets these): MODE=colocated NNODES=1 GPUS_PER_NODE=8 ENGINES=8 HEAD_ADDR=127.0.0.1 CKPT=DIR
#   STEPS=3 SAVE_INTERVAL=-1 MAX_NEW_TOKENS=256 bash examples/run_qwen3_30b_a3b.sh \
#   --use-distributed-optimizer --num-layers 8     # DIR from tools/make_random_checkpoint.py
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${HERE}/models/qwen3_30b_a3b.sh"

ROLE="${ROLE:-head}"
ENGINES="${ENGINES:-8}"        # rollout engines
ENGINE_TP="${ENGINE_TP:-1}"    # GPUs per engine (one node)
ENGINE_EP="${ENGINE_EP:-1}"    # expert-parallel size inside an engine (divides ENGINE_TP)
MODE="${MODE:-disaggregated}"
ENGINE_GPUS=$((ENGINES * ENGINE_TP))
if [[ "${MODE}" == colocated ]]; then MEM_FRACTION="${MEM_FRACTION:-0.4}"
else MEM_FRACTION="${MEM_FRACTION:-0.6}"; fi
RAY_PORT="${RAY_PORT:-6379}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NNODES="${NNODES:-2}"          # trainer nodes (torchrun)
MASTER_PORT="${MASTER_PORT:-29500}"

if [[ "${ROLE}" == engine ]]; then
    : "${HEAD_ADDR:?set HEAD_ADDR to trainer node 0 (the Ray head)}"
    exec ray start --address "${HEAD_ADDR}:${RAY_PORT}" --num-gpus "${ENGINE_GPUS}" --block
fi
: "${CKPT:?set CKPT to the Qwen3-30B-A3B HF directory}"
if [[ "${ROLE}" == head ]]; then
    HEAD_ADDR="${HEAD_ADDR:-$(hostname -I | awk '{print $1}')}"
    NODE_RANK=0
    if [[ "${MODE}" == colocated ]]; then
        CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((GPUS_PER_NODE - 1)))" \
            ray start --head --port "${RAY_PORT}" --num-gpus "${GPUS_PER_NODE}"
    else
        ray start --head --port "${RAY_PORT}" --num-gpus 0
    fi
    trap 'ray stop' EXIT
elif [[ "${ROLE}" == trainer ]]; then
    : "${HEAD_ADDR:?set HEAD_ADDR to trainer node 0}" "${NODE_RANK:?set NODE_RANK (1..NNODES-1)}"
else
    echo "ROLE must be head, trainer or engine, got ${ROLE}" >&2; exit 2
fi

PP="${PP:-1}"                   # trainer pipeline stages (docs/LAUNCH.md "Pipeline parallelism")
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --expert-model-parallel-size 8
    --expert-tensor-parallel-size 1 --pipeline-model-parallel-size "${PP}"
    --sequence-parallel --bf16
)
case "${VARIANT:-fp8}" in
    fp8)        VARIANT_ARGS=(--qrl-rollout-format fp8_block --qrl-loss-kind tis) ;;
    # qerl's LoRA needs adapter serving in SGLang, not wired yet (docs/LORA.md): full-parameter RL
    nvfp4)      VARIANT_ARGS=(--qrl-preset qwen3-30b-a3b,qerl --qrl-lora-rank 0) ;;
    nvfp4-w4a4) VARIANT_ARGS=(--qrl-preset qwen3-30b-a3b,qerl --qrl-lora-rank 0 --qrl-rollout-nvfp4-w4a4) ;;
    qarl)       VARIANT_ARGS=(--qrl-preset qwen3-30b-a3b,qarl --qrl-rollout-format fp8_block) ;;
    *) echo "VARIANT must be fp8, nvfp4, nvfp4-w4a4 or qarl, got ${VARIANT}" >&2; exit 2 ;;
esac
QRL_ARGS=(
    --qrl-preset qwen3-30b-a3b --qrl-model checkpoint --qrl-checkpoint "${CKPT}"
    --qrl-routing-replay all --qrl-rollout-engine sglang
    --qrl-output-dir "${OUT:-qrl_runs/qwen3-30b-a3b-${VARIANT:-fp8}}"
)
FLEET_ARGS=(
    --qrl-rollout-num-engines "${ENGINES}" --qrl-rollout-engine-tp "${ENGINE_TP}"
    --qrl-rollout-engine-ep "${ENGINE_EP}" --qrl-rollout-sglang-mem-fraction "${MEM_FRACTION}"
)
if [[ "${DP_ATTENTION:-0}" == 1 ]]; then FLEET_ARGS+=(--qrl-rollout-engine-dp-attention); fi
if [ -n "${STEPS:-}" ]; then QRL_ARGS+=(--qrl-steps "${STEPS}"); fi
if [ -n "${SAVE_INTERVAL:-}" ]; then QRL_ARGS+=(--qrl-save-interval "${SAVE_INTERVAL}"); fi
if [ -n "${MAX_NEW_TOKENS:-}" ]; then QRL_ARGS+=(--qrl-rollout-max-new-tokens "${MAX_NEW_TOKENS}"); fi
# rank 0 joins the Ray cluster of this node (ray.init() finds it); other ranks never use Ray
torchrun --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${GPUS_PER_NODE}" \
    --master-addr "${HEAD_ADDR}" --master-port "${MASTER_PORT}" \
    -m megatron_qrl.rl.cli --qrl-mode "${MODE}" "${QRL_ARGS[@]}" "${FLEET_ARGS[@]}" \
    "${VARIANT_ARGS[@]}" \
    -- "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "$@"
