# SPDX-License-Identifier: Apache-2.0
"""What the run-time plan reads off a step (a part of AdaptivePlan, memory/adaptive.py): the VRAM
peak and what was reserved past the process's limit, VRAM held between steps growing, each
block's facts for the planner, the step's working memory, the host optimizer's pass."""

from __future__ import annotations

import warnings

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


class StepMeasures:
    """AdaptivePlan's measurements (a part of the class: it reads the plan's state)."""

    def _peak(self) -> int:
        """The VRAM peak since the last reset, a replay's own memory left out."""
        return max(torch.cuda.max_memory_allocated(self.device),
                   self.pager.timing.peak_before_replay)

    def _reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self.pager.timing.peak_before_replay = 0

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
        over = int(reserved - (1 - RESERVED_MARGIN) * self._process_limit())
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
        """Block ``b``'s weights as streaming moves them: parameters and quantized layers'
        stored bytes (what a resident block holds in VRAM, too)."""
        return sum(t.numel() * t.element_size() for t in self.pager.weights.params.get(b, ())) if (
            b in self.pager.weights.position) else weight_bytes(self.blocks[b])

    def _facts(self) -> tuple[list, int, float]:
        m = self.pager.timing.measured.get(self.probe_block)
        if m is None:
            raise MemoryPlanError("the probe step did not run the last block's forward with "
                                  "gradients enabled; train with the model's forward")
        forward_s = self.pager.timing.forward_seconds(self.probe_block)
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
