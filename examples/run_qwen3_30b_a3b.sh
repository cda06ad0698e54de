#!/usr/bin/env bash
# Qwen3-30B-A3B: Megatron trainer on NNODES nodes x GPUS_PER_NODE GPUs under torchrun (TP 2 x
# EP 8, sequence parallel, BF16 + fp32 masters) and a fleet of ENGINES SGLang rollout engines
# of ENGINE_TP GPUs each (default 8 x TP 1) in Ray actors that trainer rank 0 drives
# (--qrl-rollout-num-engines / -engine-tp / -engine-ep, sizing in docs/LAUNCH.md). FP8-block
# (Hopper) or NVFP4 (W4A16 on Hopper, W4A4 on Blackwell) rollouts, routing replay, TIS (fp8) /
# QeRL AQN + TIS (nvfp4). docs/LAUNCH.md "Two nodes" has the environment of each node, the
# ports, the shared paths and what each failure looks like.
#
# Sizing the fleet (ENGINES x ENGINE_TP engine GPUs; checked before Ray places anything):
#   ENGINES=8 ENGINE_TP=1 (default): 8 engines of one GPU. FP8-block weights are ~31 GB, so one
#       engine fits an 80 GB+ GPU with room for the KV cache; more, narrower engines decode
#       more tokens/s than fewer wide ones (no TP all-reduce per layer).
#   ENGINES=4 ENGINE_TP=2 ENGINE_EP=2: the same 8 GPUs as 4 engines (experts split 2 ways).
#   ENGINES=1 ENGINE_TP=8 ENGINE_EP=8 DP_ATTENTION=1: one engine over a node, attention
#       data-parallel over the 8 ranks (SGLang --enable-dp-attention).
#   Engine TP must divide the 32 heads and divide or be divided by the 4 KV heads, engine EP
#   the 128 experts and engine TP. MEM_FRACTION (SGLang mem_fraction_static, default 0.6
#   disaggregated / 0.4 colocated) is each engine's share of its GPU.
#
# Roles (run the script once per node, with the same environment except ROLE / NODE_RANK):
#   MODE=disaggregated (default): NNODES trainer nodes + ENGINE_NODES engine nodes. The Ray
#   cluster holds the engines' GPUs only (the trainer's GPUs are torchrun's):
#     trainer node 0: ROLE=head    HEAD_ADDR=10.0.0.1 CKPT=/shared/Qwen3-30B-A3B OUT=/shared/runs/a
#     trainer node k: ROLE=trainer HEAD_ADDR=10.0.0.1 NODE_RANK=k CKPT=... OUT=...
#     engine node:    ROLE=engine  HEAD_ADDR=10.0.0.1 [ENGINE_NODE_GPUS=8]
#   ROLE=head starts the Ray head (0 GPUs) so rank 0 has a raylet to join; each engine node
#   joins it declaring its OWN GPUs (ENGINE_NODE_GPUS, default GPUS_PER_NODE); trainer rank 0
#   waits (--qrl-launch-ray-nodes 1 + ENGINE_NODES, up to STARTUP_TIMEOUT s, logging what it
#   waits for) until the engine nodes joined, so nodes may start in any order.
#   MODE=colocated: NNODES trainer nodes, no engine node; the Ray head on node 0 gets its
#   GPUS_PER_NODE GPUs and ENGINES x ENGINE_TP must tile them.
#   VARIANT=fp8 (default) | nvfp4 | nvfp4-w4a4 (Blackwell) | qarl
#
# Environment:
#   HEAD_ADDR      trainer node 0's address on the network the nodes share: torchrun's
#                  MASTER_ADDR and the Ray head (required with more than one node; no guess
#                  from `hostname -I`, which may pick another interface). One node: 127.0.0.1.
#   MASTER_PORT    torchrun's store on node 0 (29500); RAY_PORT the Ray head's GCS (6379).
#   CKPT, OUT      the HF checkpoint and the run's output directory: absolute paths on a
#                  file system every trainer node mounts at the same path (OUT default
#                  ${SHARED_DIR:-$PWD}/qrl_runs/qwen3-30b-a3b-VARIANT); checkpoints are written
#                  there by rank 0 and read by every rank on --qrl-resume.
#   STARTUP_TIMEOUT  seconds to wait for the other nodes (torchrun rendezvous, the ranks,
#                  the Ray nodes / GPUs, the engines' placement), default 600;
#   COLLECTIVE_TIMEOUT  seconds a rank waits in one collective (a frozen node), default 900.
#   RAY_AUTH_MODE  disabled (default) or token; set on EVERY node (Ray turns token auth on by
#                  itself when RAY_AUTH_MODE is unset and ~/.ray/auth_token exists, and a node
#                  without the token then fails to join). token: RAY_AUTH_TOKEN_PATH names the
#                  token file every node reads (e.g. on the shared file system).
#   MODEL_SH, PRESET  a smoke run with another model: MODEL_SH=examples/models/X.sh (its
#                  MODEL_ARGS) and the matching CKPT; PRESET replaces qwen3-30b-a3b; PARALLEL
#                  replaces the trainer's layout flags (e.g. PARALLEL="--expert-model-parallel-size 2").
#   DRY_RUN=1      print every node's commands (all roles, NNODES + ENGINE_NODES nodes) and
#                  run nothing.
#   STEPS, SAVE_INTERVAL (-1: no checkpoint), MAX_NEW_TOKENS; extra arguments are Megatron flags.
#   MOE_EXPERTS    the preset's routed experts are stacked (--qrl-train-moe-experts stacked: one
#                  torch grouped GEMM per expert linear; RL step of the 4-layer slice on one H200
#                  9.7-13.0 s (trainer MFU 21.5-22.7%; train-only 30.4%) vs 21 s with TE's
#                  grouped GEMM, docs/BENCHMARKS.md, measured on the local spec only through
#                  bench/rl_step.py, not this script); MOE_EXPERTS=megatron: TE's grouped GEMM.
#                  The preset's micro batch stays 1: 48 layers at 4,096 new tokens per sample.
# Ray is stopped by the process ids this script started (never a global `ray stop`).
#
# STATUS: tested on CPU only, with tiny equivalents (tests/rl/test_rl_ray_multirank.py,
# tests/rl/test_multinode_failures.py: two torchrun nodes and two raylets on one host); the
# dry run of 2 and 3 nodes is checked by tests/examples/test_multinode_script.py. NEVER RUN on
# real nodes: this script itself, NCCL, SGLang inside a Ray actor, SGLang engines of TP > 1.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${MODEL_SH:-}" ]; then source "${MODEL_SH}"; else source "${HERE}/models/qwen3_30b_a3b.sh"; fi

