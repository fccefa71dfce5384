# SPDX-License-Identifier: Apache-2.0
"""A GPT for the examples and benchmarks: token and position embeddings, pre-norm blocks of
causal attention and MLP, a tied head. ``PRESETS`` names the sizes they use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    dim: int
    heads: int
    layers: int
    context: int

    @property
    def parameters(self) -> int:
        """Trainable parameters (the head is tied to the token embedding)."""
        per_block = 12 * self.dim * self.dim + 4 * self.dim  # no linear biases; two LayerNorms
        return (self.vocab * self.dim + self.context * self.dim + self.layers * per_block
                + 2 * self.dim)


PRESETS = {
    # Trains in seconds on a laptop CPU.
    "tiny": GPTConfig(vocab=256, dim=128, heads=4, layers=4, context=64),
    # GPT-2 small's shape: fits comfortably in any recent GPU with stock AdamW.
    "124m": GPTConfig(vocab=50304, dim=768, heads=12, layers=12, context=1024),
    # fp32 weights, gradients and AdamW moments: 16 bytes x 1.6B = 25.8 GB, over a 24 GB card.
    "1.6b": GPTConfig(vocab=50304, dim=2048, heads=16, layers=30, context=1024),
    # The memory plan's benchmarks: 7.3 GB and 14.4 GB of fp32 weights.
    "1.8b": GPTConfig(vocab=50304, dim=2048, heads=16, layers=34, context=1024),
    "3.6b": GPTConfig(vocab=50304, dim=2560, heads=20, layers=44, context=1024),
}


class Attention(nn.Module):
    """Causal self-attention without projection biases (as in LLaMA): a key bias would get a
    gradient that is zero in exact arithmetic, i.e. rounding noise, which Adam's normalisation
    turns into full-size steps of random sign, so no two correct implementations would agree on
    it beyond the first step."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(),
                                 nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.dim)
        self.wpe = nn.Embedding(config.context, config.dim)
        self.blocks = nn.ModuleList(Block(config.dim, config.heads) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        self.head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_on(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a batch of token ids (bf16 autocast on CUDA)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=idx.is_cuda):
        logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())


def synthetic_batch(config: GPTConfig, batch: int, seq: int, step: int,
                    device: torch.device | str) -> torch.Tensor:
    """A batch of token ids with structure to learn (each sequence counts up from a random
    start, modulo the vocabulary), the same for a given step on every run."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, config.vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    idx = (start + stride * torch.arange(seq + 1)) % config.vocab
    return idx.to(device)
