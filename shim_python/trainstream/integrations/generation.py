# SPDX-License-Identifier: Apache-2.0
"""``TrainStreamCache``: a transformers ``Cache`` for ``model.generate(past_key_values=...)``
whose layers keep their keys and values in a ``PagedKVCache`` (resident layers in VRAM, the
others in the daemon's pinned pages, read back through a device slot ahead of use), and whose
decoding calls run the attention kernel ``attention=`` picks (``DecodeAttention``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..errors import FailedPreconditionError, InvalidArgumentError
from ..memory.paged_kv_cache import PagedKVCache
from .decode_attention import DecodeAttention

__all__ = ["TrainStreamCache"]


class PagedLayer(DynamicLayer):
    """One decoder layer's view of the shared PagedKVCache."""

    is_croppable = False

    def __init__(self, kv: PagedKVCache, index: int, attention: DecodeAttention):
        super().__init__()
        self.kv, self.index, self.attention = kv, index, attention

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # The attention that follows reads this cache: decoding when one position came.
        self.attention.armed = key_states.shape[-2]
        return self.kv.update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.kv.seq_length(self.index)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        if self.index == 0:
            self.kv.reset()

    def offload(self) -> None:  # the pages are where the offloaded layers live already
        return None

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        raise FailedPreconditionError("TrainStreamCache cannot drop positions (assisted "
                                      "decoding); use transformers' own cache for it")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise FailedPreconditionError("TrainStreamCache does not reorder its pages (beam "
                                      "search); generate greedily or by sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise FailedPreconditionError("TrainStreamCache holds one batch of prompts; expand "
                                      "the prompts before generate() instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise FailedPreconditionError("TrainStreamCache holds one batch of prompts")


def _full_attention_layers(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    if not count:
        raise InvalidArgumentError(
            f"TrainStreamCache: {type(model).__name__} has no config.num_hidden_layers")
    kinds = set(getattr(text, "layer_types", None) or [])
    # Where the config names each layer's attention, that decides; else a window set (and not
    # switched off, as Qwen2's use_sliding_window does) applies to every layer.
    sliding = (kinds - {"full_attention"} if kinds else
               getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window",
                                                                   True))
    if sliding:
        raise InvalidArgumentError(
            f"TrainStreamCache: {type(model).__name__} has layers that are not full attention "
            f"({sorted(kinds) or 'a sliding window'}); use transformers' own cache for it")
    return int(count)


class TrainStreamCache(Cache):
    """``TrainStreamCache(model, max_tokens, *, resident_layers="auto", page_tokens=256,
    vram_fraction=0.5, attention="auto")`` for ``model.generate(..., past_key_values=cache)``.
    ``max_tokens``: the longest sequence expected (prompt and new tokens). ``attention``: the
    kernel of the decoding calls that read this cache (``"auto"``: timed on CUDA as decoding
    meets it, a new key length each call; a kernel's name; None: PyTorch's pick), reported by
    ``.attention``. ``.kv`` is the PagedKVCache; ``reset()`` before the next prompts;
    ``close()`` gives the pages back and takes the attention hooks off the model. Greedy
    decoding and sampling; no beam search."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, *, resident_layers: Any = "auto",
                 page_tokens: int = 256, vram_fraction: float = 0.5, attention: Any = "auto",
                 client: Any = None):
        count = _full_attention_layers(model)
        self._decode_attention = DecodeAttention(attention, gated=True)
        self.kv = PagedKVCache(count, max_tokens, resident_layers=resident_layers,
                               page_tokens=page_tokens, vram_fraction=vram_fraction,
                               client=client)
        super().__init__(layers=[PagedLayer(self.kv, i, self._decode_attention)
                                 for i in range(count)])
        self._decode_attention.install(model)

    @property
    def attention(self) -> dict:
        """The decoding calls' kernel: ``mode``, ``backend``, the trial's ``timings_ms``, the
        ``calls`` each kernel ran, and a ``note`` of why."""
        return self._decode_attention.report()

    def close(self) -> None:
        self._decode_attention.remove()
        self.kv.close()

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.kv.reset()
