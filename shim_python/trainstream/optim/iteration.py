# SPDX-License-Identifier: Apache-2.0
"""Where OffloadAdamW's iteration stands between one step() and the next: one phase and its
transitions, kept in one place so that the gradient routing, the forward hooks, checkpoints and
step() ask it rather than set flags of their own."""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    # Backward passes of the iteration, none yet with a last micro-step's gradients (or an
    # early completion that failed: step() completes, and raises, again).
    ACCUMULATING = "accumulating"
    # A backward running now carries last micro-step gradients: the iteration cannot complete
    # from another thread while it runs.
    LAST_BACKWARD = "last backward running"
    # That backward has ended: a forward or a checkpoint before step() may complete the
    # iteration, reading every update.
    BACKWARD_ENDED = "last backward ended"
    # Completed before step() by such a forward: step() has nothing left to wait for, and
    # another backward is one too many.
    COMPLETED_EARLY = "completed before step()"


class Iteration:
    """The phase, and whether host updates are landing: from the moment a parameter updated by
    the daemon sends its last micro-step's gradient (its update then comes back whenever it is
    done) until the iteration completes."""

    def __init__(self) -> None:
        self.phase = Phase.ACCUMULATING
        self.updates_landing = False

    @property
    def completed_early(self) -> bool:
        return self.phase is Phase.COMPLETED_EARLY

    def last_gradient_out(self, *, updated_by_daemon: bool) -> None:
        """A parameter's last micro-step gradient left (or stays in VRAM for a GPU update). A
        gradient still arriving after a backward ended (an outer backward after a recompute's
        inner one) makes the iteration wait for its own backward's end again."""
        if self.completed_early:
            raise AssertionError("a gradient after the iteration completed: refused before this")
        self.phase = Phase.LAST_BACKWARD
        if updated_by_daemon:
            self.updates_landing = True

    def backward_ended(self) -> None:
        if self.phase is Phase.LAST_BACKWARD:
            self.phase = Phase.BACKWARD_ENDED

    def start_early_completion(self) -> bool:
        """True once per ended last backward: the caller completes the iteration now, then
        calls completed_before_step(). Should it raise instead, the iteration stays to be
        completed by step(), which raises again."""
        if self.phase is not Phase.BACKWARD_ENDED:
            return False
        self.phase = Phase.ACCUMULATING
        return True

    def updates_returned(self) -> None:
        """Every update of the iteration has been waited for and is on its way back."""
        self.updates_landing = False

    def completed_before_step(self) -> None:
        self.phase = Phase.COMPLETED_EARLY

    def stepped(self) -> None:
        """step() has completed the iteration: the next one begins."""
        self.phase = Phase.ACCUMULATING
