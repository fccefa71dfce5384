# SPDX-License-Identifier: Apache-2.0
"""scripts/gpu_check.sh without a GPU: `list` names every suite, `changed --dry-run` maps
changed paths to the suites that cover them, and a run's results are packed into one file when
they are more than the device tool brings back."""

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


def _pack(out: Path) -> str:
    # The script's pack_out, alone: a run's last step, without the build before it.
    return subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^pack_out()/,/^}}/p" "{SCRIPT}"); pack_out'],
        env={"OUT": str(out), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=60, check=True).stdout


def test_more_results_than_come_back_are_packed_into_one_file(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    names = [f"{i}_step.log" for i in range(8)] + ["sub/memory_plan.json"]
    for name in names:
        (out / name).write_text(name)
    assert "9 files packed" in _pack(out)
    assert sorted(p.name for p in out.iterdir()) == ["all.tar.gz", "all.txt"]
    listed = (out / "all.txt").read_text().split()
    assert all(f"./{name}" in listed for name in names)
    unpacked = tmp_path / "back"
    unpacked.mkdir()
    subprocess.run(["tar", "-xzf", str(out / "all.tar.gz"), "-C", str(unpacked)], check=True)
    assert (unpacked / "sub" / "memory_plan.json").read_text() == "sub/memory_plan.json"


def test_results_that_come_back_as_they_are_stay_as_they_are(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for i in range(7):
        (out / f"{i}.log").write_text("x")
    assert _pack(out) == ""
    assert sorted(p.name for p in out.iterdir()) == [f"{i}.log" for i in range(7)]
