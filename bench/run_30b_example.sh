#!/usr/bin/env bash
# The multi-GPU run of examples/run_qwen3_30b_a3b.sh on ONE node of G GPUs (bench/h200.sh mg-30b
# calls it; tests/examples/test_example_30b.py parses exactly these arguments on the CPU):
# MODE=colocated (ROLE=head starts the Ray head with the node's G GPUs), G engines of TP 1 (one
# per GPU), FP8-block rollouts (VARIANT=fp8), trainer TP 2 x EP min(G, 8) with sequence
# parallel and the distributed optimizer, STEPS (3) RL steps, no checkpoint, MAX_NEW_TOKENS
# (256) new tokens. The checkpoint has LAYERS decoder layers (make it with
# tools/make_random_checkpoint.py --config qwen3_30b_a3b --layers LAYERS).
#   CKPT=/tmp/qrl_random_ckpt/qwen3_30b_a3b-8L LAYERS=8 bash bench/run_30b_example.sh
# GPUS (default: nvidia-smi's count), EP, ENGINES, STEPS, MAX_NEW_TOKENS, RUN_OUT (the run's
# --qrl-output-dir, default /tmp/qrl_30b_example) override; extra arguments are Megatron flags.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${CKPT:?set CKPT to the random Qwen3-30B-A3B checkpoint}" "${LAYERS:?set LAYERS to its layers}"
G="${GPUS:-$(nvidia-smi -L | wc -l)}"
EP="${EP:-$(( G < 8 ? G : 8 ))}"
export MODE=colocated ROLE=head NNODES=1 GPUS_PER_NODE="${G}" ENGINES="${ENGINES:-${G}}"
export ENGINE_TP=1 ENGINE_EP=1 VARIANT=fp8 HEAD_ADDR="${HEAD_ADDR:-127.0.0.1}" CKPT
export STEPS="${STEPS:-3}" SAVE_INTERVAL=-1 MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-256}"
export OUT="${RUN_OUT:-/tmp/qrl_30b_example}"
exec bash "${HERE}/../examples/run_qwen3_30b_a3b.sh" --use-distributed-optimizer \
    --num-layers "${LAYERS}" --expert-model-parallel-size "${EP}" "$@"
