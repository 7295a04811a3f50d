#!/usr/bin/env bash
# What the project runs on the GPU machine (the workplace's device tool): a CUDA build against that
# machine's PyTorch, the GPU tests, end-to-end runs and bench/train_step. Needs the folder .device/ that
# scripts/device-pack.sh fills (llama.cpp libraries and headers, vocabularies, the shared data).
# Usage: scripts/device-run.sh STAGE... with stages build, test, e2e, e2e-0.6b, e2e-1.7b, e2e-1.7b-noahead, e2e-1.7b-ahead, e2e-1.7b-nearest, e2e-1.7b-stages2, e2e-1.7b-stages1, e2e-1.7b-eagerfast, bench-small, bench-large,
# kernels, ncu, profile, ladder-stories, ladder-mix30M, ablations, probe-tf32, learning, ptqr, bench-qwen35, hf, delta, moe, moe-step, moe-host, bench-8b-full, e2e-8b, cand-rate, nccl, cuda-lib, cuda-build, dry-8b, e2e-8b-defaults, bg, bg-wait. Logs and results
# go to $OUT (or ./out).
# The 8B job in one call's carry (session 40): `CUDA_LIB=… ONE_CALL=1 scripts/device-pack.sh`, then carry [".device",
# ".device-cuda"]: `find .device -name '*.xz' -exec xz -d {} + && FIXTURE_EARLY=1 BUILD_TARGETS="voodoo voodoo-fixture"
# BG_STAGES="cuda-lib e2e-8b-defaults" scripts/device-run.sh build bg`, then `WAIT_S=585 scripts/device-run.sh bg-wait`.
# Or in two calls with the full .device: first a call with carry [".device-cuda"] and
# `scripts/device-run.sh cuda-lib` (llama.cpp's CUDA backend built on the development machine, scripts/device-pack.sh
# CUDA_LIB=…), then at once, carry [".device"]: `FIXTURE_EARLY=1 BUILD_TARGETS="voodoo voodoo-fixture"
# BG_STAGES="cuda-lib e2e-8b-defaults" scripts/device-run.sh build bg`, then `WAIT_S=585 scripts/device-run.sh bg-wait`
# calls back to back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
D=$PWD/.device
export VOODOO_PROGRESS=0
log() { echo "== $(date +%T) $*"; }

# The stage e2e-1.7b (below) as a function: $1 tags its files and work folder, the other arguments go to quantize.
e2e_17b() {
    local tag=$1; shift
    local W=/tmp/e2e-17b$tag
    # Issue #16: `voodoo quantize --device cuda` with the default menu on a synthetic model of Qwen3-1.7B's shape
    # (every layer, the full 151,936-token vocabulary, BF16, tied head; random weights: speed and memory only),
    # at stock Q4_K_M's size, beside stock Q4_K_M, with every other option at its default (since session 17: the
    # probe's anchors, the eval's chunks and llama-bench runs auto). Every stage's time is in the log's last
    # "== times:" line and WORK/times.json; GPU memory sampled each second; disk per folder.
    # MENU=Q3_K,Q4_K,… runs it with that menu instead of the default one (the K-quants build in a few minutes);
    # E2E_ARGS adds flags (e.g. "--probe-anchors 2 --eval-chunks 8", the runs before session 17).
    log e2e qwen3-1.7b shape
    mkdir -p "$OUT/e2e"
    [ -f /tmp/qwen3-1.7b-shape.gguf ] || /usr/bin/time -v build-cuda/bin/voodoo-fixture --arch qwen3 --vocab "$D/llama/models/ggml-vocab-qwen2.gguf" \
        --n-embd 2048 --n-layer 28 --n-head 16 --n-head-kv 8 --head-dim 128 --n-ff 6144 --type bf16 --tied \
        -o /tmp/qwen3-1.7b-shape.gguf > "$OUT/e2e/fixture-1.7b.log" 2>&1
    ls -la /tmp/qwen3-1.7b-shape.gguf
    T=$D/data/text/wikitext-2-raw/wiki.valid.raw
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 1000 > "$OUT/e2e/gpu-mem-1.7b$tag.csv" 2>&1 &
    SMI=$!
    # The CPU's use each second (vmstat: us/sy/id/wa), timestamped: where the cores idle is where work can move.
    vmstat -n -t 1 > "$OUT/e2e/vmstat-1.7b$tag.txt" 2>&1 &
    VM=$!
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core" > "$OUT/e2e/cpu-1.7b$tag.txt" 2>&1
    log "quantize starts (the vmstat samples' clock)"
    /usr/bin/time -v build-cuda/bin/voodoo quantize /tmp/qwen3-1.7b-shape.gguf --text "$T" --like Q4_K_M \
        "$@" --eval-text "$D/data/text/wikitext-2-raw/wiki.test.raw" \
        --device cuda --work $W ${MENU:+--menu "$MENU"} ${E2E_ARGS:-} > "$OUT/e2e/qwen3-1.7b$tag.log" 2>&1
    kill $SMI $VM 2>/dev/null
    grep -E "^== |in [0-9.]+s|Maximum resident|Elapsed|candidates for|candidates built|built ahead|second stage|--probe-anchors auto|eval defaults|after the candidates|ahead: " "$OUT/e2e/qwen3-1.7b$tag.log" | cut -c1-220 | tail -40
    du -sh $W/* > "$OUT/e2e/disk-1.7b$tag.txt" 2>&1; cat "$OUT/e2e/disk-1.7b$tag.txt"
    cp $W/times.json "$OUT/e2e/times-1.7b$tag.json" 2>/dev/null
    cp $W/eval.md "$OUT/e2e/qwen3-1.7b$tag-eval.md" 2>/dev/null
    # What the run kept and measured (the kept candidates' types, for the quantizers' work by type), and what it chose.
    for f in sensitivity.json selection.json probe.eager.json probe.stage.json; do
        cp $W/run-*/$f "$OUT/e2e/1.7b$tag-$f" 2>/dev/null
    done
    awk -F', ' '{gsub(/ MiB/, "", $2); if ($2 + 0 > m) m = $2 + 0} END {print "peak GPU memory used:", m, "MiB"}' "$OUT/e2e/gpu-mem-1.7b$tag.csv"
}

# The synthetic Llama-3.1-8B shape of the 8B stages (32 layers, 4096 wide, 14,336 FFN, the full 128,256-token
# vocabulary, BF16, its own head; random weights), made once into /tmp (≈ 1 min, 16.1 GB; written to a temporary
# file and renamed, so it exists only whole). The stage build with FIXTURE_EARLY=1 starts it as soon as voodoo-fixture
# is built, beside the rest of the build (≈ 50 s of device time less); fixture_8b then waits for that one.
FIXTURE_8B_ARGS="--arch llama --vocab $D/llama/models/ggml-vocab-llama-bpe.gguf --n-embd 4096 --n-layer 32 --n-head 32
    --n-head-kv 8 --head-dim 128 --n-ff 14336 --type bf16 --rope-freq-base 500000 -o /tmp/llama3-8b-shape.gguf"
fixture_8b() {
    while [ -f /tmp/fixture-8b.running ]; do sleep 2; done
    [ -f /tmp/fixture-8b-early.log ] && cp /tmp/fixture-8b-early.log "$OUT/e2e/fixture-8b.log"
    [ -f /tmp/llama3-8b-shape.gguf ] || /usr/bin/time -v build-cuda/bin/voodoo-fixture $FIXTURE_8B_ARGS > "$OUT/e2e/fixture-8b.log" 2>&1
}

