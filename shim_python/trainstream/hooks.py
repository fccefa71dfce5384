# SPDX-License-Identifier: Apache-2.0
"""Hooks of trainstream's own: ones that reach their owner through a weak reference, and
the clock of the CPU time they take.

A hook stored on a tensor must not hold the object that registered it. Python's collector does
not look inside a tensor's hooks while C++ also holds the tensor (autograd does, for every
parameter), so an optimizer -> parameter -> hook -> optimizer cycle is never freed: a dropped
wrap() would keep its VRAM, its pinned buffers and its daemon session until the process ends."""

from __future__ import annotations

import time
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


# The CPU time trainstream's own hooks take inside a step, by hook: what the client adds to the
# thread that issues the GPU's work. A paged step whose GPU and link wait on the CPU is as slow as
# this and the model's own Python together, so ``memory_report()["hooks"]`` shows it.
class HookClock:
    """Seconds and calls per hook name, since it was made (every thread together)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def timed(self, name: str, hook: Callable) -> Callable:
        """``hook`` with its time added to ``name`` on every call."""
        clock = time.perf_counter
        seconds, calls = self.seconds, self.calls
        seconds.setdefault(name, 0.0)
        calls.setdefault(name, 0)

        def run(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return hook(*args, **kwargs)
            finally:
                # Unlocked: a lost update across threads costs a microsecond of a diagnostic.
                seconds[name] += clock() - start
                calls[name] += 1
        return run

    def report(self, steps: int) -> dict:
        """Per hook: calls and milliseconds in all, and per step over ``steps``."""
        steps = max(1, steps)
        return {name: {"calls": self.calls[name], "ms": round(1e3 * s, 2),
                       "ms_per_step": round(1e3 * s / steps, 3)}
                for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
