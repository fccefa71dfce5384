# SPDX-License-Identifier: Apache-2.0
"""Module paths from before the package had layers, kept for code that imports them: each old
path is the same module object as its new home (assignments to a module's globals, such as a
test's monkeypatch, reach the code that reads them)."""

from __future__ import annotations

import importlib
import sys

# old path -> new path, under trainstream.
MOVED = {
    "_embedded": "transport.embedded", "client": "transport.client",
    "host_optimizer": "transport.host_optimizer", "cuda_streams": "transport.device",
    "bases": "frozen.store", "gpu_pools": "frozen.gpu_pool", "base_linear": "frozen.linear",
    "fp8_matmul": "frozen.fp8_matmul",
    "offload_adamw": "optim.offload_adamw", "staged_adamw": "optim.staged_adamw",
    "nonfinite_guard": "optim.nonfinite_guard",
    "blocks": "memory.blocks", "hardware": "transport.hardware", "planner": "memory.planner",
    "kv_cache": "memory.kv_cache", "recompute": "memory.recompute",
    "activation_arena": "memory.activation_arena", "allocator_split": "memory.allocator_split",
    "paging": "memory.pager", "adaptive_plan": "memory.adaptive",
    "block_memory": "memory.block_memory", "quantize_choice": "memory.quantization",
    "chunked_loss": "integrations.chunked_loss", "huggingface": "integrations.huggingface",
    "weak_hooks": "hooks", "hook_clock": "hooks",
}
# Old module names that are also public functions of the package: the attribute stays the
# function; only the import path is kept.
_FUNCTIONS = {"bases", "gpu_pools"}


def install(package: object) -> None:
    """Registers every old path, and binds it on ``package`` unless a function has the name."""
    for old, new in MOVED.items():
        module = importlib.import_module(f"{package.__name__}.{new}")
        sys.modules[f"{package.__name__}.{old}"] = module
        if old not in _FUNCTIONS:
            setattr(package, old, module)
