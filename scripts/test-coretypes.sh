#!/usr/bin/env bash
# Runs the ctest suite once per OpenBLAS kernel family this CPU can execute, so that a float bound tuned
# on one kernel's summation order shows up before a submission that touches numerics does.
#   Prescott (SSE3) always; Haswell and Zen where /proc/cpuinfo has avx2; SkylakeX where it has avx512f;
#   Cooperlake where it has avx512_bf16 (what OpenBLAS picks by itself on such a CPU).
# OPENBLAS_CORETYPE is set for every run (whatever the environment held); OPENBLAS_L2_SIZE and the rest of
# the environment are left as they are. Each run is checked to load the asked kernel (OPENBLAS_VERBOSE=2).
#
# Usage: scripts/test-coretypes.sh [-b BUILD_DIR] [-n REPEAT] [-R REGEX] [-j JOBS] [-c CORE,CORE...]
#   -b  build folder holding the ctest suite (default build)
#   -n  ctest --repeat until-fail:N (default 3)
#   -R  only the tests whose name matches REGEX (ctest -R)
#   -j  ctest parallel jobs (default nproc)
#   -c  these coretypes instead of the detected list
# Prints one summary line per coretype; exits 1 when any run failed (2 on a usage error).
set -uo pipefail
cd "$(dirname "$0")/.."

build=build
repeat=3
regex=
jobs=$(nproc)
cores=
while getopts "b:n:R:j:c:h" opt; do
    case "$opt" in
        b) build=$OPTARG ;;
        n) repeat=$OPTARG ;;
        R) regex=$OPTARG ;;
        j) jobs=$OPTARG ;;
        c) cores=${OPTARG//,/ } ;;
        *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
done
if [ ! -f "$build/CTestTestfile.cmake" ]; then
    echo "test-coretypes: $build has no ctest suite: build first (cmake -S . -B $build -G Ninja && cmake --build $build)" >&2
    exit 2
fi
if [ -z "$cores" ]; then
    flags=$(grep -m1 '^flags' /proc/cpuinfo)
    has() { [[ " $flags " == *" $1 "* ]]; }
    cores=Prescott
    if has avx2; then cores+=" Haswell Zen"; fi
    if has avx512f; then cores+=" SkylakeX"; fi
    if has avx512_bf16; then cores+=" Cooperlake"; fi
fi
tests_bin=$(find "$build" -name voodoo_tests -type f -perm -u+x | head -1)
logs=$(mktemp -d /tmp/test-coretypes-XXXXXX)
echo "test-coretypes: cores: $cores; repeat until-fail:$repeat; ${regex:+tests matching '$regex'; }OPENBLAS_L2_SIZE=${OPENBLAS_L2_SIZE:-unset}; logs in $logs"

failed=0
summary=()
for core in $cores; do
    # The kernel OpenBLAS loads for this name: it falls back to the detected one, silently but for this line.
    if [ -n "$tests_bin" ]; then
        loaded=$(OPENBLAS_VERBOSE=2 OPENBLAS_CORETYPE=$core "$tests_bin" --gtest_list_tests 2>&1 | sed -n 's/^Core: //p' | head -1)
        if [ "$loaded" != "$core" ]; then
            summary+=("$core: NOT RUN (OpenBLAS loaded '${loaded:-?}' instead)")
            failed=1
            continue
        fi
    fi
    log=$logs/$core.log
    args=(--test-dir "$build" --output-on-failure -j "$jobs" --repeat "until-fail:$repeat")
    if [ -n "$regex" ]; then args+=(-R "$regex"); fi
    start=$SECONDS
    OPENBLAS_CORETYPE=$core ctest "${args[@]}" > "$log" 2>&1
    rc=$?
    result=$(grep -E '^[0-9]+% tests passed' "$log" | tail -1)
    line="$core: ${result:-no ctest summary (exit $rc)} ($((SECONDS - start)) s)"
    if [ "$rc" != 0 ]; then
        failed=1
        line+="; failed: $(sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) (.*/\1/p' "$log" | sort -u | tr '\n' ' ')"
    fi
    summary+=("$line")
    echo "$line"
done

echo "== test-coretypes summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
