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
         .device/data/models/stories260K .device/data/text/tinystories
cp .deps/llama.cpp/include/*.h .deps/llama.cpp/ggml/include/*.h .deps/llama.cpp/ggml/src/ggml-common.h .device/llama/include/
cp $B/libggml-base.so $B/libggml.v0.4.0.so $B/libllama.v0.4.0.so $B/libggml-cpu-*.so .device/llama/lib/
cp .deps/llama.cpp/models/ggml-vocab-{qwen2,llama-bpe,llama-spm}.gguf .device/llama/models/
cp /usr/include/xxhash.h /usr/include/xxh3.h .device/include/
cp $S/models/stories260K/stories260K.gguf .device/data/models/stories260K/
cp $S/text/tinystories/tinystories_val.txt .device/data/text/tinystories/
du -sh .device
