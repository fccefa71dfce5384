# SPDX-License-Identifier: Apache-2.0
"""``memory_report()``: what trainstream holds and decided for a wrapped model, in one dict
(host and GPU memory, the plan's choices and their reasons, the events)."""

from __future__ import annotations

import os

import torch

from .errors import FailedPreconditionError
from .frozen.gpu_pool import gpu_pools
from .frozen.linear import BaseLinear, attached_base
from .inspection import pcie_bytes, pinned_stats
from .memory.blocks import find_blocks
from .session import TrainStreamSession, session_of


def memory_report(model: torch.nn.Module | None = None) -> dict:
    """What trainstream holds and decided, for a wrapped model (or the GPU alone)."""
    report: dict = {}
    if torch.cuda.is_available():
        report["gpu"] = {"allocated": torch.cuda.memory_allocated(),
                         "reserved": torch.cuda.memory_reserved(),
                         "peak_allocated": torch.cuda.max_memory_allocated()}
    if model is None:
        # The process's page-locked memory: the daemon's, as pinned_stats() reads it.
        stats = pinned_stats()
        report["pinned"] = {k: v for k, v in stats.items() if k != "by_tag"}
        report["pinned_by_tag"] = stats["by_tag"]
        return report
    session = session_of(model)
    if session is None:
        raise FailedPreconditionError("this model is not wrapped by trainstream")
    memory = session.client.memory()
    mine = [r for r in memory.get("by_session", []) if r["key"] == session.client.session_id]
    report["pinned"] = {"daemon_reserved": memory.get("reserved_bytes", 0),
                        "session_bytes": mine[0]["bytes"] if mine else 0}
    report["pinned_by_tag"] = {r["key"]: r["bytes"] for r in memory.get("by_tag", [])}
    report["optimizer"] = session.optimizer.stats()
    pager = session.pager
    quantized = [m for m in model.modules() if isinstance(m, BaseLinear)]
    stack = _block_stack(model, session)
    report["params"] = {
        "paged_blocks": list(pager.paged) if pager else [],
        "slot_bytes": pager.resident_bytes() if pager else 0,
        "load_bytes": pager.bytes_fetched if pager else 0,  # host to device, since wrap()
        "quantize": session.config.quantization.quantize,
        "quantized_layers": len(quantized),
        # TrainStream 0.6's name: the blocks of the stack holding quantized weights.
        "quantized_blocks": [i for i, block in enumerate(stack)
                             if any(isinstance(m, BaseLinear) for m in block.modules())],
        # fp8 layers that multiply each call's largest input channels in bf16 (outliers=).
        "outliers": max((m.outliers for m in quantized), default=0.0),
        "outlier_layers": sum(1 for m in quantized if m.outliers),
        # Streamed weights come from the daemon's page-locked buffers: none is staged through
        # pageable memory. No peer-GPU pooling exists here (session.peer is None).
        "bounce_bytes": 0, "peer_bytes": 0, "peer_blocks": [], "peer_owned_bytes": 0,
    }
    recompute = session.recompute
    policy = pager.activation_policy() if pager else []
    if recompute is not None:
        count = len(recompute.blocks)
        policy = policy or ["keep"] * count
        policy = ["recompute" if i in recompute.indices else p for i, p in enumerate(policy)]
    report["activations"] = {
        "policy": policy,
        "offloaded_bytes": pager.bytes_offloaded if pager else 0,  # device to host, since wrap()
        "host_bytes": (pager.activations.arena.reserved_bytes
                       if pager and pager.activations.arena else 0),
        "host_refused": pager.activations.arena_refused if pager else None,
        # TrainStream 0.6's names: the blocks that page their activations, those that
        # recompute their forward, and what decided it.
        "offloaded_blocks": [i for i, p in enumerate(policy) if p == "offload"],
        "recompute_blocks": [i for i, p in enumerate(policy) if p == "recompute"],
        "decision": _activation_decision(session, policy),
    }
    opt = session.optimizer
    to_device, to_host = pcie_bytes(session)
    steps = max(1, opt.steps)
    report["pcie"] = {"to_device_bytes": to_device, "to_host_bytes": to_host,
                      "steps": opt.steps, "to_device_per_step": to_device // steps,
                      "to_host_per_step": to_host // steps}
    # TrainStream 0.6's names for the same bytes, and what stays in VRAM.
    report["transfers"] = {"h2d_bytes": to_device, "d2h_bytes": to_host}
    paged = set(pager.paged) if pager else set()
    blocks = pager.blocks if pager else []
    streamed = {id(p) for i in paged if i < len(blocks) for p in blocks[i].parameters()}
    report["resident"] = {
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                           if p.device.type == "cuda" and id(p) not in streamed),
        "slot_bytes": pager.resident_bytes() if pager else 0,
        "optimizer_state_bytes": 8 * opt.device_state_elements,
    }
    report["activations"]["inflight_waits"] = pager.activations.inflight_waits if pager else 0
    # The CPU time trainstream's hooks took, by hook: what the client adds to the thread that
    # issues the GPU's work (a paged step that waits on the CPU is slowed by it).
    hooks = {**opt.clock.report(opt.steps), **(pager.clock.report(opt.steps) if pager else {})}
    report["hooks"] = {"per_hook": hooks,
                       "ms_per_step": round(sum(h["ms_per_step"] for h in hooks.values()), 3)}
    report["plan"] = _plan_report(session)
    if session.attention is not None:  # attention=: the kernel chosen, and its timings
        report["attention"] = session.attention.report()
    report["frozen_host_bytes"] = session.frozen.bytes if session.frozen is not None else 0
    layers = [m for m in model.modules() if isinstance(m, BaseLinear) and m.matmul_choice]
    if layers:  # an fp8 base: how its layers multiply (see BaseLinear)
        report["fp8_matmul"] = {
            "scaled_mm": sum(m.matmul_choice["path"] == "scaled_mm" for m in layers),
            "dequantize": sum(m.matmul_choice["path"] == "dequantize" for m in layers),
            # (out, in, path, why, FP8 tensor cores ms, dequantize ms): the times where timed
            "choices": sorted({(m.out_features, m.in_features, m.matmul_choice["path"],
                                m.matmul_choice["why"], m.matmul_choice.get("scaled_mm_ms"),
                                m.matmul_choice.get("dequantize_ms")) for m in layers},
                              key=str)}
    base, gpu_base = attached_base(model)
    if base is not None:  # attach_base(): the frozen weights are the daemon's shared copy
        info = base.info()
        report["base"] = {"id": base.id, "name": base.name, "format": base.format,
                          "stored_bytes": base.stored_bytes, "users": int(info["users"])}
    if gpu_base is not None:  # attach_base(gpu_pool=True): the base read in place from VRAM
        report["gpu_pool"] = gpu_base.report()
        report["gpu_pool"]["importers"] = next(
            (len(p.get("importers", [])) for p in gpu_pools(gpu_base.base.client)["pools"]
             if int(p["pool_id"]) == gpu_base.pool_id), 0)
    if os.path.exists("/proc/self/smaps"):
        from .frozen.store import mapped_segments
        report["mapped_segments"] = mapped_segments()
    # The daemon's log holds this session's events, wrap()'s own decisions among them (as
    # "client.<kind>"), and the machine-wide ones.
    report["events"] = [e for e in session.client.events()
                        if e.get("session_id") in ("", session.client.session_id)]
    report["config"] = session.config.as_dict()
    return report



