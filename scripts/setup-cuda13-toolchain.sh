#!/usr/bin/env bash
# Installs the build-time CUDA 13.0 toolchain from PyPI wheels into a cache folder, so that
# `cargo build --features cuda` works on a machine with no CUDA install and no GPU (see README, "GPU build").
#
#   scripts/setup-cuda13-toolchain.sh        # install if missing, then print the exports (scripts/cuda-env.sh)
#
# Where: ${SMOLCHAT_CUDA_ROOT:-$HOME/.cache/smolchat/cuda13}; the toolkit lands in $ROOT/nvidia/cu13.
# Idempotent: a marker file written last records what was installed; when it matches, nothing is fetched.
#
# Why 13.0 exactly: the GPU machines run driver 580 (CUDA 13.0), which cannot load PTX from a newer nvcc.
# Why wheels: Debian's nvidia-cuda-toolkit is 11.8 (cannot target sm_90a, links cuBLAS 11).
# What needs it: candle-core's `cuda` feature -> candle-kernels (nvcc via cudaforge: PTX plus llama.cpp's
# MMQ/MMVQ objects) and cudarc 0.19 with `dynamic-linking` (-lcuda -lcublas -lcublasLt -lcurand -lnvrtc).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${SMOLCHAT_CUDA_ROOT:-$HOME/.cache/smolchat/cuda13}
CU="$ROOT/nvidia/cu13"
MARKER="$ROOT/.smolchat-toolchain-complete"

# Pinned wheels (CUDA 13.0 components). Hashes are checked by pip (--require-hashes).
# nvdisasm is the one exception to 13.0: PyPI has none older than 13.2.51, and it only reads the
# cubins ptxas 13.0 writes (scripts/check-kernels.py looks for tensor-core instructions in them);
# nothing it touches is loaded by the driver.
REQS='nvidia-cuda-nvcc==13.0.88 --hash=sha256:56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03
nvidia-cuda-crt==13.0.88 --hash=sha256:2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4
nvidia-nvvm==13.0.88 --hash=sha256:c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0
nvidia-cuda-runtime==13.0.96 --hash=sha256:7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548
nvidia-cuda-cccl==13.0.85 --hash=sha256:e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649
nvidia-cuda-nvrtc==13.0.88 --hash=sha256:ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575
nvidia-curand==10.4.0.35 --hash=sha256:1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc
nvidia-cublas==13.0.0.19 --hash=sha256:f6723af2e8e2600a11dc384037d90d9bf93070e346c24ef2e8f9001658c99896
nvidia-cuda-nvdisasm==13.2.51 --hash=sha256:5a7acf77c55d6d2911ed6155d4d5bc156ffadf9df7a68a89b0c1155f4b13688c'

# The link-time libcuda stub is generated from the cudarc version in Cargo.lock; a change of either
# the wheels or cudarc makes the stamp differ and triggers a reinstall.
CUDARC_VERSION=$(awk '/^name = "cudarc"$/ {getline; gsub(/[^0-9.]/, "", $0); print; exit}' "$REPO/Cargo.lock")
if [[ -z "$CUDARC_VERSION" ]]; then
  echo "setup-cuda13-toolchain: cudarc not found in Cargo.lock" >&2
  exit 1
fi
STAMP="$(printf '%s\n' "$REQS" | sha256sum | cut -c1-16) cudarc-$CUDARC_VERSION"

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" ]]; then
  exec "$REPO/scripts/cuda-env.sh"
fi

echo "setup-cuda13-toolchain: installing CUDA 13.0 (~670 MB download, ~1.2 GB unpacked) into $ROOT" >&2
rm -f "$MARKER"
mkdir -p "$ROOT/whl"
REQFILE="$ROOT/requirements.txt"
printf '%s\n' "$REQS" > "$REQFILE"
python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$ROOT/whl" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
  --python-version 3.11 --require-hashes -r "$REQFILE"

# Unpack afresh so a half-finished earlier run leaves nothing behind.
rm -rf "$ROOT/nvidia"
while IFS= read -r req; do
  name=${req%%==*}; version=${req#*==}; version=${version%% *}
  whl=$(ls "$ROOT"/whl/"${name//-/_}"-"$version"-*.whl)
  (cd "$ROOT" && unzip -qo "$whl" 'nvidia/*')
done <<< "$REQS"

# `-lfoo` needs the unversioned names; the wheels ship only the sonames.
cd "$CU/lib"
ln -sf libcudart.so.13 libcudart.so
ln -sf libcublas.so.13 libcublas.so
ln -sf libcublasLt.so.13 libcublasLt.so
ln -sf libcurand.so.10 libcurand.so
ln -sf libnvrtc.so.13 libnvrtc.so

# libcuda.so belongs to the driver, not to any wheel. Build a link-time stub with the driver's soname
# (libcuda.so.1) holding every driver function cudarc declares. Each returns CUDA_ERROR_NO_DEVICE (100),
# so a binary that happens to load the stub (LD_LIBRARY_PATH pointing here) reports "no CUDA device"
# instead of misbehaving. Never carry it to a GPU machine: the real libcuda.so.1 comes with the driver.
CUDARC_SRC=$(cd "$REPO" && cargo metadata --format-version 1 --features cuda --locked \
  | python3 -c 'import json,sys,os; v=sys.argv[1]; print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"]=="cudarc" and p["version"]==v))' \
    "$CUDARC_VERSION")
SYS="$CUDARC_SRC/src/driver/sys/mod.rs"
[[ -f "$SYS" ]] || { echo "setup-cuda13-toolchain: cudarc $CUDARC_VERSION source not found ($SYS)" >&2; exit 1; }
mkdir -p stubs
grep -oE '^\s+fn (cu[A-Za-z0-9_]+)\(' "$SYS" | sed -E 's/^\s+fn (cu[A-Za-z0-9_]+)\(/\1/' | sort -u \
  | awk 'BEGIN {print "/* generated by scripts/setup-cuda13-toolchain.sh: link-time stub, never ship */"}
         {print "int " $1 "(void) { return 100; }"}' > stubs/libcuda_stub.c
if [[ $(grep -c '^int cu' stubs/libcuda_stub.c) -lt 100 ]]; then
  echo "setup-cuda13-toolchain: too few driver symbols found in $SYS" >&2
  exit 1
fi
gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o stubs/libcuda.so stubs/libcuda_stub.c
ln -sf libcuda.so stubs/libcuda.so.1

# Check the pieces the build uses before declaring the install complete.
"$CU/bin/nvcc" --version | grep -q 'release 13.0' || { echo "setup-cuda13-toolchain: nvcc is not 13.0" >&2; exit 1; }
for f in include/cuda.h include/cuda_runtime.h include/cuda_fp16.h lib/libcublas.so lib/libcurand.so \
         lib/libnvrtc.so lib/libcudart.so lib/stubs/libcuda.so nvvm/bin/cicc bin/ptxas; do
  [[ -e "$CU/$f" ]] || { echo "setup-cuda13-toolchain: missing $CU/$f" >&2; exit 1; }
done

echo "$STAMP" > "$MARKER"
echo "setup-cuda13-toolchain: done" >&2
exec "$REPO/scripts/cuda-env.sh"
