# SPDX-License-Identifier: Apache-2.0
"""nonfinite="guard" on the GPU: the parameters updated there (their AdamW state in VRAM, staged
through it, or the whole optimizer after offload="auto" moved it) skip their update once a
gradient of the step holds a NaN or an infinity, as the daemon's pass does for the rest.

One flag on the device per step, set by torch's own check (the one torch.amp.GradScaler uses)
and read by torch's fused AdamW (``found_inf``), so no step waits on the CPU for it; the CPU
reads the flag a step late, from a pinned copy, to say what was skipped."""

from __future__ import annotations

import torch


# Gradient dtypes torch's own non-finite check (GradScaler's) takes.
_AMP_CHECKED = (torch.float32, torch.float16)


class DeviceGuard:
    """The step's flag on ``device``: :meth:`check` folds gradients into it, :attr:`found` is
    what the fused updates read, :meth:`end_step` queues its copy to the host and clears it for
    the next step, :meth:`last_step_found` reads what the previous step's copy said."""

    def __init__(self, device: torch.device):
        # 0-dim, as torch.amp.GradScaler's: the fused update subtracts it from its step counts.
        self.found = torch.zeros((), dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._copy = torch.zeros((), dtype=torch.float32, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self.skipped_steps = 0

    def check(self, grads: list) -> None:
        """Sets the flag, on the current stream, if any of ``grads`` holds a non-finite value
        (fp32 and fp16 ones by torch's check, each multiplied by one: unchanged; others, such
        as bf16, which that check does not take, by their largest and smallest value, which a
        NaN or an infinity becomes)."""
        grads = [g for g in grads if g is not None]
        amp = [g for g in grads if g.dtype in _AMP_CHECKED]
        if amp:
            torch._amp_foreach_non_finite_check_and_unscale_(amp, self.found, self._one)
        for g in grads:
            if g.dtype not in _AMP_CHECKED:
                ends = torch.stack([g.amax(), g.amin()]).float()
                bad = (~torch.isfinite(ends)).any().float()
                torch.maximum(self.found, bad, out=self.found)  # stays 0 or 1, as torch's

    def end_step(self) -> None:
        """After this step's updates were queued: the flag goes to the host and is cleared."""
        self._copy.copy_(self.found, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.found.zero_()

    def last_step_found(self) -> bool:
        """Whether the step before this one skipped its GPU updates (waits for that step's
        copy, long done by the next step())."""
        if self._copied is None:
            return False
        self._copied.synchronize()
        self._copied = None
        found = bool(self._copy.item() > 0)
        self.skipped_steps += found
        return found
