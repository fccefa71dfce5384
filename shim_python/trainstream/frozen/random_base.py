# SPDX-License-Identifier: Apache-2.0
"""A model of random weights as large as a real base, built one layer at a time: each frozen
linear layer named is drawn (on the GPU when there is one), quantized on every core straight
into a daemon buffer, and becomes a :class:`BaseLinear` over those bytes; the model's other
tensors are drawn where they will live. No full-precision copy of the model is ever whole, so a
70B-class model in NF4 takes its quantized size in host memory (``load_model(...,
random_weights=True)``: benchmarks of models that no machine here has the checkpoint of).

The draws follow transformers' initialisation: normal with the config's ``initializer_range``
for linear and embedding weights, zero biases, norms at one; seeded by ``torch.manual_seed``.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
from typing import Any, Callable

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..transport.client import in_one_registration
from .formats import BaseTensor
from .linear import (BaseLinear, host_views, quantize_on_every_core, quantized_sizes,
                     replace_module)

_ALIGN = 256  # each tensor's bytes start at a multiple of this in its buffer (DMA, vector loads)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class RandomBase:
    """The daemon buffers holding a random model's quantized layers (one per group of layers),
    alive as long as the model that reads them (it keeps this object)."""

    def __init__(self, client: Any):
        self.client = client
        self.buffers: list = []
        self.stored_bytes = 0
        self.seconds = 0.0


def _generator(device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(torch.initial_seed())
    return g


def quantize_random_layers(model: nn.Module, groups: list, format: str, block: int, std: float,
                           device: torch.device, keep_on_host: bool, client: Any,
                           fp8_matmul: Any = "auto", outliers: Any = 0,
                           progress: Callable[[int, int, int], None] | None = None
                           ) -> RandomBase:
    """Replaces the ``nn.Linear`` layers of ``model`` named in each group of ``groups`` (lists
    of names: a decoder layer's, say) by :class:`BaseLinear` layers over random weights
    quantized as ``format`` into one daemon buffer per group. Their bytes stay in that buffer
    (read from there at each use, and streamed from there under ``wrap()``) with
    ``keep_on_host`` or a CPU ``device``, else are copied to ``device``. ``progress(group,
    groups, bytes so far)`` after each group."""
    draw_on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    g = _generator(draw_on)
    base = RandomBase(client)
    prefix = f"random-base/{os.getpid()}/{uuid.uuid4().hex[:12]}"  # one per model built
    on_host = keep_on_host or device.type == "cpu"
    started = time.perf_counter()
    # One scratch of the largest layer's fp32 values for every draw (and its CPU copy to
    # quantize from): a fresh tensor per layer leaves the C heap fragmented by the small
    # objects made meanwhile, and a 96-layer model then held a third more than its size.
    largest = max((model.get_submodule(n).weight.numel() for names in groups for n in names),
                  default=0)
    scratch = torch.empty(largest, dtype=torch.float32, device=draw_on)
    host_scratch = scratch if draw_on.type == "cpu" else torch.empty(
        largest, dtype=torch.float32, pin_memory=True)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for k, names in enumerate(groups):
            layers = [(name, model.get_submodule(name)) for name in names]
            for name, layer in layers:
                if not isinstance(layer, nn.Linear) or isinstance(layer, BaseLinear):
                    raise InvalidArgumentError(f"random weights: {name} is not an nn.Linear")
            sizes = [quantized_sizes(format, layer.weight.numel(), block) for _, layer in layers]
            total = sum(_aligned(d) + _aligned(s) for d, s, _ in sizes)
            buffer = client.allocate(f"{prefix}/{len(base.buffers)}",
                                     max(total, 1), tag="frozen_weights")
            base.buffers.append(buffer)
            memory = buffer.tensor(torch.uint8, (max(total, 1),))
            offset = 0
            for (name, layer), (data_bytes, scale_bytes, _) in zip(layers, sizes):
                data_at, scales_at = offset, offset + _aligned(data_bytes)
                data = memory[data_at:data_at + data_bytes]
                scales = memory[scales_at:scales_at + scale_bytes]
                offset = scales_at + _aligned(scale_bytes)
                numel = layer.weight.numel()
                scratch[:numel].normal_(0.0, std, generator=g)
                if host_scratch is not scratch:
                    host_scratch[:numel].copy_(scratch[:numel])
                _, _, tensor_scale, block_used = quantize_on_every_core(
                    pool, host_scratch[:numel], format, block, out=(data, scales))
                stored = BaseTensor(name=f"{name}.weight", shape=tuple(layer.weight.shape),
                                    source_dtype="F32", stored=format, block=block_used,
                                    tensor_scale=tensor_scale, buffer=0, data_offset=0,
                                    data_bytes=data_bytes, scale_offset=0,
                                    scale_bytes=scale_bytes)
                bias = None
                if layer.bias is not None:
                    bias = torch.zeros(tuple(layer.bias.shape), dtype=layer.bias.dtype,
                                       device=device)
                new = BaseLinear(stored, data if on_host else data.to(device),
                                 scales if on_host else scales.to(device), bias,
                                 compute_dtype=layer.weight.dtype, fp8_matmul=fp8_matmul,
                                 outliers=outliers)
                # The daemon buffer stays with the base (base.buffers): a block that streams
                # reads it there, also when the layer's bytes were copied to the GPU (unless
                # they span two CUDA registrations: it then makes a copy of its own).
                if (in_one_registration(buffer, data_at, data_bytes)
                        and in_one_registration(buffer, scales_at, scale_bytes)):
                    new.host_views = host_views(data, scales)
                replace_module(model, name, new)
                base.stored_bytes += data_bytes + scale_bytes
            if progress is not None:
                progress(k + 1, len(groups), base.stored_bytes)
    base.seconds = time.perf_counter() - started
    return base


def materialize_random(model: nn.Module, device: torch.device, std: float) -> list:
    """Draws every tensor of ``model`` still on the meta device, on ``device``, frozen:
    embeddings and linear weights normal(0, ``std``), biases zero, other weights (norms) one.
    Returns their names. Buffers a module computes (rotary frequencies) are the caller's."""
    g = _generator(device)
    drawn = []
    for module_name, module in model.named_modules():
        for leaf, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            value = torch.empty(tuple(p.shape), dtype=p.dtype, device=device)
            if leaf == "bias":
                value.zero_()
            elif isinstance(module, (nn.Embedding, nn.Linear)) or p.dim() >= 2:
                value.normal_(0.0, std, generator=g)
            else:
                value.fill_(1.0)
            module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            drawn.append(f"{module_name}.{leaf}" if module_name else leaf)
    return drawn
