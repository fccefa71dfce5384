# SPDX-License-Identifier: Apache-2.0
"""The options ``wrap()`` accepts and their checks: a name it does not know, or a value it
cannot take, is an ``InvalidArgumentError`` (a ``TrainStreamError`` and a ``ValueError``)
naming what it accepts, before anything is set up."""

from __future__ import annotations

from .errors import InvalidArgumentError
from .optim.offload_adamw import MOMENT_DTYPES, NONFINITE


# Options wrap() accepts, with the values each takes; naming any other is an error rather than
# silently ignored.
ACCEPTED = {
    "optimizer_mode": ("cpu", "gpu", "auto"),
    "offload": ("auto", True),
    "moment_dtype": ("auto", "float32", "fp32", "bfloat16", "bf16", "torch.float32",
                     "torch.bfloat16"),
    "max_grad_norm": "None or a float > 0",
    "accumulation_steps": "an integer >= 1",
    "threads": "None or an integer >= 1: at most this many of the daemon's AdamW workers run "
               "this job's pass at once (default: all of them, its --threads)",
    "device": "None, 'cpu', 'cuda', 'cuda:N' or a torch.device",
    "distributed": (None, True, False),
    "verbose": (True, False),
    "lr": "a float (used only when optimizer is None)",
    "nonfinite": NONFINITE,
    "job_id": "a job name (ranks and restarted processes with the same one share the state)",
    "socket": "a trainstreamd socket path",
    "vram_headroom": "a float in [0, 1): the share of usable VRAM offload='auto' leaves free",
    "gradient_dtype": (None, "float32", "fp32", "bfloat16", "bf16"),
    "check_memory": (True, False),
    "param_offload": "'auto', True, False, a fraction 0.0-1.0, or a list of block indices",
    "blocks": "None or the list of repeated layer modules (found with find_blocks by default)",
    "prefetch_depth": "an integer >= 1: paged blocks fetched ahead",
    "activation_offload": "'auto', True, False, or a fraction 0.0-1.0 of the blocks",
    "min_offload_bytes": "an integer: smaller saved activations stay on the device",
    "recompute": "'auto', True, False, a fraction 0.0-1.0, or a list of block indices",
    "memory_wait_s": "seconds to wait for host memory other jobs hold (default 0)",
    "vram_budget": "None or bytes: the VRAM the memory plan may use (default: what this process "
                   "may use, less vram_headroom)",
    "max_inflight_bytes": "None or bytes: VRAM held by activations still crossing to host "
                          "memory (default 1 GiB or 10% of the VRAM budget, the smaller)",
    "host_arena": "'auto' (the daemon's buffers, grown on demand), bytes (reserved now, never "
                  "more), or False (private pinned memory, not counted by the daemon)",
    "profile": (True, False),
    "quantize": (None, False, "none", "auto", "int8", "nf4", "fp8", "nvfp4"),
    "prefer": ("exact", "speed"),
    "quant_block_size": "0 (the format's default) or an even number of values per scale",
    "gpu_state_blocks": "'auto', or an integer >= 0: the first N blocks, and the parameters "
                        "outside the stack, keep their AdamW state in VRAM (0: none)",
    "staged_state_blocks": "'auto', or an integer >= 0: that many of the blocks after those "
                           "are updated on the GPU with their moments staged from the "
                           "daemon's memory (0: none)",
    "chunked_loss": (True, False),
    "attention": (None, "auto", "cudnn", "efficient", "flash", "math"),
    "outliers": "0, False, None, 'auto' or True (0.01), or a fraction up to 0.1 of each fp8 "
                "matmul's input channels (its largest) multiplied in bf16 (quantize='fp8')",
    # TrainStream 0.6's options, with its meaning: a forward always waits for the updates of
    # the weights it reads (False, reading weights mid-update, is refused below); the slowdown
    # bounds activation paging only where no VRAM target exists, and wrap() always has one.
    "guard_params": (True,),
    "max_activation_slowdown": "a float >= 0 (wrap() plans against its VRAM budget instead)",
}


def check_options(options: dict) -> None:
    if options.get("guard_params", True) is not True:
        raise InvalidArgumentError(
            "trainstream.wrap: guard_params=False (forwards reading weights while their update "
            "lands) is not offered: each forward waits only for the updates of the weights it "
            "reads, which costs a step nothing measurable; leave it out")
    slowdown = options.get("max_activation_slowdown", 0.15)
    if not (isinstance(slowdown, (int, float)) and not isinstance(slowdown, bool)
            and slowdown >= 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: max_activation_slowdown={slowdown!r} must be a float >= 0")
    for name, value in options.items():
        if name not in ACCEPTED:
            raise InvalidArgumentError(
                f"trainstream.wrap: unknown option {name!r}; accepted: {', '.join(sorted(ACCEPTED))}")
        accepted = ACCEPTED[name]
        if isinstance(accepted, tuple):
            ok = value in accepted or (name in ("moment_dtype", "gradient_dtype")
                                       and value in MOMENT_DTYPES)
            if not ok:
                raise InvalidArgumentError(
                    f"trainstream.wrap: {name}={value!r} is not one of {accepted}")
    steps = options.get("accumulation_steps", 1)
    if not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(
            f"trainstream.wrap: accumulation_steps={steps!r} must be an integer >= 1")
    wait = options.get("memory_wait_s", 0.0)
    if not (isinstance(wait, (int, float)) and 0 <= wait <= 3600):
        raise InvalidArgumentError(
            f"trainstream.wrap: memory_wait_s={wait!r} must be seconds in [0, 3600]")
    headroom = options.get("vram_headroom", 0.10)
    if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
        raise InvalidArgumentError(
            f"trainstream.wrap: vram_headroom={headroom!r} must be a float in [0, 1)")
    for name in ("max_inflight_bytes", "host_arena"):
        value = options.get(name)
        if value is None or value is False or (name == "host_arena" and value == "auto"):
            continue
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise InvalidArgumentError(
                f"trainstream.wrap: {name}={value!r} must be " +
                ("None or bytes > 0" if name == "max_inflight_bytes" else
                 "'auto', False or bytes > 0"))
    block = options.get("quant_block_size", 0)
    if not (isinstance(block, int) and not isinstance(block, bool) and block >= 0
            and block % 2 == 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: quant_block_size={block!r} must be 0 or an even "
            "number of values")
    for option in ("gpu_state_blocks", "staged_state_blocks"):
        count = options.get(option, 0)
        if not (count == "auto" or (isinstance(count, int) and not isinstance(count, bool)
                                    and count >= 0)):
            raise InvalidArgumentError(
                f"trainstream.wrap: {option}={count!r} must be 'auto' or an "
                "integer >= 0")
    budget = options.get("vram_budget")
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool)
                                   and budget > 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: vram_budget={budget!r} must be None or bytes > 0")
    norm = options.get("max_grad_norm")
    if norm is not None and not (isinstance(norm, (int, float)) and norm > 0):
        raise InvalidArgumentError(
            f"trainstream.wrap: max_grad_norm={norm!r} must be None or a float > 0")

