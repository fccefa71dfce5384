# SPDX-License-Identifier: Apache-2.0
"""optimizer_mode (OffloadAdamW's ``mode``): where the AdamW update of the state in trainstreamd
runs. ``"cpu"``: the daemon's threads, each gradient crossing PCIe to the host and each new
weight back. ``"gpu"``: a CUDA kernel reading and writing the state where it lies, over PCIe
(mapped_adamw.py). ``"auto"``: the one the hardware profile says is faster, with the figures
that decided it.

Per element and step, the host path moves the gradient down and the weight up (each in the
model's dtype) and its pass reads and writes the fp32 master and both moments in host memory;
the GPU path moves only the state, both ways at once (the master, for a parameter that is not
fp32, and both moments). Both run beside backward, so the slower of a path's own links is its
cost."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..transport.hardware import profile_hardware

MODES = ("cpu", "gpu", "auto")


def check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise InvalidArgumentError(
            f"optimizer mode {mode!r} is not one of 'cpu' (AdamW on trainstreamd's threads), "
            "'gpu' (a CUDA kernel over the state in trainstreamd's pinned memory, zero-copy) "
            "or 'auto' (the faster of the two on this machine's measured profile)")


def decide_mode(mode: str, refusal: str | None, params: list,
                moment_dtype: torch.dtype) -> tuple[str, str, dict]:
    """(where the update runs, why, the figures) for ``mode``; ``refusal``: why the GPU cannot
    (placement.gpu_update_refusal), which makes mode="gpu" an error."""
    if mode == "gpu" and refusal is not None:
        raise InvalidArgumentError(f"optimizer_mode='gpu' (OffloadAdamW's mode='gpu') cannot "
                                   f"run here: {refusal}")
    if mode == "gpu":
        return ("gpu", "AdamW runs on the GPU over the state in trainstreamd's memory "
                "(optimizer_mode='gpu')", {})
    if mode == "auto" and refusal is not None:
        return "cpu", f"optimizer_mode='auto' chose 'cpu': {refusal}", {}
    if mode == "auto":
        return choose_mode(params, moment_dtype, profile_hardware(params[0].device))
    return "cpu", "AdamW runs on trainstreamd's threads (optimizer_mode='cpu')", {}


def choose_mode(params: list, moment_dtype: torch.dtype, profile: dict) -> tuple[str, str,
                                                                                 dict]:
    """("cpu" or "gpu", why, the figures) for mode="auto", from profile_hardware()'s
    ``host_copy_gbps`` and ``gpu`` (``h2d_gbps``, ``d2h_gbps``)."""
    gpu = profile.get("gpu") or {}
    host_bw = float(profile.get("host_copy_gbps") or 0) * 1e9
    link = min(float(gpu.get("h2d_gbps") or 0), float(gpu.get("d2h_gbps") or 0)) * 1e9
    if host_bw <= 0 or link <= 0:
        return "cpu", "the hardware profile has no host or PCIe bandwidth to compare", {}
    moment = torch.finfo(moment_dtype).bits // 8
    numel = sum(p.numel() for p in params)
    weight = sum(p.numel() * p.element_size() for p in params)
    master = sum(4 * p.numel() for p in params if p.dtype != torch.float32)
    copies = sum(p.numel() * p.element_size() for p in params if p.dtype != torch.float32)
    # Host: the gradient down and the weight up (the link, each way); the pass reads and writes
    # the master and both moments, reads the gradient and, for a parameter that is not fp32,
    # writes its copy in the model's dtype (profile's copy rate counts read and write).
    host_s = max(weight / link, (numel * (8 + 4 * moment) + weight + copies) / host_bw)
    gpu_s = (2 * moment * numel + master) / link  # each way, concurrently
    figures = dict(parameters=numel, host_ms=round(1e3 * host_s, 3),
                   gpu_ms=round(1e3 * gpu_s, 3), host_copy_gbps=host_bw / 1e9,
                   link_gbps=link / 1e9)
    said = (f"{numel:,} parameters: the host pass would take ~{1e3 * host_s:.1f} ms a step "
            f"(host memory {host_bw / 1e9:.0f} GB/s), the GPU kernel ~{1e3 * gpu_s:.1f} ms "
            f"(PCIe {link / 1e9:.0f} GB/s each way)")
    if gpu_s < host_s:
        return "gpu", f"optimizer_mode='auto' chose 'gpu': {said}", figures
    return "cpu", f"optimizer_mode='auto' chose 'cpu': {said}", figures
