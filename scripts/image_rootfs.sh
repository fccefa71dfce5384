#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# deploy/container/Containerfile's image assembled and run without a container engine or a
# registry (the dev VM reaches neither Docker Hub nor NVIDIA's apt repository, and podman's crun
# refuses its hybrid cgroups):
#   - debian:12-slim's equivalent from Debian's mirror (debootstrap --variant=minbase bookworm);
#   - the run-time stage's packages, read from the Containerfile, installed in it by apt-get;
#   - the two binaries built and installed with the build stage's commands (here, with this
#     machine's CUDA toolkit in place of the one the stage installs from NVIDIA's repository);
#   - the daemon started as the image's ENTRYPOINT, as pid 1 of PID, mount, IPC, UTS and network
#     namespaces of its own, its socket folder bound from another path (a DaemonSet's hostPath);
#   - a small model trained through it from the host and from another PID namespace (a pod), and
#     the daemon stopped as kubelet stops it (SIGTERM: it drains).
# Usage (root): scripts/image_rootfs.sh [WORKDIR]   (default /tmp/ts-image; the rootfs is reused)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/ts-image}
root=$work/rootfs
sockets=$work/sockets  # the host's side of the socket folder
build=${TS_IMAGE_BUILD:-$work/build}  # a Release build tree (tests off) to reuse
python=${TRAINSTREAM_VENV:-/opt/trainstream/venv}/bin/python
recipe=deploy/container/Containerfile
mkdir -p "$work" "$sockets"

if [[ ! -x $root/usr/bin/apt-get ]]; then
  command -v debootstrap > /dev/null || apt-get install -y -qq --no-install-recommends debootstrap
  echo "image_rootfs: debian 12 minbase into $root (Debian's mirror)"
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$work/debootstrap.log"
fi
runtime_packages=$("$python" - "$recipe" <<'EOF'
import re, sys
stage = open(sys.argv[1]).read().rsplit("\nFROM ", 1)[1]
found = re.search(r"apt-get install -y --no-install-recommends(.*?)&&", stage, flags=re.DOTALL)
print(" ".join(found.group(1).replace("\\", " ").split()))
EOF
)
echo "image_rootfs: the run-time stage's packages: $runtime_packages"
cp /etc/resolv.conf "$root/etc/resolv.conf"
chroot "$root" sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends \
  $runtime_packages > /dev/null && rm -rf /var/lib/apt/lists/*"

echo "image_rootfs: the build stage's commands (Release, no tests, the two binaries, stripped)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTRAINSTREAM_BUILD_TESTS=OFF \
  > "$build.log"
cmake --build "$build" --target trainstreamd tsctl -j"$(nproc)" >> "$build.log"
install -D -m 0755 -s "$build/daemon/trainstreamd" "$root/usr/bin/trainstreamd"
install -D -m 0755 -s "$build/tsctl/tsctl" "$root/usr/bin/tsctl"
install -D -m 0644 deploy/trainstreamd.conf "$root/etc/trainstream/trainstreamd.conf"
missing=$(chroot "$root" ldd /usr/bin/trainstreamd /usr/bin/tsctl | grep -c "not found" || true)
[[ $missing == 0 ]] || { echo "image_rootfs: $missing libraries missing in the image"; exit 1; }

entrypoint=$("$python" -c 'import json, re, sys
print(" ".join(json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", open(sys.argv[1]).read(),
                                    re.M).group(1))))' "$recipe")
mkdir -p "$root/run/trainstream"
rm -f "$sockets"/*
mount --bind "$sockets" "$root/run/trainstream"
mount --bind /dev "$root/dev"
daemon=
cleanup() {
  [[ -n $daemon ]] && kill "$daemon" 2> /dev/null || true
  umount "$root/run/trainstream" "$root/dev" 2> /dev/null || true
}
trap cleanup EXIT
echo "image_rootfs: ENTRYPOINT $entrypoint, as pid 1 of namespaces of its own"
unshare --pid --fork --kill-child=SIGTERM --mount --ipc --uts --net --root="$root" --mount-proc \
  $entrypoint > "$work/daemon.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do [[ -S $sockets/trainstreamd.sock.data ]] && break; sleep 0.1; done
"$root/usr/bin/tsctl" --socket="$sockets/trainstreamd.sock" status | head -4

trainer=examples/linear_offload.py  # run from the host's side, as a client pod would
host=$("$python" "$trainer" "$sockets/trainstreamd.sock" from-the-host)
pod=$(unshare --pid --fork --mount-proc "$python" "$trainer" "$sockets/trainstreamd.sock" \
  from-another-pod)
read -r host_pid host_first _ <<< "$host"
read -r pod_pid _ <<< "$pod"
echo "image_rootfs: from the host (pid $host_pid): loss $host_first -> ${host##* }"
echo "image_rootfs: from another PID namespace (pid $pod_pid there): loss ${pod##* }"
[[ ${host#* } == "${pod#* }" ]] || { echo "image_rootfs: the two runs' losses differ"; exit 1; }
echo "image_rootfs: the same 20 losses, bit for bit"
grep -E "session.open" "$work/daemon.log" | cut -d: -f3- | sed 's/^/  daemon said:/'
# As kubelet stops a pod: SIGTERM to its pid 1 (unshare itself ignores the signal).
kill -TERM "$(cat "/proc/$daemon/task/$daemon/children")"
wait "$daemon" || true
daemon=
for _ in $(seq 100); do grep -q "daemon.stop" "$work/daemon.log" && break; sleep 0.1; done
grep -E "daemon.(draining|stop)" "$work/daemon.log" | cut -d: -f3- | sed 's/^/  daemon said:/'
