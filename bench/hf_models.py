# SPDX-License-Identifier: Apache-2.0
"""Hugging Face ``transformers`` models (and PEFT LoRA) under a VRAM cap, as a new user trains
them: ``loss = model(input_ids=x, labels=x).loss; loss.backward(); opt.step()``, a
``torch.optim.AdamW`` handed to ``trainstream.wrap(model, opt, device="cuda")`` with every other
option at its default. Each engine runs in a fresh process on the same batches:

  stock            no cap: the model on the GPU, torch's fused AdamW (the reference losses)
  wrap             under the cap, wrap()'s defaults
  wrap_expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  wrap_nf4         the same as wrap with quantize="nf4" (LoRA cases)
  wrap_fp8         the same with quantize="fp8" (FP8 tensor cores where they time faster)
  wrap_fp8_cores   the same with every fp8 matmul on FP8 tensor cores (no split): the
                   baseline of the next row, so the split's own cost shows
  wrap_fp8_outliers  the same with outliers=0.01 (every fp8 matmul on FP8 tensor cores, each
                   call's largest 1% of input channels multiplied in bf16)
  ts041            TrainStream 0.4.1 (PyPI) under the same cap, quantize="none", imported from
                   its own folder (--ts041 DIR, an unpacked sdist) so it never meets ours
  ts041_nf4        the same with quantize="nf4"

Every row records each step's loss, the step's peak allocated and reserved VRAM, the settling
steps, wrap()'s own time, the step time once settled, and for wrap() the plan's events. The
losses of every engine are compared with stock's, step by step.

    python bench/hf_models.py [--cases qwen1.5b_full ...] [--modes stock wrap ...]
                              [--steps 40] [--json out.json] [--ts041 .peers/trainstream-0.4.1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

# name: the preset, full fine-tune or LoRA, weights' dtype, bf16 autocast, batch x sequence.
CASES = {
    "qwen1.5b_full": dict(preset="qwen2.5-1.5b", tune="full", dtype="float32", autocast=True,
                          batch=4, seq=512, lr=2e-5),
    # The run without autocast (fp32 activations): NaN from its third step at 65c5951.
    "qwen1.5b_full_fp32": dict(preset="qwen2.5-1.5b", tune="full", dtype="float32",
                               autocast=False, batch=4, seq=512, lr=2e-5),
    "qwen14b_lora_512": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16",
                             autocast=False, batch=1, seq=512, lr=1e-4),
    "qwen14b_lora_2k": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16",
                            autocast=False, batch=1, seq=2048, lr=1e-4),
    "llama3b_full": dict(preset="llama-3.2-3b", tune="full", dtype="float32", autocast=True,
                         batch=2, seq=1024, lr=2e-5),
    "llama8b_lora_2k": dict(preset="llama-3.1-8b", tune="lora", dtype="bfloat16",
                            autocast=False, batch=1, seq=2048, lr=1e-4),
    "phi3_lora_2k": dict(preset="phi-3-mini", tune="lora", dtype="bfloat16", autocast=False,
                         batch=2, seq=2048, lr=1e-4),
}
VRAM_CAP_GIB = 24
DEFAULT_MODES = ["stock", "wrap", "wrap_expandable", "ts041"]


def _worker(mode: str, case: dict, steps: int, ts041: str) -> dict:
    if mode.startswith("ts041"):
        sys.path.insert(0, os.path.abspath(ts041))  # 0.4.1, never our package
    import torch

    import hf_models

    row: dict = {"mode": mode, **case}
    dtype = getattr(torch, case["dtype"])
    capped = mode != "stock"
    began = time.perf_counter()
    # Drawn on the GPU (seconds for 14B), then where the engine wants it.
    model, trainable = hf_models.build(case["preset"], case["tune"], dtype,
                                       device="cpu" if capped else "cuda", init_device="cuda")
    row["trainable"] = trainable
    row["build_s"] = round(time.perf_counter() - began, 1)
    torch.cuda.empty_cache()
    if capped:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, VRAM_CAP_GIB * 2**30 / total), 0)
    torch.cuda.reset_peak_memory_stats()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=case["lr"], fused=not capped)
    session = None
    began = time.perf_counter()
    if mode.startswith("wrap"):
        import trainstream

        options = dict(quantize="nf4") if mode == "wrap_nf4" else {}
        if mode.startswith("wrap_fp8"):
            options = dict(quantize="fp8", outliers=0.01 if mode.endswith("outliers") else 0)
        if mode == "wrap_gpu":  # the AdamW update on the GPU over the daemon's state
            options["optimizer_mode"] = "gpu"
        options.update(json.loads(os.environ.get("TS_HF_OPTIONS", "{}")))  # diagnostics
        model, opt = trainstream.wrap(model, opt, device="cuda", **options)
        if mode == "wrap_fp8_cores":
            # Not a wrap() option: each layer decides at its first forward, still to come.
            from trainstream.frozen.linear import BaseLinear

            for layer in (m for m in model.modules() if isinstance(m, BaseLinear)):
                layer.fp8_matmul = True
        session = model._trainstream_session
        row["engine"] = f"trainstream {getattr(trainstream, '__version__', 'main')}"
    elif mode.startswith("ts041"):
        import trainstream

        row["engine"] = f"trainstream {trainstream.__version__} from {trainstream.__file__}"
        model, opt = trainstream.wrap(model, opt, device="cuda",
                                      quantize="nf4" if mode == "ts041_nf4" else "none")
    else:
        row["engine"] = f"torch {torch.__version__}"
    row["wrap_s"] = round(time.perf_counter() - began, 1)

    losses, peaks, times, events = [], [], [], []
    seen_events = 0
    settled_at = None
    row["error"] = None
    peak_from = int(os.environ.get("TS_HF_PEAK_FROM", "-1"))  # memory_peak.py from this step
    tail_from = steps - min(8, max(1, steps // 3))  # the steps step_s is the median of
    pcie_at_tail = None
    nan_params = os.environ.get("TS_HF_NAN_PARAMS") == "1"  # diagnostics: where NaN starts
    try:
        for s in range(steps):
            if s == tail_from and session is not None:
                pcie_at_tail = _pcie_bytes(model)
            if s == peak_from:
                sys.path.insert(0, HERE)
                import memory_peak

                memory_peak.start()
            x = hf_models.batch(case["preset"], case["batch"], case["seq"], s, "cuda")
            start = time.perf_counter()
            autocast = case["autocast"] and os.environ.get("TS_HF_AUTOCAST", "1") == "1"
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            # The forward and backward's peak, read before step() (the plan resets it).
            alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.detach())
            # (peak allocated, peak reserved, allocated after step(): what stays between steps)
            peaks.append((round(max(alloc, torch.cuda.max_memory_allocated()) / 2**30, 2),
                          round(max(reserved, torch.cuda.max_memory_reserved()) / 2**30, 2),
                          round(torch.cuda.memory_allocated() / 2**30, 2)))
            if nan_params and "first_nonfinite_params" not in row:
                bad = _nonfinite_params(model, opt)
                if bad:
                    row["first_nonfinite_params"] = {"after_step": s, **bad}
            if session is not None:
                for e in session.events[seen_events:]:
                    events.append({"step": s, "kind": e["kind"], "message": e["message"][:400]})
                seen_events = len(session.events)
                if settled_at is None and not session.adapting:
                    settled_at = s + 1
            if mode == "stock":
                torch.cuda.reset_peak_memory_stats()
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory at step {len(times)}: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # noqa: BLE001 - the row says what failed
        row["error"] = f"{type(e).__name__} at step {len(times)}: {str(e)[:500]}"
    if os.environ.get("TS_HF_REFERRERS"):
        row["referrers"] = _referrers()
    if 0 <= peak_from < len(times):
        row["memory_peak"] = memory_peak.report()
    if pcie_at_tail is not None and len(times) == steps:
        after = _pcie_bytes(model)
        row["h2d_bytes"] = (after[0] - pcie_at_tail[0]) // (steps - tail_from)
        row["d2h_bytes"] = (after[1] - pcie_at_tail[1]) // (steps - tail_from)
    row["losses"] = [float(v) for v in losses]
    row["nonfinite_losses"] = sum(not math.isfinite(v) for v in row["losses"])
    # Steps the non-finite guard kept out of the weights: a finite loss can hide them.
    row["guarded_steps"] = sum(e["kind"] == "optimizer.nonfinite" for e in events)
    row["peaks_gib"] = peaks
    row["step_times_s"] = [round(t, 4) for t in times]
    row["settled_at"] = settled_at
    tail = times[tail_from:] if len(times) == steps else times[-min(8, max(1, len(times) // 3)):]
    row["step_s"] = round(sorted(tail)[len(tail) // 2], 4) if tail else None
    row["peak_reserved_gib"] = max((p[1] for p in peaks[2:]), default=None)
    row["peak_allocated_gib"] = max((p[0] for p in peaks[2:]), default=None)
    if session is not None:
        row["events"] = events
        try:
            import trainstream

            report = trainstream.memory_report(model)
            memory = session.client.memory()
            row["host_job_bytes"] = sum(int(j.get("used_bytes", 0))
                                        for j in memory.get("plans", [])
                                        if j.get("job_id") == session.config.connection.job_id)
            row["optimizer"] = {k: v for k, v in report["optimizer"].items()
                                if k in ("runs_on", "steps", "gpu_state", "staged_state",
                                         "last_step", "nonfinite_total")}
            if report.get("fp8_matmul"):
                row["fp8_matmul"] = {k: report["fp8_matmul"].get(k)
                                     for k in ("scaled_mm", "dequantize")}
        except Exception as e:  # noqa: BLE001
            row["report_error"] = str(e)[:300]
    return row


def _nonfinite_params(model, opt) -> dict:
    """Diagnostics: the parameters holding a NaN or an infinity after a step, counted by where
    their update ran (wrap()'s optimizer: VRAM state, staged moments, or the daemon), with the
    first few names; {} when every parameter is finite."""
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    table = getattr(opt, "table", None)  # wrap()'s OffloadAdamW; torch's optimizers have none
    params = table.params if table else [p for g in opt.param_groups for p in g["params"]]
    staged = table.staged if table else set()
    held = table.state_in_vram() if table else set()
    by_place: dict = {}
    first: list = []
    for i, p in enumerate(params):
        if bool(torch.isfinite(p.detach()).all()):
            continue
        place = "staged" if i in staged else "vram_state" if i in held else "daemon"
        by_place[place] = by_place.get(place, 0) + 1
        if len(first) < 6:
            first.append(f"{names.get(id(p), i)} ({place})")
    if not by_place:
        return {}
    places = {"staged": len(staged), "vram_state": len(held),
              "daemon": len(params) - len(staged) - len(held)}
    return {"nonfinite_by_place": by_place, "params_by_place": places, "first": first}


def _pcie_bytes(model) -> tuple:
    """Bytes that crossed PCIe (to the GPU, back) since wrap(), as memory_report() counts them."""
    import trainstream

    pcie = trainstream.memory_report(model)["pcie"]
    return int(pcie["to_device_bytes"]), int(pcie["to_host_bytes"])


def _bound(rows: dict, bandwidth: dict) -> None:
    """Each wrap() row's lower bound: max(stock's step on the same GPU (compute), the bytes it
    moved over PCIe a step / the pinned bandwidth measured in this run, each way and both at
    once). Recompute's extra forwards are not in it, so the bound is optimistic for a plan that
    recomputes."""
    compute = rows.get("stock", {}).get("step_s")
    for mode, row in rows.items():
        if not mode.startswith("wrap") or "h2d_bytes" not in row or not row.get("step_s"):
            continue
        h2d = row["h2d_bytes"] / (bandwidth["h2d_gbps"] * 1e9)
        d2h = row["d2h_bytes"] / (bandwidth["d2h_gbps"] * 1e9)
        both = ((row["h2d_bytes"] + row["d2h_bytes"]) / (2e9 * bandwidth["both_each_way_gbps"])
                if "both_each_way_gbps" in bandwidth else 0.0)
        row["pcie_s"] = round(max(h2d, d2h, both), 4)
        row["compute_s"] = compute
        row["lower_bound_s"] = round(max(compute or 0.0, row["pcie_s"]), 4)
        # Nothing crossed PCIe and no stock row ran: no bound to compare with.
        row["step_over_bound"] = (round(row["step_s"] / row["lower_bound_s"], 3)
                                  if row["lower_bound_s"] else None)


def _referrers() -> list:
    """Diagnostics: the key/value caches alive after the last step (one belongs to it) and,
    for the oldest, what refers to it, a few levels up (Python-visible references only)."""
    import gc
    import types

    gc.collect()
    try:
        from transformers import DynamicCache
    except ImportError:
        return []
    caches = [o for o in gc.get_objects() if isinstance(o, DynamicCache)]
    lines = [f"{len(caches)} DynamicCache alive"]
    if not caches:
        return lines
    target = caches[0]
    del caches
    seen = set()

    def walk(o, depth):
        if depth > 5:
            return
        for r in gc.get_referrers(o):
            if isinstance(r, types.FrameType) or id(r) in seen or r is seen:
                continue
            if isinstance(r, dict) and "__builtins__" in r:
                continue
            seen.add(id(r))
            name = getattr(r, "__qualname__", "") or getattr(type(r), "__qualname__", "")
            keys = list(r.keys())[:6] if isinstance(r, dict) else ""
            lines.append(f"{'  ' * depth}{type(r).__name__} {name} {keys}"[:200])
            if len(lines) < 60:
                walk(r, depth + 1)

    walk(target, 0)
    return lines


def _run(mode: str, case: str, steps: int, ts041: str, socket: str | None,
         timeout: int) -> dict:
    env = dict(os.environ)
    if mode == "wrap_expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if socket:
        env["TRAINSTREAM_SOCKET"] = socket
    if mode.startswith("ts041"):
        env.setdefault("TRAINSTREAM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "ts041"))
        env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    cmd = [sys.executable, __file__, "--worker", mode, "--case", case, "--steps", str(steps),
           "--ts041", ts041]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "case": case, "error": f"timed out after {timeout} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"mode": mode, "case": case, "error": f"exit {result.returncode}",
                "stderr": result.stderr[-3000:]}
    row = json.loads(lines[-1])
    row["case"] = case
    return row


def _compare(rows: dict) -> None:
    """Each engine's losses beside stock's: the largest step-wise difference."""
    stock = rows.get("stock", {}).get("losses") or []
    for mode, row in rows.items():
        mine = row.get("losses") or []
        n = min(len(stock), len(mine))
        if mode != "stock" and n:
            row["max_loss_diff_vs_stock"] = round(max(abs(a - b) for a, b in
                                                      zip(stock[:n], mine[:n])), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["qwen1.5b_full", "qwen14b_lora_512"],
                        choices=list(CASES))
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ts041-steps", type=int, default=8,
                        help="steps of the TrainStream 0.4.1 rows (no plan to settle; its "
                             "2,048-token step takes seconds)")
    parser.add_argument("--json", default="")
    parser.add_argument("--ts041", default=os.path.join(HERE, "..", ".peers",
                                                        "trainstream-0.4.1"))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--case", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, CASES[args.case], args.steps, args.ts041)),
              flush=True)
        return
    import torch

    from bench_daemon import private_daemon
    from step_bench import pinned_bandwidth

    bandwidth = pinned_bandwidth()
    print(f"pinned copies: host->device {bandwidth['h2d_gbps']} GB/s, device->host "
          f"{bandwidth['d2h_gbps']} GB/s", flush=True)
    result = {"bench": "hf_models", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "commit": os.environ.get("TS_COMMIT", ""), "vram_cap_gib": VRAM_CAP_GIB,
              "bandwidth": bandwidth, "rows": []}
    fd, config = tempfile.mkstemp(prefix="hf-models-daemon-", suffix=".conf")
    with os.fdopen(fd, "w") as f:
        f.write("optimizer_retention_s: 1\n")  # each mode admitted against the machine
    with private_daemon("85%", f"--config={config}") as socket:
        for case in args.cases:
            rows = {}
            for mode in args.modes:
                if "nf4" in mode and CASES[case]["tune"] != "lora":
                    continue
                steps = args.steps
                if mode.startswith("ts041"):
                    steps = min(steps, args.ts041_steps)
                row = _run(mode, case, steps, args.ts041,
                           socket if mode.startswith("wrap") else None, args.timeout)
                rows[mode] = row
                short = {k: row.get(k) for k in ("case", "mode", "error", "step_s", "wrap_s",
                                                 "settled_at", "peak_reserved_gib",
                                                 "peak_allocated_gib", "nonfinite_losses",
                                                 "guarded_steps", "host_job_bytes",
                                                 "first_nonfinite_params")}
                print(json.dumps(short), flush=True)
            _compare(rows)
            _bound(rows, bandwidth)
            result["rows"].extend(rows.values())
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
    os.unlink(config)
    print(f"\n{'case':18} {'mode':16} {'step s':>8} {'bound s':>8} {'/bound':>6} {'/0.4.1':>6} "
          f"{'wrap s':>7} {'settled':>7} {'reserved':>8} {'dloss':>8}  error")
    by_case = {}
    for row in result["rows"]:
        by_case.setdefault(row.get("case"), {})[row.get("mode")] = row
    for row in result["rows"]:
        peer = by_case[row.get("case")].get("ts041_nf4" if "nf4" in row.get("mode", "")
                                            else "ts041", {})
        vs = (f"{row['step_s'] / peer['step_s']:.2f}"
              if row.get("step_s") and peer.get("step_s") and row is not peer else "-")
        print(f"{row.get('case', ''):18} {row.get('mode', ''):16} {row.get('step_s') or '-':>8} "
              f"{row.get('lower_bound_s') or '-':>8} {row.get('step_over_bound') or '-':>6} "
              f"{vs:>6} {row.get('wrap_s', '-'):>7} {row.get('settled_at') or '-':>7} "
              f"{row.get('peak_reserved_gib') or '-':>8} "
              f"{row.get('max_loss_diff_vs_stock', '-'):>8}  {(row.get('error') or '')[:90]}")
    print(f"(bound: max(stock's step, PCIe bytes a step / {bandwidth['h2d_gbps']} GB/s measured "
          "here); /0.4.1: the step over TrainStream 0.4.1's, same cap, this run; target <= 0.8)")


if __name__ == "__main__":
    main()
