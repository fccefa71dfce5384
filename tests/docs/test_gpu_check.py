# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_check.sh without a GPU: `list` names every suite, and `changed --dry-run` maps
changed paths to the suites that cover them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
SUITES = ["optimizer", "memory_plan", "hf_matrix", "bases_pools", "generation", "packaging",
          "compare", "all"]


def _run(*args, stdin=""):
    return subprocess.run(["bash", str(SCRIPT), *args], input=stdin, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_list_names_each_suite_with_what_it_runs():
    out = _run("list")
    names = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert names == SUITES
    assert "  bench compare.py" in out and "  test  tests/e2e/test_hf_models.py" in out


@pytest.mark.parametrize("paths,suites", [
    (["daemon/optimizer/job_optimizer.cc"], ["optimizer"]),
    (["shim_python/trainstream/frozen/linear.py"], ["bases_pools"]),
    (["shim_python/trainstream/integrations/generation.py"], ["hf_matrix", "generation"]),
    (["bench/compare.py", "shim_python/trainstream/memory/planner.py"],
     ["memory_plan", "compare"]),
    (["README.md", "docs/index.md"], []),
])
def test_changed_maps_paths_to_suites(paths, suites):
    out = _run("changed", "--stdin", "--dry-run", stdin="\n".join(paths) + "\n")
    assert out.split() == suites


def test_no_mode_is_named_after_a_date_or_a_past_task():
    text = SCRIPT.read_text()
    for old in ("owed", "mode_tests", "lean", "issue 2", "2026-"):
        assert old not in text, old
