# SPDX-License-Identifier: Apache-2.0
"""The options ``wrap()`` and ``load_model()`` accept, and their checks.

``wrap()``'s options are typed, frozen definitions by concern (the optimizer, the memory plan,
quantization, the connection, and TrainStream 0.6's that mean nothing more here): each field
holds its default and the values it takes, which the checks, ``wrap()`` (through
:class:`WrapOptions`) and the documentation's table all read. A name they do not know, or a
value they cannot take, is an ``InvalidArgumentError`` (a ``TrainStreamError`` and a
``ValueError``) whose message names the option, the value given and what is allowed, before
anything is set up."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .errors import InvalidArgumentError
from .optim.offload_adamw import MOMENT_DTYPES, NONFINITE


def _option(default: Any, accepts: Any) -> Any:
    """A field of an options class: its default, and the values it takes (a tuple of them, or
    their description), which the checks below and the documentation's table read."""
    return field(default=default, metadata={"accepts": accepts})


@dataclass(frozen=True)
class OptimizerOptions:
    """The host optimizer's: where AdamW runs, its state's dtype, clipping, accumulation, and
    what it does with non-finite gradients."""

    optimizer_mode: str = _option("cpu", ("cpu", "gpu", "auto"))
    offload: Any = _option("auto", ("auto", True))
    moment_dtype: Any = _option("auto", ("auto", "float32", "fp32", "bfloat16", "bf16",
                                         "torch.float32", "torch.bfloat16"))
    max_grad_norm: Any = _option(None, "None or a float > 0")
    accumulation_steps: int = _option(1, "an integer >= 1")
    threads: Any = _option(None, "None or an integer >= 1: at most this many of the daemon's "
                                 "AdamW workers run this job's pass at once (default: all of "
                                 "them, its --threads)")
    eager: Any = _option(None, (None, True, False))
    lr: float = _option(1e-3, "a float (used only when optimizer is None)")
    nonfinite: str = _option("guard", NONFINITE)
    gradient_dtype: Any = _option(None, (None, "float32", "fp32", "bfloat16", "bf16"))


@dataclass(frozen=True)
class MemoryOptions:
    """The memory plan's: the VRAM budget, which blocks stream their weights, page or recompute
    their activations, where optimizer state lives, and the host memory the job plans."""

    vram_headroom: float = _option(0.10, "a float in [0, 1): the share of usable VRAM "
                                         "offload='auto' leaves free")
    check_memory: bool = _option(True, (True, False))
    memory_wait_s: float = _option(0.0, "seconds to wait for host memory other jobs hold "
                                         "(default 0)")
    param_offload: Any = _option("auto", "'auto', True, False, a fraction 0.0-1.0, or a list "
                                         "of block indices")
    blocks: Any = _option(None, "None or the list of repeated layer modules (found with "
                                "find_blocks by default)")
    prefetch_depth: int = _option(1, "an integer >= 1: paged blocks fetched ahead")
    activation_offload: Any = _option("auto", "'auto', True, False, or a fraction 0.0-1.0 of "
                                              "the blocks")
    min_offload_bytes: int = _option(1 << 20, "an integer >= 0: smaller saved activations "
                                              "stay on the device")
    recompute: Any = _option("auto", "'auto', True, False, a fraction 0.0-1.0, or a list of "
                                     "block indices")
    vram_budget: Any = _option(None, "None or bytes: the VRAM the memory plan may use "
                                     "(default: what this process may use, less "
                                     "vram_headroom)")
    max_inflight_bytes: Any = _option(None, "None or bytes: VRAM held by activations still "
                                            "crossing to host memory (default 1 GiB or 10% of "
                                            "the VRAM budget, the smaller)")
    host_arena: Any = _option("auto", "'auto' (the daemon's buffers, grown on demand), bytes "
                                      "(reserved now, never more), or False (private pinned "
                                      "memory, not counted by the daemon)")
    profile: bool = _option(True, (True, False))
    gpu_state_blocks: Any = _option("auto", "'auto', or an integer >= 0: the first N blocks, "
                                            "and the parameters outside the stack, keep their "
                                            "AdamW state in VRAM (0: none)")
    staged_state_blocks: Any = _option("auto", "'auto', or an integer >= 0: that many of the "
                                               "blocks after those are updated on the GPU "
                                               "with their moments staged from the daemon's "
                                               "memory (0: none)")
    chunked_loss: bool = _option(True, (True, False))
    attention: Any = _option(None, (None, "auto", "cudnn", "efficient", "flash", "math"))


