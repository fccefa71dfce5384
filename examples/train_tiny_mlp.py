# SPDX-License-Identifier: Apache-2.0
"""Trains a small MLP through trainstreamd with one line: ``trainstream.wrap(model, optimizer)``.

The optimizer state, the gradients and the AdamW update live in the daemon; on a CPU-only
machine the model's weights themselves sit in the daemon's shared memory and are updated there
in place. ``tsctl optimizers`` shows the job while it trains.
"""

import argparse
import time

import torch

import trainstream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hold-seconds", type=float, default=0.0,
                        help="keep the session open this long after training (to inspect it)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer = trainstream.wrap(model, optimizer, max_grad_norm=1.0)
    session = model._trainstream_session
    print(f"session {session.client.session_id} on {session.client.socket_path}"
          f"{' (embedded daemon)' if session.client.embedded else ''}")

    device = next(model.parameters()).device
    x = torch.randn(4096, 32, device=device)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    start = time.perf_counter()
    for step in range(args.steps):
        batch = torch.randint(0, x.shape[0], (256,), device=device)
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {optimizer.last_grad_norm:.3f}")
    stats = optimizer.stats()
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s on {device}; the daemon's "
          f"last update moved {stats['last_step']['gbps']:.1f} GB/s "
          f"({stats['isa']} x{stats['threads']} threads)")
    time.sleep(args.hold_seconds)
    trainstream.unwrap(model)


if __name__ == "__main__":
    main()
