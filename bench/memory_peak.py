# SPDX-License-Identifier: Apache-2.0
"""Where a step's VRAM peak goes: the caching allocator's history (torch.cuda.memory) replayed
to the moment of the highest allocated total, and what was live then, grouped by the Python
frame that allocated it (the first frame in trainstream, transformers, peft, torch.optim or the
benchmark). Memory allocated before the recording started is one bucket ("before recording").
After an out-of-memory error, the same at the failed allocation, with the size it asked for.

    memory_peak.start()        # before the steps to look at
    ...steps...
    print(memory_peak.report())
"""

from __future__ import annotations

import collections

import torch

_OWNERS = ("trainstream/", "transformers/", "peft/", "torch/optim", "torch/utils/checkpoint",
           "bench/", "examples/", "tests/models/")
_base = 0


def start(entries: int = 400_000) -> None:
    global _base
    torch.cuda.synchronize()
    _base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")


def _owner(frames: list) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(o in name for o in _OWNERS) and "memory_peak" not in name:
            short = name.split("site-packages/")[-1]
            return f"{short}:{f.get('line')}({f.get('name')})"
    return "elsewhere"


def _by_owner(live: dict, top: int) -> list:
    owners: collections.Counter = collections.Counter()
    for size, owner in live.values():
        owners[owner] += size
    return [(k, round(v / 2**30, 3)) for k, v in owners.most_common(top)]


def report(top: int = 14) -> dict:
    """The peak since start(), what was live at it by owner (GiB), and what is live now; after
    an out-of-memory error, what was live when it came."""
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    live: dict = {}
    before = _base  # bytes allocated before recording, less those freed since
    total = best = _base
    best_live: dict = {}
    best_before = before
    oom = None
    for entry in trace:
        action, addr, size = entry["action"], entry.get("addr"), entry.get("size", 0)
        if action == "oom" and oom is None:
            oom = {"asked_gib": round(size / 2**30, 3), "allocated_gib": round(total / 2**30, 2),
                   "live": [("before recording", round(before / 2**30, 2))]
                   + _by_owner(live, top)}
            continue
        if action == "alloc":
            live[addr] = (size, _owner(entry.get("frames", [])))
            total += size
        elif action == "free_completed":
            if addr in live:
                total -= live.pop(addr)[0]
            else:
                before -= size
                total -= size
        else:
            continue
        if total > best:
            best, best_before = total, before
            best_live = dict(live)
    gib = 2**30
    result = {"peak_gib": round(best / gib, 2),
              "at_peak": [("before recording", round(best_before / gib, 2))]
              + _by_owner(best_live, top),
              "live_now_gib": round(torch.cuda.memory_allocated() / gib, 2),
              "live_now_recorded": _by_owner(live, top),
              "trace_entries": len(trace)}
    if oom is not None:
        # How the reserved memory was laid out: a request fails with room reserved but free
        # when no free block in it is large enough (each segment: MiB reserved, allocated, and
        # its largest free block).
        oom["segments_mib"] = sorted(
            ((round(seg["total_size"] / 2**20, 1), round(seg["allocated_size"] / 2**20, 1),
              round(max((b["size"] for b in seg["blocks"] if b["state"] == "inactive"),
                        default=0) / 2**20, 1))
             for seg in snapshot["segments"]), reverse=True)[:top]
        result["at_oom"] = oom
    return result
