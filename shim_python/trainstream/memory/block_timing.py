# SPDX-License-Identifier: Apache-2.0
"""The forward times of the blocks the pager measures (memory/pager.py): each block replayed
without gradients where it can be, else its forward as timed in the step."""

from __future__ import annotations

import time
from typing import Any

import torch

from .kv_cache import CACHE_ARGUMENTS

# Forwards timed when a measured block is replayed (after one warm-up).
_REPLAYS = 2


def _plain(value: Any) -> bool:
    """Whether a block's argument is data a forward only reads: tensors and plain values,
    alone or in tuples, lists and dicts."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return False


class BlockTiming:
    """What the pager measured of each block it was asked to (the probe step): the bytes its
    forward saves for backward, its input's bytes and its forward's time, by block index."""

    def __init__(self, device: torch.device, cuda: bool):
        self.device = device
        self.cuda = cuda
        self.measured: dict[int, dict] = {}
        # The step's VRAM peak when a measured block was replayed (the replay's own memory is
        # not the step's); read with the allocator's peak since, and cleared with it.
        self.peak_before_replay = 0

    def record(self, b: int, module: torch.nn.Module, measuring: dict) -> None:
        """Block ``b``'s forward has ended (``measuring``: what its start noted): its figures,
        replayed while its weights are still bound."""
        end = None
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.measured[b] = {"saved_bytes": measuring["saved_bytes"],
                            "input_bytes": measuring["input_bytes"],
                            "events": (measuring["start"], end),
                            "wall_s": time.perf_counter() - measuring["clock"],
                            "replay_s": self._replay_seconds(module, *measuring["call"])}

    def _replay_seconds(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> float | None:
        """The block's forward run again without gradients, after one warm-up: its time with
        the kernels chosen and the CPU ahead of the GPU, which is what a recompute costs. The
        timed forward of a step reads higher: in the first step the allocator grows and libraries
        pick kernels, and hooks can leave the GPU waiting for the CPU. The replay runs in eval
        mode (no running statistics updated, no dropout) and its memory is kept out of the
        step's peak (``peak_before_replay``). None when it fails (out of memory, say) or when the
        block is called with something a replay could change (an object other than tensors and
        plain values)."""
        # A key/value cache would grow with each replay; training never reads it back, and an
        # empty one gives attention the same keys as none.
        kwargs = {k: (None if k in CACHE_ARGUMENTS else False if k == "use_cache" else v)
                  for k, v in kwargs.items()}
        if not all(_plain(v) for v in (*args, *kwargs.values())):
            return None
        modes = [(m, m.training) for m in module.modules()]
        if self.cuda:
            self.peak_before_replay = max(self.peak_before_replay,
                                          torch.cuda.max_memory_allocated(self.device))
        try:
            module.eval()
            # Its own random numbers: whatever samples in eval mode leaves the step's stream.
            with torch.no_grad(), torch.random.fork_rng(
                    devices=[self.device] if self.cuda else [],
                    device_type="cuda" if self.cuda else "cpu"):
                module.forward(*args, **kwargs)
                if self.cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(_REPLAYS):
                        module.forward(*args, **kwargs)
                    end.record()
                    end.synchronize()
                    return start.elapsed_time(end) / 1000.0 / _REPLAYS
                clock = time.perf_counter()
                for _ in range(_REPLAYS):
                    module.forward(*args, **kwargs)
                return (time.perf_counter() - clock) / _REPLAYS
        except Exception:  # noqa: BLE001 - a measurement only: the step's timing stands in
            return None
        finally:
            for m, training in modes:
                m.training = training
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)

    def forward_seconds(self, b: int) -> float:
        """The measured block's forward time: replayed when it could be (see _replay_seconds),
        else as timed in the step (GPU time on CUDA)."""
        m = self.measured[b]
        if m.get("replay_s") is not None:
            return m["replay_s"]
        start, end = m["events"]
        if start is not None and end is not None:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return m["wall_s"]
