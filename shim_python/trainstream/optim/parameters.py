# SPDX-License-Identifier: Apache-2.0
"""The parameters an OffloadAdamW trains, by their index in the daemon's job, and where each
one's update happens: in the daemon (the default), on the GPU with its AdamW state in VRAM, or
on the GPU with its moments staged out of the daemon; and which ones stream from host memory
(a streamed block's, whose updates are read from the host copy and never copied back)."""

from __future__ import annotations

from typing import Iterable

import torch


class ParameterTable:
    """``all`` is every parameter of the optimizer's groups (frozen ones too, for checkpoints'
    order); ``params`` the trained ones, the daemon's tensors in the same order, with the
    dtypes their gradients cross to the daemon in."""

    def __init__(self, all_params: list, grad_dtype: torch.dtype | None):
        self.all = list(all_params)
        self.params = [p for p in self.all if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.grad_dtype = grad_dtype  # None: each gradient in its parameter's dtype
        self.grad_dtypes = [grad_dtype or p.dtype for p in self.params]
        self.grad_sizes = [d.itemsize for d in self.grad_dtypes]
        self.paged: set[int] = set()      # read from the host copy at each use
        self.on_device: set[int] = set()  # updated on the GPU (keep_state_on_device)
        self.staged: set[int] = set()     # of those, moments staged out of the daemon

    def __len__(self) -> int:
        return len(self.params)

    def extend(self, group_params: Iterable[torch.Tensor]) -> list:
        """A new group's parameters join (its trained ones take the next indices); returns the
        trained ones."""
        group_params = list(group_params)
        self.all += group_params
        new = [p for p in group_params if p.requires_grad]
        for p in new:
            self.index[id(p)] = len(self.params)
            self.params.append(p)
            self.grad_dtypes.append(self.grad_dtype or p.dtype)
            self.grad_sizes.append(self.grad_dtypes[-1].itemsize)
        return new

    def place(self, on_device: set, staged: set) -> None:
        """Parameters ``on_device`` are updated on the GPU from now on, ``staged`` of them with
        moments staged out of the daemon, the rest of them with their state in VRAM."""
        self.on_device, self.staged = set(on_device), set(staged)

    def state_in_vram(self) -> set:
        """The parameters whose whole AdamW state lives in VRAM."""
        return self.on_device - self.staged

    def returned(self, i: int) -> bool:
        """Whether parameter ``i``'s updates come back from the daemon to its device tensor
        (not a streamed block's, read from the host copy; not one updated on the GPU)."""
        return i not in self.paged and i not in self.on_device
