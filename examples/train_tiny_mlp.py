# SPDX-License-Identifier: Apache-2.0
"""Trains a small MLP whose parameters and gradients live in trainstreamd's shared memory.

Each parameter and gradient is a zero-copy view of a daemon buffer, so `tsctl memory` and
`tsctl sessions` show the model while it trains. (The optimizer still runs here; moving it into
the daemon is what `trainstream.wrap()` adds.)
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
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    client = trainstream.connect(job_id="tiny-mlp")
    print(f"session {client.session_id} on {client.socket_path}"
          f"{' (embedded daemon)' if client.embedded else ''}")
    for name, p in model.named_parameters():
        # The parameter and its gradient become views of daemon buffers, keeping their values.
        weights = client.allocate(f"{name}", p.numel() * 4, tag="param").tensor(
            torch.float32, p.shape)
        weights.copy_(p.detach())
        p.data = weights
        p.grad = client.allocate(f"{name}.grad", p.numel() * 4, tag="grad").tensor(
            torch.float32, p.shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    x = torch.randn(4096, 32)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    start = time.perf_counter()
    for step in range(args.steps):
        batch = torch.randint(0, x.shape[0], (256,))
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        optimizer.zero_grad(set_to_none=False)  # keep the gradients in their daemon buffers
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"{args.steps} steps in {time.perf_counter() - start:.2f} s; "
          f"daemon memory: {client.memory()['reserved_bytes'] / 2**20:.0f} MiB reserved")
    time.sleep(args.hold_seconds)
    client.close()


if __name__ == "__main__":
    main()
