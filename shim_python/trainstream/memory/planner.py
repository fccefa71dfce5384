# SPDX-License-Identifier: Apache-2.0
"""The memory plan: from measured sizes and budgets, which blocks keep their weights in VRAM and
which stream them from host memory, which blocks' activations stay, go to host memory or are
recomputed, and the moments' precision. A pure function of its inputs (tested on synthetic
budgets); ``wrap()`` feeds it measurements and says every decision in an event.

Order of preference, cheapest first for a step's time: keep everything; page saved activations
to host memory (their copies overlap compute); recompute the blocks host memory cannot take;
stream block weights (each crosses PCIe twice a step); and on the host side, bf16 moments before
giving up. A plan that cannot fit raises :class:`MemoryPlanError` with the numbers and what would
make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidArgumentError, ResourceExhaustedError

GiB = float(1 << 30)


class MemoryPlanError(ResourceExhaustedError):
    """The run cannot fit in this machine's VRAM or host memory; the message has the numbers."""


@dataclass(frozen=True)
class BlockFacts:
    """One block of the repeated stack, as measured."""

    weight_bytes: int        # its weights as held on the GPU
    activation_bytes: int    # what its forward saves for backward
    input_bytes: int = 0     # what recomputing it keeps instead (its input)
    trainable: int = 0       # trainable elements (their optimizer state lives on the host)
    trained_share: float = 1.0  # of its weights, the share that trains (0: a frozen base)


@dataclass(frozen=True)
class PlanInputs:
    blocks: tuple[BlockFacts, ...]
    other_weight_bytes: int      # weights outside the block stack (embeddings, head)
    other_trainable: int         # trainable elements outside the stack
    working_bytes: int           # VRAM a step needs beyond weights and saved activations
    vram_budget: int             # usable VRAM for this process, headroom already taken off
    host_budget: int             # host memory the daemon can give this job
    grad_bytes: int = 4          # per trainable element, one gradient slot
    ranks: int = 1               # gradient slots per element
    moment_dtype: str = "auto"   # "auto", "float32" or "bfloat16"
    param_offload: object = "auto"       # "auto", True, False, fraction, or block indices
    activation_offload: object = "auto"  # "auto", True, False, or fraction
    prefetch_depth: int = 1
    block_forward_s: float = 0.0     # one block's measured forward time (0: not measured)
    link_bytes_per_s: float = 0.0    # measured PCIe bandwidth, one direction (0: not measured)
    paged_already: tuple = ()        # blocks streaming their weights already (kept so)
    step_compute_s: float = 0.0      # a step's GPU compute (0: estimated, see _compute_s)
    transfer_bytes: tuple = (0, 0)   # what crosses PCIe a step besides paging (to, from GPU)
    # The host optimizer's measured pass over every trainable element (0: not measured). A
    # full fine-tune's pass can outlast the backward it overlaps: then the AdamW state of the
    # blocks whose gradients come last, the first ones, and of the parameters outside the stack
    # is better kept in VRAM and updated there.
    host_update_s: float = 0.0
    # The host's pass waits for backward's last gradient (clipping that scales the step): it
    # then follows the step's compute instead of overlapping it, and every block whose state
    # VRAM can hold shortens the step.
    host_after_backward: bool = False
    gpu_state: object = 0            # "auto", or that many leading blocks kept so (0: none)
    gpu_state_bytes: int = 12        # VRAM per element so kept: fp32 moments, the gradient
    update_transfer: tuple = (4, 4)  # per element updated on the host: bytes to, from the GPU
    host_state_planned: bool = False  # the optimizer's host memory is admitted already
    # Of the blocks after those (weights in VRAM), some may instead be updated on the GPU with
    # their moments staged from host memory as backward finishes them (staged_block_indices):
    # no host pass for them, no VRAM but the staging slots, their moments over PCIe both ways
    # instead of gradient and weight. "auto", or that many blocks (0: none).
    staged_state: object = 0
    staged_transfer: tuple = (8, 8)  # per element staged: bytes to, from the GPU
    staged_vram: int = 768 << 20     # the staging slots (staged_adamw.slots_bytes())
    staged_grad_bytes: int = 0       # VRAM per element staged: its gradient until the last
                                     # micro-step (4 with gradient accumulation, else 0)
    # Host memory traffic per element, in units of the host pass's own (which reads weight,
    # gradient and both moments and writes three back: 28 bytes in fp32): one updated on the
    # host (its gradient's and weight's copies overlap the measured pass already), one staged
    # (the copy engines read and write its moments, 16 bytes). The pass is bound by host memory
    # bandwidth, so staged copies slow it.
    host_traffic: tuple = (1.0, 16 / 28)
    # Under activation_offload="auto", how each block that VRAM cannot keep is handled: "model"
    # weighs a page against a recompute by the step model below; "recompute" never pages (what
    # gradient checkpointing gives, but only the blocks VRAM cannot keep); "page" pages while
    # host memory has room (the fitting plan with the least recompute); "recompute_all"
    # recomputes every block but the last whatever VRAM holds (checkpointing itself; only
    # where no block streams its weights). The run-time trial (memory/plan_trial.py) times
    # them as whole plans.
    activation_choice: str = "model"


