# SPDX-License-Identifier: Apache-2.0
"""``wrap(quantize="auto")``: whether the frozen linear weights are stored quantized, decided
before the memory plan from their sizes, the VRAM budget and the host memory the daemon has
free.

Candidates, in order: the weights as they are, int8, NF4. ``prefer="exact"`` (the default) takes
the first the run fits with: as they are, blocks may stream their weights from host memory,
whose frozen copies the daemon must have room for; quantized, every block must stay in VRAM (the
pager streams parameters, and a quantized weight is a buffer). ``prefer="speed"`` takes the
first that keeps every block in VRAM, and falls back to the rule above when none does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..frozen.linear import BaseLinear
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

    @property
    def name(self) -> str:
        return self.fmt or "as they are"

    @property
    def in_vram(self) -> bool:
        return self.streamed == 0 and self.fits_host

    @property
    def runs(self) -> bool:
        return self.streamed is not None and self.fits_host and (
            self.fmt is None or self.streamed == 0)


def _frozen_linear(module: nn.Module) -> list:
    # A BaseLinear is stored as its base keeps it already (and has no weight of its own).
    return [m.weight for m in module.modules()
            if isinstance(m, nn.Linear) and not isinstance(m, BaseLinear)
            and not m.weight.requires_grad]


def _frozen_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)


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
    total = sum(p.numel() * p.element_size() for p in weights.values())
    block_ids = [{id(p) for p in blk.parameters()} for blk in blocks]
    frozen = _frozen_linear(model)
    tied = _shared(model)
    room = None
    out = []
    for fmt in CANDIDATES:
        saved = {id(w): _saved(w, fmt, block, id(w) in tied) for w in frozen}
        sizes = [sum(p.numel() * p.element_size() for p in blk.parameters()) -
                 sum(saved.get(i, 0) for i in ids) for blk, ids in zip(blocks, block_ids)]
        weight_bytes = total - sum(saved.values())
        try:
            if blocks:
                streamed = weight_plan_for_sizes(sizes, weight_bytes - sum(sizes), budget,
                                                 depth, probe)
            elif weight_bytes + budget // 4 <= budget:  # no stack: all or nothing
                streamed = []
            else:
                streamed = None
        except MemoryPlanError:
            streamed = None
        if streamed and not may_stream:
            streamed = None
        host = 0 if not streamed else sum(_frozen_bytes(blocks[b]) for b in streamed)
        if host and room is None:
            room = host_room()
        out.append(Candidate(fmt, weight_bytes, None if streamed is None else len(streamed),
                             host, host == 0 or host <= room))
    return out


def choose(options: list, prefer: str) -> Candidate:
    """The candidate ``prefer`` picks (see the module's notes); the first one when none runs
    (the plan then says why)."""
    if prefer == "speed":
        for c in options:
            if c.in_vram:
                return c
    for c in options:
        if c.runs:
            return c
    return options[0]


def explain(options: list, chosen: Candidate, budget: int, blocks: int, prefer: str) -> str:
    """One line per candidate up to the one chosen, for the wrap.quantize event."""
    said = []
    for c in options:
        if c.streamed is None:
            what = f"do not fit in the {size(budget)} VRAM budget even streaming every block"
        elif c.streamed == 0:
            what = f"all stay in the {size(budget)} VRAM budget"
        else:
            what = f"{c.streamed} of {blocks} blocks stream"
            if not c.fits_host:
                what += (f", and the daemon has no room for their {size(c.host_bytes)} of "
                         "frozen host copies")
        said.append(f"{c.name}: {size(c.weight_bytes)} of weights, {what}")
        if c is chosen:
            break
    return (f"quantize='auto', prefer='{prefer}': frozen linear weights "
            f"{'kept as they are' if chosen.fmt is None else 'stored as ' + chosen.fmt} ("
            + "; ".join(said) + ")")


def frozen_linear_count(model: nn.Module) -> int:
    return len(_frozen_linear(model))

