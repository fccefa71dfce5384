# SPDX-License-Identifier: Apache-2.0
"""offload="auto": after the first offloaded steps, OffloadAdamW decides whether torch's fused
GPU AdamW fits beside the model's peak, and if so moves its state there and steps on the GPU
from then on; an event says which way it went and why."""

from __future__ import annotations

import torch


AUTO_STEPS = 2  # offload="auto" decides after this many offloaded steps

class GpuSwitch:
    """OffloadAdamW's offload="auto" decision and the move to the GPU (a part of the class)."""

    def _decide_offload(self) -> None:
        """Moves the optimizer to torch's fused GPU AdamW when the model, its gradients and both
        moments fit in VRAM under the cap with the headroom left, as measured over the first
        steps; otherwise keeps it in the daemon. Either way, says so in an event."""
        numel = sum(p.numel() for p in self.table.params)
        step_ms = 1000 * min(self._step_times) if self._step_times else 0.0
        if not self._cuda:
            self._on_decision("wrap.offload", "CPU model: the optimizer stays in trainstreamd",
                              parameters=numel)
            return
        if self._world_size > 1 or self._machines > 1:
            self._on_decision("wrap.offload", "data parallel job: the optimizer stays in "
                              "trainstreamd (one state for every rank)", parameters=numel)
            return
        if self._pager is not None and self._pager.paged:
            self._on_decision("wrap.offload", "weights are paged from host memory: the "
                              "optimizer stays in trainstreamd, where they are updated",
                              parameters=numel)
            return
        if self.rules.nonfinite in ("skip", "error"):
            self._on_decision("wrap.offload", f"nonfinite={self.rules.nonfinite!r}: the optimizer "
                              "stays in trainstreamd, which checks every gradient before a step",
                              parameters=numel)
            return
        odd = sorted({str(p.dtype) for p in self.table.params if p.dtype != torch.float32})
        if odd:
            self._on_decision("wrap.offload", f"parameters in {', '.join(odd)}: the optimizer "
                              "stays in trainstreamd, which keeps their fp32 master weights",
                              parameters=numel)
            return
        device = self.table.params[0].device
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = 1.0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            fraction = float(getter(device))
        limit = total * fraction
        peak = torch.cuda.max_memory_allocated(device)
        allowed = (1.0 - self._vram_headroom) * limit
        if self._adaptive is not None:
            # The memory plan's budget (vram_budget=, what else the process holds) binds too.
            peak -= self._adaptive.others
            allowed = min(allowed, self._adaptive.budget)
        # Stock AdamW keeps every gradient and both fp32 moments in VRAM: 12 bytes a parameter
        # more than the offloaded steps measured (those updated in VRAM already counted).
        need = peak + 12 * (numel - self.placement.device_state_elements)
        numbers = dict(parameters=numel, peak_bytes=peak, need_bytes=need,
                       allowed_bytes=allowed, offloaded_step_ms=step_ms)
        if need > allowed:
            self._on_decision(
                "wrap.offload", f"kept offloaded: torch AdamW on {device} would need "
                f"{need / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB + 12 B x {numel:,} "
                f"parameters), more than {allowed / 2**30:.2f} GiB ({1 - self._vram_headroom:.0%} "
                f"of the {limit / 2**30:.2f} GiB this process may use)", **numbers)
            return
        self._switch_to_gpu()
        self._on_decision(
            "wrap.offload", f"switched to torch fused AdamW on {device}: the model fits "
            f"({need / 2**30:.2f} GiB of the {allowed / 2**30:.2f} GiB allowed); offloaded steps "
            f"took {step_ms:.1f} ms", **numbers)

    def _switch_to_gpu(self) -> None:
        self.synchronize()
        self.placement.all_state_to_daemon()  # the daemon's state is whole, then all moves
        if self._adaptive is not None:
            self._adaptive.state_left_vram()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        cls = torch.optim.AdamW if self.rules.kind == "adamw" else torch.optim.Adam
        # The same group dicts: a scheduler that holds this optimizer keeps working.
        gpu = cls(self.param_groups, fused=True)
        self._gpu_optimizer = gpu
        self.placement.switched_to_gpu = True
        self._steps_at_switch = self._host.iteration
        if self._adaptive is not None:
            self._adaptive.weights_fixed = True  # nothing left in the daemon to stream from
        self._load_gpu_state_from_daemon()
        for p in self.table.params:
            p.grad = None
        self.state = gpu.state
        self.param_groups = gpu.param_groups  # one list: groups added later reach both

    def _load_gpu_state_from_daemon(self) -> None:
        self._gpu_optimizer.state.clear()
        self.placement.moments_from_daemon(self._gpu_optimizer, range(len(self.table.params)))

    @property
    def on_gpu(self) -> bool:
        """True once offload='auto' moved the optimizer to torch's fused GPU AdamW."""
        return self._gpu_optimizer is not None
