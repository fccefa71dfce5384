# SPDX-License-Identifier: Apache-2.0
"""What was live in VRAM, read from a memory snapshot hf_run.py wrote (--memory-snapshot): for
each training step its traced peak and, at that moment, the live bytes grouped by the code that
allocated them; then the same at the out-of-memory error, and the allocations just before it.
Allocations made before the recording started (the weights wrap() placed) are not in the trace:
the totals are what the steps added.

    python snapshot_summary.py SNAPSHOT.pickle [--top 25]
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

# Frames in these files say who asked for the memory; torch's own frames only how.
_OWNERS = ("/trainstream/", "/transformers/", "/peft/", "hf_run.py", "hf_models.py")


def owner(frames: list) -> str:
    """The innermost frame in the project, the model's library or the harness, with the
    innermost frame of all when that is another (torch's functional layer, say)."""
    inner = frames[0] if frames else None
    for f in frames:
        name = f.get("filename", "")
        if any(o in name for o in _OWNERS):
            where = f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
            if inner is not None and inner is not f:
                where += f" <- {inner['name']}"
            return where
    return f"{inner['filename'].rsplit('/', 1)[-1]}:{inner['line']} {inner['name']}" if (
        inner) else "?"


def is_step_start(frames: list) -> bool:
    return any(f.get("name") == "batch" and f.get("filename", "").endswith("hf_models.py")
               for f in frames)


def grouped(live: dict, top: int) -> str:
    by = defaultdict(lambda: [0, 0])
    for size, where in live.values():
        by[where][0] += size
        by[where][1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return "\n".join(f"  {b / 2**20:9.1f} MiB {n:6d}x  {w}" for w, (b, n) in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    live: dict[int, tuple[int, str]] = {}
    total, step = 0, -1
    peak: tuple[int, dict] = (0, {})
    recent: list[str] = []

    def close_step() -> None:
        if step >= 0:
            print(f"step {step}: traced peak {peak[0] / 2**20:.1f} MiB; live then:")
            print(grouped(peak[1], args.top))

    for e in trace:
        action, frames = e["action"], e.get("frames", [])
        if action == "alloc":
            if is_step_start(frames):
                close_step()
                step, peak = step + 1, (0, {})
            live[e["addr"]] = (e["size"], owner(frames))
            total += e["size"]
            if total > peak[0]:
                peak = (total, dict(live))
            recent.append(f"  alloc {e['size'] / 2**20:8.1f} MiB  {owner(frames)}")
        elif action == "free_requested" and e["addr"] in live:
            size, where = live.pop(e["addr"])
            total -= size
            recent.append(f"  free  {size / 2**20:8.1f} MiB  {where}")
        elif action == "oom":
            close_step()
            print(f"out of memory in step {step}, asking {e['size'] / 2**20:.1f} MiB "
                  f"(device free {e.get('device_free', 0) / 2**20:.1f} MiB); traced live "
                  f"{total / 2**20:.1f} MiB:")
            print(grouped(live, args.top))
            print("the last allocations and frees:")
            print("\n".join(recent[-40:]))
            return
        recent = recent[-40:]
    close_step()
    print("no out-of-memory error in the trace")


if __name__ == "__main__":
    main()
