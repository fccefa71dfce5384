#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what building and testing trainstream needs on Debian 12 (run as root), and a Python
# virtual environment that later runs reuse. Idempotent: a second run only checks.
set -euo pipefail

VENV=${TRAINSTREAM_VENV:-/opt/trainstream/venv}
TORCH_SPEC=${TRAINSTREAM_TORCH:-torch}

apt_packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev prometheus-cpp-dev
  clang libclang-rt-14-dev clang-format
  python3 python3-dev python3-venv
  systemd passwd util-linux
)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "bootstrap: creating the virtual environment $VENV"
  mkdir -p "$(dirname "$VENV")"
  /usr/bin/python3 -m venv "$VENV"
fi
py="$VENV/bin/python"
need_pip=()
"$py" -c 'import torch' 2>/dev/null || need_pip+=("$TORCH_SPEC")
for mod in pytest grpc_tools grpc_health grpc_reflection scikit_build_core pybind11 numpy \
           safetensors transformers peft accelerate kubernetes_validate \
           mkdocs material mkdocstrings mkdocstrings_handlers.python ruff; do
  "$py" -c "import $mod" 2>/dev/null || need_pip+=("$mod")
done
if ((${#need_pip[@]})); then
  pkgs=()
  for m in "${need_pip[@]}"; do
    case "$m" in
      grpc_tools) pkgs+=(grpcio grpcio-tools "protobuf>=4.21") ;;
      # The standard clients of the daemon's health and reflection services (the tests).
      grpc_health) pkgs+=(grpcio-health-checking) ;;
      grpc_reflection) pkgs+=(grpcio-reflection) ;;
      scikit_build_core) pkgs+=(scikit-build-core) ;;
      # The Kubernetes API's schemas, offline: the DaemonSet's check (tests/deploy).
      kubernetes_validate) pkgs+=(kubernetes-validate) ;;
      # The documentation site, built strictly by tests/docs/test_docs.py.
      material) pkgs+=(mkdocs-material) ;;
      mkdocstrings|mkdocstrings_handlers.python) pkgs+=("mkdocstrings[python]") ;;
      *) pkgs+=("$m") ;;
    esac
  done
  echo "bootstrap: pip installing ${pkgs[*]} into $VENV (torch is a large download the first time)"
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "${pkgs[@]}"
fi
echo "bootstrap: ready ($("$py" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")'))"
