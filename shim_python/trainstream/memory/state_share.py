# SPDX-License-Identifier: Apache-2.0
"""The run-time plan's share of the optimizer state on the GPU (memory/adaptive.py): the
leading blocks whose AdamW state lives in VRAM, the blocks after them whose moments are staged
through the GPU for each update, and the move when a plan changes either."""

from __future__ import annotations

from typing import Any, Callable

from .planner import MemoryPlan, size


class OptimizerStateShare:
    """Owns where the plan may put optimizer state (``option``, ``staged_option``: "auto" or a
    number of blocks, as they stand now: the staging trial and a switch of the whole optimizer
    to the GPU change them) and what the running plan put there (``blocks``, ``elements``,
    ``staged_blocks``, ``staged_elements``).

    ``set_gpu_state(blocks, staged)`` moves the state and returns each part's elements (None:
    no state may move, and both options are 0); ``block_count`` is the stack's length, for
    what is said; ``say(kind, message, **numbers)`` reports the move."""

    def __init__(self, set_gpu_state: Callable[[int, int], tuple] | None, option: Any,
                 staged_option: Any, block_count: int, say: Callable[..., None]) -> None:
        self._set_gpu_state = set_gpu_state
        movable = set_gpu_state is not None
        self.option = option if movable else 0
        self.staged_option = staged_option if movable else 0
        self._block_count = block_count
        self._say = say
        self.blocks = 0
        self.elements = 0
        self.staged_blocks = 0
        self.staged_elements = 0

    def may_move(self) -> bool:
        """Whether any state may move between the daemon and the GPU as plans change."""
        return not self.option == self.staged_option == 0

    def matches(self, plan: MemoryPlan) -> bool:
        """Whether ``plan`` puts the state where the running plan put it."""
        return (plan.gpu_state_blocks, plan.staged_blocks) == (self.blocks, self.staged_blocks)

    def vram_bytes(self, staged_vram: int) -> int:
        """What the share holds on the GPU between steps: the fp32 moments of the state in VRAM,
        and the staging slots (``staged_vram``) while any block is staged."""
        return 8 * self.elements + (staged_vram if self.staged_elements else 0)

    def left_vram(self) -> None:
        """The optimizer moved whole to the GPU (offload='auto'): no state moves any more, and
        none is held here to take off the peaks."""
        self.option = self.staged_option = 0
        self.blocks = self.elements = 0
        self.staged_blocks = self.staged_elements = 0

    def apply(self, plan: MemoryPlan) -> None:
        """Moves the state where ``plan`` puts it and says where it lives now."""
        before, staged_before = self.blocks, self.staged_blocks
        self.elements, self.staged_elements = self._set_gpu_state(plan.gpu_state_blocks,
                                                                  plan.staged_blocks)
        self.blocks, self.staged_blocks = plan.gpu_state_blocks, plan.staged_blocks
        held = 12 * self.elements  # fp32 moments, and the gradient until step()
        if plan.gpu_state_blocks:
            message = (f"the AdamW state of blocks 0-{plan.gpu_state_blocks - 1} and of the "
                       f"parameters outside the stack ({self.elements:,} elements) lives in "
                       f"VRAM ({size(held)} with their gradients): updated there by torch's "
                       "fused AdamW at step(); the daemon keeps the rest, and a copy of this "
                       "part as of each checkpoint")
        elif before:
            message = (f"the AdamW state of the {before} leading blocks and the parameters "
                       "outside the stack is back in trainstreamd")
        else:
            message = "no optimizer state is held in VRAM"
        if plan.staged_blocks:
            first = plan.gpu_state_blocks
            message += (f"; {plan.staged_blocks} of blocks {first}-{self._block_count - 1} "
                        f"({self.staged_elements:,} elements) are updated on the GPU with "
                        "their moments staged from trainstreamd's memory as backward finishes "
                        "them")
        elif staged_before:
            message += "; no block's moments are staged through the GPU any more"
        estimate = {f"estimated_{k}_ms": 1e3 * v for k, v in plan.step_s.items()}
        self._say("plan.gpu_state", message, gpu_state_blocks=plan.gpu_state_blocks,
                  gpu_state_elements=self.elements, vram_bytes=held,
                  staged_blocks=plan.staged_blocks, staged_elements=self.staged_elements,
                  **estimate)