cuda_build() {
    # llama.cpp's CUDA backend built there for the GPU by scripts/llama-cuda.sh, from ggml's source in the same bundle as
    # the libraries (.device/llama/ggml-src.tar.xz, scripts/device-pack.sh), with that machine's nvcc: the pinned
    # package family's prebuilt one does not run on driver 580 (stage cuda-lib above). Later stages of the same call,
    # bg's included, get it through GGML_BACKEND_PATH, and libllama's eval then offloads every layer to the GPU.
    log cuda-build
    rm -rf /tmp/ggml-src && mkdir -p /tmp/ggml-src && tar xJf "$D/llama/ggml-src.tar.xz" -C /tmp/ggml-src
    local lib
    lib=$(CUDA_ARCH=90 scripts/llama-cuda.sh /tmp/ggml-src/ggml /tmp/ggml-cuda-build 2> "$OUT/cuda-build.log") || { tail -30 "$OUT/cuda-build.log"; return 1; }
    cat "$OUT/cuda-build.log"; log "built $lib"; readelf -d "$lib" | grep NEEDED
    export GGML_BACKEND_PATH=$lib
    cuda_smoke
}

# With GGML_BACKEND_PATH set: `voodoo doctor` names the GPU backend, and stock Q4_0 of stories260K is evaluated on the GPU
# and on the CPU (that libllama decodes there, and how close the two backends' numbers are).
cuda_smoke() {
    [ -x build-cuda/bin/voodoo ] || { log "cuda smoke check skipped: no build-cuda/bin/voodoo yet (the stage build)"; return 0; }
    build-cuda/bin/voodoo doctor 2>&1 | grep -iE "cuda|gpu|device" | head -8
    M=$D/data/models/stories260K/stories260K.gguf; T=$D/data/text/tinystories/tinystories_val.txt
    build-cuda/bin/voodoo baseline "$M" --recipes Q4_0 --out-dir /tmp/cuda-smoke > "$OUT/cuda-smoke-baseline.log" 2>&1
    for where in gpu cpu; do
        pre=(); [ $where = cpu ] && pre=(env -u GGML_BACKEND_PATH)
        "${pre[@]}" build-cuda/bin/voodoo eval /tmp/cuda-smoke/*Q4_0*.gguf -m "$M" --text "$T" \
            --ctx 128 --chunks 16 --speed-reps 2 --out-dir "$OUT/cuda-smoke-$where" > "$OUT/cuda-smoke-$where.log" 2>&1
        echo "$where: $(grep -h "Q4_0" "$OUT/cuda-smoke-$where/eval.md") $(grep -ho "computed by libllama on .*" "$OUT/cuda-smoke-$where/eval.md")"
    done
}

for stage in "$@"; do
case "$stage" in
build)
    log build
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    TORCH_PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
    cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DVOODOO_CUDA=ON \
        -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DVOODOO_LLAMA_DIR="$D/llama" \
        -DXXHASH_INCLUDE_DIR="$D/include" -DXXHASH_LIBRARY=/lib/x86_64-linux-gnu/libxxhash.so.0 \
        -DVOODOO_SHARED_DATA="$D/data" > /tmp/configure.log 2>&1 || { tail -40 /tmp/configure.log; exit 1; }
    if [ "${FIXTURE_EARLY:-0}" = 1 ] && [ ! -f /tmp/llama3-8b-shape.gguf ]; then
        cmake --build build-cuda -j "$(nproc)" --target voodoo-fixture > /tmp/build-fixture.log 2>&1 \
            || grep -E "error|Error" -A5 /tmp/build-fixture.log | head -20
        if [ -x build-cuda/bin/voodoo-fixture ]; then
            touch /tmp/fixture-8b.running
            # Its own process session (as the stage bg's), so that it outlives this call if the build ends first.
            setsid nohup bash -c "/usr/bin/time -v build-cuda/bin/voodoo-fixture $(echo $FIXTURE_8B_ARGS) > /tmp/fixture-8b-early.log 2>&1; rm -f /tmp/fixture-8b.running" \
                < /dev/null > /dev/null 2>&1 &
            log "the 8B fixture started beside the build"
        fi
    fi
    # -k 0: build every target that can be built, so one failing target still leaves the others to run.
    # BUILD_TARGETS (default: all) builds only what a run needs, e.g. "voodoo voodoo-fixture" for e2e-8b.
    cmake --build build-cuda -j "$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS} -- -k 0 > /tmp/build.log 2>&1 || grep -E "error|Error" -A5 /tmp/build.log | head -80
    log built
    ;;
cuda-lib)
    # llama.cpp's CUDA backend for libllama (issue #16: the eval of an 8B shape on the GPU). The parts of
    # .device-cuda/N travel in separate calls (scripts/device-pack.sh, CUDA_EVAL=1); each call's stage cuda-lib
    # keeps the parts it finds in /tmp/ggml-cuda and, once all three are there, joins them into libggml-cuda.so.
    # Later stages of the call load it through ggml's GGML_BACKEND_PATH; libllama's default n_gpu_layers (-1)
    # then offloads every layer of the eval's models. The package's library (CUDA_EVAL=1) has sm_90 code only as PTX,
    # which driver 580.159 refuses ("compiled with an unsupported toolchain", docs/BENCHMARKS.md, session 16); one built
    # on the development machine with nvcc 13.0 for sm_90 (CUDA_LIB=…) holds its machine code, as the stage cuda-build's.
    # The parts' count is in libggml-cuda.so.parts (3 for the package's library; 1 for one built by scripts/llama-cuda.sh
    # on the development machine, CUDA_LIB=… scripts/device-pack.sh, which runs where a build here does).
    mkdir -p /tmp/ggml-cuda
    for d in .device-cuda/*/; do [ -d "$d" ] && cp "$d"* /tmp/ggml-cuda/; done
    ls /tmp/ggml-cuda
    n=$(cat /tmp/ggml-cuda/libggml-cuda.so.parts 2>/dev/null || echo 3)
    have=0; for ((i = 0; i < n; i++)); do [ -f /tmp/ggml-cuda/part-$i ] && have=$((have + 1)); done
    if [ -f /tmp/ggml-cuda/libggml-cuda.so.sha256 ] && [ "$have" = "$n" ]; then
        [ -f /tmp/ggml-cuda/libggml-cuda.so ] || cat $(for ((i = 0; i < n; i++)); do echo /tmp/ggml-cuda/part-$i; done) | xz -d > /tmp/ggml-cuda/libggml-cuda.so
        echo "$(cat /tmp/ggml-cuda/libggml-cuda.so.sha256)  /tmp/ggml-cuda/libggml-cuda.so" | sha256sum -c || exit 1
        # libcudart.so.13 and libcublas.so.13, which the library needs, from PyTorch's CUDA wheels.
        for l in libcublas.so.13 libcudart.so.13; do
            f=$(python3 -c "import nvidia, pathlib; print(next(p for d in nvidia.__path__ for p in pathlib.Path(d).rglob('$l')).parent)" 2>/dev/null)
            [ -n "$f" ] && export LD_LIBRARY_PATH="$f${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        done
        export GGML_BACKEND_PATH=/tmp/ggml-cuda/libggml-cuda.so CUDA_CACHE_PATH=/tmp/cuda-cache CUDA_CACHE_MAXSIZE=4294967296
        echo "GGML_BACKEND_PATH=$GGML_BACKEND_PATH LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        mkdir -p "$OUT" && cuda_smoke
    fi
    ;;
cuda-build)
    cuda_build || log "cuda-build failed: the stages after it run with libllama on the CPU"
    ;;
bg)
    # Runs the stages named in BG_STAGES in a process session of their own (setsid), which outlives this call, with
    # OUT=/tmp/bg-out; the stage bg-wait of a later call waits for it and brings its files back as one archive.
    rm -rf /tmp/bg-out /tmp/bg.rc; mkdir -p /tmp/bg-out
    OUT=/tmp/bg-out setsid nohup bash -c "scripts/device-run.sh $BG_STAGES > /tmp/bg-out/bg.log 2>&1; echo \$? > /tmp/bg.rc" \
        < /dev/null > /dev/null 2>&1 &
    log "started in the background: $BG_STAGES"
    ;;
