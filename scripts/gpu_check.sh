#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine (see ../shared/device/README.md): build with the carried .devdeps, run every
# GPU test (ctest -L gpu, pytest -m gpu) and the GPU benchmarks. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ts-gpu-out}
mkdir -p "$OUT"
source .devdeps/prelude.sh
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90"
export CMAKE_BUILD_PARALLEL_LEVEL=16
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pip install -q --no-build-isolation --no-deps --no-index . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
BIN=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
export PATH="$BIN:$PATH"
status=0
ctest --test-dir build/py --output-on-failure -j8 > "$OUT/ctest_all.log" 2>&1 || status=1
ctest --test-dir build/py -L gpu --output-on-failure > "$OUT/ctest_gpu.log" 2>&1 || status=1
python3 -m pytest -ra -m gpu tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
python3 -m pytest -ra -m "not gpu" tests/e2e > "$OUT/pytest_cpu.log" 2>&1 || status=1
./build/py/bench/control_latency_bench --iterations=20000 > "$OUT/latency.txt" 2>&1 || status=1
python3 bench/h2d_bandwidth.py --gib 1 --repeats 20 --json "$OUT/h2d_bandwidth.json" \
  > "$OUT/h2d_bandwidth.txt" 2>&1 || status=1
echo "== summary"
cat "$OUT/gpu.txt"
tail -3 "$OUT/ctest_all.log"; tail -3 "$OUT/ctest_gpu.log"
tail -3 "$OUT/pytest_gpu.log"; tail -3 "$OUT/pytest_cpu.log"
cat "$OUT/latency.txt" "$OUT/h2d_bandwidth.txt"
exit $status
