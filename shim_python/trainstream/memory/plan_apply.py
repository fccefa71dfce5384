# SPDX-License-Identifier: Apache-2.0
"""The plan that runs, and applying a new one to the job (memory/adaptive.py decides when):
streamed weights, the job's host plan, the activation policy and the optimizer state's place,
in that order, each said in an event."""

from __future__ import annotations

from typing import Any, Callable

from .plan_setup import PlanActions
from .planner import BlockFacts, MemoryPlan, size
from .state_share import OptimizerStateShare


class AppliedPlan:
    """Owns the plan that runs (``plan``, None before the probe's), the activation bytes it
    pages to the daemon (``host_activation_bytes``) and how many plans were applied
    (``count``: a plan applied mid-window restarts a trial's timing).

    ``pager`` streams the blocks' weights and pages their activations, ``recompute`` recomputes
    theirs; ``actions`` are the plan's actions on the job (memory/plan_setup.py); ``state`` is
    the plan's share of the optimizer state on the GPU; ``budget`` is for what is said;
    ``say(kind, message, **numbers)`` reports each decision."""

    def __init__(self, pager: Any, recompute: Any, actions: PlanActions,
                 state: OptimizerStateShare, budget: int, say: Callable[..., None]) -> None:
        self._pager = pager
        self._recompute = recompute
        self._actions = actions
        self._state = state
        self._budget = budget
        self._say = say
        self.plan: MemoryPlan | None = None
        self.host_activation_bytes = 0
        self.count = 0

    def decides_the_same(self, plan: MemoryPlan) -> bool:
        """Whether ``plan`` makes every decision of the plan that runs."""
        running = self.plan
        return (running is not None and plan.paged_blocks == running.paged_blocks
                and plan.activation_policy == running.activation_policy
                and plan.moment_dtype == running.moment_dtype and self._state.matches(plan))

    def keep(self, plan: MemoryPlan, facts: list[BlockFacts]) -> None:
        """``plan`` runs in place of one with the same decisions: its estimates are the new
        measurements'. The paged activations may have grown (a longer sequence): the daemon is
        told what the job holds now."""
        host_bytes = sum(facts[b].activation_bytes
                         for b, p in enumerate(plan.activation_policy) if p == "offload")
        if host_bytes != self.host_activation_bytes:
            self._actions.plan_host(host_bytes)
            self.host_activation_bytes = host_bytes
        self.plan = plan
        self._say("plan.kept", f"the plan stands: the measurements move none of its decisions "
                  f"(estimated peak {size(plan.vram_bytes)} of {size(self._budget)})",
                  vram_bytes=plan.vram_bytes, budget_bytes=self._budget)

    def apply(self, plan: MemoryPlan, facts: list[BlockFacts]) -> None:
        """Applies ``plan`` (``facts``: the measured blocks it was made from)."""
        offload = [b for b, p in enumerate(plan.activation_policy) if p == "offload"]
        again = [b for b, p in enumerate(plan.activation_policy) if p == "recompute"]
        added = [b for b in plan.paged_blocks if b not in self._pager.weights.position]
        removed = [b for b in self._pager.paged if b not in plan.paged_blocks]
        host_bytes = sum(facts[b].activation_bytes for b in offload)
        # Weights first (streaming frozen ones adds host copies), then the job's host plan with
        # the activations' bytes, then the activation policy, whose arena is taken at the next
        # forward.
        if removed:
            self._actions.unstream_weights(removed)
        if added:
            self._actions.stream_weights(added)
        self._actions.plan_host(host_bytes)
        self.host_activation_bytes = host_bytes
        self._recompute.set(again)
        self._pager.set_activation_blocks(offload)
        self.plan = plan
        if not self._state.matches(plan):
            # Last: a move that fails leaves the rest of the plan applied (after_step says why).
            self._state.apply(plan)
        for line in plan.history:
            self._say("plan.decision", line)
        keep = plan.activation_policy.count("keep")
        self._say("plan.applied",
                  f"{len(plan.paged_blocks)} of {len(plan.activation_policy)} blocks stream "
                  f"their weights; activations: {keep} kept, {len(offload)} paged, "
                  f"{len(again)} recomputed; estimated peak {size(plan.vram_bytes)} of "
                  f"{size(self._budget)}, {size(plan.pcie_bytes_per_step)} over PCIe a step "
                  "for paging", vram_bytes=plan.vram_bytes, budget_bytes=self._budget,
                  pcie_bytes=plan.pcie_bytes_per_step, paged_blocks=len(plan.paged_blocks),
                  offloaded_blocks=len(offload), recomputed_blocks=len(again))
        self.count += 1