bg-wait)
    # Waits up to WAIT_S seconds (default 540) for the stage bg's run; then, finished or not, its files to $OUT.
    # A machine with no background run (a fresh one: the warm one was given back, and its run with it) says so at
    # once instead of waiting.
    if [ ! -d /tmp/bg-out ]; then log "no background run on this machine (a fresh one?): nothing to wait for"; exit 3; fi
    for ((i = 0; i < ${WAIT_S:-540}; i += 5)); do [ -f /tmp/bg.rc ] && break; sleep 5; done
    if [ -f /tmp/bg.rc ]; then log "background run finished, exit $(cat /tmp/bg.rc)"; else log "background run still running"; fi
    tail -40 /tmp/bg-out/bg.log
    tar czf "$OUT/bg-out.tar.gz" -C /tmp bg-out
    ;;
hf)
    # Hugging Face checkpoints in (issue #20): tiny llama and qwen3 checkpoints written by this machine's
    # transformers, converted by the bundle's converter, quantized end to end on the CPU.
    log hf
    python3 -c 'import transformers, torch, numpy, sentencepiece; print("transformers", transformers.__version__, "torch", torch.__version__, "numpy", numpy.__version__)'
    build-cuda/bin/voodoo_tests --gtest_filter='hf.*' 2>&1 | tee "$OUT/test-hf.log" | grep -E "^\[|Failure|Expected|Which|error|wrote" | head -60
    ;;
test)
    log test
    build-cuda/bin/voodoo_tests --gtest_filter="${TEST_FILTER:-cuda*:gated*:train.the_loss*:train.finishes*:train.ptqr*}" 2>&1 | tee "$OUT/test-cuda.log" | grep -E "^\[|Failure|Expected|Which|error" | head -80
    if [ "${PIPESTATUS[0]}" -ge 128 ]; then
        log "the tests crashed: the training test again under cuda-gdb for a backtrace"
        cuda-gdb -batch -ex run -ex bt -ex 'x/8a $sp' -ex 'info sharedlibrary' --args build-cuda/bin/voodoo_tests \
            --gtest_filter='cuda.training*' > "$OUT/gdb.log" 2>&1
        grep -E "^#|signal|0x7" "$OUT/gdb.log" | grep -v "New Thread\|exited" | head -60
    fi
    ;;
e2e)
    log e2e stories260K
    T=$D/data/text/tinystories/tinystories_val.txt
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p "$OUT/e2e"
    head -n $k "$T" > /tmp/calib.txt; tail -n +$((k + 1)) "$T" > /tmp/heldout.txt
    /usr/bin/time -v build-cuda/bin/voodoo quantize "$D/data/models/stories260K/stories260K.gguf" --text /tmp/calib.txt \
        --eval-text /tmp/heldout.txt --like Q4_K_M --ctx 256 --eval-ctx 256 --baselines Q4_K_M --device cuda \
        --work /tmp/e2e-stories --threads 16 --ggml-threads 8 > "$OUT/e2e/stories.log" 2>&1
    tail -25 "$OUT/e2e/stories.log"; cp /tmp/e2e-stories/eval.json "$OUT/e2e/stories-eval.json" 2>/dev/null
    cp /tmp/e2e-stories/eval.md "$OUT/e2e/stories-eval.md" 2>/dev/null
    ;;
