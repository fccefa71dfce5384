#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README command 2: set up (Debian packages, the Python environment), build, and run every test:
# GoogleTest through ctest, then pytest (GPU tests skip with a reason where no GPU is present),
# then the C++ tests under sanitizers and the fuzz targets' short runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# Formatting and lint first: seconds, and a failure names the file and line.
bash scripts/lint.sh
VENV=${TRAINSTREAM_VENV:-/opt/trainstream/venv}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
# The tests build with warnings as errors (a user's build only shows them).
export CMAKE_ARGS="${CMAKE_ARGS:-} -DTRAINSTREAM_WERROR=ON"
echo "== build (pip install . drives CMake; build tree: build/py)"
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps .
echo "== ctest"
ctest --test-dir build/py --output-on-failure -j2
echo "== pytest"
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -ra tests "$@"
# The C++ tests again under ASan/UBSan and TSan, then each fuzz target's short run.
bash scripts/sanitize.sh
echo "== fuzz (libFuzzer, clang, ASan + UBSan; 20 s a target)"
bash scripts/fuzz.sh 20
