# SPDX-License-Identifier: Apache-2.0
"""offload="auto": after the first offloaded steps, OffloadAdamW decides whether torch's fused
GPU AdamW fits beside the model's peak, and if so moves its state there and steps on the GPU
from then on; an event says which way it went and why."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

import torch

from .parameters import ParameterTable
from .placement import StatePlacement, UpdateRules

AUTO_STEPS = 2  # offload="auto" decides after this many offloaded steps


@dataclasses.dataclass(frozen=True)
class Switch:
    """offload="auto" decided for the GPU: what to say once the optimizer is there."""

    message: str
    numbers: dict


class AutoOffload:
    """OffloadAdamW's offload="auto": whether it still decides (``enabled``), the VRAM share
    it leaves free (``vram_headroom``), the offloaded steps' times it measures, and once it has
    switched, torch's fused AdamW that runs every step (``optimizer``) and the step count at
    the switch.

    ``host`` is the daemon's optimizer of the job; ``say(kind, message, **numbers)`` reports
    the decision."""

    def __init__(self, *, rules: UpdateRules, table: ParameterTable, placement: StatePlacement,
                 host: Any, enabled: bool, vram_headroom: float,
                 say: Callable[..., None]) -> None:
        self._rules = rules
        self._table = table
        self._placement = placement
        self._host = host
        self._say = say
        self.enabled = enabled
        self.vram_headroom = vram_headroom
        self.optimizer: torch.optim.Optimizer | None = None
        self._steps_at_switch = 0
        self._steps_on_gpu = 0
        self._step_times: list[float] = []
        self._last_step_end: float | None = None

    @property
    def steps(self) -> int:
        """The job's steps since it switched: those in the daemon before, those here after."""
        return self._steps_at_switch + self._steps_on_gpu

    def stepped_on_gpu(self) -> None:
        self._steps_on_gpu += 1

    def count_from(self, steps: int) -> None:
        """The daemon holds the state as of ``steps`` (a checkpoint saved or loaded)."""
        self._steps_at_switch, self._steps_on_gpu = steps, 0

    def offloaded_step_ended(self) -> None:
        now = time.perf_counter()
        if self._last_step_end is not None:
            self._step_times.append(now - self._last_step_end)
        self._last_step_end = now

    def due(self, plan: Any) -> bool:
        """Whether it decides now: once, after AUTO_STEPS offloaded steps, and once the memory
        plan (``plan``, or None) has settled: its peaks are what the choice compares."""
        if (self.enabled and self._host.iteration >= AUTO_STEPS
                and (plan is None or not plan.adapting)):
            self.enabled = False
            return True
        return False

    def decide(self, weights_paged: bool, plan: Any) -> Switch | None:
        """Whether torch's fused AdamW fits in VRAM under the cap with the headroom left, as
        the offloaded steps measured (``plan``: the memory plan, whose budget binds too). Says
        why not and returns None, or returns what to say once the switch is made."""
        params = self._table.params
        numel = sum(p.numel() for p in params)
        step_ms = 1000 * min(self._step_times) if self._step_times else 0.0
        rules = self._rules
        kept = None
        if not rules.cuda:
            kept = "CPU model: the optimizer stays in trainstreamd"
        elif rules.world_size > 1 or rules.machines > 1:
            kept = ("data parallel job: the optimizer stays in trainstreamd (one state for "
                    "every rank)")
        elif weights_paged:
            kept = ("weights are paged from host memory: the optimizer stays in trainstreamd, "
                    "where they are updated")
        elif rules.nonfinite in ("skip", "error"):
            kept = (f"nonfinite={rules.nonfinite!r}: the optimizer stays in trainstreamd, which "
                    "checks every gradient before a step")
        else:
            odd = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
            if odd:
                kept = (f"parameters in {', '.join(odd)}: the optimizer stays in trainstreamd, "
                        "which keeps their fp32 master weights")
        if kept is not None:
            self._say("wrap.offload", kept, parameters=numel)
            return None
        device = params[0].device
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = 1.0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            fraction = float(getter(device))
        limit = total * fraction
        peak = torch.cuda.max_memory_allocated(device)
        allowed = (1.0 - self.vram_headroom) * limit
        if plan is not None:
            # The memory plan's budget (vram_budget=, what else the process holds) binds too.
            peak -= plan.others
            allowed = min(allowed, plan.budget)
        # Stock AdamW keeps every gradient and both fp32 moments in VRAM: 12 bytes a parameter
        # more than the offloaded steps measured (those updated in VRAM already counted).
        need = peak + 12 * (numel - self._placement.device_state_elements)
        numbers = dict(parameters=numel, peak_bytes=peak, need_bytes=need,
                       allowed_bytes=allowed, offloaded_step_ms=step_ms)
        if need > allowed:
            self._say(
                "wrap.offload", f"kept offloaded: torch AdamW on {device} would need "
                f"{need / 2**30:.2f} GiB (peak {peak / 2**30:.2f} GiB + 12 B x {numel:,} "
                f"parameters), more than {allowed / 2**30:.2f} GiB ({1 - self.vram_headroom:.0%} "
                f"of the {limit / 2**30:.2f} GiB this process may use)", **numbers)
            return None
        return Switch(f"switched to torch fused AdamW on {device}: the model fits "
                      f"({need / 2**30:.2f} GiB of the {allowed / 2**30:.2f} GiB allowed); "
                      f"offloaded steps took {step_ms:.1f} ms", numbers)

    def switch(self, param_groups: list) -> torch.optim.Optimizer:
        """Builds torch's fused AdamW over ``param_groups`` (the same group dicts: a scheduler
        that holds the optimizer keeps working) with the daemon's state, which must be whole."""
        cls = torch.optim.AdamW if self._rules.kind == "adamw" else torch.optim.Adam
        self.optimizer = cls(param_groups, fused=True)
        self._placement.switched_to_gpu = True
        self.count_from(self._host.iteration)
        self.state_from_daemon()
        return self.optimizer

    def state_from_daemon(self) -> None:
        """The GPU optimizer's moments and steps from the daemon's (a switch, a load)."""
        self.optimizer.state.clear()
        self._placement.moments_from_daemon(self.optimizer, range(len(self._table.params)))

    def state_to_daemon(self, groups: Iterable[dict]) -> None:
        """Hands the daemon a copy of the GPU optimizer's state, groups and steps (a save)."""
        param_steps = self._placement.moments_to_daemon(self.optimizer,
                                                        range(len(self._table)))
        self._host.set_groups(list(groups))
        self._host.set_step(self.steps, param_steps)
        self.count_from(self.steps)
