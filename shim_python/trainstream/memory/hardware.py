# SPDX-License-Identifier: Apache-2.0
"""What the memory plan needs to know about the machine, measured once and cached: host memory
bandwidth and, with a GPU, pinned copy bandwidth each way and the GPU's memory."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from typing import Any

import torch

_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                      "trainstream")


def _machine_key() -> str:
    parts = [platform.node(), platform.machine(), str(os.cpu_count()), torch.__version__]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        parts += [props.name, str(props.total_memory), torch.version.cuda or ""]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _measure(nbytes: int, repeats: int) -> dict:
    host_a = torch.empty(nbytes, dtype=torch.uint8)
    host_b = torch.empty(nbytes, dtype=torch.uint8)
    host_a.fill_(1)
    seconds = _timed(lambda: host_b.copy_(host_a), repeats)
    result: dict[str, Any] = {"host_copy_gbps": round(2 * nbytes / seconds / 1e9, 2), "gpu": None}
    if torch.cuda.is_available():
        # Under a VRAM cap (or beside a big model) the full buffer may not fit; a smaller one
        # still measures the link, down to 16 MiB where launch costs start to show.
        while True:
            try:
                device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                break
            except torch.OutOfMemoryError:
                if nbytes <= 16 << 20:
                    raise
                nbytes //= 2
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        h2d = _timed(lambda: device.copy_(pinned, non_blocking=True), repeats)
        d2h = _timed(lambda: pinned.copy_(device, non_blocking=True), repeats)
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "total_memory": props.total_memory,
                         "h2d_gbps": round(nbytes / h2d / 1e9, 2),
                         "d2h_gbps": round(nbytes / d2h / 1e9, 2), "copy_bytes": nbytes}
    return result


def profile_hardware(refresh: bool = False, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """The machine's bandwidths (GB/s), from the cache unless ``refresh``; measured with
    ``nbytes`` buffers, best of ``repeats``. ``"gpu"`` is None without a CUDA device."""
    path = os.path.join(_CACHE, f"hardware-{_machine_key()}.json")
    if not refresh and os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        cached["cached"] = True
        return cached
    result = _measure(nbytes, repeats)
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(_CACHE, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    result["cached"] = False
    return result
