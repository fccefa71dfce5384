# SPDX-License-Identifier: Apache-2.0
"""bench/README.md's table of current figures is bench/current_table.py's output on the
recorded results, so it cannot go stale: a new result file without `--write` fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- current-table:begin (bench/current_table.py --write) -->"
END = "<!-- current-table:end -->"


def test_readme_table_is_the_scripts_output():
    script = subprocess.run([sys.executable, str(ROOT / "bench" / "current_table.py")],
                            capture_output=True, text=True, timeout=60, check=True)
    readme = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    assert BEGIN in readme and END in readme, "bench/README.md lost the table's markers"
    table = readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip("\n")
    assert table == script.stdout.strip("\n"), (
        "bench/README.md's table is stale: run `python bench/current_table.py --write`")


def test_table_takes_the_newest_file_of_each_case():
    script = subprocess.run([sys.executable, str(ROOT / "bench" / "current_table.py")],
                            capture_output=True, text=True, timeout=60, check=True)
    rows = [line for line in script.stdout.splitlines() if line.startswith("| offload_step")]
    big = [r for r in rows if "| big " in r]
    assert big and "2026-12-06" in big[0], rows       # not the 2026-11-29 run of the same case
    assert len(rows) == len({r.split(" | ")[1] for r in rows}), rows  # one row per case


def test_readme_stays_short():
    assert len((ROOT / "bench" / "README.md").read_text().splitlines()) <= 200
