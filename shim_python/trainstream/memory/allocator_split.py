# SPDX-License-Identifier: Apache-2.0
"""Keeps torch's caching allocator from splitting the blocks the step's largest tensors (the
logits and their gradient) come back to. Left to itself the allocator hands part of a freed
logits block to a smaller request (an activation brought back for backward), and the next step's
logits find room reserved but no piece of it large enough: under a tight cap that is an
out-of-memory error with a fifth of the reserved memory free (the GPU model matrix's small LoRA
cases, 2026-12-02). torch's own remedy is ``max_split_size_mb``: blocks at least that large are
never split. It is process-wide, so it is set only where the user chose no allocator settings of
their own, and taken back when the last wrapped model that asked for it is unwrapped."""

from __future__ import annotations

import os

import torch

# What "no limit" is set back to: torch's default is the largest size_t, which its parser
# cannot take back in MiB; a pebibyte is as good as none.
_NO_LIMIT_MIB = 1 << 30
# torch refuses limits at or below its large-buffer size (20 MiB).
_SMALLEST_MIB = 21
_holders: dict[int, int] = {}  # id of the holder: the limit it asked for, in MiB


def _user_chose_settings() -> bool:
    conf = ",".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF",
                                                     "PYTORCH_ALLOC_CONF"))
    return any(k in conf for k in ("max_split_size_mb", "expandable_segments:True",
                                   "expandable_segments:true", "cudaMallocAsync"))


def _setter():
    """torch's call that changes the allocator's settings at run time (renamed, the
    old name deprecated), or None where this torch has neither."""
    return (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            or getattr(torch.cuda.memory, "_set_allocator_settings", None))


def _set(mib: int) -> None:
    _setter()(f"max_split_size_mb:{mib}")


def largest_split_segment_mib() -> int:
    """The largest segment of the caching allocator's large pool that is cut into more than one
    block, in MiB rounded up (0: none), after handing back every whole free segment.

    Such a segment must stay below the split limit: torch 2.11's allocator, at its limit,
    releases free blocks at or past ``max_split_size`` with ``cudaFree`` without checking that
    they are whole segments, and a piece of one is not an address ``cudaMalloc`` returned:
    "CUDA error: invalid argument" in whatever operation was allocating (the 1.5B full
    fine-tune's embedding backward, H200 2026-12-04), or, for a segment's first piece, the
    pieces after it freed under their users. Blocks split before the limit was lowered are the
    only ones that can be there: past it, the allocator splits no block at or above it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    largest = max((int(segment["total_size"]) for segment in torch.cuda.memory_snapshot()
                   if segment.get("segment_type", "large") == "large"
                   and len(segment.get("blocks", ())) > 1), default=0)
    return -(-largest >> 20) if largest else 0


class LargeBlocksWhole:
    """One wrapped model's request that blocks the size of its step's largest tensors stay
    whole."""

    def __init__(self) -> None:
        self.mib = 0  # the limit this holder asked for (0: none)
        # Where a segment already cut up was larger than the limit wanted: that limit, in MiB
        # (the limit set is then above the segment: largest_split_segment_mib).
        self.wanted_mib = 0

    def apply(self, largest_bytes: int) -> int:
        """Blocks of half ``largest_bytes`` and more are not split from now on; returns the limit
        in MiB, or 0 where nothing was set (the user's settings stand, or no CUDA allocator
        setting can be changed in this torch). The limit is raised above any segment the
        allocator has already cut up (largest_split_segment_mib)."""
        if (self.mib or _user_chose_settings() or not torch.cuda.is_available()
                or _setter() is None):
            return 0
        wanted = max(_SMALLEST_MIB, (int(largest_bytes) // 2) >> 20)
        lowest = min([wanted, *_holders.values()])
        split = largest_split_segment_mib()
        mib = max(wanted, split + 1) if split >= lowest else wanted
        self.wanted_mib = wanted if mib != wanted else 0
        _holders[id(self)] = mib
        _set(min(_holders.values()))
        self.mib = mib
        return mib

    def restore(self) -> None:
        if not self.mib:
            return
        _holders.pop(id(self), None)
        self.mib = 0
        _set(min(_holders.values()) if _holders else _NO_LIMIT_MIB)
