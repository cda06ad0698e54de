# The multi-GPU phases (nvidia-h200-x2 / -x4 / -x8), sourced by bench/h200.sh for any
# phase named mg-* (after its setup: the SGLang site, megatron-core, PYTHONPATH, te_env):
#
#   bash bench/h200.sh mg-parity        (or: bash bench/h200.sh run mg-parity:400 mg-engine:590)
#
# Each writes under $OUT (the device returns at most 8 files per call: each phase writes <= 3).
#   mg-parity   x2, ~3 min: tests/gpu/test_multigpu_parity.py — qrl-train at TP=2 (+ sequence
#               parallel) and EP=2 under torchrun + NCCL vs TP=1, BF16, the TE spec where
#               /tmp/te_site imports (te-load first; else the local spec, printed): 3 SFT steps'
#               loss / token acc / grad norm within BF16 noise, then 1 RL step
#               -> $OUT/mg_parity.log
#   mg-engine   x2, ~6 min: tests/gpu/test_multigpu_sglang.py — an SGLang engine of TP 2 synced
#               in place (fp8, int8) vs the aligned reference; qrl-train colocated with one
#               engine of --qrl-rollout-engine-tp 2, and torchrun EP 2 with 2 engines (one per
#               GPU), 2 RL steps each (Ray: ray-part 1..2 + ray-install first)
#               -> $OUT/mg_engine.log
#   mg-fleet    x2, ~5 min: bench/rollout_throughput.py on the Qwen3-30B-A3B shape, VARIANTS
#               (default fp8), 256 new tokens: one engine at batch 128 and 256, then 2 engines
#               on 2 GPUs (--gpus 2) at 256 (128 each); --scaling prints the ratio at the same
#               batch per engine (target >= 1.9x) and at the same total batch
#               (FLEET_GPUS=8 on x8: 8 engines at 1,024 vs one at 128 and 1,024)
#               -> $OUT/mg_fleet.jsonl
#   mg-dist-test x2, ~3 min: tests/gpu/test_sglang_inplace.py -k distributed — the engine on
#               GPU 1, every bucket broadcast from GPU 0 over NCCL (bf16, int8, fp8) vs the
#               aligned reference -> $OUT/mg_dist_test.log
#   mg-sync     x2, ~6.5 min: bench/weight_sync.py, Qwen3-30B-A3B shape, each format's sync
#               to an engine on GPU 1 over NCCL (FMT:distributed) next to the colocated in-place
#               sync on GPU 0 (the engine's defaults), one engine start each (~90 s):
#               VARIANTS default fp8 and int8 pairs -> $OUT/mg_sync.jsonl
#   mg-30b      x8 (or x4: EP 4, 4 engines), ~8 min: bench/run_30b_example.sh —
#               examples/run_qwen3_30b_a3b.sh as shipped, one node, MODE=colocated, one engine
#               per GPU (fp8_block), trainer TP 2 x EP min(G, 8) + distributed optimizer,
#               3 RL steps of 256 new tokens on a random Qwen3-30B-A3B shape of
#               ${LAYERS_30B:-8} layers (made here when absent, ~1 min; 48 = the full model, not
#               in one call). Needs TE (te-load: --moe-grouped-gemm and the alltoall dispatcher)
#               and Ray; nvidia-smi samples every GPU's memory each second
#               -> $OUT/mg30b_metrics.jsonl, $OUT/mg30b_summary.json (step split + per-GPU
#               peak GiB), $OUT/mg30b.log (the run's last 300 lines)
# shellcheck shell=bash
mg_gpus() { nvidia-smi -L | wc -l; }
mg_need_gpus() {  # $1: GPUs the phase needs
  local n; n=$(mg_gpus)
  if [ "$n" -lt "$1" ]; then echo "$phase needs >= $1 GPUs, this machine has $n"; exit 3; fi
}
mg_cli_shims() {  # torchrun / ray as commands for examples/*.sh (pip --target has no PATH entry)
  mkdir -p /tmp/mg_bin && export PATH=/tmp/mg_bin:/tmp/ray_site/bin:$PATH
  command -v torchrun >/dev/null || printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' \
    > /tmp/mg_bin/torchrun
  if ! ray --version >/dev/null 2>&1; then  # rank 0's ray.init() then starts a local cluster
    echo "the ray CLI does not run here: a no-op stand-in (qrl-train starts Ray itself)"
    printf '#!/bin/sh\nexit 0\n' > /tmp/mg_bin/ray
  fi
  chmod +x /tmp/mg_bin/* 2>/dev/null; return 0
}
case $phase in
  mg-parity)
    mg_need_gpus 2; te_env
    python3 -m pytest -q -s -rs tests/gpu/test_multigpu_parity.py 2>&1 | tee "$OUT/mg_parity.log" \
      | grep -E "\[mg-parity\]|passed|failed|skipped|Error|assert " | tail -n 40 ;;
  mg-engine)
    mg_need_gpus 2; te_env
    python3 -c "import ray; print('ray', ray.__version__)" || echo "no Ray: the qrl-train cases skip"
    python3 -m pytest -q -s -rs tests/gpu/test_multigpu_sglang.py 2>&1 | tee "$OUT/mg_engine.log" \
      | grep -E "\[mg-engine\]|\[inplace\+tp2\]|passed|failed|skipped|Error|assert |worker\|" \
      | tail -n 60 ;;
  mg-fleet)  # FLEET_GPUS=N (default 2): N engines on N GPUs, 128 per engine
    n=${FLEET_GPUS:-2}; mg_need_gpus "$n"
    python3 bench/rollout_throughput.py --variants "${VARIANTS:-fp8}" --batches "128,$((128 * n))" \
      --new 256 --out "$OUT/mg_fleet.jsonl" 2>&1 | grep -E "^\||Error" | tail -n 6
    python3 bench/rollout_throughput.py --variants "${VARIANTS:-fp8}" --batches $((128 * n)) \
      --new 256 --engines "$n" --gpus "$n" --out "$OUT/mg_fleet.jsonl" 2>&1 \
      | grep -E "^\||Error" | tail -n 6
    python3 bench/rollout_throughput.py --scaling "$OUT/mg_fleet.jsonl" ;;
  mg-dist-test)
    mg_need_gpus 2
    python3 -m pytest -q -s -rs tests/gpu/test_sglang_inplace.py -k distributed 2>&1 \
      | tee "$OUT/mg_dist_test.log" | grep -E "distributed\]|passed|failed|skipped|Error|assert " ;;
  mg-sync)
    mg_need_gpus 2
    stacked=inplace+flat+prefetch+direct+stacked
    python3 bench/weight_sync.py --out "$OUT/mg_sync.jsonl" \
      --variants "${VARIANTS:-fp8:distributed,fp8:$stacked,int8:distributed,int8:$stacked}" 2>&1 \
      | grep -E "^\||sync\]|Error" ;;
  mg-30b)
    mg_need_gpus 4; te_env; mg_cli_shims
    python3 -c "import transformer_engine.pytorch" 2>/dev/null \
      || { echo "mg-30b needs TE (te-part 1..5, te-load): --moe-grouped-gemm / alltoall"; exit 3; }
    python3 -c "import ray" || { echo "mg-30b needs Ray (ray-part 1..2, ray-install)"; exit 3; }
    layers=${LAYERS_30B:-8}; ck=/tmp/qrl_random_ckpt/qwen3_30b_a3b-${layers}L
    [ -f "$ck/config.json" ] || python3 tools/make_random_checkpoint.py --config qwen3_30b_a3b \
      --layers "$layers" --out "$ck" || exit 1
    rm -rf /tmp/qrl_30b_example
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 1000 \
      > /tmp/mg30b_gpu_mem.csv 2>/dev/null &
    smi=$!
    CKPT=$ck LAYERS=$layers RUN_OUT=/tmp/qrl_30b_example timeout --kill-after=10 "${RUN_S:-480}" \
      bash bench/run_30b_example.sh > /tmp/mg30b.log 2>&1; echo "run_30b_example rc=$?"
    kill "$smi" 2>/dev/null
    ray stop --force >/dev/null 2>&1
    grep -v -i warn /tmp/mg30b.log | tail -n 300 > "$OUT/mg30b.log"; tail -n 25 "$OUT/mg30b.log"
    cp /tmp/qrl_30b_example/metrics.jsonl "$OUT/mg30b_metrics.jsonl" 2>/dev/null
    python3 bench/multigpu_summary.py --metrics /tmp/qrl_30b_example/metrics.jsonl \
      --gpu-log /tmp/mg30b_gpu_mem.csv --out "$OUT/mg30b_summary.json" ;;
  *) echo "unknown multi-GPU phase $phase (bench/multigpu.sh)" >&2; exit 2 ;;
esac
