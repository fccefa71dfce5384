# SPDX-License-Identifier: Apache-2.0
"""How long the daemon takes to answer GetStatus (what `tsctl status` and every client's
status() call ask) as the buffers it holds grow: 0, 10,000 and 40,000 small buffers in one
session. An outside test measured 0.2 ms with none and 4 ms with 40,000 before the daemon kept
running totals; the bound is ListSessions with its one session on the same socket (a gRPC round
trip with next to no work), the doorbell's round trip beside it.

    python bench/status_latency.py [--buffers 0 10000 40000] [--calls 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import trainstream
from bench_daemon import private_daemon


def _median_ms(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--buffers", type=int, nargs="+", default=[0, 10_000, 40_000])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    with private_daemon("4G") as socket:
        with trainstream.connect(socket, job_id="status-bench") as client:
            held = []
            for target in sorted(args.buffers):
                began = time.perf_counter()
                while len(held) < target:
                    buffer = client.allocate(f"b{len(held)}", 4096, tag="bench")
                    held.append(buffer)
                allocate_s = time.perf_counter() - began
                status_ms = _median_ms(client.status, args.calls)
                rpc_ms = _median_ms(client.sessions, args.calls)
                ping_ms = _median_ms(client.ping, args.calls)
                rows.append({"buffers": target, "status_ms": status_ms, "rpc_bound_ms": rpc_ms,
                             "doorbell_ms": ping_ms, "allocate_s": allocate_s})
    print(f"{'buffers':>8} {'GetStatus ms':>12} {'ListSessions ms (bound)':>24} "
          f"{'doorbell ms':>12}")
    for r in rows:
        print(f"{r['buffers']:>8} {r['status_ms']:>12.3f} {r['rpc_bound_ms']:>24.3f} "
              f"{r['doorbell_ms']:>12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "status_latency", "date": time.strftime("%Y-%m-%d"),
                       "host": platform.node(), "cores": os.cpu_count(),
                       "commit": os.environ.get("TS_COMMIT", ""), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
