#!/usr/bin/env bash
# Installs what Voodoo needs on Debian 12, and does nothing that is already done:
#   - Debian packages (only the missing ones; apt-get update only when something is missing)
#   - the pinned llama.cpp npm packages (npm ci, only when the lock file changed)
# The llama.cpp headers are taken from the package's source bundle by CMake (cmake/llama.cmake).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
    cmake ninja-build g++ make git pkg-config
    libtorch-dev libopenblas0-pthread libgloo-dev
    nlohmann-json3-dev libcli11-dev libfmt-dev libxxhash-dev libssl-dev
    libgtest-dev libgmock-dev libbenchmark-dev
    gnuplot-nox
)

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
# Node.js and npm only when there is no npm at all: a machine may have them from elsewhere (NodeSource),
# and Debian's npm package conflicts with those.
if ! command -v npm >/dev/null 2>&1; then
    missing+=(nodejs npm)
fi
if ((${#missing[@]})); then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    sudo_cmd=()
    if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi

# npm ci only when node_modules is missing or older than the lock file.
stamp=node_modules/.package-lock.json
if [ ! -f "$stamp" ] || [ package-lock.json -nt "$stamp" ] \
   || [ ! -f node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/libllama.v0.4.0.so ]; then
    echo "bootstrap: npm ci (node-llama-cpp@3.21.1, @node-llama-cpp/linux-x64@3.21.1)"
    npm ci --ignore-scripts --omit=optional --no-audit --no-fund --loglevel=error
    touch "$stamp"
fi
