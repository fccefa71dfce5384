# SPDX-License-Identifier: Apache-2.0
"""What the layers above OffloadAdamW (the memory plan, wrap()) read and set, instead of its
internals (a part of the class)."""

from __future__ import annotations

from typing import Any

import torch



class LayerSurface:
    """OffloadAdamW's surface for the layers above."""

    @property
    def trained_params(self) -> list:
        """The parameters it updates, in the daemon's order (index ``i`` is the daemon's)."""
        return self.table.params

    def index_of(self, p: torch.Tensor) -> int | None:
        """``p``'s index in the daemon, None for a parameter it does not update."""
        return self.table.index.get(id(p))

    @property
    def is_cuda(self) -> bool:
        """Whether the model's parameters are on a CUDA device."""
        return self.rules.cuda

    @property
    def resumed(self) -> bool:
        """Whether it re-attached to a job's state that a process before it made."""
        return getattr(self, "_resumed", False)

    @property
    def gradient_dtypes(self) -> list:
        """The dtype each parameter's gradient leaves in, by index."""
        return self.table.grad_dtypes

    @property
    def gradient_dtype(self) -> torch.dtype | None:
        """gradient_dtype= as given (None: each gradient leaves in its parameter's dtype)."""
        return self.table.grad_dtype

    @property
    def updates_on_gpu(self) -> bool:
        """optimizer_mode="gpu": the GPU updates the parameters it may (mapped_adamw.py)."""
        return self.placement.update_on_gpu

    # -- where the state lives (optim/placement.py) ----------------------------------------------

    def keep_state_on_device(self, param_ids: set, staged_ids: set = frozenset()) -> int:
        """Keeps the AdamW state of exactly these parameters in VRAM (``staged_ids``: updated
        on the GPU, their moments staged from the daemon); see
        StatePlacement.keep_state_on_device. Between steps only. Returns the elements whose
        state is in VRAM."""
        return self.placement.keep_state_on_device(param_ids, staged_ids)

    def gpu_state_refusal(self) -> str | None:
        """Why no parameter's AdamW state may move to VRAM in this job (None: it may)."""
        return self.placement.gpu_state_refusal()

    def staged_state_refusal(self) -> str | None:
        """Why no parameter may be updated on the GPU from staged moments (None: it may)."""
        return self.placement.staged_state_refusal()

    def updates_after_backward(self) -> bool:
        """Whether the daemon's updates of the next step wait for backward's last gradient
        (see StatePlacement.updates_after_backward)."""
        return self.placement.updates_after_backward()

    @property
    def device_state_elements(self) -> int:
        """Elements whose AdamW state lives in VRAM (keep_state_on_device)."""
        return self.placement.device_state_elements

    @property
    def staged_state_elements(self) -> int:
        """Elements updated on the GPU with their state in the daemon (staged, or mapped under
        optimizer_mode="gpu")."""
        return self.placement.staged_state_elements

    @property
    def switch_pending(self) -> bool:
        """offload="auto" has not decided yet."""
        return self.auto.enabled

    def weights_to_daemon(self, i: int) -> None:
        """Parameter ``i``'s current value into the daemon's master (and model-dtype) copy."""
        self.placement.weights_to_daemon(i)

    def returned_bytes(self) -> int:
        """Bytes of updated weights the daemon copies back to the device a step."""
        return sum(p.numel() * p.element_size() for i, p in enumerate(self.table.params)
                   if i not in self.table.paged)

    def host_updated_elements(self) -> int:
        """Elements the daemon updates a step (those not updated in VRAM)."""
        return sum(p.numel() for i, p in enumerate(self.table.params)
                   if i not in self.table.on_device)

    def configure(self, *, on_decision: Any = None, vram_headroom: float | None = None,
                  switch_when_fits: bool | None = None, memory_plan: Any = None) -> None:
        """Settings wrap() knows only once its session exists: where decisions are said, the
        VRAM share offload="auto" leaves free, whether it decides, and the run-time memory
        plan told after every step (its ``after_step()``, ``adapting``)."""
        if on_decision is not None:
            self._on_decision = on_decision
        if vram_headroom is not None:
            self.auto.vram_headroom = float(vram_headroom)
        if switch_when_fits is not None:
            self.auto.enabled = bool(switch_when_fits)
        if memory_plan is not None:
            self._adaptive = memory_plan
