# SPDX-License-Identifier: Apache-2.0
"""Where does training memory live? Trains a few steps through ``trainstream.wrap()`` and checks,
each with PASS or FAIL and its numbers, that the optimizer state is in trainstreamd's memory
(not this process's, nor the GPU's beyond what the plan said it keeps there), that gradients
leave the GPU (or, on a CPU, are the daemon's shared slots), and that the daemon's pinned memory
holds the job. Exits 1 when a check fails.

    python examples/verify_ram_offload.py [--model tiny-qwen2|qwen2.5-1.5b|PATH] [--lora]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import model_for, vocabulary  # noqa: E402

import trainstream  # noqa: E402

MIB = 2 ** 20


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b" if cuda else "tiny-qwen2")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    device = "cuda" if cuda else "cpu"
    model = model_for(options.model, "lora" if options.lora else "full", torch.float32)
    trained = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trained)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(trained, lr=1e-5), device=device)
    g = torch.Generator().manual_seed(0)
    grads_left, seen = True, 0
    for _ in range(options.steps):
        x = torch.randint(0, vocabulary(model), (2, 64), generator=g).to(device)
        model(input_ids=x, labels=x).loss.backward()
        if cuda:  # before step(): a gradient still on the GPU would be here
            grads_left &= all(p.grad is None or not p.grad.is_cuda for p in trained)
            seen += opt.stats()["tensors"]
        else:  # each gradient is the daemon's shared slot, written in place by backward
            grads = [(i, p.grad) for i, p in enumerate(opt.trained_params) if p.grad is not None]
            grads_left &= all(g.data_ptr() == opt.host.grad(i).data_ptr() for i, g in grads)
            seen += len(grads)
        opt.step()
        opt.zero_grad()
    stats = opt.stats()
    report = trainstream.memory_report(model)
    in_vram = stats["gpu_state"]["moment_bytes"]  # the plan's own choice, said in its event
    held_here = sum(t.numel() * t.element_size() for state in opt.state.values()
                    for t in state.values() if torch.is_tensor(t) and t.numel() > 1)
    moments = 8 * count
    checks = [
        ("the optimizer state is in trainstreamd",
         stats["state_bytes"] + in_vram >= moments,
         f"{stats['state_bytes'] / MIB:,.1f} MiB in the daemon for {count:,} trained "
         f"parameters (their two fp32 moments alone: {moments / MIB:,.1f} MiB)"),
        ("no optimizer state in this process beyond the plan's",
         held_here <= in_vram,
         f"{held_here / MIB:,.1f} MiB held by the optimizer here; the plan keeps "
         f"{in_vram / MIB:,.1f} MiB of moments in VRAM"),
        ("gradients leave the GPU during backward" if cuda else
         "gradients are the daemon's shared slots", grads_left and seen > 0,
         f"{seen} gradients seen over {options.steps} steps"),
        ("the daemon's pinned memory holds the job",
         report["pinned"]["daemon_reserved"] >= stats["state_bytes"],
         f"{report['pinned']['daemon_reserved'] / MIB:,.1f} MiB reserved by the daemon"),
    ]
    if cuda:
        stock = sum(p.numel() * p.element_size() for p in model.parameters()) + 2 * moments
        peak = torch.cuda.max_memory_allocated()
        checks.append(("the GPU held less than the weights and moments stock AdamW needs",
                       peak < stock, f"peak {peak / MIB:,.0f} MiB, stock's floor "
                                     f"{stock / MIB:,.0f} MiB"))
    failed = 0
    for name, ok, numbers in checks:
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f": {numbers}" if numbers else ""))
    trainstream.unwrap(model)
    print("verdict:", "PASS" if not failed else f"FAIL ({failed} of {len(checks)} checks)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