@dataclass(frozen=True)
class QuantizationOptions:
    """How the frozen linear weights of the block stack are stored."""

    quantize: Any = _option(None, (None, False, "none", "auto", "int8", "nf4", "fp8", "nvfp4"))
    prefer: str = _option("exact", ("exact", "speed"))
    quant_block_size: int = _option(0, "0 (the format's default) or an even number of values "
                                       "per scale")
    outliers: Any = _option(0, "0, False, None, 'auto' or True (0.01), or a fraction up to 0.1 "
                               "of each fp8 matmul's input channels (its largest) multiplied "
                               "in bf16 (quantize='fp8')")


@dataclass(frozen=True)
class ConnectionOptions:
    """Where the model runs and which daemon, job and ranks it trains with."""

    device: Any = _option(None, "None, 'cpu', 'cuda', 'cuda:N' or a torch.device")
    distributed: Any = _option(None, (None, True, False))
    verbose: bool = _option(False, (True, False))
    job_id: str = _option("", "a job name (ranks and restarted processes with the same one "
                              "share the state)")
    socket: Any = _option(None, "a trainstreamd socket path")


@dataclass(frozen=True)
class CompatibilityOptions:
    """TrainStream 0.6's options that mean nothing more here, taken so that its calls run."""

    # A forward always waits for the updates of the weights it reads (False, reading weights
    # mid-update, is refused below).
    guard_params: bool = _option(True, (True,))
    # The slowdown bounds activation paging only where no VRAM target exists, and wrap()
    # always has one.
    max_activation_slowdown: float = _option(0.15, "a float >= 0 (wrap() plans against its "
                                                   "VRAM budget instead)")
    # Pooling the frozen blocks every rank streams in the GPUs' VRAM: not offered here, and
    # meaningless on one GPU; taken so that a 0.6 call runs, with an event saying it is off.
    peer: Any = _option(None, "'auto', False, None or bytes >= 0 (TrainStream 0.6's peer-GPU "
                              "pooling; off here, an event says why)")


CONCERNS = (OptimizerOptions, MemoryOptions, QuantizationOptions, ConnectionOptions,
            CompatibilityOptions)

# Every option wrap() accepts, with the values each takes; naming any other is an error rather
# than silently ignored.
ACCEPTED = {f.name: f.metadata["accepts"] for concern in CONCERNS for f in fields(concern)}


