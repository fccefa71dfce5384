# SPDX-License-Identifier: Apache-2.0
"""Which frozen linear weights are stored quantized, and in what format.

``quantize_model()`` (TrainStream 0.6's signature) quantizes the frozen linear layers of the
block stack in this process; a frozen output head and the embeddings stay as they are, as in
0.6 (a model without a stack: every frozen linear layer but its output head).
``quantizable_layers()`` names them, for it and for the choice below.

``wrap(quantize="auto")``: whether those weights are stored quantized, decided before the memory
plan from their sizes, the VRAM budget and the host memory the daemon has free.

Candidates, in order: the weights as they are, int8, NF4. Under each, blocks may stream their
weights from host memory (quantized ones in their stored format: a quarter of bf16's bytes over
the link for NF4), whose frozen copies the daemon must have room for. ``prefer="exact"`` (the
default) takes the first the run fits with. ``prefer="speed"`` takes the first that keeps every
block in VRAM, and when none does, the one that streams the fewest bytes a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..errors import InvalidArgumentError
from ..frozen.fp8_matmul import outlier_fraction
from ..frozen.linear import BaseLinear, quantize_layers
from .blocks import find_blocks, stored_buffers, weight_bytes
from .weight_plan import weight_plan_for_sizes
from .planner import MemoryPlanError, size

CANDIDATES = (None, "int8", "nf4")
_DEFAULT_BLOCK = {"int8": 64, "nf4": 64}


def stored_bytes(numel: int, element_size: int, fmt: str | None, block: int = 0) -> int:
    """Bytes of a frozen weight of ``numel`` values stored as ``fmt`` (None: as it is)."""
    if fmt is None:
        return numel * element_size
    block = block or _DEFAULT_BLOCK[fmt]
    data = numel if fmt == "int8" else (numel + 1) // 2
    return data + 4 * ((numel + block - 1) // block)


@dataclass
class Candidate:
    fmt: str | None
    weight_bytes: int        # every weight of the model, frozen linear ones as stored
    streamed: int | None     # blocks whose weights stream; None: no plan fits the VRAM budget
    host_bytes: int          # host copies of frozen weights the streamed blocks need
    fits_host: bool
    streamed_bytes: int = 0  # the streamed blocks' weights, as stored: fetched every step

    @property
    def name(self) -> str:
        return self.fmt or "as they are"

    @property
    def in_vram(self) -> bool:
        return self.streamed == 0 and self.fits_host

    @property
    def runs(self) -> bool:
        return self.streamed is not None and self.fits_host


FORMATS = ("int8", "nf4", "fp8", "nvfp4")


def _output_head(model: nn.Module) -> Any:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def quantizable_layers(model: nn.Module, blocks: Any = None) -> list:
    """The names (as ``model.named_modules()`` gives them) of the frozen ``nn.Linear`` layers
    :func:`quantize_model` quantizes: those inside ``blocks`` (default: the stack
    :func:`trainstream.find_blocks` finds); for a model without a stack, every frozen one but
    its output head (``get_output_embeddings()``). A ``BaseLinear`` is stored as its base keeps
    it already, and is not named."""
    stack = list(blocks) if blocks is not None else find_blocks(model)
    if stack:
        inside = {id(m) for block in stack for m in block.modules()}
    else:
        head = _output_head(model)
        inside = {id(m) for m in model.modules() if m is not head}
    return [name for name, m in model.named_modules()
            if id(m) in inside and isinstance(m, nn.Linear) and not isinstance(m, BaseLinear)
            and not m.weight.requires_grad]


def quantize_model(model: nn.Module, quantize: str = "nf4", *, blocks: Any = None,
                   block_size: int = 64, pin_budget: int | None = None,
                   fp8_matmul: Any = "auto", outliers: Any = 0,
                   block: int | None = None, format: str | None = None) -> dict:
    """Quantizes the frozen linear weights of ``model``'s block stack in place, in this process
    (the daemon's reference quantizer, every core), into :class:`trainstream.BaseLinear` layers
    on their device, before ``wrap()``; TrainStream 0.6's signature and defaults.

    ``quantize``: ``"int8"``, ``"nf4"`` (the default), ``"fp8"`` or ``"nvfp4"``. ``blocks``:
    the layer stack (default: :func:`trainstream.find_blocks`'); a frozen output head and the
    embeddings stay as they are; a model without a stack has every frozen linear layer but its
    output head quantized. Trainable layers stay as they are. ``block_size``: values per scale
    for int8 and NF4, an even number >= 2, or 0 for the format's own (64); FP8 and NVFP4 use
    their fixed 32 and 16. ``block`` and ``format`` are ``block_size``'s and ``quantize``'s names
    before 0.6 (0.4's list of names is ``result["layers"]`` now). ``pin_budget`` (None or bytes) is
    checked and has no effect: the quantized bytes are ordinary tensors on the weights' device,
    and the page-locked host copies of blocks that stream are the daemon's, within its budget.
    ``fp8_matmul`` and ``outliers``: see :class:`trainstream.BaseLinear`.

    Returns ``{"tensors": count, "bytes_before": ..., "bytes_after": ..., "layers": [names]}``:
    the weights quantized, their bytes before and as stored (scales included), and their
    names. For one host copy shared by several processes, load the checkpoint with
    :func:`trainstream.load_base` and :func:`trainstream.attach_base` instead."""
    if format is not None:
        if quantize not in ("nf4", format):
            raise InvalidArgumentError(
                f"quantize_model: format={format!r} and quantize={quantize!r}: format is "
                "quantize's name before 0.6; give one of them")
        quantize = format
    if quantize not in FORMATS:
        raise InvalidArgumentError(
            f"quantize_model: quantize={quantize!r} must be one of {', '.join(map(repr, FORMATS))}")
    if block is not None:
        if block_size not in (64, block):
            raise InvalidArgumentError(
                f"quantize_model: block={block!r} and block_size={block_size!r}: block is "
                "block_size's name before 0.6; give one of them")
        block_size = block
    if not (isinstance(block_size, int) and not isinstance(block_size, bool)
            and block_size >= 0 and block_size % 2 == 0):
        raise InvalidArgumentError(
            f"quantize_model: block_size={block_size!r} must be an even integer >= 2 (values "
            "per scale), or 0 for the format's own")
    if pin_budget is not None and not (isinstance(pin_budget, int)
                                       and not isinstance(pin_budget, bool) and pin_budget >= 0):
        raise InvalidArgumentError(
            f"quantize_model: pin_budget={pin_budget!r} must be None or bytes >= 0")
    if outlier_fraction(outliers) and quantize != "fp8":
        raise InvalidArgumentError(
            f"quantize_model: outliers={outliers!r} splits FP8 tensor-core matmuls; {quantize} "
            "weights quantize no input here (use quantize='fp8', or outliers=0)")
    if blocks is not None and not all(isinstance(b, nn.Module) for b in blocks):
        raise InvalidArgumentError(
            f"quantize_model: blocks={blocks!r} must be None or a list of the model's layer "
            "modules")
    names = quantizable_layers(model, blocks)
    # FP8 and NVFP4 scale fixed blocks of their own (32 and 16 values).
    done = quantize_layers(model, names, quantize, block_size if quantize in ("int8", "nf4")
                           else 0, fp8_matmul=fp8_matmul, outliers=outliers)
    return {"tensors": len(done["layers"]), "bytes_before": done["bytes_before"],
            "bytes_after": done["bytes_after"], "layers": done["layers"]}


def _frozen_linear(model: nn.Module, blocks: Any = None) -> list:
    """The weights :func:`quantize_model` would quantize."""
    names = set(quantizable_layers(model, blocks))
    return [m.weight for name, m in model.named_modules() if name in names]


def _frozen_bytes(module: nn.Module, saved: dict) -> int:
    """The frozen weights of ``module`` with those ``saved`` names (by id) stored smaller."""
    return weight_bytes(module, trained=False) - sum(
        saved.get(id(p), 0) for p in module.parameters() if not p.requires_grad)


def _saved(weight, fmt: str | None, block: int, tied: bool) -> int:
    """Bytes storing ``weight`` as ``fmt`` saves; a tied weight stays where else it is used, so
    its quantized copy only adds bytes."""
    if fmt is None:
        return 0
    held = 0 if tied else weight.numel() * weight.element_size()
    return held - stored_bytes(weight.numel(), weight.element_size(), fmt, block)


def _shared(model: nn.Module) -> set:
    """Parameters held by more than one module (a head tied to the embedding)."""
    seen: dict = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def candidates(model: nn.Module, blocks: list, budget: int, depth: int, probe: bool,
               host_room: Callable[[], int], block: int = 0,
               may_stream: bool = True) -> list:
    """What each candidate format would take: its weight bytes, the blocks the plan at wrap()
    would stream, and whether the daemon's free host memory (``host_room()``, asked only when
    a candidate streams) holds the frozen copies those blocks need. With ``may_stream`` False
    (param_offload=False) a candidate that would stream does not run."""
    weights = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in weights.values()) + sum(
        t.numel() * t.element_size() for t in stored_buffers(model))
    block_ids = [{id(p) for p in blk.parameters()} for blk in blocks]
    frozen = _frozen_linear(model, blocks)
    tied = _shared(model)
    room = None
    out = []
    for fmt in CANDIDATES:
        saved = {id(w): _saved(w, fmt, block, id(w) in tied) for w in frozen}
        sizes = [weight_bytes(blk) - sum(saved.get(i, 0) for i in ids)
                 for blk, ids in zip(blocks, block_ids)]
        stored_total = total - sum(saved.values())
        try:
            if blocks:
                streamed = weight_plan_for_sizes(sizes, stored_total - sum(sizes), budget,
                                                 depth, probe)
            elif stored_total + budget // 4 <= budget:  # no stack: all or nothing
                streamed = []
            else:
                streamed = None
        except MemoryPlanError:
            streamed = None
        if streamed and not may_stream:
            streamed = None
        host = 0 if not streamed else sum(_frozen_bytes(blocks[b], saved) for b in streamed)
        if host and room is None:
            room = host_room()
        out.append(Candidate(fmt, stored_total, None if streamed is None else len(streamed),
                             host, host == 0 or host <= room,
                             sum(sizes[b] for b in streamed or ())))
    return out


def choose(options: list, prefer: str) -> Candidate:
    """The candidate ``prefer`` picks (see the module's notes); the first one when none runs
    (the plan then says why)."""
    running = [c for c in options if c.runs]
    if prefer == "speed":
        for c in options:
            if c.in_vram:
                return c
        if running:  # the fewest bytes over the link a step; the more exact on a tie
            return min(running, key=lambda c: (c.streamed_bytes, options.index(c)))
    return running[0] if running else options[0]


def explain(options: list, chosen: Candidate, budget: int, blocks: int, prefer: str) -> str:
    """One line per candidate up to the one chosen, for the wrap.quantize event."""
    said = []
    for c in options:
        if c.streamed is None:
            what = f"do not fit in the {size(budget)} VRAM budget even streaming every block"
        elif c.streamed == 0:
            what = f"all stay in the {size(budget)} VRAM budget"
        else:
            what = f"{c.streamed} of {blocks} blocks stream ({size(c.streamed_bytes)} of them)"
            if not c.fits_host:
                what += (f", and the daemon has no room for their {size(c.host_bytes)} of "
                         "frozen host copies")
        said.append(f"{c.name}: {size(c.weight_bytes)} of weights, {what}")
        if c is chosen:
            break
    return (f"quantize='auto', prefer='{prefer}': frozen linear weights "
            f"{'kept as they are' if chosen.fmt is None else 'stored as ' + chosen.fmt} ("
            + "; ".join(said) + ")")


def frozen_linear_count(model: nn.Module, blocks: Any = None) -> int:
    """How many frozen linear layers :func:`quantize_model` would quantize."""
    return len(quantizable_layers(model, blocks))

