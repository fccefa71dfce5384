# SPDX-License-Identifier: Apache-2.0
"""LoRA r=16 on a Qwen2.5-14B-shaped model whose frozen weights come from a shared base held by
trainstreamd, per quantized format, under a 24 GB VRAM cap, trained through wrap(). fp8 runs
with fp8_matmul="auto" (FP8 tensor cores where they time faster, see
trainstream.frozen.fp8_matmul); "fp8:dequantize" is the same base always dequantized, the
alternative beside it.

    python bench/base_lora.py [--formats nf4 int8 fp8 fp8:dequantize nvfp4] [--seq 512]
                              [--dir DIR] [--json out.json]

The checkpoint is bench/shared_base.py's (random bf16 weights, Hugging Face names, in
--dir), written once and reused; the model's own names map onto it. Each format runs in a fresh
process: the base is loaded (or found) in the daemon, the quantized weights are copied to the
GPU once, each projection dequantizes its weight at every use (the CUDA kernel) and the
adapters train. Reported: step time (median of the
timed steps after the plan settled), peak VRAM, the base's host bytes. The bf16 base (29.5 GB,
which does not fit) is bench/memory_plan.py's qwen14b case: the plan streams it. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from bench_daemon import private_daemon  # noqa: E402
from qwen_shape import CONFIGS, LoRALinear, add_lora, build, lm_loss  # noqa: E402
from shared_base import checkpoint_bytes  # noqa: E402
from step_bench import (add_worker_arguments, answered_as_worker, median_step_s,  # noqa: E402
                        run_worker)

PRESET = "qwen2.5-14b"
WARMUP, MEASURED, VRAM_GB = 3, 5, 24


def lora_model():
    """The decoder with LoRA adapters, on the meta device (no memory): its frozen tensors come
    from the base, its adapters are made on the GPU."""
    model = build(CONFIGS[PRESET], dtype=torch.bfloat16, device="meta")
    add_lora(model, r=16)
    return model


def adapters_on_gpu(model) -> None:
    """Makes the meta model's LoRA adapters on the GPU (A as nn.Linear initialises it, B zero)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            a = torch.empty(module.lora_a.shape, dtype=torch.bfloat16, device="cuda")
            torch.nn.init.kaiming_uniform_(a, a=5 ** 0.5)
            module.lora_a = torch.nn.Parameter(a)
            module.lora_b = torch.nn.Parameter(torch.zeros(module.lora_b.shape,
                                                           dtype=torch.bfloat16, device="cuda"))


def checkpoint_name(name: str) -> str:
    """The Hugging Face name of one of this model's tensors (LoRA wraps each projection)."""
    name = name.replace(".base.", ".")
    return name if name.startswith("lm_head.") else "model." + name


def worker(variant: str, case: dict) -> dict:
    import trainstream

    fmt, _, matmul = variant.partition(":")
    row = {"format": variant, "seq": case["seq"], "vram_gb": VRAM_GB}
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, VRAM_GB * 2**30 / total), 0)
    model = lora_model()
    adapters_on_gpu(model)
    began = time.perf_counter()
    base = trainstream.load_base(case["dir"], format=fmt, progress=False)
    row["load_s"] = round(time.perf_counter() - began, 1)
    row["base_host_bytes"] = base.stored_bytes
    taken = trainstream.attach_base(model, base, device="cuda", rename=checkpoint_name,
                                    fp8_matmul=False if matmul == "dequantize" else "auto")
    row["base_linear"] = len(taken["linear"])
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise RuntimeError(f"not from the base: {left[:5]}")
    model, opt = trainstream.wrap(model, lr=1e-4, device="cuda")
    g = torch.Generator().manual_seed(0)
    vocab = CONFIGS[PRESET].vocab

    def step():
        idx = torch.randint(0, vocab, (1, case["seq"] + 1), generator=g).cuda()
        lm_loss(model, idx).backward()
        opt.step()
        opt.zero_grad()

    session = model._trainstream_session
    s = 0
    while (session.adapting and s < 12) or s < WARMUP:
        step()
        s += 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    row.update(step_s=round(median_step_s(step, MEASURED), 4),
               peak_vram_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
               settle_steps=s)
    chosen = trainstream.memory_report(model).get("fp8_matmul")
    if chosen:
        row["fp8_matmul"] = {"scaled_mm": chosen["scaled_mm"], "dequantize": chosen["dequantize"],
                             "choices": [list(c) for c in chosen["choices"]]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--formats", nargs="+",
                        default=["nf4", "int8", "fp8", "fp8:dequantize", "nvfp4"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dir", default="/var/tmp/ts-bench-base")
    parser.add_argument("--timeout", type=int, default=900)
    add_worker_arguments(parser)
    args = parser.parse_args()
    folder = os.path.join(args.dir, PRESET)
    cases = {"lora": {"seq": args.seq, "dir": folder}}
    if answered_as_worker(args, worker, cases):
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"checkpoint: {folder}", flush=True)
    file_bytes = checkpoint_bytes(folder, CONFIGS[PRESET])
    rows = []
    # Each format's base goes when its worker does: the next one needs the memory.
    with private_daemon(f"{int(file_bytes * 1.3) >> 20}M", "--base_keep_warm_s=0") as socket:
        for fmt in args.formats:
            row = run_worker(os.path.abspath(__file__), fmt, "lora", socket, args.timeout)
            rows.append(row)
            if row.get("failed"):
                print(f"{fmt:14s} failed: {row['stderr'][-800:]}", flush=True)
                continue
            tensor_cores = (f"; FP8 tensor cores in {row['fp8_matmul']['scaled_mm']} of them"
                            if "fp8_matmul" in row else "")
            print(f"{fmt:14s} {1e3 * row['step_s']:7.1f} ms/step, peak "
                  f"{row['peak_vram_gib']:5.2f} GiB, base {row['base_host_bytes'] / 1e9:5.2f} GB "
                  f"in host memory (loaded in {row['load_s']} s), {row['base_linear']} "
                  f"projections from it{tensor_cores}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"bench": "base_lora", "preset": PRESET, "gpu":
                               torch.cuda.get_device_name(), "torch": torch.__version__,
                               "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
