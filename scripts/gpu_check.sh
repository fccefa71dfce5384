#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: GPU checks as suites named by feature. Logs and JSON go to $OUT.
#   scripts/gpu_check.sh list                      the suites, what each runs
#   scripts/gpu_check.sh SUITE... [--wheel]        build, then run each suite
#   scripts/gpu_check.sh changed [BASE] [--dry-run] the suites whose sources `git diff
#                                                  --name-only BASE` touched (BASE: main)
#   scripts/gpu_check.sh changed --stdin --dry-run the same for paths read from stdin
#   scripts/gpu_check.sh steps 'CMD'... [--wheel]  build, then each CMD ($OUT/step_N.log)
#   scripts/gpu_check.sh before_after 'CMD'...     build HEAD and the carried .before/ tree
#                                                  (scripts/before_tree.sh REF, here) side by
#                                                  side, then each CMD with HEAD, then with the
#                                                  before tree from inside it; {which} in a CMD
#                                                  reads after or before
# More than 7 files under $OUT are packed into $OUT/all.tar.gz at the end (the device tool
# brings back 8 at most).
# Build: with .devdeps carried, `source .devdeps/prelude.sh`, then
# `pip install --no-build-isolation --no-deps --no-index .`. With --wheel, no build: the newest
# wheel for this Python in dist/ (scripts/wheel.sh makes it) goes into python3 instead.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ts-gpu-out}

# Each suite: pytest files (run with and without -m gpu), then benchmark commands ("bench:").
declare -A SUITE=(
  [optimizer]="tests/gpu/test_adamw_mapped.py tests/gpu/test_staged_adamw.py
    tests/e2e/test_optimizer_mode.py tests/e2e/test_host_optimizer.py
    tests/e2e/test_offload_adamw_options.py tests/e2e/test_nonfinite.py
    bench:offload_step.py --fits --json \$OUT/offload_step_fits.json
    bench:offload_step.py --big --modes compute wrap wrap_gpu --json \$OUT/offload_step_big.json
    bench:h2d_bandwidth.py --gib 1 --repeats 20 --json \$OUT/h2d_bandwidth.json"
  [memory_plan]="tests/e2e/test_memory_plan.py tests/e2e/test_weight_paging.py
    tests/e2e/test_wrap.py tests/e2e/test_planner.py tests/e2e/test_plan_trial.py
    tests/e2e/test_activation_offloader.py tests/gpu/test_allocator_split.py
    tests/e2e/test_streamed_quantized.py
    bench:memory_plan.py --cases gpt1.8b qwen14b_512 --json \$OUT/memory_plan.json"
  [hf_matrix]="tests/e2e/test_hf_models.py tests/e2e/test_hf_trainer.py
    tests/e2e/test_chunked_loss.py tests/e2e/test_hidden_losses.py tests/e2e/test_logprobs.py
    bench:chunked_loss.py --json \$OUT/chunked_loss.json
    bench:hf_models.py --cases qwen1.5b_full qwen14b_lora_512 --json \$OUT/hf_models.json
    bench:hf_trainer.py --json \$OUT/hf_trainer.json
    bench:dpo.py --json \$OUT/dpo.json"
  [bases_pools]="tests/e2e/test_shared_bases.py tests/e2e/test_base_models.py
    tests/e2e/test_streamed_quantized.py tests/e2e/test_base_host_memory.py
    tests/e2e/test_fp8_matmul.py tests/e2e/test_gpu_pools.py
    bench:dequantize.py --json \$OUT/dequantize.json
    bench:base_lora.py --json \$OUT/base_lora.json
    bench:gpu_pool.py --json \$OUT/gpu_pool.json"
  [generation]="tests/e2e/test_paged_kv_cache.py tests/e2e/test_decode_attention.py
    tests/e2e/test_attention_backend.py
    bench:generation.py --json \$OUT/generation.json
    bench:attention.py --json \$OUT/attention.json"
  [packaging]="tests/gpu/test_cuda_copies.py tests/e2e/test_package_layout.py
    ctest:gpu"
  [compare]="tests/e2e/test_bench_compare.py
    bench:compare.py --tiny --device cuda --json \$OUT/compare.json"
  [all]="tests ctest:gpu"
)
ORDER=(optimizer memory_plan hf_matrix bases_pools generation packaging compare all)

