#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Here, before a GPU call: the tree of commit REF in the git-ignored .before/, to carry with the
# working tree (run's carry: ".before") so that `scripts/gpu_check.sh before_after` builds and
# times it beside HEAD in the same call. The GPU machine gets no .git, hence the copy.
#   scripts/before_tree.sh REF
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: scripts/before_tree.sh REF}
commit=$(git rev-parse --verify "$ref^{commit}")
grep -qx '/.before/' .git/info/exclude 2>/dev/null || echo '/.before/' >> .git/info/exclude
rm -rf .before && mkdir .before
git archive "$commit" | tar -x -C .before
echo "$commit" > .before/COMMIT
echo "before tree: $(git log --oneline -1 "$commit") in .before/ ($(du -sh .before | cut -f1))"
