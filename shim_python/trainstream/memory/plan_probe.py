# SPDX-License-Identifier: Apache-2.0
"""The run-time plan's probe step (memory/adaptive.py): every block but the measured last one
recomputes or pages its activations, and a first step whose loss and activations would not fit
beside the weights wrap() left in VRAM streams more blocks first, or is refused with the
numbers."""

from __future__ import annotations

from typing import Any, Protocol

from .allocator_split import LargeBlocksWhole
from .planner import MemoryPlanError, size
from .step_measures import streamed_weight_bytes, trained_share
from .weight_plan import weight_plan_for_sizes

# Before the probe has measured anything: a transformer block's saved activations per
# position and hidden unit (bf16; its MLP's wider intermediate included).
_BLOCK_ACTIVATION_BYTES = 48


class ProbedPlan(Protocol):
    """What the probe step reads and does of the run-time plan it serves (AdaptivePlan)."""

    cuda: bool
    blocks: list
    pager: Any
    recompute: Any
    meter: Any               # step_measures.StepMeter
    settings: Any            # plan_setup.PlanSettings
    actions: Any             # plan_setup.PlanActions (stream_weights)
    budget: int
    weights_fixed: bool
    steps_since_plan: int    # -1 until the probe step has run

    def say(self, kind: str, message: str, **numbers: float) -> None: ...