@dataclass(frozen=True)
class WrapOptions:
    """``wrap()``'s options, checked, by concern; each the caller's value or its default."""

    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    quantization: QuantizationOptions = field(default_factory=QuantizationOptions)
    connection: ConnectionOptions = field(default_factory=ConnectionOptions)
    compatibility: CompatibilityOptions = field(default_factory=CompatibilityOptions)

    @classmethod
    def from_call(cls, options: dict, model: Any = None) -> "WrapOptions":
        """The options of a ``wrap(model, **options)`` call, checked (see
        :func:`check_options`)."""
        check_options(options, _NO_MODEL if model is None else model)
        parts = [concern(**{f.name: options[f.name] for f in fields(concern)
                            if f.name in options}) for concern in CONCERNS]
        return cls(*parts)

    def as_dict(self) -> dict:
        """Every option by name (``memory_report()["config"]``)."""
        return {f.name: getattr(part, f.name)
                for part in (self.optimizer, self.memory, self.quantization, self.connection,
                             self.compatibility)
                for f in fields(part)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(where: str, name: str, value: Any, allowed: str) -> InvalidArgumentError:
    """The error for ``name=value``: the option, the value given, and what it takes."""
    return InvalidArgumentError(f"{where}: {name}={value!r} must be {allowed}")


def check_model(model: Any) -> None:
    """``wrap()``'s model: a ``torch.nn.Module`` with parameters to train."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            f"trainstream.wrap: model={model!r} (a {type(model).__name__}) must be a "
            "torch.nn.Module: the model to train")
    if next(model.parameters(), None) is None:
        raise InvalidArgumentError(
            f"trainstream.wrap: model={type(model).__name__} has no parameters; it must be a "
            "torch.nn.Module with parameters to train")


def check_device(where: str, device: Any) -> None:
    """``device``: None, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` of those,
    and a CUDA one only where torch finds that GPU."""
    if device is None:
        return
    allowed = "None, 'cpu', 'cuda', 'cuda:N' or a torch.device of those"
    target = None
    if isinstance(device, (str, torch.device)):
        try:
            target = torch.device(device)
        except (RuntimeError, ValueError):
            target = None
    if target is None or target.type not in ("cpu", "cuda"):
        raise _refuse(where, "device", device, allowed)
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise _refuse(where, "device", device,
                          "None or 'cpu' on this machine: torch finds no CUDA GPU here "
                          "(torch.cuda.is_available() is False)")
        if target.index is not None and target.index >= count:
            raise _refuse(where, "device", device,
                          f"None, 'cpu', 'cuda' or 'cuda:0' to 'cuda:{count - 1}': torch "
                          f"finds {count} CUDA GPU{'s' if count > 1 else ''} here")


def _check_blocks(blocks: Any, model: Any) -> None:
    """``blocks``: None, or a list of the model's own modules (its repeated layers)."""
    if blocks is None:
        return
    allowed = ("None or a list of the model's own repeated layer modules "
               "(trainstream.find_blocks(model) finds them)")
    if isinstance(blocks, (str, bytes, dict)) or (
            isinstance(blocks, torch.nn.Module) and not isinstance(
                blocks, (torch.nn.ModuleList, torch.nn.Sequential))):
        raise _refuse("trainstream.wrap", "blocks", blocks, allowed)
    try:
        listed = list(blocks)
    except TypeError:
        raise _refuse("trainstream.wrap", "blocks", blocks, allowed) from None
    model_given = isinstance(model, torch.nn.Module)
    mine = {id(m) for m in model.modules()} if model_given else set()
    params = {id(p) for p in model.parameters()} if model_given else set()

    def of_the_model(block: torch.nn.Module) -> bool:
        # One of its modules, or a container of its parts (which block_memory refuses with
        # its own reason: a list of parts is not called).
        held = [id(p) for p in block.parameters()]
        return id(block) in mine or (bool(held) and all(i in params for i in held))

    for i, block in enumerate(listed):
        if not isinstance(block, torch.nn.Module):
            raise InvalidArgumentError(
                f"trainstream.wrap: blocks[{i}]={block!r} is a {type(block).__name__}; blocks "
                f"must be {allowed}")
        if model_given and not of_the_model(block):
            raise InvalidArgumentError(
                f"trainstream.wrap: blocks[{i}] (a {type(block).__name__}) is not a module "
                f"of the model passed to wrap(); blocks must be {allowed}")


def _check_paging(options: dict) -> None:
    """prefetch_depth, and the kinds of value param_offload, activation_offload and recompute
    take (which blocks a list names is checked against the block stack, in block_memory)."""
    depth = options.get("prefetch_depth", 1)
    if not _is_int(depth) or depth < 1:
        raise _refuse("trainstream.wrap", "prefetch_depth", depth, ">= 1 (an integer: blocks "
                      "fetched ahead)")
    for name in ("param_offload", "activation_offload", "recompute"):
        if name not in options:
            continue
        value = options[name]
        lists = "" if name == "activation_offload" else " or a list of block indices"
        allowed = f"'auto', True, False, a fraction 0.0-1.0{lists}"
        if value is None or value is True or value is False or (
                isinstance(value, str) and value == "auto"):
            continue
        if isinstance(value, float):
            if not 0.0 <= value <= 1.0:
                raise _refuse("trainstream.wrap", name, value, f"in [0, 1] ({allowed})")
            continue
        if lists and isinstance(value, (list, tuple)):
            continue
        raise InvalidArgumentError(
            f"trainstream.wrap: {name}={value!r} is not one of {allowed}")


def _check_values(options: dict) -> None:
    """The options whose values were taken unchecked before: each named with what it takes."""
    lr = options.get("lr", 1e-3)
    if not _is_number(lr) or lr < 0:
        raise _refuse("trainstream.wrap", "lr", lr, "a float >= 0 (the learning rate, used "
                      "when optimizer is None)")
    threads = options.get("threads")
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise _refuse("trainstream.wrap", "threads", threads,
                      "None or an integer >= 1 (the daemon's AdamW workers this job's pass "
                      "may use; None: all of them)")
    least = options.get("min_offload_bytes", 1 << 20)
    if not _is_int(least) or least < 0:
        raise _refuse("trainstream.wrap", "min_offload_bytes", least,
                      "an integer >= 0 (bytes: smaller saved activations stay on the device)")
    peer = options.get("peer")
    if not (peer is None or peer is False or (isinstance(peer, str) and peer == "auto")
            or (_is_int(peer) and peer >= 0)):
        raise _refuse("trainstream.wrap", "peer", peer, "'auto', False, None or bytes >= 0")
    check_device("trainstream.wrap", options.get("device"))


_NO_MODEL = object()


def check_options(options: dict, model: Any = _NO_MODEL) -> None:
    """Checks ``wrap()``'s ``options`` (and ``model``, when given: a module with parameters,
    of which ``blocks`` must name modules); raises ``InvalidArgumentError`` naming the option,
    the value given and what it takes."""
    if model is not _NO_MODEL:
        check_model(model)
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
                f"trainstream.wrap: unknown option {name!r}; accepted: "
                f"{', '.join(sorted(ACCEPTED))}")
        accepted = ACCEPTED[name]
        if isinstance(accepted, tuple):
            ok = value in accepted or (name in ("moment_dtype", "gradient_dtype")
                                       and value in MOMENT_DTYPES)
            if not ok:
                raise InvalidArgumentError(
                    f"trainstream.wrap: {name}={value!r} is not one of {accepted}")
    _check_values(options)
    _check_paging(options)
    _check_blocks(options.get("blocks"), None if model is _NO_MODEL else model)
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


# load_model(): the formats it stores a base in, the dtypes it builds the model in, and the
# config fields that count or size something (an override of one must be a positive integer;
# None, where a config takes it, means "derived from the others").
LOAD_MODEL_QUANTIZE = ("auto", None, False, "none", "bf16", "int8", "nf4", "fp8", "nvfp4")
LOAD_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CONFIG_SIZES = {"num_hidden_layers": False, "hidden_size": False, "intermediate_size": False,
                 "num_attention_heads": False, "vocab_size": False,
                 "max_position_embeddings": False, "num_key_value_heads": True,
                 "head_dim": True}


def check_load_model(quantize: Any, dtype: Any, ram_fraction: Any, quant_block_size: Any,
                     config_overrides: dict) -> None:
    """Checks ``load_model()``'s arguments (those a config of its own does not decide);
    raises ``InvalidArgumentError`` naming the argument, the value given and what it takes."""
    where = "load_model"
    if not any(quantize is q or (isinstance(quantize, str) and quantize == q)
               for q in LOAD_MODEL_QUANTIZE):
        raise _refuse(where, "quantize", quantize, "one of 'auto', None, 'none', False, "
                      "'int8', 'nf4', 'fp8', 'nvfp4'")
    if not any(dtype is d for d in LOAD_MODEL_DTYPES):
        raise _refuse(where, "dtype", dtype,
                      "torch.bfloat16, torch.float16 or torch.float32 (the frozen weights' "
                      "compute dtype)")
    if not (_is_number(ram_fraction) and 0 < ram_fraction <= 1):
        raise _refuse(where, "ram_fraction", ram_fraction, "a float in (0, 1]")
    if not (_is_int(quant_block_size) and quant_block_size >= 0
            and quant_block_size % 2 == 0):
        raise _refuse(where, "quant_block_size", quant_block_size,
                      "an even integer >= 2 (values per scale), or 0 for the format's own")
    for name, value in config_overrides.items():
        if name not in _CONFIG_SIZES or (value is None and _CONFIG_SIZES[name]):
            continue
        if not (_is_int(value) and value >= 1):
            raise _refuse(where, name, value, "an integer >= 1" +
                          (" or None" if _CONFIG_SIZES[name] else "") +
                          " (a config field that counts or sizes the model's parts)")
