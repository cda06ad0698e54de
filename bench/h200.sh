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
#   kvthroughput  the same at RL lengths with the KV-cache variants: PRESET=rl-512 |
#               rl-1024, VARIANTS=... (default: the `kv` set; ~2.5 min per variant at rl-512,
#               so give one call three variants; LAYERS=12: the first 12 of the 48 layers,
#               ~4x less decode time per variant) -> $OUT/kvthroughput.jsonl
#   kvalign     tests/gpu/test_kv_cache_alignment.py: trainer vs SGLang log-probs with an FP8 KV
#               cache, KV-aligned vs plain vs the BF16-KV floor (tiny Qwen3, ~2 min)
#   kvtrain     qrl-train end to end, ${STEPS:-2} RL steps of the random Qwen3-4B (randckpt or
#               example4b makes it), --qrl-rollout-format ${FORMAT:-fp8} --qrl-rollout-kv-cache
#               ${KV_CACHE:-fp8_e4m3} --qrl-train-forward aligned -> $OUT/kvtrain_metrics.jsonl
#   inplace     tests/gpu/test_sglang_inplace.py (waits for the Marlin prewarm)
#   sync        bench/weight_sync.py, Qwen3-30B-A3B shape in place: per-expert loads (flat +
#               prefetch, the older default) vs the defaults (+ direct loads of the
#               expert-stacked wire) for fp8, w4a16, nvfp4 (~90 s per variant: each starts a 30B engine);
#               the direct sync: VARIANTS=fp8:direct+resident,fp8:direct+resident+packed,... (quantized
#               into the engine's tensors vs the packed stream copied; +qcache: cached codes copied);
#               MODEL=qwen3_4b: the 1-GPU example's dense shapes instead of the 30B-A3B's
#   produce     bench/weight_sync.py --produce-only: the trainer side of the 30B in-place sync
#               without an engine (pack, fingerprints, expert stacking, flat buckets), stacked
#               experts fingerprinted as rows vs one by one (+fpeach) vs per expert (~1 min);
#               +packeach: experts packed per expert and stacked in the sender (the older order);
#               +qcache: codes and scales from a Q(W) cache made before the clock (the sync
#               without its quantization, as with --qrl-train-forward aligned)
#   packprof    bench/pack_profile.py: a torch.profiler trace of the pack alone (FORMATS, LAYERS):
#               GPU busy vs wall, top kernels, top host ops, once with the torch quantizers and
#               once with the fused Triton ones (QUANT_IMPL, default torch,triton), their ratio
#               (~35 s per format)
#   fp8bwd      --qrl-train-aligned-backward / -wgrad fp8 vs bf16: GPU tests (tests/gpu/test_real_gemm.py
#               -k "dgrad or wgrad") and bench/fp8_backward.py --speed-only (4B shapes) -> fp8_backward.jsonl
#   logprob     the fused Triton log-prob kernels (megatron_qrl/losses/triton_logprobs.py):
#               tests/gpu/test_logprob_kernel.py, then bench/logprob_kernel.py, torch vs triton
#               forward + backward ms, GB/s and their ratio at [${ROWS:-16384}, 151936] BF16 with
#               the entropy (TEMPERATURE, default 1), the kernels also at CONFIGS (block x
#               warps, default 2048x4,8192x16) -> $OUT/logprob_kernel.jsonl; needs no
#               setup (torch + Triton only; carry .stage/recipe .stage/stub .commit; ~1.5 min)
#   restart     tests/gpu/test_sglang_restart.py (kill a scheduler; the supervisor recovers)
#   dist        sync="distributed": the engine on GPU 1, buckets broadcast from GPU 0 (one GPU: gloo)
#               over NCCL — tests/gpu/test_sglang_inplace.py -k distributed, then the 30B sync
#   train       qrl-train tiny-cpu with --qrl-rollout-engine sglang (int8 in place, aligned)
#   fleet       tests/gpu/test_sglang_fleet.py (two SGLang engines in Ray actors on one GPU: one
#               broadcast, digests on both, split rollout, SIGKILL + recovery; needs Ray in the
#               site), then bench/rollout_throughput.py --engines 2 vs 1 (VARIANTS, default fp8)
#   aligned     bench/aligned_step.py (aligned-forward step time vs bf16)
#   fp8train    bench/aligned_step.py on Qwen3-4B (LAYERS, default all 36): bf16 vs aligned
#               fake-quant vs aligned real low-bit GEMM (fp8 torch._scaled_mm, int8 torch._int_mm),
#               its operands from the fused Triton kernels and from torch (:real:torch), fp8 with FP8
#               dgrad + wgrad too (:real:bwd8, :real:bwd8:torch); PROFILE=N: one profiled step
#               per variant, its N costliest ops; NMB=N: N micro batches per optimizer step,
#               side by side, times / MFU / ratio, commit in each record; local spec (TE=1:
#               the TE spec where TE is built, te_env); ~3 min -> $OUT/fp8_trainer.jsonl
#   lora-mem    bench/lora_memory.py: Qwen3-4B trainer memory, full vs LoRA / QLoRA-NF4 / NVFP4 base
#   lora        LoRA adapters served by SGLang on its quantized base: bench/lora_sync.py
#               (adapter sync time, Qwen3-30B-A3B shape, r = 32, FORMATS default fp8: no Marlin
#               wait; SCOPES default attn,all: attention-only / + every expert, with the sha256
#               receipt; add attn+noreceipt,all+noreceipt for the transport alone; ~2.5 min) -> $OUT/lora_sync.jsonl, then tests/gpu/test_sglang_lora.py (engine
#               log-probs after adapter updates vs the reference: fp8, w4a16, w4a16 + experts,
#               nvfp4, nvfp4 + experts; waits for the setup phase's Marlin prewarm; ~3 min; LORA_TESTS=0
#               skips them; a
#               failed case prints its worker's last 40 output lines as "worker| ...")
#   loratrain   qrl-train tiny-cpu,qerl with --qrl-rollout-engine sglang (NVFP4 base + adapters
#               served by SGLang, 5 RL steps) -> $OUT/qrl_sglang_lora_metrics.jsonl
#   te-part N   Transformer Engine, part N of 5 of the 276 MB transformer_engine_cu13 wheel
#               (carry .stage/teN; the parts are split here with `split -b 57000000 -d`)
#   te-build    (carry .stage/te0: TE meta wheel, transformer_engine_torch sdist, deps) reassemble,
#               install, compile transformer_engine_torch against the machine's torch in the
#               background (setsid; poll with te-test; TE_JOBS compile jobs, default 16)
#   te-test     wait for the build, then tests/gpu/test_te_recipes.py and the te: variants of
#               bench/aligned_step.py
#   te-save     after te-build: the compiled transformer_engine_torch as xz parts under $OUT
#   te-load     a later machine: te-part 1..5, then te-load (carry .stage/te0 .stage/te_built
#               .stage/recipe .stage/stub): no compile
#   ray-part N  Ray 2.60.0 (no Ray in the image): part N (1..2) of its 79 MB cp312 wheel, staged
#               here as .stage/rayN (split -b 40000000 -d; .stage/ray1/ray.sha256); carry .stage/rayN
#               with .stage/recipe .stage/stub -> /tmp/ray
#   ray-install reassemble, check, install into /tmp/ray_site (every later phase puts it on
#               PYTHONPATH: the fleet test, MODE=colocated)
#   cuda-cases  the CUDA-only cases of the CPU suite (test files found by grep, ~1 min)
#   gpu-tests   every tests/gpu file, one log each with the commit hash under $OUT
#               (FILES=... to choose; ~25 min one after another). STREAMS="a b;c;d" runs
#               each ;-group (files or node ids) as a parallel stream, one log per stream:
#               every file in two calls of ~5.5 min
#   fa3-part N  FA3 attention (sgl_kernel/flash_ops.abi3.so, 1.1 GB, left out of the site):
#               part N (0..2) of its xz (148 MB), staged here by tools/stage_fa3.sh; carry
#               .stage/fa3_N with .stage/recipe and .stage/stub only (57 MB: no room for
#               .stage/s1, so run setup first on the same warm machine) -> /tmp/fa3
#   fa3-install reassemble, check sha256, unpack into /tmp/site/sgl_kernel/, then
#               tools/check_fa3.py: SGLang's fa3 backend imports, FA3 prefill/decode vs SDPA
#               (~1 min). Then VARIANTS=...:fa3 for throughput (bench/rollout_throughput.py
#               lists the options: fa3, flashinfer, deepgemm, deepgemm_dense, sglang)
#
#   randckpt    tools/make_random_checkpoint.py on the GPU: Qwen3-4B (all 36 layers) and a
#               Qwen3-30B-A3B shape with ${LAYERS_30B:-4} layers under /tmp/qrl_random_ckpt (~1-2 min)
#   tespec      tests/gpu/test_te_spec.py: TE spec vs local spec (BF16 noise), the aligned forward
#               on the TE spec vs the rollout reference (every format, grouped experts too), the
#               aligned TE-named model vs the TE model (names, TP attributes, state-dict and
#               torch_dist keys, plain logits, torch_dist load), SDPA on CUDA (TE tests
#               skip with the reason when /tmp/te_site is absent: run te-part/te-build first)
#   rlstep      bench/rl_step.py: one RL step (rollout / recompute / train / sync, trainer MFU,
#               peak trainer memory) of Qwen3-4B, BF16 vs FP8 rollouts (~5 min)
#   rlstep-offload  the same, FP8, with --use-distributed-optimizer --optimizer-cpu-offload
#               (its peak trainer memory next to rlstep's fp8 row)
#   rlstep30b   the same on the Qwen3-30B-A3B shape with ${LAYERS_30B:-4} layers (randckpt first),
#               micro batch 16 (MICRO_BATCH=4: the earlier rows) and the qwen3-30b-a3b preset's
#               stacked experts and fast MoE path (no full recompute); MOE_EXPERTS=megatron:
#               TE's grouped GEMM instead (--qrl-train-moe-experts megatron);
#               VARIANTS may name FMT@aligned, FMT@replay, FMT@alignedreplay (the aligned forward,
#               routing replay of every layer, both), FMT@alignedkeep (aligned, the real GEMM's
#               dequantized weights kept per optimizer step); NO_TE=1: the local spec even with TE staged;
#               any model: FMT@alignedfake (the aligned forward's fake quantization: the mismatch-KL
#               reference of the real GEMM), FMT@aligned8 (aligned, FP8 dgrad and wgrad),
#               FMT@spin (the engine without sleep_on_idle: its scheduler polls a core throughout),
#               FMT@awake (--qrl-trainer-sleep off: the trainer keeps its GPU state through the
#               rollout), FMT@direct (--qrl-rollout-sglang-sync direct: with the memory saver,
#               the engine writes the trainer's weights into its tensors); PROFILE=1: the last
#               step's trainer phases profiled (--qrl-profile-step)
#   moe30b      bench/train_mfu.py on the Qwen3-30B-A3B slice (${LAYERS_30B:-4} layers, no engine):
#               ROWS of MoE build settings (gg grouped GEMM, pf permute fusion, rf router fusion,
#               ag allgather dispatcher, st stacked experts: one torch grouped GEMM per expert
#               linear; al aligned fp8 forward (real FP8 GEMMs), alk + kept dequantized weights,
#               alb aligned fp8_block, rp routing replay) with --breakdown: GPU ms per model part
#               per train micro batch and per log-prob recompute micro batch (two tables);
#               IMPL=local builds the local spec (no TE: st rows without pf / rf). The stacked
#               profile rows: ROWS=none-mb16-st,none-mb16-st-al,none-mb16-st-alk,none-mb16-st-rp
#               IMPL=local (bench/README.md); PROMPTS=32 UPDATES=4: the RL step's batch and
#               its 4 optimizer steps (16 micro batches of 16 samples)
#   teblock     bench/te_block_codes.py: TE Float8BlockQuantizer vs the fp8_block spec, codes and
#               scales element by element, and the recipe's power-of-two setting (~1 min)
#   rlstep-mfu  trainer MFU: bench/train_mfu.py runs the recompute + train phases of
#               one 4B RL step (32 x 8 samples, 1,024 new tokens, synthetic batch, no engine)
#               for ROWS side by side on ONE built policy, at ${UPDATES:-1} optimizer updates per
#               step (the qwen3-4b-1gpu job's; the 7ed221d rows ran 2) (default: the first measured setting
#               full-mb4-oldlp-norope-prox0, then full-mb4-prox0, none-mb4-prox0,
#               none-mb4-lp16512-prox1, none-mb8-lp16512-prox1, full-mb16-lp16512-prox1; prox0
#               recomputes pi_prox of every micro batch, prox1 or no word (the default) not the
#               first update's; a row word thd packs each micro
#               batch, --qrl-pack-sequences, e.g. ROWS=none-mb4,none-mb4-thd; MFU + peak memory per row, under
#               ${MFU_S:-270} s) -> $OUT/train_mfu.jsonl; then ONE real RL step row (fp8
#               rollouts, 1,024 new tokens, ${STEPS:-2} steps, under ${STEP_S:-230} s) with the
#               fastest row's flags whose reserved peak is <= ${MAX_PEAK:-110} GiB ->
#               $OUT/rlstep_mfu.jsonl (its train + recompute share). Needs setup, TE and the
#               random 4B checkpoint (randckpt) on the warm machine; ~8.5 min in all
#   example4b   examples/run_qwen3_4b_1gpu.sh as shipped (MODE=single; MODE=colocated: the engine
#               in a Ray actor, needs ray-install), 3 RL steps on the random Qwen3-4B, no checkpoint
#               written; SLEEP=on: the trainer asleep during rollout (engine mem fraction 0.6
#               unless MEM_FRACTION; SYNC=direct: the direct sync); the metrics go to $OUT/example4b_${MODE}_sleep${SLEEP}[_${SYNC}]_metrics.jsonl
#   slime-part N, slime-sg-part N, slime-sg-install, slime-install, slime-env, slime-ckpt,
#               slime-run   slime 0.3.1 (on SGLang 0.5.15.post1 with slime's patches) staged and
#               run with and without our flags on one GPU: bench/slime.sh, sourced here, lists
#               what each does
#   mg-parity, mg-engine, mg-fleet, mg-dist-test, mg-sync, mg-30b   the multi-GPU runs
#               (nvidia-h200-x2 / -x8): bench/multigpu.sh, sourced here, lists what each does
#   bash bench/h200.sh run PHASE[:SECONDS] ...   several phases in one device call, each under
#               its own timeout (default 300 s), so a hung phase cannot eat the call and its
#               output still comes back (the first restart run hung past the 600 s call)
set -uo pipefail
phase=${1:?usage: bash bench/h200.sh setup|tune|throughput|inplace|restart|dist|sync|produce|packprof|fakeq|logprob|fp8bwd|train|aligned|fp8train|lora-mem|lora|loratrain|te-part N|te-build|te-test|marlin-save|marlin-load|cuda-cases|gpu-tests|fa3-part N|fa3-install|randckpt|tespec|rlstep|rlstep-offload|rlstep30b|rlstep-mfu|example4b|mg-*|slime-*|run PHASE[:SECONDS]...}
if [ "$phase" = run ]; then
  shift
  for item in "$@"; do
    name=${item%%:*}; secs=${item#*:}; [ "$secs" = "$item" ] && secs=300
    echo "=== $name (timeout ${secs} s) ==="
    timeout --kill-after=10 "$secs" bash "$0" "$name"; rc=$?
    [ $rc -eq 124 ] && echo "=== $name TIMED OUT after ${secs} s ===" || echo "=== $name rc=$rc ==="
  done
  exit 0
fi
OUT=${OUT:-/tmp/qrl-out}
FA3_SO_SHA256=b8feae71ed589f0fa8ea407718b6a59411bf6bb5aac7310abeebad0133dd4216
mkdir -p "$OUT"
source .stage/recipe/setup.sh
# the recipe's stand-in IPython (.stage/stub) lacks what matplotlib reads when it makes any
# figure canvas (qrl-train lost its plot to it on the H200): give it version_info >= 8.24
ipy=.stage/stub/IPython/__init__.py
if [ -f $ipy ] && ! grep -q version_info $ipy; then
  printf 'version_info = (8, 24, 0)\ndef get_ipython(): return None\n' >> $ipy; fi
export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/mcore PYTHONUNBUFFERED=1
[ -d /tmp/ray_site ] && export PYTHONPATH=$PYTHONPATH:/tmp/ray_site
if [ ! -d /tmp/mcore/megatron ] && ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mcore .whl/megatron_core-*.whl
fi
te_env() {  # TE on PYTHONPATH once its background build (te-build) has finished and it imports;
  # a phase that starts while the compile runs waits for it (bounded by the phase's timeout);
  # NO_TE=1: the local spec now (e.g. beside a running TE build)
  [ "${NO_TE:-0}" = 1 ] && { echo "NO_TE=1: local spec"; return 0; }
  [ -d /tmp/te_site ] || return 0
  while [ -f /tmp/te_build.pid ] && kill -0 "$(cat /tmp/te_build.pid)" 2>/dev/null; do sleep 5; done
  if PYTHONPATH=$PYTHONPATH:/tmp/te_site python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
    export PYTHONPATH=$PYTHONPATH:/tmp/te_site; echo "TE: /tmp/te_site"
  else echo "TE does not import from /tmp/te_site: local spec"; fi
}
prewarm_start() {  # the Marlin JIT prewarm in the background (~6.5 min of nvcc uncached)
  setsid nohup python3 tools/prewarm_sglang_kernels.py > /tmp/prewarm.log 2>&1 < /dev/null &
  echo $! > /tmp/prewarm.pid; rm -f /tmp/prewarm.asked
}
# the prewarm imports sglang, whose utils need the recipe's stand-in IPython (.stage/stub):
# setup carries no stub (64 MiB limit), so it asks and the first phase that has it starts it
# (started without, every kernel failed at its import: "No module named 'IPython'")
if [ -f /tmp/prewarm.asked ] && [ -d .stage/stub/IPython ]; then
  prewarm_start; echo "Marlin prewarm started (asked by setup)"; fi
marlin_wait() {  # block until the background prewarm (setup phase) has finished, when
  # the phase's VARIANTS / PYTEST_K (unset: every format) name a Marlin format
  case "${VARIANTS:-}${PYTEST_K:-}" in ""|*w4a16*|*nvfp4*) ;; *) return 0 ;; esac
  while [ -f /tmp/prewarm.pid ] && kill -0 "$(cat /tmp/prewarm.pid)" 2>/dev/null; do sleep 5; done
  cat /tmp/prewarm.log 2>/dev/null | grep prewarm
}
case $phase in
  setup)
    nvidia-smi --query-gpu=name,memory.used --format=csv
    [ "${PREWARM:-1}" = 0 ] && { echo "no Marlin prewarm (PREWARM=0)"; exit 0; }
    [ -d .stage/marlin ] && bash "$0" marlin-load  # the prewarm below then loads in seconds
    if [ -d .stage/stub/IPython ]; then prewarm_start
    else touch /tmp/prewarm.asked; echo "Marlin prewarm: starts with the next phase that carries .stage/stub"; fi ;;
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
  kvalign)
    python3 -m pytest -q -s -rs tests/gpu/test_kv_cache_alignment.py 2>&1 \
      | tee "$OUT/kv_alignment.log" | grep -v Warning | tail -n 20 ;;
  kvtrain)
    te_env
    [ -f /tmp/qrl_random_ckpt/qwen3_4b-allL/config.json ] || python3 tools/make_random_checkpoint.py \
      --config qwen3_4b --out /tmp/qrl_random_ckpt/qwen3_4b-allL
    source examples/models/qwen3_4b.sh
    kvout=/tmp/qrl_kvtrain_$(date +%s)
    python3 -m megatron_qrl.rl.cli --qrl-mode single --qrl-preset qwen3-4b-1gpu \
      --qrl-model checkpoint --qrl-checkpoint /tmp/qrl_random_ckpt/qwen3_4b-allL \
      --qrl-rollout-engine sglang --qrl-rollout-format "${FORMAT:-fp8}" \
      --qrl-rollout-kv-cache "${KV_CACHE:-fp8_e4m3}" --qrl-train-forward aligned \
      --qrl-rollout-sglang-mem-fraction 0.3 --qrl-rollout-max-new-tokens 512 \
      --qrl-steps "${STEPS:-2}" --qrl-save-interval -1 --qrl-output-dir "$kvout" \
      -- "${MODEL_ARGS[@]}" --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16 \
      --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 2>&1 \
      | grep -v Warning | tail -n 25
    cp "$kvout/metrics.jsonl" "$OUT/kvtrain_metrics.jsonl" 2>/dev/null ;;
  kvthroughput)
    marlin_wait
    python3 bench/rollout_throughput.py --preset "${PRESET:-rl-512}" --variants "${VARIANTS:-kv}" \
      ${BATCHES:+--batches "$BATCHES"} ${LAYERS:+--layers "$LAYERS"} \
      --out "$OUT/kvthroughput.jsonl" 2>&1 | grep -v "^\s*$" | tail -n 15 ;;
  inplace)
    marlin_wait
    python3 -m pytest -q tests/gpu/test_sglang_inplace.py -s ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | grep -E "\[inplace[^ ]*\]|passed|failed|Error|assert |worker\|" ;;
  restart)  # a SIGKILLed scheduler: restart + re-sync + retry, the trainer process survives
    python3 -m pytest -q tests/gpu/test_sglang_restart.py -s 2>&1 \
      | grep --line-buffered -E "restart|passed|failed|Error|assert |Thread|File " | tail -n 80 ;;
  dist)
    nvidia-smi --query-gpu=index,name --format=csv,noheader
    python3 -m pytest -q tests/gpu/test_sglang_inplace.py -s -k distributed 2>&1 \
      | grep -E "distributed\]|passed|failed|skipped|Error|assert "
    if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
      echo "one GPU: the 30B distributed sync time needs 2 GPUs (NCCL); not measured"; exit 0; fi
    python3 bench/weight_sync.py --out "$OUT/weight_sync_dist.jsonl" \
      --variants "${VARIANTS:-bf16:distributed,fp8:distributed}" 2>&1 | grep -E "^\||sync\]|Error" ;;
  sync)  # engine-side phase times of every in-place bucket: $OUT/inplace_phases.jsonl
    marlin_wait
    QRL_INPLACE_PROFILE="$OUT/inplace_phases.jsonl" python3 bench/weight_sync.py \
      --out "$OUT/weight_sync.jsonl" ${MODEL:+--model "$MODEL"} ${SYNC_ARGS:-} \
      --variants "${VARIANTS:-fp8:inplace+flat+prefetch,fp8:inplace+flat+prefetch+direct+stacked,w4a16:inplace+flat+prefetch+direct+stacked,nvfp4:inplace+flat+prefetch+direct+stacked}" 2>&1 \
      | grep -E "^\||sync\]|Error"
    if [ -f "$OUT/inplace_phases.jsonl" ]; then  # (none from direct variants: rc 0 then too)
      python3 -m megatron_qrl.rollout_sglang.sync.debug "$OUT/inplace_phases.jsonl"; fi ;;
  packprof)  # bench/pack_profile.py: traced packs (FORMATS, default fp8 fp8_block w4a16) of
    # LAYERS (default 8) 30B-A3B layers, one per quantizer of QUANT_IMPL (default torch,triton)
    # -> $OUT/pack_profile_FMT.json (GPU busy vs wall, top kernels, top host ops, torch / triton)
    for f in ${FORMATS:-fp8 fp8_block w4a16}; do
      python3 bench/pack_profile.py --format "$f" --layers "${LAYERS:-8}" \
        --quant-impl "${QUANT_IMPL:-torch,triton}" --out "$OUT/pack_profile_$f.json" 2>&1 \
        | grep -v -i warn | head -n 100
    done ;;
  fp8bwd)  # the FP8 input and weight gradients of the aligned linears vs BF16 (torch only): GPU tests + speed
    python3 -m pytest -q -rs tests/gpu/test_real_gemm.py -k "dgrad or wgrad or fp8_backward" 2>&1 \
      | tee "$OUT/fp8bwd_test.log" | tail -n 8
    python3 bench/fp8_backward.py --speed-only --out "$OUT/fp8_backward.jsonl" 2>&1 | tail -n 20 ;;
  fakeq)  # the aligned experts' Q(W) refresh, torch vs fused Triton fake quantization (no SGLang, no TE)
    python3 -m pytest -q -rs tests/gpu/test_fused_quant.py -k "fake or stacked_refresh" 2>&1 \
      | tee "$OUT/fakeq_test.log" | tail -n 8
    python3 bench/fake_quant_speed.py --out "$OUT/fake_quant_speed.jsonl" 2>&1 \
      | grep -E "^\||fake_quant_speed\]|Error|error" ;;
  logprob)  # torch + Triton only: no SGLang, no TE
    python3 -m pytest -q -rs tests/gpu/test_logprob_kernel.py 2>&1 | tee "$OUT/logprob_test.log" \
      | tail -n 15
    python3 bench/logprob_kernel.py --rows "${ROWS:-16384}" --temperature "${TEMPERATURE:-1.0}" \
      --configs "${CONFIGS:-2048x4,8192x16}" --out "$OUT/logprob_kernel.jsonl" 2>&1 \
      | grep -E "^\||logprob_kernel\]|Error|error" ;;
  produce)  # no SGLang: pure torch on the GPU
    python3 bench/weight_sync.py --produce-only --out "$OUT/produce.jsonl" \
      --variants "${VARIANTS:-fp8:inplace+flat+direct+stacked,fp8:inplace+flat+direct+stacked+qcache,fp8_block:inplace+flat+direct+stacked,fp8_block:inplace+flat+direct+stacked+qcache,fp8:inplace+flat+direct+stacked+packeach,fp8:inplace+flat+direct+stacked+fpeach,fp8:inplace+flat+direct,w4a16:inplace+flat+direct+stacked,w4a16:inplace+flat+direct+stacked+fpeach}" 2>&1 \
      | grep -E "^\||DIFFER|Error" ;;
  train)
    python3 -m megatron_qrl.rl.cli --qrl-preset tiny-cpu --qrl-rollout-engine sglang \
      --qrl-sft-steps 100 --qrl-steps 5 --qrl-output-dir /tmp/qrl_sglang --qrl-no-progress 2>&1 \
      | grep -v Warning | tail -n 20
    cp /tmp/qrl_sglang/metrics.jsonl "$OUT/qrl_sglang_metrics.jsonl" ;;
  lora-mem)  # trainer memory: full RL vs LoRA vs QLoRA-NF4 vs rollout-format bases (Qwen3-4B)
    python3 -m pytest -q tests/models/test_lora.py tests/quant/test_nf4.py 2>&1 | tail -n 2
    python3 bench/lora_memory.py --layers 36 --seq-len 2048 --out "$OUT/lora_memory.jsonl" 2>&1 \
      | grep -v -i warn | tail -n 12 ;;
  lora)
    python3 bench/lora_sync.py --formats "${FORMATS:-fp8}" --scopes "${SCOPES:-attn,all}" \
      --out "$OUT/lora_sync.jsonl" 2>&1 \
      | grep -E "^\||lora_sync\]|Error"
    [ "${LORA_TESTS:-1}" = 0 ] && exit 0  # the bench alone
    marlin_wait
    python3 -m pytest -q -s tests/gpu/test_sglang_lora.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | grep -E "\[lora[^]]*\]|passed|failed|skipped|Error|assert |worker\|" ;;
  loratrain)  # qrl-train QeRL mode end to end with the SGLang engine: NVFP4 base, adapters only
    marlin_wait
    python3 -m megatron_qrl.rl.cli --qrl-preset tiny-cpu,qerl --qrl-rollout-engine sglang \
      --qrl-sft-steps 100 --qrl-steps 5 --qrl-output-dir /tmp/qrl_sglang_lora --qrl-no-progress \
      2>&1 | grep -v Warning | tail -n 20
    cp /tmp/qrl_sglang_lora/metrics.jsonl "$OUT/qrl_sglang_lora_metrics.jsonl" ;;
  aligned)  # one micro-batch (re-quantization dominates), then eight (activations dominate)
    # the fake-quant fast path must be bit-identical to the codes path on CUDA too: checked first
    python3 -m pytest -q tests/quant/test_quant_fake_fast.py -k cuda 2>&1 | tail -n 3
    python3 bench/fake_quant_ops.py --device cuda --experts 64 --repeats 5 2>&1 | tail -n 12
    python3 bench/aligned_step.py --warmup 2 --rounds 6 --profile 12 --per-expert int8 \
      --out "$OUT/aligned_step.jsonl" 2>&1 | grep -v "^\s*$" | tail -n 60
    python3 bench/aligned_step.py --warmup 1 --rounds 4 --num-micro-batches 8 \
      --formats int8,fp8_block,w4a16 --per-expert int8 --out "$OUT/aligned_step_8mb.jsonl" 2>&1 \
      | grep -E "^\||note" ;;
  fp8train)  # plain model not built beside the aligned one (two 4B models + Adam: ~150 GiB)
    [ "${TE:-0}" = 1 ] && te_env
    python3 bench/aligned_step.py --config megatron_qrl/data/configs/qwen3_4b.json \
      ${LAYERS:+--layers $LAYERS} --formats fp8,int8 --real fp8,int8 --real-torch-operands --real-fp8-backward --plain-model no --no-te-variants \
      --warmup 2 --rounds 5 ${PROFILE:+--profile $PROFILE} ${NMB:+--num-micro-batches $NMB} \
      --out "$OUT/fp8_trainer.jsonl" 2>&1 \
      | grep -E "^\||note|device|Error|^profile"
    # fp8_block's real GEMM is SGLang's own (its site must import): its own run, so that a
    # missing SGLang costs only these rows
    python3 bench/aligned_step.py --config megatron_qrl/data/configs/qwen3_4b.json \
      ${LAYERS:+--layers $LAYERS} --formats fp8_block --real fp8_block --plain-model no --no-te-variants \
      --warmup 2 --rounds 5 ${NMB:+--num-micro-batches $NMB} --out "$OUT/fp8_trainer_block.jsonl" 2>&1 | grep -E "^\||note|device|Error" ;;
  te-part)
    mkdir -p /tmp/te && cp .stage/te${2:?part number}/part* /tmp/te/ && ls -la /tmp/te ;;
  te-build)
    cat /tmp/te/part0* > /tmp/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
    (cd /tmp/te && echo "$(cat "$OLDPWD/.stage/te0/cu13.sha256")  transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl" | sha256sum -c) || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te_site \
      /tmp/te/transformer_engine_cu13-*.whl .stage/te0/transformer_engine-*.whl .stage/te0/deps/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/te_site
    (cd /tmp && tar xzf "$OLDPWD/.stage/te0/transformer_engine_torch-2.20.2.tar.gz")
    # its own --target, merged after: pip --target into the existing te_site skips the
    # extension ("Target directory ... already exists"), measured on the H200
    NVTE_FRAMEWORK=pytorch MAX_JOBS=${TE_JOBS:-16} setsid nohup sh -c "python3 -m pip install -v --no-deps \
      --no-build-isolation --no-index --target /tmp/te_torch /tmp/transformer_engine_torch-2.20.2 \
      && cp -r /tmp/te_torch/. /tmp/te_site/" > /tmp/te_build.log 2>&1 < /dev/null &
    echo $! > /tmp/te_build.pid
    echo "building transformer_engine_torch in the background (log /tmp/te_build.log)" ;;
  te-save)  # the compiled transformer_engine_torch back under $OUT (<= 4 x 16 MiB xz parts): a
    # later machine carries them as .stage/te_built and runs te-load instead of the 7-min compile
    te_env
    tar cf - -C /tmp te_torch | xz -T0 -6 > /tmp/te_torch.tar.xz && ls -la /tmp/te_torch.tar.xz
    (cd /tmp && sha256sum te_torch.tar.xz > "$OUT/te_torch.sha256" \
      && split -b 16000000 -d te_torch.tar.xz "$OUT/te_torch.tar.xz.part") ; ls -la "$OUT" ;;
  te-load)  # carry .stage/te0 and .stage/te_built (+ the five parts as te-part calls first)
    cat /tmp/te/part0* > /tmp/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te_site \
      /tmp/te/transformer_engine_cu13-*.whl .stage/te0/transformer_engine-*.whl .stage/te0/deps/*.whl
    (cd .stage/te_built && cat te_torch.tar.xz.part* > /tmp/te_torch.tar.xz) \
      && (cd /tmp && sha256sum -c "$OLDPWD/.stage/te_built/te_torch.sha256") || exit 1
    tar xJf /tmp/te_torch.tar.xz -C /tmp && cp -r /tmp/te_torch/. /tmp/te_site/
    te_env ;;
  te-test)
    te_env
    while kill -0 "$(cat /tmp/te_build.pid)" 2>/dev/null; do sleep 10; done
    tail -n 5 /tmp/te_build.log
    python3 -c "import transformer_engine as t, transformer_engine.pytorch; print('TE', t.__version__)" || exit 1
    python3 -m pytest -q tests/gpu/test_te_recipes.py -s 2>&1 | tee "$OUT/te_test.log" | tail -n 20
    # 4 of the 6 layers: the plain bf16, the fake-quant and the TE model together (114 GiB peak)
    python3 bench/aligned_step.py --layers 4 --warmup 2 --rounds 6 --out "$OUT/aligned_step_te.jsonl" \
      2>&1 | grep -E "^\||note" ;;
  ray-part)
    mkdir -p /tmp/ray && cp .stage/ray${2:?part number}/* /tmp/ray/ && ls -la /tmp/ray ;;
  ray-install)
    (cd /tmp/ray && cat rpart0* > ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl && sha256sum -c ray.sha256) || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ray_site /tmp/ray/ray-*.whl
    PYTHONPATH=$PYTHONPATH:/tmp/ray_site python3 -c "import ray; ray.init(num_cpus=2); print('ray', ray.__version__, ray.cluster_resources()); ray.shutdown()" ;;
  gpu-tests)  # FILES: tests/gpu files (default: all), one log each headed by the commit;
    # STREAMS="targets;targets;...": each ;-group (files or pytest node ids) runs as its own
    # parallel stream (SGLang sizes its pool from the memory free at its start, so 4 streams
    # of 0.3-fraction engines fit one H200), one log per stream (the device returns <= 8 files).
    # Keep the mem_fraction_static of the engines alive at once <= ~0.9 across the streams:
    # test_sglang_load 0.45, test_sglang_fleet 2 x 0.3, the others 0.3 (one more 0.3 engine next
    # to load + two others starved: "Loaded weights leave no GPU memory for the
    # KV cache"); a file that waits for the Marlin prewarm (~6.5 min uncached) holds its stream
    # Trainer-side tensors count too (the TE tests, each in-place worker's reference models):
    # three 0.3 streams beside test_te_spec starved the fp8 in-place engine, so
    # keep <= ~0.6 of engines beside a TE / trainer stream.
    te_env
    commit=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)  # .commit first: the device copy's git HEAD can be stale
    # no -s: under xdist (pyproject's addopts) a test's prints reach the log only as captured
    # output: -rP shows them for passed tests (stdout only), a failure shows them with its
    # report, written as it happens (QRL_PRINT_FAILURES, tests/conftest.py) so a run cut short
    # keeps what failed; faulthandler dumps every thread's stack of a test running past
    # FAULT_S seconds; PYTEST_ARGS adds options (e.g. "--maxfail=1", "-n 0", "-x")
    read -ra extra <<< "${PYTEST_ARGS:-}"
    pytest_opts=(-q -rfEsP --tb=short --show-capture=stdout
                 -o "faulthandler_timeout=${FAULT_S:-300}" "${extra[@]}")
    run_tests() {  # $1: the log; the rest: pytest targets, run one after another
      local log=$1; shift
      case "$*" in *w4a16*|*nvfp4*|*test_sglang_inplace.py|*test_sglang_load.py|*test_sglang_lora.py) marlin_wait ;; esac
      for f in "$@"; do
        echo "# nvidia-h200 $(date -u +%F), commit $commit: python3 -m pytest ${pytest_opts[*]} $f" >> "$log"
        QRL_PRINT_FAILURES=1 python3 -m pytest "${pytest_opts[@]}" "$f" ${PYTEST_K:+-k "$PYTEST_K"} \
          >> "$log" 2>&1
        echo "$f: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1)"
      done
    }
    if [ -n "${STREAMS:-}" ]; then
      IFS=';' read -ra groups <<< "$STREAMS"; i=0
      for g in "${groups[@]}"; do
        i=$((i + 1)); read -ra targets <<< "$g"
        run_tests "$OUT/gpu_tests_stream$i.log" "${targets[@]}" &
      done
      wait
    else
      for f in ${FILES:-tests/gpu/test_*.py}; do run_tests "$OUT/$(basename "$f" .py).log" "$f"; done
    fi ;;
  cuda-cases)  # the CUDA-only cases of the CPU suite (skipped on CI): every tests/ file (not
    # tests/gpu) with a `skipif(not torch.cuda.is_available()` case, found by grep so a moved file
    # stays covered; only its cases named *cuda* run
    files=$(grep -rlE "skipif\(not torch\.cuda\.is_available" tests --include='test_*.py' | grep -v '^tests/gpu/')
    echo "cuda cases in: $files"
    python3 -m pytest -q -rs -k cuda $files 2>&1 | tail -n 5 ;;
  marlin-save)  # the Marlin JIT kernels (the setup prewarm, ~6.5 min of nvcc) back under $OUT
    # as <= 16 MB xz parts: a later machine carries them as .stage/marlin and setup loads them.
    # SGLang's load_jit reuses a built .so found under its content- and arch-keyed directory
    # (sglang/kernels/jit/utils/compile.py), so only the .so files travel
    marlin_wait; cache=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
    (cd "$cache" && find . -name '*.so' | tar cf - -T - | xz -T0 -6 > /tmp/marlin.tar.xz) || exit 1
    (cd /tmp && sha256sum marlin.tar.xz > "$OUT/marlin.sha256" \
      && split -b 16000000 -d marlin.tar.xz "$OUT/marlin.tar.xz.part") ; ls -la "$OUT" ;;
  marlin-load)  # carry .stage/marlin (the parts marlin-save wrote)
    cache=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}; mkdir -p "$cache"
    (cd .stage/marlin && cat marlin.tar.xz.part* > /tmp/marlin.tar.xz) \
      && (cd /tmp && sha256sum -c "$OLDPWD/.stage/marlin/marlin.sha256") || exit 1
    tar xJf /tmp/marlin.tar.xz -C "$cache" && find "$cache" -name '*.so' | sed 's/^/marlin: /' ;;
  fa3-part)
    mkdir -p /tmp/fa3 && cp .stage/fa3_${2:?part number}/* /tmp/fa3/ && ls -la /tmp/fa3 ;;
  fa3-install)  # the raw sha256 is tools/stage_fa3.sh's SO_SHA256 (sglang-kernel 0.4.5 wheel)
    so=/tmp/site/sgl_kernel/flash_ops.abi3.so
    if ! echo "$FA3_SO_SHA256  $so" | sha256sum -c --quiet 2>/dev/null; then
      (cd /tmp/fa3 && cat flash_ops.so.xz.part_* > flash_ops.so.xz && sha256sum -c flash_ops.so.xz.sha256) || exit 1
      xz -T0 -d -c /tmp/fa3/flash_ops.so.xz > $so.tmp && mv $so.tmp $so && rm /tmp/fa3/flash_ops.so.xz
      echo "$FA3_SO_SHA256  $so" | sha256sum -c || exit 1
    fi
    python3 tools/check_fa3.py ;;
  randckpt)
    te_env
    python3 tools/make_random_checkpoint.py --config qwen3_4b --out /tmp/qrl_random_ckpt/qwen3_4b-allL
    python3 tools/make_random_checkpoint.py --config qwen3_30b_a3b --layers "${LAYERS_30B:-4}" \
      --out "/tmp/qrl_random_ckpt/qwen3_30b_a3b-${LAYERS_30B:-4}L"
    du -sh /tmp/qrl_random_ckpt/* ;;
  tespec)
    te_env
    python3 -m pytest -q tests/gpu/test_te_spec.py -s -rs 2>&1 | tee "$OUT/te_spec.log" | tail -n 30 ;;
  rlstep|rlstep-offload|rlstep30b)  # one phase per device call (~2.5 min per variant)
    te_env
    recompute="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    case $phase in
      rlstep) model=(--model qwen3_4b); variants=${VARIANTS:-bf16,fp8}; mbs=4 ;;
      rlstep-offload) model=(--model qwen3_4b); variants=${VARIANTS:-fp8@offload}; mbs=4 ;;
      rlstep30b) model=(--model qwen3_30b_a3b --layers "${LAYERS_30B:-4}")
                 variants=${VARIANTS:-bf16,fp8}; mbs=16
                 # micro batch 16: 4.01 s train / 13.0 s step vs 5.97 / 18.4 s at 4, 73.3 GiB peak
                 # (stacked experts, local spec, bench/results/rlstep30b_st_local_98f7b96.jsonl);
                 # the preset's fast MoE path (fused permute / router, selective moe_act
                 # recompute where TE is staged) instead of full recompute; TE's fused grouped
                 # GEMM for MOE_EXPERTS=megatron (13.0% vs 10.5% trainer MFU on the 4-layer slice,
                 # bench/results/moe30b_ee27c8e.jsonl)
                 recompute=""
                 export NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=${NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM:-1} ;;
    esac
    python3 bench/rl_step.py "${model[@]}" --formats "$variants" \
      --variant-flags "offload=--use-distributed-optimizer --optimizer-cpu-offload" \
      --variant-flags "aligned=--qrl-train-forward aligned" \
      --variant-flags "replay=--qrl-routing-replay all" \
      --variant-flags "alignedreplay=--qrl-train-forward aligned --qrl-routing-replay all" \
      --variant-flags "alignedkeep=--qrl-train-forward aligned --qrl-train-aligned-keep-dequantized" \
      --variant-flags "alignedfake=--qrl-train-forward aligned --qrl-train-aligned-gemm fake" \
      --variant-flags "aligned8=--qrl-train-forward aligned --qrl-train-aligned-backward fp8 --qrl-train-aligned-wgrad fp8" \
      --variant-flags "spin=--no-qrl-rollout-sglang-sleep-on-idle" \
      --variant-flags "awake=--qrl-trainer-sleep off" \
      --variant-flags "direct=--qrl-rollout-sglang-sync direct" ${PROFILE:+--profile} \
      --megatron "${RLSTEP_MEGATRON:-$recompute}" --micro-batch-size "${MICRO_BATCH:-$mbs}" \
      ${MOE_EXPERTS:+--moe-experts "$MOE_EXPERTS"} \
      --prompts "${PROMPTS:-32}" --n 8 --max-new-tokens "${NEW_TOKENS:-1024}" --steps 2 \
      --out "$OUT/${phase//-/_}${TAG:-}.jsonl" 2>&1 | grep -E "^\||rl_step\]|Error|error" | tail -n 20 ;;
  moe30b)  # the 30B-A3B slice's trainer alone (no engine): MoE build settings side by side,
    # each row's GPU time by model part (bench/layer_profile.py) -> $OUT/moe30b.jsonl
    te_env
    timeout --kill-after=10 "${MFU_S:-540}" python3 bench/train_mfu.py --model qwen3_30b_a3b \
      --layers "${LAYERS_30B:-4}" --rows "${ROWS:-full-mb2,none-mb2-gg,none-mb8-gg,none-mb8-gg-pf}" \
      --transformer-impl "${IMPL:-auto}" \
      --prompts "${PROMPTS:-16}" --new-tokens "${NEW_TOKENS:-1024}" --updates "${UPDATES:-1}" \
      --breakdown --no-profile --out "$OUT/moe30b${TAG:-}.jsonl" 2>&1 \
      | grep -E "^\||train_mfu\]|Error|error" | grep -v '"breakdown"' | tail -n 100 ;;
  teblock)  # TE's FP8 block quantizer vs the fp8_block spec, codes and scales element by element
    te_env
    python3 bench/te_block_codes.py --out "$OUT/te_block_codes.jsonl" 2>&1 \
      | grep -E "te_block_codes\]|Error|error" ;;
  rlstep-mfu)
    te_env
    rm -f "$OUT/train_mfu${TAG:-}.jsonl"
    timeout --kill-after=10 "${MFU_S:-270}" python3 bench/train_mfu.py --model qwen3_4b \
      ${ROWS:+--rows "$ROWS"} --new-tokens "${NEW_TOKENS:-1024}" --updates "${UPDATES:-1}" \
      --out "$OUT/train_mfu${TAG:-}.jsonl" 2>&1 | grep -E "^\||train_mfu\]|Error|error" | tail -n 24
    picked=$(python3 bench/train_mfu.py --pick "$OUT/train_mfu${TAG:-}.jsonl" \
      --max-peak-gib "${MAX_PEAK:-110}") || { echo "no train_mfu row for the RL step"; exit 1; }
    { read -r mb; read -r meg; read -r qrl; } <<< "$picked"
    echo "RL step row: $mb --megatron '$meg' --qrl '$qrl'"
    timeout --kill-after=10 "${STEP_S:-230}" python3 bench/rl_step.py --model qwen3_4b \
      --formats fp8 $mb --megatron "$meg" --qrl "$qrl" --prompts 32 --n 8 \
      --max-new-tokens "${NEW_TOKENS:-1024}" --steps "${STEPS:-2}" \
      --out "$OUT/rlstep_mfu${TAG:-}.jsonl" 2>&1 | grep -E "^\||rl_step\]|Error|error" | tail -n 8 ;;
  example4b)
    te_env
    [ -f /tmp/qrl_random_ckpt/qwen3_4b-allL/config.json ] || python3 tools/make_random_checkpoint.py \
      --config qwen3_4b --out /tmp/qrl_random_ckpt/qwen3_4b-allL
    CKPT=/tmp/qrl_random_ckpt/qwen3_4b-allL STEPS=${STEPS:-3} SAVE_INTERVAL=-1 \
      OUT=/tmp/qrl_example4b bash examples/run_qwen3_4b_1gpu.sh 2>&1 \
      | grep -v Warning | tail -n 25
    m="$OUT/example4b_${MODE:-single}_sleep${SLEEP:-off}${SYNC:+_$SYNC}${RELEASE:+_release$RELEASE}_metrics.jsonl"
    cp /tmp/qrl_example4b/metrics.jsonl "$m" 2>/dev/null && rm -rf /tmp/qrl_example4b
    python3 -c "import json; [print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k.startswith('sync_') or k in ('step', 'time_rollout_s', 'time_recompute_s', 'time_train_s', 'time_sync_s', 'time_engine_resume_s', 'time_sleep_s', 'time_wake_s', 'trainer_gpu_gib_asleep', 'rollout_waves', 'trainer_peak_gib', 'trained_tokens')}) for r in map(json.loads, open('$m'))]" ;;
  fleet)
    python3 -c "import ray; print('ray', ray.__version__)" || echo "Ray is not in the site: the fleet test skips"
    python3 -m pytest -q tests/gpu/test_sglang_fleet.py -s 2>&1 \
      | grep -E "\[fleet\]|passed|failed|skipped|SKIP|Error|assert " | tail -n 40
    for n in 1 2; do
      python3 bench/rollout_throughput.py --variants "${VARIANTS:-fp8}" --batches 128 --new 256 \
        --engines $n --out "$OUT/throughput_fleet.jsonl" 2>&1 | grep -E "^\||Error" | tail -n 4
    done ;;
  mg-*) source bench/multigpu.sh ;;  # the multi-GPU phases (their list is there)
  slime-*) source bench/slime.sh ;;  # slime 0.3.1 (its list is there)
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