class ProbeStep:
    """The plan's first step, which measures the last block while the others recompute or page.
    It owns what the probe decides: the measured block, the loss's working memory for the
    step's logits (``loss_floor``: no working memory read off a later peak is less) and the
    allocator's split limit it may set (``large_blocks``, taken back by unwrap())."""

    def __init__(self, plan: ProbedPlan) -> None:
        self._plan = plan
        self.block = len(plan.blocks) - 1
        # The loss's working memory for the step's logits (make_room): its logits and their
        # gradient live together with every kept activation as backward starts, so no working
        # memory read off a peak is less (a probe whose peak came elsewhere read less, and the
        # plan's first step ran out of memory: small Phi-3 LoRA, 2026-12-02).
        self.loss_floor = 0
        self.large_blocks = LargeBlocksWhole()

    def start(self) -> None:
        plan = self._plan
        offload, again = self.policy()
        if plan.cuda:
            plan.meter.reset_peak()
        plan.say("plan.probe", f"probe step: block {self.block} is measured, "
                 f"{len(again)} blocks recompute and {len(offload)} page their activations "
                 "meanwhile")

    def policy(self) -> tuple[list, list]:
        """The probe step's activations: streamed blocks page theirs, the others recompute."""
        plan = self._plan
        last = self.block
        streamed = set(plan.pager.paged)
        offload = [b for b in range(last) if b in streamed]
        again = [b for b in range(last) if b not in streamed]
        plan.recompute.set(again)
        plan.pager.set_activation_blocks(offload)
        plan.pager.measure = {last}
        return offload, again

    def make_room(self, tokens: int, vocab: int, hidden: int, loss_bytes: int) -> None:
        """Called as the probe step's forward starts, when its size is first known: the loss's
        working memory (``loss_bytes``, for the logits of ``tokens`` positions over ``vocab``:
        chunked_loss.working_bytes) and a block's activations may not fit
        beside the weights wrap() left in VRAM, which reserved only a quarter of the budget
        for them. More blocks then stream their weights before any block runs; a step that
        cannot fit even with every block streaming is refused here, with the numbers, rather
        than ending in an out-of-memory error. With the streamed blocks chosen by the user
        (param_offload), an estimate is not a reason to refuse: an event says it looks tight."""
        plan = self._plan
        if plan.steps_since_plan >= 0 or tokens <= 0:
            return
        loss = int(loss_bytes)
        self.loss_floor = loss
        if plan.cuda:
            # The logits and their gradient, half the loss's working memory each.
            limit = self.large_blocks.apply(loss // 2)
            wanted = self.large_blocks.wanted_mib
            raised = (f" (not {wanted} MiB: a {limit - 1} MiB segment was already cut up, and "
                      "torch's allocator would hand a piece of it to cudaFree under a lower "
                      "limit)") if wanted else ""
            if limit:
                plan.say("plan.allocator",
                         f"the caching allocator no longer splits blocks of {limit} MiB or more"
                         f"{raised} (max_split_size_mb, process-wide until unwrap()): the "
                         f"step's logits ({size(loss // 2)}, and as much for their gradient) "
                         "come back to blocks of their own each step, rather than to reserved "
                         "memory cut up by smaller tensors; set PYTORCH_CUDA_ALLOC_CONF to "
                         "choose otherwise", max_split_mib=limit, wanted_mib=wanted or limit)
        # The measured block's activations, and the inputs the recomputed ones keep.
        activations = tokens * hidden * (_BLOCK_ACTIVATION_BYTES + 2 * len(plan.blocks))
        sizes = [streamed_weight_bytes(plan.pager, plan.blocks, b) for b in range(len(plan.blocks))]
        # Streamed blocks page their activations in the probe: copies still crossing to host
        # memory hold device memory up to the pager's cap.
        in_flight = plan.pager.activations.max_inflight_bytes if plan.cuda else 0
        # Backward holds a block's gradients while the one before it computes its own (the
        # first are still crossing to the optimizer): beside the loss and the activations, as
        # in wrap()'s plan for the probe (weight_plan.weight_plan).
        grads = 2 * max(int(trained_share(plan.blocks[b]) * w) for b, w in enumerate(sizes))
        working = loss + activations + grads
        streamed = set(plan.pager.paged)
        depth, other = plan.settings.prefetch_depth, plan.settings.other_weight_bytes
        resident = other + sum(w for b, w in enumerate(sizes) if b not in streamed)
        paging = (depth + 1) * max(sizes) + in_flight if streamed else 0
        if resident + paging + working <= plan.budget:
            return

        working += in_flight
        need = other + (depth + 1) * max(sizes) + working
        if plan.weights_fixed:
            plan.say("plan.probe_tight",
                     f"the first step trains on {tokens} positions: its loss ({size(loss)}) and "
                     f"a block's activations ({size(activations)}) beside the weights kept in "
                     f"VRAM ({size(resident)}) may not fit in the {size(plan.budget)} budget; "
                     "param_offload chose the streamed blocks, so none more stream",
                     loss_bytes=loss, activation_bytes=activations)
            return
        if need > plan.budget:
            raise MemoryPlanError(
                f"trainstream: the first step does not fit in the {size(plan.budget)} VRAM "
                f"budget: its loss works on {tokens} positions x {vocab} logits ({size(loss)} "
                f"with their gradients), a block's activations take about "
                f"{size(activations)}" + (f", two blocks' gradients {size(grads)}"
                                          if grads else "")
                + (f", those crossing to host memory up to {size(in_flight)}"
                   if in_flight else "")
                + f", and the weights outside the blocks with {depth + 1} device slots "
                f"take {size(need - working)}. Train on fewer positions a step (a smaller "
                "batch with accumulation_steps, shorter sequences) or give the process more "
                "VRAM (vram_budget, vram_headroom)")
        paged = weight_plan_for_sizes(sizes, other, plan.budget, depth, probe=False,
                                      working=working)
        added = [b for b in paged if b not in streamed]
        if not added:
            return
        plan.actions.stream_weights(added)
        offload, again = self.policy()
        plan.say("plan.probe_room",
                 f"the first step trains on {tokens} positions: its loss works on "
                 f"{tokens} x {vocab} logits (about {size(loss)} with their gradients) and "
                 f"a block's activations on about {size(activations)}, more than wrap() left "
                 f"beside the weights; {len(added)} more blocks stream their weights for the "
                 f"probe ({len(plan.pager.paged)} of {len(plan.blocks)}), and the plan made "
                 "from its measurements keeps what fits",
                 loss_bytes=loss, activation_bytes=activations, added_blocks=len(added))