e2e-0.6b)
    log e2e qwen3-0.6b shape
    build-cuda/bin/voodoo-fixture --vocab "$D/llama/models/ggml-vocab-qwen2.gguf" --n-embd 1024 --n-layer 28 --n-head 16 \
        --n-head-kv 8 --head-dim 128 --n-ff 3072 --type bf16 --tied -o /tmp/qwen3-0.6b-shape.gguf
    W=$D/data/text/tinystories/tinystories_val.txt
    # A short run: a 4-type menu, 8 imatrix chunks, 30 steps; the eval (libllama on the CPU) loads the
    # exported file beside stock Q4_K_M on 4 chunks.
    mkdir -p "$OUT/e2e"
    /usr/bin/time -v build-cuda/bin/voodoo quantize /tmp/qwen3-0.6b-shape.gguf --text "$W" --ratio 0.6 --ctx 512 \
        --menu Q3_K,Q4_K,Q6_K,Q8_0 --imatrix-chunks 8 --probe-sequences 4 --steps 30 --batch 4 \
        --baselines Q4_K_M --eval-ctx 512 --eval-chunks 4 --device cuda --work /tmp/e2e-06b --threads 16 --ggml-threads 16 \
        > "$OUT/e2e/qwen3-0.6b.log" 2>&1
    tail -30 "$OUT/e2e/qwen3-0.6b.log"
    ls -la /tmp/e2e-06b/*.gguf
    cp /tmp/e2e-06b/eval.md "$OUT/e2e/qwen3-0.6b-eval.md" 2>/dev/null
    ;;
e2e-1.7b)
    e2e_17b "" --baselines Q4_K_M
    ;;
e2e-1.7b-gpueval)
    # The job of e2e-1.7b with libllama's eval on the GPU (the stage cuda-build earlier in the same call sets
    # GGML_BACKEND_PATH; --eval-ahead auto is then off), in a fresh work folder.
    [ -n "${GGML_BACKEND_PATH:-}" ] || { log "e2e-1.7b-gpueval: no GGML_BACKEND_PATH (the stage cuda-build first), skipped"; continue; }
    rm -rf /tmp/e2e-17b-gpueval
    e2e_17b "-gpueval" --baselines Q4_K_M
    ;;
e2e-1.7b-stages2|e2e-1.7b-stages1)
    # The job of e2e-1.7b-gpueval with candidate pruning in two stages (--prune-stages 2: the knapsack's choices and
    # their neighbours measured, the plan made again) or in one (the default before session 32), in a fresh work
    # folder; run both in one call for an A/B on one machine (libllama's eval on the GPU after the stage cuda-build,
    # else on the CPU; E2E_ARGS="--eval-ahead off" keeps the CPU eval out of the train stage).
    n=${stage#e2e-1.7b-stages}
    rm -rf /tmp/e2e-17b-stages$n
    e2e_17b "-stages$n" --baselines Q4_K_M --prune-stages $n
    cp /tmp/e2e-17b-stages$n/run-Q4_K_M/candidates.built.json "$OUT/e2e/candidates-1.7b-stages$n.json" 2>/dev/null
    rm -rf /tmp/e2e-17b-stages$n
    ;;
e2e-1.7b-eagerfast)
    # The job of e2e-1.7b-stages2 with the eager types of before session 37 (--eager-types fast: Q2_K and Q8_0), in a
    # fresh work folder: run after e2e-1.7b-stages2 on the same machine, the A/B of the cheap eager types.
    rm -rf /tmp/e2e-17b-eagerfast
    e2e_17b "-eagerfast" --baselines Q4_K_M --eager-types fast
    cp /tmp/e2e-17b-eagerfast/run-Q4_K_M/candidates.built.json "$OUT/e2e/candidates-1.7b-eagerfast.json" 2>/dev/null
    rm -rf /tmp/e2e-17b-eagerfast
    ;;
e2e-1.7b-cpueval)
    # The same job with libllama on the CPU (GGML_BACKEND_PATH removed; the eval ahead at its auto, on), in a fresh
    # work folder: the same machine's baseline for e2e-1.7b-gpueval.
    rm -rf /tmp/e2e-17b-cpueval
    (unset GGML_BACKEND_PATH; e2e_17b "-cpueval" --baselines Q4_K_M)
    ;;
e2e-1.7b-noahead)
    # The job of e2e-1.7b with --eval-ahead off, said outright (the default since session 24; the eval stage does all
    # of the eval), in a fresh work folder: the same machine's baseline for e2e-1.7b-ahead.
    rm -rf /tmp/e2e-17b /tmp/e2e-17b-noahead
    e2e_17b "-noahead" --baselines Q4_K_M --eval-ahead off
    ;;
e2e-1.7b-ahead)
    # The same job with --eval-ahead on (the reference and the stock file scored on the CPU while the train child
    # runs), in a fresh work folder: run after e2e-1.7b-noahead on the same machine, it is the A/B of the eval ahead.
    rm -rf /tmp/e2e-17b-noahead /tmp/e2e-17b-ahead
    e2e_17b "-ahead" --baselines Q4_K_M --eval-ahead on
    ;;
e2e-1.7b-nearest)
    # The same job with --baselines at its default (nearest: the stock files that can be among the six nearest in
    # size, made and compared), in a fresh work folder; the previous run's folder is removed first (the disk).
    rm -rf /tmp/e2e-17b
    e2e_17b "-nearest"
    ;;
nccl)
    # Issue #17: c10d's NCCL process group (the GPU machine's PyTorch has it; it ships no gloo headers), checked by
    # voodoo-dist-check (exact sums in f32/bf16/int64, maximum, send/recv, barrier) with one rank a GPU: every GPU of
    # this machine, at most 2 (one GPU: one rank, which checks the rendezvous, the communicator and the collectives'
    # paths, not a transfer between GPUs). NVLink multicast stays off (the device's KINDS.md).
    log nccl
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    grep -E "process groups" /tmp/configure.log
    mkdir -p "$OUT/nccl"
    n=$(nvidia-smi -L | wc -l); [ "$n" -gt 2 ] && n=2
    export WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=29533
    for ((r = 1; r < n; r++)); do RANK=$r LOCAL_RANK=$r build-cuda/bin/voodoo-dist-check cuda > "$OUT/nccl/rank$r.log" 2>&1 & done
    RANK=0 LOCAL_RANK=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN} build-cuda/bin/voodoo-dist-check cuda 2>&1 | tee "$OUT/nccl/rank0.log"
    wait; cat "$OUT/nccl"/rank[1-9]*.log 2>/dev/null
    unset WORLD_SIZE RANK LOCAL_RANK MASTER_ADDR MASTER_PORT
    ;;
cand-rate)
    # Issue #16: this machine's CPU (lscpu), the per-core rate of every type of the default menu (bench_quant's
    # quantize_1core), and Voodoo's candidates against llama_model_quantize on the same tensors and types
    # (bench/candidate_rate) on a 4-layer slice of the Qwen3-1.7B shape (the full vocabulary, BF16, tied).
    log candidate rate
    mkdir -p "$OUT/cand-rate"
    lscpu > "$OUT/cand-rate/lscpu.txt"; grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|Flags" "$OUT/cand-rate/lscpu.txt" | cut -c1-120
    [ -x build-cuda/bin/bench_quant ] && build-cuda/bin/bench_quant --benchmark_filter=quantize_1core > "$OUT/cand-rate/bench-quant-1core.txt" 2>&1
    grep -E "quantize_1core" "$OUT/cand-rate/bench-quant-1core.txt" | awk '{print $1, $NF}' | head -30
    build-cuda/bin/voodoo-fixture --arch qwen3 --vocab "$D/llama/models/ggml-vocab-qwen2.gguf" \
        --n-embd 2048 --n-layer 4 --n-head 16 --n-head-kv 8 --head-dim 128 --n-ff 6144 --type bf16 --tied \
        -o /tmp/q3-4l.gguf > "$OUT/cand-rate/fixture.log" 2>&1
    build-cuda/bin/voodoo data --model /tmp/q3-4l.gguf --text "$D/data/text/wikitext-2-raw/wiki.valid.raw" --ctx 512 --out /tmp/q3-4l-data > /dev/null 2>&1
    build-cuda/bin/voodoo imatrix -m /tmp/q3-4l.gguf -d /tmp/q3-4l-data -o /tmp/q3-4l-im.gguf --chunks 8 --device cuda > "$OUT/cand-rate/imatrix.log" 2>&1
    build-cuda/bin/candidate_rate /tmp/q3-4l.gguf --imatrix /tmp/q3-4l-im.gguf --recipes ${RATE_RECIPES:-Q6_K,Q4_K_S,IQ4_XS,IQ2_XXS} \
        --scratch /tmp/cand-rate --out "$OUT/cand-rate/candidate-rate-qwen3-1.7b-4layers.json" 2>&1 | tee "$OUT/cand-rate/candidate-rate.log" | grep "^|"
    ;;
e2e-8b)
    # Issue #16: `voodoo quantize --device cuda` end to end on a synthetic model of Llama-3.1-8B's shape (32 layers,
    # the full 128,256-token vocabulary, BF16, its own head; random weights: speed, memory and disk only) at stock
    # Q4_K_M's size, beside stock Q4_K_M, both evaluated in libllama (CPU, 16 cores). MENU (default: the K-quants)
    # and PROBE_SEQ (default 2: the f32 probe of an 8B model is ≈ 1 s a forward per 4 sequences) set the rest;
    # E2E_ARGS adds flags (a short run: "--steps 20").
    log e2e llama3.1-8b shape
    mkdir -p "$OUT/e2e"
    build-cuda/bin/voodoo doctor 2>&1 | tee "$OUT/e2e/doctor.log" | grep -iE "backend|device|cuda" | head
    /usr/bin/time -v build-cuda/bin/voodoo-fixture --arch llama --vocab "$D/llama/models/ggml-vocab-llama-bpe.gguf" \
        --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --head-dim 128 --n-ff 14336 --type bf16 \
        --rope-freq-base 500000 -o /tmp/llama3-8b-shape.gguf > "$OUT/e2e/fixture-8b.log" 2>&1
    ls -la /tmp/llama3-8b-shape.gguf; df -h /tmp | tail -1
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 1000 > "$OUT/e2e/gpu-mem-8b.csv" 2>&1 &
    SMI=$!
    /usr/bin/time -v build-cuda/bin/voodoo quantize /tmp/llama3-8b-shape.gguf --text "$D/data/text/wikitext-2-raw/wiki.valid.raw" \
        --like Q4_K_M --baselines Q4_K_M --eval-text "$D/data/text/wikitext-2-raw/wiki.test.raw" --eval-chunks "${EVAL_CHUNKS:-4}" \
        --probe-anchors 2 --probe-sequences "${PROBE_SEQ:-2}" --menu "${MENU:-Q3_K,Q4_K,Q5_K,Q6_K,Q8_0}" \
        --speed-reps "${SPEED_REPS:-1}" ${E2E_ARGS:-} --device cuda --work /tmp/e2e-8b > "$OUT/e2e/llama3-8b.log" 2>&1
    kill $SMI
    grep -E "^== |in [0-9.]+s|Maximum resident|Elapsed|candidates for|candidates built" "$OUT/e2e/llama3-8b.log" | cut -c1-220 | tail -40
    du -sh /tmp/e2e-8b/* > "$OUT/e2e/disk-8b.txt" 2>&1; cat "$OUT/e2e/disk-8b.txt"
    cp /tmp/e2e-8b/times.json "$OUT/e2e/times-8b.json" 2>/dev/null
    cp /tmp/e2e-8b/eval.md "$OUT/e2e/llama3-8b-eval.md" 2>/dev/null; cp /tmp/e2e-8b/eval.json "$OUT/e2e/llama3-8b-eval.json" 2>/dev/null
    awk -F', ' '{gsub(/ MiB/, "", $2); if ($2 + 0 > m) m = $2 + 0} END {print "peak GPU memory used:", m, "MiB"}' "$OUT/e2e/gpu-mem-8b.csv"
    ;;
e2e-8b-defaults)
    # Issue #16's question at 8B: `voodoo quantize --device cuda` on the Llama-3.1-8B shape (the fixture of e2e-8b)
    # with every option at its default, as e2e-1.7b runs the 1.7B shape: the default menu, 8 probe sequences, the
    # probe's anchors, the eval's chunks and llama-bench runs auto. It takes longer than one session's device time, so
    # what it reaches is what is measured: every stage's line in the log as it ends, and every 10 s the candidate
    # cache's files and bytes (cache-8b.csv: the build's rate) and the GPU's memory.
    log e2e llama3.1-8b shape, every default
    rm -rf /tmp/e2e-17b* /tmp/e2e-8b
    mkdir -p "$OUT/e2e"
    fixture_8b
    ls -la /tmp/llama3-8b-shape.gguf; df -B1 /tmp | tee "$OUT/e2e/df-8b.txt"; free -b | tee -a "$OUT/e2e/df-8b.txt"
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 1000 > "$OUT/e2e/gpu-mem-8b.csv" 2>&1 &
    SMI=$!
    ( while sleep 10; do
        echo "$(date +%T),$(find /tmp/e2e-8b/candidates -type f 2>/dev/null | wc -l),$(du -sb /tmp/e2e-8b/candidates 2>/dev/null | cut -f1),$(df -B1 --output=avail /tmp | tail -1)"
      done ) > "$OUT/e2e/cache-8b.csv" 2>&1 &
    CACHE=$!
    vmstat -n -t 1 > "$OUT/e2e/vmstat-8b.txt" 2>&1 &
    VM=$!
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core" > "$OUT/e2e/cpu-8b.txt" 2>&1
    log "quantize starts (the vmstat samples' clock)"
    /usr/bin/time -v build-cuda/bin/voodoo quantize /tmp/llama3-8b-shape.gguf --text "$D/data/text/wikitext-2-raw/wiki.valid.raw" \
        --like Q4_K_M --baselines Q4_K_M --eval-text "$D/data/text/wikitext-2-raw/wiki.test.raw" --device cuda \
        --work /tmp/e2e-8b ${E2E_ARGS:-} > "$OUT/e2e/llama3-8b-defaults.log" 2>&1
    kill $SMI $CACHE $VM
    for f in sensitivity.json selection.json probe.eager.json probe.stage.json candidates.built.json; do
        cp /tmp/e2e-8b/run-*/$f "$OUT/e2e/8b-$f" 2>/dev/null
    done
    cp /tmp/e2e-8b/eval.json "$OUT/e2e/llama3-8b-eval.json" 2>/dev/null
    grep -E "^== |in [0-9.]+ ?s|Maximum resident|Elapsed|candidates for|built ahead|--probe-anchors auto|eval defaults|warning|error" \
        "$OUT/e2e/llama3-8b-defaults.log" | cut -c1-300 | tail -40
    du -sh /tmp/e2e-8b/* > "$OUT/e2e/disk-8b.txt" 2>&1; cat "$OUT/e2e/disk-8b.txt"
    cp /tmp/e2e-8b/times.json "$OUT/e2e/times-8b.json" 2>/dev/null
    cp /tmp/e2e-8b/eval.md "$OUT/e2e/llama3-8b-eval.md" 2>/dev/null
    ;;
dry-8b)
    # Issue #16 ("will it fit?"): the dry run of the default job on the Llama-3.1-8B shape (the fixture of e2e-8b;
    # every option at its default, as e2e-1.7b runs the 1.7B shape): its menus, candidates, disk verdict for the work
    # folder's file system, GPU memory and stage estimates. Frees the 1.7B run's files first so the disk is this
    # machine's as a fresh job would find it.
    log dry-run llama3.1-8b shape
    rm -rf /tmp/e2e-17b /tmp/qwen3-1.7b-shape.gguf
    mkdir -p "$OUT/e2e"
    fixture_8b
    df -B1 /tmp | tee "$OUT/e2e/df-8b.txt"; free -b | tee -a "$OUT/e2e/df-8b.txt"
    /usr/bin/time -v build-cuda/bin/voodoo quantize /tmp/llama3-8b-shape.gguf --text "$D/data/text/wikitext-2-raw/wiki.valid.raw" \
        --like Q4_K_M --baselines Q4_K_M --eval-text "$D/data/text/wikitext-2-raw/wiki.test.raw" --device cuda \
        --work /tmp/e2e-8b --dry-run --json "$OUT/e2e/dry-8b.json" > "$OUT/e2e/dry-8b.log" 2>&1
    grep -vE '^\s+(Command|User|System|Percent|Average|Major|Minor|Volun|Invol|Swaps|File|Socket|Signals|Page|Exit)' "$OUT/e2e/dry-8b.log" | tail -40
    ;;
bench-small)
    log bench qwen3-0.6b
    build-cuda/bin/train_step --shape qwen3-0.6b --min-blocks "${MIN_BLOCKS:-0}" --work /tmp/bench --json "$OUT/bench-qwen3-0.6b.json" 2>&1 | tee "$OUT/bench-qwen3-0.6b.log" | tail -8
    ;;
bench-large)
    log bench llama3-8b shape
    build-cuda/bin/train_step --shape llama3-8b --layers 4 --steps 3 --warmup 1 --work /tmp/bench --json "$OUT/bench-llama3-8b.json" 2>&1 | tee "$OUT/bench-llama3-8b.log" | tail -8
    ;;
bench-8b-full)
    # Issue #16: one training step of the Llama-3-8B shape with every layer (32) at batch × sequence = 8 × 2048, the
    # fused path and the dense reference each in its own process (the reference holds 6 dense bf16 copies of every
    # matrix: it may not fit, and its failure must not lose the fused figures).
    mkdir -p "$OUT/bench-8b"
    # BATCH=2 for a batch that fits (8 × 2048 ran out of the H200's memory on both paths: the saved activations of 32
    # layers at 16,384 tokens).
    # RECOMPUTE=1: activation checkpointing (train_step --recompute), which makes 8 × 2048 fit; PATHS: which paths.
    B=${BATCH:-8}
    R=${RECOMPUTE:+-recompute}
    for p in ${PATHS:-fused reference}; do
        log "bench llama3-8b, every layer, $B x 2048, $p${R}"
        build-cuda/bin/train_step --shape llama3-8b --batch $B --seq 2048 --steps 3 --warmup 1 --paths $p \
            --menu "${BENCH_MENU:-Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0}" ${RECOMPUTE:+--recompute} --work /tmp/bench \
            --json "$OUT/bench-8b/llama3-8b-L32-b$B-$p$R.json" 2>&1 \
            | tee "$OUT/bench-8b/llama3-8b-L32-b$B-$p$R.log" | grep -vE '^  (fused|reference) .* step|^frame|^/' | tail -6
    done
    ;;
kernels)
    # The fused kernels alone (bench/fused_kernels), per variant, and their registers and shared memory.
    log kernels
    build-cuda/bin/fused_kernels --json "$OUT/fused-kernels.json" 2>&1 | tee "$OUT/fused-kernels.md"
    cuobjdump -res-usage "$(find build-cuda -name 'gpu.cu.o' | head -1)" 2>&1 | c++filt | grep -A1 "Function" \
        | cut -c1-160 > "$OUT/kernel-resources.txt"; grep -A1 "tiled" "$OUT/kernel-resources.txt" | grep -o "REG:[0-9]* STACK:[0-9]*"
    # The fastest tiled variant here is what the later stages of this call run (MIN_BLOCKS).
    MIN_BLOCKS=$(python3 -c "import json; r=[x for x in json.load(open('$OUT/fused-kernels.json')) if x['kernels']!='rows']; \
b=min(r, key=lambda x: x['mixture_ms'] + x['gate_grad_ms']); print(b['kernels'].split(',')[1].split()[0])")
    export MIN_BLOCKS; log "fastest tiled variant: $MIN_BLOCKS blocks per SM"
    ;;
ncu)
    # Hardware counters for the tiled kernels (Nsight Compute; clocks left alone, as METHOD.md asks): occupancy,
    # warp stall reasons, issue slots and memory throughput of one mixture and one gate-gradient launch.
    log ncu
    ncu --clock-control none --kernel-name regex:tiled --launch-skip 6 --launch-count 2 \
        --section Occupancy --section SchedulerStats --section WarpStateStats --section SpeedOfLight \
        --section MemoryWorkloadAnalysis build-cuda/bin/fused_kernels --reps 1 > "$OUT/ncu-tiled.txt" 2>&1
    grep -E "Achieved Occupancy|Stall|Issue Slot|Memory Throughput|Compute \(SM\)|Warp Cycles" "$OUT/ncu-tiled.txt" | head -40
    ;;
profile)
    # One profiled step per path on the 8B shape's slice (PyTorch's profiler), summed by kernel.
    log profile llama3-8b shape
    build-cuda/bin/train_step --shape llama3-8b --layers 4 --steps 3 --warmup 1 --min-blocks "${MIN_BLOCKS:-0}" --work /tmp/bench \
        --profile /tmp/prof --json "$OUT/profile-llama3-8b.json" > "$OUT/profile-llama3-8b.log" 2>&1
    for t in /tmp/prof/trace-*.json; do
        python3 scripts/trace_summary.py "$t" --json "$OUT/$(basename "$t" .json)-summary.json" | tee -a "$OUT/profile-summary.md"
    done
    ;;
ladder-stories)
    # stories260K at every stock size (sizes that coincide are one rung), with the greedy peer, evaluated here.
    log ladder stories260K
    T=$D/data/text/tinystories/tinystories_val.txt; W=/tmp/storiesw
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p $W "$OUT/ladder"
    head -n $k "$T" > $W/calib.txt; tail -n +$((k + 1)) "$T" > $W/heldout.txt
    build-cuda/bin/voodoo quantize "$D/data/models/stories260K/stories260K.gguf" --text $W/calib.txt \
        --eval-text $W/heldout.txt --like "${STORIES_LADDER:-Q4_0,IQ3_M,Q3_K_L,Q4_1,Q5_0,Q4_K_S,Q4_K_M,Q5_1,Q5_K_M,Q6_K,Q8_0}" \
        --ctx 256 --eval-ctx 256 --baselines all-that-fit --greedy-peer --device cuda --work $W/work \
        --threads 16 --ggml-threads 16 > "$OUT/ladder/stories260K.log" 2>&1
    tail -5 "$OUT/ladder/stories260K.log"
    tar czf "$OUT/ladder/stories260K.tgz" -C $W/work eval.json eval.md curve.md curve.json probe.json \
        $(cd $W/work && ls -d run-*/{recipe,greedy.recipe,selection,sensitivity}.json run-*/log.jsonl 2>/dev/null)
    ;;
