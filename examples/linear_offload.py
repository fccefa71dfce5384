# SPDX-License-Identifier: Apache-2.0
"""A 16-input linear model trained 20 steps through ``wrap(offload=True)`` on the CPU, against
the trainstreamd on SOCKET, as job JOB; prints this process's pid and the 20 losses. Seeded, so
two runs through any daemon print the same losses bit for bit: the check that a client in
another PID or mount namespace (a container) trains as one beside the daemon does.

    python examples/linear_offload.py SOCKET JOB
"""

import os
import sys

import torch

import trainstream

torch.manual_seed(0)
model, opt = trainstream.wrap(torch.nn.Linear(16, 1), lr=0.05, device="cpu", offload=True,
                              socket=sys.argv[1], job_id=sys.argv[2])
x = torch.randn(64, 16)
y = x.sum(1, keepdim=True)
losses = []
for _ in range(20):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
trainstream.unwrap(model)
print(os.getpid(), *losses, flush=True)
