# SPDX-License-Identifier: Apache-2.0
"""The staging trial (a part of AdaptivePlan, memory/adaptive.py): staging the planner chose is
kept only if the settled steps run faster with it than with the same plan without it."""

from __future__ import annotations

import time

import torch

# Settled steps timed together on each side of the staging trial.
_TRIAL_STEPS = 3


class StagingTrial:
    """AdaptivePlan's staging trial (a part of the class: it reads the plan's state)."""

    def _trial_due(self) -> bool:
        return self.cuda and self.adapting and not self._trial_done and (
            self._trial is not None or (self._staged_option == "auto" and self.staged_blocks > 0))

    def _staging_trial(self) -> bool:
        """Called on each settled step; runs the trial of the staging "auto" chose and returns
        True while it does (the plan is not settled until it has decided, and the plan it
        decided for ran through settling already, or it runs through it again). Each side is timed
        over _TRIAL_STEPS steps with the GPU synchronized at the window's ends only, so that
        neither side loses the overlap of one step's tail with the next forward."""
        if not self._trial_due():
            return False
        trial = self._trial
        if trial is None:
            trial = self._trial = {"side": "staged", "start": None}
        if trial["side"] == "staged" and not self.staged_blocks:
            # A settling re-plan staged nothing after all: there is nothing to compare.
            self._trial, self._trial_done = None, True
            return False
        if trial["side"] == "staged":
            # The plan being timed (a re-plan of the same decisions renews its estimates).
            trial.update(blocks=self.staged_blocks, plan=self.plan)
        if trial["start"] is None or trial["serial"] != self._plans_applied:
            torch.cuda.synchronize(self.device)
            trial.update(start=time.perf_counter(), steps=0, serial=self._plans_applied)
            return True
        trial["steps"] += 1
        if trial["steps"] < _TRIAL_STEPS:
            return True
        torch.cuda.synchronize(self.device)
        trial[trial["side"]] = (time.perf_counter() - trial["start"]) / trial["steps"]
        trial["start"] = None
        if trial["side"] == "staged":
            self._say("plan.staging_trial",
                      f"staging measured: {1e3 * trial['staged']:.1f} ms a step with "
                      f"{trial['blocks']} blocks' moments staged through the GPU; now the plan "
                      "without staging, to compare", step_ms=1e3 * trial["staged"],
                      staged_blocks=trial["blocks"])
            trial["side"] = "unstaged"
            self._plan_without_staging()
            return True
        staged_s, unstaged_s, blocks = trial["staged"], trial["unstaged"], trial["blocks"]
        self._trial, self._trial_done = None, True
        times = (f"{1e3 * staged_s:.1f} ms a step with {blocks} blocks' moments staged "
                 f"through the GPU, {1e3 * unstaged_s:.1f} ms without")
        numbers = dict(staged_ms=1e3 * staged_s, unstaged_ms=1e3 * unstaged_s)
        if staged_s >= unstaged_s:
            self._say("plan.staging_trial", f"staging dropped: {times}", kept=0.0, **numbers)
            return False  # the plan without staging runs, settled
        # The plan that was timed runs again as it was (planned afresh with as many staged
        # blocks, the planner may place the rest otherwise: an untimed plan). Later re-plans
        # choose the staging again ("auto").
        unstaged = self.plan
        try:
            self._apply_plan(trial["plan"])
        except Exception as e:  # noqa: BLE001 - the plan timed without staging goes on
            # The host memory it held may be another job's by now; what of it was applied
            # (streamed weights) is undone by applying the other timed plan again.
            self._apply_plan(unstaged)
            self._say("plan.staging_trial", f"staging measured faster ({times}), but its "
                      f"plan could not be applied again ({e}): the plan without staging runs",
                      kept=0.0, **numbers)
            return True
        self._staged_option = "auto"
        self._say("plan.staging_trial", f"staging kept: {times}; the plan timed with it runs "
                  "again", kept=1.0, **numbers)
        # Its peaks were read on every step it was timed: it settles now rather than after
        # more settling steps (the watchdog still reads each later step's peak).
        return False

    def _plan_without_staging(self) -> None:
        """Plans again without staging, as the probe's plan was made (streamed blocks may come
        back), and applies the plan. A plan that cannot be made or applied ends the trial with
        the plan that runs now."""
        before = self._staged_option
        self._staged_option = 0
        try:
            self._replan(fresh=True)
        except Exception:
            self._staged_option = before if self.staged_blocks else 0
            self._trial, self._trial_done = None, True
            raise
