#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets of tests/fuzz with clang, ASan and UBSan (build tree build/fuzz)
# and runs each for SECONDS (default 20: the short version CI runs) from its seed corpus in
# tests/fuzz/corpus/<target>/, printing the executions and whether anything crashed. New inputs
# the fuzzer finds go to a scratch folder, not into the repo; a crash leaves its input in
# build/fuzz/crashes/<target>/ and fails the script.
#   scripts/fuzz.sh [SECONDS] [TARGET...]      e.g. scripts/fuzz.sh 600 (the long version)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
shift || true
targets=("$@")
((${#targets[@]})) \
  || targets=(safetensors_fuzz checkpoint_fuzz request_validation_fuzz doorbell_fuzz)
build=build/fuzz
mkdir -p build
if [[ ! -f $build/build.ninja ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTRAINSTREAM_FUZZ=ON \
    -DTRAINSTREAM_BUILD_TESTS=OFF > "$build.configure.log" 2>&1 \
    || { tail -30 "$build.configure.log"; exit 1; }
fi
ninja -C "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" "${targets[@]}" > "$build/ninja.log" 2>&1 \
  || { tail -40 "$build/ninja.log"; exit 1; }
status=0
printf '%-26s %12s %10s %8s  %s\n' target executions "exec/s" seconds result
for t in "${targets[@]}"; do
  scratch=$(mktemp -d)
  crashes="$build/crashes/$t"
  mkdir -p "$crashes"
  log="$build/$t.log"
  # -rss_limit_mb: each input is small; a leak or a runaway allocation shows as a failure.
  if "$build/tests/fuzz/$t" -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 \
      -timeout=10 -artifact_prefix="$crashes/" "$scratch" "tests/fuzz/corpus/$t" > "$log" 2>&1; then
    result=ok
  else
    result="FAILED (input and log: $crashes, $log)"
    status=1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  printf '%-26s %12s %10s %8s  %s\n' "$t" "${runs:-?}" "${speed:-?}" "$seconds" "$result"
  rm -rf "$scratch"
done
exit $status