# Path prefixes -> suites, for `changed`: every matching line counts.
PATHS="
daemon/optimizer/                         optimizer
shim_python/trainstream/optim/            optimizer
shim_python/trainstream/transport/        optimizer memory_plan
kernels/                                  optimizer hf_matrix bases_pools
client/                                   optimizer packaging
bench/offload_step.py                     optimizer
bench/host_adamw                          optimizer
shim_python/trainstream/memory/paged_kv   generation
shim_python/trainstream/memory/           memory_plan
shim_python/trainstream/wrap.py           memory_plan optimizer
shim_python/trainstream/options.py        memory_plan
shim_python/trainstream/session.py        memory_plan
bench/memory_plan.py                      memory_plan
shim_python/trainstream/integrations/generation.py       generation
shim_python/trainstream/integrations/decode_attention.py generation
bench/generation.py                       generation
bench/attention.py                        generation
shim_python/trainstream/integrations/     hf_matrix
examples/hf_models.py                     hf_matrix compare
bench/hf_                                 hf_matrix
bench/dpo.py                              hf_matrix
shim_python/trainstream/frozen/           bases_pools
daemon/bases/                             bases_pools
daemon/gpu/                               bases_pools
daemon/safetensors/                       bases_pools
bench/compare.py                          compare
CMakeLists.txt                            packaging
pyproject.toml                            packaging
scripts/wheel.sh                          packaging
shim_python/src/                          packaging
"

list_suites() {
  local s
  for s in "${ORDER[@]}"; do
    echo "$s"
    tr -s ' \n' '\n' <<< "${SUITE[$s]}" | sed -n 's/^\(tests[^ ]*\)$/  test  \1/p'
    sed -n 's/.*bench:\([^ ]*\).*/  bench \1/p' <<< "${SUITE[$s]}"
    grep -q 'ctest:gpu' <<< "${SUITE[$s]}" && echo "  ctest -L gpu"
  done
  return 0
}

suites_for_paths() {  # paths on stdin -> suite names, in ORDER, once each
  local path prefix suites hit=()
  while read -r path; do
    [[ -n $path ]] || continue
    while read -r prefix suites; do
      [[ -n $prefix && $path == "$prefix"* ]] && hit+=($suites)
    done <<< "$PATHS"
  done
  local s
  for s in "${ORDER[@]}"; do
    [[ " ${hit[*]} " == *" $s "* ]] && echo "$s"
  done
  return 0
}

deps() {  # the carried Debian packages unpacked, once (a second unpacking rewrites headers
          # another build may be reading)
  if [[ -f .devdeps/prelude.sh && -z ${TS_DEPS_READY:-} ]]; then
    source .devdeps/prelude.sh
    export TS_DEPS_READY=1
  fi
  return 0
}

prepare() {  # build (or install the carried wheel), once
  mkdir -p "$OUT"
  trap pack_out EXIT
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  [[ -d .peers/cache ]] && export TRAINSTREAM_CACHE_DIR=${TRAINSTREAM_CACHE_DIR:-$PWD/.peers/cache}
  if (( WHEEL )); then
    local abi wheel
    abi=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheel=$(ls -t dist/trainstream-*-"$abi"-"$abi"-manylinux*.whl 2>/dev/null | head -1)
    [[ -n $wheel ]] || { echo "no $abi wheel in dist/: carry dist (scripts/wheel.sh makes it)"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --force-reinstall "$wheel" > "$OUT/build.log" 2>&1 \
      || { cat "$OUT/build.log"; exit 1; }
    echo "wheel: $wheel" >> "$OUT/build.log"
  else
    deps
    export CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90}"
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
    python3 -m pip install -q --no-build-isolation --no-deps --no-index . > "$OUT/build.log" 2>&1 \
      || { tail -50 "$OUT/build.log"; exit 1; }
  fi
  export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
}

status=0
step=0

