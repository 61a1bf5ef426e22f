#!/usr/bin/env bash
# Downloads, where there is network, the wheels benchmarks/gpu_check.sh installs offline
# from ./.whl/ on a CUDA machine without network: kvikio for CUDA 13 and what it needs
# beyond the frameworks' own CUDA wheels, and the build and test packages a bare
# framework image may lack. Only wheels, for the target's Python and platform.
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION] [CUDA_MAJOR]     (defaults: 3.12 13)
#
# Then carry .whl/ to the machine with the tree (it is git-ignored).
set -euo pipefail
PYV=${1:-3.12}
CUDA=${2:-13}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$ROOT/.whl"
packages=(
    "kvikio-cu$CUDA" "libkvikio-cu$CUDA" "rapids-logger" "cuda-pathfinder"  # GDS (the [gds-cu$CUDA] extra)
    "xxhash" "ml_dtypes" "safetensors"                                      # tensorferry's own dependencies, a peer
    "scikit-build-core" "nanobind" "pathspec" "packaging" "cmake" "ninja"    # the offline build
    "pytest" "iniconfig" "pluggy" "psutil"                                  # the CUDA tests
)
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYV" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$ROOT/.whl" "${packages[@]}"
ls -la "$ROOT/.whl"
