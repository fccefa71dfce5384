# SPDX-License-Identifier: Apache-2.0
"""The CPU a recomputed block costs a step, by how it is recomputed, on a model small enough
that the CPU issuing the work is the whole step (as a LoRA step over a 14B base is on the GPU
machine's host: bench/README.md). A Qwen-shaped decoder of 48 blocks (hidden 64) with LoRA
adapters, trained through wrap() on the CPU with 30 blocks recomputed:

  keep           no block recomputed (the floor: what the step costs without recompute)
  reentrant      trainstream's recompute (torch's reentrant checkpoint)
  non_reentrant  torch's non-reentrant checkpoint, which trainstream used before: two Python
                 hooks per saved tensor

Each mode in a fresh process; the median of 5 runs of 10 steps after 3 warm-up steps. The
difference from ``keep`` is what recomputing costs: the forward run again, and the machinery.

    python bench/recompute_overhead.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("keep", "reentrant", "non_reentrant")
RECOMPUTED, LAYERS, STEPS, RUNS = 30, 48, 10, 5


def worker(mode: str) -> dict:
    import torch
    import torch.utils.checkpoint

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from qwen_shape import DecoderConfig, add_lora, build, lm_loss

    import trainstream
    import trainstream.memory.recompute

    torch.set_num_threads(1)
    if mode == "non_reentrant":
        trainstream.memory.recompute._recomputed = (
            lambda module, run, args, kwargs: torch.utils.checkpoint.checkpoint(
                run, *args, use_reentrant=False, **kwargs))
    config = DecoderConfig(vocab=256, dim=64, layers=LAYERS, heads=4, kv_heads=2, mlp=128)
    torch.manual_seed(0)
    model = build(config, torch.float32, device="cpu", init_device="cpu")
    add_lora(model, r=4)
    recompute = False if mode == "keep" else list(range(1, RECOMPUTED + 1))
    model, opt = trainstream.wrap(model, lr=1e-4, param_offload=False, activation_offload=False,
                                  recompute=recompute)
    g = torch.Generator().manual_seed(0)

    def step():
        idx = torch.randint(0, config.vocab, (1, 65), generator=g)
        lm_loss(model, idx).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    runs = []
    for _ in range(RUNS):
        start = time.perf_counter()
        for _ in range(STEPS):
            step()
        runs.append((time.perf_counter() - start) / STEPS)
    return {"mode": mode, "step_ms": round(1e3 * statistics.median(runs), 2),
            "runs_ms": [round(1e3 * r, 2) for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--worker", mode], check=True,
                             capture_output=True, text=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    keep = rows["keep"]["step_ms"]
    print(f"{LAYERS} blocks, {RECOMPUTED} recomputed, CPU, median of {RUNS} x {STEPS} steps")
    for mode, row in rows.items():
        extra = row["step_ms"] - keep
        row["recompute_ms"] = round(extra, 2)
        per_block = f", {1e3 * extra / RECOMPUTED:.0f} us per recomputed block" if mode != "keep" \
            else " (no recompute: the floor)"
        print(f"  {mode:14s} {row['step_ms']:8.2f} ms/step{per_block}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "recompute_overhead", "date": time.strftime("%Y-%m-%d"),
                       "host": platform.node(), "processor": platform.processor(),
                       "rows": list(rows.values())}, f, indent=1)


if __name__ == "__main__":
    main()
