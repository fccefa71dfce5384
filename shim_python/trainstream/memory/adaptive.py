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

import time
import warnings
from typing import Any, Callable

import torch

from .allocator_split import LargeBlocksWhole
from .weight_plan import weight_plan_for_sizes
from .planner import (BlockFacts, MemoryPlan, MemoryPlanError, PlanInputs, plan_memory,
                      size)

# Steps after the plan is applied whose peaks may still correct it; later, only the watchdog.
_SETTLE_STEPS = 2
# A later step's peak may exceed the budget by this share before the watchdog re-plans.
_WATCHDOG_SLACK = 0.02
# Settled steps timed together on each side of the staging trial.
_TRIAL_STEPS = 3
# Corrections settling may make for steps over the budget; then the largest overshoot seen is
# added once more and the plan settles (the watchdog still watches): a plan that each step
# overshoots by a different amount would otherwise stream one more block every step.
_MAX_CORRECTIONS = 4
# The caching allocator may reserve up to the process's limit; a step whose reserved peak comes
# this close to it is treated as over the budget by the difference (fragmentation is working
# memory too: the next large tensor may not find room in what is reserved but free).
_RESERVED_MARGIN = 0.03
# VRAM held between steps growing this much a step, several steps running with one plan, is
# something keeping each step's tensors: said once, never planned for.
_GROWTH_BYTES, _GROWTH_STEPS = 32 << 20, 4
# Before the probe has measured anything: a transformer block's saved activations per
# position and hidden unit (bf16; its MLP's wider intermediate included).
_BLOCK_ACTIVATION_BYTES = 48


def settling_correction(peak: int, estimate: int, budget: int, fragmented: int) -> int:
    """The working memory settling adds after a step over the budget so that the next step,
    under the plan made with it, fits: its peak within ``budget`` and its reserved peak within
    the margin of the process's limit (``fragmented``: how far past that margin it came).

    The plan's ``estimate`` (with the working memory added so far) missed the measured
    ``peak`` by ``peak - estimate``, and the next plan's step misses its own estimate by as
    much while the planner holds that estimate to the budget: the peak fits with
    ``peak - estimate`` more, and the reserved peak (the peak plus what was reserved but free,
    taken to be the same next step) comes down by ``fragmented`` with
    ``budget - estimate + fragmented`` more. Adding only the overshoot past the budget left a
    plan estimated under the budget unmoved while its steps' reserved peaks stayed at the
    limit, and a later step ran out of memory (the GPU model matrix, 2026-12-02)."""
    grew = peak - estimate
    if fragmented:
        grew = max(grew, budget - estimate + fragmented)
    return max(int(grew), int(peak - budget), 1 << 20)


