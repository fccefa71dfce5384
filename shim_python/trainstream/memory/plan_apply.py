# SPDX-License-Identifier: Apache-2.0
"""Planning again from the measurements and applying a plan (a part of AdaptivePlan,
memory/adaptive.py): streamed weights, the job's host plan, the activation policy and the
optimizer state's place, in that order, each said in an event."""

from __future__ import annotations

import torch

from .planner import BlockFacts, MemoryPlan, PlanInputs, plan_memory, size
from .step_measures import streamed_weight_bytes


class PlanApplication:
    """AdaptivePlan's planning and applying (a part of the class: it reads the plan's state)."""

    def _plan_inputs(self, fresh: bool = False) -> PlanInputs:
        """The planner's inputs from the measurements (see replan for ``fresh``)."""
        facts = [BlockFacts(weight_bytes=streamed_weight_bytes(self.pager, self.blocks, b),
                            activation_bytes=f.activation_bytes, input_bytes=f.input_bytes,
                            trained_share=f.trained_share, trainable=f.trainable)
                 for b, f in enumerate(self._facts_cache)]
        own = self.host_activation_bytes
        host = max(0, self.readings.host_free()) + own
        if self.settings.host_cap:
            host = min(host, self.settings.host_cap)
        trainable = self.settings.other_trainable + sum(f.trainable for f in facts)
        inputs = PlanInputs(
            blocks=tuple(facts), other_weight_bytes=self.settings.other_weight_bytes,
            other_trainable=self.settings.other_trainable, host_state_planned=True,
            host_update_s=self.measured.get("host_s_per_element", 0.0) * trainable,
            host_after_backward=bool(self.readings.updates_after_backward()),
            gpu_state=self._gpu_state_option, update_transfer=self.settings.update_transfer,
            staged_state=self.staged_option,
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
            # staging trial's, ``fresh``) may also take back those streamed before.
            paged_already=(tuple(self.pager.paged) if self.steps_since_plan >= 0 and not fresh
                           else ()),
            activation_choice=self._activation_choice)
        return inputs

    def replan(self, fresh: bool = False) -> bool:
        """Plans from the measurements and applies the plan when it differs from the one that
        runs; returns whether it did. The same plan again leaves the settling count as it is:
        a measurement that moves no decision is no reason to watch more steps."""
        inputs = self._plan_inputs(fresh)
        facts = inputs.blocks
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
                self.actions.plan_host(host_bytes)
                self.host_activation_bytes = host_bytes
            self.plan = plan  # its estimates are the new measurements'
            self.say("plan.kept", f"the plan stands: the measurements move none of its "
                     f"decisions (estimated peak {size(plan.vram_bytes)} of "
                     f"{size(self.budget)})", vram_bytes=plan.vram_bytes,
                     budget_bytes=self.budget)
            return False
        self.apply_plan(plan)
        return True

    def apply_plan(self, plan: MemoryPlan) -> None:
        """Applies ``plan`` (streamed weights, the job's host plan, activations, the optimizer
        state's place) and starts settling it."""
        offload = [b for b, p in enumerate(plan.activation_policy) if p == "offload"]
        again = [b for b, p in enumerate(plan.activation_policy) if p == "recompute"]
        added = [b for b in plan.paged_blocks if b not in self.pager.weights.position]
        removed = [b for b in self.pager.paged if b not in plan.paged_blocks]
        host_bytes = sum(self._facts_cache[b].activation_bytes for b in offload)
        # Weights first (streaming frozen ones adds host copies), then the job's host plan with
        # the activations' bytes, then the activation policy, whose arena is taken at the next
        # forward.
        if removed:
            self.actions.unstream_weights(removed)
        if added:
            self.actions.stream_weights(added)
        self.actions.plan_host(host_bytes)
        self.host_activation_bytes = host_bytes
        self.recompute.set(again)
        self.pager.set_activation_blocks(offload)
        self.plan = plan
        if (plan.gpu_state_blocks, plan.staged_blocks) != (self.gpu_state_blocks,
                                                            self.staged_blocks):
            # Last: a move that fails leaves the rest of the plan applied (after_step says why).
            self._apply_gpu_state(plan)
        for line in plan.history:
            self.say("plan.decision", line)
        keep = plan.activation_policy.count("keep")
        self.say("plan.applied",
                 f"{len(plan.paged_blocks)} of {len(self.blocks)} blocks stream their weights; "
                 f"activations: {keep} kept, {len(offload)} paged, {len(again)} recomputed; "
                 f"estimated peak {size(plan.vram_bytes)} of {size(self.budget)}, "
                 f"{size(plan.pcie_bytes_per_step)} over PCIe a step for paging",
                 vram_bytes=plan.vram_bytes, budget_bytes=self.budget,
                 pcie_bytes=plan.pcie_bytes_per_step, paged_blocks=len(plan.paged_blocks),
                 offloaded_blocks=len(offload), recomputed_blocks=len(again))
        self.steps_since_plan = 0
        self.adapting = True
        self.plans_applied += 1
        self.meter.plan_changed()
        if self.cuda:
            # What the old plan's steps left cached (another layout of activations, weights and
            # state) goes back, so that it cannot fragment the new plan's steps.
            torch.cuda.empty_cache()

    def state_left_vram(self) -> None:
        """The optimizer moved whole to the GPU (offload='auto'): no state moves any more, and
        none is held here to take off the peaks."""
        self._gpu_state_option = self.staged_option = 0
        self.gpu_state_blocks = self.gpu_state_elements = 0
        self.staged_blocks = self.staged_elements = 0

    def _apply_gpu_state(self, plan: MemoryPlan) -> None:
        before, staged_before = self.gpu_state_blocks, self.staged_blocks
        self.gpu_state_elements, self.staged_elements = self.actions.set_gpu_state(
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
        self.say("plan.gpu_state", message, gpu_state_blocks=plan.gpu_state_blocks,
                 gpu_state_elements=self.gpu_state_elements, vram_bytes=held,
                 staged_blocks=plan.staged_blocks, staged_elements=self.staged_elements,
                 **estimate)