ROLE="${ROLE:-head}"
ENGINES="${ENGINES:-8}"        # rollout engines
ENGINE_TP="${ENGINE_TP:-1}"    # GPUs per engine (one node)
ENGINE_EP="${ENGINE_EP:-1}"    # expert-parallel size inside an engine (divides ENGINE_TP)
MODE="${MODE:-disaggregated}"
if [[ "${MODE}" == colocated ]]; then MEM_FRACTION="${MEM_FRACTION:-0.4}"; ENGINE_NODES=0
else MEM_FRACTION="${MEM_FRACTION:-0.6}"; ENGINE_NODES="${ENGINE_NODES:-1}"; fi
RAY_PORT="${RAY_PORT:-6379}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
ENGINE_NODE_GPUS="${ENGINE_NODE_GPUS:-${GPUS_PER_NODE}}"
NNODES="${NNODES:-2}"          # trainer nodes (torchrun)
MASTER_PORT="${MASTER_PORT:-29500}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-600}"
COLLECTIVE_TIMEOUT="${COLLECTIVE_TIMEOUT:-900}"
VARIANT="${VARIANT:-fp8}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
if [[ "${RAY_AUTH_MODE}" == token ]]; then
    : "${RAY_AUTH_TOKEN_PATH:?RAY_AUTH_MODE=token: set RAY_AUTH_TOKEN_PATH to a token file every node reads}"
    export RAY_AUTH_TOKEN_PATH
