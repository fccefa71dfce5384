# SPDX-License-Identifier: Apache-2.0
"""optimizer_mode="gpu": AdamW on the GPU over state that stays in the daemon's pinned memory.

The staged pipeline (staged_adamw.py) copies a chunk's moments into VRAM, updates there and
copies them back. Here the kernel (kernels/cuda/adamw_mapped.cu) reads and writes the moments,
and the fp32 master weights of a bf16 or fp16 parameter, where they lie: the client registers
the daemon's segments with CUDA as mapped memory, so each element crosses PCIe once each way
inside the kernel, with no slots in VRAM, no copies to order and no host pass. The weight and
the gradient stay in VRAM; the weight is updated in place as backward finishes its gradient,
on a stream of the engine's own that the next forward waits for.

Element for element it is the host path's arithmetic (the same constants, roundings and
stochastic-rounding seed per tensor and step), so a job may move between the host and the GPU,
or restore the other's checkpoint, and go on exactly as if it had not."""

from __future__ import annotations

import torch

from ..transport import kernels
from .nonfinite_guard import DeviceGuard

_TYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def mappable_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernel updates parameters (and reads gradients) of this dtype."""
    return dtype in _TYPE_NAMES


class MappedAdamW:
    """The zero-copy updates of one optimizer's parameters on the GPU (see the module's text).

    The same surface as StagedAdamW, which placement.py drives: ``set_steps``, ``steps_of``,
    ``forget``, ``add``, ``flush``, ``join``, ``synchronize``."""

    def __init__(self, device: torch.device, kind: str = "adamw",
                 guard: DeviceGuard | None = None):
        self._device = device
        self._decoupled = kind == "adamw"
        self._stream = torch.cuda.Stream(device)
        self._produced = torch.cuda.Event()
        self._guard = guard
        # Gradient elements that were NaN or infinite (applied, as torch does, unless guarded).
        self._nonfinite = torch.zeros(1, dtype=torch.int64, device=device)
        self._steps: dict[int, int] = {}
        # nonfinite="guard": each launch of the step records the flag as its kernel read it;
        # the host learns a step late (from a pinned copy, as DeviceGuard does) which launches
        # were skipped, and takes their steps back.
        self._launched: list[int] = []
        self._flags: torch.Tensor | None = None
        self._host_flags: torch.Tensor | None = None
        self._pending: tuple[list[int], torch.cuda.Event] | None = None
        self.chunks = 0          # kernel launches since construction
        self.bytes_each_way = 0  # optimizer state read over PCIe (and as much written back)

    def set_steps(self, index: int, numel: int, steps: int) -> None:
        """Parameter ``index`` has taken ``steps`` AdamW steps (``numel``: StagedAdamW's)."""
        del numel
        self._steps[index] = int(steps)

    def steps_of(self, index: int) -> int:
        """Parameter ``index``'s steps (after :meth:`synchronize`)."""
        self._settle()
        return self._steps[index]

    def forget(self, index: int) -> None:
        self._steps.pop(index, None)

    def nonfinite_values(self) -> int:
        """Non-finite gradient elements the kernel has seen (a host sync)."""
        return int(self._nonfinite.item())

    def add(self, index: int, weight: torch.Tensor, grad: torch.Tensor,
            exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, hyper: tuple,
            producer: torch.cuda.Stream, master: torch.Tensor | None = None,
            grad_scale: float = 1.0) -> None:
        """Queues parameter ``index``'s update, whose final gradient ``producer`` made; the
        caller may drop the gradient once this returns. ``master``: the daemon's fp32 master,
        for a parameter that is not fp32 (an fp32 parameter is its own). ``grad_scale``
        multiplies the gradient first (the step's clip coefficient), as the host path's does."""
        self._settle()
        if not grad.is_contiguous():  # the kernel reads it flat (made on the producer)
            grad = grad.contiguous()
        lr, beta1, beta2, eps, weight_decay = hyper
        stream = self._stream
        k = len(self._launched)
        if self._guard is not None and (self._flags is None or k >= self._flags.numel()):
            self._grow_flags(max(2 * k, len(self._steps), 16))
        # One event, re-recorded for each gradient (a wait takes its state when queued): this
        # runs once a parameter, and torch's wait_stream makes an event each time.
        self._produced.record(producer)
        stream.wait_event(self._produced)
        grad.record_stream(stream)  # kept until the kernel has read it
        step = self._steps[index] + 1
        numel = weight.numel()

        def launch(flag: int) -> None:
            kernels.adamw(
                True, master.data_ptr() if master is not None else 0, exp_avg.data_ptr(),
                exp_avg_sq.data_ptr(), _TYPE_NAMES[exp_avg.dtype], grad.data_ptr(),
                _TYPE_NAMES[grad.dtype], weight.data_ptr(), _TYPE_NAMES[weight.dtype], numel,
                lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                kernels.adamw_rounding_seed(index, step), self._nonfinite.data_ptr(),
                stream.cuda_stream, self._decoupled, flag)

        if self._guard is None:
            launch(0)
        else:
            # In this order on the engine's stream: the check, the kernel (skipped when the
            # step's flag is set by then), the flag as the kernel read it.
            with torch.cuda.stream(stream):
                self._guard.check([grad])
                launch(self._guard.found.data_ptr())
                self._flags[k].copy_(self._guard.found)
            self._launched.append(index)
        self._steps[index] = step
        self.chunks += 1
        self.bytes_each_way += numel * (2 * exp_avg.element_size()
                                        + (4 if master is not None else 0))

    def flush(self, producer: torch.cuda.Stream) -> None:
        """Nothing waits to start: each update is queued by :meth:`add` itself."""
        del producer

    def join(self, consumer: torch.cuda.Stream) -> None:
        """``consumer``'s later work (the next forward, the guard's reset) waits for every
        queued update; the step's record of skipped launches starts on its way to the host."""
        if self._launched:
            n = len(self._launched)
            with torch.cuda.stream(self._stream):
                self._host_flags[:n].copy_(self._flags[:n], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            self._pending, self._launched = (self._launched, copied), []
        consumer.wait_stream(self._stream)

    def synchronize(self) -> None:
        """Blocks until every queued update has finished (the daemon's state is current)."""
        self._stream.synchronize()
        self._settle()

    def _settle(self) -> None:
        """Takes back the steps of the last joined step's skipped launches (its flags were
        copied by then: this waits for nothing still running)."""
        if self._pending is None:
            return
        launched, copied = self._pending
        self._pending = None
        copied.synchronize()
        for k, index in enumerate(launched):
            if self._host_flags[k] > 0 and index in self._steps:
                self._steps[index] -= 1

    def _grow_flags(self, size: int) -> None:
        """Room for ``size`` launches a step (the flags so far move over on the stream)."""
        flags = torch.zeros(size, dtype=torch.float32, device=self._device)
        if self._flags is not None:
            # The zeros (the current stream's) before the old flags land on them, and the old
            # tensor kept until the engine's stream, which wrote it, is done with it.
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                flags[:self._flags.numel()].copy_(self._flags)
            self._flags.record_stream(self._stream)
        self._flags = flags
        self._host_flags = torch.zeros(size, dtype=torch.float32, pin_memory=True)
