# SPDX-License-Identifier: Apache-2.0
"""Key/value caches in training. Hugging Face decoders build a cache in every forward while
``config.use_cache`` is on (its default); in training nothing reads it, and it costs twice:

- it holds every layer's keys and values until the step ends, and a layer recomputed in
  backward appends its keys again (attention then runs over twice the keys);
- a recomputed layer's checkpoint keeps its keyword arguments for backward, the cache among
  them, and the keys a layer that is not recomputed wrote there carry autograd history back to
  the recomputed layer's output: a reference cycle through autograd's C++ graph, which Python's
  collector cannot see. Each step's graph, activations and cache then stay alive for good
  (seen on the H200: 0.6 GiB more VRAM held after every step of a Qwen2.5-1.5B full fine-tune).

So ``wrap()`` turns the cache off in the model's training forwards (as transformers does under
gradient checkpointing), without writing its config (other models may share that object: a
reference model, or one generating during training), and a recomputed block never keeps one it
is handed."""

from __future__ import annotations

import inspect
from typing import Any

import torch

# The names decoder layers take a cache under, across transformers versions.
CACHE_ARGUMENTS = ("past_key_value", "past_key_values", "layer_past", "cache")


def _is_cache(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name != "cache":
        return True
    # A block's own argument may be called "cache": only a transformers Cache is dropped.
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


def without_cache(kwargs: dict) -> dict:
    """``kwargs`` with any key/value cache replaced by None (the same dict when it has none)."""
    if not any(_is_cache(k, v) for k, v in kwargs.items() if k in CACHE_ARGUMENTS):
        return kwargs
    return {k: (None if k in CACHE_ARGUMENTS and _is_cache(k, v) else v)
            for k, v in kwargs.items()}


class CacheSwitch:
    """Makes every transformers model in ``model`` whose config has ``use_cache`` on build no
    cache in a forward with gradients on (training, in train or eval mode), unless the call
    asks for one: a forward pre-hook passes ``use_cache=False`` where the call left it out.
    The config itself is never written: models that share it (a reference model, a policy
    that generates during training) and generation with the wrapped model under ``no_grad``
    see it as it was. :meth:`restore` takes the hooks off."""

    def __init__(self, model: torch.nn.Module):
        self._handles: list = []
        for module in model.modules():
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", False) is not True:
                continue
            try:
                accepted = inspect.signature(module.forward).parameters
            except (TypeError, ValueError):
                continue
            if "use_cache" in accepted:
                self._handles.append(module.register_forward_pre_hook(_no_cache_in_training,
                                                                      with_kwargs=True))

    @property
    def count(self) -> int:
        """How many models build no cache in training now."""
        return len(self._handles)

    def restore(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _no_cache_in_training(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    if torch.is_grad_enabled() and kwargs.get("use_cache") is None:
        return args, {**kwargs, "use_cache": False}
    return None
