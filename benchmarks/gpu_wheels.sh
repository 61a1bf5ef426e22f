#!/usr/bin/env bash
# Downloads, where there is network, the wheels benchmarks/gpu_check.sh installs offline
# from ./.whl/ on a CUDA machine without network: kvikio for CUDA 13 and what it needs
# beyond the frameworks' own CUDA wheels, and the build and test packages a bare
# framework image may lack. Only wheels, for the target's Python and platform.
#
#   benchmarks/gpu_wheels.sh [PYTHON_VERSION] [CUDA_MAJOR]     (defaults: 3.12 13)
#
# Then carry .whl/ to the machine with the tree (it is git-ignored).
#
# fio, the ceiling of every figure, is not on the CUDA image: where Debian's fio source can
# be had (apt-get source, deb-src enabled) it is built here without library ioengines and
# placed as .whl/fio/fio (a wrapper that finds the libaio copied beside it); gpu_check.sh
# puts .whl/fio on PATH. Without it the figures have no ceiling.
set -euo pipefail
PYV=${1:-3.12}
CUDA=${2:-13}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$ROOT/.whl"
packages=(
    "kvikio-cu$CUDA" "libkvikio-cu$CUDA" "rapids-logger" "cuda-pathfinder"  # GDS (the [gds-cu$CUDA] extra)
    "xxhash" "ml_dtypes" "safetensors" "fastsafetensors"                    # tensorferry's own dependencies, peers
    "scikit-build-core" "nanobind" "pathspec" "packaging" "cmake" "ninja"    # the offline build
    "pytest" "iniconfig" "pluggy" "psutil"                                  # the CUDA tests
)
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYV" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$ROOT/.whl" "${packages[@]}"
ls -la "$ROOT/.whl"

if [ ! -x "$ROOT/.whl/fio/fio" ]; then
    src=$(mktemp -d)
    if (cd "$src" && apt-get source -q --download-only fio >/dev/null 2>&1 && tar xzf fio_*.orig.tar.gz \
        && cd fio-*/ && ./configure --disable-native --disable-numa --disable-rdma --disable-gfapi --disable-rbd --disable-rados \
            --disable-pmem --disable-http --disable-libnfs --disable-xnvme --disable-libzbc --disable-dfs >/dev/null && make -j"$(nproc)" -s >/dev/null); then
        mkdir -p "$ROOT/.whl/fio"
        strip -o "$ROOT/.whl/fio/fio.bin" "$src"/fio-*/fio
        libaio=$(ldd "$ROOT/.whl/fio/fio.bin" | awk '/libaio/ {print $3}')
        [ -n "$libaio" ] && cp -L "$libaio" "$ROOT/.whl/fio/"
        printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/fio.bin" "$@"\n' \
            >"$ROOT/.whl/fio/fio"
        chmod +x "$ROOT/.whl/fio/fio"
        "$ROOT/.whl/fio/fio" --version
    else
        echo "fio not built (no deb-src for fio here): the GPU figures will have no fio ceiling" >&2
    fi
    rm -rf "$src"
fi
