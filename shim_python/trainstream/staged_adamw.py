# SPDX-License-Identifier: Apache-2.0
"""AdamW on the GPU for parameters whose moments stay in the daemon's host memory.

A full fine-tune too large for VRAM has two places to run its optimizer: the host, whose pass
over every parameter is bounded by the host's memory bandwidth, or the GPU, which needs the
moments next to the weights. This is the second, for the parameters VRAM cannot hold moments
for: as backward finishes a parameter's gradient, its moments are copied from the daemon's
pinned buffers into a staging slot, torch's fused AdamW updates weight and moments there, and
the moments are copied back. Each element crosses PCIe twice each way (8 bytes up, 8 down,
fp32 moments) and costs the host nothing; its weight and gradient never leave VRAM.

Two streams, each with its own slot, take chunks in turn: one chunk's moments go up while the
other's come down. A chunk starts once its gradients are final (its stream waits for the
stream that made them); the optimizer's step() makes the compute stream wait for both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Elements per chunk: a slot holds both moments of that many, 2 x 4 bytes each.
SLOT_ELEMENTS = 16 << 20


def slots_bytes(slot_elements: int = SLOT_ELEMENTS) -> int:
    """VRAM the pipeline's two slots take: both fp32 moments of a chunk, twice."""
    return 2 * 2 * 4 * slot_elements


@dataclass
class _Piece:
    key: tuple           # (parameter index, first element): its step counter
    weight: torch.Tensor  # flat views on the GPU
    grad: torch.Tensor
    exp_avg: torch.Tensor  # flat views of the daemon's pinned memory
    exp_avg_sq: torch.Tensor
    hyper: tuple         # (lr, beta1, beta2, eps, weight_decay)


class StagedAdamW:
    """The pipeline for one optimizer's staged parameters (see the module's text)."""

    def __init__(self, device: torch.device, kind: str = "adamw",
                 slot_elements: int = SLOT_ELEMENTS):
        self._update = torch._fused_adamw_ if kind == "adamw" else torch._fused_adam_
        self._device = device
        self._slot_elements = int(slot_elements)
        self._streams = [torch.cuda.Stream(device) for _ in range(2)]
        self._slots: list[torch.Tensor] = []  # made at the first chunk
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
        """Queues parameter ``index``'s update, whose final gradient ``producer`` made."""
        flat_weight, flat_grad = weight.detach().view(-1), grad.detach().view(-1)
        flat_avg, flat_avg_sq = exp_avg.view(-1), exp_avg_sq.view(-1)
        n = flat_weight.numel()
        for first in range(0, n, self._slot_elements):
            last = min(n, first + self._slot_elements)
            if self._pending_elements + (last - first) > self._slot_elements:
                self.flush(producer)
            self._pending.append(_Piece((index, first), flat_weight[first:last],
                                        flat_grad[first:last], flat_avg[first:last],
                                        flat_avg_sq[first:last], hyper))
            self._pending_elements += last - first
        if self._pending_elements >= self._slot_elements // 2:
            self.flush(producer)

    def flush(self, producer: torch.cuda.Stream) -> None:
        """Starts the pending chunk, after the work ``producer`` has queued so far."""
        pieces, self._pending, self._pending_elements = self._pending, [], 0
        if not pieces:
            return
        if not self._slots:
            self._slots = [torch.empty(2 * self._slot_elements, dtype=torch.float32,
                                       device=self._device) for _ in self._streams]
        stream, slot = self._streams[self._turn], self._slots[self._turn]
        self._turn ^= 1
        stream.wait_stream(producer)
        with torch.cuda.stream(stream):
            avgs, avg_sqs, offset = [], [], 0
            for piece in pieces:
                n = piece.weight.numel()
                avg = slot[offset:offset + n]
                avg_sq = slot[self._slot_elements + offset:self._slot_elements + offset + n]
                avg.copy_(piece.exp_avg, non_blocking=True)
                avg_sq.copy_(piece.exp_avg_sq, non_blocking=True)
                piece.grad.record_stream(stream)  # the caller drops its gradient at once
                avgs.append(avg)
                avg_sqs.append(avg_sq)
                offset += n
            by_hyper: dict[tuple, list[int]] = {}
            for k, piece in enumerate(pieces):
                by_hyper.setdefault(piece.hyper, []).append(k)
            for (lr, beta1, beta2, eps, weight_decay), ks in by_hyper.items():
                steps = [self._steps[pieces[k].key] for k in ks]
                torch._foreach_add_(steps, 1.0)
                self._update([pieces[k].weight for k in ks], [pieces[k].grad for k in ks],
                             [avgs[k] for k in ks], [avg_sqs[k] for k in ks], [], steps,
                             lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                             eps=eps, amsgrad=False, maximize=False)
            for piece, avg, avg_sq in zip(pieces, avgs, avg_sqs):
                piece.exp_avg.copy_(avg, non_blocking=True)
                piece.exp_avg_sq.copy_(avg_sq, non_blocking=True)
        self.chunks += 1
        self.bytes_each_way += 8 * offset

    def join(self, consumer: torch.cuda.Stream) -> None:
        """``consumer``'s later work (the next forward) waits for every queued update."""
        for stream in self._streams:
            consumer.wait_stream(stream)

    def synchronize(self) -> None:
        """Blocks until every queued update and copy has finished (the host's moments are
        current then)."""
        for stream in self._streams:
            stream.synchronize()
