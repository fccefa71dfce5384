# SPDX-License-Identifier: Apache-2.0
"""What the training-step benchmarks share: each configuration runs in a fresh process (a worker
mode of the same script), and the pinned-copy bandwidth their PCIe bounds are measured against."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument("--json", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)


def answered_as_worker(args: argparse.Namespace, worker: Callable[[str, dict], dict],
                       cases: dict) -> bool:
    """In a worker process: runs the one configuration, prints its row, and says so."""
    if not args.worker:
        return False
    print(json.dumps(worker(args.worker, cases[args.case])), flush=True)
    return True


def write_results(path: str, bench: str, rows: list, **fields) -> None:
    """A benchmark's recorded result: its rows with the date, machine, torch and GPU beside them
    (and ``fields``: its bandwidth, steps, ...)."""
    import platform

    with open(path, "w") as f:
        json.dump({"bench": bench, "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
                   "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                   **fields, "rows": rows}, f, indent=1)


def run_worker(script: str, mode: str, case: str, socket: str | None, timeout: int) -> dict:
    """Runs ``script --worker MODE --case CASE`` in a fresh Python process (nothing one
    configuration allocates reaches the next) and returns the JSON row it prints last."""
    env = dict(os.environ)
    if socket:
        env["TRAINSTREAM_SOCKET"] = socket
    try:
        result = subprocess.run([sys.executable, script, "--worker", mode, "--case", case],
                                capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "failed": True, "stderr": f"timed out after {timeout} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"mode": mode, "failed": True, "stderr": result.stderr[-3000:]}
    return json.loads(lines[-1])


def said_failure(mode: str, row: dict) -> bool:
    """Prints why a worker's row has no timings (out of memory, or failed with the last line of
    its stderr) and says whether it had none."""
    if not (row.get("failed") or row.get("oom")):
        return False
    reason = row.get("error") or (row.get("stderr", "").strip().splitlines() or ["?"])[-1][:200]
    print(f"  {mode:20s} {'out of memory' if row.get('oom') else 'failed'}: {reason}", flush=True)
    return True


def median_step_s(step: Callable[[], None], steps: int) -> float:
    """The median of ``steps`` timed calls of ``step``, each waited for on the GPU."""
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pinned_bandwidth(gib: float = 1.0, repeats: int = 10) -> dict:
    """Median pinned copy bandwidth, GB/s, with torch's own pinned tensors: each way alone, and
    each way while the other runs too (``both_each_way_gbps``: two streams, one copy each way
    at once), which is what a step that moves bytes both ways at the same time can hope for."""
    n = int(gib * 2**30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host_back = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_back = torch.empty(n, dtype=torch.uint8, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(up):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(down):
            host_back.copy_(dev_back, non_blocking=True)

    out = {}
    for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h", lambda: host.copy_(dev, non_blocking=True)),
                     ("both_each_way", both)):  # n bytes went each way in that time
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[f"{name}_gbps"] = round(n / statistics.median(times) / 1e9, 2)
    return out


def python_profile(run: Callable[[], None], rows: int = 22) -> str:
    """``run`` under cProfile: the Python functions (and the native calls they make) that took
    the most time of their own, as text. torch.profiler puts a hook's Python in the autograd
    node that ran it; this names it."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    # The table only: from its header on, the paths of the repository's own files shortened.
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(line.replace(os.getcwd() + "/", "") for line in lines[start:])


def profiled_steps(step: Callable[[int], None], first: int, steps: int = 2) -> dict:
    """TS_BENCH_PROFILE=1: ``steps`` more steps under torch.profiler, then ``steps`` more under
    cProfile; the ops that took the most GPU and CPU time and the Python functions that took
    the most, as tables (for a row of the results). Runs ``2 * steps`` steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for s in range(first, first + steps):
            step(s)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    out = {"profile_cpu": table.table(sort_by="self_cpu_time_total", row_limit=18)}
    if cuda:
        out["profile"] = table.table(sort_by="self_cuda_time_total", row_limit=18)

    def more_steps() -> None:
        for s in range(first + steps, first + 2 * steps):
            step(s)
        if cuda:
            torch.cuda.synchronize()
    out["profile_python"] = python_profile(more_steps)
    return out
