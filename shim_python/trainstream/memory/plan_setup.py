# SPDX-License-Identifier: Apache-2.0
"""What the run-time memory plan (memory/adaptive.py) is given when wrap() makes it: the figures
fixed for the run, what it may do to the job, and what it reads of the job as it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PlanSettings:
    """Fixed for the run."""

    budget: int                     # VRAM bytes the process's steps may peak at
    other_weight_bytes: int = 0     # VRAM weights outside the block stack
    prefetch_depth: int = 1         # blocks fetched ahead of the one running
    link_bytes_per_s: float = 0.0   # PCIe, measured at wrap()
    weights_fixed: bool = False     # param_offload chose the streamed blocks: none more stream
    # What the process held on the device besides this model at wrap(): not in the budget, and
    # taken off every peak read.
    others_bytes: int = 0
    host_cap: int = 0               # host_arena= bytes: paged activations never take more
    # The optimizer state kept in VRAM: "auto", or a number of leading blocks (0: none); and
    # the blocks after them updated on the GPU from staged moments ("auto" or a number). Both
    # 0 where no state may move.
    gpu_state: object = 0
    staged_state: object = 0
    staged_vram: int = 768 << 20    # the staging slots' VRAM (planner.PlanInputs)
    staged_grad_bytes: int = 0      # see planner.PlanInputs
    # Elements outside the stack whose state may move (fp32 trained ones), and what each updated
    # on the host moves over PCIe a step (the updated weight in, its gradient out).
    other_trainable: int = 0
    update_transfer: tuple = (4, 4)


@dataclass(frozen=True)
class PlanActions:
    """What the plan does to the job."""

    stream_weights: Callable[[list], None]    # these blocks stream (their updates stop coming back)
    unstream_weights: Callable[[list], None]  # these blocks hold their weights in VRAM again
    plan_host: Callable[[int], None]          # the job's host plan with this many paged bytes
    note: Callable[..., None]                 # note(kind, message, **numbers): a decision said
    # set_gpu_state(blocks, staged): those leading blocks' state (and the parameters' outside
    # the stack) in VRAM, ``staged`` blocks after them staged; returns each one's elements.
    # None where no state may move.
    set_gpu_state: Callable[[int, int], tuple] | None = None


@dataclass(frozen=True)
class PlanReadings:
    """What the plan reads of the job as it runs."""

    host_free: Callable[[], int]              # host bytes the daemon could still plan
    # The optimizer's PCIe bytes a step (to, from the GPU), as blocks stream now.
    transfer_bytes: Callable[[], tuple] = lambda: (0, 0)
    # The last step's host optimizer pass: (seconds, elements updated on the host).
    host_pass: Callable[[], tuple] | None = None
    # Whether the host's updates wait for backward's last gradient now (clipping that scaled
    # the last step: see OffloadAdamW.updates_after_backward).
    updates_after_backward: Callable[[], bool] = lambda: False
