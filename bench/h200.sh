#!/usr/bin/env bash
# The GPU measurements of docs/BENCHMARKS.md and the H200 tests, one phase per device call.
#
#   bash bench/h200.sh PHASE        (repo root on the H200 machine; results under $OUT)
#
# Needs the SGLang 0.5.17 recipe staged in .stage/ (shared/gpu/sglang-h200/README.md) and, for
# the trainer phases, the megatron-core wheel in .whl/ (python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
# megatron-core==0.16.1). Phases, in the order a session runs them back to back (the machine's
# /tmp — the unpacked SGLang site and the Marlin kernel cache — survives while it stays warm):
#   setup       unpack SGLang, install megatron-core, start the Marlin prewarm in the background
#   tune        tools/tune_fused_moe.py for fp8_block, fp8, int8 side by side (~3 min)
#   throughput  bench/rollout_throughput.py (set VARIANTS=...; default every format)
#   inplace     tests/gpu/test_sglang_inplace.py (waits for the Marlin prewarm)
#   sync        bench/weight_sync.py, Qwen3-30B-A3B shape, every format in place
#   train       qrl-train tiny-cpu with --qrl-rollout-engine sglang (int8 in place, aligned)
#   aligned     bench/aligned_step.py (aligned-forward step time vs bf16)
set -uo pipefail
phase=${1:?usage: bash bench/h200.sh setup|tune|throughput|inplace|sync|train|aligned}
OUT=${OUT:-/tmp/qrl-out}
mkdir -p "$OUT"
source .stage/recipe/setup.sh
export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/mcore PYTHONUNBUFFERED=1
if [ ! -d /tmp/mcore/megatron ] && ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/megatron_core-*.whl
fi
marlin_wait() {  # block until the background prewarm (setup phase) has finished
  while [ -f /tmp/prewarm.pid ] && kill -0 "$(cat /tmp/prewarm.pid)" 2>/dev/null; do sleep 5; done
  cat /tmp/prewarm.log 2>/dev/null | grep prewarm
}
case $phase in
  setup)
    nvidia-smi --query-gpu=name,memory.used --format=csv
    setsid nohup python3 tools/prewarm_sglang_kernels.py > /tmp/prewarm.log 2>&1 < /dev/null &
    echo $! > /tmp/prewarm.pid ;;
  tune)
    pids=""
    for f in fp8_block fp8 int8; do
      python3 tools/tune_fused_moe.py --formats $f --budget-s 110 --out /tmp/qrl_moe_configs \
        --summary "$OUT/tune_$f.json" > "$OUT/tune_$f.log" 2>&1 & pids="$pids $!"
    done
    wait $pids
    grep -h "x[0-9]" "$OUT"/tune_*.log
    tar czf "$OUT/moe_configs.tgz" -C /tmp qrl_moe_configs ;;
  throughput)
    marlin_wait
    python3 bench/rollout_throughput.py --variants "${VARIANTS:-bf16,int8,fp8,fp8_block,w4a16,nvfp4}" \
      --out "$OUT/throughput.jsonl" 2>&1 | grep -v "^\s*$" | tail -n 15 ;;
  inplace)
    marlin_wait
    python3 -m pytest -q tests/gpu/test_sglang_inplace.py -s ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | grep -E "inplace\]|passed|failed|Error|assert " ;;
  sync)
    marlin_wait
    python3 bench/weight_sync.py --out "$OUT/weight_sync.jsonl" \
      --variants "${VARIANTS:-bf16:tensor,int8:inplace,fp8:inplace,fp8_block:inplace,w4a16:inplace,nvfp4:inplace}" 2>&1 \
      | grep -E "^\||sync\]|Error" ;;
  train)
    python3 -m megatron_qrl.rl.cli --qrl-preset tiny-cpu --qrl-rollout-engine sglang \
      --qrl-sft-steps 100 --qrl-steps 5 --qrl-output-dir /tmp/qrl_sglang --qrl-no-progress 2>&1 \
      | grep -v Warning | tail -n 20
    cp /tmp/qrl_sglang/metrics.jsonl "$OUT/qrl_sglang_metrics.jsonl" ;;
  aligned)
    python3 bench/aligned_step.py --warmup 2 --rounds 8 --out "$OUT/aligned_step.jsonl" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
