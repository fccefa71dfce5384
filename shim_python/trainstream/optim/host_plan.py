# SPDX-License-Identifier: Apache-2.0
"""The job's host memory, planned with the daemon before anything is allocated: what the
optimizer's state and the streamed frozen weights will take (counted by the daemon with the code
that allocates them), said per trained parameter, kept or refused now with the numbers instead
of mid-run; bf16 moments when fp32 ones do not fit and ``moment_dtype="auto"``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import ResourceExhaustedError
from ..options import OptimizerOptions, WrapOptions


def job_host_bytes(client: Any, model: torch.nn.Module, moment: Any,
                   optimizer: OptimizerOptions, ranks: int, machines: int,
                   other_buffers: Sequence[int] = ()) -> int:
    """The host memory the daemon will hold for this job, as the daemon counts it with the code
    that allocates it: the optimizer's state for each trainable tensor (master, moments, a
    model-dtype copy, a gradient slot per rank, a summing buffer), plus ``other_buffers`` (the
    frozen weights streamed from host memory), each placed into segments as the arena will."""
    from ..transport.host_optimizer import ParameterSpec, estimate_host_memory
    from .offload_adamw import GRADIENT_DTYPES, MOMENT_DTYPES

    grad_dtype = GRADIENT_DTYPES.get(optimizer.gradient_dtype) if optimizer.gradient_dtype else None
    cuda = next(model.parameters()).is_cuda
    trainable = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    specs = [ParameterSpec(f"p{i}", tuple(p.shape), p.dtype, grad_dtype or p.dtype)
             for i, p in enumerate(trainable)]
    # CUDA gradients are summed over micro-steps in the daemon (OffloadAdamW's choice).
    accumulation = optimizer.accumulation_steps if cuda else 1
    return estimate_host_memory(client, specs, MOMENT_DTYPES[moment], accumulation, machines,
                                ranks, other_buffers).bytes


def per_trained_parameter(planned: int, model: torch.nn.Module, frozen: Sequence[int]) -> str:
    """``planned`` host bytes said per trained parameter (the frozen weights that stream, which
    are not per trained parameter, said apart)."""
    trained = sum(p.numel() for p in {id(p): p for p in model.parameters()
                                      if p.requires_grad}.values())
    streamed = sum(frozen)
    line = f"{(planned - streamed) / max(trained, 1):.1f} bytes per trained parameter"
    line += f" for {trained / 1e9:.2f}B of them" if trained >= 1e8 else f" for {trained} of them"
    if streamed:
        line += f", and {streamed / 2**30:.2f} GiB of frozen weights that stream"
    return line


@dataclass
class Admission:
    planned: int          # host bytes the daemon keeps for the job
    moment: str           # the moments' dtype the plan is for
    chose_bf16: str = ""  # why moment_dtype="auto" chose bf16 moments, if it did


def admit(client: Any, model: torch.nn.Module, moment: str, config: WrapOptions, ranks: int,
          machines: int, frozen: Sequence[int], job_id: str, events: list) -> Admission:
    """Plans the job's host memory with the daemon (waiting up to ``memory_wait_s``): fp32 or
    bf16 moments as ``moment`` says, or bf16 when fp32 ones are refused under
    ``moment_dtype="auto"``. Refused: ResourceExhaustedError with the bytes, the bytes per
    trained parameter and the options that would take less. Appends its events."""
    wait_s = float(config.memory.memory_wait_s)

    def bytes_for(dtype: str) -> int:
        return job_host_bytes(client, model, dtype, config.optimizer, ranks, machines, frozen)

    planned = bytes_for(moment)
    chose_bf16 = ""
    try:
        try:
            client.plan_host_memory(planned, wait_s=wait_s)
        except ResourceExhaustedError as e:
            if config.optimizer.moment_dtype != "auto":
                raise
            # bf16 moments (stochastically rounded) when fp32 ones do not fit; the master
            # weights stay fp32.
            fp32_bytes, planned, moment = planned, bytes_for("bfloat16"), "bfloat16"
            client.plan_host_memory(planned, wait_s=wait_s)
            chose_bf16 = (f"with fp32 moments this run needs {fp32_bytes / 2**30:.2f} GiB of "
                          f"host memory and the daemon refused ({e})")
            events.append(("wrap.plan", f"moments in bf16: {chose_bf16}"))
    except ResourceExhaustedError as e:
        smaller = ""
        if moment != "bfloat16":
            bf16 = bytes_for("bfloat16")
            smaller = (f"moment_dtype='bfloat16' ({bf16 / 2**30:.2f} GiB, "
                       f"{per_trained_parameter(bf16, model, frozen)}), ")
        raise ResourceExhaustedError(
            f"trainstream.wrap: this run needs {planned / 2**30:.2f} GiB of host memory in "
            f"trainstreamd ({moment} moments; {per_trained_parameter(planned, model, frozen)}) "
            f"and the machine cannot give it: {e}. Options: {smaller}memory_wait_s= to wait "
            "for other jobs, LoRA adapters instead of a full fine-tune, or check_memory=False "
            "to allocate as it goes") from None
    events.append(("wrap.admitted", f"host memory planned: {planned / 2**30:.2f} GiB for job "
                                    f"{job_id} ({moment} moments; "
                                    f"{per_trained_parameter(planned, model, frozen)})"))
    return Admission(planned, moment, chose_bf16)
