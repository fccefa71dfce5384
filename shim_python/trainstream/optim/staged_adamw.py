# SPDX-License-Identifier: Apache-2.0
"""AdamW on the GPU for parameters whose moments stay in the daemon's host memory.

A full fine-tune too large for VRAM has two places to run its optimizer: the host, whose pass
over every parameter is bounded by the host's memory bandwidth, or the GPU, which needs the
moments next to the weights. This is the second, for the parameters VRAM cannot hold moments
for: as backward finishes a parameter's gradient, its moments are copied from the daemon's
pinned buffers into a staging slot, torch's fused AdamW updates weight and moments there, and
the moments are copied back. Each element crosses PCIe twice each way (8 bytes up, 8 down,
fp32 moments) and costs the host nothing; its weight and gradient never leave VRAM.

A chunk's gradients are copied into its slot on the stream that made them, so they are free at
once and VRAM holds only the slots; that stream waits (on the GPU, never the CPU) for a slot
to come free, which paces backward to PCIe when the link is what binds. Each direction has its
own stream, so neither copy engine queues behind the other: the up stream loads a chunk's
moments as soon as its slot is free, before backward has made its gradient, and the down
stream updates each chunk once both have arrived and sends its moments back. Eight slots let
the up stream run a block's worth of chunks ahead while the compute stream makes the next
block's gradients. The optimizer's step() makes the compute stream wait for both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Elements per chunk, and chunks in flight: a slot holds a chunk's gradient and both moments.
SLOT_ELEMENTS = 8 << 20
SLOTS = 8


def slots_bytes(slot_elements: int = SLOT_ELEMENTS, slots: int = SLOTS) -> int:
    """VRAM the pipeline's slots take: fp32 gradient and moments of a chunk, each."""
    return slots * 3 * 4 * slot_elements


@dataclass
class _Piece:
    key: tuple           # (parameter index, first element): its step counter
    weight: torch.Tensor  # flat views on the GPU
    grad: torch.Tensor
    made_on: torch.cuda.Stream  # the stream whose work produced the gradient
    exp_avg: torch.Tensor  # flat views of the daemon's pinned memory
    exp_avg_sq: torch.Tensor
    hyper: tuple         # (lr, beta1, beta2, eps, weight_decay)


