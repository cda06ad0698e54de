#!/usr/bin/env bash
# The overlay site in which slime 0.3.1's own parse_args runs on a CPU machine
# (tests/integrations/test_integrations_slime.py::test_launcher_parses_a_real_slime_command_line).
#
#   bash tools/slime_cpu_site.sh                     build or check the site (idempotent)
#   bash tools/slime_cpu_site.sh --stage-megatron D  write Megatron-LM's patched training tree to
#                                                    D (needs MEGATRON_GIT and SLIME_GIT)
#   bash tools/slime_cpu_site.sh --stage-megatron-core D   the same plus that commit's
#                                                    megatron/core (0.16.0rc0, 6 MB): the walk
#                                                    test's $QRL_MEGATRON_LM_TREE (slime's model
#                                                    provider needs its TransformerConfig)
#
# slime's parse_args imports sglang.srt.server_args, sglang_router, wandb and Megatron-LM's
# megatron.training. On the project's CPU torch (2.13.0+cpu) sglang does not import: its
# utils import torchvision, and PyPI's x86_64 torchvision is a CUDA build that fails beside a
# CPU torch ("operator torchvision::nms does not exist"); server_args imports triton kernels.
# So the site carries its own torch 2.14.1 + torchvision 0.29.1 (a CUDA build that imports on
# the CPU; pip takes both from the machine's disk where it has them, else from PyPI) and the
# transformers / tokenizers / huggingface_hub versions sglang 0.5.17 pins; it is used only by
# that test's subprocess (PYTHONPATH=site first), never by the project's venv. sglang,
# sglang-router and wandb come --no-deps, with the modules their import chain needs (measured
# by importing until nothing is missing). kernels is pinned here because transformers imports it
# when it is importable at all: the project's venv holds the newest (transformers >= 5.2x pulls
# 0.19, whose LayerRepository needs a revision that 5.12.1 does not pass -> ValueError at import).
# Measured on the CPU machine: 6.0 GB, 3.5 min.
#
# Megatron-LM's megatron/{training,legacy,rl} at the commit slime's Dockerfile pins, with
# slime's two Megatron patches applied, comes from (first found):
#   $MEGATRON_TRAINING_SRC, a folder holding megatron/training
#   shared/third_party/megatron-lm-1dcf0da above this checkout (the project's shared folder)
#   third_party/megatron-lm-1dcf0da.tar.xz in this checkout (232 KB: the same tree, written by
#   --stage-megatron; no package index ships megatron.training, and CI cannot reach GitHub),
#   unpacked once beside the site
#   MEGATRON_GIT / SLIME_GIT: git dirs of NVIDIA/Megatron-LM and THUDM/slime
# The site: $QRL_SLIME_CPU_SITE, else ${XDG_CACHE_HOME:-~/.cache}/megatron_qrl/slime-cpu-site.
# Exit 0 with the site ready; 3 when a prerequisite cannot be had here (the message says which;
# the test then skips naming it); anything else is an error.
set -euo pipefail
MEGATRON_COMMIT=1dcf0dafa884ad52ffb243625717a3471643e087  # slime 0.3.1's docker/Dockerfile
SLIME_COMMIT=624b824a8                                     # slime 0.3.1
TREE_NAME=megatron-lm-1dcf0da
HERE=$(cd "$(dirname "$0")/.." && pwd)
SITE=${QRL_SLIME_CPU_SITE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_qrl/slime-cpu-site}
# the site's contents; the READY stamp records them, so a change rebuilds
TORCH="torch==2.14.1 torchvision==0.29.1"
NODEPS="sglang==0.5.17 sglang-router==0.3.2 wandb==0.31.0 transformers==5.12.1
  tokenizers==0.22.2 huggingface_hub==1.33.0 apache-tvm-ffi==0.1.11 openai==2.6.1
  orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 fastapi==0.165.0 uvicorn==0.55.0
  opentelemetry-api==1.45.2 ipython==9.18.1 traitlets==5.16.1 msgspec==0.23.0 pyzmq==27.3.0
  sniffio==1.3.1 partial_json_parser==0.2.1.1.post7 xgrammar==0.2.9 sentencepiece==0.2.3
  setproctitle==1.3.8 xxhash==4.1.0 six==1.17.0 dill==0.4.1 distro==1.9.0
  platformdirs==4.14.9 kernels==0.12.3"
SPEC="$MEGATRON_COMMIT $TORCH $NODEPS"

unavailable() { echo "slime_cpu_site: $*" >&2; exit 3; }

