#!/usr/bin/env bash
# The environment a `--features cuda` build needs, pointing at the toolkit that
# scripts/setup-cuda13-toolchain.sh installed. Two ways to use it:
#   eval "$(scripts/cuda-env.sh)"     # prints `export ...` lines
#   source scripts/cuda-env.sh        # exports into the current shell
# CUDA_HOME also tells cudarc (cuda-version-from-build-system) and cudaforge where the toolkit is;
# LIBRARY_PATH lets the linker find cuBLAS & co. and the link-time libcuda stub.
# CUDA_COMPUTE_CAP=90: PTX and MMQ objects for the H100/H200 only (other targets multiply nvcc time).
# CUDAFORGE_THREADS: parallel nvcc jobs in candle-kernels' build script (defaults to the core count).
# NVCC: scripts/nvcc-cache.sh, which keeps nvcc's outputs in the toolkit cache so the ~8 minutes of
# kernel compilation happen once per machine, not once per profile and checkout
# (SMOLCHAT_NVCC_CACHE=0 bypasses it).
_smolchat_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_smolchat_cuda_root=${SMOLCHAT_CUDA_ROOT:-$HOME/.cache/smolchat/cuda13}
_smolchat_cu="$_smolchat_cuda_root/nvidia/cu13"
_smolchat_cuda_lines=(
  "CUDA_HOME=$_smolchat_cu"
  "CUDA_PATH=$_smolchat_cu"
  "PATH=$_smolchat_cu/bin:$PATH"
  "CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}"
  "CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}"
  "NVCC=$_smolchat_repo/scripts/nvcc-cache.sh"
  "LIBRARY_PATH=$_smolchat_cu/lib/stubs:$_smolchat_cu/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
)
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
  for _l in "${_smolchat_cuda_lines[@]}"; do export "${_l?}"; done
  unset _l
else
  for _l in "${_smolchat_cuda_lines[@]}"; do printf 'export %s=%q\n' "${_l%%=*}" "${_l#*=}"; done
fi
unset _smolchat_cuda_root _smolchat_cu _smolchat_cuda_lines _smolchat_repo
