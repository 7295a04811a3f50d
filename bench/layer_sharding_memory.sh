#!/usr/bin/env bash
# Host memory of layer sharding (issue #17): `voodoo train` on a synthetic llama (8 layers of 1024, FFN 2816, the
# llama-spm vocabulary of 32,000, untied head, bf16: 155 M weights; random weights, so speed and memory only) as one
# process, then as two Gloo ranks with --parallel layers on this host, each under /usr/bin/time -v. Prints each
# process's peak resident set, wall time and what each rank read and held, and checks that the two runs' probe and
# recipe are the same bytes. Results: docs/BENCHMARKS.md ("Layer sharding's host memory").
#   bench/layer_sharding_memory.sh [WORK_DIR]     (default /tmp/voodoo-layer-sharding; needs build/bin from `make`)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/voodoo-layer-sharding}
bin=$root/build/bin
mkdir -p "$work" && cd "$work"
[ -f syn.gguf ] || "$bin/voodoo-fixture" --vocab "$root/.deps/llama.cpp/models/ggml-vocab-llama-spm.gguf" --n-embd 1024 \
    --n-layer 8 --n-head 16 --n-head-kv 4 --head-dim 64 --n-ff 2816 --type bf16 -o syn.gguf > /dev/null 2>&1
[ -f t.txt ] || head -c 200000 "$root/../shared/data/text/tinystories/tinystories_val.txt" > t.txt
[ -d d ] || "$bin/voodoo" data --model syn.gguf --text t.txt --ctx 128 --val-fraction 0.1 --out d > /dev/null 2>&1
args="train --model syn.gguf --data d --ratio 0.6 --menu Q4_K,Q6_K,Q8_0 --steps 4 --batch 1 --seq 64 --probe-sequences 1 --select-sequences 1 -t 1"
export VOODOO_PROGRESS=0
rm -rf one two
env -u WORLD_SIZE /usr/bin/time -v "$bin/voodoo" $args --out one > one.log 2>&1
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
RANK=1 /usr/bin/time -v "$bin/voodoo" $args --out two --parallel layers > rank1.log 2>&1 &
RANK=0 /usr/bin/time -v "$bin/voodoo" $args --out two --parallel layers > rank0.log 2>&1
wait
for f in one.log rank0.log rank1.log; do
    echo "== $f"
    grep -E 'Maximum resident|Elapsed \(wall|rank . of 2: (read|candidates in host|layers)|candidates: rank' "$f" || true
done
cmp one/probe.json two/probe.json && echo "probe.json: the same bytes"
cmp one/recipe.json two/recipe.json && echo "recipe.json: the same bytes"
