# slime 0.3.1 on the H200 machine: sourced by bench/h200.sh for the slime-* phases ($phase,
# $OUT, te_env and the SGLang site's PYTHONPATH come from there). Staged on the CPU machine
# by bench/stage_slime.sh (.stage/slime1 22.3 MiB, .stage/slime2 48.7 MiB); TE (te-part 1..5 +
# te-load) and Ray (ray-part 1..2 + ray-install) as bench/README.md says.
#   slime-part N     copy .stage/slimeN (N = 1, 2) to /tmp/slime_stage (carry .stage/slimeN
#                    with .stage/recipe .stage/stub)
#   slime-install    check the sums, unpack slime's repository to /tmp/slime and the patched
#                    Megatron-LM tree to /tmp/mlm, the wheels to /tmp/slime_site; then slime's
#                    own parse_args with our flags (the launcher test that skips on CPU)
#   slime-ckpt       the random Qwen3-4B shape (${LAYERS:-8} layers) + prompts, and its
#                    fp8_block export, under /tmp/qrl_random_ckpt (~1 min)
#   slime-run        examples/slime/run_qwen3_4b_qrl_1gpu.sh with QRL=${QRL:-1} LOSS=${LOSS:-acr}
#                    -> $OUT/slime_<tag>.log and the per-rollout lines (times, reward, mismatch)
# Every slime phase puts the patched Megatron-LM tree first (its megatron.core replaces the
# 0.16.1 wheel for slime, as in slime's image), slime's repository, then the wheels last (the
# image's own packages win).
SLIME_SITE=/tmp/slime_site
export PYTHONPATH=/tmp/mlm:$PYTHONPATH:/tmp/slime:$SLIME_SITE SLIME_SRC=/tmp/slime
export PATH=/tmp/ray_site/bin:$SLIME_SITE/bin:$PATH  # `ray start` of the example script
case $phase in
  slime-part)
    n=${2:?part number}; mkdir -p /tmp/slime_stage/slime$n
    cp .stage/slime$n/* /tmp/slime_stage/slime$n/ && du -sh /tmp/slime_stage/slime$n ;;
  slime-install)
    (cd /tmp/slime_stage && sha256sum -c --quiet slime1/SHA256SUMS) || exit 1
    tar xJf /tmp/slime_stage/slime1/src.tar.xz -C /tmp   # -> /tmp/slime, /tmp/mlm
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SLIME_SITE" \
      /tmp/slime_stage/slime1/*.whl /tmp/slime_stage/slime2/*.whl
    du -sh /tmp/slime /tmp/mlm "$SLIME_SITE"
    te_env
    python3 -c "import slime.utils.arguments, megatron.training.arguments, sglang_router, wandb, torch_memory_saver; print('slime imports')" || exit 1
    python3 -m pytest -q -rs -n 0 tests/integrations/test_integrations_slime_examples.py \
      "tests/integrations/test_integrations_slime.py::test_launcher_parses_a_real_slime_command_line" \
      2>&1 | tee "$OUT/slime_launcher_test.log" | tail -n 15 ;;
  slime-ckpt)
    te_env; c=/tmp/qrl_random_ckpt/qwen3_4b-${LAYERS:-8}L
    [ -f $c/config.json ] || python3 tools/make_random_checkpoint.py --config qwen3_4b \
      --layers "${LAYERS:-8}" --out $c
    [ -f $c-fp8_block/config.json ] || python3 tools/export_quantized.py --hf-dir $c \
      --format fp8_block --out $c-fp8_block
    du -sh $c $c-fp8_block ;;
  slime-run)
    te_env; tag=${QRL:-1}; [ "$tag" = 1 ] && tag=qrl_${LOSS:-acr} || tag=baseline
    commit=$(cat .commit 2>/dev/null || echo unknown)
    echo "# nvidia-h200 $(date -u +%F), commit $commit: QRL=${QRL:-1} LOSS=${LOSS:-acr} LAYERS=${LAYERS:-8}" \
      > "$OUT/slime_$tag.log"
    SLIME_DIR=/tmp/slime CKPT=/tmp/qrl_random_ckpt/qwen3_4b-${LAYERS:-8}L \
      timeout --kill-after=10 "${RUN_S:-540}" bash examples/slime/run_qwen3_4b_qrl_1gpu.sh \
      >> "$OUT/slime_$tag.log" 2>&1
    echo "slime run rc=$?"
    # slime's per-rollout / per-step log lines (timer, rollout reward, train metrics incl. the
    # mismatch: our kl_behav_prox_k3, slime's --get-mismatch-metrics keys)
    grep -E "perf |rollout [0-9]+:|train_rollout|kl_behav|logp_abs|raw_reward|step [0-9]+:|Error|error" \
      "$OUT/slime_$tag.log" | grep -v Warning | tail -n 40 ;;
  *) echo "unknown slime phase $phase" >&2; exit 2 ;;
esac
