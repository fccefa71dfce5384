#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# README command 1: set up, build, start trainstreamd, train a small model through it, and show
# `tsctl status`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${TRAINSTREAM_VENV:-/opt/trainstream/venv}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
# Built as command 2 builds it (warnings as errors), so that running both rebuilds nothing.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DTRAINSTREAM_WERROR=ON"
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps .
export PATH="$VENV/bin:$PATH"
run_dir=$(mktemp -d /tmp/trainstream-demo.XXXXXX)
export TRAINSTREAM_SOCKET="$run_dir/trainstreamd.sock"
trainstreamd --memory_budget=2G >"$run_dir/trainstreamd.log" 2>&1 &
daemon_pid=$!
trap 'kill -TERM $daemon_pid 2>/dev/null; wait $daemon_pid 2>/dev/null; rm -rf "$run_dir"' EXIT
for _ in $(seq 100); do tsctl status >/dev/null 2>&1 && break; sleep 0.1; done
# Train, keeping the session open a few seconds afterwards so tsctl can show it.
python examples/train_gpt.py --hold-seconds 4 | tee "$run_dir/train.log" &
train_pid=$!
until grep -q "steps in" "$run_dir/train.log" 2>/dev/null; do
  kill -0 $train_pid 2>/dev/null || break
  sleep 0.2
done
echo
tsctl status
echo
tsctl sessions
echo
tsctl optimizers
wait $train_pid
echo
tsctl events | tail -n 6