ladder-mix30M)
    # mix30M at the size of every stock recipe from IQ1_M to Q8_0, with the greedy peer; no eval here (the
    # recipes, imatrix and probe come back, and the same command on the CPU machine exports and evaluates,
    # with the same paths so the files are byte for byte the same).
    log ladder mix30M
    [ -f /tmp/mix30M.gguf ] || xz -dc .device-model/mix30M.gguf.xz > /tmp/mix30M.gguf
    W=/tmp/mixw; T=$D/data/text/tinystories/tinystories_val.txt
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p $W "$OUT/ladder"
    (cat "$D/data/text/wikitext-2-raw/wiki.valid.raw"; head -n $k "$T") > $W/calib.txt
    build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $W/calib.txt --eval-text $W/wiki.test.raw \
        --like "${MIX_LADDER:-IQ1_M,IQ2_XXS,IQ2_XS,IQ2_S,IQ2_M,IQ3_XXS,IQ3_XS,IQ3_S,IQ3_M,Q2_K_S,Q2_K,Q3_K_S,Q3_K_M,Q3_K_L,IQ4_XS,IQ4_NL,Q4_0,Q4_1,Q4_K_S,Q4_K_M,Q5_0,Q5_1,Q5_K_S,Q5_K_M,Q6_K,Q8_0}" \
        --ctx 512 --baselines none --greedy-peer --eval-chunks 0 --device cuda --work $W/work \
        --threads 16 --ggml-threads 16 ${MIX_FLAGS:-} > "$OUT/ladder/mix30M.log" 2>&1
    tail -5 "$OUT/ladder/mix30M.log"
    tar czf "$OUT/ladder/mix30M.tgz" -C $W/work imatrix.gguf probe.json \
        $(cd $W/work && ls -d run-*/{recipe,greedy.recipe,selection,sensitivity}.json run-*/log.jsonl 2>/dev/null)
    ;;
