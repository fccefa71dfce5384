# SPDX-License-Identifier: Apache-2.0
"""The run-time plan's probe step (a part of AdaptivePlan, memory/adaptive.py): every block but the
measured last one recomputes or pages its activations, and a first step whose loss and
activations would not fit beside the weights wrap() left in VRAM streams more blocks first, or
is refused with the numbers."""

from __future__ import annotations

from .planner import MemoryPlanError, size
from .step_measures import streamed_weight_bytes, trained_share
from .weight_plan import weight_plan_for_sizes

# Before the probe has measured anything: a transformer block's saved activations per
# position and hidden unit (bf16; its MLP's wider intermediate included).
_BLOCK_ACTIVATION_BYTES = 48


class ProbeStep:
    """AdaptivePlan's probe step (a part of the class: it reads the plan's state)."""

    def _start_probe(self) -> None:
        offload, again = self._probe_policy()
        if self.cuda:
            self.meter.reset_peak()
        self.say("plan.probe", f"probe step: block {self.probe_block} is measured, "
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
            wanted = self.large_blocks.wanted_mib
            raised = (f" (not {wanted} MiB: a {limit - 1} MiB segment was already cut up, and "
                      "torch's allocator would hand a piece of it to cudaFree under a lower "
                      "limit)") if wanted else ""
            if limit:
                self.say("plan.allocator",
                          f"the caching allocator no longer splits blocks of {limit} MiB or more"
                          f"{raised} (max_split_size_mb, process-wide until unwrap()): the "
                          f"step's logits ({size(loss // 2)}, and as much for their gradient) "
                          "come back to blocks of their own each step, rather than to reserved "
                          "memory cut up by smaller tensors; set PYTORCH_CUDA_ALLOC_CONF to "
                          "choose otherwise", max_split_mib=limit, wanted_mib=wanted or limit)
        # The measured block's activations, and the inputs the recomputed ones keep.
        activations = tokens * hidden * (_BLOCK_ACTIVATION_BYTES + 2 * len(self.blocks))
        sizes = [streamed_weight_bytes(self.pager, self.blocks, b) for b in range(len(self.blocks))]
        # Streamed blocks page their activations in the probe: copies still crossing to host
        # memory hold device memory up to the pager's cap.
        in_flight = self.pager.activations.max_inflight_bytes if self.cuda else 0
        # Backward holds a block's gradients while the one before it computes its own (the
        # first are still crossing to the optimizer): beside the loss and the activations, as
        # in wrap()'s plan for the probe (weight_plan.weight_plan).
        grads = 2 * max(int(trained_share(self.blocks[b]) * w) for b, w in enumerate(sizes))
        working = loss + activations + grads
        streamed = set(self.pager.paged)
        depth, other = self.settings.prefetch_depth, self.settings.other_weight_bytes
        resident = other + sum(w for b, w in enumerate(sizes) if b not in streamed)
        paging = (depth + 1) * max(sizes) + in_flight if streamed else 0
        if resident + paging + working <= self.budget:
            return

        working += in_flight
        need = other + (depth + 1) * max(sizes) + working
        if self.weights_fixed:
            self.say("plan.probe_tight",
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
                + f", and the weights outside the blocks with {depth + 1} device slots "
                f"take {size(need - working)}. Train on fewer positions a step (a smaller "
                "batch with accumulation_steps, shorter sequences) or give the process more "
                "VRAM (vram_budget, vram_headroom)")
        paged = weight_plan_for_sizes(sizes, other, self.budget, depth, probe=False,
                                      working=working)
        added = [b for b in paged if b not in streamed]
        if not added:
            return
        self.actions.stream_weights(added)
        offload, again = self._probe_policy()
        self.say("plan.probe_room",
                  f"the first step trains on {tokens} positions: its loss works on "
                  f"{tokens} x {vocab} logits (about {size(loss)} with their gradients) and "
                  f"a block's activations on about {size(activations)}, more than wrap() left "
                  f"beside the weights; {len(added)} more blocks stream their weights for the "
                  f"probe ({len(self.pager.paged)} of {len(self.blocks)}), and the plan made "
                  "from its measurements keeps what fits",
                  loss_bytes=loss, activation_bytes=activations, added_blocks=len(added))
