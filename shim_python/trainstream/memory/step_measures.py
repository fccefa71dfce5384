# SPDX-License-Identifier: Apache-2.0
"""What the run-time plan (memory/adaptive.py) reads off a step: the VRAM peak and what was
reserved past the process's limit, VRAM held between steps growing (``StepMeter``), each block's
facts for the planner, the step's working memory left once weights and saved activations
are taken off its peak, and what settling adds to it after a step over the budget."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from .blocks import weight_bytes
from .planner import BlockFacts, MemoryPlanError, size

# The caching allocator may reserve up to the process's limit; a step whose reserved peak comes
# this close to it is treated as over the budget by the difference (fragmentation is working
# memory too: the next large tensor may not find room in what is reserved but free).
RESERVED_MARGIN = 0.03

# VRAM held between steps growing this much a step, several steps running with one plan, is
# something keeping each step's tensors: said once, never planned for.
_GROWTH_BYTES, _GROWTH_STEPS = 32 << 20, 4


class StepMeter:
    """The VRAM of ``device``'s steps as the plan reads them: the peak (less a measured block's
    replay), what the allocator reserved past the process's limit, and the VRAM held between
    steps (less ``others``, what the process held besides the model at ``wrap()``) growing
    under one plan, said once through ``say(kind, message, **numbers)``."""

    def __init__(self, device: torch.device, timing: Any, others: int,
                 say: Callable[..., None]):
        self.device = device
        self._timing = timing  # the pager's BlockTiming: the peak a replay set aside
        self.others = others
        self._say = say
        self.held: list[int] = []  # VRAM held after each step since the last plan change
        self._growth_said = False

    def peak(self) -> int:
        """The VRAM peak since the last reset, a replay's own memory left out."""
        return max(torch.cuda.max_memory_allocated(self.device),
                   self._timing.peak_before_replay)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._timing.peak_before_replay = 0

    def process_limit(self) -> int:
        """What the caching allocator may reserve in this process (torch's per-process
        fraction of the device): a reservation past it is an out-of-memory error."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return int(total * (float(getter(self.device)) if getter is not None else 1.0))

    def reserved_over(self) -> int:
        """How far the step's reserved peak came past the process's limit less the margin
        (0: not): reserved memory this process held but could not have handed out again.
        Cached blocks are released when it did, so the next steps start from what they use."""
        reserved = torch.cuda.max_memory_reserved(self.device)
        over = int(reserved - (1 - RESERVED_MARGIN) * self.process_limit())
        if over <= 0:
            return 0
        torch.cuda.empty_cache()
        return over

    def plan_changed(self) -> None:
        """Growth is read under one plan: a new one starts the count over."""
        self.held = []

    def watch_growth(self) -> None:
        """Says once when the VRAM held between steps grows step after step under one plan:
        something keeps each step's tensors (a list of losses with their graphs, a cache), which
        no plan can make room for."""
        held = torch.cuda.memory_allocated(self.device) - self.others
        self.held.append(held)
        recent = self.held[-(_GROWTH_STEPS + 1):]
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


def streamed_weight_bytes(pager: Any, blocks: Sequence[torch.nn.Module], b: int) -> int:
    """Block ``b``'s weights as streaming moves them: parameters and quantized layers' stored
    bytes (what a resident block holds in VRAM, too)."""
    slots = pager.weights
    if b in slots.position:
        return sum(t.numel() * t.element_size() for t in slots.params.get(b, ()))
    return weight_bytes(blocks[b])


def trained_share(block: torch.nn.Module) -> float:
    """The share of ``block``'s weights (by bytes, a quantized base's buffers counted) that
    train: backward computes their gradients, which a frozen base's weights do not have."""
    trained = sum(p.numel() * p.element_size() for p in block.parameters() if p.requires_grad)
    total = trained + sum(t.numel() * t.element_size() for t in (
        *(p for p in block.parameters() if not p.requires_grad), *block.buffers()))
    return trained / total if total else 1.0


def measured_block_facts(pager: Any, blocks: Sequence[torch.nn.Module],
                         probe_block: int) -> tuple[list, int, float]:
    """Every block's facts for the planner from what the pager measured of ``probe_block``
    (they share its activations), with the bytes it saves for backward and its forward's
    seconds."""
    m = pager.timing.measured.get(probe_block)
    if m is None:
        raise MemoryPlanError("the probe step did not run the last block's forward with "
                              "gradients enabled; train with the model's forward")
    forward_s = pager.timing.forward_seconds(probe_block)
    facts = [BlockFacts(weight_bytes=streamed_weight_bytes(pager, blocks, b),
                        activation_bytes=m["saved_bytes"], input_bytes=m["input_bytes"],
                        trained_share=trained_share(blocks[b]),
                        # What may keep its state in VRAM: fp32 trained weights.
                        trainable=sum(p.numel() for p in blocks[b].parameters()
                                      if p.requires_grad and p.dtype == torch.float32))
             for b in range(len(blocks))]
    return facts, m["saved_bytes"], forward_s


def working_from_peak(peak: int, facts: list, pager: Any, recomputed: Sequence[int],
                      other_weights: int, state_bytes: int, floor: int) -> int:
    """The step's VRAM beyond weights and saved activations, from its ``peak`` (``others``
    taken off), under the activation policy the step ran with: ``pager``'s streamed and paged
    blocks, ``recomputed`` blocks, ``other_weights`` outside the stack, ``state_bytes`` of
    moments held in VRAM (their gradients, which appear only as backward ends, may or may not
    be in the peak, and stay in the working memory read here); never less than ``floor`` (the
    loss's)."""
    streamed = set(pager.paged)
    resident = other_weights + sum(f.weight_bytes for b, f in enumerate(facts)
                                   if b not in streamed)
    slots = pager.resident_bytes()
    offloaded, recomputed = set(pager.offloading), set(recomputed)
    saved = (sum(f.activation_bytes for b, f in enumerate(facts)
                 if b not in offloaded and b not in recomputed)
             + sum(facts[b].input_bytes for b in recomputed))
    in_flight = facts[0].activation_bytes if offloaded else 0
    return max(floor, peak - resident - slots - saved - in_flight - state_bytes)


def host_pass_rate(host_pass: Callable[[], tuple], measured: dict) -> float:
    """The last step's host optimizer pass per element it updated (``host_pass()`` gives the
    seconds and the elements), recorded in ``measured``; 0 where it did not run."""
    seconds, elements = host_pass()
    if seconds <= 0 or elements <= 0:
        return 0.0
    rate = seconds / elements
    measured["host_s_per_element"] = rate
    measured["host_pass_s"] = seconds
    return rate


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
