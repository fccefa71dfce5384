# SPDX-License-Identifier: Apache-2.0
"""Which blocks stream their weights before anything was measured: at wrap(), for the probe
step, and for quantize="auto"'s candidates. A pure function of the blocks' sizes and the budget,
over the planner."""

from __future__ import annotations

import torch

from .blocks import stored_buffers, weight_bytes
from .planner import BlockFacts, MemoryPlanError, PlanInputs, plan_memory, size


def weight_plan(model: torch.nn.Module, blocks: list, budget: int, depth: int,
                 probe: bool) -> list:
    """param_offload="auto" at wrap(): the fewest blocks (spread over the stack, see
    planner.spread_order) whose weights must stream for the weights to fit, with room for one
    block's gradients in flight, and, when a probe step follows, a quarter of the budget for
    that step's activations and working memory (unknown until it runs: the logits of a large
    vocabulary alone can take gigabytes). The plan made from the probe's measurements streams
    more blocks, or fewer."""
    sizes = [weight_bytes(blk) for blk in blocks]  # quantized layers' stored bytes included
    trained = [weight_bytes(blk, trained=True) for blk in blocks]
    total = sum(t.numel() * t.element_size()
                for t in [*model.parameters(), *stored_buffers(model)])
    return weight_plan_for_sizes(sizes, total - sum(sizes), budget, depth, probe,
                                 probe_grad_bytes=2 * max(trained, default=0))


def weight_plan_for_sizes(sizes: list, other: int, budget: int, depth: int,
                          probe: bool, working: int = 0, probe_grad_bytes: int = 0) -> list:
    """weight_plan() from the blocks' weight bytes (``sizes``) and those outside them
    (``other``): the blocks that stream, with ``working`` bytes of working memory at least
    (two blocks' weights at least: gradients in flight, or as much of other working memory).
    With a probe step to come, its quarter of the budget, and ``probe_grad_bytes`` beside it.
    MemoryPlanError when the weights do not fit even with every block streaming."""
    working = max(working, 2 * max(sizes))
    if probe:
        # The quarter of the budget is the probe's guess at activations and working memory;
        # the gradients backward holds come on top of it (a 16-block TinyGPT full fine-tune
        # under a 231 MiB cap ran out of memory in the probe's backward while they were
        # counted inside it, H200, 2026-12-03).
        working = max(working, int(probe_grad_bytes) + budget // 4)
    inputs = PlanInputs(blocks=tuple(BlockFacts(weight_bytes=w, activation_bytes=0) for w in sizes),
                        other_weight_bytes=other, other_trainable=0, working_bytes=working,
                        vram_budget=budget, host_budget=1 << 62, grad_bytes=0,
                        activation_offload=False, prefetch_depth=depth)
    try:
        return plan_memory(inputs).paged_blocks
    except MemoryPlanError:
        need = other + (depth + 1) * max(sizes) + working
        room = ("room for the probe step and a block's gradients in flight" if probe else
                "a block's gradients in flight")
        raise MemoryPlanError(
            f"trainstream.wrap: the weights do not fit in the {size(budget)} VRAM budget even "
            f"with every block streaming: the weights outside the {len(sizes)} blocks "
            f"({size(other)}), {depth + 1} device slots of {size(max(sizes))} and {room} "
            f"({size(working)}) need {size(need)}. Use a GPU with more free memory or a larger "
            "vram_budget, lower vram_headroom" + (", or prefetch_depth=1" if depth > 1 else "")
        ) from None
