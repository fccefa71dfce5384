# SPDX-License-Identifier: Apache-2.0
"""Writes bench/README.md's table of current figures from bench/results/*.json.

For each benchmark and case, the newest result file that has that case (by the file's date,
then its name) gives the row: each engine's (``mode``'s) headline figure side by side (ours and
the peers in the same run), the bound where the row or the file has one, and the machine,
commit and date where the file records them.

    python bench/current_table.py            # prints the table
    python bench/current_table.py --write    # replaces it in bench/README.md, between markers

tests/docs/test_bench_table.py checks that the README's table equals this script's output.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN = "<!-- current-table:begin (bench/current_table.py --write) -->"
END = "<!-- current-table:end -->"
# Fields that name a case; `mode` names the engine within it.
CASE_KEYS = ("case", "preset", "kind", "tune", "format", "seq", "positions", "processes",
             "prompt", "tokens", "which")
# The headline figure of a row, the first present: (key, unit, scale).
METRICS = (("step_s", "s", 1), ("step_ms", "ms", 1), ("decode_tokens_per_s", "tok/s", 1),
           ("kernel_gbps", "GB/s", 1), ("daemon_gbps", "GB/s", 1), ("read_gbps", "GB/s", 1),
           ("auto_ms", "ms", 1), ("kernel_s", "s", 1), ("held_out_ppl", "ppl", 1),
           ("exposed_s", "s", 1), ("gbps", "GB/s", 1), ("p50", "µs", 1))
BOUNDS = (("lower_bound_s", "s"), ("bound_ms", "ms"), ("time_bound_s", "s"))
MACHINE = re.compile(r"_(h100|h200host|h200|dev2core)[_.]")
DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")


def _rows(data: dict) -> list[dict]:
    """A file's rows, flattened: a list, the rows of each run, or a dict of named rows."""
    rows = data.get("rows")
    if isinstance(rows, dict):
        return [dict(v, case=k) if isinstance(v, dict) else {"case": k} for k, v in rows.items()]
    if isinstance(rows, list):
        return [r for r in rows if isinstance(r, dict)]
    out = []
    for run in data.get("runs") or []:
        if isinstance(run, dict):
            out.extend(r for r in run.get("rows", []) if isinstance(r, dict))
    for key in ("rpc_us", "doorbell_us"):  # control_latency: percentiles at the top
        if isinstance(data.get(key), dict):
            out.append(dict(data[key], case=key[:-3]))
    return out


def _number(value) -> str:
    if isinstance(value, list):
        value = sorted(value)[len(value) // 2] if value and all(
            isinstance(v, (int, float)) for v in value) else None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return ""
    return f"{value:.4g}"


def _metric(row: dict) -> str:
    if row.get("oom") or (row.get("error") and "memory" in str(row.get("error")).lower()):
        return "out of memory"
    for key, unit, _ in METRICS:
        text = _number(row.get(key))
        if text:
            return f"{text} {unit}"
    return ""


def _case(row: dict) -> str:
    return " ".join(str(row[k]) for k in CASE_KEYS
                    if isinstance(row.get(k), (str, int, float)) and row[k] != "") or "all"


def _files() -> list[tuple[str, str, dict]]:
    out = []
    for path in glob.glob(os.path.join(HERE, "results", "*.json")):
        name = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        date = str(data.get("date") or (DATE.search(name) or [None, ""])[1])
        out.append((date, name, data))
    return sorted(out, key=lambda t: (t[0], t[1]))


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _engine(row: dict) -> str:
    return str(row.get("mode") or row.get("engine_name") or "")


def current() -> dict:
    """{(bench, case): (file names, data, [rows of that case])}: the newest file of each, with
    the rows of other engines that files of the same day and machine hold for that case (one
    benchmark run split over several device calls), the newest row of each engine."""
    found: dict = {}
    for date, name, data in _files():
        bench = data.get("bench") or name.split("_2")[0]
        machine = (MACHINE.search(name) or [None, ""])[1]
        by_case: dict = {}
        for row in _rows(data):
            by_case.setdefault(_case(row), []).append(row)
        for case, rows in by_case.items():
            found.setdefault((bench, case), []).append((date, machine, name, data, rows))
    table: dict = {}
    for key, entries in found.items():
        date, machine, name, data, newest = entries[-1]  # the newest file
        same = [e for e in entries if e[0] == date and e[1] == machine]
        if not all(_engine(r) for e in same for r in e[4]):
            table[key] = ([name], data, newest)  # rows without an engine: that file alone
            continue
        by_engine: dict = {}
        for _, _, _, _, rows in same:  # oldest first: a later file's row of an engine wins
            for row in rows:
                by_engine[_engine(row)] = row
        names = [e[2] for e in same if any(r in by_engine.values() for r in e[4])]
        table[key] = (names, data, list(by_engine.values()))
    return table


def render() -> str:
    lines = ["| benchmark | case | figure by engine | bound | machine | commit | date | file |",
             "|---|---|---|---|---|---|---|---|"]
    for (bench, case), (names, data, rows) in sorted(current().items()):
        name = names[-1]
        figures = []
        for row in rows:
            figure = _metric(row)
            if figure:
                mode = row.get("mode") or row.get("engine_name") or ""
                figures.append(f"{mode} {figure}".strip())
        if not figures:
            continue
        bound = ""
        for row in rows:
            for key, unit in BOUNDS:
                if _number(row.get(key)):
                    bound = f"{_number(row[key])} {unit}"
                    break
            if bound:
                break
        if not bound and isinstance(data.get("bound"), str):
            bound = data["bound"].split(";")[0][:60]
        machine = (MACHINE.search(name) or [None, ""])[1]
        commit = str(data.get("commit") or "").split(" ")[0]
        lines.append("| " + " | ".join(_cell(c) for c in (
            bench, case, "; ".join(figures[:4]), bound, machine, commit,
            data.get("date") or "", ", ".join(f"`{n}`" for n in names))) + " |")
    return "\n".join(lines) + "\n"


def write(readme: str) -> None:
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(text[:start] + "\n" + render() + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = parser.parse_args()
    if args.write:
        write(os.path.join(HERE, "README.md"))
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
