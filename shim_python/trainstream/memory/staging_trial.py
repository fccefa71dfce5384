# SPDX-License-Identifier: Apache-2.0
"""The staging trial of the run-time plan (memory/adaptive.py): staging the planner chose is
kept only if the settled steps run faster with it than with the same plan without it."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from .state_share import OptimizerStateShare

# Settled steps timed together on each side of the staging trial.
_TRIAL_STEPS = 3


class TrialledPlan(Protocol):
    """What the staging trial reads and does of the run-time plan it serves (AdaptivePlan)."""

    cuda: bool
    device: Any
    adapting: bool           # still settling
    plan: Any                # the MemoryPlan that runs now
    # Its share of the optimizer state on the GPU: staged_blocks, whose moments are staged
    # through the GPU, and staged_option, "auto" or a number asked for.
    state: OptimizerStateShare
    plans_applied: int       # plans applied so far: one applied mid-window restarts a side

    def apply_plan(self, plan: Any) -> None: ...
    def replan(self, fresh: bool = False) -> bool: ...
    def say(self, kind: str, message: str, **numbers: float) -> None: ...


class StagingTrial:
    """Times the plan with the staging "auto" chose against the same plan without it, and keeps
    the faster (the planner's model of a step cannot see how the staged copies and backward slow
    each other). It owns the trial's state: the side being timed, each side's step time, and
    whether the trial is over; the plan it serves (``plan``) applies plans and says what
    happened."""

    def __init__(self, plan: TrialledPlan) -> None:
        self._plan = plan
        self._trial: dict | None = None
        self._done = False

    def stop(self) -> None:
        """No trial from now on (a plan that failed, or settled otherwise)."""
        self._trial, self._done = None, True

    def due(self) -> bool:
        plan = self._plan
        return plan.cuda and plan.adapting and not self._done and (
            self._trial is not None
            or (plan.state.staged_option == "auto" and plan.state.staged_blocks > 0))

    def step(self) -> bool:
        """Called on each settled step; runs the trial of the staging "auto" chose and returns
        True while it does (the plan is not settled until it has decided, and the plan it
        decided for ran through settling already, or it runs through it again). Each side is
        timed over _TRIAL_STEPS steps with the GPU synchronized at the window's ends only, so
        that neither side loses the overlap of one step's tail with the next forward."""
        if not self.due():
            return False
        plan = self._plan
        trial = self._trial
        if trial is None:
            trial = self._trial = {"side": "staged", "start": None}
        if trial["side"] == "staged" and not plan.state.staged_blocks:
            # A settling re-plan staged nothing after all: there is nothing to compare.
            self.stop()
            return False
        if trial["side"] == "staged":
            # The plan being timed (a re-plan of the same decisions renews its estimates).
            trial.update(blocks=plan.state.staged_blocks, plan=plan.plan)
        if trial["start"] is None or trial["serial"] != plan.plans_applied:
            torch.cuda.synchronize(plan.device)
            trial.update(start=time.perf_counter(), steps=0, serial=plan.plans_applied)
            return True
        trial["steps"] += 1
        if trial["steps"] < _TRIAL_STEPS:
            return True
        torch.cuda.synchronize(plan.device)
        trial[trial["side"]] = (time.perf_counter() - trial["start"]) / trial["steps"]
        trial["start"] = None
        if trial["side"] == "staged":
            plan.say("plan.staging_trial",
                     f"staging measured: {1e3 * trial['staged']:.1f} ms a step with "
                     f"{trial['blocks']} blocks' moments staged through the GPU; now the plan "
                     "without staging, to compare", step_ms=1e3 * trial["staged"],
                     staged_blocks=trial["blocks"])
            trial["side"] = "unstaged"
            self._plan_without_staging()
            return True
        staged_s, unstaged_s, blocks = trial["staged"], trial["unstaged"], trial["blocks"]
        self.stop()
        times = (f"{1e3 * staged_s:.1f} ms a step with {blocks} blocks' moments staged "
                 f"through the GPU, {1e3 * unstaged_s:.1f} ms without")
        numbers = dict(staged_ms=1e3 * staged_s, unstaged_ms=1e3 * unstaged_s)
        if staged_s >= unstaged_s:
            plan.say("plan.staging_trial", f"staging dropped: {times}", kept=0.0, **numbers)
            return False  # the plan without staging runs, settled
        # The plan that was timed runs again as it was (planned afresh with as many staged
        # blocks, the planner may place the rest otherwise: an untimed plan). Later re-plans
        # choose the staging again ("auto").
        unstaged = plan.plan
        try:
            plan.apply_plan(trial["plan"])
        except Exception as e:  # noqa: BLE001 - the plan timed without staging goes on
            # The host memory it held may be another job's by now; what of it was applied
            # (streamed weights) is undone by applying the other timed plan again.
            plan.apply_plan(unstaged)
            plan.say("plan.staging_trial", f"staging measured faster ({times}), but its "
                     f"plan could not be applied again ({e}): the plan without staging runs",
                     kept=0.0, **numbers)
            return True
        plan.state.staged_option = "auto"
        plan.say("plan.staging_trial", f"staging kept: {times}; the plan timed with it runs "
                 "again", kept=1.0, **numbers)
        # Its peaks were read on every step it was timed: it settles now rather than after
        # more settling steps (the watchdog still reads each later step's peak).
        return False

    def _plan_without_staging(self) -> None:
        """Plans again without staging, as the probe's plan was made (streamed blocks may come
        back), and applies the plan. A plan that cannot be made or applied ends the trial with
        the plan that runs now."""
        plan = self._plan
        before = plan.state.staged_option
        plan.state.staged_option = 0
        try:
            plan.replan(fresh=True)
        except Exception:
            plan.state.staged_option = before if plan.state.staged_blocks else 0
            self.stop()
            raise
