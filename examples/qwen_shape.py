# SPDX-License-Identifier: Apache-2.0
"""A decoder with Qwen2.5's architecture (RMSNorm, grouped-query attention with q/k/v biases,
SwiGLU MLP, untied head; rotary embeddings left out, which changes no shape and little time) for
benchmarks at real model shapes with random weights, and LoRA adapters for it.

``CONFIGS["qwen2.5-14b"]`` is Qwen2.5-14B's published config (hidden 5120, 48 layers, 40 query
and 8 key/value heads, MLP 13824, vocabulary 152064): 14.8B parameters, 29.5 GB in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int

    @property
    def parameters(self) -> int:
        head = self.dim // self.heads
        attn = self.dim * (self.heads + 2 * self.kv_heads) * head + (
            self.heads + 2 * self.kv_heads) * head + self.heads * head * self.dim
        block = attn + 3 * self.dim * self.mlp + 2 * self.dim
        return 2 * self.vocab * self.dim + self.layers * block + self.dim


CONFIGS = {
    "tiny": DecoderConfig(vocab=256, dim=128, layers=4, heads=4, kv_heads=2, mlp=256),
    "qwen2.5-14b": DecoderConfig(vocab=152064, dim=5120, layers=48, heads=40, kv_heads=8,
                                 mlp=13824),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LoRALinear(nn.Module):
    """``base(x) + (x @ A^T @ B^T) * alpha / r``: the base frozen, A and B trained (B starts at
    zero, so training starts from the base model)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(r, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r, dtype=w.dtype,
                                               device=w.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        head = c.dim // c.heads
        self.heads, self.kv_heads, self.head = c.heads, c.kv_heads, head
        self.q_proj = nn.Linear(c.dim, c.heads * head, bias=True)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * head, bias=True)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * head, bias=True)
        self.o_proj = nn.Linear(c.heads * head, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head).transpose(1, 2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.mlp, bias=False)
        self.up_proj = nn.Linear(c.dim, c.mlp, bias=False)
        self.down_proj = nn.Linear(c.mlp, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(config: DecoderConfig, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
          init_device: str | None = None) -> Decoder:
    """A decoder with random weights (std 0.02) in ``dtype`` on ``device``, initialised one
    piece at a time on ``init_device`` (a GPU is much faster at it than the CPU) and moved, so
    a model bigger than the GPU is never there whole."""
    init_device = init_device or device
    with torch.device("meta"):
        model = Decoder(config)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            value = torch.empty(p.shape, dtype=dtype, device=init_device)
            if name == "weight" and isinstance(module, RMSNorm):
                value.fill_(1.0)
            elif name == "bias":
                value.zero_()
            else:
                value.normal_(0.0, 0.02)
            setattr(module, name, nn.Parameter(value.to(device), requires_grad=p.requires_grad))
    return model


def add_lora(model: Decoder, r: int = 16, alpha: float = 32.0) -> int:
    """LoRA on every projection of every layer; everything else frozen. Returns the trainable
    parameter count."""
    model.requires_grad_(False)
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, r, alpha))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lm_loss(model: Decoder, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
