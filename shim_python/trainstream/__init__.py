# SPDX-License-Identifier: Apache-2.0
"""trainstream: train models larger than GPU memory through a per-machine daemon.

``trainstream.connect()`` opens a session with ``trainstreamd`` (starting a private one when
none answers); buffers in the daemon's shared memory appear as torch tensors with no copy.
"""

# torch before the native module: with the native module's libraries (gRPC, Abseil, protobuf)
# loaded first, importing torch 2.11 aborts in free() on Ubuntu 24.04; torch first works.
import torch  # noqa: F401  (import order only)

from .transport.client import VERSION as __version__, Buffer, Client, Notice, connect
from .transport.device import cuda_available
from .transport.host_optimizer import HostOptimizer, ParameterSpec
from .frozen.store import SharedBase, bases, load_base
from .frozen.gpu_pool import GpuBase, gpu_pools
from .frozen.linear import BaseLinear, attach_base
from .memory.quantization import quantize_model
from .integrations.huggingface import load_model, wrap_hf
from .integrations.losses import (causal_lm_loss, chunked_cross_entropy, dpo_loss,
                                  sequence_logprobs)
from .memory.activation_offloader import ActivationOffloader
from .memory.blocks import find_blocks
from .memory.paged_kv_cache import PagedKVCache
from .transport.hardware import HardwareProfile, profile_hardware
from .optim.offload_adamw import OffloadAdamW
from .memory.planner import BlockFacts, MemoryPlan, MemoryPlanError, PlanInputs, plan_memory
from .report import memory_report
from .inspection import pinned_stats, reserve_pinned, transfer_stats
from .session import TrainStreamSession
from .wrap import unwrap, wrap
from .errors import (
    AlreadyExistsError,
    DaemonUnavailableError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TrainStreamError,
)


__all__ = [
    "__version__",
    "AlreadyExistsError", "Buffer", "Client", "DaemonUnavailableError", "DeadlineExceededError",
    "FailedPreconditionError", "HostOptimizer", "InternalError", "OffloadAdamW", "ParameterSpec",
    "TrainStreamSession", "memory_report", "unwrap", "wrap", "InvalidArgumentError", "Notice",
    "NotFoundError",
    "PermissionDeniedError", "ResourceExhaustedError", "TrainStreamError", "connect",
    "cuda_available", "find_blocks", "BlockFacts", "MemoryPlan", "MemoryPlanError",
    "PlanInputs", "plan_memory", "HardwareProfile", "profile_hardware", "SharedBase", "bases",
    "load_base",
    "BaseLinear", "attach_base", "quantize_model", "load_model", "wrap_hf", "PagedKVCache",
    "GpuBase", "gpu_pools", "pinned_stats", "reserve_pinned", "transfer_stats",
    "ActivationOffloader",
    "causal_lm_loss", "chunked_cross_entropy", "dpo_loss", "sequence_logprobs",
]

# Imported on first use: they need transformers, which importing trainstream does not.
_HUGGING_FACE = ("TrainStreamCache", "TrainStreamCallback", "TrainStreamTrainer")


def __getattr__(name: str):
    if name in _HUGGING_FACE:
        from .integrations import huggingface

        return getattr(huggingface, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