class StagedAdamW:
    """The pipeline for one optimizer's staged parameters (see the module's text)."""

    def __init__(self, device: torch.device, kind: str = "adamw",
                 slot_elements: int = SLOT_ELEMENTS, slots: int = SLOTS,
                 found_inf: torch.Tensor | None = None):
        self._update = torch._fused_adamw_ if kind == "adamw" else torch._fused_adam_
        # nonfinite="guard" (nonfinite_guard.py): the step's flag on the device; each chunk's
        # gradients set it, and no chunk is applied once it is set.
        self._found_inf = found_inf
        self._one = (torch.ones((), dtype=torch.float32, device=device)
                     if found_inf is not None else None)
        self._device = device
        self._slot_elements = int(slot_elements)
        self._up = torch.cuda.Stream(device)    # moments to the GPU
        self._down = torch.cuda.Stream(device)  # the update, and moments back
        self._slot_count = int(slots)
        self._slots: list[torch.Tensor] = []  # made at the first chunk
        self._free: list = [None] * self._slot_count  # each slot's last use, as an event
        self._turn = 0
        self._pending: list[_Piece] = []
        self._pending_elements = 0
        # One step counter a piece, on the GPU (the fused update reads it there); every piece
        # of a parameter counts alike.
        self._steps: dict[tuple, torch.Tensor] = {}
        self.chunks = 0
        self.bytes_each_way = 0  # moments copied up (and as many down) since construction

    def set_steps(self, index: int, numel: int, steps: int) -> None:
        """Parameter ``index`` (of ``numel`` elements) has taken ``steps`` AdamW steps."""
        for first in range(0, numel, self._slot_elements):
            self._steps[(index, first)] = torch.tensor(float(steps), dtype=torch.float32,
                                                       device=self._device)

    def steps_of(self, index: int) -> int:
        """Parameter ``index``'s steps (after :meth:`synchronize`)."""
        return int(self._steps[(index, 0)].item())

    def forget(self, index: int) -> None:
        for key in [k for k in self._steps if k[0] == index]:
            del self._steps[key]

    def add(self, index: int, weight: torch.Tensor, grad: torch.Tensor,
            exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, hyper: tuple,
            producer: torch.cuda.Stream) -> None:
        """Queues parameter ``index``'s update, whose final gradient ``producer`` made (and
        whose gradient the caller may drop once this returns)."""
        flat_weight, flat_grad = weight.detach().view(-1), grad.detach().view(-1)
        flat_avg, flat_avg_sq = exp_avg.view(-1), exp_avg_sq.view(-1)
        n = flat_weight.numel()
        for first in range(0, n, self._slot_elements):
            last = min(n, first + self._slot_elements)
            if self._pending_elements + (last - first) > self._slot_elements:
                self.flush(producer)
            self._pending.append(_Piece((index, first), flat_weight[first:last],
                                        flat_grad[first:last], producer,
                                        flat_avg[first:last], flat_avg_sq[first:last], hyper))
            self._pending_elements += last - first
        if self._pending_elements >= self._slot_elements // 2:
            self.flush(producer)  # the gradients wait in the caller's memory until then

    def flush(self, producer: torch.cuda.Stream) -> None:
        """Starts the pending chunk, after the work ``producer`` has queued so far."""
        pieces, self._pending, self._pending_elements = self._pending, [], 0
        if not pieces:
            return
        if not self._slots:
            # From the producer's pool, which hands out memory its queued kernels may still
            # use (freed by backward an instant ago): the up stream writes the first moments
            # only after that work. Without this wait a kernel still running there could
            # overwrite moments just loaded (NaN weights from step 2 of a Qwen2.5-1.5B run,
            # 2026-12-02), or the load could overwrite its tensors.
            with torch.cuda.stream(producer):
                self._slots = [torch.empty(3 * self._slot_elements, dtype=torch.float32,
                                           device=self._device)
                               for _ in range(self._slot_count)]
            self._up.wait_stream(producer)
        k = self._turn
        self._turn = (k + 1) % self._slot_count
        slot, size = self._slots[k], self._slot_elements
        avgs, avg_sqs, grads, offset = [], [], [], 0
        for piece in pieces:
            n = piece.weight.numel()
            avgs.append(slot[offset:offset + n])
            avg_sqs.append(slot[size + offset:size + offset + n])
            grads.append(slot[2 * size + offset:2 * size + offset + n])
            offset += n
        if self._free[k] is not None:  # the slot's last chunk has gone back
            self._up.wait_event(self._free[k])
            producer.wait_event(self._free[k])
        with torch.cuda.stream(self._up):
            for piece, avg, avg_sq in zip(pieces, avgs, avg_sqs):
                avg.copy_(piece.exp_avg, non_blocking=True)
                avg_sq.copy_(piece.exp_avg_sq, non_blocking=True)
            loaded = torch.cuda.Event()
            loaded.record(self._up)
        # A gradient another stream made (a backward on a side stream) is read after it, and
        # its memory kept until the copy below has read it.
        for made_on in {piece.made_on for piece in pieces} - {producer}:
            producer.wait_stream(made_on)
        for piece in pieces:
            if piece.made_on != producer:
                piece.grad.record_stream(producer)
        with torch.cuda.stream(producer):
            for piece, grad in zip(pieces, grads):
                grad.copy_(piece.grad)
        self._down.wait_event(loaded)
        self._down.wait_stream(producer)
        with torch.cuda.stream(self._down):
            if self._found_inf is not None:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf,
                                                                 self._one)
            by_hyper: dict[tuple, list[int]] = {}
            for j, piece in enumerate(pieces):
                by_hyper.setdefault(piece.hyper, []).append(j)
            for (lr, beta1, beta2, eps, weight_decay), js in by_hyper.items():
                steps = [self._steps[pieces[j].key] for j in js]
                torch._foreach_add_(steps, 1.0)
                self._update([pieces[j].weight for j in js], [grads[j] for j in js],
                             [avgs[j] for j in js], [avg_sqs[j] for j in js], [], steps,
                             lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                             eps=eps, amsgrad=False, maximize=False, found_inf=self._found_inf)
                if self._found_inf is not None:  # a skipped update took no step
                    torch._foreach_sub_(steps, [self._found_inf] * len(steps))
            for piece, avg, avg_sq in zip(pieces, avgs, avg_sqs):
                piece.exp_avg.copy_(avg, non_blocking=True)
                piece.exp_avg_sq.copy_(avg_sq, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._down)
        self._free[k] = done
        self.chunks += 1
        self.bytes_each_way += 8 * offset

    def join(self, consumer: torch.cuda.Stream) -> None:
        """``consumer``'s later work (the next forward) waits for every queued update."""
        consumer.wait_stream(self._down)
        # The next step's loads read what this step's updates send back: the up stream, which
        # otherwise waits only for its slot, waits for all of them.
        self._up.wait_stream(self._down)

    def synchronize(self) -> None:
        """Blocks until every queued update and copy has finished (the host's moments are
        current then). Pieces added but not flushed are not started: the optimizer flushes at
        the end of every backward, before anything reads the host's moments."""
        self._up.synchronize()
        self._down.synchronize()
