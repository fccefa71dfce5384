# SPDX-License-Identifier: Apache-2.0
"""Recompute: chosen blocks keep only their inputs from forward and run their forward again in
backward, trading compute for activation memory when host memory cannot take their activations
either.

The block runs through torch's reentrant checkpoint: its forward without gradients, then in
backward its forward again and a backward through it. The non-reentrant form calls two Python
hooks for every tensor the block saves, forward and backward, which on a small LoRA block costs
the CPU more than the recomputed forward itself (``bench/README.md``); a paged step waits on
that CPU. Two things the reentrant form needs are supplied here: an input that requires
gradients (a LoRA block after a frozen embedding has none, and its adapters would get no
gradients), and keyword arguments (passed in a closure). A block given a keyword tensor that
requires gradients uses the non-reentrant form, which passes them on. As with any reentrant
checkpoint, gradients come from ``loss.backward()``: ``torch.autograd.grad`` through a
recomputed block is refused by torch with a message saying so.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils.checkpoint

from .kv_cache import without_cache


class Recompute:
    """Makes ``blocks[i]`` recompute its forward in backward for every ``i`` in ``indices``;
    :meth:`set` changes the choice between steps (the adaptive plan does)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], indices: Sequence[int]):
        self.blocks = list(blocks)
        self.indices: list[int] = []
        self.set(indices)

    def set(self, indices: Sequence[int]) -> None:
        chosen = sorted(set(int(i) for i in indices))
        for i in set(self.indices) - set(chosen):
            self.blocks[i].__dict__.pop("forward", None)
        for i in set(chosen) - set(self.indices):
            module = self.blocks[i]
            original = module.forward

            def forward(*args, _original=original, _module=module, **kwargs):
                if not torch.is_grad_enabled():
                    return _original(*args, **kwargs)
                return _recomputed(_module, _original, args, kwargs)

            # An attribute of the instance: module hooks still run around it, once per call.
            module.forward = forward
        self.indices = chosen

    def close(self) -> None:
        self.set(())


# An input that requires gradients, so that the reentrant checkpoint's backward always runs
# (it is never used: its gradient stays None). One per process, made on first use.
_ALWAYS_GRAD: list = []


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_requires_grad(v) for v in value.values())
    return False


def _recomputed(module: torch.nn.Module, run: Callable, args: tuple, kwargs: dict) -> Any:
    # The checkpoint keeps its arguments for backward: a key/value cache among them would keep
    # each step's graph alive (kv_cache.py), and the recompute would append its keys again.
    kwargs = without_cache(kwargs)
    if _requires_grad(kwargs):
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
    if not (_requires_grad(args) or any(p.requires_grad for p in module.parameters())):
        # Nothing in it is trained and nothing trained comes before it: no backward reaches it,
        # so no activations are kept and there is nothing to recompute.
        return run(*args, **kwargs)
    if not _ALWAYS_GRAD:
        _ALWAYS_GRAD.append(torch.empty(0, requires_grad=True))

    def call(_always_grad: torch.Tensor, *inputs: Any) -> Any:
        return run(*inputs, **kwargs)

    return torch.utils.checkpoint.checkpoint(call, _ALWAYS_GRAD[0], *args, use_reentrant=True)
