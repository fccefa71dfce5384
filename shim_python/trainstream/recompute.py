# SPDX-License-Identifier: Apache-2.0
"""Recompute: chosen blocks keep only their inputs from forward and run their forward again in
backward (torch.utils.checkpoint, non-reentrant), trading compute for activation memory when
host memory cannot take their activations either."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.utils.checkpoint


class Recompute:
    """Makes ``blocks[i]`` recompute its forward in backward for every ``i`` in ``indices``;
    :meth:`set` changes the choice between steps (the adaptive plan does)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], indices: Sequence[int]):
        self.blocks = list(blocks)
        self.indices: list[int] = []
        self.set(indices)

    def set(self, indices: Sequence[int]) -> None:
        chosen = sorted(set(int(i) for i in indices))
        for i in set(self.indices) - set(chosen):
            self.blocks[i].__dict__.pop("forward", None)
        for i in set(chosen) - set(self.indices):
            module = self.blocks[i]
            original = module.forward

            def forward(*args, _original=original, **kwargs):
                if not torch.is_grad_enabled():
                    return _original(*args, **kwargs)
                return torch.utils.checkpoint.checkpoint(_original, *args, use_reentrant=False,
                                                         **kwargs)

            # An attribute of the instance: module hooks still run around it, once per call.
            module.forward = forward
        self.indices = chosen

    def close(self) -> None:
        self.set(())
