# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's gradients on their way out: each leaves as backward produces it (small ones
batched on the compute stream, large ones on a side stream), and the iteration's end is found
from backward's own end (the last micro-step's gradients out, their updates landing)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..errors import FailedPreconditionError
from ..transport import device as cuda_device
from .iteration import Iteration
from .parameters import ParameterTable

# Gradients up to this size leave on the compute stream itself (a few microseconds of copy
# there, and no cross-stream wait and event per gradient); larger ones on the side stream.
_SIDE_STREAM_BYTES = 1 << 20
# Those small ones leave in batches (one native call and one event each), sent when this many
# gradients or bytes wait, or when the backward they came from ends.
_BATCH_GRADIENTS = 32
_BATCH_BYTES = 8 << 20


@dataclasses.dataclass
class Traffic:
    """Bytes over PCIe since the optimizer was made: gradients (and staged moments) to the
    host, updated weights (and staged moments) to the device."""

    to_host: int = 0
    to_device: int = 0


class GradientRouter:
    """Each trained parameter's gradient, the moment backward produces it: counted against the
    accumulation steps, and sent to the daemon (a CUDA one copied out, a CPU one posted from its
    shared slot), or left in VRAM for a GPU update (``held_gradient``). It owns the micro-step
    counts and the batch of small gradients waiting to leave; the iteration's phase is told of
    each last gradient and of each backward's end.

    ``first_gradient`` runs before an iteration's first gradient leaves (the daemon's
    hyper-parameters and copy targets must be current before updates start); ``held_gradient(i,
    p)`` takes a gradient of a parameter updated on the GPU at its last micro-step;
    ``backward_ended`` runs as each backward that sent gradients ends."""

    def __init__(self, *, host: Any, table: ParameterTable, iteration: Iteration,
                 accumulation_steps: int, device_index: int, copy_stream: Any,
                 traffic: Traffic, clock: Any, first_gradient: Callable[[], None],
                 held_gradient: Callable[[int, torch.Tensor], None],
                 backward_ended: Callable[[], None]) -> None:
        self._host = host
        self._table = table
        self._iteration = iteration
        self._accumulation_steps = accumulation_steps
        self._cuda = device_index >= 0
        self._device_index = device_index
        self._copy_stream = copy_stream
        self._traffic = traffic
        self._first_gradient = first_gradient
        self._held_gradient = held_gradient
        self._after_backward = backward_ended
        self._backwards = [0] * len(table.params)  # micro-steps seen, per parameter
        self._count = 0  # gradients since the iteration began
        # Small gradients waiting to leave together: (index, micro-step, gradient), all made on
        # the stream _batch_stream; their memory is held until their copies are enqueued.
        self._batch: list[tuple[int, int, torch.Tensor]] = []
        self._batch_stream = 0
        self._batch_bytes = 0
        self._end_task = -2  # the backward whose end is hooked (a graph task id)
        self.on_gradient_timed = clock.timed("optimizer.gradient_out", self.on_gradient)
        self._backward_ended_timed = clock.timed("optimizer.gradient_batch", self._backward_ended)

    # -- what the optimizer asks ---------------------------------------------------------------

    @property
    def in_iteration(self) -> bool:
        """Whether any gradient arrived since the iteration began (a step is in progress)."""
        return any(self._backwards)

    @property
    def most_backwards(self) -> int:
        """The most backward passes any parameter had a gradient from in this iteration."""
        return max(self._backwards, default=0)

    def backwards_of(self, i: int) -> int:
        """Backward passes parameter ``i`` had a gradient from in this iteration."""
        return self._backwards[i]

    @property
    def batched(self) -> int:
        """Small gradients waiting in the batch to leave."""
        return len(self._batch)

    def extend(self, count: int) -> None:
        """``count`` parameters joined the table (add_param_group)."""
        self._backwards += [0] * count

    def iteration_done(self) -> None:
        """The iteration completed: the next gradients are its successor's first."""
        self._backwards = [0] * len(self._backwards)
        self._count = 0

    def send_batch(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if batch:
            self._host.send_gradients(batch, self._batch_stream)

    def drain(self) -> None:
        """Every gradient on its way out is handed to the daemon (CUDA: waits for the copies)."""
        if self._cuda:
            self.send_batch()
            self._host.drain_gradients()

    # -- backward's hooks ----------------------------------------------------------------------

    def on_gradient(self, p: torch.Tensor) -> None:
        accumulation = self._accumulation_steps
        if self._iteration.completed_early:
            raise FailedPreconditionError(
                f"backward pass {accumulation + 1} before step(); accumulation_steps is "
                f"{accumulation} (pass accumulation_steps= to wrap). A forward after the last "
                "backward already applied this step's updates")
        table = self._table
        i = table.index[id(p)]
        # A counter, not a scan of every parameter's count: this runs once per gradient.
        if self._count == 0:
            self._first_gradient()
        micro = self._backwards[i]
        if micro >= accumulation:
            raise FailedPreconditionError(
                f"backward pass {micro + 1} before step(); accumulation_steps is "
                f"{accumulation} (pass accumulation_steps= to wrap)")
        self._backwards[i] = micro + 1
        self._count += 1
        last = micro + 1 == accumulation
        if i in table.on_device:
            # Updated in VRAM at step(): the gradient stays where it is (micro-steps add up in
            # it, as torch's do), and a forward after the last backward still completes the
            # iteration first.
            if last:
                self._finish_after_backward(updated_by_daemon=False)
                self._held_gradient(i, p)
            return
        if not self._cuda:
            slot = self._host.grad(i)
            if p.grad.data_ptr() != slot.data_ptr():
                # Someone set .grad to None (model.zero_grad()): fold the new tensor into the
                # slot and make the slot the gradient again.
                slot.copy_(p.grad)
                p.grad = slot
            if last:  # the slot holds the sum of the passes
                self._finish_after_backward(updated_by_daemon=True)
                self._host.post(i)
            return
        if micro > 0:
            self.send_batch()  # the last micro-step's gradient may still wait in it
            self._host.wait_consumed(i)
        if last:
            self._finish_after_backward(updated_by_daemon=True)
        grad = p.grad
        convert = grad.dtype != table.grad_dtypes[i] or not grad.is_contiguous()
        nbytes = grad.numel() * table.grad_sizes[i]
        if convert or nbytes > _SIDE_STREAM_BYTES:
            # The side stream, after the work that made the gradient; the allocator keeps its
            # memory until that stream is done with it.
            stream = self._copy_stream
            stream.wait_stream(cuda_device.current(self._device_index))
            grad.record_stream(stream)
            if convert:
                with torch.cuda.stream(stream):
                    grad = grad.to(table.grad_dtypes[i], memory_format=torch.contiguous_format)
            self._host.send_gradient(i, micro, grad, stream.cuda_stream)
        else:
            # On the compute stream, in a batch: its later work (reusing this memory once the
            # batch lets go of it) is ordered after the copies.
            self._add_to_batch(i, micro, grad, nbytes)
        self._traffic.to_host += nbytes
        p.grad = None  # no gradient stays in VRAM

    def _add_to_batch(self, i: int, micro: int, grad: torch.Tensor, nbytes: int) -> None:
        pointer = cuda_device.current_pointer(self._device_index)
        if self._batch and pointer != self._batch_stream:
            self.send_batch()
        if graph_task() == -1:  # not inside a backward (no end to wait for): sent now
            self._host.send_gradient(i, micro, grad, pointer)
            return
        self._at_backward_end()  # sent then at the latest (a recompute's inner backward too)
        self._batch.append((i, micro, grad))
        self._batch_stream = pointer
        self._batch_bytes += nbytes
        if len(self._batch) >= _BATCH_GRADIENTS or self._batch_bytes >= _BATCH_BYTES:
            self.send_batch()

    def _finish_after_backward(self, *, updated_by_daemon: bool) -> None:
        # The iteration may be completed early only once the backward that produced its last
        # gradients has ended (not from another thread while it runs): marked at its end.
        self._iteration.last_gradient_out(updated_by_daemon=updated_by_daemon)
        self._at_backward_end()

    def _at_backward_end(self) -> None:
        """Has _backward_ended run when the backward running now ends (once per backward; on
        every call where torch cannot tell one backward from another)."""
        task = graph_task()
        if task != self._end_task or task == -1:
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended_timed)
            self._end_task = task

    def _backward_ended(self) -> None:
        self.send_batch()
        self._after_backward()
        self._iteration.backward_ended()


def reduce_across_machines(host: Any, count: int, group: Any) -> None:
    """Sums every parameter's machine-summed gradient over the machines, in place in the
    daemon's reduce buffers, in one fixed order on every machine (the collectives must line
    up), then lets the daemon update each (``count`` parameters, ``group`` the machines' rank
    0s)."""
    import torch.distributed as dist

    order = list(reversed(range(count)))  # backward's: the first ready first
    had = torch.tensor([float(host.wait_reduce_ready(i)) for i in order])
    # Which parameters any machine had a gradient for: the others are left alone, as on one
    # machine, and need no all-reduce.
    dist.all_reduce(had, op=dist.ReduceOp.MAX, group=group)
    for i, any_gradient in zip(order, had.tolist()):
        if any_gradient:
            dist.all_reduce(host.reduce(i), group=group)
        host.post_reduced(i, bool(any_gradient))


def graph_task() -> int:
    """The autograd backward this thread runs now (its graph task id), -1 when none."""
    return _current_graph_task() if _current_graph_task is not None else -1


# Each backward's id, from torch (-1 outside one); a torch without it sends each gradient on
# its own, and lets every forward wait.
_current_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether this thread runs an autograd backward now (a recompute inside it, say)."""
    return graph_task() != -1