def _block_stack(model: torch.nn.Module, session: TrainStreamSession) -> list:
    """The block stack wrap() used: the pager's or the recompute's, else blocks=, else the one
    find_blocks finds."""
    if session.pager is not None:
        return list(session.pager.blocks)
    if session.recompute is not None:
        return list(session.recompute.blocks)
    blocks = session.config.memory.blocks
    return list(blocks) if blocks is not None else find_blocks(model)


def _activation_decision(session: TrainStreamSession, policy: list) -> dict:
    """What decided the activation policy (TrainStream 0.6's ``activations.decision``): the
    memory plan's measurements and reasons, or the options as given."""
    decision = {"offloaded": [i for i, p in enumerate(policy) if p == "offload"],
                "recomputed": [i for i, p in enumerate(policy) if p == "recompute"],
                "kept": [i for i, p in enumerate(policy) if p == "keep"],
                # Blocks moved back to VRAM after the policy was decided (0.6's keep_resident):
                # the plan here decides where each block's activations go in one move.
                "kept_blocks": []}
    config = session.config
    asked = (f"activation_offload={config.memory.activation_offload!r}, "
             f"recompute={config.memory.recompute!r}")
    plan = session.plan
    if plan is not None:
        decided = plan.plan
        decision.update(
            by="memory plan",
            measured=dict(plan.measured),
            reason=("; ".join(decided.history) if decided is not None and decided.history else
                    "the probe step has not run yet: every block but the measured one "
                    "recomputes or pages until it has"))
    elif policy:
        decision.update(by="options", reason=f"as asked: {asked}")
    else:
        decision.update(by="options", reason=f"nothing pages or recomputes ({asked}; no "
                                               "VRAM plan decides it on this run)")
    return decision


def _plan_report(session: TrainStreamSession) -> dict:
    """The memory plan: the adaptive plan's own report where one runs, with TrainStream 0.6's
    ``target_vram`` (the VRAM the plan keeps a step under), ``settled`` (no longer adapting)
    and ``budget`` beside it; otherwise those keys alone (a run no plan adapts: settled)."""
    plan = session.plan
    if plan is None:
        return {"target_vram": session.vram_target, "settled": True, "adapting": False,
                "budget": session.vram_target, "budget_bytes": session.vram_target,
                "history": []}
    report = plan.report()
    report.update(target_vram=plan.budget, settled=not plan.adapting, budget=plan.budget)
    return report
