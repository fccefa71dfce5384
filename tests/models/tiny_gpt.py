# SPDX-License-Identifier: Apache-2.0
"""A small GPT (token and position embeddings, pre-norm blocks of causal attention and MLP, a
tied head) for tests and examples: small enough for a CPU, shaped like the real thing."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

# The attention is the examples' GPT's (examples/gpt.py), not a copy of it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from gpt import Attention  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2,
                 context: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(step: int, size: int = 8, context: int = 32, vocab: int = 128, device: str = "cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (size, context + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_steps(model: nn.Module, opt, steps: int, device: str = "cpu", start: int = 0) -> list:
    """Trains on the fixed batches ``start`` .. ``start + steps - 1``; returns the losses."""
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, device=device)
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest difference between the two models' parameters."""
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))