ladder-mix30M-eval)
    # The same ladder evaluated here (libllama on the machine's 16 cores, every stock recipe, 40 chunks of
    # wiki.test.raw), then bench/probe_anchors on its full probe, and the ladder again with --probe-anchors 2
    # (the selection's validation KL of each size, against the full probe's).
    log ladder mix30M with eval
    [ -f /tmp/mix30M.gguf ] || xz -dc .device-model/mix30M.gguf.xz > /tmp/mix30M.gguf
    W=/tmp/mixw; T=$D/data/text/tinystories/tinystories_val.txt
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p $W "$OUT/ladder"
    (cat "$D/data/text/wikitext-2-raw/wiki.valid.raw"; head -n $k "$T") > $W/calib.txt
    cp "$D/data/text/wikitext-2-raw/wiki.test.raw" $W/
    L="${MIX_LADDER:-IQ1_M,IQ2_XXS,IQ2_XS,IQ2_S,IQ2_M,IQ3_XXS,IQ3_XS,IQ3_S,IQ3_M,Q2_K_S,Q2_K,Q3_K_S,Q3_K_M,Q3_K_L,IQ4_XS,IQ4_NL,Q4_0,Q4_1,Q4_K_S,Q4_K_M,Q5_0,Q5_1,Q5_K_S,Q5_K_M,Q6_K,Q8_0}"
    build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $W/calib.txt --eval-text $W/wiki.test.raw --like "$L" \
        --ctx 512 --baselines all-that-fit --greedy-peer --eval-chunks 40 --device cuda --work $W/work \
        --threads 16 --ggml-threads 16 > "$OUT/ladder/mix30M.log" 2>&1
    tail -3 "$OUT/ladder/mix30M.log"
    log probe anchors
    build-cuda/bin/probe_anchors /tmp/mix30M.gguf --imatrix $W/work/imatrix.gguf --probe $W/work/probe.json \
        --cache $W/work/candidates --threads 16 --out "$OUT/ladder/anchors-mix30M.json" > "$OUT/ladder/anchors-mix30M.log" 2>&1
    tail -8 "$OUT/ladder/anchors-mix30M.log"
    log ladder mix30M, anchored probe
    build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $W/calib.txt --like "${ANCHORED_LADDER:-IQ2_M,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K}" --probe-anchors 2 \
        --ctx 512 --baselines none --eval-chunks 0 --device cuda --work $W/anchored \
        --threads 16 --ggml-threads 16 > "$OUT/ladder/mix30M-anchored.log" 2>&1
    tail -3 "$OUT/ladder/mix30M-anchored.log"
    tar czf "$OUT/ladder/mix30M.tgz" -C $W work/imatrix.gguf work/probe.json anchored/probe.json \
        $(cd $W && ls -d work/{curve,eval}.* work/run-*/{recipe,greedy.recipe,selection}.json anchored/run-*/selection.json 2>/dev/null)
    ;;
