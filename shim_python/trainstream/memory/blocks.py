# SPDX-License-Identifier: Apache-2.0
"""Finding a model's repeated block stack: the layers the memory plan streams, pages or
recomputes one at a time; and what streaming a block's weights moves."""

from __future__ import annotations

from typing import Any

import torch


def _signature(module: Any) -> tuple:
    return (type(module), tuple((name, tuple(p.shape), p.dtype)
                                for name, p in module.named_parameters()))


def has_forward(module: Any) -> bool:
    """Whether ``module`` is called itself (a class with its own ``forward``), as the hooks on a
    block need: an ``nn.ModuleList`` holding a layer's parts is iterated, never called."""
    from torch import nn

    return type(module).forward is not nn.Module.forward


def find_blocks(model: Any) -> list:
    """The longest list of consecutive, identically built submodules held in one
    ``nn.ModuleList`` or ``nn.Sequential`` (a transformer's layers): same class, same parameter
    names, shapes and dtypes, each called as a whole (``has_forward``). Empty when the model has
    no such stack of two or more."""
    from torch import nn

    best: list = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        run: list = []
        for child in children:
            if run and _signature(child) != _signature(run[0]):
                run = []
            if next(child.parameters(), None) is None or not has_forward(child):
                run = []
                continue
            run.append(child)
            if len(run) > len(best) or (len(run) == len(best) and best and
                                        sum(p.numel() for m in run for p in m.parameters()) >
                                        sum(p.numel() for m in best for p in m.parameters())):
                best = list(run)
    return best if len(best) >= 2 else []


# The buffers a frozen linear layer over stored bytes (frozen.linear.BaseLinear) reads its
# weight from: quantized codes and their scales, or the row-scaled FP8 copy that replaces them.
_STORED_BUFFERS = ("data", "scales", "fp8_rows", "fp8_row_scales")


def stored_buffers(module: Any, pooled: bool = False) -> list:
    """The stored weight bytes of ``module``'s frozen quantized (or shared-base) linear layers:
    buffers, not parameters, that a block streaming its weights moves with them. Empty ones
    (what an FP8 layer leaves behind once it multiplies from its row-scaled copy) are left out,
    and so are layers read in place from a daemon GPU pool (``attach_base(gpu_pool=True)``)
    unless ``pooled``: that VRAM is the daemon's, already off the budget, and streaming it would
    free none."""
    from ..frozen.linear import BaseLinear

    found = []
    for m in module.modules():
        if isinstance(m, BaseLinear) and (pooled or not m.pooled):
            found.extend(b for name in _STORED_BUFFERS
                         if isinstance(b := getattr(m, name, None), torch.Tensor) and b.numel())
    return found


def streamed_tensors(module: Any) -> list:
    """Everything streaming ``module``'s weights moves: its parameters (trained ones included),
    then the stored bytes of its quantized layers (:func:`stored_buffers`)."""
    return list(module.parameters()) + stored_buffers(module)


def weight_tensors(module: Any) -> list:
    """Every tensor ``module``'s forward reads weights from: what streams, and the stored bytes
    of layers read in place from a GPU pool, which never stream. The pager tells them from the
    activations a block saves for backward by their storage."""
    return list(module.parameters()) + stored_buffers(module, pooled=True)


def shared_host_buffers(module: Any) -> dict:
    """The stored buffers (by id) whose bytes are a shared base's host memory (``attach_base``
    without a GPU pool, a random base's daemon buffers), each with that host view: streaming
    reads them there, with no copy of its own, also when the buffer itself is on the GPU."""
    from ..frozen.linear import BaseLinear

    found = {}
    for m in module.modules():
        if isinstance(m, BaseLinear):
            for name, view in m.host_views.items():
                buffer = getattr(m, name, None)
                if isinstance(buffer, torch.Tensor) and buffer.numel() == view.numel():
                    found[id(buffer)] = view
    return found


def base_host_views(module: Any) -> list:
    """Every host view of a shared base's bytes that ``module``'s layers keep (see
    :func:`shared_host_buffers`), whatever their buffers hold now."""
    from ..frozen.linear import BaseLinear

    return [view for m in module.modules() if isinstance(m, BaseLinear)
            for view in m.host_views.values()]


def weight_bytes(module: Any, trained: bool | None = None) -> int:
    """Bytes of :func:`streamed_tensors`; ``trained``: only the parameters that train (True) or
    only what is frozen, stored bytes included (False)."""
    return sum(t.numel() * t.element_size() for t in streamed_tensors(module)
               if trained is None or t.requires_grad == trained)
