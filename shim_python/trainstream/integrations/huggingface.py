# SPDX-License-Identifier: Apache-2.0
"""Hugging Face causal LMs over a shared base: ``load_model(path, quantize=...)`` builds the
model from its config without allocating its weights, has trainstreamd hold the checkpoint once
(bf16 or quantized), and takes every frozen weight from that one copy. Adapters (PEFT LoRA, or
your own) added afterwards train through ``trainstream.wrap`` as usual."""

from __future__ import annotations

from typing import Any

import torch

from ..frozen.linear import attach_base
from ..frozen.store import load_base
from ..errors import FailedPreconditionError, InvalidArgumentError


def _materialize_computed_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers a model computes at construction (rotary frequencies) are in no checkpoint:
    modules holding them on the meta device are built again on ``device``."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        config = getattr(module, "config", None)
        try:
            # Built under the device: whatever the class's signature (it changes between
            # transformers versions), what it computes lands there.
            with torch.device(device):
                rebuilt = type(module)(config=config)
        except TypeError as e:
            raise FailedPreconditionError(
                f"load_model: {name} ({type(module).__name__}) computes buffers the checkpoint "
                f"does not hold, and could not be rebuilt: {e}") from e
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, rebuilt)


def load_model(path: str, quantize: str | None = None, device: Any = "cuda",
               dtype: torch.dtype = torch.bfloat16, keep_on_host: bool = False,
               client: Any = None, progress: bool = True,
               fp8_matmul: Any = "auto", gpu_pool: bool = False) -> torch.nn.Module:
    """A causal LM from the Hugging Face checkpoint folder ``path`` (config.json and
    .safetensors), frozen, its weights from the daemon's shared base: bf16 (``quantize=None``)
    or ``"int8"``, ``"nf4"``, ``"fp8"``, ``"nvfp4"`` for the block weights (embeddings, norms
    and the head stay as the checkpoint has them). Every process loading the same checkpoint
    and format uses the one host copy. ``fp8_matmul``, ``gpu_pool`` (one VRAM copy per GPU):
    see :func:`attach_base`."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # an optional dependency: only this function needs it
        raise FailedPreconditionError("load_model needs the transformers package") from e
    fmt = quantize or "bf16"
    if fmt not in ("bf16", "int8", "nf4", "fp8", "nvfp4"):
        raise InvalidArgumentError(f"quantize={quantize!r} is not one of None, 'int8', 'nf4', "
                                   "'fp8', 'nvfp4'")
    device = torch.device(device)
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(dtype)
    model.requires_grad_(False)
    base = load_base(path, format=fmt, client=client, progress=progress)
    taken = attach_base(model, base, device=device, keep_on_host=keep_on_host,
                        fp8_matmul=fp8_matmul, gpu_pool=gpu_pool)
    _materialize_computed_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta]
    if left:
        raise FailedPreconditionError(
            f"load_model: {len(left)} tensors are in neither {path} nor the model's own "
            f"computed buffers, e.g. {', '.join(left[:5])}")
    model._trainstream_loaded = taken
    return model
