#!/usr/bin/env bash
# Create (or update) the project-local virtual environment .venv and install arborspec into it.
# Usage: bash scripts/setup.sh [extra]   e.g. `bash scripts/setup.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned exactly: a looser spec would pull several GB of CUDA wheels.
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
extra=${1:-}
spec="."
[ -n "$extra" ] && spec=".[$extra]"
.venv/bin/python -m pip install -q -c constraints.txt -e "$spec"
# llama.cpp's CPU kernels (the `llamacpp` backend): llama-cpp-python ships as source only and compiles llama.cpp on
# install, with this CPU's native instruction set (AVX-512/VNNI where present). The first install takes ~10-30 min on
# 2 cores; pip keeps the built wheel in its cache, so later installs take seconds. On a CPU with AMX it is built
# without llama.cpp's AMX kernels: the pinned version's AMX matrix product faults on its first multi-token forward (an
# Intel Xeon with AMX-INT8, 2026-11-29; backends/llamacpp.py, model_params). A wheel built with them, installed or in
# pip's cache, is built again.
llama_built() {
    .venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36' \
or b'AMX_INT8 = 1' in llama_cpp.llama_print_system_info())" 2>/dev/null
}
build_llama() {
    local no_amx=""
    # only where -march=native would turn AMX on (a compiler older than GCC 11 does not know these flags)
    grep -qw amx_tile /proc/cpuinfo 2>/dev/null && no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CFLAGS="$no_amx" CXXFLAGS="$no_amx" CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        .venv/bin/python -m pip install -q -c constraints.txt "$@" "llama-cpp-python==0.3.36"
}
if ! llama_built; then
    echo "[arborspec] building llama-cpp-python (llama.cpp, native CPU flags; first time only: 10-30 min) ..." >&2
    build_llama
    if ! llama_built; then  # pip's cache gave a wheel built with the AMX kernels
        .venv/bin/python -m pip cache remove "llama_cpp_python*" >/dev/null 2>&1 || true
        build_llama --force-reinstall --no-deps
    fi
fi
# SIMDe (header-only, Debian libsimde-dev): the tests build the kernels' AVX-512 VNNI code against it a second time, to
# prove it exact on CPUs without VNNI; without it (no root, no apt) those tests skip and say why.
if ! echo '#include <simde/x86/avx512.h>' | c++ -x c++ -E - -o /dev/null 2>/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev; } >/dev/null 2>&1 \
            || echo "[arborspec] could not install libsimde-dev: the emulated AVX-512 kernel tests will skip" >&2
    else
        echo "[arborspec] SIMDe (libsimde-dev) is missing and cannot be installed here (needs root and apt-get):" \
             "the emulated AVX-512 kernel tests will skip" >&2
    fi
fi
# arborspec's own GGUF kernels (the `native` backend): compiled for this CPU with the system's C++ compiler, once
# (~20-40 s), into the arborspec cache; a machine without a compiler gets a one-line note and the other backends.
.venv/bin/arborspec kernels build || echo "[arborspec] the native backend's kernels did not build (see above)" >&2
