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


def _machine_key(device: int = 0) -> str:
    parts = [platform.node(), platform.machine(), str(os.cpu_count()), torch.__version__]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        parts += [props.name, str(props.total_memory), torch.version.cuda or "", str(device)]
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


def _measure(nbytes: int, repeats: int, gpu: int = 0) -> dict:
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
                device = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
                break
            except torch.OutOfMemoryError:
                if nbytes <= 16 << 20:
                    raise
                nbytes //= 2
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        h2d = _timed(lambda: device.copy_(pinned, non_blocking=True), repeats)
        d2h = _timed(lambda: pinned.copy_(device, non_blocking=True), repeats)
        props = torch.cuda.get_device_properties(gpu)
        result["gpu"] = {"index": gpu, "name": props.name, "total_memory": props.total_memory,
                         "h2d_gbps": round(nbytes / h2d / 1e9, 2),
                         "d2h_gbps": round(nbytes / d2h / 1e9, 2), "copy_bytes": nbytes}
    return result


class HardwareProfile(dict):
    """profile_hardware()'s answer: a dict (``host_copy_gbps``; ``gpu``: its name, memory and
    pinned copy bandwidth each way, or None; ``measured_at``; ``cached``) with ``summary()``."""

    def summary(self) -> str:
        lines = [f"host memory copy: {self['host_copy_gbps']} GB/s"]
        gpu = self.get("gpu")
        if gpu:
            lines.append(f"GPU {gpu.get('index', 0)}: {gpu['name']}, "
                         f"{gpu['total_memory'] / 2**30:.1f} GiB; pinned copies host->device "
                         f"{gpu['h2d_gbps']} GB/s, device->host {gpu['d2h_gbps']} GB/s")
        else:
            lines.append("no CUDA GPU")
        lines.append(f"measured {self.get('measured_at', '?')}"
                     + (" (from the cache)" if self.get("cached") else ""))
        return "\n".join(lines)


def profile_hardware(device: Any = None, quick: bool = True, force: bool = False,
                     threads: Any = None, *, refresh: bool = False, nbytes: int | None = None,
                     repeats: int | None = None) -> HardwareProfile:
    """The machine's bandwidths (GB/s), from the cache unless ``force`` (or ``refresh``):
    host memory copies and, with a GPU (``device``: its index or ``torch.device``, default the
    current one), pinned copies each way. ``quick``: 64 MiB buffers, best of 3 (else 256 MiB,
    best of 5; ``nbytes``, ``repeats`` set them). ``threads`` is TrainStream 0.6's host AdamW
    benchmark, which belongs to trainstreamd here (its --threads; tsctl status shows its
    AdamW's figures): only None is taken. ``"gpu"`` is None without a CUDA device."""
    from ..errors import InvalidArgumentError

    for name, value in (("quick", quick), ("force", force), ("refresh", refresh)):
        if value is not True and value is not False:
            raise InvalidArgumentError(
                f"profile_hardware: {name}={value!r} must be True or False")
    if threads is not None:
        raise InvalidArgumentError(
            f"profile_hardware: threads={threads!r}: the host AdamW runs in trainstreamd, on its "
            "--threads; this profile measures copies")
    gpu = 0
    if torch.cuda.is_available():
        gpu = (torch.device(device).index if device is not None and not isinstance(device, int)
               else device)
        gpu = torch.cuda.current_device() if gpu is None else int(gpu)
    nbytes = nbytes or ((64 << 20) if quick else (256 << 20))
    repeats = repeats or (3 if quick else 5)
    path = os.path.join(_CACHE, f"hardware-{_machine_key(gpu)}.json")
    if not (force or refresh) and os.path.exists(path):
        with open(path) as f:
            cached = HardwareProfile(json.load(f))
        cached["cached"] = True
        return cached
    result = HardwareProfile(_measure(nbytes, repeats, gpu))
    result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    os.makedirs(_CACHE, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    result["cached"] = False
    return result
