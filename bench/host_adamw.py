# SPDX-License-Identifier: Apache-2.0
"""Host AdamW on the full mixed-precision step, three ways, in one run:

1. trainstream's pass (bench/host_adamw_bench, the daemon's kernel and thread pool): bf16
   gradient in, fp32 master and moments (or bf16 moments), bf16 parameter out, in one pass;
2. the memory bound: an in-place stream over the same arrays with the same threads;
3. torch.optim.AdamW(fused=True) on the CPU doing the same job with the conversions it needs
   (bf16 gradient -> fp32 into a reused buffer, fused step on fp32 master weights, fp32 -> bf16
   parameter).

GB/s counts the bytes the update must move: 28 per parameter with fp32 moments
(grad 2 + master 4+4 + moments 8+8 + param 2) and 20 with bf16 moments.

    python bench/host_adamw.py --params 10M 100M 1B [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].isalpha() else int(text)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (0 when the kernel does not say)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for index in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best


def torch_fused(n: int, threads: int, repeats: int) -> float:
    """Median seconds of one torch fused CPU AdamW step on the mixed-precision job."""
    torch.set_num_threads(threads)
    master = torch.nn.Parameter(torch.ones(n, dtype=torch.float32))
    grad_bf16 = torch.full((n,), 0.5, dtype=torch.bfloat16)
    param_bf16 = torch.empty(n, dtype=torch.bfloat16)
    # The best a user can do: the fp32 gradient buffer is allocated once and reused, so no step
    # pays for page faults, only for the conversions.
    master.grad = torch.empty(n, dtype=torch.float32)
    opt = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.01, fused=True)

    def step():
        master.grad.copy_(grad_bf16)  # bf16 -> fp32, the conversion torch needs
        opt.step()
        param_bf16.copy_(master.detach())  # and back to the model's dtype

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--params", nargs="+", default=["10M", "100M"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bench", default=os.path.join(HERE, "..", "build", "py", "bench",
                                                        "host_adamw_bench"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    sizes = [parse_count(p) for p in args.params]
    rows = []
    llc = last_level_cache_bytes()
    for n in sizes:
        out = subprocess.run([args.bench, f"--params={n}", f"--threads={args.threads}",
                              f"--repeats={args.repeats}"], capture_output=True, text=True,
                             check=True).stdout
        ours = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        t = torch_fused(n, args.threads, args.repeats)
        for r in ours:
            r["torch_fused_s"] = round(t, 6)
            r["torch_fused_gbps_same_bytes"] = round(n * r["bytes_per_param"] / t / 1e9, 2)
            r["speedup_vs_torch"] = round(t / r["adamw_s"], 3)
            r["of_stream"] = round(r["adamw_gbps"] / r["stream_gbps"], 4)
            # Arrays that fit in the last-level cache: the stream then measures the cache's
            # bandwidth, not memory's, and the update's arithmetic can become the limit.
            r["fits_in_cache"] = n * r["bytes_per_param"] <= llc
            rows.append(r)
    print(f"{'params':>12} {'moments':>7} {'ours GB/s':>10} {'stream GB/s':>12} {'of stream':>9} "
          f"{'ours ms':>9} {'torch fused ms':>15} {'speedup':>8}  (* arrays fit in the "
          f"{llc / 2**20:.0f} MiB last-level cache)")
    for r in rows:
        print(f"{r['params']:>12} {r['moments']:>7} {r['adamw_gbps']:>10.1f} "
              f"{r['stream_gbps']:>12.1f} {100 * r['of_stream']:>8.1f}% {1e3 * r['adamw_s']:>9.2f} "
              f"{1e3 * r['torch_fused_s']:>15.2f} {r['speedup_vs_torch']:>7.2f}x"
              f"{'  *' if r['fits_in_cache'] else ''}")
    result = {"bench": "host_adamw", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "cpu_count": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
              "last_level_cache_bytes": llc,
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
