# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's gradients on their way out: each leaves as backward produces it (small ones
batched on the compute stream, large ones on a side stream), and the iteration's end is found
from backward's own end (the last micro-step's gradients out, their updates landing)."""

from __future__ import annotations

import torch

from ..errors import FailedPreconditionError
from ..transport import device as cuda_device

# Gradients up to this size leave on the compute stream itself (a few microseconds of copy
# there, and no cross-stream wait and event per gradient); larger ones on the side stream.
_SIDE_STREAM_BYTES = 1 << 20
# Those small ones leave in batches (one native call and one event each), sent when this many
# gradients or bytes wait, or when the backward they came from ends.
_BATCH_GRADIENTS = 32
_BATCH_BYTES = 8 << 20

class GradientRouting:
    """OffloadAdamW's gradient routing (a part of the class: it reads the facade's state)."""

    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._iteration.completed_early:
            raise FailedPreconditionError(
                f"backward pass {self.accumulation_steps + 1} before step(); accumulation_steps "
                f"is {self.accumulation_steps} (pass accumulation_steps= to wrap). A forward "
                "after the last backward already applied this step's updates")
        i = self.table.index[id(p)]
        # A counter, not a scan of every parameter's count: this runs once per gradient.
        if self._grads_this_iteration == 0:
            # The first gradient of an iteration: updates start now, so a scheduler's new lr
            # must reach the daemon before it, and the copies back must know where each
            # parameter's storage is now.
            self._push_hyperparameters()
            self._check_targets()
        micro = self._backwards[i]
        if micro >= self.accumulation_steps:
            raise FailedPreconditionError(
                f"backward pass {micro + 1} before step(); accumulation_steps is "
                f"{self.accumulation_steps} (pass accumulation_steps= to wrap)")
        self._backwards[i] = micro + 1
        self._grads_this_iteration += 1
        if i in self.table.on_device:
            # Updated in VRAM at step(): the gradient stays where it is (micro-steps add up in
            # it, as torch's do), and a forward after the last backward still completes the
            # iteration first.
            if micro + 1 == self.accumulation_steps:
                self._finish_after_backward(updated_by_daemon=False)
                if i in self.table.staged and self._update_on_gpu:
                    # Final: its update starts now, beside the rest of backward; with clipping
                    # or a reported norm, at step(), once the global norm is known.
                    if not self._reports_norm:
                        self._start_mapped([i], cuda_device.current(self._device_index))
                elif i in self.table.staged:
                    # Final: its update starts now, beside the rest of backward.
                    self._staged.add(i, p, p.grad, self._host.exp_avg(i),
                                     self._host.exp_avg_sq(i), self._hyper(i),
                                     cuda_device.current(self._device_index))
                    self.bytes_to_host += 8 * p.numel()  # fp32 moments each way
                    self.bytes_to_device += 8 * p.numel()
                    p.grad = None  # its chunk holds it until the update has read it
            return
        if not self._cuda:
            slot = self._host.grad(i)
            if p.grad.data_ptr() != slot.data_ptr():
                # Someone set .grad to None (model.zero_grad()): fold the new tensor into the
                # slot and make the slot the gradient again.
                slot.copy_(p.grad)
                p.grad = slot
            if micro + 1 == self.accumulation_steps:  # the slot holds the sum of the passes
                self._finish_after_backward(updated_by_daemon=True)
                self._host.post(i)
            return
        if micro > 0:
            self._send_batch()  # the last micro-step's gradient may still wait in it
            self._host.wait_consumed(i)
        if micro + 1 == self.accumulation_steps:
            self._finish_after_backward(updated_by_daemon=True)
        grad = p.grad
        convert = grad.dtype != self.table.grad_dtypes[i] or not grad.is_contiguous()
        nbytes = grad.numel() * self.table.grad_sizes[i]
        if convert or nbytes > _SIDE_STREAM_BYTES:
            # The side stream, after the work that made the gradient; the allocator keeps its
            # memory until that stream is done with it.
            stream = self._copy_stream
            stream.wait_stream(cuda_device.current(self._device_index))
            grad.record_stream(stream)
            if convert:
                with torch.cuda.stream(stream):
                    grad = grad.to(self.table.grad_dtypes[i], memory_format=torch.contiguous_format)
            pointer = stream.cuda_stream
            self._host.send_gradient(i, micro, grad, pointer)
        else:
            # On the compute stream, in a batch: its later work (reusing this memory once the
            # batch lets go of it) is ordered after the copies.
            self._add_to_batch(i, micro, grad, nbytes)
        self.bytes_to_host += nbytes
        p.grad = None  # no gradient stays in VRAM

    def _add_to_batch(self, i: int, micro: int, grad: torch.Tensor, nbytes: int) -> None:
        pointer = cuda_device.current_pointer(self._device_index)
        if self._batch and pointer != self._batch_stream:
            self._send_batch()
        if graph_task() == -1:  # not inside a backward (no end to wait for): sent now
            self._host.send_gradient(i, micro, grad, pointer)
            return
        self._at_backward_end()  # sent then at the latest (a recompute's inner backward too)
        self._batch.append((i, micro, grad))
        self._batch_stream = pointer
        self._batch_bytes += nbytes
        if len(self._batch) >= _BATCH_GRADIENTS or self._batch_bytes >= _BATCH_BYTES:
            self._send_batch()

    def _send_batch(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if batch:
            self._host.send_gradients(batch, self._batch_stream)

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
        self._send_batch()
        if self._staged is not None:
            self._staged.flush(cuda_device.current(self._device_index))
        self._iteration.backward_ended()

    def _settle_updates(self) -> None:
        """Between the last backward and step(), updates are still landing: a forward, or a
        checkpoint, completes the iteration first and reads the new values, all of them. Not
        in a data-parallel job, where completing waits for every rank's gradients and joins
        the machines' all-reduce, which the other ranks reach only from their step()."""
        if (self._gpu_optimizer is None and self._world_size == 1 and self._machines == 1
                and not in_backward() and self._iteration.start_early_completion()):
            self._complete_iteration()
            self._iteration.completed_before_step()

    def _reduce_across_machines(self) -> None:
        """Sums every parameter's machine-summed gradient over the machines, in place in the
        daemon's reduce buffers, in one fixed order on every machine (the collectives must line
        up), then lets the daemon update each."""
        import torch.distributed as dist

        order = list(reversed(range(len(self.table.params))))  # backward's: the first ready first
        had = torch.tensor([float(self._host.wait_reduce_ready(i)) for i in order])
        # Which parameters any machine had a gradient for: the others are left alone, as on
        # one machine, and need no all-reduce.
        dist.all_reduce(had, op=dist.ReduceOp.MAX, group=self._machine_group)
        for i, any_gradient in zip(order, had.tolist()):
            if any_gradient:
                dist.all_reduce(self._host.reduce(i), group=self._machine_group)
            self._host.post_reduced(i, bool(any_gradient))


def graph_task() -> int:
    """The autograd backward this thread runs now (its graph task id), -1 when none."""
    return _current_graph_task() if _current_graph_task is not None else -1


# Each backward's id, from torch (-1 outside one); a torch without it sends each gradient on
# its own, and lets every forward wait.
_current_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether this thread runs an autograd backward now (a recompute inside it, say)."""
    return graph_task() != -1
