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

from typing import NamedTuple

import torch

from ..transport import kernels
from .nonfinite_guard import DeviceGuard

_TYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Gradients up to this size wait to be launched in a batch (as the host path sends them), of at
# most this many gradients or bytes: the Python around each launch (the stream switch, the
# event the engine's stream waits on) is paid once a batch. A larger gradient goes at once:
# its kernel outweighs that, and VRAM is freed as backward goes.
_BATCH_EACH_BYTES = 1 << 20
_BATCH_GRADIENTS = 32
_BATCH_BYTES = 8 << 20


class _Update(NamedTuple):
    index: int
    weight: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    hyper: tuple
    master: torch.Tensor | None
    grad_scale: float
    step: int


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
        self._launched: list[tuple[int, int]] = []  # (parameter, its flag's index)
        self._flag_count = 0  # launches this step (one flag each)
        self._batch: list[_Update] = []
        self._batch_bytes = 0
        self._batch_producer: torch.cuda.Stream | None = None
        self._flags: torch.Tensor | None = None
        self._host_flags: torch.Tensor | None = None
        self._pending: tuple[list, torch.cuda.Event] | None = None
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
        multiplies the gradient first (the step's clip coefficient), as the host path's does.
        A small gradient waits for a batch (launched together, by :meth:`flush` at the latest:
        one stream switch and one event for the batch instead of one each); a large one goes
        at once with whatever waits."""
        self._settle()
        if not grad.is_contiguous():  # the kernel reads it flat (made on the producer)
            grad = grad.contiguous()
        if self._batch and producer != self._batch_producer:
            self._launch(self._batch_producer)  # each batch waits on the stream that made it
        self._batch_producer = producer
        step = self._steps[index] + 1
        self._steps[index] = step
        self._batch.append(_Update(index, weight, grad, exp_avg, exp_avg_sq, hyper, master,
                                   grad_scale, step))
        nbytes = grad.numel() * grad.element_size()
        self._batch_bytes += nbytes
        if (nbytes > _BATCH_EACH_BYTES or len(self._batch) >= _BATCH_GRADIENTS
                or self._batch_bytes >= _BATCH_BYTES):
            self._launch(producer)
        self.bytes_each_way += weight.numel() * (2 * exp_avg.element_size()
                                                 + (4 if master is not None else 0))

    def _launch(self, stream_now: torch.cuda.Stream) -> None:
        """Queues the waiting updates on the engine's stream, after the work of the stream that
        made their gradients and of ``stream_now`` (the caller's)."""
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if not batch:
            return
        # A forward under inference_mode may complete the iteration (flush, join): the flags
        # made here must still be ordinary tensors.
        with torch.inference_mode(False):
            self._launch_now(batch, stream_now)

    def _launch_now(self, batch: list, stream_now: torch.cuda.Stream) -> None:
        stream = self._stream
        k = self._flag_count
        if self._guard is not None and (self._flags is None
                                        or k + len(batch) > self._flags.numel()):
            self._grow_flags(max(2 * (k + len(batch)), len(self._steps), 16))
        # One event, re-recorded for each batch (a wait takes its state when queued): torch's
        # wait_stream makes an event each time.
        for made in {self._batch_producer, stream_now}:
            if made is not None:
                self._produced.record(made)
                stream.wait_event(self._produced)
        for u in batch:
            u.grad.record_stream(stream)  # kept until the kernel has read it
        if self._guard is None:
            for u in batch:
                self._kernel(u, 0)
        else:
            # Gradient by gradient, in the order backward made them, as one at a time did:
            # its check, its kernel (skipped once the step's flag is set), the flag as it read
            # it. The daemon's pass too applies what came before the first non-finite value.
            flag = self._guard.found.data_ptr()
            with torch.cuda.stream(stream):
                for u in batch:
                    self._guard.check([u.grad])
                    self._kernel(u, flag)
                    self._flags[k].copy_(self._guard.found)
                    self._launched.append((u.index, k))
                    k += 1
            self._flag_count = k
        self.chunks += len(batch)

    def _kernel(self, u: "_Update", flag: int) -> None:
        lr, beta1, beta2, eps, weight_decay = u.hyper
        kernels.adamw(
            True, u.master.data_ptr() if u.master is not None else 0, u.exp_avg.data_ptr(),
            u.exp_avg_sq.data_ptr(), _TYPE_NAMES[u.exp_avg.dtype], u.grad.data_ptr(),
            _TYPE_NAMES[u.grad.dtype], u.weight.data_ptr(), _TYPE_NAMES[u.weight.dtype],
            u.weight.numel(), lr, beta1, beta2, eps, weight_decay, u.step, u.grad_scale,
            kernels.adamw_rounding_seed(u.index, u.step), self._nonfinite.data_ptr(),
            self._stream.cuda_stream, self._decoupled, flag)

    def flush(self, producer: torch.cuda.Stream) -> None:
        """Launches the updates still waiting for a batch (at backward's end, and at step())."""
        self._launch(producer)

    def join(self, consumer: torch.cuda.Stream) -> None:
        """``consumer``'s later work (the next forward, the guard's reset) waits for every
        queued update; the step's record of skipped launches starts on its way to the host."""
        self._launch(consumer)
        if self._launched:
            n = self._flag_count
            with torch.cuda.stream(self._stream):
                self._host_flags[:n].copy_(self._flags[:n], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self._stream)
            self._pending, self._launched, self._flag_count = (self._launched, copied), [], 0
        consumer.wait_stream(self._stream)

    def synchronize(self) -> None:
        """Blocks until every queued update has finished (the daemon's state is current)."""
        self._launch(torch.cuda.current_stream(self._device))
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
        for index, k in launched:
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
