#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fetches the engines bench/hf_models.py compares against into the git-ignored folder .peers/
# (here, where PyPI is reachable), to carry to the GPU machine (device run: carry ".peers").
# TrainStream 0.4.1 is an sdist that compiles its CUDA extension at its first import there;
# bench/hf_models.py imports it from its own folder, so it never meets this package.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.peers/' .git/info/exclude 2>/dev/null || echo '/.peers/' >> .git/info/exclude
mkdir -p .peers
if [[ ! -d .peers/trainstream-0.4.1 ]]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: trainstream==0.4.1 -d "$tmp"
  tar -xzf "$tmp"/trainstream-0.4.1.tar.gz -C .peers
  rm -rf "$tmp"
fi
echo "ready: $(du -sh .peers | cut -f1) in .peers/ (carry it with the device call)"
