# shellcheck shell=bash disable=SC2154
# slime 0.3.1 on the H200 machine: sourced by bench/h200.sh for the slime-* phases ($phase,
# $OUT, te_env and the SGLang site's PYTHONPATH come from there). Staged on the CPU machine
# by bench/stage_slime.sh (.stage/slime1 23.8 MiB, .stage/slime2 48.7 MiB) and
# bench/stage_slime_sglang.sh (.stage/slime_sg1 26.4 MiB: SGLang 0.5.15.post1 with slime's
# patches, the SGLang slime 0.3.1's image runs); TE (te-part 1..5 + te-load) and Ray
# (ray-part 1..2 + ray-install) as bench/README.md says.
#   slime-part N     copy .stage/slimeN (N = 1, 2, 3) to /tmp/slime_stage (carry .stage/slimeN
#                    with .stage/recipe .stage/stub)
#   slime-sg-part N  copy .stage/slime_sgN (N = 1.. as many parts as the staging printed) to
#                    /tmp/slime_stage/sg
#   slime-sg-install join and check the parts (SHA256SUMS), unpack to /tmp/sg515_site, check
#                    that SGLang 0.5.15.post1 is the one imported and its engine modules import
#   slime-install    check the sums, unpack slime's repository to /tmp/slime and the patched
#                    Megatron-LM tree to /tmp/mlm, the wheels to /tmp/slime_site, the pins of
#                    slime's image (numpy 1.26.4, scipy 1.17.1) to /tmp/slime_pins; then slime's
#                    own parse_args with our flags (the launcher test that skips on CPU)
#   slime-env        which SGLang and Megatron the slime phases import, and the PYTHONPATH
#   slime-ckpt       the random Qwen3-4B shape (${LAYERS:-8} layers) + prompts, and its
#                    fp8_block export, under /tmp/qrl_random_ckpt (~1 min)
#   slime-run        examples/slime/run_qwen3_4b_qrl_1gpu.sh with QRL=${QRL:-1} LOSS=${LOSS:-acr}
#                    (QRL=1 diagnostics: AQN=0, TRAIN_FORWARD=bf16; the log's name says which)
#                    -> $OUT/slime_<tag>.log (its header names the SGLang) and the per-rollout
#                    lines (times, reward, mismatch)
# Every slime phase puts the patched Megatron-LM tree first (its megatron.core replaces the
# 0.16.1 wheel for slime, as in slime's image), then slime's pins (its Megatron init asserts
# numpy 1.x; the image's numpy 2.5 would fail it), then /tmp/sg515_site when slime-sg-install has
# made it (SG515=0: the 0.5.17 site alone, where slime's SGLang engine fails on the read-only
# ServerArgs), then the 0.5.17 site, slime's repository, and the wheels last (the image's own
# packages win).
SLIME_SITE=/tmp/slime_site SG515_SITE=${SG515_SITE:-/tmp/sg515_site}
SLIME_PINS=${SLIME_PINS:-/tmp/slime_pins}
slime_path() {  # the slime phases' PYTHONPATH (again after slime-sg-install made the site)
  local sg="" pins=""
  [ -f "$SLIME_PINS/.ok" ] && pins=$SLIME_PINS:
  [ "${SG515:-1}" = 1 ] && [ -f "$SG515_SITE/.ok" ] && sg=$SG515_SITE:
  export PYTHONPATH=/tmp/mlm:$pins$sg$BASE_PYTHONPATH:/tmp/slime:$SLIME_SITE SLIME_SRC=/tmp/slime
}
sglang_used() {  # "SGLang VERSION from DIR": what slime's processes import, without importing it
  python3 -c "import importlib.metadata as m, importlib.util as u
s = u.find_spec('sglang'); print('SGLang', m.version('sglang') if s else None, 'from',
      list(s.submodule_search_locations)[0] if s else None)"
}
BASE_PYTHONPATH=$PYTHONPATH; slime_path
export PATH=/tmp/ray_site/bin:$SLIME_SITE/bin:$PATH  # `ray start` of the example script
# shellcheck source=bench/parts.sh
source bench/parts.sh
case $phase in
  slime-part)
    n=${2:?part number}; mkdir -p "/tmp/slime_stage/slime$n"
    cp ".stage/slime$n"/* "/tmp/slime_stage/slime$n/" && du -sh "/tmp/slime_stage/slime$n" ;;
  slime-sg-part)
    n=${2:?part number}; mkdir -p /tmp/slime_stage/sg
    cp .stage/slime_sg"$n"/* /tmp/slime_stage/sg/ && ls -la /tmp/slime_stage/sg ;;
  slime-sg-install)
    parts_join /tmp/slime_stage/sg sg515.tar.xz || exit 1
    rm -rf "$SG515_SITE" && mkdir -p "$SG515_SITE" \
      && tar xJf /tmp/slime_stage/sg/sg515.tar.xz -C "$SG515_SITE" --strip-components=1 \
      && touch "$SG515_SITE/.ok" && rm /tmp/slime_stage/sg/sg515.tar.xz || exit 1
    cat "$SG515_SITE/MANIFEST"; du -sh "$SG515_SITE"; slime_path; sglang_used
    python3 -c "import sglang, sgl_kernel, flashinfer, importlib.metadata as m
assert sglang.__file__.startswith('$SG515_SITE'), sglang.__file__
print({d: m.version(d) for d in ('sglang', 'sglang-kernel', 'flashinfer-python', 'sgl-deep-gemm')})" || exit 1
    python3 .stage/recipe/imports.py | tail -n 3 ;;  # slime-install imports its http_server
  slime-env)
    sglang_used; echo "PYTHONPATH=$PYTHONPATH"
    python3 -c "import importlib.util as u; s = u.find_spec('megatron')
print('megatron from', list(s.submodule_search_locations) if s else None)" ;;
  slime-install)
    (cd /tmp/slime_stage && sha256sum -c --quiet slime1/SHA256SUMS) || exit 1
    tar xJf /tmp/slime_stage/slime1/src.tar.xz -C /tmp   # -> /tmp/slime, /tmp/mlm
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SLIME_SITE" \
      /tmp/slime_stage/slime1/*.whl /tmp/slime_stage/slime2/*.whl
    rm -rf "$SLIME_PINS" && python3 -m pip install -q --no-index --no-deps --no-compile \
      --target "$SLIME_PINS" /tmp/slime_stage/slime3/*.whl && touch "$SLIME_PINS/.ok" || exit 1
    du -sh /tmp/slime /tmp/mlm "$SLIME_SITE" "$SLIME_PINS"
    slime_path
    python3 -c "import numpy, scipy; assert numpy.__version__.startswith('1.'), numpy.__file__
print('numpy', numpy.__version__, 'scipy', scipy.__version__, 'from', numpy.__file__)" || exit 1
    te_env
    sglang_used
    python3 -c "import slime.utils.arguments, megatron.training.arguments, sglang_router, wandb, torch_memory_saver, sglang.srt.entrypoints.http_server; print('slime imports')" || exit 1
    python3 -m pytest -q -rs -n 0 tests/integrations/test_integrations_slime_examples.py \
      "tests/integrations/test_integrations_slime.py::test_launcher_parses_a_real_slime_command_line" \
      2>&1 | tee "$OUT/slime_launcher_test.log" | tail -n 15 ;;
  slime-ckpt)
    te_env; c=/tmp/qrl_random_ckpt/qwen3_4b-${LAYERS:-8}L
    [ -f "$c/config.json" ] || python3 tools/make_random_checkpoint.py --config qwen3_4b \
      --layers "${LAYERS:-8}" --out "$c"
    [ -f "$c-fp8_block/config.json" ] || python3 tools/export_quantized.py --hf-dir "$c" \
      --format fp8_block --out "$c-fp8_block"
    du -sh "$c" "$c-fp8_block" ;;
  slime-run)
    te_env; tag=${QRL:-1}; [ "$tag" = 1 ] && tag=qrl_${LOSS:-acr} || tag=baseline
    # diagnostic variants of QRL=1 (the example's AQN=0 / TRAIN_FORWARD=off) get their own log
    [ "${AQN:-1}" = 0 ] && tag=${tag}_noaqn
    [ "${TRAIN_FORWARD:-aligned}" = bf16 ] && tag=${tag}_bf16fwd
    commit=$(cat .commit 2>/dev/null || echo unknown)
    echo "# nvidia-h200 $(date -u +%F), commit $commit: QRL=${QRL:-1} LOSS=${LOSS:-acr} AQN=${AQN:-1} TRAIN_FORWARD=${TRAIN_FORWARD:-aligned} LAYERS=${LAYERS:-8}, $(sglang_used)" \
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
