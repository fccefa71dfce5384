# SPDX-License-Identifier: Apache-2.0
"""Hooks that reach their owner through a weak reference.

A hook stored on a tensor must not hold the object that registered it. Python's collector does
not look inside a tensor's hooks while C++ also holds the tensor (autograd does, for every
parameter), so an optimizer -> parameter -> hook -> optimizer cycle is never freed: a dropped
wrap() would keep its VRAM, its pinned buffers and its daemon session until the process ends."""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(owner: Any, attribute: str, *leading: Any) -> Callable:
    """Calls ``owner.<attribute>(*leading, *args)`` while ``owner`` lives; nothing after."""
    ref = weakref.ref(owner)

    def hook(*args: Any) -> Any:
        target = ref()
        if target is None:
            return None
        return getattr(target, attribute)(*leading, *args)
    return hook
