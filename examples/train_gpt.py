# SPDX-License-Identifier: Apache-2.0
"""Trains a GPT through trainstreamd: ``model, optimizer = trainstream.wrap(model, optimizer)``.

On a GPU, the default is a 1.6B-parameter GPT under a 24 GB VRAM cap: its fp32 weights,
gradients and AdamW moments need 25.8 GB, so stock PyTorch runs out of memory, while through
the daemon only the weights and activations stay in VRAM (gradients leave during backward, the
update runs on the host, new weights come back before their next use). On a machine without a
GPU, a small GPT trains on the CPU through the same call.

    python examples/train_gpt.py [--preset tiny|124m|1.6b] [--steps N] [--vram-gb 24]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainstream  # noqa: E402
from gpt import GPT, PRESETS, loss_on, synthetic_batch  # noqa: E402


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1.6b" if cuda else "tiny")
    parser.add_argument("--steps", type=int, default=20 if cuda else 60)
    parser.add_argument("--batch", type=int, default=4 if cuda else 16)
    parser.add_argument("--seq", type=int, default=512 if cuda else 64)
    parser.add_argument("--lr", type=float, default=3e-4 if cuda else 3e-3)
    parser.add_argument("--vram-gb", type=float, default=24.0,
                        help="cap this process's VRAM (torch.cuda.set_per_process_memory_fraction)")
    parser.add_argument("--hold-seconds", type=float, default=0.0,
                        help="keep the session open this long after training (to inspect it)")
    args = parser.parse_args()
    config = PRESETS[args.preset]
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, args.vram_gb * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        print(f"VRAM capped at {fraction * total / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
    torch.manual_seed(0)
    with device:
        model = GPT(config)
    n = sum(p.numel() for p in model.parameters())
    state = 16 * n
    size = f"{state / 2**30:.1f} GiB" if state >= 2**30 else f"{state / 2**20:.1f} MiB"
    print(f"GPT '{args.preset}': {n / 1e6:,.1f}M parameters; fp32 weights + gradients + AdamW "
          f"moments = {size}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = trainstream.wrap(model, optimizer, max_grad_norm=1.0)
    session = model._trainstream_session
    print(f"session {session.client.session_id} on {session.client.socket_path}"
          f"{' (embedded daemon)' if session.client.embedded else ''}")

    start = time.perf_counter()
    for step in range(args.steps):
        begin = time.perf_counter()
        loss = loss_on(model, synthetic_batch(config, args.batch, args.seq, step, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            if cuda:
                torch.cuda.synchronize()
            peak = (f"  peak VRAM {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
                    if cuda else "")
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm "
                  f"{optimizer.last_grad_norm or 0:.3f}  "
                  f"{1000 * (time.perf_counter() - begin):.0f} ms"
                  f"{peak}", flush=True)
    stats = optimizer.stats()
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s on {device}; the daemon's "
          f"last update moved {stats['last_step']['gbps']:.1f} GB/s "
          f"({stats['isa']} x{stats['threads']} threads); optimizer runs on {stats['runs_on']}")
    for event in trainstream.memory_report(model)["events"]:
        if event["kind"].startswith("client.wrap"):
            print(f"  {event['kind']}: {event['message']}")
    time.sleep(args.hold_seconds)
    trainstream.unwrap(model)


if __name__ == "__main__":
    main()
