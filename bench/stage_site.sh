#!/usr/bin/env bash
# The SGLang 0.5.17 site for the H200 machine (.stage/recipe, .stage/s1, .stage/stub), built by
# the shared recipe and then pruned so that the setup call (carry .stage/s1 .stage/recipe
# .commit) fits the device's 64 MiB limit beside the working tree, which the limit counts in
# disk blocks (8.5 MiB on 2026-12-03; the recipe's unpruned site.tar.xz is 59.7 MB and left
# the call refused).
#
#   bash bench/stage_site.sh        (repo root, CPU machine; ~3 min build + ~4 min re-xz on 2 cores)
#
# Pruned: packages' test suites and sglang/multimodal_gen (diffusion serving: nothing under
# sglang/srt imports it) -> site.tar.xz 58,152,668 bytes (55.5 MiB), measured 2026-12-03.
set -euo pipefail
SHARED=${SHARED:-$(cd "$(dirname "$0")/../.." && pwd)/shared}
[ -d "$SHARED/gpu/sglang-h200" ] || { echo "no SGLang recipe at $SHARED/gpu/sglang-h200 (the shared/ folder beside the checkout): set SHARED=" >&2; exit 1; }
STAGE=$(mkdir -p "${STAGE:-.stage}" && cd "${STAGE:-.stage}" && pwd)
rm -rf "$STAGE/recipe" && cp -r "$SHARED/gpu/sglang-h200" "$STAGE/recipe" && chmod -R u+w "$STAGE/recipe"
STAGE=$STAGE bash "$STAGE/recipe/build_site.sh"        # -> /tmp/site, $STAGE/s1, $STAGE/stub
cd /tmp/site
rm -rf sglang/multimodal_gen test flashinfer/data/cccl/python/cuda_cccl/tests \
  flashinfer/data/cutlass/test flashinfer/data/cccl/libcudacxx/test jsonschema/tests dill/tests \
  referencing/tests
cd /tmp && tar -cf - site | xz -T0 -9 > /tmp/site.tar.xz.tmp && mv /tmp/site.tar.xz.tmp /tmp/site.tar.xz
cp /tmp/site.tar.xz "$STAGE/s1/site.tar.xz.tmp" && mv "$STAGE/s1/site.tar.xz.tmp" "$STAGE/s1/site.tar.xz"
(cd /tmp && md5sum site.tar.xz) > "$STAGE/s1/site.md5"
(cd "$STAGE/s1" && md5sum -c site.md5)
du -sk "$STAGE/s1" "$STAGE/stub" "$STAGE/recipe"
