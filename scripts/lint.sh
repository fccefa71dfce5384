#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The formatter and linter checks the test command runs first: ruff over every Python file
# (pyproject.toml's [tool.ruff]), and clang-format (.clang-format) over the C++ and CUDA files
# changed since BASE (default: the commit that brought .clang-format in; the files before it keep
# their layout until a change touches them). Fix with: ruff check --fix; clang-format -i FILE.
#   bash scripts/lint.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRAINSTREAM_VENV:-/opt/trainstream/venv}
echo "== lint: ruff"
"$VENV/bin/python" -m ruff check --quiet .
if ! git rev-parse --git-dir >/dev/null 2>&1; then
  echo "== lint: clang-format skipped (not a git checkout: no history to find changed files in)"
  exit 0
fi
base=${1:-$(git log --diff-filter=A --format=%H -- .clang-format | tail -1)}
if [[ -z "$base" ]]; then
  base=HEAD  # .clang-format not committed yet: the working tree's changes
fi
mapfile -t changed < <(git diff --name-only --diff-filter=ACMR "$base" -- \
  '*.cc' '*.h' '*.cu' '*.cuh' | while read -r f; do [[ -f "$f" ]] && echo "$f"; done)
echo "== lint: clang-format over ${#changed[@]} C++/CUDA file(s) changed since ${base:0:10}"
if ((${#changed[@]})); then
  clang-format --dry-run --Werror "${changed[@]}"
fi
