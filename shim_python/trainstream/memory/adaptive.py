# SPDX-License-Identifier: Apache-2.0
"""The memory plan at run time: a probe step measures one block, the planner decides from the
measurements, the decision is applied between steps, the next step measures the block again
warm, the steps after confirm or correct the plan from their peaks, staging the planner chose
is timed against the same plan without it (the faster stays), and a watchdog has the block
measured again when a later step grows.

The probe step is safe for VRAM and host memory alike: every block but the measured one either
recomputes its forward in backward (keeping only its input) or, when its weights stream (a
streamed block is never recomputed), pages its activations to the daemon's buffers. The measured
block is the last one, which keeps its activations in every plan. What it saves for backward,
its input, its forward time, and the step's VRAM peak are what the planner works from, with the
PCIe bandwidth measured once per machine (``profile_hardware``) and the host memory the daemon
has left (other jobs' plans taken off).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .plan_apply import AppliedPlan
from .plan_probe import ProbeStep
from .plan_setup import PlanActions, PlanReadings, PlanSettings
from .plan_trial import TRIAL_STEPS, WholePlanTrial
from .planner import (ACTIVATION_CHOICES, BlockFacts, MemoryPlan, MemoryPlanError, PlanInputs,
                      plan_memory, size)
from .staging_trial import StagingTrial
from .state_share import OptimizerStateShare
from .step_measures import (RESERVED_MARGIN, StepMeter, host_pass_rate, measured_block_facts,
                            settling_correction, streamed_weight_bytes, working_from_peak)

# Steps after the plan is applied whose peaks may still correct it; later, only the watchdog.
_SETTLE_STEPS = 2
# A later step's peak may exceed the budget by this share before the watchdog re-plans.
_WATCHDOG_SLACK = 0.02
# Corrections settling may make for steps over the budget; then the largest overshoot seen is
# added once more and the plan settles (the watchdog still watches): a plan that each step
# overshoots by a different amount would otherwise stream one more block every step.
_MAX_CORRECTIONS = 4
# Corrections a plan the whole-plan trial applies may take before it is left out of the trial.
_TRIAL_CORRECTIONS = 2


class AdaptivePlan:
    """Owns the activation policy of ``blocks`` (and may stream more of their weights) for a
    wrapped model.

    ``pager`` is the model's BlockPager, ``recompute`` its Recompute; ``settings`` are the
    figures fixed for the run, ``actions`` what the plan may do to the job (stream weights,
    re-declare its host memory, move optimizer state, say a decision), ``readings`` what it
    reads of the job as it runs (memory/plan_setup.py).

    It decides when to plan again (the probe, settling, the trials, the watchdog) and from what
    (the measurements); ``applied`` holds the plan that runs and applies new ones, ``state``
    the plan's share of the optimizer state on the GPU.
    """

    def __init__(self, blocks: list, pager: Any, recompute: Any, settings: PlanSettings,
                 actions: PlanActions, readings: PlanReadings):
        self.blocks = blocks
        self.pager = pager
        self.recompute = recompute
        self.settings = settings
        self.actions = actions
        self.readings = readings
        self.budget = int(settings.budget)
        self.weights_fixed = settings.weights_fixed  # offload="auto" fixes them later too
        self.others = int(settings.others_bytes)
        self.state = OptimizerStateShare(actions.set_gpu_state, settings.gpu_state,
                                         settings.staged_state, len(blocks), self.say)
        self.applied = AppliedPlan(pager, recompute, actions, self.state, self.budget, self.say)
        self._fragmentation_kept_said = False  # _correction_streams said so once
        # Staging the planner chose ("auto") is kept only if it measures faster
        # (staging_trial.py).
        self.staging = StagingTrial(self)
        # The whole-plan trial (plan_trial.py): how blocks VRAM cannot keep are handled now
        # (planner.ACTIVATION_CHOICES), the trial under way, and the plan each choice ran.
        self._activation_choice = "model"
        self._whole_trial: WholePlanTrial | None = None
        self._whole_trial_done = False
        self._whole_trial_plans: dict = {}
        # The choice, working memory and corrections of the plan before a trial's plan.
        self._trial_working = ("model", 0, 0)
        self.trial_result: dict = {}
        self.cuda = pager.cuda
        self.device = pager.device
        self.meter = StepMeter(self.device, pager.timing, self.others, self.say)
        self.history: list[str] = []
        self.measured: dict = {}
        self.extra_working = 0         # what the settling steps and the watchdog added
        self.corrections = 0           # settling's corrections since the probe's plan
        self._largest_overshoot = 0
        self._fragmented_steps = 0
        self.steps_since_plan = -1     # -1: the probe has not run
        self.adapting = True
        # "warm": the first step after the probe's plan measures the block again (the probe is a
        # first step: the allocator grows, libraries pick kernels); "watchdog": a later step
        # grew past the budget, and the next one measures what grew.
        self._measure_next: str | None = None
        self._unfixable_peak = 0  # a watchdog peak no plan could hold: not measured again
        self._release_cache_after_step = False
        # The first step: the last block measured while the others recompute or page.
        self.probe = ProbeStep(self)
        self.probe.start()

    @property
    def plan(self) -> MemoryPlan | None:
        """The plan that runs (None before the probe's)."""
        return self.applied.plan

    @property
    def plans_applied(self) -> int:
        """Plans applied so far (the trials restart their timing when it moves)."""
        return self.applied.count

    # -- planning and applying ---------------------------------------------------------------

    def _plan_inputs(self, fresh: bool = False) -> PlanInputs:
        """The planner's inputs from the measurements (see replan for ``fresh``)."""
        facts = [BlockFacts(weight_bytes=streamed_weight_bytes(self.pager, self.blocks, b),
                            activation_bytes=f.activation_bytes, input_bytes=f.input_bytes,
                            trained_share=f.trained_share, trainable=f.trainable)
                 for b, f in enumerate(self._facts_cache)]
        host = max(0, self.readings.host_free()) + self.applied.host_activation_bytes
        if self.settings.host_cap:
            host = min(host, self.settings.host_cap)
        trainable = self.settings.other_trainable + sum(f.trainable for f in facts)
        return PlanInputs(
            blocks=tuple(facts), other_weight_bytes=self.settings.other_weight_bytes,
            other_trainable=self.settings.other_trainable, host_state_planned=True,
            host_update_s=self.measured.get("host_s_per_element", 0.0) * trainable,
            host_after_backward=bool(self.readings.updates_after_backward()),
            gpu_state=self.state.option, update_transfer=self.settings.update_transfer,
            staged_state=self.state.staged_option,
            staged_vram=self.settings.staged_vram,
            staged_grad_bytes=self.settings.staged_grad_bytes,
            working_bytes=self._working + self.extra_working, vram_budget=self.budget,
            host_budget=host, grad_bytes=0, moment_dtype="float32",
            param_offload=list(self.pager.paged) if self.weights_fixed else "auto",
            activation_offload="auto", prefetch_depth=self.settings.prefetch_depth,
            block_forward_s=self.measured["forward_s"],
            link_bytes_per_s=self.settings.link_bytes_per_s,
            transfer_bytes=self.readings.transfer_bytes(),
            # Settling and the watchdog only add streamed blocks; the probe's plan (and the
            # trials', ``fresh``) may also take back those streamed before.
            paged_already=(tuple(self.pager.paged) if self.steps_since_plan >= 0 and not fresh
                           else ()),
            activation_choice=self._activation_choice)

    def replan(self, fresh: bool = False) -> bool:
        """Plans from the measurements and applies the plan when it decides otherwise than
        the one that runs; returns whether it did. The same decisions again leave the settling
        count as it is: a measurement that moves no decision is no reason to watch more
        steps."""
        plan = plan_memory(self._plan_inputs(fresh))
        if self.applied.decides_the_same(plan):
            self.applied.keep(plan, self._facts_cache)
            return False
        self.apply_plan(plan)
        return True

    def apply_plan(self, plan: MemoryPlan) -> None:
        """Applies ``plan`` and starts settling it."""
        self.applied.apply(plan, self._facts_cache)
        self.steps_since_plan = 0
        self.adapting = True
        self.meter.plan_changed()
        if self.cuda:
            # What the old plan's steps left cached (another layout of activations, weights and
            # state) goes back, so that it cannot fragment the new plan's steps.
            torch.cuda.empty_cache()

    # -- after every step -----------------------------------------------------------------------

    def after_step(self) -> None:
        """Called after every optimizer step. Never raises: a plan that cannot be made or
        applied leaves training as it runs now, and an event says why."""
        try:
            self._after_step()
        except Exception as e:  # noqa: BLE001 - training goes on; the reason is reported
            if self._whole_trial is not None:
                # A plan on trial failed: the fastest timed (or the one before the trial)
                # runs, not the plan that failed.
                trial = self._whole_trial
                if trial.current != trial.order[0]:
                    self._restore_trial_working()
                self._end_whole_trial(trial, trial.winner if trial.seconds else "")
            self.adapting = False
            self.steps_since_plan = max(self.steps_since_plan, 0)
            self.staging.stop()  # no trial of a plan that failed
            self._whole_trial, self._whole_trial_done = None, True
            self.say("plan.limit", f"the plan stays as it runs now: {e}")
            if self.cuda:
                self.meter.reset_peak()

    def _correction_streams(self, peak: int, fragmented: int) -> bool:
        """Whether the settling correction for a step whose allocated peak fit the budget, but
        whose reserved peak crowded the process's limit, would stream weights the plan keeps in
        VRAM now. The correction is then left out, said once: the allocator's cached blocks go
        back after such steps (_reserved_over), and it hands its free blocks back by itself
        before it fails an allocation, where streaming a block's weights costs every step its
        copies (a 2.6B full fine-tune's fifth correction streamed four blocks: 0.65 s steps
        became 2.1 s, H100 2026-12-07)."""
        grew = settling_correction(peak, self.plan.vram_bytes if self.plan is not None
                                   else self.budget, self.budget, fragmented)
        self.extra_working += grew
        try:
            streamed = set(plan_memory(self._plan_inputs()).paged_blocks)
        except MemoryPlanError:
            streamed = set(range(len(self.blocks)))
        finally:
            self.extra_working -= grew
        more = sorted(streamed - set(self.pager.paged))
        if more and not self._fragmentation_kept_said:
            self._fragmentation_kept_said = True
            self.say("plan.settling", f"the allocator's reserved peak came within "
                     f"{100 * RESERVED_MARGIN:.0f}% of the process's limit while the step's "
                     f"peak ({size(peak)}) fit the {size(self.budget)} budget; planning for "
                     f"{size(grew)} more working memory would stream the weights of "
                     f"{len(more)} more block(s), so the plan stays and the allocator's cached "
                     "blocks go back after such steps", peak_bytes=peak,
                     fragmented_bytes=fragmented, blocks=len(more))
        return bool(more)

    def _after_step(self) -> None:
        if self.steps_since_plan < 0:
            self._plan_from_probe()
            return
        self.steps_since_plan += 1
        if self._measure_next is not None:
            if self._measured_again():
                return
            if self.cuda:
                # The measured step replayed a block and kept its activations where the next
                # steps page or recompute them: its cached blocks, laid out for that step, go
                # back rather than fragment the steps after it.
                self._release_cache_after_step = True
        # Only CUDA has a peak to read; elsewhere the plan settles on the measured numbers.
        peak = self.meter.peak() - self.others if self.cuda else 0
        fragmented = self.meter.reserved_over() if self.cuda else 0
        if self.cuda:
            self.meter.watch_growth()
        # What the step needed beyond the budget: its allocated peak, or the room its reserved
        # peak left under the process's limit.
        needed = max(peak, self.budget + fragmented if fragmented else 0)
        limit = self.budget * (1 + (_WATCHDOG_SLACK if not self.adapting else 0))
        if (fragmented and peak <= self.budget and self.adapting
                and not self._trial_candidate_running()
                and self._correction_streams(peak, fragmented)):
            needed = peak  # the cached blocks went back (_reserved_over); the plan stays
        if needed > limit and self.adapting and self._trial_candidate_running():
            # A plan on trial that does not fit as planned is left out, not corrected: the
            # corrections would grow the working memory every later plan is made with.
            self.meter.reset_peak()
            self._trial_candidate_overshot(peak, fragmented)
        elif needed > limit and self.adapting:
            grew = settling_correction(
                peak, self.plan.vram_bytes if self.plan is not None else self.budget,
                self.budget, fragmented)
            self._largest_overshoot = max(self._largest_overshoot, grew)
            last = self.corrections >= _MAX_CORRECTIONS
            if last:
                # Each correction overshot again: once more with the largest overshoot seen,
                # and the plan settles.
                grew = self._largest_overshoot
            self.corrections += 1
            self.extra_working += grew
            free_reserved = (torch.cuda.max_memory_reserved(self.device)
                             - torch.cuda.max_memory_allocated(self.device))
            why = (f"step peak {size(peak)} is over the {size(self.budget)} budget by "
                   f"{size(peak - self.budget)}" if peak > self.budget else
                   f"the allocator reserved {size(fragmented)} more than this plan may "
                   f"(within {100 * RESERVED_MARGIN:.0f}% of the process's limit; "
                   f"{size(free_reserved)} of it free but reserved)")
            self.say("plan.settling", f"{why}: planning again with {size(grew)} more working "
                     f"memory (correction {self.corrections} of at most "
                     f"{_MAX_CORRECTIONS + 1})", peak_bytes=peak, budget_bytes=self.budget,
                     fragmented_bytes=fragmented, correction=self.corrections)
            # The peak that was read is accounted for: the next one is read from here.
            self.meter.reset_peak()
            try:
                self.replan()
            except Exception:
                # No plan fits that much more: the next step's peak is read against the same
                # working memory, not one grown again by the same overshoot.
                self.extra_working -= grew
                raise
            if last:
                self.adapting = False
                if self._whole_trial is not None:
                    # Only the plan before the trial takes this many corrections (one on trial
                    # is left out sooner): it runs on, and no other is timed.
                    self._whole_trial, self._whole_trial_done = None, True
                    self.say("plan.trial", "the trial of whole plans stops: the plan it "
                             "started from took its last settling correction")
                self.say("plan.settled", f"plan settled after {self.corrections} corrections, "
                         f"with {size(self.extra_working)} more working memory than measured "
                         "(the watchdog still re-plans if a later step grows)",
                         peak_bytes=peak, budget_bytes=self.budget,
                         extra_working_bytes=self.extra_working)
                self.meter.reset_peak()
        elif fragmented and peak <= limit and not self.adapting:
            # Settled, within the budget, but reserved memory crowded the limit: the cached
            # blocks went back (_reserved_over); said on the first time and every 100th.
            self._fragmented_steps += 1
            if self._fragmented_steps % 100 == 1:
                self.say("plan.fragmentation", f"the allocator's reserved peak came within "
                         f"{100 * RESERVED_MARGIN:.0f}% of the process's limit "
                         f"({size(self.meter.process_limit())}) while the step's peak was "
                         f"{size(peak)} of the {size(self.budget)} budget: its cached blocks "
                         f"were released ({self._fragmented_steps} such steps so far)",
                         peak_bytes=peak, fragmented_bytes=fragmented,
                         steps=self._fragmented_steps)
        elif needed > limit and needed > self._unfixable_peak * (1 + _WATCHDOG_SLACK):
            # A settled run grew (a longer sequence, a larger batch): what grew is measured in
            # the next step, with the plan as it is, rather than guessed from the peak alone.
            self.say("plan.watchdog", f"step peak {size(peak)} is over the "
                     f"{size(self.budget)} budget by {size(peak - self.budget)}: measuring "
                     "a block again in the next step to plan again", peak_bytes=peak,
                     budget_bytes=self.budget)
            self._start_measuring("watchdog")
        elif (self.adapting and self.steps_since_plan >= _SETTLE_STEPS
              and not self.staging.step() and not self._whole_plan_trial()):
            self.adapting = False
            measured = (f"step peak {size(peak)} of the {size(self.budget)} "
                        "budget" if self.cuda else "no VRAM peak to read off a CPU device")
            self.say("plan.settled", f"plan settled: {measured}", peak_bytes=peak,
                     budget_bytes=self.budget)
        if self.cuda and self.adapting:
            # Each settling step is read alone; once settled the counter is the user's again
            # and the watchdog reads the peak since then (it only grows).
            self.meter.reset_peak()
        if self._release_cache_after_step:
            self._release_cache_after_step = False
            torch.cuda.empty_cache()

    # -- whole plans timed against each other (plan_trial.py) ------------------------------

    @staticmethod
    def _decisions(plan: MemoryPlan) -> tuple:
        return tuple(plan.paged_blocks), tuple(plan.activation_policy)

    def _trial_choices(self) -> list:
        """The choice running now, then each other one whose plan decides otherwise."""
        choices, seen = [self._activation_choice], [self._decisions(self.plan)]
        if all(p == "keep" for p in self.plan.activation_policy):
            return choices  # every block keeps its activations: nothing to page or recompute
        # Each plan is made with the probe's working memory: what settling added was this
        # plan's, and each plan on trial settles on its own (_TRIAL_CORRECTIONS).
        inputs = replace(self._plan_inputs(fresh=True), working_bytes=self._working)
        for choice in ACTIVATION_CHOICES:
            if choice == self._activation_choice:
                continue
            try:
                plan = plan_memory(replace(inputs, activation_choice=choice))
            except Exception:  # noqa: BLE001 - a choice that cannot fit is not timed
                continue
            if self._decisions(plan) not in seen:
                seen.append(self._decisions(plan))
                choices.append(choice)
        return choices

    def _whole_plan_trial(self) -> bool:
        """Called on each settled step (after the staging trial); returns True while the
        trial runs. Each plan is timed once it has settled; the fastest runs on."""
        if not self.cuda or self._whole_trial_done or self.plan is None:
            return False
        trial = self._whole_trial
        if trial is None:
            choices = self._trial_choices()
            if len(choices) < 2:
                self._whole_trial_done = True
                return False
            trial = self._whole_trial = WholePlanTrial(choices)
            self.say("plan.trial", f"timing {len(choices)} whole plans, {TRIAL_STEPS} settled "
                     f"steps each: {', '.join(choices)} (the first runs now)",
                     plans=len(choices))
        torch.cuda.synchronize(self.device)
        self._whole_trial_plans[trial.current] = (self.plan, self.extra_working,
                                                  self.corrections)
        return self._trial_went_on(trial, trial.settled_step(self.plans_applied))

    def _trial_went_on(self, trial: WholePlanTrial, step: Any) -> bool:
        """Applies the plans ``step`` asks for until one runs (True) or the trial ends."""
        while step.action == "apply":
            self._trial_working = (self._activation_choice, self.extra_working,
                                   self.corrections)
            self._activation_choice = step.choice
            self.extra_working, self.corrections = 0, 0
            applying = False
            try:
                plan = plan_memory(self._plan_inputs(fresh=True))
                best = min(trial.seconds.values(), default=0.0)
                # Its paging crosses both ways at once: half of it over the one-way rate is
                # a lower bound of its step.
                link = self.settings.link_bytes_per_s
                link_s = plan.pcie_bytes_per_step / (2 * link) if link > 0 else 0.0
                if best and link_s >= best:
                    # Its paging alone over the measured link outlasts a plan timed already.
                    self._restore_trial_working()
                    step = trial.skip(f"its {size(plan.pcie_bytes_per_step)} over PCIe a step "
                                      f"take {1e3 * link_s:.0f} ms at the measured rate, more "
                                      f"than the {1e3 * best:.0f} ms step measured already")
                    continue
                applying = True
                if self.replan(fresh=True):
                    return True
                self._restore_trial_working()
                step = trial.skip("the same decisions as the plan timed before it")
            except Exception as e:  # noqa: BLE001 - that plan is left out of the trial
                self._restore_trial_working()
                if applying:
                    # Part of it may be in place (streamed weights): the plan that ran before
                    # it is applied again whole.
                    self.apply_plan(self.plan)
                step = trial.skip(f"could not be planned or applied: {e}")
        if step.action == "time":
            return True
        return self._end_whole_trial(trial, step.choice)

    def _restore_trial_working(self) -> None:
        """The choice, working memory and corrections of the plan before the one on trial."""
        self._activation_choice, self.extra_working, self.corrections = self._trial_working

    def _trial_candidate_running(self) -> bool:
        """A plan the trial applied (not the one that ran before it) went over the budget
        after as many settling corrections as a plan on trial gets."""
        trial = self._whole_trial
        return (trial is not None and trial.current != trial.order[0]
                and self.corrections >= _TRIAL_CORRECTIONS)

    def _trial_candidate_overshot(self, peak: int, fragmented: int) -> None:
        trial = self._whole_trial
        self._restore_trial_working()
        why = (f"its step peak {size(peak)} went over the {size(self.budget)} budget"
               if peak > self.budget else
               f"the allocator reserved {size(fragmented)} more than it may")
        self.say("plan.trial", f"{trial.current}: {why}; left out of the trial",
                 peak_bytes=peak)
        if not self._trial_went_on(trial, trial.skip(why)):
            # The trial ended with the plan in place (it was timed already): settled.
            self.adapting = False
            self.say("plan.settled", "plan settled after the trial of whole plans",
                     budget_bytes=self.budget)

    def _end_whole_trial(self, trial: WholePlanTrial, winner: str) -> bool:
        """The fastest plan timed runs on (applied again unless it is the one running); with
        none timed, the plan that ran before the trial. Returns whether it applied a plan
        (which then settles as any plan does)."""
        self._whole_trial, self._whole_trial_done = None, True
        running = self._activation_choice
        winner = winner or trial.order[0]
        plan, extra, corrections = self._whole_trial_plans.get(winner, (None, 0, 0))
        numbers = {f"{choice}_ms": 1e3 * s for choice, s in trial.seconds.items()}
        self.trial_result = {"winner": winner, "step_ms": {c: 1e3 * s for c, s in
                                                           trial.seconds.items()},
                             "skipped": dict(trial.skipped)}
        if plan is not None and plan is not self.plan:
            try:
                self._activation_choice = winner
                self.extra_working, self.corrections = extra, corrections
                self.apply_plan(plan)
            except Exception as e:  # noqa: BLE001 - the plan that runs now goes on
                self._activation_choice = running
                self.say("plan.trial", f"{winner} measured fastest ({trial.summary()}) but "
                         f"could not be applied again ({e}): {running} runs on",
                         **numbers)
                self.trial_result["winner"] = running
                return False
            applied = True
        else:
            applied = False
            self._activation_choice = winner
        self.say("plan.trial", f"{winner} runs on, the fastest of the whole plans timed: "
                 f"{trial.summary()}", **numbers)
        return applied

    def _start_measuring(self, reason: str) -> None:
        self.pager.timing.measured.pop(self.probe.block, None)
        self.pager.measure = {self.probe.block}
        self._measure_next = reason
        if self.cuda:
            self.meter.reset_peak()

    def _plan_from_probe(self) -> None:
        facts, act, forward_s = measured_block_facts(self.pager, self.blocks, self.probe.block)
        self.measured = {"activation_bytes": act, "input_bytes": facts[0].input_bytes,
                         "forward_s": forward_s}
        self._working = self._working_from_peak(facts)
        self.measured["working_bytes"] = self._working
        self._measure_host_pass()
        self.say("plan.measured", f"probe: a block saves {size(act)} for backward, its "
                 f"input is {size(facts[0].input_bytes)}, its forward takes "
                 f"{1e3 * forward_s:.2f} ms; working memory {size(self._working)}",
                 activation_bytes=act, input_bytes=facts[0].input_bytes,
                 forward_ms=1e3 * forward_s, working_bytes=self._working)
        self._facts_cache = facts
        try:
            self.replan()
        finally:
            # Measured again in the next step, warm; its peak is read alone, not with the
            # probe's.
            self._start_measuring("warm")

    def _measured_again(self) -> bool:
        """Reads the block measured in this step and this step's working memory. After the
        probe, plans again (returning True) when the forward time or the working memory differ
        from the probe's by more than a quarter; after the watchdog, always plans again."""
        reason, self._measure_next = self._measure_next, None
        self.pager.measure = set()
        if self.probe.block not in self.pager.timing.measured:
            return False  # the step did not run the block with gradients: nothing to read
        peak = self.meter.peak() - self.others if self.cuda else 0
        facts, act, forward_s = measured_block_facts(self.pager, self.blocks, self.probe.block)
        self.pager.timing.measured.pop(self.probe.block)
        working = self._working_from_peak(facts)
        before = dict(self.measured)

        def moved(new: float, old: float) -> bool:
            return abs(new - old) > 0.25 * max(old, 1e-9)

        if reason == "warm":
            self.measured["forward_s_probe"] = before["forward_s"]
            self.measured["working_bytes_probe"] = before["working_bytes"]
            host_rate = self._measure_host_pass()
            changed = [what for what, new, old in (
                ("forward", forward_s, before["forward_s"]),
                ("working memory", working, before["working_bytes"] + self.extra_working),
                ("host optimizer pass", host_rate, before.get("host_s_per_element", 0.0)))
                if new > 0 and moved(new, old)]
            if not changed:
                return False
        else:
            changed = ["activations", "working memory"]
        self.measured.update(activation_bytes=act, input_bytes=facts[0].input_bytes,
                             forward_s=forward_s, working_bytes=working)
        self._facts_cache = facts
        self._working, self.extra_working = working, 0
        self.say("plan.remeasured", f"measured again ({reason} step): a block saves "
                 f"{size(act)} for backward, its forward takes {1e3 * forward_s:.2f} ms, "
                 f"working memory {size(working)} (the {'probe' if reason == 'warm' else 'plan'}"
                 f" had {size(before['activation_bytes'])}, {1e3 * before['forward_s']:.2f} ms, "
                 f"{size(before['working_bytes'])}): planning again for the "
                 f"{' and '.join(changed)}", activation_bytes=act, forward_ms=1e3 * forward_s,
                 working_bytes=working, probe_forward_ms=1e3 * before["forward_s"])
        if self.cuda:
            self.meter.reset_peak()
        if reason == "watchdog":
            # Until a plan holds it, a peak this high is not measured again every other step.
            self._unfixable_peak = peak
        if self.replan() or reason != "watchdog":
            self._unfixable_peak = 0
        return True

    def _working_from_peak(self, facts: list) -> int:
        """The step's working memory read off its peak (0 off CUDA: no peak to read)."""
        if not self.cuda:
            return 0
        state = self.state.vram_bytes(self.settings.staged_vram)
        return working_from_peak(self.meter.peak() - self.others, facts, self.pager,
                                 self.recompute.indices, self.settings.other_weight_bytes, state,
                                 self.probe.loss_floor)

    def _measure_host_pass(self) -> float:
        """The host pass per element (0 where no state may move: it decides nothing)."""
        moves = self.readings.host_pass is not None and self.state.may_move()
        return host_pass_rate(self.readings.host_pass, self.measured) if moves else 0.0

    def say(self, kind: str, message: str, **numbers: float) -> None:
        self.history.append(message)
        self.actions.note(kind, message, **numbers)

    def report(self) -> dict:
        plan = self.plan
        return {"adapting": self.adapting, "budget_bytes": self.budget,
                "measured": dict(self.measured),
                "estimated_vram_bytes": plan.vram_bytes if plan else None,
                "pcie_bytes_per_step": plan.pcie_bytes_per_step if plan else None,
                "host_activation_bytes": self.applied.host_activation_bytes,
                "gpu_state_blocks": self.state.blocks,
                "gpu_state_elements": self.state.elements,
                "staged_blocks": self.state.staged_blocks,
                "staged_elements": self.state.staged_elements,
                "estimated_step_s": dict(plan.step_s) if plan else None,
                # Settling's corrections, the extra working memory they added, the steps whose
                # reserved memory crowded the process's limit, VRAM held after the last step.
                "corrections": self.corrections, "extra_working_bytes": self.extra_working,
                "fragmented_steps": self._fragmented_steps,
                "held_bytes": self.meter.held[-1] if self.meter.held else None,
                # The whole plans timed against each other: the one that runs, each one's step.
                "activation_choice": self._activation_choice,
                "plan_trial": dict(self.trial_result),
                "history": list(self.history)}
