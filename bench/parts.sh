# shellcheck shell=bash
# Carry-sized parts of one staged archive, split on the CPU machine and joined on the device
# against one SHA256SUMS list (the whole archive and every part), so a missing, stale or
# damaged part is named before anything unpacks. Sourced by bench/stage_slime_sglang.sh and
# bench/slime.sh.
#   parts_split FILE STAGE PREFIX BYTES  FILE -> STAGE/PREFIX1/NAME.part00, STAGE/PREFIX2/
#                                        NAME.part01, ... (one part per carry dir) and
#                                        STAGE/PREFIX1/SHA256SUMS; prints the number of parts
#   parts_join DIR NAME                  DIR holding SHA256SUMS and every part -> DIR/NAME,
#                                        checked (nothing is left at DIR/NAME on a failure)

parts_split() {
  local file=$1 stage=$2 prefix=$3 bytes=$4 name tmp n=0 p d i
  name=$(basename "$file"); tmp=$(mktemp -d)
  split -b "$bytes" -d -a 2 "$file" "$tmp/$name.part"
  for d in "$stage/$prefix"[0-9]*; do [ -d "$d" ] && rm -r "$d"; done
  for p in "$tmp/$name".part*; do
    n=$((n + 1)); mkdir -p "$stage/$prefix$n" && mv "$p" "$stage/$prefix$n/"
  done
  { (cd "$(dirname "$file")" && sha256sum "$name")
    for ((i = 1; i <= n; i++)); do (cd "$stage/$prefix$i" && sha256sum "$name".part*); done
  } > "$tmp/SHA256SUMS" && mv "$tmp/SHA256SUMS" "$stage/${prefix}1/SHA256SUMS"
  rmdir "$tmp"; echo "$n"
}

parts_join() {
  local dir=$1 name=$2 f
  [ -f "$dir/SHA256SUMS" ] || { echo "no $dir/SHA256SUMS: copy the first part's carry dir first" >&2; return 1; }
  grep -q "  $name\$" "$dir/SHA256SUMS" || { echo "$dir/SHA256SUMS does not list $name" >&2; return 1; }
  while read -r _ f; do
    [ "$f" = "$name" ] || [ -f "$dir/$f" ] || { echo "missing $dir/$f: copy every part first" >&2; return 1; }
  done < "$dir/SHA256SUMS"
  for f in "$dir/$name".part*; do
    [ -f "$f" ] || continue
    grep -q "  ${f##*/}\$" "$dir/SHA256SUMS" || { echo "$f is not in $dir/SHA256SUMS (a part of another staging): remove it" >&2; return 1; }
  done
  (cd "$dir" && grep -v "  $name\$" SHA256SUMS | sha256sum -c --quiet) \
    || { echo "a part in $dir does not match SHA256SUMS: stage and copy it again" >&2; return 1; }
  cat "$dir/$name".part* > "$dir/$name.tmp" && mv "$dir/$name.tmp" "$dir/$name"
  (cd "$dir" && grep "  $name\$" SHA256SUMS | sha256sum -c --quiet) \
    || { rm -f "$dir/$name"; echo "$dir/$name joined does not match SHA256SUMS" >&2; return 1; }
}