probe-tf32)
    # Issue #16: the probe's f32 products on the tensor cores (--probe-compute tf32) against f32. (1) On mix30M's
    # learned weights (unpacked into /tmp/mix30M.gguf by an earlier call), every candidate of every default-menu type
    # probed both ways (--candidates all --probe-anchors 0, the same imatrix), compared by bench/probe_anchors --against
    # (|ln(tf32 / f32)| per type; the exact knapsack on the TF32 values, measured with the f32 ones, at 40 budgets),
    # and the files of three sizes trained and selected from each probe, evaluated on 40 chunks of wiki.test.raw.
    # (2) The eager probe's time on the Qwen3-1.7B shape both ways: the default job (every default but the probe's
    # arithmetic) run until its log says "the eager probe in", then stopped.
    log probe tf32
    mkdir -p "$OUT/tf32"
    if [ -f /tmp/mix30M.gguf ]; then
        W=/tmp/tf32; mkdir -p $W; T=$D/data/text/wikitext-2-raw/wiki.valid.raw
        for p in f32 tf32; do
            build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $T --eval-text $D/data/text/wikitext-2-raw/wiki.test.raw \
                --like IQ2_M,Q4_K_M,Q6_K --candidates all --probe-anchors 0 --probe-compute $p --baselines none \
                --eval-chunks 40 --speed-reps 0 --device cuda --work $W/$p \
                $([ $p = tf32 ] && echo --imatrix $W/f32/imatrix.gguf) > "$OUT/tf32/mix30M-$p.log" 2>&1
            grep -E "^== times|selection on|probe in|in [0-9.]+ s" "$OUT/tf32/mix30M-$p.log" | cut -c1-220 | tail -12
            cp $W/$p/probe.json "$OUT/tf32/mix30M-probe-$p.json"; cp $W/$p/eval.md "$OUT/tf32/mix30M-eval-$p.md" 2>/dev/null
            for r in $W/$p/run-*/selection.json; do cp $r "$OUT/tf32/mix30M-$p-$(basename $(dirname $r))-selection.json"; done
        done
        build-cuda/bin/probe_anchors /tmp/mix30M.gguf --imatrix $W/f32/imatrix.gguf --probe $W/f32/probe.json \
            --against $W/tf32/probe.json --cache $W/f32/candidates --anchors 2 --threads 16 \
            --out "$OUT/tf32/against-mix30M.json" > "$OUT/tf32/against-mix30M.log" 2>&1
        head -30 "$OUT/tf32/against-mix30M.log"
        rm -rf $W
    else
        log "no /tmp/mix30M.gguf (send .device-model and unpack it first): part 1 skipped"
    fi
    rm -rf /tmp/e2e-17b*
    [ -f /tmp/qwen3-1.7b-shape.gguf ] || build-cuda/bin/voodoo-fixture --arch qwen3 --vocab "$D/llama/models/ggml-vocab-qwen2.gguf" \
        --n-embd 2048 --n-layer 28 --n-head 16 --n-head-kv 8 --head-dim 128 --n-ff 6144 --type bf16 --tied \
        -o /tmp/qwen3-1.7b-shape.gguf > "$OUT/tf32/fixture-1.7b.log" 2>&1
    for p in f32 tf32; do
        L="$OUT/tf32/qwen3-1.7b-probe-$p.log"
        build-cuda/bin/voodoo quantize /tmp/qwen3-1.7b-shape.gguf --text "$D/data/text/wikitext-2-raw/wiki.valid.raw" \
            --like Q4_K_M --baselines Q4_K_M --eval-text "$D/data/text/wikitext-2-raw/wiki.test.raw" --device cuda \
            --work /tmp/e2e-17b-$p --probe-compute $p > "$L" 2>&1 &
        PID=$!
        while kill -0 $PID 2>/dev/null && ! grep -qE "the eager probe in|eager candidates probed as" "$L"; do sleep 1; done
        kill -INT $PID 2>/dev/null; wait $PID
        grep -E "^== |eager|built ahead" "$L" | cut -c1-200
        rm -rf /tmp/e2e-17b-$p
    done
    ;;
ablations)
    # mix30M at three sizes, one change each against the ladder's defaults: training in f32, no CE term,
    # the probe in bf16 (as before the f32 probe). Data, imatrix and candidates are the ladder's.
    log ablations
    W=/tmp/mixw
    for a in "f32:--compute f32" "noce:--lambda-ce 0" "probebf16:--probe-compute bf16"; do
        name=${a%%:*}; flags=${a#*:}; A=$W/abl-$name; mkdir -p $A
        cp -r $W/work/data $W/work/imatrix.gguf $A/ 2>/dev/null; ln -sfn $W/work/candidates $A/candidates
        mkdir -p $A/baselines; cp $W/work/baselines/*.gguf $A/baselines/ 2>/dev/null
        [ "$name" = probebf16 ] || cp $W/work/probe.json $A/
        build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $W/calib.txt --eval-text $W/wiki.test.raw \
            --like IQ2_M,Q4_K_M,Q6_K --ctx 512 --baselines none --eval-chunks 0 --device cuda --work $A \
            --threads 16 --ggml-threads 16 $flags > "$OUT/ladder/abl-$name.log" 2>&1
        tail -2 "$OUT/ladder/abl-$name.log"
    done
    tar czf "$OUT/ladder/ablations.tgz" -C $W $(cd $W && ls -d abl-*/probe.json abl-*/run-*/{recipe,selection}.json abl-*/run-*/log.jsonl 2>/dev/null)
    ;;
learning)
    # Can the gates learn past the probe's allocation? mix30M at five sizes, the gates freer than the defaults
    # (gate-init 3, lr 0.05), in f32 and in bf16; selection.json holds each candidate recipe's validation KL.
    log learning
    [ -f /tmp/mix30M.gguf ] || xz -dc .device-model/mix30M.gguf.xz > /tmp/mix30M.gguf
    W=/tmp/mixl; T=$D/data/text/tinystories/tinystories_val.txt
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p $W "$OUT/learning"
    [ -f $W/calib.txt ] || (cat "$D/data/text/wikitext-2-raw/wiki.valid.raw"; head -n $k "$T") > $W/calib.txt
    first=""
    for a in "f32-g1:--compute f32 --gate-init 1 --lr 0.25" "f32-g0:--compute f32 --gate-init 0 --lr 0.25" \
             "bf16-g1:--compute bf16 --gate-init 1 --lr 0.25"; do
        name=${a%%:*}; flags=${a#*:}; A=$W/$name; mkdir -p $A
        if [ -n "$first" ]; then
            cp -r $first/data $first/imatrix.gguf $first/probe.json $A/; ln -sfn $first/candidates $A/candidates
            mkdir -p $A/baselines; cp $first/baselines/*.gguf $A/baselines/
        fi
        build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $W/calib.txt --eval-text $W/calib.txt \
            --like IQ2_M,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K --ctx 512 --baselines none --eval-chunks 0 --device cuda --work $A \
            --threads 16 --ggml-threads 16 $flags > "$OUT/learning/$name.log" 2>&1
        grep "selection on" "$OUT/learning/$name.log" | cut -c1-200
        first=${first:-$A}
    done
    tar czf "$OUT/learning/learning.tgz" -C $W $(cd $W && ls -d */run-*/{recipe,selection}.json */run-*/log.jsonl 2>/dev/null)
    ;;
