# SPDX-License-Identifier: Apache-2.0
"""One VRAM copy of a frozen base for every process on a GPU: 1, 2 and 4 processes training
LoRA r=16 (1x512) on a Qwen2.5-14B-shaped NF4 base, each either reading the daemon's GPU pool
(attach_base(gpu_pool=True)) or holding its own copy on the GPU (the alternative).

    python bench/gpu_pool.py [--processes 1 2 4] [--format nf4] [--dir DIR] [--json out.json]

For each count and mode, the processes start together, load (or find) the shared host base,
build the model with its adapters, then attach the base one after another while the GPU's used
memory (cudaMemGetInfo, the whole device) is read before and after each attach; then they all
train at once and each reports its median step time; last, one at a time, each times its
kernels dequantizing every frozen projection once (GB/s of stored base read), the one part of a
step where reading a pool could differ from reading a private copy, measured without the CPU
noise of a whole step. The bound for VRAM is one copy of the base (plus, for the pool, the
daemon's own CUDA context on that GPU); for the step time and the read speed it is the same
process count with private copies. The checkpoint is bench/shared_base.py's. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from bench_daemon import private_daemon  # noqa: E402
from qwen_shape import CONFIGS, lm_loss  # noqa: E402
from shared_base import checkpoint_bytes  # noqa: E402
from step_bench import median_step_s  # noqa: E402

from base_lora import PRESET, adapters_on_gpu, checkpoint_name, lora_model  # noqa: E402

SEQ, WARMUP, MEASURED = 512, 4, 8


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def say(**what) -> None:
    print(json.dumps(what), flush=True)


def worker(folder: str, mode: str, fmt: str) -> None:
    """One training process, driven over stdin: "attach", then "train"."""
    import trainstream

    model = lora_model()
    adapters_on_gpu(model)
    base = trainstream.load_base(folder, format=fmt, progress=False)
    torch.cuda.synchronize()
    say(ready=True)
    sys.stdin.readline()
    before = used_bytes()
    began = time.perf_counter()
    trainstream.attach_base(model, base, device="cuda", rename=checkpoint_name,
                            gpu_pool=mode == "pool")
    torch.cuda.synchronize()
    say(attached_bytes=used_bytes() - before, attach_s=round(time.perf_counter() - began, 2))
    sys.stdin.readline()
    model, opt = trainstream.wrap(model, lr=1e-4, device="cuda")
    g = torch.Generator().manual_seed(0)

    def step():
        idx = torch.randint(0, CONFIGS[PRESET].vocab, (1, SEQ + 1), generator=g).cuda()
        lm_loss(model, idx).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(WARMUP):
        step()
    say(step_s=round(median_step_s(step, MEASURED), 4),
        peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        gpu_pool=trainstream.memory_report(model).get("gpu_pool"))
    sys.stdin.readline()
    # What the pool could change: how fast the kernels read the base. Every frozen projection
    # dequantized once, timed on the GPU, with the other processes idle.
    from trainstream.frozen.linear import BaseLinear, _weight

    layers = [m for m in model.modules() if isinstance(m, BaseLinear)]
    stored = sum(m.data.numel() * m.data.element_size() + m.scales.numel() for m in layers)

    def read_all():
        for m in layers:
            _weight(m, m.data.device)

    read_all()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        read_all()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 3e3
    say(base_read_s=round(seconds, 5), base_read_gbps=round(stored / seconds / 1e9, 1))
    sys.stdin.readline()


def run(script: str, folder: str, fmt: str, mode: str, count: int, socket: str) -> dict:
    env = dict(os.environ, TRAINSTREAM_SOCKET=socket)
    procs = [subprocess.Popen([sys.executable, script, "--worker", mode, "--format", fmt,
                               "--dir", os.path.dirname(folder)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for _ in range(count)]

    def tell(p, line):
        p.stdin.write(line + "\n")
        p.stdin.flush()

    def hear(p):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a {mode} worker ended (exit {p.wait()})")
        return json.loads(line)

    try:
        for p in procs:
            hear(p)
        before = used_bytes()
        attached = []
        for p in procs:  # one at a time: each reads the GPU while the others wait
            tell(p, "attach")
            attached.append(hear(p))
        after = used_bytes()
        for p in procs:
            tell(p, "train")
        trained = [hear(p) for p in procs]
        read = []
        for p in procs:  # one at a time: a kernel reading the base alone on the GPU
            tell(p, "read")
            read.append(hear(p))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    tell(p, "exit")
                except BrokenPipeError:
                    pass
            p.wait(timeout=120)
    return {"mode": mode, "processes": count, "vram_for_bases": after - before,
            "attached_bytes": [a["attached_bytes"] for a in attached],
            "attach_s": [a["attach_s"] for a in attached],
            "step_s": [t["step_s"] for t in trained],
            "peak_allocated_gib": [t["peak_allocated_gib"] for t in trained],
            "base_read_gbps": [r["base_read_gbps"] for r in read],
            "gpu_pool": trained[0]["gpu_pool"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--format", default="nf4")
    parser.add_argument("--dir", default="/var/tmp/ts-bench-base")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each count, pool and private alternating (step times on "
                             "one GPU vary from run to run)")
    parser.add_argument("--json", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = os.path.join(args.dir, PRESET)
    if args.worker:
        worker(folder, args.worker, args.format)
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"checkpoint: {folder}", flush=True)
    file_bytes = checkpoint_bytes(folder, CONFIGS[PRESET])
    torch.zeros(1, device="cuda")  # this process's own context, before any reading
    rows = []
    with private_daemon(f"{int(file_bytes * 1.3) >> 20}M", "--base_keep_warm_s=600") as socket:
        import trainstream

        with trainstream.connect(socket, job_id="bench") as client:
            base = trainstream.load_base(folder, format=args.format, client=client,
                                         progress=False)  # held for every run: loaded once
            base_bytes = base.stored_bytes
            print(f"base: {args.format}, {base_bytes / 1e9:.2f} GB (loaded in "
                  f"{base.load_seconds:.1f} s)", flush=True)
            for count in args.processes:
                for repeat, mode in [(r, m) for r in range(args.repeats)
                                     for m in ("pool", "private")]:
                    row = run(os.path.abspath(__file__), folder, args.format, mode, count,
                              socket)
                    row.update(base_bytes=base_bytes, repeat=repeat)
                    rows.append(row)
                    print(f"{count} x {mode:7s}: VRAM for the base(s) "
                          f"{row['vram_for_bases'] / 1e9:6.2f} GB = "
                          f"{row['vram_for_bases'] / base_bytes:4.2f}x one copy; step "
                          f"{1e3 * statistics.mean(row['step_s']):6.1f} ms (each: "
                          f"{', '.join(f'{1e3 * s:.1f}' for s in row['step_s'])}); kernels "
                          f"read the base at {statistics.mean(row['base_read_gbps']):.0f} GB/s",
                          flush=True)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump({"bench": "gpu_pool", "preset": PRESET,
                                       "format": args.format, "seq": SEQ,
                                       "gpu": torch.cuda.get_device_name(),
                                       "torch": torch.__version__, "rows": rows}, f, indent=1)
                step = {m: statistics.median(statistics.mean(r["step_s"]) for r in rows
                                             if r["processes"] == count and r["mode"] == m)
                        for m in ("pool", "private")}
                print(f"  {count} processes, median of {args.repeats} runs: pool / private step "
                      f"{step['pool'] / step['private']:.3f} ({1e3 * step['pool']:.1f} vs "
                      f"{1e3 * step['private']:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
