#!/usr/bin/env bash
# Stage SGLang's FA3 attention kernel (sgl_kernel/flash_ops.abi3.so, 1.1 GB, from the
# sglang-kernel 0.4.5 wheel that shared/gpu/sglang-h200/build_site.sh trims it out of) for the
# H200 machine, in parts that fit one device call each:
#
#   bash tools/stage_fa3.sh          (repo root, CPU machine; ~4 min on 2 cores)
#
# -> .stage/fa3_0/ ... .stage/fa3_N/, each one 57 MB part of flash_ops.so.xz (xz -T2 -6),
#    and .stage/fa3_0/flash_ops.so.xz.sha256. On the H200 machine (one warm machine, in order):
#    bash bench/h200.sh fa3-part 0 (carry .stage/fa3_0), ... fa3-part N (carry .stage/fa3_N),
#    then bash bench/h200.sh fa3-install.
set -euo pipefail
SO_SHA256=b8feae71ed589f0fa8ea407718b6a59411bf6bb5aac7310abeebad0133dd4216  # measured 2026-11-29
STAGE=$(mkdir -p "${STAGE:-.stage}" && cd "${STAGE:-.stage}" && pwd)
WORK=${WORK:-/tmp/fa3_stage}
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_35_x86_64"
mkdir -p "$WORK"
# shellcheck disable=SC2086
python3 -m pip download -q $P --no-deps -d "$WORK" sglang-kernel==0.4.5
cd "$WORK"
unzip -q -o sglang_kernel-0.4.5-*.whl sgl_kernel/flash_ops.abi3.so
echo "$SO_SHA256  sgl_kernel/flash_ops.abi3.so" | sha256sum -c --quiet \
  || { echo "flash_ops.abi3.so sha256 differs from the one measured: update SO_SHA256 here and in bench/h200.sh" >&2; exit 1; }
t=$(date +%s)
xz -T2 -6 -c sgl_kernel/flash_ops.abi3.so > flash_ops.so.xz
echo "xz -T2 -6: $(( $(date +%s) - t )) s"
sha256sum flash_ops.so.xz > flash_ops.so.xz.sha256
rm -f part_*
split -b 57000000 -d flash_ops.so.xz part_
rm -rf "$STAGE"/fa3_*
n=0
for p in part_*; do
  mkdir -p "$STAGE/fa3_$n" && mv "$p" "$STAGE/fa3_$n/flash_ops.so.xz.$p"
  n=$((n + 1))
done
cp flash_ops.so.xz.sha256 "$STAGE/fa3_0/"
echo "raw $(stat -c %s sgl_kernel/flash_ops.abi3.so) B, xz $(stat -c %s flash_ops.so.xz) B, $n parts:"
ls -l "$STAGE"/fa3_*/
cat flash_ops.so.xz.sha256
