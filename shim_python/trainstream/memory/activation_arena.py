# SPDX-License-Identifier: Apache-2.0
"""Host memory for paged activations, carved from the daemon's buffers (pinned there, counted
against the job and the machine like everything else it holds) instead of private pinned
allocations. One step's activations are laid out one after another; the next step's forward
starts again at the beginning, the earlier step's backward being over by then."""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

_ALIGN = 256
_CHUNK = 64 << 20


class ActivationArena:
    """``allocate(name, nbytes)`` returns a daemon buffer (``trainstream.Buffer``)."""

    def __init__(self, allocate: Callable[[str, int], Any], prefix: str, cap: int = 0):
        """``cap`` > 0: that many bytes are reserved now and the arena never grows past them
        (``host_arena=`` bytes); 0: it grows on demand."""
        self._allocate = allocate
        self._prefix = prefix
        self._names = itertools.count()
        self._chunks: list[torch.Tensor] = []  # byte views of the daemon's buffers
        self._buffers: list[Any] = []          # kept alive with their views
        self._chunk = 0
        self._offset = 0
        self.cap = int(cap)
        if self.cap:
            self._add_chunk(self.cap)

    def _add_chunk(self, size: int) -> None:
        buffer = self._allocate(f"{self._prefix}/{next(self._names)}", size)
        self._buffers.append(buffer)
        self._chunks.append(buffer.tensor(torch.uint8, (size,)))
        self._chunk, self._offset = len(self._chunks) - 1, 0

    @property
    def reserved_bytes(self) -> int:
        return sum(c.numel() for c in self._chunks)

    def reset(self) -> None:
        """A new step: its activations may reuse the last step's room."""
        self._chunk, self._offset = 0, 0

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` in the arena (more is allocated from the
        daemon when the chunks so far are full; the daemon's refusal propagates)."""
        nbytes = max(1, torch.Size(shape).numel() * dtype.itemsize)
        while True:
            if self._chunk < len(self._chunks):
                chunk = self._chunks[self._chunk]
                start = (self._offset + _ALIGN - 1) // _ALIGN * _ALIGN
                if start + nbytes <= chunk.numel():
                    self._offset = start + nbytes
                    return chunk[start:start + nbytes].view(dtype).view(shape)
                if self._chunk + 1 < len(self._chunks):
                    self._chunk, self._offset = self._chunk + 1, 0
                    continue
            if self.cap:
                raise MemoryError(f"the activation arena's {self.cap} bytes (host_arena=) are "
                                  "taken this step")
            self._add_chunk(max(_CHUNK, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN))
