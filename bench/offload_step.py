# SPDX-License-Identifier: Apache-2.0
"""Training step time and peak VRAM of a GPT, trainstream.wrap() beside what a user would
otherwise run, on one GPU, in one run (each configuration in a fresh process):

(a) a model that fits (``--fits``, GPT-2 small's shape): stock PyTorch with fused GPU AdamW
    against ``wrap(offload="auto")``, which measures two steps and moves to fused GPU AdamW;
(b) a full fine-tune that fits only with offload (``--big``, 1.6B parameters under a 24 GB VRAM
    cap): ``wrap`` against stock PyTorch (runs out of memory), PyTorch's own CPU offload (FSDP2
    ``fully_shard`` with ``CPUOffloadPolicy``, world size 1), and the lower bound
    max(GPU compute, PCIe time for the bytes moved, host optimizer time), each measured here:
    compute as forward+backward with the weights resident and no optimizer; PCIe as the bytes
    wrap moves (gradients out, fp32 weights back: 4 + 4 B per parameter, 2 + 4 with bf16
    gradients) over pinned copy bandwidth measured in this run, the two directions overlapping;
    the host optimizer as the daemon's update pass over all workers (summed worker seconds /
    workers). ``wrap`` keeps fp32 moments and gradients (exact); ``wrap_bf16`` sends bf16
    gradients and keeps bf16 moments (stochastic rounding), fp32 master weights either way.
(c) ``optimizer_mode="gpu"`` in either case (``wrap_gpu``, ``wrap_gpu_bf16``: fp32 or bf16
    moments): the update runs on the GPU as each gradient is final, reading and writing the
    moments in the daemon's pinned memory over PCIe; its bound is max(compute, the moments'
    bytes each way over the slower direction). In the fitting case it keeps offload=True (the
    mode itself is measured, not a switch to fused GPU AdamW).

    python bench/offload_step.py [--fits] [--big] [--json out.json]
    (TS_BENCH_PROFILE=1: each row also runs two steps under torch.profiler and two under
    cProfile, and keeps the ops that took the most GPU and CPU time and the Python functions
    that took the most)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from gpt import GPT, PRESETS, loss_on, synthetic_batch  # noqa: E402
from step_bench import (add_worker_arguments, answered_as_worker,  # noqa: E402
                        pinned_bandwidth, profiled_steps, run_worker)

CASES = {
    "fits": dict(preset="124m", batch=8, seq=1024, vram_gb=0, warmup=5, steps=40),
    "big": dict(preset="1.6b", batch=4, seq=1024, vram_gb=24, warmup=3, steps=6),
}


def cap_vram(gb: float) -> None:
    if gb > 0:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 2**30 / total), 0)


def timed_steps(step, warmup: int, steps: int) -> tuple[float, int]:
    """Seconds per step over `steps` steps after `warmup`, and the peak VRAM of those steps."""
    for s in range(warmup):
        step(s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for s in range(warmup, warmup + steps):
        step(s)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated()


def worker(mode: str, case: dict) -> dict:
    config = PRESETS[case["preset"]]
    cap_vram(case["vram_gb"] if mode != "compute" else 0)
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    row = {"mode": mode, "preset": case["preset"], "parameters": config.parameters,
           "batch": case["batch"], "seq": case["seq"], "vram_cap_gb": case["vram_gb"]}
    batches = {}

    def data(s):
        if s not in batches:
            batches[s] = synthetic_batch(config, case["batch"], case["seq"], s, device)
        return batches[s]

    try:
        with device:
            model = GPT(config)
        if mode == "stock":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(s):
                loss_on(model, data(s)).backward()
                opt.step()
                opt.zero_grad()
        elif mode in ("wrap", "wrap_bf16", "wrap_gpu", "wrap_gpu_bf16"):
            import trainstream

            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            began = time.perf_counter()
            # *_bf16: bf16 moments (stochastic rounding) and, on the host path, gradients sent
            # in bf16; the master weights stay fp32.
            low = mode.endswith("_bf16")
            on_gpu = mode.startswith("wrap_gpu")
            options = dict(optimizer_mode="gpu", offload=True) if on_gpu else dict(
                gradient_dtype="bfloat16" if low else None)
            model, opt = trainstream.wrap(model, opt,
                                          moment_dtype="bfloat16" if low else "float32",
                                          **options)
            row["wrap_s"] = round(time.perf_counter() - began, 2)

            def step(s):
                loss_on(model, data(s)).backward()
                opt.step()
                opt.zero_grad()
        elif mode == "compute":
            # Forward and backward only, every gradient dropped as it lands.
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))

            def step(s):
                loss_on(model, data(s)).backward()
        elif mode == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0,
                                    world_size=1)
            for block in model.blocks:
                fully_shard(block, offload_policy=CPUOffloadPolicy())
            fully_shard(model, offload_policy=CPUOffloadPolicy())
            try:  # the fastest CPU AdamW torch offers, when it takes the sharded parameters
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
                row["fsdp_optimizer"] = "fused"
            except Exception:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                row["fsdp_optimizer"] = "default"

            def step(s):
                loss_on(model, data(s)).backward()
                opt.step()
                opt.zero_grad()
        else:
            raise ValueError(mode)
        warmup, steps = case["warmup"], case["steps"]
        if mode == "fsdp2":  # seconds a step: fewer of them tell the same
            warmup, steps = 1, 3
        seconds, peak = timed_steps(step, warmup, steps)
        row.update(step_s=round(seconds, 4), peak_vram_gib=round(peak / 2**30, 2))
        ran = warmup + steps
        if os.environ.get("TS_BENCH_PROFILE") == "1":  # where a step's time goes
            row.update(profiled_steps(step, ran))
            ran += 4
        if mode.startswith("wrap"):
            stats = opt.stats()
            row["runs_on"] = stats["runs_on"]
            row["gpu_updated_elements"] = stats["staged_state"]["elements"]
            # Bytes over PCIe a step, each way, as the optimizer counted them (the mapped
            # kernel's state; the host path's gradients out and weights back).
            row["pcie_to_device_bytes_per_step"] = opt.bytes_to_device // ran
            row["pcie_to_host_bytes_per_step"] = opt.bytes_to_host // ran
            last = stats.get("last_step", {})
            threads = max(1, int(stats.get("threads", 1)))
            row["host_update_s"] = round(float(last.get("update_seconds", 0)) / threads, 4)
            report = trainstream.memory_report(model)
            row["events"] = [e["message"] for e in report["events"]
                             if e["kind"] in ("client.wrap.offload", "client.optimizer.mode")]
            row["hooks"] = report.get("hooks")  # the CPU time the optimizer's hooks took
    except torch.OutOfMemoryError as e:
        row.update(oom=True, error=str(e).splitlines()[0][:200],
                   peak_vram_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fits", action="store_true")
    parser.add_argument("--big", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    add_worker_arguments(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker, CASES):
        return
    if not torch.cuda.is_available():
        sys.exit("offload_step.py needs a CUDA GPU")
    from bench_daemon import private_daemon

    cases = [c for c, on in (("fits", args.fits), ("big", args.big)) if on] or ["fits", "big"]
    rows = []
    bandwidth = pinned_bandwidth()
    print(f"pinned copies: host->device {bandwidth['h2d_gbps']} GB/s, "
          f"device->host {bandwidth['d2h_gbps']} GB/s")
    with private_daemon("80%") as socket:
        for case_name in cases:
            modes = args.modes or (["stock", "compute", "wrap", "wrap_gpu"] if case_name == "fits"
                                   else ["stock", "compute", "wrap", "wrap_bf16", "wrap_gpu",
                                         "wrap_gpu_bf16", "fsdp2"])
            by_mode = {}
            # A model that fits steps in tens of milliseconds: each configuration runs in
            # `rounds` fresh processes, alternating, and keeps its fastest.
            rounds = args.rounds if case_name == "fits" else 1
            for _ in range(rounds):
                for mode in modes:
                    row = run_worker(__file__, mode, case_name,
                                     socket if mode.startswith("wrap") else None, 1800)
                    row["case"] = case_name
                    print(json.dumps(row), flush=True)
                    best = by_mode.get(mode)
                    if best is None or row.get("step_s", 1e9) < best.get("step_s", 1e9):
                        by_mode[mode] = row
            rows.extend(by_mode.values())
            report(case_name, by_mode, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "offload_step", "date": time.strftime("%Y-%m-%d"),
                       "host": platform.node(), "gpu": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "bandwidth": bandwidth, "rows": rows}, f,
                      indent=1)


def fmt(row: dict) -> str:
    if row.get("oom"):
        return f"out of memory (peak {row['peak_vram_gib']} GiB)"
    if row.get("failed"):
        return "failed: " + row.get("stderr", "").strip().splitlines()[-1][:120]
    return f"{1000 * row['step_s']:.1f} ms/step, peak {row['peak_vram_gib']} GiB"


def report(case_name: str, rows: dict, bandwidth: dict) -> None:
    print(f"\n== {case_name}")
    for mode, row in rows.items():
        print(f"  {mode:13s} {fmt(row)}")
    wrap = rows.get("wrap", {})
    if case_name == "fits" and "step_s" in wrap and "step_s" in rows.get("stock", {}):
        print(f"  wrap(offload='auto') / stock: {wrap['step_s'] / rows['stock']['step_s']:.3f} "
              f"(runs on {wrap.get('runs_on')})")
    if "step_s" in rows.get("wrap_gpu", {}) and "step_s" in wrap:
        print(f"  optimizer_mode='gpu' / 'cpu': "
              f"{rows['wrap_gpu']['step_s'] / wrap['step_s']:.3f}")
    compute = rows.get("compute", {}).get("step_s", 0.0)
    for mode in ("wrap_gpu", "wrap_gpu_bf16"):
        row = rows.get(mode, {})
        if "step_s" not in row:
            continue
        # The moments (2 x 4 or 2 x 2 bytes an element) read and written over the link.
        state = (4 if mode == "wrap_gpu_bf16" else 8) * row["gpu_updated_elements"]
        pcie = state / (min(bandwidth["h2d_gbps"], bandwidth["d2h_gbps"]) * 1e9)
        bound = max(compute, pcie)
        row["lower_bound_s"] = round(bound, 4)
        print(f"  {mode}: lower bound {1000 * bound:.1f} ms = max(compute {1000 * compute:.1f}, "
              f"PCIe {1000 * pcie:.1f} for {state / 1e9:.2f} GB each way); step / bound "
              f"{row['step_s'] / bound:.2f}; counted over PCIe a step: "
              f"{row.get('pcie_to_device_bytes_per_step', 0) / 1e9:.2f} GB to the GPU, "
              f"{row.get('pcie_to_host_bytes_per_step', 0) / 1e9:.2f} GB back")
    if case_name != "big":
        return
    fsdp = rows.get("fsdp2", {})
    for mode in ("wrap", "wrap_bf16"):
        row = rows.get(mode, {})
        if "step_s" not in row:
            continue
        n = row["parameters"]
        grad_bytes = 2 if mode == "wrap_bf16" else 4
        pcie = max(grad_bytes * n / (bandwidth["d2h_gbps"] * 1e9),
                   4 * n / (bandwidth["h2d_gbps"] * 1e9))
        host = row.get("host_update_s", 0.0)
        bound = max(compute, pcie, host)
        row["lower_bound_s"] = round(bound, 4)
        print(f"  {mode}: lower bound {1000 * bound:.1f} ms = max(compute {1000 * compute:.1f}, "
              f"PCIe {1000 * pcie:.1f}, host optimizer {1000 * host:.1f}); step / bound "
              f"{row['step_s'] / bound:.2f}", end="")
        if "step_s" in fsdp:
            row["speedup_vs_fsdp2"] = round(fsdp["step_s"] / row["step_s"], 2)
            print(f"; FSDP2 CPU offload / {mode}: {fsdp['step_s'] / row['step_s']:.2f}x", end="")
        print()

if __name__ == "__main__":
    main()