# The device tool brings back at most 8 files from $OUT: past 7, everything there (logs, JSON)
# goes into one $OUT/all.tar.gz instead, beside the list of what it holds.
pack_out() {
  [[ -d $OUT ]] || return 0
  local count
  count=$(find "$OUT" -type f | wc -l)
  (( count > 7 )) || return 0
  tar -czf /tmp/ts-gpu-all.tar.gz -C "$OUT" . \
    && find "$OUT" -mindepth 1 -delete \
    && mv /tmp/ts-gpu-all.tar.gz "$OUT/all.tar.gz" \
    && tar -tzf "$OUT/all.tar.gz" > "$OUT/all.txt" \
    && echo "$count files packed into \$OUT/all.tar.gz (tar -xzf it here)"
  return 0
}
run() {  # run NAME CMD...: one logged step
  step=$((step + 1))
  local log="$OUT/${step}_$1.log"; shift
  echo "== $*" > "$log"
  "$@" >> "$log" 2>&1 || { status=1; echo "(failed)" >> "$log"; }
  echo "$(tail -1 "$log" | cut -c1-160)   [$log]"
}

run_suite() {
  local s=$1 item tests=() benches=() ctest=0
  [[ -n ${SUITE[$s]+x} ]] || { echo "unknown suite '$s' (scripts/gpu_check.sh list)"; exit 2; }
  while IFS= read -r item; do
    item=$(sed 's/^ *//' <<< "$item")
    case "$item" in
      bench:*) benches+=("${item#bench:}") ;;
      "") ;;
      *) for t in $item; do [[ $t == ctest:gpu ]] && ctest=1 || tests+=("$t"); done ;;
    esac
  done <<< "${SUITE[$s]}"
  if ((${#tests[@]})); then
    run "${s}_pytest_gpu" python3 -m pytest -ra -m gpu "${tests[@]}"
    [[ $s == all ]] || run "${s}_pytest_cpu" python3 -m pytest -ra -m "not gpu" "${tests[@]}"
  fi
  (( ctest )) && [[ -d build/py ]] && run "${s}_ctest" ctest --test-dir build/py --output-on-failure -j8 -L gpu
  local b
  for b in "${benches[@]}"; do
    run "${s}_bench" bash -c "python3 bench/$(eval echo "$b")"
  done
}

WHEEL=0 DRY=0 STDIN=0 args=()
for a in "$@"; do
  case "$a" in
    --wheel) WHEEL=1 ;;
    --dry-run) DRY=1 ;;
    --stdin) STDIN=1 ;;
    *) args+=("$a") ;;
  esac
done
set -- "${args[@]}"
what=${1:-list}
case "$what" in
  list) list_suites; exit 0 ;;
  changed)
    base=${2:-main}
    if (( STDIN )); then picked=$(suites_for_paths)
    else picked=$(git diff --name-only "$base" | suites_for_paths); fi
    if (( DRY )); then echo "$picked"; exit 0; fi
    [[ -n $picked ]] || { echo "no GPU suite covers what changed since $base"; exit 0; }
    prepare
    for s in $picked; do run_suite "$s"; done ;;
  steps)
    shift; prepare
    for c in "$@"; do run step bash -c "$c"; done ;;
  before_after)
    shift
    [[ -f .before/COMMIT ]] || {
      echo "no .before/ tree: run scripts/before_tree.sh REF here, and carry .before"; exit 2; }
    # The before tree builds into .before/site while HEAD builds (half the cores each).
    mkdir -p "$OUT"
    deps
    ( cd .before && CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=90}" \
        CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install -q --no-build-isolation --no-deps \
        --no-index --target site . > "$OUT/build_before.log" 2>&1 ) &
    before_build=$!
    CMAKE_BUILD_PARALLEL_LEVEL=8 prepare
    wait "$before_build" || { tail -30 "$OUT/build_before.log"; exit 1; }
    daemon=$(find "$PWD/.before/site" -name trainstreamd -type f | head -1)
    [[ -n $daemon ]] || { echo "the before tree built no trainstreamd"; exit 1; }
    echo "before: $(cat .before/COMMIT), daemon $daemon" | tee "$OUT/before.txt"
    for c in "$@"; do
      run after bash -c "${c//\{which\}/after}"
      run before bash -c "export PATH=$(dirname "$daemon"):\$PATH \
        PYTHONPATH=$PWD/.before/site; cd .before && ${c//\{which\}/before}"
    done ;;
  *)
    prepare
    for s in "$@"; do run_suite "$s"; done ;;
esac
exit $status
