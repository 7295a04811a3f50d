#!/usr/bin/env bash
# Fills .device/ (git-ignored) with what scripts/device-run.sh needs on the GPU machine, which has no
# network and none of ../shared: the pinned llama.cpp libraries and headers (ggml-common.h included), the
# vocabularies of the fixtures, xxhash's header, and the shared model and text the runs read.
set -euo pipefail
cd "$(dirname "$0")/.."
B=node_modules/@node-llama-cpp/linux-x64/bins/linux-x64
S=${SHARED:-../shared}/data
rm -rf .device
mkdir -p .device/llama/include .device/llama/lib .device/llama/models .device/include \
         .device/data/models/stories260K .device/data/text/tinystories .device/data/text/wikitext-2-raw
cp .deps/llama.cpp/include/*.h .deps/llama.cpp/ggml/include/*.h .deps/llama.cpp/ggml/src/ggml-common.h .deps/llama.cpp/ggml/src/ggml-quants.h .device/llama/include/
cp $B/libggml-base.so $B/libggml.v0.4.0.so $B/libllama.v0.4.0.so $B/libggml-cpu-*.so .device/llama/lib/
cp .deps/llama.cpp/models/ggml-vocab-{qwen2,qwen35,llama-bpe,llama-spm}.gguf .device/llama/models/
# llama.cpp's Hugging Face converter with its gguf-py (tests/test_hf.cpp runs it there: that machine has transformers).
mkdir -p .device/llama/convert
cp -r .deps/llama.cpp/convert_hf_to_gguf.py .deps/llama.cpp/conversion .deps/llama.cpp/gguf-py .deps/llama.cpp/requirements \
    .device/llama/convert/
cp /usr/include/xxhash.h /usr/include/xxh3.h .device/include/
# ggml's source from the same bundle (0.4 MB compressed): the stage cuda-build of scripts/device-run.sh builds llama.cpp's
# CUDA backend from it there for that GPU (issue #16: the eval on the GPU).
(cd .deps/llama.cpp && tar cJf - ggml/CMakeLists.txt ggml/cmake ggml/include ggml/src/CMakeLists.txt ggml/src/*.c \
    ggml/src/*.cpp ggml/src/*.h ggml/src/ggml-version.h.in ggml/src/ggml-cpu/*.h ggml/src/ggml-cuda) > .device/llama/ggml-src.tar.xz
cp $S/models/stories260K/stories260K.gguf .device/data/models/stories260K/
cp $S/text/tinystories/tinystories_val.txt .device/data/text/tinystories/
cp $S/text/wikitext-2-raw/wiki.test.raw $S/text/wikitext-2-raw/wiki.valid.raw .device/data/text/wikitext-2-raw/
# mix30M (61 MB BF16) travels xz-compressed (41 MB) in .device-model/; the ladder stage unpacks it into /tmp.
rm -rf .device-model && mkdir -p .device-model
xz -T0 -6 -c $S/models/mix30M/mix30M.gguf > .device-model/mix30M.gguf.xz
# LIGHT=1: what the quantize ladders need and no more, so that .device and .device-model travel together
# (64 MiB): no fixture vocabularies, and only the CPU variants of current server chips.
if [ "${LIGHT:-0}" = 1 ]; then
    rm -rf .device/llama/models
    find .device/llama/lib -name 'libggml-cpu-*.so' \
        ! -name '*-x64.so' ! -name '*-haswell.so' ! -name '*-skylakex.so' ! -name '*-icelake.so' \
        ! -name '*-sapphirerapids.so' ! -name '*-zen4.so' -delete
fi
# CUDA_EVAL=1: llama.cpp's CUDA backend for libllama's eval (issue #16), from the pinned package family
# (@node-llama-cpp/linux-x64-cuda at the same version as package.json's linux-x64), xz-compressed and split into
# .device-cuda/1, 2, 3: its 159 MB library (124 MB compressed) exceeds what one device call carries (64 MiB), so
# each part travels in its own call and scripts/device-run.sh's stage cuda-lib joins them there.
if [ "${CUDA_EVAL:-0}" = 1 ]; then
    v=$(node -p 'require("./package.json").dependencies["@node-llama-cpp/linux-x64"]')
    t=$(mktemp -d)
    (cd "$t" && npm pack "@node-llama-cpp/linux-x64-cuda@$v" --silent >/dev/null && tar xzf ./*.tgz package/bins/linux-x64-cuda/libggml-cuda.so)
    rm -rf .device-cuda && mkdir -p .device-cuda/1 .device-cuda/2 .device-cuda/3
    xz -T0 -6 -c "$t/package/bins/linux-x64-cuda/libggml-cuda.so" | split -b 58M -d -a 1 - .device-cuda/part-
    for i in 0 1 2; do mv .device-cuda/part-$i .device-cuda/$((i + 1))/; done
    sha256sum "$t/package/bins/linux-x64-cuda/libggml-cuda.so" | cut -d' ' -f1 > .device-cuda/3/libggml-cuda.so.sha256
    echo 3 > .device-cuda/3/libggml-cuda.so.parts
    rm -rf "$t"
    du -sh .device-cuda/*
fi
# CUDA_LIB=path/libggml-cuda.so: llama.cpp's CUDA backend built on this machine for the GPU's architecture
# (`CUDA_ARCH=90 scripts/llama-cuda.sh`, where a CUDA toolkit of the device's version is installed: nvcc 13.0 here and
# there; ≈ 33 min on 2 cores), stripped and xz-compressed into .device-cuda/1 (≈ 38 MB): it travels in a call of its own,
# whose stage cuda-lib keeps it in /tmp, and saves the stage cuda-build's ≈ 4 min of device time in the next call.
if [ -n "${CUDA_LIB:-}" ]; then
    [ -f "$CUDA_LIB" ] || { echo "device-pack.sh: CUDA_LIB='$CUDA_LIB' is not a file (build it with scripts/llama-cuda.sh)" >&2; exit 1; }
    t=$(mktemp -d)
    cp "$CUDA_LIB" "$t/libggml-cuda.so" && strip --strip-unneeded "$t/libggml-cuda.so"
    rm -rf .device-cuda && mkdir -p .device-cuda/1
    xz -T0 -9 -c "$t/libggml-cuda.so" | split -b 58M -d -a 1 - .device-cuda/1/part-
    ls .device-cuda/1/part-* | wc -l | tr -d ' ' > .device-cuda/1/libggml-cuda.so.parts
    sha256sum "$t/libggml-cuda.so" | cut -d' ' -f1 > .device-cuda/1/libggml-cuda.so.sha256
    rm -rf "$t"
    du -sh .device-cuda/*
fi
# ONE_CALL=1: .device for the 1.7B and 8B jobs only, small enough to travel with .device-cuda in one call (session 40:
# 6.4 MB): the fixtures' llama-bpe and qwen2 vocabularies, the wikitext texts, the headers and the libraries of current
# server chips, the big files xz-compressed. The call unpacks them first:
#   find .device -name '*.xz' -exec xz -d {} + && FIXTURE_EARLY=1 BUILD_TARGETS="voodoo voodoo-fixture" \
#       BG_STAGES="cuda-lib e2e-8b-defaults" scripts/device-run.sh build bg        (carry .device and .device-cuda)
if [ "${ONE_CALL:-0}" = 1 ]; then
    rm -rf .device/llama/convert .device/llama/ggml-src.tar.xz .device/llama/models/ggml-vocab-{qwen35,llama-spm}.gguf \
        .device/data/models/stories260K/* .device/data/text/tinystories/*
    find .device/llama/lib -name 'libggml-cpu-*.so' \
        ! -name '*-x64.so' ! -name '*-haswell.so' ! -name '*-skylakex.so' ! -name '*-icelake.so' \
        ! -name '*-sapphirerapids.so' ! -name '*-zen4.so' -delete
    xz -T0 -6 .device/llama/lib/*.so .device/llama/models/*.gguf .device/data/text/wikitext-2-raw/*.raw
fi
du -sh .device .device-model
