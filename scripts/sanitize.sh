#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The C++ tests under sanitizers (CUDA left out):
#   address  build/asan, ASan and UBSan: every ctest test but the GPU ones, the end-to-end
#            tests with the instrumented trainstreamd they start;
#   thread   build/tsan, TSan: the tests whose code shares memory across threads through
#            atomics and std:: primitives (the doorbell ring, fd passing, the AdamW
#            kernels' threads).
# Code that locks with absl::Mutex runs under ASan here, not under TSan: Debian's abseil is not
# built with TSan, whose reports would then be about the uninstrumented mutex, not our code.
#   scripts/sanitize.sh [address|thread|all]   (default all)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
mkdir -p build
configure() {  # build dir, sanitizers
  [[ -f $1/build.ninja ]] && return 0
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRAINSTREAM_SANITIZE="$2" \
    -DTRAINSTREAM_WERROR=ON > "$1.configure.log" 2>&1 || { tail -30 "$1.configure.log"; exit 1; }
}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if [[ $what == address || $what == all ]]; then
  echo "== ASan + UBSan: build (build/asan)"
  configure build/asan address,undefined
  ninja -C build/asan -j "$jobs" > build/asan/ninja.log 2>&1 \
    || { tail -40 build/asan/ninja.log; exit 1; }
  echo "== ASan + UBSan: ctest"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1 \
    ctest --test-dir build/asan --output-on-failure -j "$jobs" -LE gpu
fi
if [[ $what == thread || $what == all ]]; then
  echo "== TSan: build (build/tsan)"
  configure build/tsan thread
  tsan_tests=(trainstream_ipc_test adamw_kernel_test)
  ninja -C build/tsan -j "$jobs" "${tsan_tests[@]}" > build/tsan/ninja.log 2>&1 \
    || { tail -40 build/tsan/ninja.log; exit 1; }
  echo "== TSan: ${tsan_tests[*]}"
  for t in "${tsan_tests[@]}"; do
    bin=$(find build/tsan -name "$t" -type f -perm -u+x | head -1)
    TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 "$bin" --gtest_brief=1
  done
fi
