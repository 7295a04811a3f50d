#!/usr/bin/env bash
# Fuzzes every reader of outside bytes (issue #19) for SECONDS each (default 60): GGUF, imatrix (GGUF and legacy
# .dat), recipe.json, token files (train.tokens, val.tokens), data.json, the candidate cache entries and the training
# journal's envelope. Builds the harnesses of fuzz/ with clang, libFuzzer, ASan and UBSan in build-fuzz/, seeds each
# corpus from real files (stories260K's header; the imatrix, recipe, candidate cache and journal a short voodoo
# quantize run makes from it; the token files and data.json `voodoo data` makes), and runs each fuzzer with memory
# bounds: a single allocation over 256 MB or a process over 2 GB is a finding. Findings (crash-*, leak-*, oom-*,
# timeout-*) land in build-fuzz/findings/<reader>/; the exit status is 1 when any. The LibTorch archive inside the
# journal is not fuzzed (LibTorch is not built with the sanitizers): tests/test_train.cpp corrupts a real one.
# Usage: scripts/fuzz.sh [SECONDS [READER...]]   READER: gguf imatrix recipe tokens data candidates journal (all)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift $(($# > 0 ? 1 : 0))
READERS=("$@")
if ((${#READERS[@]} == 0)); then READERS=(gguf imatrix recipe tokens data candidates journal); fi
SHARED=${SHARED:-../shared}
# clang with libFuzzer and the sanitizer runtimes (Debian: clang, libclang-rt-14-dev), installed when missing.
if ! command -v clang++ >/dev/null 2>&1 || ! dpkg-query -W -f='${Status}' libclang-rt-14-dev 2>/dev/null | grep -q "install ok installed"; then
    echo "fuzz: installing Debian packages: clang libclang-rt-14-dev"
    sudo_cmd=()
    if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq clang libclang-rt-14-dev
fi
B=build-fuzz
mkdir -p $B
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DVOODOO_FUZZ=ON -DVOODOO_BUILD_TESTS=OFF -DVOODOO_BUILD_BENCH=OFF -DVOODOO_UNITY=OFF > $B/configure.log 2>&1 \
    || { tail -20 $B/configure.log; exit 1; }
cmake --build $B --target fuzzers -j "$(nproc)"

# Seeds: real files, cut to a size a fuzzer mutates quickly.
MODEL=$SHARED/data/models/stories260K/stories260K.gguf
TEXT=$SHARED/data/text/tinystories/tinystories_val.txt
mkdir -p $B/corpus/gguf $B/corpus/imatrix $B/corpus/recipe $B/corpus/tokens $B/corpus/data $B/corpus/candidates $B/corpus/journal
head -c 16384 "$MODEL" > $B/corpus/gguf/stories260K-header.gguf
for v in llama-spm qwen2; do
    head -c 65536 ".deps/llama.cpp/models/ggml-vocab-$v.gguf" > "$B/corpus/gguf/vocab-$v.gguf" 2>/dev/null || true
done
if [ -x build/bin/voodoo ] && [ ! -s $B/corpus/recipe/recipe.json ]; then
    rm -rf $B/seed-work
    head -c 200000 "$TEXT" > $B/seed-text.txt
    VOODOO_PROGRESS=0 build/bin/voodoo quantize "$MODEL" --text $B/seed-text.txt --like Q4_0 --ctx 64 --steps 2 \
        --eval-chunks 0 --baselines none --work $B/seed-work > $B/seed.log 2>&1 || true
    cp $B/seed-work/imatrix.gguf $B/corpus/imatrix/ 2>/dev/null || true
    cp $B/seed-work/run-Q4_0/recipe.json $B/corpus/recipe/ 2>/dev/null || true
    cp $B/seed-work/run-Q4_0/journal.pt $B/corpus/journal/ 2>/dev/null || true
fi
# Token files and data.json from `voodoo data` on 6 kB of text with 16-token chunks: a few hundred tokens each.
if [ -x build/bin/voodoo ] && [ ! -s $B/corpus/data/data.json ]; then
    rm -rf $B/seed-data
    head -c 6000 "$TEXT" > $B/seed-data.txt
    VOODOO_PROGRESS=0 build/bin/voodoo data --model "$MODEL" --text $B/seed-data.txt --ctx 16 --val-fraction 0.2 \
        --out $B/seed-data > $B/seed-data.log 2>&1 || true
    cp $B/seed-data/train.tokens $B/seed-data/val.tokens $B/corpus/tokens/ 2>/dev/null || true
    cp $B/seed-data/data.json $B/corpus/data/ 2>/dev/null || true
fi
# Candidate cache entries of the quantize run: those of the [64, 32] tensors (attn_k, attn_v: 2,048 weights), whose
# size tells the type. fuzz_candidates reads a first byte (the ggml type number; +128: written by store()) before the
# entry, so each is seeded both ways.
if [ -d $B/seed-work/candidates ] && [ -z "$(ls $B/corpus/candidates)" ]; then
    for f in $B/seed-work/candidates/*/*.bin; do
        case $(($(stat -c %s "$f") - 8)) in  # the payload, without the 8-byte checksum
            1152) t=2 ;; 1280) t=3 ;; 1408) t=6 ;; 1536) t=7 ;; 2176) t=8 ;; *) continue ;;
        esac
        for mode in 0 128; do
            { printf "\\$(printf %o $((t + mode)))"; if ((mode)); then head -c -8 "$f"; else cat "$f"; fi; } \
                > "$B/corpus/candidates/$(basename "$f" .bin)-$mode"
        done
    done
fi
# A legacy .dat imatrix (llama.cpp's old format): one entry "w" of 4 values from 1 call, then the chunk count.
printf '\x01\x00\x00\x00\x01\x00\x00\x00w\x01\x00\x00\x00\x04\x00\x00\x00\x00\x00\x80\x3f\x00\x00\x80\x3f\x00\x00\x80\x3f\x00\x00\x80\x3f\x01\x00\x00\x00' \
    > $B/corpus/imatrix/legacy.dat

found=0
for r in "${READERS[@]}"; do
    mkdir -p $B/findings/$r
    echo "== fuzz_$r for ${SECONDS_EACH}s"
    ( cd $B/findings/$r && "../../bin/fuzz_$r" "../../corpus/$r" -max_total_time="$SECONDS_EACH" -malloc_limit_mb=256 \
        -rss_limit_mb=2048 -timeout=10 -max_len=65536 -print_final_stats=1 > ../fuzz_$r.log 2>&1 ) || true
    grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|ERROR|SUMMARY|out-of-memory|Done [0-9]+ runs" $B/findings/fuzz_$r.log | head -6
    if ls $B/findings/$r/ | grep -qE "^(crash|leak|oom|timeout)-"; then
        echo "   findings: $(ls $B/findings/$r | tr '\n' ' ')"
        found=1
    fi
done
exit $found
