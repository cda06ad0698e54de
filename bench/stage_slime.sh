#!/usr/bin/env bash
# CPU side: stage slime 0.3.1 for the H200 machine (no network there) as two carries,
#   .stage/slime1  slime's repository at its 0.3.1 commit (slime/, train.py, scripts/models,
#                  docker/patch/latest), the Megatron-LM tree at the commit slime's Dockerfile
#                  pins with slime's two Megatron patches applied, and the small py3.12 wheels
#                  slime imports that the SGLang site (.stage/s1) lacks, and soundfile (23.8 MiB)
#   .stage/slime2  the two large wheels: wandb (slime imports it at start) and sglang-router
#                  0.3.2 (slime's parse_args imports its RouterArgs)              (48.7 MiB)
#   .stage/slime3  the pins slime's image installs over its base (docker/Dockerfile:
#                  numpy 1.26.4, scipy 1.17.1): slime's Megatron init asserts numpy 1.x, the
#                  H200 image has numpy 2.5; they go first on slime's path     (50.7 MiB)
# bench/slime.sh (the slime-* phases of bench/h200.sh) unpacks them on the device.
#
#   SLIME_GIT=DIR MEGATRON_GIT=DIR bash bench/stage_slime.sh     (from the repo root)
#
# SLIME_GIT / MEGATRON_GIT: git directories holding slime's commit below and Megatron-LM's
# pinned commit (e.g. the snapshots of THUDM/slime and NVIDIA/Megatron-LM the session's fetch
# tool brings under /work/.mirror/). Measured: .stage/slime1 23.8 MiB, .stage/slime2 48.7 MiB, .stage/slime3 50.7 MiB.
set -euo pipefail
SLIME_COMMIT=624b824a8        # slime 0.3.1 (setup.py version), shared/third_party/slime-0.3.1
MEGATRON_COMMIT=1dcf0dafa884ad52ffb243625717a3471643e087  # slime's docker/Dockerfile ARG
: "${SLIME_GIT:?git dir of THUDM/slime}" "${MEGATRON_GIT:?git dir of NVIDIA/Megatron-LM}"
STAGE=$(mkdir -p "${STAGE:-.stage}" && cd "${STAGE:-.stage}" && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/slime" "$work/mlm"
git --git-dir "$SLIME_GIT" archive "$SLIME_COMMIT" slime train.py setup.py requirements.txt \
  scripts/models docker/patch/latest | tar x -C "$work/slime"
git --git-dir "$MEGATRON_GIT" archive "$MEGATRON_COMMIT" megatron setup.py pyproject.toml \
  | tar x -C "$work/mlm"
# slime's Dockerfile: `git apply megatron.patch`, then megatron-sglang-aligned.patch
(cd "$work/mlm" && git init -q && for p in megatron.patch megatron-sglang-aligned.patch; do
   git apply "$work/slime/docker/patch/latest/$p" || { echo "slime's $p does not apply"; exit 1; }
 done && rm -rf .git)
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64"
# slime's imports (requirements.txt, the ones its train / rollout / reward paths reach),
# Megatron-LM training's, and soundfile (+ cffi, pycparser), which SGLang's http_server imports
# (0.5.15.post1 and 0.5.17 both pin 0.13.1), that neither the H200 image nor the SGLang site has
SMALL="pylatexenc aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache sympy
   mpmath pillow platformdirs gitpython gitdb smmap sentry-sdk protobuf six einops typer rich
   shellingham markdown-it-py mdurl pygments pyyaml xxhash blake3 soundfile==0.13.1 cffi pycparser"
# slime's docker/Dockerfile: `pip install "numpy==1.26.4" "scipy==1.17.1"` over the base image
PINS="numpy==1.26.4 scipy==1.17.1"
mkdir -p "$work/w1" "$work/w2" "$work/w3"
# shellcheck disable=SC2086
python3 -m pip download -q $P --no-deps -d "$work/w1" $SMALL
# shellcheck disable=SC2086
python3 -m pip download -q $P --no-deps -d "$work/w2" wandb sglang-router==0.3.2
# shellcheck disable=SC2086
python3 -m pip download -q $P --no-deps -d "$work/w3" $PINS
rm -rf "$STAGE/slime1" "$STAGE/slime2" "$STAGE/slime3"
mkdir -p "$STAGE/slime1" "$STAGE/slime2" "$STAGE/slime3"
tar cf - -C "$work" slime mlm | xz -T0 -9 > "$STAGE/slime1/src.tar.xz"
cp "$work"/w1/*.whl "$STAGE/slime1/" && cp "$work"/w2/*.whl "$STAGE/slime2/"
cp "$work"/w3/*.whl "$STAGE/slime3/"
(cd "$STAGE" && sha256sum slime1/* slime2/* slime3/* > "$work/sums" \
  && mv "$work/sums" slime1/SHA256SUMS)
du -sh "$STAGE/slime1" "$STAGE/slime2" "$STAGE/slime3"
