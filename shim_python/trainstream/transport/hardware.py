# SPDX-License-Identifier: Apache-2.0
"""What the memory plan needs to know about the machine, measured once and cached: host memory
bandwidth and, with a GPU, pinned copy bandwidth each way and the GPU's memory; and, as
TrainStream 0.6 reported them, a matmul's throughput and a host AdamW step's."""

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


def _matmul(gpu: int | None, quick: bool, repeats: int) -> dict:
    """One square matmul's throughput: bf16 on the GPU (4096, else 8192), fp32 on the CPU
    without one (256, else 512: small, so a CPU profile stays fast)."""
    device = torch.device("cuda", gpu) if gpu is not None else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = (4096 if quick else 8192) if device.type == "cuda" else (256 if quick else 512)
    while True:
        try:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            out = torch.empty(n, n, device=device, dtype=dtype)
            break
        except torch.OutOfMemoryError:  # beside a big model: a smaller one still measures it
            if n <= 512:
                raise
            n //= 2
    seconds = _timed(lambda: torch.matmul(a, b, out=out), repeats)
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "n": n,
            "ms": round(1e3 * seconds, 4), "tflops": round(2 * n ** 3 / seconds / 1e12, 4)}


def _host_adamw(quick: bool, threads: int | None, repeats: int) -> dict:
    """A torch.optim.AdamW step over fp32 parameters on the CPU (1M elements, else 4M), on
    ``threads`` intra-op threads (None: torch's current number). It stands for a host AdamW
    pass on this machine; trainstreamd's own pass is timed by the daemon (tsctl status)."""
    numel = (1 << 20) if quick else (1 << 22)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        param = torch.nn.Parameter(torch.zeros(numel))
        param.grad = torch.randn(numel)
        opt = torch.optim.AdamW([param], lr=1e-3)
        seconds = _timed(opt.step, repeats)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return {"elements": numel, "threads": used, "ms": round(1e3 * seconds, 4),
            "gelems_per_s": round(numel / seconds / 1e9, 4),
            "how": "torch.optim.AdamW step on the CPU, fp32"}


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
        mm = self.get("matmul")
        if mm:
            lines.append(f"matmul: {mm['tflops']} TFLOPS ({mm['n']}x{mm['n']}x{mm['n']} "
                         f"{mm['dtype']} on {mm['device']}, {mm['ms']} ms)")
        adamw = self.get("host_adamw")
        if adamw:
            lines.append(f"host AdamW: {adamw['gelems_per_s']} G elements/s ({adamw['how']}, "
                         f"{adamw['threads']} threads, {adamw['elements']:,} elements in "
                         f"{adamw['ms']} ms)")
        lines.append(f"measured {self.get('measured_at', '?')}"
                     + (" (from the cache)" if self.get("cached") else ""))
        return "\n".join(lines)


def _check(quick: Any, force: Any, refresh: Any, threads: Any) -> None:
    from ..errors import InvalidArgumentError

    for name, value in (("quick", quick), ("force", force), ("refresh", refresh)):
        if value is not True and value is not False:
            raise InvalidArgumentError(
                f"profile_hardware: {name}={value!r} must be True or False")
    if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool)
                                    and threads >= 1):
        raise InvalidArgumentError(
            f"profile_hardware: threads={threads!r} must be None or an integer >= 1 (host "
            "threads for the AdamW benchmark)")


def profile_hardware(device: Any = None, quick: bool = True, force: bool = False,
                     threads: int | None = None, *, refresh: bool = False,
                     nbytes: int | None = None, repeats: int | None = None) -> HardwareProfile:
    """The machine's figures, from the cache unless ``force`` (or ``refresh``): host memory
    copies (``host_copy_gbps``) and, with a GPU (``device``: its index or ``torch.device``,
    default the current one), pinned copies each way (``gpu``: None without a CUDA device);
    a square matmul's throughput (``matmul``: bf16 on the GPU, a small fp32 one on the CPU
    without one); and a host AdamW step's (``host_adamw``): a ``torch.optim.AdamW`` step over
    fp32 parameters on the CPU, on ``threads`` intra-op threads (None: torch's current number),
    not trainstreamd's own pass, which the daemon times on its --threads (``tsctl status``).
    ``quick``: 64 MiB copies, best of 3, a 1M-element AdamW step (else 256 MiB, best of 5, 4M
    elements; ``nbytes``, ``repeats`` set them). A cached profile without the matmul and AdamW
    figures, or with AdamW timed on other ``threads``, has them measured and cached again."""
    _check(quick, force, refresh, threads)
    gpu = None
    if torch.cuda.is_available():
        gpu = (torch.device(device).index if device is not None and not isinstance(device, int)
               else device)
        gpu = torch.cuda.current_device() if gpu is None else int(gpu)
    nbytes = nbytes or ((64 << 20) if quick else (256 << 20))
    repeats = repeats or (3 if quick else 5)
    path = os.path.join(_CACHE, f"hardware-{_machine_key(gpu or 0)}.json")
    result = None
    if not (force or refresh) and os.path.exists(path):
        with open(path) as f:
            result = HardwareProfile(json.load(f))
        adamw = result.get("host_adamw")
        stale = "matmul" not in result or adamw is None or (
            threads is not None and adamw.get("threads") != threads)
        if not stale:
            result["cached"] = True
            return result
    if result is None:
        result = HardwareProfile(_measure(nbytes, repeats, gpu or 0))
        result["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["matmul"] = _matmul(gpu, quick, repeats)
    result["host_adamw"] = _host_adamw(quick, threads, repeats)
    result.pop("cached", None)
    os.makedirs(_CACHE, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    result["cached"] = False
    return result
