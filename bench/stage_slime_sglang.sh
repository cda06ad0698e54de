#!/usr/bin/env bash
# CPU side: stage SGLang 0.5.15.post1 with slime's SGLang patches for the H200 machine (py3.12,
# torch 2.11.0+cu130, no network), as slime 0.3.1's image has it (docker/Dockerfile: the
# slimerl/sglang v0.5.15.post1 base, then `git apply` of docker/patch/latest/sglang*.patch).
# Only the packages whose versions differ from the SGLang 0.5.17 site (.stage/s1 ->
# /tmp/site) are here; the slime phases put /tmp/sg515_site before /tmp/site on PYTHONPATH,
# so everything else (pydantic, fastapi, uvicorn, zmq, tvm-ffi, torchao 0.17.0, ...) comes
# from that site, whose versions satisfy 0.5.15.post1's pins:
#   sglang 0.5.15.post1         cp312 wheel, slime's five patches applied to its files
#   sglang-kernel 0.4.4         PyPI's cu13 / torch 2.11 build, trimmed like the 0.5.17 site's
#                               0.4.5: FA3 (flash_ops, 1.76 GB), sm100 and flashmla ops left
#                               out -> slime's example runs `--sglang-attention-backend triton`
#   flashinfer-python 0.6.12    (0.5.15.post1 checks it only with attention_backend=flashinfer)
#   sgl-deep-gemm 0.1.4         cu13 build (slime's image rebuilds a fork of DeepGEMM instead)
# Left to the 0.5.17 site: llguidance (1.9.1 there, 0.5.15.post1 pins <0.8; imported only by
# the llguidance grammar backend, and the example runs --sglang-grammar-backend none).
# Not staged: flashinfer-cubin (447 MB; the 0.5.17 site runs without it too).
# transformers 5.17 (H200 image) already registers qwen3_asr: the same exist_ok fix as
# .stage/recipe/setup.sh applies to 0.5.15.post1's configs/qwen3_asr.py, here.
#
#   SLIME_GIT=DIR bash bench/stage_slime_sglang.sh       (from the repo root; ~8 min, most of
#                                                         it xz on 2 cores)
#
# SLIME_GIT: git dir holding slime 0.3.1's commit (the patches); SG_WHEELS: wheel cache (default
# /tmp/sg515_wheels: the 615 MB sglang-kernel wheel downloads once). Writes .stage/slime_sg1..N,
# one <= PART_BYTES (57,000,000) part of sg515.tar.xz each, SHA256SUMS and MANIFEST in
# slime_sg1. Measured: one part, .stage/slime_sg1 26.4 MiB (site 188 MB unpacked).
# On the device: bash bench/h200.sh slime-sg-part N, then slime-sg-install (bench/slime.sh).
set -euo pipefail
SLIME_COMMIT=624b824a8        # slime 0.3.1 (setup.py version), shared/third_party/slime-0.3.1
PATCHES="sglang.patch sglang-top_p.patch sglang-release_hicache.patch sglang-pull_weights.patch
  sglang-deterministic.patch"  # slime's Dockerfile order