elif [[ "${RAY_AUTH_MODE}" != disabled ]]; then
    echo "RAY_AUTH_MODE must be disabled or token, got ${RAY_AUTH_MODE}" >&2; exit 2
fi
if [[ "${NNODES}" -gt 1 || "${ENGINE_NODES}" -gt 0 || "${ROLE}" != head ]]; then
    : "${HEAD_ADDR:?set HEAD_ADDR to the address of trainer node 0, torchrun MASTER_ADDR and the Ray head}"
else
    HEAD_ADDR="${HEAD_ADDR:-127.0.0.1}"
fi

absolute() { [[ "$1" == /* ]] && echo "$1" || echo "$(pwd)/$1"; }

PP="${PP:-1}"                   # trainer pipeline stages (docs/LAUNCH.md "Pipeline parallelism")
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --expert-model-parallel-size 8
    --expert-tensor-parallel-size 1 --pipeline-model-parallel-size "${PP}"
    --sequence-parallel --bf16
)
if [ -n "${PARALLEL:-}" ]; then read -r -a PARALLEL_ARGS <<< "${PARALLEL}"; fi
PRESET="${PRESET:-qwen3-30b-a3b}"
case "${VARIANT}" in
    fp8)        VARIANT_ARGS=(--qrl-rollout-format fp8_block --qrl-loss-kind tis) ;;
    # qerl's LoRA needs adapter serving in SGLang, not wired yet (docs/LORA.md): full-parameter RL
    nvfp4)      VARIANT_ARGS=(--qrl-preset "${PRESET},qerl" --qrl-lora-rank 0) ;;
    nvfp4-w4a4) VARIANT_ARGS=(--qrl-preset "${PRESET},qerl" --qrl-lora-rank 0 --qrl-rollout-nvfp4-w4a4) ;;
    qarl)       VARIANT_ARGS=(--qrl-preset "${PRESET},qarl" --qrl-rollout-format fp8_block) ;;
    *) echo "VARIANT must be fp8, nvfp4, nvfp4-w4a4 or qarl, got ${VARIANT}" >&2; exit 2 ;;
esac

# one node's commands: ROLE / NODE_RANK given; prints (DRY_RUN=1) or runs them
engine_command() {
    RAY_CMD=(ray start --address "${HEAD_ADDR}:${RAY_PORT}" --num-gpus "${ENGINE_NODE_GPUS}" --block)
}
head_ray_command() {
    if [[ "${MODE}" == colocated ]]; then
        RAY_CMD=(env "CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((GPUS_PER_NODE - 1)))"
                 ray start --head --node-ip-address "${HEAD_ADDR}" --port "${RAY_PORT}"
                 --num-gpus "${GPUS_PER_NODE}" --block)
    else
        RAY_CMD=(ray start --head --node-ip-address "${HEAD_ADDR}" --port "${RAY_PORT}"
                 --num-gpus 0 --block)
    fi
}
trainer_command() {  # $1: node rank
    local ckpt out
    ckpt="$(absolute "${CKPT}")"
    out="$(absolute "${OUT:-${SHARED_DIR:-$(pwd)}/qrl_runs/${PRESET}-${VARIANT}}")"
    QRL_ARGS=(
        --qrl-preset "${PRESET}" --qrl-model checkpoint --qrl-checkpoint "${ckpt}"
        --qrl-routing-replay all --qrl-rollout-engine sglang --qrl-output-dir "${out}"
        --qrl-launch-startup-timeout-s "${STARTUP_TIMEOUT}"
        --qrl-launch-collective-timeout-s "${COLLECTIVE_TIMEOUT}"
        --qrl-launch-ray-nodes "$((1 + ENGINE_NODES))"
    )
    FLEET_ARGS=(
        --qrl-rollout-num-engines "${ENGINES}" --qrl-rollout-engine-tp "${ENGINE_TP}"
        --qrl-rollout-engine-ep "${ENGINE_EP}" --qrl-rollout-sglang-mem-fraction "${MEM_FRACTION}"
    )
    if [[ "${DP_ATTENTION:-0}" == 1 ]]; then FLEET_ARGS+=(--qrl-rollout-engine-dp-attention); fi
    if [ -n "${STEPS:-}" ]; then QRL_ARGS+=(--qrl-steps "${STEPS}"); fi
    if [ -n "${SAVE_INTERVAL:-}" ]; then QRL_ARGS+=(--qrl-save-interval "${SAVE_INTERVAL}"); fi
    if [ -n "${MAX_NEW_TOKENS:-}" ]; then QRL_ARGS+=(--qrl-rollout-max-new-tokens "${MAX_NEW_TOKENS}"); fi
    if [ -n "${MOE_EXPERTS:-}" ]; then QRL_ARGS+=(--qrl-train-moe-experts "${MOE_EXPERTS}"); fi
    # rank 0 joins the Ray cluster of this node (ray.init() finds it); other ranks never use Ray
    TRAIN_CMD=(torchrun --nnodes "${NNODES}" --node-rank "$1" --nproc-per-node "${GPUS_PER_NODE}"
               --master-addr "${HEAD_ADDR}" --master-port "${MASTER_PORT}"
               --rdzv-conf "timeout=${STARTUP_TIMEOUT}"
               -m megatron_qrl.rl.cli --qrl-mode "${MODE}" "${QRL_ARGS[@]}" "${FLEET_ARGS[@]}"
               "${VARIANT_ARGS[@]}" -- "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${EXTRA[@]}")
}

EXTRA=("$@")
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    : "${CKPT:?set CKPT to the checkpoint directory}"
    for ((k = 0; k < NNODES; k++)); do
        trainer_command "${k}"
        if ((k == 0)); then
            echo "# node 0: ROLE=head"
            head_ray_command; echo "${RAY_CMD[*]} &"
        else
            echo "# node ${k}: ROLE=trainer NODE_RANK=${k}"
        fi
        echo "${TRAIN_CMD[*]}"
    done
    for ((e = 0; e < ENGINE_NODES; e++)); do
        echo "# node $((NNODES + e)): ROLE=engine"
        engine_command; echo "${RAY_CMD[*]}"
    done
    exit 0
fi

RAY_PID=""
stop_ray() {  # the Ray processes THIS script started (its own process group), nobody else's
    if [ -n "${RAY_PID}" ] && kill -0 "${RAY_PID}" 2>/dev/null; then
        kill -TERM -- "-${RAY_PID}" 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "${RAY_PID}" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-${RAY_PID}" 2>/dev/null || true
    fi
}
case "${ROLE}" in
    engine)
        engine_command
        exec "${RAY_CMD[@]}" ;;
    head)
        : "${CKPT:?set CKPT to the Qwen3-30B-A3B HF directory}"
        NODE_RANK=0
        head_ray_command
        setsid "${RAY_CMD[@]}" & RAY_PID=$!
        trap stop_ray EXIT
        for ((t = 0; t < STARTUP_TIMEOUT; t++)); do
            ray status --address "${HEAD_ADDR}:${RAY_PORT}" >/dev/null 2>&1 && break
            kill -0 "${RAY_PID}" 2>/dev/null || { echo "the Ray head did not start" >&2; exit 1; }
            sleep 1
        done ;;
    trainer)
        : "${CKPT:?set CKPT to the Qwen3-30B-A3B HF directory}"
        : "${NODE_RANK:?set NODE_RANK to the rank of this trainer node, 1 to NNODES-1}" ;;
    *) echo "ROLE must be head, trainer or engine, got ${ROLE}" >&2; exit 2 ;;
esac
trainer_command "${NODE_RANK}"
echo "[run_qwen3_30b_a3b] node ${NODE_RANK}: waiting for ${NNODES} trainer nodes at ${HEAD_ADDR}:${MASTER_PORT} (up to ${STARTUP_TIMEOUT} s)" >&2
"${TRAIN_CMD[@]}"
