# SPDX-License-Identifier: Apache-2.0
"""Where a step's time goes, from a torch.profiler trace: how long the copy engines and the
compute were busy, whether host memory was pinned, what the CPU waited on and which Python
functions and operators its own time went to, and the longest stretches in which nothing crossed
to the GPU. A paged step is only as fast as its busiest
resource; the gaps say what kept that resource waiting.

    with step_trace.profiled(path) as prof: ...steps...
    summary = step_trace.summarize(path)      # a dict; step_trace.describe(summary) in words
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import json
import os
from typing import Iterator

import torch


@contextlib.contextmanager
def profiled(path: str) -> Iterator[None]:
    """Profiles the CPU and CUDA activity of the enclosed steps into a Chrome trace at
    ``path`` (gzip-compressed when it ends in .gz)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # with_stack: the Python functions the CPU spent its time in (python_calls in summarize).
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        yield
        torch.cuda.synchronize()
    plain = path[:-3] if path.endswith(".gz") else path
    prof.export_chrome_trace(plain)
    if plain != path:
        with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())
        os.remove(plain)


def _events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _union(intervals: list) -> list:
    merged: list = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _busy(intervals: list) -> float:
    return sum(end - start for start, end in _union(intervals))


def _self_times(events: list) -> dict:
    """Per name, the time spent in events of that name less their children's (events nest on
    one thread): where a thread's own time went."""
    totals: dict = {}
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for items in by_thread.values():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []  # [event, children's time]
        for e in items + [None]:
            while stack and (e is None or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                done, children = stack.pop()
                totals[done["name"]] = totals.get(done["name"], 0.0) + done["dur"] - children
                if stack:
                    stack[-1][1] += done["dur"]
            if e is not None:
                stack.append([e, 0.0])
    return totals


def summarize(path: str, gaps: int = 8) -> dict:
    """The trace's GPU timeline in milliseconds: its span (first to last GPU activity), the
    union of kernel time, of host-to-device and of device-to-host copies, copies by kind
    (pinned or pageable, bytes and rate), the CUDA calls the CPU spent longest in, and the
    ``gaps`` longest stretches with no host-to-device copy running (with the kernels
    running meanwhile)."""
    events = _events(path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    gpu = kernels + copies
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    span_start = min(e["ts"] for e in gpu)
    span_end = max(e["ts"] + e["dur"] for e in gpu)

    def spans(items):
        return [(e["ts"], e["ts"] + e["dur"]) for e in items]

    to_device = [e for e in copies if "HtoD" in e["name"]]
    to_host = [e for e in copies if "DtoH" in e["name"]]
    kinds: dict = {}
    for e in copies:
        k = kinds.setdefault(e["name"], {"count": 0, "ms": 0.0, "bytes": 0})
        k["count"] += 1
        k["ms"] += e["dur"] / 1e3
        k["bytes"] += int(e.get("args", {}).get("bytes", 0))
    for k in kinds.values():
        k["gbps"] = round(k["bytes"] / (k["ms"] * 1e6), 1) if k["ms"] else 0.0
        k["ms"] = round(k["ms"], 2)
    calls: dict = {}
    for e in runtime:
        c = calls.setdefault(e["name"], {"count": 0, "ms": 0.0})
        c["count"] += 1
        c["ms"] += e["dur"] / 1e3
    top_calls = dict(sorted(((n, {"count": c["count"], "ms": round(c["ms"], 2)})
                             for n, c in calls.items()), key=lambda kv: -kv[1]["ms"])[:8])
    # Stretches of the span with no copy to the device running, longest first.
    idle, at = [], span_start
    for start, end in _union(spans(to_device)) + [[span_end, span_end]]:
        if start > at:
            idle.append((at, start))
        at = max(at, end)
    idle.sort(key=lambda g: g[0] - g[1])
    described = []
    for start, end in idle[:gaps]:
        during = [e for e in kernels if e["ts"] < end and e["ts"] + e["dur"] > start]
        names: dict = {}
        for e in during:
            names[e["name"][:60]] = names.get(e["name"][:60], 0) + 1
        described.append({"at_ms": round((start - span_start) / 1e3, 2),
                          "ms": round((end - start) / 1e3, 2),
                          "kernel_busy_ms": round(_busy(
                              [(max(s, start), min(t, end)) for s, t in spans(during)]) / 1e3, 2),
                          "kernels": dict(sorted(names.items(), key=lambda kv: -kv[1])[:3])})
    why_idle = _idle_causes(idle, to_device, runtime)
    # Where the CPU's own time went: Python functions (with_stack) and torch operators, by
    # self time, the heaviest first.
    cpu = [e for e in events if e.get("cat") in ("python_function", "cpu_op")]
    python_calls = dict(sorted(((n, round(t / 1e3, 2)) for n, t in _self_times(cpu).items()),
                               key=lambda kv: -kv[1])[:15])
    return {"span_ms": round((span_end - span_start) / 1e3, 2),
            "cpu_self_ms": python_calls,
            "kernel_busy_ms": round(_busy(spans(kernels)) / 1e3, 2),
            "h2d_busy_ms": round(_busy(spans(to_device)) / 1e3, 2),
            "d2h_busy_ms": round(_busy(spans(to_host)) / 1e3, 2),
            "copies": kinds, "cuda_calls": top_calls,
            "h2d_idle_ms": round(sum(end - start for start, end in idle) / 1e3, 2),
            "h2d_idle_causes_ms": why_idle,
            "h2d_gaps": described}


def _idle_causes(idle: list, to_device: list, runtime: list) -> dict:
    """Splits the time no copy to the GPU ran by what the copy that ended each idle stretch was
    doing meanwhile: not yet asked for by the CPU (the CPU issuing work was behind: "cpu_late"),
    or asked for before the stretch began and held back on the GPU (waiting for a slot to be
    released, or behind another stream's work: "gpu_held"). A stretch the next copy was asked
    for during counts as late from its start to the request, held after it. Copies and the
    calls that asked for them are matched by the profiler's correlation ids."""
    issued = {e.get("args", {}).get("correlation"): e["ts"] + e["dur"] for e in runtime
              if "Memcpy" in e["name"] and "correlation" in e.get("args", {})}
    starts = sorted((e["ts"], issued.get(e.get("args", {}).get("correlation"))) for e in to_device)
    times = [ts for ts, _ in starts]
    out = {"cpu_late": 0.0, "gpu_held": 0.0, "unattributed": 0.0}
    for start, end in idle:
        at = bisect.bisect_left(times, end)  # the first copy to start once the stretch ends
        following = starts[at][1] if at < len(starts) else None
        if following is None:
            out["unattributed"] += end - start  # no copy after it (the span's end), or its
            # request is not in the trace
        elif following <= start:
            out["gpu_held"] += end - start
        else:
            late = min(following, end) - start
            out["cpu_late"] += late
            out["gpu_held"] += (end - start) - late
    return {k: round(v / 1e3, 2) for k, v in out.items()}


def describe(summary: dict) -> list:
    """The summary in lines of text."""
    if "error" in summary:
        return [summary["error"]]
    lines = [f"GPU span {summary['span_ms']} ms: kernels busy {summary['kernel_busy_ms']} ms, "
             f"copies to GPU busy {summary['h2d_busy_ms']} ms (idle {summary['h2d_idle_ms']} "
             f"ms), back {summary['d2h_busy_ms']} ms"]
    for name, k in summary["copies"].items():
        lines.append(f"  {name}: {k['count']} copies, {k['bytes'] / 1e9:.2f} GB in {k['ms']} ms "
                     f"({k['gbps']} GB/s)")
    lines.append("  CPU in CUDA calls: " + ", ".join(
        f"{n} {c['ms']} ms/{c['count']}" for n, c in summary["cuda_calls"].items()))
    if summary.get("cpu_self_ms"):
        lines.append("  CPU self time (Python functions and operators): " + ", ".join(
            f"{n} {t} ms" for n, t in summary["cpu_self_ms"].items()))
    if summary.get("h2d_idle_causes_ms"):
        c = summary["h2d_idle_causes_ms"]
        lines.append(f"  copies to the GPU idle because the CPU had not asked for the next one yet "
                     f"{c['cpu_late']} ms; asked for and held back on the GPU {c['gpu_held']} ms"
                     f"; not attributed (after the last copy) {c['unattributed']} ms")
    for g in summary["h2d_gaps"]:
        lines.append(f"  no copy to the GPU for {g['ms']} ms at {g['at_ms']} ms (kernels busy "
                     f"{g['kernel_busy_ms']} ms: {g['kernels']})")
    return lines