: "${SLIME_GIT:?git dir of THUDM/slime}"
# shellcheck source=bench/parts.sh
source "$(dirname "$0")/parts.sh"
STAGE=$(mkdir -p "${STAGE:-.stage}" && cd "${STAGE:-.stage}" && pwd)
WHEELS=$(mkdir -p "${SG_WHEELS:-/tmp/sg515_wheels}" && cd "${SG_WHEELS:-/tmp/sg515_wheels}" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat > "$work/req.txt" <<'EOF'
sglang==0.5.15.post1 --hash=sha256:d1cf208d6ed6bd1d66e6c284635cb671519855dcdfe119e3c4011b6797c90679
sglang-kernel==0.4.4 --hash=sha256:558bc7035e3c0a795e8c3eca3cc29e189c7d29f1db2471a0a71b9156a8ee7fa1
flashinfer-python==0.6.12 --hash=sha256:0c7a01e586b4796810d974cbf13a9c0eb2ade6a94d12e3220cf7782a1c09b8d3
sgl-deep-gemm==0.1.4 --hash=sha256:142e73d76c6925e307e1657b66f3ae2c73ad5bd6bba0a13e7df78b377a541f28
EOF
python3 -m pip download -q --no-deps --require-hashes --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" -r "$work/req.txt"
site=$work/sg515_site; man=$work/MANIFEST
mkdir -p "$work/src/python" && unzip -q "$WHEELS"/sglang-0.5.15.post1-cp312-*.whl -d "$work/src/python"
{ echo "SGLang 0.5.15.post1 site for slime $SLIME_COMMIT, staged $(date -u +%F)"
  (cd "$WHEELS" && sha256sum sglang-0.5.15.post1-cp312-*.whl sglang_kernel-0.4.4-*.whl \
     flashinfer_python-0.6.12-*.whl sgl_deep_gemm-0.1.4-*.whl)
  echo "slime's patches (docker/patch/latest, applied to the wheel's python/sglang files):"; } > "$man"
(cd "$work/src" && git init -q && for p in $PATCHES; do
   git --git-dir "$SLIME_GIT" show "$SLIME_COMMIT:docker/patch/latest/$p" > "$work/$p"
   git apply --check --include='python/sglang/*' "$work/$p" \
     || { echo "slime's $p does not apply to sglang 0.5.15.post1" >&2; exit 1; }
   git apply --include='python/sglang/*' "$work/$p"
   all=$(grep -c '^diff --git' "$work/$p"); own=$(git apply --numstat --include='python/sglang/*' "$work/$p" < /dev/null | wc -l)
   skipped=$(grep '^diff --git' "$work/$p" | grep -v ' a/python/sglang/' | sed 's|^diff --git a/||; s| b/.*||' | tr '\n' ' ')
   note=${skipped:+ (outside python/sglang, not in the wheel: $skipped)}
   echo "  $p: $own of $all files$note"
 done >> "$man" && rm -rf .git)
mv "$work/src/python" "$site"
asr=$site/sglang/srt/configs/qwen3_asr.py
sed -i 's/AutoConfig.register("qwen3_asr", Qwen3ASRConfig)$/AutoConfig.register("qwen3_asr", Qwen3ASRConfig, exist_ok=True)/; s/AutoConfig.register("qwen3_asr_thinker", Qwen3ASRThinkerConfig)$/AutoConfig.register("qwen3_asr_thinker", Qwen3ASRThinkerConfig, exist_ok=True)/' "$asr"
[ "$(grep -c 'exist_ok=True)$' "$asr")" = 2 ] || { echo "the qwen3_asr fix does not match $asr" >&2; exit 1; }
echo "transformers 5.17: configs/qwen3_asr.py registers with exist_ok=True" >> "$man"
(cd "$site" && unzip -q -o "$WHEELS"/flashinfer_python-0.6.12-*.whl && unzip -q -o "$WHEELS"/sgl_deep_gemm-0.1.4-*.whl \
  && unzip -q -o "$WHEELS"/sglang_kernel-0.4.4-*.whl -x 'sgl_kernel/flash_ops.abi3.so' \
     'sgl_kernel/flashmla_ops*' 'sgl_kernel/sm100/*' && rm -rf tools)
echo "sglang-kernel 0.4.4 without sgl_kernel/flash_ops.abi3.so, flashmla_ops, sm100/ (attention: triton)" >> "$man"
echo "unpacked: $(du -sb "$site" | cut -f1) bytes" >> "$man"
cp "$man" "$site/MANIFEST"
tar -cf - -C "$work" sg515_site | xz -T0 -9 > "$work/sg515.tar.xz"
n=$(parts_split "$work/sg515.tar.xz" "$STAGE" slime_sg "${PART_BYTES:-57000000}")
cp "$man" "$STAGE/slime_sg1/MANIFEST"
# what the device gets: every part in one dir, joined and checked as slime-sg-install does
mkdir "$work/check" && for ((i = 1; i <= n; i++)); do cp "$STAGE/slime_sg$i"/* "$work/check/"; done
parts_join "$work/check" sg515.tar.xz && cmp -s "$work/check/sg515.tar.xz" "$work/sg515.tar.xz"
cat "$man"; du -sh "$STAGE"/slime_sg[0-9]*; echo "$n part(s): carry .stage/slime_sg1..$n"