find_tree() {  # a folder holding megatron/training, patched; empty when none
  if [ -n "${MEGATRON_TRAINING_SRC:-}" ]; then
    [ -f "$MEGATRON_TRAINING_SRC/megatron/training/arguments.py" ] ||
      unavailable "\$MEGATRON_TRAINING_SRC=$MEGATRON_TRAINING_SRC has no megatron/training/arguments.py"
    echo "$MEGATRON_TRAINING_SRC"; return
  fi
  local d=$HERE
  while [ "$d" != / ]; do
    [ -f "$d/shared/third_party/$TREE_NAME/megatron/training/arguments.py" ] &&
      { echo "$d/shared/third_party/$TREE_NAME"; return; }
    d=$(dirname "$d")
  done
  local archive=$HERE/third_party/$TREE_NAME.tar.xz unpacked
  unpacked=$(dirname "$SITE")/$TREE_NAME
  if [ -f "$archive" ]; then
    if [ ! -f "$unpacked/megatron/training/arguments.py" ]; then
      rm -rf "$unpacked.tmp" && mkdir -p "$unpacked.tmp" && tar xJf "$archive" -C "$unpacked.tmp" \
        && rm -rf "$unpacked" && mv "$unpacked.tmp" "$unpacked" >&2
    fi
    echo "$unpacked"
  fi
}

need_git() {
  if [ -z "${MEGATRON_GIT:-}" ] || [ -z "${SLIME_GIT:-}" ]; then
    unavailable "Megatron-LM's training tree ($TREE_NAME) not found: set MEGATRON_TRAINING_SRC," \
      "put it at shared/third_party/$TREE_NAME, or set MEGATRON_GIT and SLIME_GIT (git dirs)"
  fi
}

stage_megatron() {  # DEST [core]: megatron/{training,legacy,rl} (+ core) at the pinned commit, patched
  local dest=$1 folders="training legacy rl" work
  [ "${2:-}" = core ] && folders="core $folders"
  need_git
  work=$(mktemp -d)
  git --git-dir "$SLIME_GIT" archive "$SLIME_COMMIT" docker/patch/latest | tar x -C "$work"
  mkdir "$work/mlm"
  git --git-dir "$MEGATRON_GIT" archive "$MEGATRON_COMMIT" megatron LICENSE | tar x -C "$work/mlm"
  # slime's Dockerfile: `git apply megatron.patch`, then megatron-sglang-aligned.patch
  (cd "$work/mlm" && git init -q && for p in megatron.patch megatron-sglang-aligned.patch; do
     git apply "$work/docker/patch/latest/$p" || { echo "slime's $p does not apply" >&2; exit 1; }
   done)
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp/megatron"
  for f in $folders; do cp -r "$work/mlm/megatron/$f" "$dest.tmp/megatron/"; done
  cp "$work/mlm/LICENSE" "$dest.tmp/"
  cat > "$dest.tmp/PROVENANCE.md" <<EOF
# Megatron-LM training tree for slime 0.3.1 (BSD-3 / Apache-2.0 parts, LICENSE beside this file)

Upstream: NVIDIA/Megatron-LM commit $MEGATRON_COMMIT (the commit slime 0.3.1's
docker/Dockerfile checks out), folders megatron/{${folders// /,}}, with
slime's docker/patch/latest/megatron.patch and megatron-sglang-aligned.patch applied (slime
commit $SLIME_COMMIT), as slime's image has them. No megatron/__init__.py: megatron is a
namespace package, so this tree joins megatron-core's megatron.core when on PYTHONPATH.
Written by megatron_qrl's tools/slime_cpu_site.sh --stage-megatron; used by its slime launcher
test on CPU machines. Not part of megatron_qrl.
EOF
  rm -rf "$work" "$dest" && mv "$dest.tmp" "$dest"
}

if [ "${1:-}" = --stage-megatron ]; then
  stage_megatron "${2:?--stage-megatron DEST}"; du -sh "$2"; exit 0
fi
if [ "${1:-}" = --stage-megatron-core ]; then
  stage_megatron "${2:?--stage-megatron-core DEST}" core; du -sh "$2"; exit 0
fi
if [ -f "$SITE/READY" ] && [ "$(cat "$SITE/READY")" = "$SPEC" ]; then
  echo "slime_cpu_site: ready at $SITE"; exit 0
fi
tree=$(find_tree)
[ -n "$tree" ] || need_git
start=$(date +%s)
rm -rf "$SITE.tmp" && mkdir -p "$SITE.tmp"
if [ -n "$tree" ]; then
  mkdir -p "$SITE.tmp/megatron"
  cp -r "$tree"/megatron/{training,legacy,rl} "$SITE.tmp/megatron/"
else
  stage_megatron "$SITE.tmp/mlm" && mv "$SITE.tmp/mlm/megatron" "$SITE.tmp/" && rm -rf "$SITE.tmp/mlm"
fi
pipi() { python3 -m pip install -q --disable-pip-version-check --target "$SITE.tmp" "$@" ||
           { rm -rf "$SITE.tmp"; unavailable "pip could not install $* (is PyPI reachable?)"; }; }
# shellcheck disable=SC2086
pipi $TORCH
# shellcheck disable=SC2086
pipi --no-deps --upgrade $NODEPS
echo "$SPEC" > "$SITE.tmp/READY"
rm -rf "$SITE" && mv "$SITE.tmp" "$SITE"
echo "slime_cpu_site: built $SITE ($(du -sh "$SITE" | cut -f1), $(( $(date +%s) - start )) s)"
