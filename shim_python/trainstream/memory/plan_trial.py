# SPDX-License-Identifier: Apache-2.0
"""Whole plans timed against each other on settled steps. The planner's model of a step
weighs a page against a recompute block by block; it cannot see how paged copies, the
allocator and the kernels slow each other, and a user who tried gradient checkpointing alone
would drop a plan that loses to it. So once the plan the model prefers has settled, the plans
that handle the same blocks otherwise (never paging; paging before any recompute; every block
recomputed, as checkpointing does) run a few settled steps each, and the fastest stays.

``WholePlanTrial`` is the bookkeeping alone (which plan is timed, each one's time, the
winner), with the clock passed in so a test can drive it; ``AdaptivePlan`` applies the plans
and synchronizes the GPU at each window's ends."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

# Settled steps timed together for each plan: the GPU is synchronized at the window's ends
# only, so no plan loses the overlap of one step's tail with the next forward.
TRIAL_STEPS = 3


@dataclass(frozen=True)
class TrialStep:
    """What the caller does after a settled step: ``"time"`` (go on with the plan that runs),
    ``"apply"`` (plan with ``choice`` and apply it: its window starts after it settles) or
    ``"done"`` (every plan timed: ``choice`` is the fastest)."""

    action: str
    choice: str = ""


class WholePlanTrial:
    """Times ``choices`` (the first is the one running when the trial starts) in turn, each
    over ``steps`` settled steps read with ``clock``. Not thread-safe: the training loop's
    thread calls it between steps."""

    def __init__(self, choices: list, clock: Callable[[], float] = time.perf_counter,
                 steps: int = TRIAL_STEPS):
        if not choices:
            raise ValueError("WholePlanTrial needs at least one plan to time")
        self.order = list(choices)
        self.seconds: dict = {}    # choice -> seconds a step
        self.skipped: dict = {}    # choice -> why it was not timed
        self._clock, self._steps = clock, steps
        self._index = 0
        self._start: float | None = None
        self._serial = None
        self._counted = 0

    @property
    def current(self) -> str:
        return self.order[self._index]

    @property
    def winner(self) -> str:
        return min(self.seconds, key=self.seconds.get)

    def settled_step(self, serial: int) -> TrialStep:
        """After a settled step of the plan being timed. ``serial`` counts the plans applied
        so far: a plan applied mid-window (settling corrected it) restarts that window."""
        if self._start is None or serial != self._serial:
            self._start, self._serial, self._counted = self._clock(), serial, 0
            return TrialStep("time")
        self._counted += 1
        if self._counted < self._steps:
            return TrialStep("time")
        self.seconds[self.current] = (self._clock() - self._start) / self._counted
        return self._next()

    def skip(self, reason: str) -> TrialStep:
        """The plan to be timed could not be made or applied, or is one timed already."""
        self.skipped[self.current] = reason
        return self._next()

    def _next(self) -> TrialStep:
        self._start = None
        self._index += 1
        if self._index < len(self.order):
            return TrialStep("apply", self.current)
        if not self.seconds:
            return TrialStep("done", "")
        return TrialStep("done", self.winner)

    def summary(self) -> str:
        timed = ", ".join(f"{choice} {1e3 * s:.1f} ms" for choice, s in self.seconds.items())
        skipped = "".join(f"; {choice}: {why}" for choice, why in self.skipped.items())
        return timed + skipped
