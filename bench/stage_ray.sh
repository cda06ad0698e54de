#!/usr/bin/env bash
# CPU side: stage Ray 2.60.0 (the H200 image has none) for the H200 machine (py3.12, no
# network) in two carry-sized dirs, laid out as bench/h200.sh's ray-part / ray-install read them:
#   .stage/ray1  rpart00 (the first 40,000,000 bytes of ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl,
#                `split -b 40000000 -d`) and ray.sha256 (`sha256sum -c` form, the wheel's name)
#   .stage/ray2  rpart01 (the rest)
# ray-part N copies .stage/rayN/* to /tmp/ray; ray-install joins `rpart0*` into the wheel, checks
# ray.sha256 and installs it with --no-deps (Ray's own requirements — click, filelock,
# jsonschema, msgpack, packaging, protobuf, pyyaml, requests — come from the image and the
# SGLang site).
#
#   bash bench/stage_ray.sh       (repo root; STAGE=DIR stages elsewhere; WORK=DIR is the
#                                  download cache, default /tmp/ray_stage: a rerun downloads
#                                  nothing and rebuilds ray1, ray2 from it)
#
# The wheel is pinned by its sha256 (pip --require-hashes): a different file stops the script.
# Measured 2026-12-03: ray1 38.2 MiB, ray2 37.5 MiB; 5 s.
set -euo pipefail
WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
PART_BYTES=40000000
LIMIT_MIB=57                  # a carry dir below this leaves room for the tree and the recipe
STAGE=$(mkdir -p "${STAGE:-.stage}" && cd "${STAGE:-.stage}" && pwd)
WORK=$(mkdir -p "${WORK:-/tmp/ray_stage}" && cd "${WORK:-/tmp/ray_stage}" && pwd)
t0=$(date +%s)
echo "ray==2.60.0 --hash=sha256:b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a" > "$WORK/ray.txt"
python3 -m pip download -q --no-deps --require-hashes --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK" -r "$WORK/ray.txt" \
  || { echo "stage_ray: pip download of $WORK/ray.txt failed (a sha256 mismatch is named above)" >&2; exit 1; }
rm -rf "$STAGE"/ray[0-9] "$WORK/split" && mkdir "$WORK/split"
(cd "$WORK/split" && split -b $PART_BYTES -d "$WORK/$WHEEL" rpart)
n=0
for p in "$WORK"/split/rpart*; do n=$((n + 1)); mkdir "$STAGE/ray$n" && mv "$p" "$STAGE/ray$n/"; done
(cd "$WORK" && sha256sum "$WHEEL") > "$STAGE/ray1/ray.sha256"
# what ray-part 1..n and ray-install do on the device, here: join the parts and check the sum
check=$WORK/device && rm -rf "$check" && mkdir "$check"
for ((i = 1; i <= n; i++)); do cp "$STAGE/ray$i"/* "$check/"; done
(cd "$check" && cat rpart0* > "$WHEEL" && sha256sum -c --quiet ray.sha256) \
  || { echo "stage_ray: the joined parts do not match ray1/ray.sha256" >&2; exit 1; }
rm -rf "$check"
for d in "$STAGE"/ray[0-9]; do
  b=$(du -sb "$d" | cut -f1)
  awk -v b="$b" -v d="$d" 'BEGIN { printf "%-14s %6.1f MiB\n", d, b / 1048576 }'
  [ "$b" -lt $((LIMIT_MIB * 1048576)) ] || { echo "stage_ray: $d is not below $LIMIT_MIB MiB" >&2; exit 1; }
done
echo "$n parts: ray-part 1..$n (carry .stage/rayN), then ray-install; $(($(date +%s) - t0)) s"
