# SPDX-License-Identifier: Apache-2.0
"""How much of the host optimizer's time a training step sees, through a real daemon.

A simulated backward posts one tensor's gradient every `gap` seconds (the time backward takes to
produce it), with `gap` chosen so that backward lasts as long as the whole update. With updates
starting as each gradient lands, the step waits after the last gradient only for the last tensor's
update; with clipping (which needs the whole job's norm first) it waits for all of them. Prints the
time exposed after the last gradient for: all gradients at once (what an optimizer that starts after
backward exposes: the whole update), per-tensor updates, and clipped updates.

    python bench/optimizer_overlap.py [--tensors 24] [--elements 4M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import trainstream
from trainstream import HostOptimizer, ParameterSpec
from bench_daemon import private_daemon


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].isalpha() else int(text)


def run(client, job, tensors, elements, clip, steps, gap):
    specs = [ParameterSpec(f"w{i}", (elements,), torch.bfloat16) for i in range(tensors)]
    c = trainstream.connect(client.socket_path, job_id=job)
    opt = HostOptimizer(c, specs, groups=[dict(lr=1e-4)], max_grad_norm=clip, timeout_s=300)
    opt.load_weights([torch.zeros(elements) for _ in range(tensors)])
    grads = [torch.full((elements,), 0.01, dtype=torch.bfloat16) for _ in range(tensors)]
    for i in range(tensors):
        opt.grad(i).copy_(grads[i])
    exposed = []
    for step in range(steps + 1):
        for i in range(tensors):
            if gap:
                time.sleep(gap)  # backward producing the next gradient
            opt.post(i)
        last_post = time.perf_counter()
        opt.wait()
        if step > 0:  # the first step warms the pages
            exposed.append(time.perf_counter() - last_post)
    c.close()
    return sorted(exposed)[len(exposed) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=24)
    parser.add_argument("--elements", default="4M")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    elements = parse_count(args.elements)
    with private_daemon("90%") as socket:
        client = trainstream.connect(socket, job_id="probe")
        # All gradients at once: the whole update is exposed, as for an optimizer that starts
        # after backward. Then a backward exactly as long as that update (the hardest case for
        # overlap), posting one gradient every `gap`.
        full = run(client, "after-backward", args.tensors, elements, 0.0, args.steps, 0.0)
        gap = full / args.tensors
        rows = {"after backward (no overlap)": {"exposed_s": round(full, 6)}}
        for mode, clip in (("per-tensor (no clipping)", 0.0),
                           ("clipped (waits for the norm)", 1.0)):
            exposed = run(client, mode.split()[0], args.tensors, elements, clip, args.steps, gap)
            rows[mode] = {"exposed_s": round(exposed, 6)}
        client.close()
    params = args.tensors * elements
    print(f"{args.tensors} tensors x {elements} = {params / 1e6:.0f}M params, bf16 grads/params, "
          f"fp32 moments; gradient gap {gap * 1e3:.2f} ms")
    print(f"{'mode':32} {'exposed after the last gradient (s)':>36} {'hidden':>7}")
    for mode, r in rows.items():
        r["hidden"] = round(1 - r["exposed_s"] / full, 4)
        print(f"{mode:32} {r['exposed_s']:36.4f} {100 * r['hidden']:6.0f}%")
    result = {"bench": "optimizer_overlap", "date": time.strftime("%Y-%m-%d"),
              "host": platform.node(), "cpu_count": os.cpu_count(), "tensors": args.tensors,
              "elements": elements, "gap_s": gap, "rows": rows}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
