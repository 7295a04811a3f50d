#!/usr/bin/env bash
# Builds llama.cpp's CUDA backend for libllama's eval on this machine's GPU (issue #16: the eval on the GPU), from
# ggml's source in the same bundle as the pinned libraries (make bootstrap puts it in .deps/llama.cpp), with this
# machine's nvcc. Voodoo loads it when GGML_BACKEND_PATH names it (ggml-backend-reg.cpp,
# ggml_backend_load_all_from_path); libllama's eval then offloads every layer to the GPU (`voodoo doctor` lists
# "CUDA0: …", eval.md says "computed by libllama on CUDA0: …").
#
# Why build it: the pinned package family's prebuilt CUDA backends do not run everywhere. @node-llama-cpp/linux-x64-cuda
# carries Hopper code only as PTX from a newer toolkit than driver 580 accepts ("the provided PTX was compiled with an
# unsupported toolchain", docs/BENCHMARKS.md, session 16), and linux-x64-cuda-ext needs CUDA 12's runtime libraries.
#
# Usage: scripts/llama-cuda.sh [GGML_SOURCE_DIR [BUILD_DIR]]   (defaults: the repository's .deps/llama.cpp/ggml and
# .deps/ggml-cuda; with your own llama.cpp, give its ggml folder). CUDA_ARCH (default "native": the GPUs of this
# machine; e.g. 90 for H100/H200) picks the code built. Progress and errors go to stderr, the library's path to stdout:
#   export GGML_BACKEND_PATH=$(scripts/llama-cuda.sh)
# before `voodoo quantize` / `voodoo eval` (the CPU build of Voodoo is enough: this is libllama's backend).
# Needs CMake ≥ 3.24 (for "native"), ninja, nvcc and cuBLAS (a CUDA toolkit). A loadable backend (GGML_BACKEND_DL),
# built with an unversioned soname so that it uses the libggml-base.so Voodoo already loaded (one copy of ggml).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
# Paths given are the caller's (relative to where it runs); the defaults are the repository's.
abs() { case "$1" in /*) echo "$1";; *) echo "$PWD/$1";; esac; }
SRC=$(abs "${1:-$(dirname "$0")/../.deps/llama.cpp/ggml}")
B=$(abs "${2:-$(dirname "$0")/../.deps/ggml-cuda}")
[ -f "$SRC/CMakeLists.txt" ] || { echo "llama-cuda.sh: no ggml source in '$SRC' (make bootstrap puts it in .deps/llama.cpp/ggml)" >&2; exit 1; }
command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "llama-cuda.sh: no nvcc on PATH or in /usr/local/cuda/bin: a CUDA toolkit is needed" >&2; exit 1; }
# The bundle leaves out ggml's pkg-config template, which its CMakeLists configures.
[ -f "$SRC/ggml.pc.in" ] || touch "$SRC/ggml.pc.in"
t0=$SECONDS
cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_BACKEND_DL=ON -DGGML_CPU=OFF -DGGML_NATIVE=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-native}" -DCMAKE_PLATFORM_NO_VERSIONED_SONAME=ON \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF > "$B.configure.log" 2>&1 \
    || { tail -30 "$B.configure.log" >&2; echo "llama-cuda.sh: configure failed (log: $B.configure.log)" >&2; exit 1; }
cmake --build "$B" -j "$(nproc)" --target ggml-cuda > "$B.build.log" 2>&1 \
    || { grep -E "error" -A3 "$B.build.log" | head -40 >&2; echo "llama-cuda.sh: build failed (log: $B.build.log)" >&2; exit 1; }
lib=$(find "$B" -name 'libggml-cuda.so' | head -1)
echo "llama-cuda.sh: built in $((SECONDS - t0)) s; $(readelf -d "$lib" | grep -c NEEDED) libraries needed, libggml-base as $(readelf -d "$lib" | grep -o 'libggml-base[^]]*')" >&2
readlink -f "$lib"