ptqr)
    # Issue #22: mixing against per-token quant routing (PTQR) on mix30M at the sizes of IQ2_M, Q4_K_M and Q6_K, at
    # the defaults (equal steps), with freer gates (gate-init 1, lr 0.25), and at the method's published settings
    # (50 steps, lr 0.25, λ_KL 2, λ_size 100, tolerance 0.02, sequences of 512). Data, imatrix, candidates and probe
    # are the first run's; every Voodoo file is evaluated on 40 chunks of wiki.test.raw, every stock recipe once (the
    # first run); selection.json holds each candidate recipe's validation KL, the trained one among them.
    log ptqr
    [ -f /tmp/mix30M.gguf ] || xz -dc .device-model/mix30M.gguf.xz > /tmp/mix30M.gguf
    W=/tmp/mixp; T=$D/data/text/tinystories/tinystories_val.txt
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p $W "$OUT/ptqr"
    [ -f $W/calib.txt ] || (cat "$D/data/text/wikitext-2-raw/wiki.valid.raw"; head -n $k "$T") > $W/calib.txt
    cp "$D/data/text/wikitext-2-raw/wiki.test.raw" $W/
    PUB="--steps 50 --lr 0.25 --lambda-kl 2 --lambda-size 100 --size-tol 0.02 --gate-init 1"
    first=""
    for a in "mix:" "ptqr:--routing ptqr" "mix-free:--gate-init 1 --lr 0.25" "ptqr-free:--routing ptqr --gate-init 1 --lr 0.25" \
             "mix-pub:$PUB" "ptqr-pub:--routing ptqr $PUB"; do
        name=${a%%:*}; flags=${a#*:}; A=$W/$name; mkdir -p $A
        base="--baselines none"
        if [ -n "$first" ]; then
            cp -r $first/data $first/imatrix.gguf $first/probe.json $A/; ln -sfn $first/candidates $A/candidates
        else
            base="--baselines all-that-fit"
        fi
        /usr/bin/time -f "$name: %e s, max RSS %M KB" build-cuda/bin/voodoo quantize /tmp/mix30M.gguf --text $W/calib.txt \
            --eval-text $W/wiki.test.raw --like IQ2_M,Q4_K_M,Q6_K --ctx 512 --eval-ctx 512 --eval-chunks 40 $base \
            --device cuda --work $A --threads 16 --ggml-threads 16 $flags > "$OUT/ptqr/$name.log" 2>&1
        tail -1 "$OUT/ptqr/$name.log"
        for r in $A/run-*/selection.json; do
            python3 -c "import json; print('$name', '$r'.split('/')[-2], ' '.join(e['recipe'].split('/')[-2] + '=' + format(e['val_kl'], '.4e') if '/' in e['recipe'] else e['recipe'] + '=' + format(e['val_kl'], '.4e') for e in json.load(open('$r'))))"
        done
        first=${first:-$A}
    done
    tar czf "$OUT/ptqr/ptqr.tgz" -C $W $(cd $W && ls -d */eval.json */eval.md */curve.json */run-*/{recipe,selection}.json */run-*/log.jsonl 2>/dev/null)
    ;;
bench-qwen35)
    # Issue #15: one training step on Qwen3.5-0.8B's shape (qwen35, every layer, its real vocabulary), 2,048 tokens,
    # fused and reference paths, mixing and PTQR.
    log bench qwen35-0.8b shape
    build-cuda/bin/train_step --shape qwen35-0.8b --routing mix,ptqr --work /tmp/bench --json "$OUT/bench-qwen35-0.8b.json" 2>&1 \
        | tee "$OUT/bench-qwen35-0.8b.log" | tail -8
    ;;
delta)
    # Issue #15 after the affine state passing (session 10): the delta rule alone, a qwen35 step (fused and
    # reference, mixing) beside the Qwen3-0.6B shape, and one profiled qwen35 step's kernel count.
    log delta rule
    build-cuda/bin/delta_rule --benchmark_min_time=1 2>&1 | tee "$OUT/delta-rule.log" | tail -4
    build-cuda/bin/train_step --shape qwen35-0.8b --routing mix --work /tmp/bench --json "$OUT/bench-qwen35-0.8b.json" 2>&1 \
        | tee "$OUT/bench-qwen35-0.8b.log" | tail -5
    build-cuda/bin/train_step --shape qwen3-0.6b --paths fused --routing mix --work /tmp/bench06 --json "$OUT/bench-qwen3-0.6b.json" 2>&1 \
        | tee "$OUT/bench-qwen3-0.6b.log" | tail -3
    build-cuda/bin/train_step --shape qwen35-0.8b --paths fused --steps 2 --warmup 1 --work /tmp/bench --profile /tmp/prof \
        > "$OUT/profile-qwen35.log" 2>&1
    python3 scripts/trace_summary.py /tmp/prof/*.json > "$OUT/profile-qwen35-summary.md" 2>&1; head -14 "$OUT/profile-qwen35-summary.md"
    ;;
moe)
    # Issue #18: qwen3moe and qwen35moe fixtures end to end with --device cuda (the LibTorch imatrix counts each
    # expert's tokens, the fused mixture works on 3-D candidates), then one training step on a Qwen3-30B-A3B-shaped
    # slice (2 of its 48 layers, every expert, its vocabulary), fused and reference paths, GPU-resident candidates.
    log moe e2e
    T=$D/data/text/tinystories/tinystories_val.txt
    n=$(wc -l < "$T"); k=$((n * 4 / 5)); mkdir -p "$OUT/moe"
    head -n $k "$T" > /tmp/calib.txt; tail -n +$((k + 1)) "$T" > /tmp/heldout.txt
    F=build-cuda/bin/voodoo-fixture
    $F --arch qwen3moe --vocab "$D/llama/models/ggml-vocab-qwen2.gguf" --type bf16 --n-embd 512 --n-layer 4 \
        --n-head 8 --n-head-kv 2 --head-dim 64 --n-ff 1536 --n-expert 32 --n-expert-used 4 --n-ff-exp 256 \
        -o /tmp/qwen3moe.gguf > /dev/null 2>&1
    $F --arch qwen35moe --vocab "$D/llama/models/ggml-vocab-qwen35.gguf" --type bf16 --tied --n-embd 512 --n-layer 4 \
        --n-head 8 --n-head-kv 2 --head-dim 64 --n-ff 1536 --full-attention-interval 2 --ssm-d-state 64 \
        --n-expert 32 --n-expert-used 4 --n-ff-exp 256 --n-ff-shexp 512 -o /tmp/qwen35moe.gguf > /dev/null 2>&1
    for m in qwen3moe qwen35moe; do
        log "moe e2e $m"
        /usr/bin/time -v build-cuda/bin/voodoo quantize /tmp/$m.gguf --text /tmp/calib.txt --eval-text /tmp/heldout.txt \
            --like Q4_K_M --baselines Q3_K_M,Q4_K_M --device cuda --work /tmp/e2e-$m --threads 16 --ggml-threads 8 \
            > "$OUT/moe/$m.log" 2>&1
        grep -A6 'experts the calibration' "$OUT/moe/$m.log"; tail -8 "$OUT/moe/$m.log"
        for f in eval.json eval.md experts.json times.json; do cp /tmp/e2e-$m/$f "$OUT/moe/$m-$f" 2>/dev/null; done
        build-cuda/bin/voodoo check-parity /tmp/$m.gguf --tokens 256 > "$OUT/moe/$m-parity.txt" 2>&1; tail -4 "$OUT/moe/$m-parity.txt"
    done
    ;&
moe-step)
    # The Qwen3-30B-A3B-shaped step, with the experts' products grouped (one batched product per tensor) and per expert.
    mkdir -p "$OUT/moe"
    for p in grouped per-expert; do
        log "moe step qwen3-30b-a3b ($p)"
        build-cuda/bin/train_step --shape qwen3-30b-a3b --layers 2 --menu Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0 --work /tmp/bench \
            --expert-products $p --json "$OUT/moe/bench-qwen3-30b-a3b-L2-$p.json" 2>&1 \
            | tee "$OUT/moe/bench-qwen3-30b-a3b-L2-$p.log" | tail -4
    done
    ;;
moe-host)
    # Issue #18: the Qwen3-30B-A3B-shaped step with the candidates resident on the GPU (fused) and in pinned host
    # memory, each layer's moved to the GPU ahead of use (fused-host), at 1 × 2048 and 2 × 2048 tokens; then a short
    # sequence, where some experts get no token and only the routed experts' mixture is formed.
    mkdir -p "$OUT/moe"
    for b in 1 2; do
        log "moe step qwen3-30b-a3b, 4 layers, batch $b × 2048: GPU-resident and host-resident candidates"
        build-cuda/bin/train_step --shape qwen3-30b-a3b --layers 4 --batch $b --seq 2048 --menu Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0 \
            --work /tmp/bench --paths fused,fused-host --json "$OUT/moe/bench-qwen3-30b-a3b-L4-b$b-host.json" 2>&1 \
            | tee "$OUT/moe/bench-qwen3-30b-a3b-L4-b$b-host.log" | tail -5
        free -g | head -2
    done
    log "moe step qwen3-30b-a3b, 4 layers, 1 × 64 tokens (routed experts only)"
    build-cuda/bin/train_step --shape qwen3-30b-a3b --layers 4 --batch 1 --seq 64 --menu Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0 \
        --work /tmp/bench --paths fused,fused-host --json "$OUT/moe/bench-qwen3-30b-a3b-L4-s64.json" 2>&1 \
        | tee "$OUT/moe/bench-qwen3-30b-a3b-L4-s64.log" | tail -5
    ;;
*)
    echo "unknown stage $stage"; exit 2 ;;
esac
done
log done
