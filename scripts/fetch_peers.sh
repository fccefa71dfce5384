#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fetches the engines the benchmarks compare against into git-ignored folders (here, where PyPI
# is reachable), to carry to the GPU machine, which has no network:
#
#   .peers/trainstream-0.4.1   TrainStream 0.4.1's sdist (bench/hf_models.py, bench/compare.py
#                              --ts041; device run: carry ".peers"). It compiles its CUDA
#                              extension at its first import there; the benches import it from
#                              its own folder, so it never meets this package.
#   .whl/bnb .whl/ds .whl/ao   wheels for the GPU image (CPython 3.12, x86-64, torch 2.11+cu130
#                              already there) of bench/compare.py's peers: bitsandbytes,
#                              DeepSpeed (+ the pure-Python needs the image lacks), torchao.
#                              compare.py --peers .whl unpacks each folder into a temporary
#                              folder and puts it on sys.path only in its engines' processes.
#                              Carry the folders a run needs (each call: 64 MiB in all with the
#                              working tree); .whl/README.txt lists what is where, with sizes.
#
# Versions are pinned, so a second fetch gives the same set. DeepSpeed is an sdist only: its
# wheel is built here with DS_BUILD_OPS=0 (its ops, DeepSpeedCPUAdam among them, JIT-compile
# on the GPU machine at first use) by a Python that has torch ($TS_TORCH_PYTHON, default
# /opt/trainstream/venv/bin/python; nothing is installed into it). bitsandbytes' wheel carries
# a native library for every CUDA and ROCm version (41 MiB); the copy kept in .whl/bnb has only
# the CPU and CUDA 13 ones (build tag "1cu13" in its name, RECORD rewritten to match).
#
#   bash scripts/fetch_peers.sh            # both
#   bash scripts/fetch_peers.sh --peers    # .peers/ only
#   bash scripts/fetch_peers.sh --wheels   # .whl/ only
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}

BNB=bitsandbytes==0.50.2
TORCHAO=torchao==0.18.0   # its native parts load on torch >= 2.11; CPUOffloadOptimizer is Python
DEEPSPEED=0.19.8
# DeepSpeed's needs that the GPU image lacks (it has einops, msgpack, ninja, numpy, packaging,
# psutil, py-cpuinfo, tqdm, nvidia-ml-py); typing-extensions because pydantic needs >= 4.16.
DS_NEEDS=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
          typing-inspection==0.4.5 typing-extensions==4.16.0)

if [[ $what == all || $what == --peers ]]; then
  grep -qx '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >> .git/info/exclude
  mkdir -p .peers
  if [[ ! -d .peers/trainstream-0.4.1 ]]; then
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary :all: trainstream==0.4.1 -d "$tmp"
    tar -xzf "$tmp"/trainstream-0.4.1.tar.gz -C .peers
    rm -rf "$tmp"
  fi
  echo "ready: $(du -sh .peers | cut -f1) in .peers/ (carry it with the device call)"
fi

if [[ $what == all || $what == --wheels ]]; then
  grep -qx '/.whl/' .gitignore .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl/bnb .whl/ds .whl/ao
  target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT

  if ! ls .whl/bnb/bitsandbytes-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q "${target[@]}" -d "$tmp/bnb" "$BNB"
    # Only the CPU and CUDA 13.x native libraries (the GPU image's torch is cu130).
    python3 - "$tmp"/bnb/bitsandbytes-*.whl .whl/bnb <<'EOF'
import base64, hashlib, os, re, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
keep = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")
name = os.path.basename(src)
version_end = name.index("-", len("bitsandbytes-"))
dst = os.path.join(out, name[:version_end] + "-1cu13" + name[version_end:])
records = []
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    for info in zin.infolist():
        if info.filename == record_name:
            continue
        if "libbitsandbytes_" in info.filename and not keep.search(info.filename):
            continue
        data = zin.read(info)
        zout.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append(f"{info.filename},sha256={digest},{len(data)}")
    records.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(records) + "\n")
print(f"{os.path.basename(dst)}: {os.path.getsize(dst) / 2**20:.1f} MiB "
      f"(from {os.path.getsize(src) / 2**20:.1f} MiB)")
EOF
  fi

  if ! ls .whl/ao/torchao-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q "${target[@]}" -d .whl/ao "$TORCHAO"
  fi

  if ! ls .whl/ds/deepspeed-*.whl >/dev/null 2>&1; then
    py=${TS_TORCH_PYTHON:-/opt/trainstream/venv/bin/python}
    "$py" -c 'import torch, setuptools' || {
      echo "fetch_peers: $py has no torch (or setuptools) to build DeepSpeed's wheel with;" \
           "set TS_TORCH_PYTHON" >&2; exit 1; }
    python3 -m pip download -q --no-deps --no-binary :all: "deepspeed==$DEEPSPEED" -d "$tmp/ds"
    # No ops built here (JIT on the GPU machine); the CUDA accelerator named, whatever this
    # machine has.
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$py" -m pip wheel -q --no-deps --no-build-isolation \
      -w .whl/ds "$tmp/ds/deepspeed-$DEEPSPEED.tar.gz"
  fi
  for need in "${DS_NEEDS[@]}"; do
    file=$(echo "${need%%==*}" | tr - _)
    ls .whl/ds/"$file"-"${need##*==}"-*.whl >/dev/null 2>&1 ||
      python3 -m pip download -q "${target[@]}" -d .whl/ds "$need"
  done

  {
    echo "Wheels for bench/compare.py's peers on the GPU machine (CPython 3.12, x86-64,"
    echo "torch 2.11+cu130 already there), fetched by scripts/fetch_peers.sh on $(date -u +%F)."
    echo "compare.py --peers .whl unpacks each folder into a temporary folder and puts it on"
    echo "sys.path only in the processes of its engines (bnb: bnb*; ds: ds2*, ds3*; ao: ao*)."
    echo "Carry the folders a run needs (64 MiB a device call, the working tree included)."
    echo
    for d in bnb ds ao; do
      echo "$d/ ($(du -sb .whl/$d | awk '{printf "%.1f MiB", $1 / 1048576}'))"
      for w in .whl/$d/*.whl; do
        printf '  %-78s %8.2f MiB\n' "$(basename "$w")" "$(stat -c %s "$w" | awk '{print $1 / 1048576}')"
      done
    done
  } > .whl/README.txt
  cat .whl/README.txt
fi
