#!/usr/bin/env bash
# CPU side: stage Transformer Engine 2.20.2 for the H200 machine (py3.12, torch 2.11.0+cu130,
# CUDA 13, no network) in carry-sized dirs, laid out as bench/h200.sh's te-* phases read them:
#   .stage/te1 .. te5  part00 .. part04: the 276,522,776-byte transformer_engine_cu13 wheel cut
#                      by `split -b 57000000 -d` (te-part N copies .stage/teN/part* to /tmp/te;
#                      te-build / te-load join them with `cat /tmp/te/part0*`)
#   .stage/te0         cu13.sha256 (the joined wheel's digest alone: te-build adds the name),
#                      the transformer_engine 2.20.2 wheel (TE's python), the
#                      transformer_engine_torch-2.20.2.tar.gz sdist (te-build compiles it against
#                      the machine's torch) and deps/ (below)
# deps/: what the two packages' metadata requires that the H200 image (torch, numpy, packaging,
# pyyaml, sympy, typing_extensions, setuptools) does not hold. transformer_engine_torch 2.20.2:
# torch, einops, onnxscript, onnx, packaging, pydantic, nvdlfw-inspect, nvidia-cudnn-frontend;
# transformer_engine_cu13 2.20.2: pydantic, importlib-metadata, packaging. Staged: einops,
# nvdlfw-inspect, onnx + onnxscript + onnx-ir + ml_dtypes + protobuf (TE imports onnx only to
# export; 10 MB), pydantic + pydantic-core + annotated-types + typing-inspection (the SGLang
# site's versions: TE's recipe module imports pydantic, so TE imports without the site too),
# wheel (the sdist's setup.py imports wheel.bdist_wheel; te-build runs without build isolation).
# Left out: importlib-metadata (TE imports the stdlib's importlib.metadata on 3.12),
# nvidia-cudnn-frontend (1.32.0 in the SGLang site; TE imports it only in its fused grouped-MLP
# and MLA paths).
# Not staged here: .stage/te_built (te-load's compiled transformer_engine_torch). It comes from
# the H200 only: te-part 1..5, te-build (a ~4-7 min compile), then te-save brings it back.
#
#   bash bench/stage_te.sh        (repo root; STAGE=DIR stages elsewhere; WORK=DIR is the
#                                  download cache, default /tmp/te_stage: a rerun downloads
#                                  nothing and rebuilds te0..te5 from it)
#
# Every file is pinned by its sha256 (pip --require-hashes; the sdist checked against the
# digest below): a different file stops the script naming it. Measured 2026-12-03: te0 14.6 MiB,
# te1..te4 54.4 MiB each, te5 46.3 MiB; 18 s (16 s from the download cache).
set -euo pipefail
VERSION=2.20.2
CU13=transformer_engine_cu13-$VERSION-py3-none-manylinux_2_28_x86_64.whl
SDIST=transformer_engine_torch-$VERSION.tar.gz
SDIST_SHA256=4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e
PART_BYTES=57000000
LIMIT_MIB=57                  # a carry dir below this leaves room for the tree and the recipe
TE0_LIMIT_MIB=25
STAGE=$(mkdir -p "${STAGE:-.stage}" && cd "${STAGE:-.stage}" && pwd)
WORK=$(mkdir -p "${WORK:-/tmp/te_stage}" && cd "${WORK:-/tmp/te_stage}" && pwd)
rm -rf "$WORK/deps" && mkdir "$WORK/deps"  # exactly the pinned deps (pip's own cache keeps them)
INDEX=${INDEX_URL:-https://pypi.org/simple}
t0=$(date +%s)
cat > "$WORK/te.txt" <<EOF
transformer_engine==$VERSION --hash=sha256:7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094
transformer_engine_cu13==$VERSION --hash=sha256:30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e
EOF
cat > "$WORK/deps.txt" <<'EOF'
einops==0.8.2 --hash=sha256:54058201ac7087911181bfec4af6091bb59380360f069276601256a76af08193
nvdlfw-inspect==0.2.2 --hash=sha256:8a4dc2814c5a4cd19ae304170b9bfa514538ef3c3eb243a45a82404ec3cb279d
onnx==1.23.2 --hash=sha256:7abf381d278f31ac62487fddedc9dd42da842dce94d5d43536836ee3efdf4a2b
onnxscript==0.7.2 --hash=sha256:d0e7121c6a1eefd608058928e111cbdb76709f70d269ff0d07aee493bd1d13c9
onnx-ir==1.1.0 --hash=sha256:76cc313a788c073b75271c1b6abb172aaf90fcc6335ed40f9f3238b2064a2fa3
ml_dtypes==0.7.0 --hash=sha256:3c4e47f553a04d33886160a9600e2313e5bee8c1c3da997baa23c8fecbfab189
protobuf==7.36.2 --hash=sha256:89f23aa53c24553a2416fd4fd1ec06f74fa42b14b546d8883128813f775bbfd2
pydantic==2.14.4 --hash=sha256:653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc
pydantic-core==2.50.5 --hash=sha256:470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d
annotated-types==0.8.0 --hash=sha256:f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0
typing-inspection==0.4.5 --hash=sha256:bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39
wheel==0.48.0 --hash=sha256:3217dcc807155e45db462d7ef2431f5ddda0d7273b700d05a67b271ceb1287ab
EOF
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for req in te deps; do
  dest=$WORK; [ $req = deps ] && dest=$WORK/deps
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --require-hashes $P -d "$dest" -r "$WORK/$req.txt" \
    || { echo "stage_te: pip download of $WORK/$req.txt failed (a sha256 mismatch is named above)" >&2; exit 1; }
done
# the sdist from the index's link: pip download would build its metadata, which needs torch
if ! echo "$SDIST_SHA256  $WORK/$SDIST" | sha256sum -c --quiet > /dev/null 2>&1; then
  url=$(curl -fsS "$INDEX/transformer-engine-torch/" | grep -o "href=\"[^\"]*/$SDIST#sha256=[0-9a-f]*\"" \
        | head -n 1 | sed 's/^href="//; s/#.*//')
  [ -n "$url" ] || { echo "stage_te: $INDEX lists no $SDIST" >&2; exit 1; }
  curl -fsS -o "$WORK/$SDIST.tmp" "$url" && mv "$WORK/$SDIST.tmp" "$WORK/$SDIST"
  echo "$SDIST_SHA256  $WORK/$SDIST" | sha256sum -c --quiet \
    || { echo "stage_te: $SDIST from $url differs from SDIST_SHA256 (pinned here)" >&2; exit 1; }
fi
tar tzf "$WORK/$SDIST" "transformer_engine_torch-$VERSION/setup.py" > /dev/null  # te-build's dir
rm -rf "$STAGE"/te[0-9] "$WORK/split" && mkdir -p "$STAGE/te0/deps" "$WORK/split"
(cd "$WORK/split" && split -b $PART_BYTES -d "$WORK/$CU13" part)
n=0
for p in "$WORK"/split/part*; do n=$((n + 1)); mkdir "$STAGE/te$n" && mv "$p" "$STAGE/te$n/"; done
(cd "$WORK" && sha256sum "$CU13" | cut -d' ' -f1) > "$STAGE/te0/cu13.sha256"
cp "$WORK"/transformer_engine-$VERSION-py3-none-any.whl "$WORK/$SDIST" "$STAGE/te0/"
cp "$WORK"/deps/*.whl "$STAGE/te0/deps/"
# what te-part 1..n and te-build do on the device, here: join the parts and check the sum
check=$WORK/device && rm -rf "$check" && mkdir "$check"
for ((i = 1; i <= n; i++)); do cp "$STAGE/te$i"/part* "$check/"; done
(cd "$check" && cat part0* > "$CU13" && echo "$(cat "$STAGE/te0/cu13.sha256")  $CU13" | sha256sum -c --quiet) \
  || { echo "stage_te: the joined parts do not match te0/cu13.sha256" >&2; exit 1; }
rm -rf "$check"
# sizes (MiB), each carry dir under its limit
for d in "$STAGE"/te[0-9]; do
  b=$(du -sb "$d" | cut -f1); lim=$LIMIT_MIB; [ "${d##*/}" = te0 ] && lim=$TE0_LIMIT_MIB
  awk -v b="$b" -v d="$d" 'BEGIN { printf "%-14s %6.1f MiB\n", d, b / 1048576 }'
  [ "$b" -lt $((lim * 1048576)) ] || { echo "stage_te: $d is not below $lim MiB" >&2; exit 1; }
done
echo "$n parts: te-part 1..$n (carry .stage/teN), then te-build or te-load (carry .stage/te0);" \
  "$(($(date +%s) - t0)) s"
