# SPDX-License-Identifier: Apache-2.0
"""Where this process sits among a launcher's ranks (torchrun, Slurm's srun): its rank on this
machine, the ranks on this machine, and the name their job takes in this machine's daemon."""

from __future__ import annotations

import os
from typing import Any

from ..errors import FailedPreconditionError


def _leading_int(text: str) -> int | None:
    digits = ""
    for c in text.strip():
        if not c.isdigit():
            break
        digits += c
    return int(digits) if digits else None


def launcher_topology(environ: Any, rank: int, world: int) -> tuple:
    """(rank on this machine, ranks on this machine, the job's name) from the launcher's
    variables: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE / TORCHELASTIC_RUN_ID, else Slurm's
    SLURM_LOCALID / SLURM_NTASKS_PER_NODE ("4", or "4(x2)" for 4 on each of 2 nodes) /
    SLURM_JOB_ID and SLURM_STEP_ID; without either, every rank on this machine. Ranks of one
    machine form one job in its daemon, under that name."""
    if "LOCAL_WORLD_SIZE" in environ or "TORCHELASTIC_RUN_ID" in environ:
        run = environ.get("TORCHELASTIC_RUN_ID") or (
            f"{environ.get('MASTER_ADDR', 'local')}-{environ.get('MASTER_PORT', '0')}")
        return (int(environ.get("LOCAL_RANK", rank)),
                int(environ.get("LOCAL_WORLD_SIZE", world)), f"torchrun-{run}")
    per_node = _leading_int(environ.get("SLURM_NTASKS_PER_NODE", ""))
    if per_node and "SLURM_JOB_ID" in environ:
        return (int(environ.get("SLURM_LOCALID", rank % per_node)), per_node,
                f"slurm-{environ['SLURM_JOB_ID']}.{environ.get('SLURM_STEP_ID', '0')}")
    run = f"{environ.get('MASTER_ADDR', 'local')}-{environ.get('MASTER_PORT', '0')}"
    return int(environ.get("LOCAL_RANK", rank)), world, f"torchrun-{run}"


def this_machines_ranks(job_id: str) -> tuple:
    """(rank, world size, job) of ``distributed=True``: this machine's ranks of the initialised
    torch.distributed group, as the launcher placed them, one job in this machine's daemon."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise FailedPreconditionError(
            "OffloadAdamW(distributed=True) needs an initialised torch.distributed process group")
    world = dist.get_world_size()
    if os.environ.get("TRAINSTREAM_SHM") == "0":
        raise FailedPreconditionError(
            "OffloadAdamW(distributed=True) shares one state among this machine's ranks, and "
            "TRAINSTREAM_SHM=0 asks for a copy per rank: trainstream.wrap() keeps one per rank "
            "and all-reduces the gradients between them")
    local_rank, local_world, run = launcher_topology(os.environ, dist.get_rank(), world)
    if local_world != world:
        raise FailedPreconditionError(
            f"OffloadAdamW(distributed=True) takes one machine's ranks ({local_world} here of "
            f"{world}); across machines, trainstream.wrap() reduces between them")
    return local_rank, local_world, job_id or run