@dataclass
class MemoryPlan:
    paged_blocks: list = field(default_factory=list)     # weights streamed from host memory
    activation_policy: list = field(default_factory=list)  # per block: keep/offload/recompute
    moment_dtype: str = "float32"
    vram_bytes: int = 0          # the plan's VRAM peak estimate
    host_bytes: int = 0          # optimizer state, paged weights' staging, paged activations
    pcie_bytes_per_step: int = 0
    gpu_state_blocks: int = 0    # leading blocks (and the rest outside the stack) updated in VRAM
    gpu_state_elements: int = 0
    staged_blocks: int = 0       # the blocks after those, updated on the GPU from host moments
    staged_elements: int = 0
    step_s: dict = field(default_factory=dict)  # estimated busy time a step, per resource
    history: list = field(default_factory=list)          # every decision, in words


def size(nbytes: float) -> str:
    """Bytes in words a message can use at any scale."""
    for unit, scale in (("GiB", GiB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if abs(nbytes) >= 0.1 * scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed order (0, n/2, n/4, 3n/4, ...): any first k of them are spread
    evenly over the stack, and the first k are among the first k+1. Streaming blocks in this
    order puts resident blocks between streamed ones, whose compute hides the next fetch; a
    leading run of streamed blocks would leave PCIe idle while the rest compute."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def fetch_bytes(weight_bytes: list, depth: int) -> int:
    """Bytes a step fetches for streamed blocks of these sizes (in stack order): each once in
    forward, and again in backward except the last ``depth + 1``, still in their slots when
    backward starts with them."""
    kept = weight_bytes[-(depth + 1):] if weight_bytes else []
    return 2 * sum(weight_bytes) - sum(kept)


def _trainable(inputs: PlanInputs) -> int:
    return inputs.other_trainable + sum(b.trainable for b in inputs.blocks)


def _host_state(inputs: PlanInputs, moment_bytes: int) -> int:
    if inputs.host_state_planned:
        return 0
    return _trainable(inputs) * (4 + 2 * moment_bytes + inputs.grad_bytes * inputs.ranks)


def gpu_state_elements(inputs: PlanInputs, blocks: int) -> int:
    """Elements updated in VRAM when the first ``blocks`` blocks keep their state there (the
    parameters outside the stack with them: the embeddings' gradients come last of all)."""
    if blocks <= 0:
        return 0
    return inputs.other_trainable + sum(b.trainable for b in inputs.blocks[:blocks])


def staged_block_indices(n: int, first: int, count: int) -> list[int]:
    """The ``count`` blocks of ``first`` .. ``n - 1`` whose moments are staged through the GPU:
    spread evenly, the last one included. Backward reaches them from its start on, so their
    copies start with it, and the host's pass has blocks from the start on too."""
    span = n - first
    return [first + (j + 1) * span // count - 1 for j in range(count)] if count else []


def staged_elements(inputs: PlanInputs, first: int, blocks: int) -> int:
    """Elements of the ``blocks`` blocks staged after ``first`` (see PlanInputs)."""
    return sum(inputs.blocks[i].trainable
               for i in staged_block_indices(len(inputs.blocks), first, blocks))


ACTIVATION_CHOICES = ("model", "recompute", "page", "recompute_all")


def _wanted_pages(option: object, n: int) -> set | None:
    """Blocks the user asked to page (None: the planner decides)."""
    if option == "auto":
        return None
    if option is True:
        return set(range(n))
    if option is False or option is None:
        return set()
    if isinstance(option, float):
        return set(range(round(option * n)))
    return set(option)


def plan_memory(inputs: PlanInputs) -> MemoryPlan:
    """Decides the plan, or raises :class:`MemoryPlanError`.

    Page or recompute is chosen per block by what it adds to the step, the step taking as long
    as the busiest of compute, PCIe to the device and PCIe back: a page adds its activations'
    transfer both ways, a recompute adds one forward. The weights streamed load PCIe too, and
    they are decided after the activations, so with both measured the plan is made twice: the
    second time knowing what the first streamed."""
    best, note = _plan_vram_state(inputs)
    option = inputs.staged_state
    if option and option != "auto":
        best = _plan_staged(inputs, best, int(option))
    elif option == "auto" and (inputs.host_update_s > 0 and inputs.block_forward_s > 0
                               and _trainable(inputs)) and _binding(best) in _HOST:
        start = best
        # The staging slots take VRAM the state of a block or two may be holding: give those
        # back when that lets more blocks stage (unless gpu_state_blocks was asked for).
        held = best.gpu_state_blocks
        for k in (range(held, max(-1, held - 3), -1) if inputs.gpu_state == "auto" else [held]):
            candidate = _staged_search(inputs, k, start)
            if candidate is not None and _estimate(candidate) < _estimate(best):
                best = candidate
        if best.staged_blocks:
            first, n = best.gpu_state_blocks, len(inputs.blocks)
            best.history.insert(0, (
                f"{best.staged_blocks} of blocks {first}-{n - 1} "
                f"({best.staged_elements:,} elements, spread over them) are updated on "
                f"the GPU with their moments staged from host memory as backward finishes "
                f"them: the host's pass would make the step about "
                f"{1e3 * _estimate(start):.0f} ms, now about {1e3 * _estimate(best):.0f} ms "
                f"({_binding(best)} bound; {inputs.staged_transfer[0]} bytes a parameter "
                "over PCIe each way instead of "
                f"{inputs.update_transfer[0]})"))
    if note and best.gpu_state_blocks:
        best.history.insert(0, note(best))
    return best


def _plan_staged(inputs: PlanInputs, best: MemoryPlan, staged: int) -> MemoryPlan:
    """The plan staging ``staged`` blocks (asked for) after the VRAM-held ones: with fewer of
    those where "auto" chose more than leave room for them or their slots."""
    n, held = len(inputs.blocks), best.gpu_state_blocks
    if staged + (0 if inputs.gpu_state == "auto" else held) > n:
        raise MemoryPlanError(f"staged_state_blocks={staged} with gpu_state_blocks={held}: the "
                              f"model has {n} blocks")
    error = None
    for k in (range(min(held, n - staged), -1, -1) if inputs.gpu_state == "auto" else [held]):
        try:
            return _plan_twice(inputs, k, staged)
        except MemoryPlanError as e:
            error = e
    raise error


def _staged_search(inputs: PlanInputs, k: int, start: MemoryPlan) -> MemoryPlan | None:
    """With ``k`` blocks' state in VRAM, the plan staging the most blocks after them that
    still shortens the step (None: none does)."""
    best = None
    for blocks in range(1, len(inputs.blocks) - k + 1):
        try:
            plan = _plan_twice(inputs, k, blocks)
        except MemoryPlanError:
            break
        if plan.paged_blocks != start.paged_blocks:
            break  # its slots would push weights out of VRAM
        if best is not None and _estimate(plan) >= _estimate(best):
            break
        best = plan
        if _binding(plan) not in _HOST:
            break
    return best


def _plan_vram_state(inputs: PlanInputs) -> tuple:
    """The plan with the leading blocks' AdamW state in VRAM as ``gpu_state`` says, and for
    "auto" a note of why (given the final plan)."""
    option = inputs.gpu_state
    if option != "auto":
        return _plan_twice(inputs, int(option or 0)), None
    # "auto": more blocks' state in VRAM while the host's pass is what the step waits for, and
    # while VRAM can take it without streaming weights (theirs then live on the host).
    measured = inputs.host_update_s > 0 and inputs.block_forward_s > 0
    best = _plan_twice(inputs, 0)
    if not measured or not _trainable(inputs):
        return best, None
    start = best
    plan = best
    for blocks in range(1, len(inputs.blocks) + 1):
        if max(plan.step_s[k] for k in _HOST) <= max(
                v for k, v in plan.step_s.items() if k not in _HOST):
            break  # the host no longer binds: more state in VRAM would only cost room
        try:
            plan = _plan_twice(inputs, blocks)
        except MemoryPlanError:
            break
        if plan.paged_blocks:
            break
        if _estimate(plan) < _estimate(best) * 0.99:  # a gain worth the VRAM
            best = plan
    def note(chosen: MemoryPlan) -> str:
        return (f"the AdamW state of blocks 0-{chosen.gpu_state_blocks - 1} and of the "
                f"parameters outside the stack ({chosen.gpu_state_elements:,} elements, "
                f"{size(inputs.gpu_state_bytes * chosen.gpu_state_elements)} of VRAM) is kept "
                f"in VRAM and updated there at step(): the host's pass over every parameter "
                f"({1e3 * inputs.host_update_s:.0f} ms) would make the step about "
                f"{1e3 * _estimate(start):.0f} ms" + (
                    f", now about {1e3 * _estimate(best):.0f} ms ({_binding(best)} bound)"
                    # Staging may give blocks back: its own line has the final estimate.
                    if chosen.gpu_state_blocks == best.gpu_state_blocks
                    and not chosen.staged_blocks else ""))
    return best, (note if best.gpu_state_blocks else None)


# The host's resources: its optimizer pass (after the forward), and its memory bandwidth, which
# the pass shares with the copy engines' reads and writes of what crosses PCIe for it.
_HOST = ("host", "host_memory")


def _estimate(plan: MemoryPlan) -> float:
    return max(plan.step_s.values())


def _binding(plan: MemoryPlan) -> str:
    return max(plan.step_s, key=plan.step_s.get)


def _plan_twice(inputs: PlanInputs, gpu_blocks: int, staged: int = 0) -> MemoryPlan:
    plan = _plan(inputs, frozenset(), gpu_blocks, staged)
    if inputs.block_forward_s > 0 and inputs.link_bytes_per_s > 0 and plan.paged_blocks:
        plan = _plan(inputs, frozenset(plan.paged_blocks), gpu_blocks, staged)
    return plan


def _step_estimate(inputs: PlanInputs, plan: MemoryPlan, transfer: tuple, on_gpu: int,
                   staged: int = 0) -> dict:
    """Each resource's busy time a step under ``plan`` (0 where not measured). The host's pass
    starts with the first gradient, after the forward (or, ``host_after_backward``, after the
    step's compute), and ends the step when it is last; the host's memory serves that pass and
    the staged moments' copies (``staged`` of the ``on_gpu`` elements) all step long."""
    link = inputs.link_bytes_per_s
    forward = inputs.block_forward_s
    compute = ((inputs.step_compute_s or _compute_s(inputs))
               + forward * plan.activation_policy.count("recompute"))
    paged_activations = sum(inputs.blocks[i].activation_bytes
                            for i, p in enumerate(plan.activation_policy) if p == "offload")
    weights_in = fetch_bytes([inputs.blocks[i].weight_bytes for i in plan.paged_blocks],
                             inputs.prefetch_depth)
    forward_s = _forward_s(inputs, plan.paged_blocks)
    forward_d2h = paged_activations / link if link else 0.0
    compute += max(0.0, forward_d2h - forward_s)  # the forward stalls on its copies
    trainable = _trainable(inputs)
    host = memory = 0.0
    if inputs.host_update_s > 0 and trainable:
        per_element = inputs.host_update_s / trainable
        start = compute if inputs.host_after_backward else max(forward_s, forward_d2h)
        host = start + per_element * (trainable - on_gpu)
        memory = per_element * ((trainable - on_gpu) * inputs.host_traffic[0]
                                + staged * inputs.host_traffic[1])
    return {"compute": compute,
            "h2d": (transfer[0] + weights_in + paged_activations) / link if link else 0.0,
            "d2h": (transfer[1] + paged_activations) / link if link else 0.0,
            "host": host, "host_memory": memory}


def _forward_s(inputs: PlanInputs, streamed: list) -> float:
    """The forward's length: its blocks' compute, or the streamed weights' fetches (each once
    in it) where those take longer."""
    link = inputs.link_bytes_per_s
    fetched = sum(inputs.blocks[i].weight_bytes for i in streamed)
    return max(inputs.block_forward_s * len(inputs.blocks), fetched / link if link else 0.0)


def _compute_s(inputs: PlanInputs) -> float:
    """A step's GPU compute from one block's forward: the forward, then in backward the
    gradient of its input (about one forward more) and of the weights that train (one more, in
    their share): three forwards for a full fine-tune, two for a frozen base under adapters."""
    return sum(inputs.block_forward_s * (2 + min(1.0, max(0.0, b.trained_share)))
               for b in inputs.blocks)


def _plan(inputs: PlanInputs, streamed_guess: frozenset, gpu_blocks: int = 0,
          staged_blocks: int = 0) -> MemoryPlan:
    n = len(inputs.blocks)
    if not 0 <= gpu_blocks <= n:
        raise InvalidArgumentError(f"gpu_state blocks {gpu_blocks} is not in [0, {n}]")
    if not 0 <= staged_blocks <= n - gpu_blocks:
        raise InvalidArgumentError(f"staged blocks {staged_blocks} is not in [0, {n - gpu_blocks}]")
    plan = MemoryPlan(activation_policy=["keep"] * n)
    say = plan.history.append
    on_gpu = gpu_state_elements(inputs, gpu_blocks)
    staged = staged_elements(inputs, gpu_blocks, staged_blocks)
    staged_set = set(staged_block_indices(n, gpu_blocks, staged_blocks))
    wanted = _wanted_pages(inputs.param_offload, n)
    clash = staged_set & ((wanted or set()) | set(inputs.paged_already))
    if clash:
        raise MemoryPlanError(
            f"blocks {sorted(clash)} would stage their moments through the GPU but stream "
            "their weights; a staged block keeps its weights in VRAM (fewer "
            "staged_state_blocks, or param_offload without them)")
    plan.gpu_state_blocks, plan.gpu_state_elements = gpu_blocks, on_gpu
    plan.staged_blocks, plan.staged_elements = staged_blocks, staged
    # What the optimizer moves over PCIe a step: less what the VRAM-held state keeps off it,
    # the staged moments instead of the staged parameters' gradients and weights.
    transfer = tuple(max(0, inputs.transfer_bytes[d]
                         - (on_gpu + staged) * inputs.update_transfer[d]
                         + staged * inputs.staged_transfer[d]) for d in (0, 1))

    # Host side first: the optimizer state must fit, in fp32 moments if it can.
    moment = inputs.moment_dtype
    state = _host_state(inputs, 4 if moment in ("auto", "float32") else 2)
    if moment == "auto":
        moment = "float32"
        if state > inputs.host_budget:
            say(f"moments in bf16: fp32 moments would need {size(state)} of host memory, "
                f"more than the {size(inputs.host_budget)} the daemon can give")
            moment, state = "bfloat16", _host_state(inputs, 2)
    plan.moment_dtype = moment
    if state > inputs.host_budget:
        raise MemoryPlanError(
            f"the optimizer state needs {size(state)} of host memory with {moment} "
            f"moments; the daemon can give this job {size(inputs.host_budget)}. Free "
            "host memory, raise the daemon's --memory_budget, or train fewer parameters (LoRA)")
    host_left = inputs.host_budget - state

    weights = inputs.other_weight_bytes + sum(b.weight_bytes for b in inputs.blocks)
    activations = [b.activation_bytes for b in inputs.blocks]
    paged: set = set()

    def vram() -> int:
        resident = inputs.other_weight_bytes + sum(
            b.weight_bytes for i, b in enumerate(inputs.blocks) if i not in paged)
        if paged:  # slots for the blocks being fetched and used
            biggest = max(inputs.blocks[i].weight_bytes for i in paged)
            resident += (inputs.prefetch_depth + 1) * biggest
        saved = 0
        for i, policy in enumerate(plan.activation_policy):
            if policy == "keep":
                saved += activations[i]
            elif policy == "recompute":
                saved += inputs.blocks[i].input_bytes
        # Offloaded activations still pass through VRAM one block at a time.
        in_flight = max((activations[i] for i, p in enumerate(plan.activation_policy)
                         if p != "keep"), default=0)
        return (resident + saved + in_flight + inputs.working_bytes
                + inputs.gpu_state_bytes * on_gpu
                + (inputs.staged_vram + inputs.staged_grad_bytes * staged if staged else 0))

    if wanted:
        paged |= wanted
        say(f"blocks {sorted(wanted)} stream their weights, as asked (param_offload)")
    paged |= set(inputs.paged_already)
    streaming = set(paged)  # never recomputed: their weights would cross PCIe a third time

    # Activations: page them to host memory while it has room, else recompute; the last
    # block's are used at once by backward and always stay.
    order = list(range(n - 1))
    forced = inputs.activation_offload
    choice = inputs.activation_choice
    if choice not in ACTIVATION_CHOICES:
        raise InvalidArgumentError(
            f"activation_choice={choice!r} must be one of {ACTIVATION_CHOICES}")
    if choice == "recompute_all" and forced == "auto":
        if streaming or wanted:
            raise MemoryPlanError("every block recomputed: blocks stream their weights, which "
                                  "a recompute would fetch a third time")
        for i in order:
            plan.activation_policy[i] = "recompute"
        say(f"every block but the last ({len(order)}) is recomputed in backward and none "
            "pages its activations, as gradient checkpointing does")
        forced = "recompute_all"
    if forced is True or isinstance(forced, float):
        count = len(order) if forced is True else round(forced * len(order))
        for i in order[:count]:
            plan.activation_policy[i] = "offload"
        say(f"{count} blocks page their activations, as asked (activation_offload)")
    elif forced == "auto":
        link, forward = inputs.link_bytes_per_s, inputs.block_forward_s
        measured = link > 0 and forward > 0
        # What a step already asks of each resource, in seconds (see plan_memory).
        weights_in = fetch_bytes([inputs.blocks[i].weight_bytes
                                  for i in sorted(streamed_guess | streaming)],
                                 inputs.prefetch_depth)
        load = {"compute": inputs.step_compute_s or _compute_s(inputs),
                "h2d": (transfer[0] + weights_in) / link if link else 0.0,
                "d2h": transfer[1] / link if link else 0.0, "forward_d2h": 0.0}
        forward_s = _forward_s(inputs, sorted(streamed_guess | streaming))

        def step(extra: dict) -> float:
            busy = {k: v + extra.get(k, 0.0) for k, v in load.items()}
            # Activations paged in the forward leave while it runs: more than it lasts stalls
            # it (the pager waits for copies in flight), and the step with it.
            stall = max(0.0, busy["forward_d2h"] - forward_s)
            return max(busy["compute"] + stall, busy["h2d"], busy["d2h"])

        # Spread over the stack, as streamed weights are: each block paged in the forward has
        # the compute of the blocks after it to hide its copy.
        for i in [b for b in spread_order(n) if b != n - 1]:
            if vram() <= inputs.vram_budget:
                break
            transfer_s = activations[i] / link if link else 0.0
            paging = step({"h2d": transfer_s, "d2h": transfer_s, "forward_d2h": transfer_s})
            again = step({"compute": forward})
            if choice == "model":
                recompute_it = measured and again < paging
            else:
                recompute_it = choice == "recompute"
            if recompute_it and i not in streaming:
                plan.activation_policy[i] = "recompute"
                load["compute"] += forward
                if choice == "recompute":
                    say(f"block {i} is recomputed in backward: VRAM does not hold every "
                        "block's activations, and this plan pages none")
                else:
                    say(f"block {i} is recomputed in backward: one more forward "
                        f"({1e3 * forward:.1f} ms) costs the step less than its "
                        f"{size(activations[i])} of activations over PCIe both ways "
                        f"({1e3 * transfer_s:.1f} ms each, the link already busy "
                        f"{1e3 * max(load['h2d'], load['d2h']):.0f} ms a step, "
                        f"{1e3 * load['forward_d2h']:.0f} of the forward's "
                        f"{1e3 * forward_s:.0f} ms)")
            elif activations[i] <= host_left:
                load["h2d"] += transfer_s
                load["d2h"] += transfer_s
                load["forward_d2h"] += transfer_s
                plan.activation_policy[i] = "offload"
                host_left -= activations[i]
                say(f"block {i} pages its activations ({size(activations[i])}) to host "
                    "memory: VRAM does not hold every block's")
            elif i in streaming:
                continue
            else:
                plan.activation_policy[i] = "recompute"
                say(f"block {i} is recomputed in backward: host memory cannot take its "
                    f"{size(activations[i])} of activations")

    # Weights: stream blocks while VRAM is still short, spread over the stack (see
    # spread_order), so each fetch overlaps the compute of the resident blocks before it.
    if wanted is None:
        for i in spread_order(n):
            if vram() <= inputs.vram_budget:
                break
            if i in paged or i < gpu_blocks or i in staged_set:  # updated on the GPU: kept
                continue
            if plan.activation_policy[i] == "recompute":
                # Recomputing a block whose weights stream would fetch them a third time.
                if activations[i] > host_left:
                    continue
                plan.activation_policy[i] = "offload"
                host_left -= activations[i]
                say(f"block {i} pages its activations instead of recomputing: its weights "
                    "stream")
            paged.add(i)
            say(f"block {i} streams its weights ({size(inputs.blocks[i].weight_bytes)}) "
                "from host memory: VRAM does not hold them all")

    if forced == "recompute_all" and paged:
        raise MemoryPlanError(
            f"every block recomputed still needs {len(paged)} blocks to stream their weights "
            "to fit, which a recompute would fetch a third time: not checkpointing's plan")
    need = vram()
    if need > inputs.vram_budget:
        state = (f" and the AdamW state of {gpu_blocks} blocks in VRAM "
                 f"({size(inputs.gpu_state_bytes * on_gpu)}; gpu_state_blocks= fewer)"
                 if gpu_blocks else "")
        raise MemoryPlanError(
            f"this run needs {size(need)} of VRAM even with {len(paged)} of {n} blocks "
            f"streaming their weights and {plan.activation_policy.count('keep')} keeping their "
            f"activations{state}; {size(inputs.vram_budget)} is usable. Lower the batch size "
            "or sequence length, or let more blocks stream (param_offload=True, "
            "activation_offload=True)")
    plan.paged_blocks = sorted(paged)
    plan.vram_bytes = need
    paged_activations = sum(activations[i] for i, p in enumerate(plan.activation_policy)
                            if p == "offload")
    plan.host_bytes = state + paged_activations
    plan.pcie_bytes_per_step = (fetch_bytes([inputs.blocks[i].weight_bytes for i in sorted(paged)],
                                            inputs.prefetch_depth) + 2 * paged_activations)
    plan.step_s = _step_estimate(inputs, plan, transfer, on_gpu + staged, staged)
    if not plan.history:
        say(f"everything stays in VRAM: {size(need)} of {size(inputs.vram_budget)} "
            f"({size(weights)} of weights)")
    return plan
