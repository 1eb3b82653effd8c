#!/usr/bin/env bash
# nvcc with an output cache, for candle-kernels' build script (cudaforge runs `$NVCC`; see
# scripts/cuda-env.sh). Its PTX and MMQ/MMVQ objects take ~8 minutes of nvcc on two cores and are the
# same for every Rust profile (check, test, release) and every checkout, so each output is kept under
# a key made of: the toolkit's nvcc version, the host compiler's version, the arguments (output path
# left out), the input's path inside its crate and the contents of every CUDA/C source and header
# of that crate. Headers from outside the crate count by path only (the toolkit's through the nvcc
# version); candle-kernels includes none other. A hit copies the file nvcc wrote
# the first time; anything else (a miss, `--version`, `--lib`, a command this script does not
# recognise) runs the real nvcc. SMOLCHAT_NVCC_CACHE=0 turns the cache off.
set -euo pipefail

REAL=${SMOLCHAT_REAL_NVCC:-${CUDA_HOME:?CUDA_HOME is not set; use scripts/cuda-env.sh}/bin/nvcc}
CACHE=${SMOLCHAT_NVCC_CACHE_DIR:-${SMOLCHAT_CUDA_ROOT:-$HOME/.cache/smolchat/cuda13}/nvcc-cache}
[[ "${SMOLCHAT_NVCC_CACHE:-1}" == 0 ]] && exec "$REAL" "$@"

# Recognise the two forms cudaforge uses:
#   nvcc ... --ptx ... --output-directory DIR ... FILE.cu   -> DIR/<stem>.ptx
#   nvcc ... -c -o OBJ ... FILE.cu                           -> OBJ
mode= out= outdir= input= key_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  a=${args[i]}
  case "$a" in
    --ptx) mode=ptx; key_args+=("$a") ;;
    -c) [[ -z "$mode" ]] && mode=obj; key_args+=("$a") ;;
    -o) out=${args[i + 1]:-}; i=$((i + 1)) ;;
    --output-directory) outdir=${args[i + 1]:-}; i=$((i + 1)) ;;
    *.cu) [[ -n "$input" ]] && exec "$REAL" "$@"; input=$a ;;
    *) key_args+=("$a") ;;
  esac
done
case "$mode" in
  ptx) [[ -n "$outdir" && -z "$out" ]] || exec "$REAL" "$@"
       stem=$(basename "$input" .cu); target="$outdir/$stem.ptx" ;;
  obj) [[ -n "$out" && -z "$outdir" ]] || exec "$REAL" "$@"; target=$out ;;
  *) exec "$REAL" "$@" ;;
esac
[[ -f "$input" ]] || exec "$REAL" "$@"

# The crate holding the input: the nearest directory above it with a Cargo.toml.
crate=$(dirname "$(realpath "$input")")
while [[ "$crate" != / && ! -f "$crate/Cargo.toml" ]]; do crate=$(dirname "$crate"); done
[[ "$crate" != / ]] || exec "$REAL" "$@"

rel=$(realpath "$input"); rel=${rel#"$crate"/}
key=$(
  {
    echo "smolchat-nvcc-cache v1 $mode $(basename "$crate") $rel"
    "$REAL" --version
    "${NVCC_CCBIN:-gcc}" --version 2>/dev/null | head -1 || true
    printf '%s\n' "${key_args[@]}"
    echo "${NVCC_PREPEND_FLAGS:-} ${NVCC_APPEND_FLAGS:-}"
    # Sources and headers of the crate (build outputs and VCS data pruned).
    (cd "$crate" && find . \( -name target -o -name .git \) -prune -o -type f \
        \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.inc' \) -print0 \
      | LC_ALL=C sort -z | xargs -0 -r sha256sum)
  } | sha256sum | cut -c1-64
)
entry="$CACHE/${key:0:2}/$key"

if [[ -f "$entry" ]]; then
  cp "$entry" "$target"
  exit 0
fi
"$REAL" "$@"
mkdir -p "$(dirname "$entry")"
tmp=$(mktemp "$entry.XXXXXX")
cp "$target" "$tmp" && chmod 644 "$tmp" && mv -f "$tmp" "$entry"
