# SPDX-License-Identifier: Apache-2.0
"""Finding a model's repeated block stack: the layers the memory plan streams, pages or
recomputes one at a time."""

from __future__ import annotations

from typing import Any


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