class AdaptivePlan:
    """Owns the activation policy of ``blocks`` (and may stream more of their weights) for a
    wrapped model.

    ``pager`` is the model's BlockPager, ``recompute`` its Recompute; ``stream_weights(blocks)``
    makes more blocks stream their weights (the optimizer stops returning their updates first);
    ``plan_host(extra)`` re-declares the job's host memory with ``extra`` bytes of paged
    activations (raising if the daemon refuses); ``note(kind, message, **numbers)`` says a
    decision.
    """

    def __init__(self, blocks: list, pager: Any, recompute: Any, budget: int,
                 stream_weights: Callable[[list], None], unstream_weights: Callable[[list], None],
                 plan_host: Callable[[int], None],
                 host_free: Callable[[], int], note: Callable[..., None],
                 other_weight_bytes: int = 0, prefetch_depth: int = 1,
                 link_bytes_per_s: float = 0.0, weights_fixed: bool = False,
                 others_bytes: int = 0,
                 transfer_bytes: Callable[[], tuple] = lambda: (0, 0),
                 host_cap: int = 0, gpu_state: object = 0,
                 set_gpu_state: Callable[[int, int], tuple] | None = None,
                 host_pass: Callable[[], tuple] | None = None,
                 other_trainable: int = 0, update_transfer: tuple = (4, 4),
                 staged_state: object = 0, staged_vram: int = 768 << 20,
                 staged_grad_bytes: int = 0):
        self.blocks = blocks
        self.pager = pager
        self.recompute = recompute
        self.budget = int(budget)
        self._stream_weights = stream_weights
        self._unstream_weights = unstream_weights
        self._plan_host = plan_host
        self._host_free = host_free
        self._note = note
        self._depth = prefetch_depth
        self._link = float(link_bytes_per_s)
        self.weights_fixed = weights_fixed
        self._other_weights = int(other_weight_bytes)  # VRAM weights outside the block stack
        # What the process held on the device besides this model at wrap(): not in the budget,
        # and taken off every peak read here.
        self.others = int(others_bytes)
        # The optimizer's PCIe bytes a step (to, from the GPU), as blocks stream now.
        self._transfer_bytes = transfer_bytes
        self._host_cap = int(host_cap)  # host_arena= bytes: paged activations never take more
        # The optimizer state kept in VRAM: gpu_state is "auto", or a number of leading blocks
        # (0: none); set_gpu_state(blocks, staged) keeps those blocks' state (and the
        # parameters' outside the stack) there, updates ``staged`` of the blocks after them on
        # the GPU from moments staged out of the daemon, and returns the elements of each;
        # host_pass() is the last step's host optimizer pass (seconds, elements updated on the
        # host).
        self._gpu_state_option = gpu_state if set_gpu_state is not None else 0
        self._set_gpu_state = set_gpu_state
        self._host_pass = host_pass
        # Elements outside the stack whose state may move (fp32 trained ones), and what each
        # updated on the host moves over PCIe a step (the updated weight in, its gradient out).
        self._other_trainable = int(other_trainable)
        self._update_transfer = tuple(update_transfer)
        self.gpu_state_blocks = 0
        self.gpu_state_elements = 0
        self.staged_blocks = 0
        self.staged_elements = 0
        self._staged_vram = int(staged_vram)
        self._staged_grad_bytes = int(staged_grad_bytes)  # see PlanInputs
        # "auto", or a number of blocks staged through the GPU (planner.PlanInputs); only
        # where state may move at all.
        self._staged_option = staged_state if set_gpu_state is not None else 0
        # Staging the planner chose ("auto") is kept only if it measures faster: the settled
        # steps are timed with it, then without, and the faster plan stays (the planner's model
        # of a step cannot see how the staged copies and backward slow each other).
        self._trial: dict | None = None  # the side being timed, and each side's step time
        self._trial_done = False
        self._plans_applied = 0  # a plan applied mid-window restarts that side's timing
        self.cuda = pager.cuda
        self.device = pager.device
        self.probe_block = len(blocks) - 1
        self.plan: MemoryPlan | None = None
        self.history: list[str] = []
        self.measured: dict = {}
        self.extra_working = 0         # what the settling steps and the watchdog added
        self.corrections = 0           # settling's corrections since the probe's plan
        self._largest_overshoot = 0
        self._held: list[int] = []     # VRAM held after each step since the last plan change
        self._growth_said = False
        self._fragmented_steps = 0
        self.steps_since_plan = -1     # -1: the probe has not run
        self.adapting = True
        self.host_activation_bytes = 0
        # "warm": the first step after the probe's plan measures the block again (the probe is a
        # first step: the allocator grows, libraries pick kernels); "watchdog": a later step
        # grew past the budget, and the next one measures what grew.
        self._measure_next: str | None = None
        self._unfixable_peak = 0  # a watchdog peak no plan could hold: not measured again
        self._release_cache_after_step = False
        # The loss's working memory for the step's logits (make_room_for_probe): its logits and
        # their gradient live together with every kept activation as backward starts, so no
        # working memory read off a peak is less (a probe whose peak came elsewhere read less,
        # and the plan's first step ran out of memory: small Phi-3 LoRA, 2026-12-02).
        self.loss_floor = 0
        self.large_blocks = LargeBlocksWhole()  # taken back by unwrap()
        self._start_probe()

    # -- the probe ------------------------------------------------------------------------------

    def _start_probe(self) -> None:
        offload, again = self._probe_policy()
        if self.cuda:
            self._reset_peak()
        self._say("plan.probe", f"probe step: block {self.probe_block} is measured, "
                  f"{len(again)} blocks recompute and {len(offload)} page their activations "
                  "meanwhile")

    def _probe_policy(self) -> tuple[list, list]:
        """The probe step's activations: streamed blocks page theirs, the others recompute."""
        last = self.probe_block
        streamed = set(self.pager.paged)
        offload = [b for b in range(last) if b in streamed]
        again = [b for b in range(last) if b not in streamed]
        self.recompute.set(again)
        self.pager.set_activation_blocks(offload)
        self.pager.measure = {last}
        return offload, again

    def make_room_for_probe(self, tokens: int, vocab: int, hidden: int,
                            loss_bytes: int) -> None:
        """Called as the probe step's forward starts, when its size is first known: the loss's
        working memory (``loss_bytes``, for the logits of ``tokens`` positions over ``vocab``:
        chunked_loss.working_bytes) and a block's activations may not fit
        beside the weights wrap() left in VRAM, which reserved only a quarter of the budget
        for them. More blocks then stream their weights before any block runs; a step that
        cannot fit even with every block streaming is refused here, with the numbers, rather
        than ending in an out-of-memory error. With the streamed blocks chosen by the user
        (param_offload), an estimate is not a reason to refuse: an event says it looks tight."""
        if self.steps_since_plan >= 0 or tokens <= 0:
            return
        loss = int(loss_bytes)
        self.loss_floor = loss
        if self.cuda:
            # The logits and their gradient, half the loss's working memory each.
            limit = self.large_blocks.apply(loss // 2)
            if limit:
                self._say("plan.allocator",
                          f"the caching allocator no longer splits blocks of {limit} MiB or more "
                          f"(max_split_size_mb, process-wide until unwrap()): the step's logits "
                          f"({size(loss // 2)}, and as much for their gradient) come back to "
                          "blocks of their own each step, rather than to reserved memory cut "
                          "up by smaller tensors; set PYTORCH_CUDA_ALLOC_CONF to choose "
                          "otherwise", max_split_mib=limit)
        # The measured block's activations, and the inputs the recomputed ones keep.
        activations = tokens * hidden * (_BLOCK_ACTIVATION_BYTES + 2 * len(self.blocks))
        sizes = [self._weights_bytes(b) for b in range(len(self.blocks))]
        # Streamed blocks page their activations in the probe: copies still crossing to host
        # memory hold device memory up to the pager's cap.
        in_flight = self.pager.max_inflight_bytes if self.cuda else 0
        # Backward holds a block's gradients while the one before it computes its own (the
        # first are still crossing to the optimizer): beside the loss and the activations, as
        # in wrap()'s plan for the probe (weight_plan.weight_plan).
        grads = 2 * max(int(self._trained_share(b) * w) for b, w in enumerate(sizes))
        working = loss + activations + grads
        streamed = set(self.pager.paged)
        resident = self._other_weights + sum(w for b, w in enumerate(sizes) if b not in streamed)
        paging = (self._depth + 1) * max(sizes) + in_flight if streamed else 0
        if resident + paging + working <= self.budget:
            return

        working += in_flight
        need = self._other_weights + (self._depth + 1) * max(sizes) + working
        if self.weights_fixed:
            self._say("plan.probe_tight",
                      f"the first step trains on {tokens} positions: its loss ({size(loss)}) and "
                      f"a block's activations ({size(activations)}) beside the weights kept in "
                      f"VRAM ({size(resident)}) may not fit in the {size(self.budget)} budget; "
                      "param_offload chose the streamed blocks, so none more stream",
                      loss_bytes=loss, activation_bytes=activations)
            return
        if need > self.budget:
            raise MemoryPlanError(
                f"trainstream: the first step does not fit in the {size(self.budget)} VRAM "
                f"budget: its loss works on {tokens} positions x {vocab} logits ({size(loss)} "
                f"with their gradients), a block's activations take about "
                f"{size(activations)}" + (f", two blocks' gradients {size(grads)}"
                                          if grads else "")
                + (f", those crossing to host memory up to {size(in_flight)}"
                   if in_flight else "")
                + f", and the weights outside the blocks with {self._depth + 1} device slots "
                f"take {size(need - working)}. Train on fewer positions a step (a smaller "
                "batch with accumulation_steps, shorter sequences) or give the process more "
                "VRAM (vram_budget, vram_headroom)")
        paged = weight_plan_for_sizes(sizes, self._other_weights, self.budget, self._depth,
                                      probe=False, working=working)
        added = [b for b in paged if b not in streamed]
        if not added:
            return
        self._stream_weights(added)
        offload, again = self._probe_policy()
        self._say("plan.probe_room",
                  f"the first step trains on {tokens} positions: its loss works on "
                  f"{tokens} x {vocab} logits (about {size(loss)} with their gradients) and "
                  f"a block's activations on about {size(activations)}, more than wrap() left "
                  f"beside the weights; {len(added)} more blocks stream their weights for the "
                  f"probe ({len(self.pager.paged)} of {len(self.blocks)}), and the plan made "
                  "from its measurements keeps what fits",
                  loss_bytes=loss, activation_bytes=activations, added_blocks=len(added))

    def _peak(self) -> int:
        """The VRAM peak since the last reset, a replay's own memory left out."""
        return max(torch.cuda.max_memory_allocated(self.device), self.pager.peak_before_replay)

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self.pager.peak_before_replay = 0

    def _process_limit(self) -> int:
        """What the caching allocator may reserve in this process (torch's per-process
        fraction of the device): a reservation past it is an out-of-memory error."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return int(total * (float(getter(self.device)) if getter is not None else 1.0))

    def _reserved_over(self) -> int:
        """How far the step's reserved peak came past the process's limit less the margin
        (0: not): reserved memory this process held but could not have handed out again.
        Cached blocks are released when it did, so the next steps start from what they use."""
        reserved = torch.cuda.max_memory_reserved(self.device)
        over = int(reserved - (1 - _RESERVED_MARGIN) * self._process_limit())
        if over <= 0:
            return 0
        torch.cuda.empty_cache()
        return over

    def _watch_growth(self) -> None:
        """Says once when the VRAM held between steps grows step after step under one plan:
        something keeps each step's tensors (a list of losses with their graphs, a cache), which
        no plan can make room for."""
        held = torch.cuda.memory_allocated(self.device) - self.others
        self._held.append(held)
        recent = self._held[-(_GROWTH_STEPS + 1):]
        if (self._growth_said or len(recent) <= _GROWTH_STEPS
                or any(b - a < _GROWTH_BYTES for a, b in zip(recent, recent[1:]))):
            return
        self._growth_said = True
        rate = (recent[-1] - recent[0]) // _GROWTH_STEPS
        message = (f"VRAM held between steps grew by {size(rate)} a step over the last "
                   f"{_GROWTH_STEPS} steps with the plan unchanged (now {size(held)}): "
                   "something keeps each step's tensors alive (a list of losses that still "
                   "hold their graphs, a cache); no plan can make room for that")
        self._say("plan.growth", message, held_bytes=held, growth_bytes_per_step=rate)
        warnings.warn(f"trainstream: {message}", stacklevel=2)

    def _weights_bytes(self, b: int) -> int:
        return sum(p.numel() * p.element_size() for p in self.pager.params.get(b, ())) if (
            b in self.pager.position) else sum(p.numel() * p.element_size()
                                               for p in self.blocks[b].parameters())

    def _facts(self) -> tuple[list, int, float]:
        m = self.pager.measured.get(self.probe_block)
        if m is None:
            raise MemoryPlanError("the probe step did not run the last block's forward with "
                                  "gradients enabled; train with the model's forward")
        forward_s = self.pager.forward_seconds(self.probe_block)
        facts = [BlockFacts(weight_bytes=self._weights_bytes(b),
                            activation_bytes=m["saved_bytes"], input_bytes=m["input_bytes"],
                            trained_share=self._trained_share(b),
                            # What may keep its state in VRAM: fp32 trained weights.
                            trainable=sum(p.numel() for p in self.blocks[b].parameters()
                                          if p.requires_grad and p.dtype == torch.float32))
                 for b in range(len(self.blocks))]
        return facts, m["saved_bytes"], forward_s

    def _trained_share(self, b: int) -> float:
        """The share of block ``b``'s weights (by bytes, a quantized base's buffers counted)
        that train: backward computes their gradients, which a frozen base's weights do not
        have."""
        block = self.blocks[b]
        trained = sum(p.numel() * p.element_size() for p in block.parameters()
                      if p.requires_grad)
        total = trained + sum(t.numel() * t.element_size() for t in (
            *(p for p in block.parameters() if not p.requires_grad), *block.buffers()))
        return trained / total if total else 1.0

    def _working_from_peak(self, facts: list) -> int:
        """The step's VRAM beyond weights and saved activations, from its peak, under the
        activation policy the step ran with."""
        if not self.cuda:
            return 0
        peak = self._peak() - self.others
        streamed = set(self.pager.paged)
        resident = self._other_weights + sum(f.weight_bytes for b, f in enumerate(facts)
                                             if b not in streamed)
        slots = self.pager.resident_bytes()
        offloaded, recomputed = set(self.pager.offloading), set(self.recompute.indices)
        saved = (sum(f.activation_bytes for b, f in enumerate(facts)
                     if b not in offloaded and b not in recomputed)
                 + sum(facts[b].input_bytes for b in recomputed))
        in_flight = facts[0].activation_bytes if offloaded else 0
        # The moments held in VRAM; their gradients, which appear only as backward ends, may or
        # may not be in the peak and stay in the working memory read here.
        state = 8 * self.gpu_state_elements + (self._staged_vram if self.staged_elements else 0)
        return max(self.loss_floor, peak - resident - slots - saved - in_flight - state)

    # -- after every step -----------------------------------------------------------------------

    def after_step(self) -> None:
        """Called after every optimizer step. Never raises: a plan that cannot be made or
        applied leaves training as it runs now, and an event says why."""
        try:
            self._after_step()
        except Exception as e:  # noqa: BLE001 - training goes on; the reason is reported
            self.adapting = False
            self.steps_since_plan = max(self.steps_since_plan, 0)
            self._trial, self._trial_done = None, True  # no trial of a plan that failed
            self._say("plan.limit", f"the plan stays as it runs now: {e}")
            if self.cuda:
                self._reset_peak()

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
        peak = self._peak() - self.others if self.cuda else 0
        fragmented = self._reserved_over() if self.cuda else 0
        if self.cuda:
            self._watch_growth()
        # What the step needed beyond the budget: its allocated peak, or the room its reserved
        # peak left under the process's limit.
        needed = max(peak, self.budget + fragmented if fragmented else 0)
        limit = self.budget * (1 + (_WATCHDOG_SLACK if not self.adapting else 0))
        if needed > limit and self.adapting:
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
                   f"(within {100 * _RESERVED_MARGIN:.0f}% of the process's limit; "
                   f"{size(free_reserved)} of it free but reserved)")
            self._say("plan.settling", f"{why}: planning again with {size(grew)} more working "
                      f"memory (correction {self.corrections} of at most "
                      f"{_MAX_CORRECTIONS + 1})", peak_bytes=peak, budget_bytes=self.budget,
                      fragmented_bytes=fragmented, correction=self.corrections)
            # The peak that was read is accounted for: the next one is read from here.
            self._reset_peak()
            try:
                self._replan()
            except Exception:
                # No plan fits that much more: the next step's peak is read against the same
                # working memory, not one grown again by the same overshoot.
                self.extra_working -= grew
                raise
            if last:
                self.adapting = False
                self._say("plan.settled", f"plan settled after {self.corrections} corrections, "
                          f"with {size(self.extra_working)} more working memory than measured "
                          "(the watchdog still re-plans if a later step grows)",
                          peak_bytes=peak, budget_bytes=self.budget,
                          extra_working_bytes=self.extra_working)
                self._reset_peak()
        elif fragmented and peak <= limit and not self.adapting:
            # Settled, within the budget, but reserved memory crowded the limit: the cached
            # blocks went back (_reserved_over); said on the first time and every 100th.
            self._fragmented_steps += 1
            if self._fragmented_steps % 100 == 1:
                self._say("plan.fragmentation", f"the allocator's reserved peak came within "
                          f"{100 * _RESERVED_MARGIN:.0f}% of the process's limit "
                          f"({size(self._process_limit())}) while the step's peak was "
                          f"{size(peak)} of the {size(self.budget)} budget: its cached blocks "
                          f"were released ({self._fragmented_steps} such steps so far)",
                          peak_bytes=peak, fragmented_bytes=fragmented,
                          steps=self._fragmented_steps)
        elif needed > limit and needed > self._unfixable_peak * (1 + _WATCHDOG_SLACK):
            # A settled run grew (a longer sequence, a larger batch): what grew is measured in
            # the next step, with the plan as it is, rather than guessed from the peak alone.
            self._say("plan.watchdog", f"step peak {size(peak)} is over the "
                      f"{size(self.budget)} budget by {size(peak - self.budget)}: measuring "
                      "a block again in the next step to plan again", peak_bytes=peak,
                      budget_bytes=self.budget)
            self._start_measuring("watchdog")
        elif (self.adapting and self.steps_since_plan >= _SETTLE_STEPS
              and not self._staging_trial()):
            self.adapting = False
            measured = (f"step peak {size(peak)} of the {size(self.budget)} "
                        "budget" if self.cuda else "no VRAM peak to read off a CPU device")
            self._say("plan.settled", f"plan settled: {measured}", peak_bytes=peak,
                      budget_bytes=self.budget)
        if self.cuda and self.adapting:
            # Each settling step is read alone; once settled the counter is the user's again
            # and the watchdog reads the peak since then (it only grows).
            self._reset_peak()
        if self._release_cache_after_step:
            self._release_cache_after_step = False
            torch.cuda.empty_cache()

    # -- the staging trial ----------------------------------------------------------------------

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

    def _start_measuring(self, reason: str) -> None:
        self.pager.measured.pop(self.probe_block, None)
        self.pager.measure = {self.probe_block}
        self._measure_next = reason
        if self.cuda:
            self._reset_peak()

    def _plan_from_probe(self) -> None:
        facts, act, forward_s = self._facts()
        self.measured = {"activation_bytes": act, "input_bytes": facts[0].input_bytes,
                         "forward_s": forward_s}
        self._working = self._working_from_peak(facts)
        self.measured["working_bytes"] = self._working
        self._measure_host_pass()
        self._say("plan.measured", f"probe: a block saves {size(act)} for backward, its "
                  f"input is {size(facts[0].input_bytes)}, its forward takes "
                  f"{1e3 * forward_s:.2f} ms; working memory {size(self._working)}",
                  activation_bytes=act, input_bytes=facts[0].input_bytes,
                  forward_ms=1e3 * forward_s, working_bytes=self._working)
        self._facts_cache = facts
        try:
            self._replan()
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
        if self.probe_block not in self.pager.measured:
            return False  # the step did not run the block with gradients: nothing to read
        peak = self._peak() - self.others if self.cuda else 0
        facts, act, forward_s = self._facts()
        self.pager.measured.pop(self.probe_block)
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
        self._say("plan.remeasured", f"measured again ({reason} step): a block saves "
                  f"{size(act)} for backward, its forward takes {1e3 * forward_s:.2f} ms, "
                  f"working memory {size(working)} (the {'probe' if reason == 'warm' else 'plan'}"
                  f" had {size(before['activation_bytes'])}, {1e3 * before['forward_s']:.2f} ms, "
                  f"{size(before['working_bytes'])}): planning again for the "
                  f"{' and '.join(changed)}", activation_bytes=act, forward_ms=1e3 * forward_s,
                  working_bytes=working, probe_forward_ms=1e3 * before["forward_s"])
        if self.cuda:
            self._reset_peak()
        if reason == "watchdog":
            # Until a plan holds it, a peak this high is not measured again every other step.
            self._unfixable_peak = peak
        if self._replan() or reason != "watchdog":
            self._unfixable_peak = 0
        return True

    def _measure_host_pass(self) -> float:
        """The last step's host optimizer pass, per element it updated (0: not measured, or
        no state may move, when it decides nothing)."""
        if self._host_pass is None or self._gpu_state_option == self._staged_option == 0:
            return 0.0
        seconds, elements = self._host_pass()
        if seconds <= 0 or elements <= 0:
            return 0.0
        rate = seconds / elements
        self.measured["host_s_per_element"] = rate
        self.measured["host_pass_s"] = seconds
        return rate

    def _replan(self, fresh: bool = False) -> bool:
        """Plans from the measurements and applies the plan when it differs from the one that
        runs; returns whether it did. The same plan again leaves the settling count as it is:
        a measurement that moves no decision is no reason to watch more steps."""
        facts = [BlockFacts(weight_bytes=self._weights_bytes(b),
                            activation_bytes=f.activation_bytes, input_bytes=f.input_bytes,
                            trained_share=f.trained_share, trainable=f.trainable)
                 for b, f in enumerate(self._facts_cache)]
        own = self.host_activation_bytes
        host = max(0, self._host_free()) + own
        if self._host_cap:
            host = min(host, self._host_cap)
        trainable = self._other_trainable + sum(f.trainable for f in facts)
        inputs = PlanInputs(
            blocks=tuple(facts), other_weight_bytes=self._other_weights,
            other_trainable=self._other_trainable, host_state_planned=True,
            host_update_s=self.measured.get("host_s_per_element", 0.0) * trainable,
            gpu_state=self._gpu_state_option, update_transfer=self._update_transfer,
            staged_state=self._staged_option,
            staged_vram=self._staged_vram, staged_grad_bytes=self._staged_grad_bytes,
            working_bytes=self._working + self.extra_working, vram_budget=self.budget,
            host_budget=host, grad_bytes=0, moment_dtype="float32",
            param_offload=list(self.pager.paged) if self.weights_fixed else "auto",
            activation_offload="auto", prefetch_depth=self._depth,
            block_forward_s=self.measured["forward_s"], link_bytes_per_s=self._link,
            transfer_bytes=self._transfer_bytes(),
            # Settling and the watchdog only add streamed blocks; the probe's plan (and the
            # staging trial's, ``fresh``) may also take back those streamed before.
            paged_already=(tuple(self.pager.paged) if self.steps_since_plan >= 0 and not fresh
                           else ()))
        plan = plan_memory(inputs)
        if (self.plan is not None and plan.paged_blocks == self.plan.paged_blocks
                and plan.activation_policy == self.plan.activation_policy
                and plan.moment_dtype == self.plan.moment_dtype
                and plan.gpu_state_blocks == self.gpu_state_blocks
                and plan.staged_blocks == self.staged_blocks):
            # The same decisions; the paged activations may have grown (a longer sequence):
            # the daemon is told what the job holds now.
            host_bytes = sum(facts[b].activation_bytes
                             for b, p in enumerate(plan.activation_policy) if p == "offload")
            if host_bytes != self.host_activation_bytes:
                self._plan_host(host_bytes)
                self.host_activation_bytes = host_bytes
            self.plan = plan  # its estimates are the new measurements'
            self._say("plan.kept", f"the plan stands: the measurements move none of its "
                      f"decisions (estimated peak {size(plan.vram_bytes)} of "
                      f"{size(self.budget)})", vram_bytes=plan.vram_bytes,
                      budget_bytes=self.budget)
            return False
        self._apply_plan(plan)
        return True

    def _apply_plan(self, plan: MemoryPlan) -> None:
        """Applies ``plan`` (streamed weights, the job's host plan, activations, the optimizer
        state's place) and starts settling it."""
        offload = [b for b, p in enumerate(plan.activation_policy) if p == "offload"]
        again = [b for b, p in enumerate(plan.activation_policy) if p == "recompute"]
        added = [b for b in plan.paged_blocks if b not in self.pager.position]
        removed = [b for b in self.pager.paged if b not in plan.paged_blocks]
        host_bytes = sum(self._facts_cache[b].activation_bytes for b in offload)
        # Weights first (streaming frozen ones adds host copies), then the job's host plan with
        # the activations' bytes, then the activation policy, whose arena is taken at the next
        # forward.
        if removed:
            self._unstream_weights(removed)
        if added:
            self._stream_weights(added)
        self._plan_host(host_bytes)
        self.host_activation_bytes = host_bytes
        self.recompute.set(again)
        self.pager.set_activation_blocks(offload)
        self.plan = plan
        if (plan.gpu_state_blocks, plan.staged_blocks) != (self.gpu_state_blocks,
                                                            self.staged_blocks):
            # Last: a move that fails leaves the rest of the plan applied (after_step says why).
            self._apply_gpu_state(plan)
        for line in plan.history:
            self._say("plan.decision", line)
        keep = plan.activation_policy.count("keep")
        self._say("plan.applied",
                  f"{len(plan.paged_blocks)} of {len(self.blocks)} blocks stream their weights; "
                  f"activations: {keep} kept, {len(offload)} paged, {len(again)} recomputed; "
                  f"estimated peak {size(plan.vram_bytes)} of {size(self.budget)}, "
                  f"{size(plan.pcie_bytes_per_step)} over PCIe a step for paging",
                  vram_bytes=plan.vram_bytes, budget_bytes=self.budget,
                  pcie_bytes=plan.pcie_bytes_per_step, paged_blocks=len(plan.paged_blocks),
                  offloaded_blocks=len(offload), recomputed_blocks=len(again))
        self.steps_since_plan = 0
        self.adapting = True
        self._plans_applied += 1
        self._held = []  # growth is read under one plan
        if self.cuda:
            # What the old plan's steps left cached (another layout of activations, weights and
            # state) goes back, so that it cannot fragment the new plan's steps.
            torch.cuda.empty_cache()

    def state_left_vram(self) -> None:
        """The optimizer moved whole to the GPU (offload='auto'): no state moves any more, and
        none is held here to take off the peaks."""
        self._gpu_state_option = self._staged_option = 0
        self.gpu_state_blocks = self.gpu_state_elements = 0
        self.staged_blocks = self.staged_elements = 0

    def _apply_gpu_state(self, plan: MemoryPlan) -> None:
        before, staged_before = self.gpu_state_blocks, self.staged_blocks
        self.gpu_state_elements, self.staged_elements = self._set_gpu_state(
            plan.gpu_state_blocks, plan.staged_blocks)
        self.gpu_state_blocks, self.staged_blocks = plan.gpu_state_blocks, plan.staged_blocks
        held = 12 * self.gpu_state_elements  # fp32 moments, and the gradient until step()
        if plan.gpu_state_blocks:
            message = (f"the AdamW state of blocks 0-{plan.gpu_state_blocks - 1} and of the "
                       f"parameters outside the stack ({self.gpu_state_elements:,} elements) "
                       f"lives in VRAM ({size(held)} with their gradients): updated there by "
                       "torch's fused AdamW at step(); the daemon keeps the rest, and a copy of "
                       "this part as of each checkpoint")
        elif before:
            message = (f"the AdamW state of the {before} leading blocks and the parameters "
                       "outside the stack is back in trainstreamd")
        else:
            message = "no optimizer state is held in VRAM"
        if plan.staged_blocks:
            first = plan.gpu_state_blocks
            message += (f"; {plan.staged_blocks} of blocks {first}-{len(self.blocks) - 1} "
                        f"({self.staged_elements:,} elements) are updated on the GPU with "
                        "their moments staged from trainstreamd's memory as backward finishes "
                        "them")
        elif staged_before:
            message += "; no block's moments are staged through the GPU any more"
        estimate = {f"estimated_{k}_ms": 1e3 * v for k, v in plan.step_s.items()}
        self._say("plan.gpu_state", message, gpu_state_blocks=plan.gpu_state_blocks,
                  gpu_state_elements=self.gpu_state_elements, vram_bytes=held,
                  staged_blocks=plan.staged_blocks, staged_elements=self.staged_elements,
                  **estimate)

    def _say(self, kind: str, message: str, **numbers: float) -> None:
        self.history.append(message)
        self._note(kind, message, **numbers)

    def report(self) -> dict:
        plan = self.plan
        return {"adapting": self.adapting, "budget_bytes": self.budget,
                "measured": dict(self.measured),
                "estimated_vram_bytes": plan.vram_bytes if plan else None,
                "pcie_bytes_per_step": plan.pcie_bytes_per_step if plan else None,
                "host_activation_bytes": self.host_activation_bytes,
                "gpu_state_blocks": self.gpu_state_blocks,
                "gpu_state_elements": self.gpu_state_elements,
                "staged_blocks": self.staged_blocks,
                "staged_elements": self.staged_elements,
                "estimated_step_s": dict(plan.step_s) if plan else None,
                # Settling's corrections, the extra working memory they added, the steps whose
                # reserved memory crowded the process's limit, VRAM held after the last step.
                "corrections": self.corrections, "extra_working_bytes": self.extra_working,
                "fragmented_steps": self._fragmented_steps,
                "held_bytes": self._held[-1] if self._held else None,
                "history": list(self.history)}
