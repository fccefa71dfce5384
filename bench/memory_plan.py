# SPDX-License-Identifier: Apache-2.0
"""Models bigger than a 24 GB VRAM cap, trained through wrap() with the memory plan deciding
what streams (weights, activations) and what is recomputed; each beside the lower bound its
bytes imply and beside stock PyTorch without the cap (where the GPU holds it whole). One GPU,
one run, each configuration in a fresh process:

  gpt1.8b      a 1.8B-parameter GPT, fp32 weights, full fine-tune, batch 8x512
  qwen14b_512  LoRA r=16 on a Qwen2.5-14B-shaped model (its config, random bf16 weights), 1x512
  qwen14b_2k   the same at 1x2048
  gpt3.6b      a 3.6B-parameter GPT, fp32 weights, full fine-tune, batch 4x512
  hf_<case>    each case of hf_models.py: Hugging Face transformers models (Qwen2.5, Llama 3,
               Phi-3; full fine-tunes under bf16 autocast, PEFT LoRA), handed to wrap() with a
               torch.optim.AdamW as users do, the loss the model's own (labels=)

Modes: ``wrap`` (under the cap, every option "auto"), ``wrap_paged`` (the 3.6B case: every
block streams its weights, ``param_offload=True``), ``stock`` (no cap: fused AdamW on the GPU),
``wrap_depth2`` (as ``wrap``, with ``prefetch_depth=2``: asked for by ``--modes``),
``wrap_unstaged`` (as ``wrap``, with ``staged_state_blocks=0``: asked for by ``--modes``),
``wrap_staged<N>`` (as ``wrap``, with ``staged_state_blocks=N``: to time other splits of the
update between host and GPU than the planner's) and,
for the full fine-tunes, ``compute`` (no cap: forward and backward with the weights resident, no
optimizer). The GPTs compute in fp32 with TF32 matmuls (every mode alike); the
Qwen shape in bf16.

Every mode records the CPU's time per phase of a step (forward issued, backward, optimizer step,
no synchronisation added) and, through ``wrap()``, the CPU time trainstream's hooks took a step.
For ``wrap`` it records the step time once the plan has settled, the peak VRAM of those steps,
the host memory the daemon holds for the job, and the bytes that crossed PCIe each way in one
step (paged weights fetched, activations out and back, gradients out, updated weights back);
the lower bound is max(GPU compute, host-to-device bytes / measured bandwidth, device-to-host
bytes / measured bandwidth, bytes both ways / the bandwidth measured with both ways copying at
once: the link and host memory cap what both directions move together), compute being the
stock step's forward and backward, plus the recomputed blocks' extra forwards as the plan
chose them. Full fine-tunes have one more floor: the host optimizer's pass over every
parameter (memory bandwidth), printed beside it.

With ``--trace DIR``, each mode then profiles two more steps (torch.profiler) into
DIR/PRESET_BATCHxSEQ_MODE.json.gz and prints where their time went (see step_trace.py): the
copy engines' and the kernels' busy time, pinned or pageable copies, the CPU's own time by
Python function and operator, and the longest stretches with nothing crossing to the GPU.

    python bench/memory_plan.py [--cases gpt1.8b qwen14b_512 ...] [--json out.json] [--trace DIR]
                                [--cprofile] [--daemon-threads N]
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, HERE)
from step_bench import (add_worker_arguments, answered_as_worker,  # noqa: E402
                        pinned_bandwidth, run_worker)

CASES = {
    "gpt1.8b": dict(kind="gpt", preset="1.8b", batch=8, seq=512, vram_gb=24),
    "qwen14b_512": dict(kind="lora", preset="qwen2.5-14b", batch=1, seq=512, vram_gb=24),
    "qwen14b_2k": dict(kind="lora", preset="qwen2.5-14b", batch=1, seq=2048, vram_gb=24),
    "gpt3.6b": dict(kind="gpt", preset="3.6b", batch=4, seq=512, vram_gb=24,
                    modes=["compute", "wrap", "wrap_paged", "stock"]),
}


def _load(name: str, path: str):
    """A module by its file: bench/hf_models.py and examples/hf_models.py share a name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The Hugging Face cases are hf_models.py's own (one table for both benchmarks).
CASES.update({f"hf_{name}": dict(kind="hf", vram_gb=24, **case) for name, case in _load(
    "hf_models_bench", os.path.join(HERE, "hf_models.py")).CASES.items()})
WARMUP_AFTER_SETTLED, MEASURED = 1, 4


def cap_vram(gb: float) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 2**30 / total), 0)


def build(case: dict, device: str):
    """(model, loss function on a step's batch, trainable parameter count)."""
    if case["kind"] == "gpt":
        from gpt import GPT, PRESETS, synthetic_batch

        config = PRESETS[case["preset"]]
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        with torch.device("cuda"):  # initialised on the GPU (fast), then put where asked
            model = GPT(config)
        model.to(device)

        def loss(s):
            idx = synthetic_batch(config, case["batch"], case["seq"], s, "cuda")
            logits = model(idx[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

        return model, loss, config.parameters
    if case["kind"] == "hf":
        models = _load("hf_models_examples", os.path.join(HERE, "..", "examples", "hf_models.py"))
        model, trainable = models.build(case["preset"], case["tune"],
                                        getattr(torch, case["dtype"]), device=device,
                                        init_device="cuda")

        def loss(s):
            x = models.batch(case["preset"], case["batch"], case["seq"], s, "cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bool(case["autocast"])):
                return model(input_ids=x, labels=x).loss

        return model, loss, trainable
    from qwen_shape import CONFIGS, add_lora, build as build_decoder, lm_loss

    config = CONFIGS[case["preset"]]
    model = build_decoder(config, torch.bfloat16, device=device, init_device="cuda")
    trainable = add_lora(model, r=16)
    g = torch.Generator().manual_seed(0)

    def loss(s):
        idx = torch.randint(0, config.vocab, (case["batch"], case["seq"] + 1), generator=g)
        return lm_loss(model, idx.cuda())

    return model, loss, trainable


def worker(mode: str, case: dict) -> dict:
    torch.manual_seed(0)
    row = {"mode": mode, **case}
    try:
        if mode.startswith("wrap"):
            import trainstream

            # Built on the CPU: a model bigger than the cap never goes to the GPU whole.
            model, loss, trainable = build(case, "cpu")
            cap_vram(case["vram_gb"])
            torch.cuda.reset_peak_memory_stats()
            began = time.perf_counter()
            # wrap_paged: every block streams its weights (the plan would rather not);
            # wrap_depth2: two streamed blocks fetched ahead instead of one; wrap_unstaged: the
            # plan never stages moments through the GPU; wrap_staged<N>: it stages N blocks'.
            options = (dict(param_offload=True) if mode == "wrap_paged" else
                       dict(prefetch_depth=2) if mode == "wrap_depth2" else
                       dict(staged_state_blocks=0) if mode == "wrap_unstaged" else
                       dict(staged_state_blocks=int(mode[len("wrap_staged"):]))
                       if mode.startswith("wrap_staged") else {})
            # Named, so that this job's host memory is read apart from earlier cases' (the
            # daemon keeps an ended job's state a while for a restarted process).
            job = f"memory-plan-{case['preset']}-{case['batch']}x{case['seq']}-{mode}"
            if case["kind"] == "hf":  # as users do: their own torch optimizer
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                        lr=case["lr"])
                model, opt = trainstream.wrap(model, opt, device="cuda", job_id=job, **options)
            else:
                model, opt = trainstream.wrap(model, lr=1e-5, device="cuda", job_id=job,
                                              **options)
            row["wrap_s"] = round(time.perf_counter() - began, 1)
            session = model._trainstream_session
            s = 0
            while session.adapting and s < 30:
                loss(s).backward()
                opt.step()
                opt.zero_grad()
                s += 1
            row["settle_steps"] = s
        else:
            model, loss, trainable = build(case, "cuda")
            opt = None
            if mode == "stock":
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                        lr=case.get("lr", 1e-5), fused=True)
            else:  # compute: every gradient dropped as it lands
                for p in model.parameters():
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
            s = 0
        row["trainable"] = trainable

        phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}

        def step(i):
            # The CPU's time in each phase (no synchronisation added): where the thread that
            # issues the GPU's work spends a step when the GPU waits on it.
            began = time.perf_counter()
            value = loss(i)
            issued = time.perf_counter()
            value.backward()
            backward = time.perf_counter()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            done = time.perf_counter()
            phases["forward"] += issued - began
            phases["backward"] += backward - issued
            phases["step"] += done - backward

        for i in range(s, s + WARMUP_AFTER_SETTLED):
            step(i)
        s += WARMUP_AFTER_SETTLED
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = _transfer_counters(model) if mode.startswith("wrap") else None
        hooks_before = _hook_ms(model) if mode.startswith("wrap") else {}
        for k in phases:
            phases[k] = 0.0
        start = time.perf_counter()
        for i in range(s, s + MEASURED):
            step(i)
        torch.cuda.synchronize()
        row["step_s"] = round((time.perf_counter() - start) / MEASURED, 4)
        row["peak_vram_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        row["cpu_phase_ms"] = {k: round(1e3 * v / MEASURED, 1) for k, v in phases.items()}
        if mode.startswith("wrap"):
            hooks = _hook_ms(model)
            row["hook_ms_per_step"] = {k: round((v - hooks_before.get(k, 0.0)) / MEASURED, 2)
                                       for k, v in hooks.items()}
            after = _transfer_counters(model)
            row.update({k: (after[k] - before[k]) // MEASURED for k in after})
            row.update(_plan_summary(model, opt))
        trace_dir = os.environ.get("TS_BENCH_TRACE")
        if trace_dir:  # every mode: stock's CPU time beside wrap's
            import step_trace

            name = f"{case['preset']}_{case['batch']}x{case['seq']}_{mode}.json.gz"
            path = os.path.join(trace_dir, name)
            s += MEASURED
            with step_trace.profiled(path):
                for i in range(s, s + 2):
                    step(i)
            row["trace"] = step_trace.summarize(path)
        if os.environ.get("TS_BENCH_CPROFILE"):
            # Where the CPU's time goes, by Python function and native call: two steps under
            # cProfile (which slows Python calls, not native ones), top 30 by own time.
            row["cprofile"] = _cprofiled(lambda: [step(i) for i in range(s + 2, s + 4)])
    except torch.OutOfMemoryError as e:
        row.update(oom=True, error=str(e).splitlines()[0][:200],
                   peak_vram_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    return row


def _cprofiled(run) -> list:
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:30]
    return [{"function": f"{os.path.basename(file)}:{line}({name})", "calls": calls,
             "own_ms_per_step": round(1e3 * own / 2, 2),
             "total_ms_per_step": round(1e3 * total / 2, 2)}
            for (file, line, name), (_, calls, own, total, _) in top]


def _transfer_counters(model) -> dict:
    """Bytes that crossed PCIe each way since wrap(), as memory_report() counts them."""
    import trainstream

    pcie = trainstream.memory_report(model)["pcie"]
    return {"h2d_bytes": pcie["to_device_bytes"], "d2h_bytes": pcie["to_host_bytes"]}


def _hook_ms(model) -> dict:
    """Milliseconds trainstream's hooks have taken since wrap(), by hook."""
    import trainstream

    return {k: h["ms"] for k, h in trainstream.memory_report(model)["hooks"]["per_hook"].items()}


def _plan_summary(model, opt) -> dict:
    import trainstream

    report = trainstream.memory_report(model)
    session = model._trainstream_session
    memory = session.client.memory()
    policy = report["activations"]["policy"]
    plan = report["plan"] or {}
    stats = opt.stats()
    last = stats.get("last_step", {})
    threads = max(1, int(stats.get("threads", 1)))
    return {"paged_blocks": len(report["params"]["paged_blocks"]), "blocks": len(policy),
            "offloaded_blocks": policy.count("offload"),
            # Forward waiting for activations' copies to host (max_inflight_bytes), since wrap().
            "inflight_waits": report["activations"]["inflight_waits"],
            "recomputed_blocks": policy.count("recompute"),
            "block_forward_s": plan.get("measured", {}).get("forward_s", 0.0),
            "host_job_bytes": sum(int(j.get("used_bytes", 0)) for j in memory.get("plans", [])
                                  if j.get("job_id") == session.config.connection.job_id),
            "host_update_s": round(float(last.get("update_seconds", 0)) / threads, 4),
            "runs_on": stats.get("runs_on"),
            # Elements whose AdamW state lives in VRAM, updated there (the planner's choice).
            "gpu_state_elements": stats.get("gpu_state", {}).get("elements", 0),
            "gpu_state_blocks": (report["plan"] or {}).get("gpu_state_blocks", 0),
            # Elements updated on the GPU from moments staged out of the daemon.
            "staged_elements": stats.get("staged_state", {}).get("elements", 0),
            "staged_blocks": (report["plan"] or {}).get("staged_blocks", 0),
            "plan": [e["message"] for e in report["events"]
                     if e["kind"] in ("client.plan.applied", "client.wrap.plan",
                                      "client.plan.settled", "client.plan.measured",
                                      "client.plan.watchdog", "client.plan.settling",
                                      "client.plan.remeasured", "client.plan.limit",
                                      "client.plan.kept", "client.plan.gpu_state",
                                      "client.plan.staging_trial")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--trace", default="",
                        help="profile two steps of each mode into this folder")
    parser.add_argument("--daemon-threads", type=int, default=0,
                        help="the daemon's optimizer threads (default: one per core): a full "
                             "fine-tune's host pass shares the cores with the training process")
    parser.add_argument("--cprofile", action="store_true",
                        help="two more steps of each mode under cProfile: the top functions")
    add_worker_arguments(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker, CASES):
        return
    if not torch.cuda.is_available():
        sys.exit("memory_plan.py needs a CUDA GPU")
    from bench_daemon import private_daemon

    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        os.environ["TS_BENCH_TRACE"] = os.path.abspath(args.trace)  # the workers read it
    if args.cprofile:
        os.environ["TS_BENCH_CPROFILE"] = "1"
    bandwidth = pinned_bandwidth()
    print(f"pinned copies: host->device {bandwidth['h2d_gbps']} GB/s, "
          f"device->host {bandwidth['d2h_gbps']} GB/s, each way while the other runs "
          f"{bandwidth['both_each_way_gbps']} GB/s", flush=True)
    rows = []
    flags = [f"--threads={args.daemon_threads}"] if args.daemon_threads else []
    # An ended job's optimizer state is freed a second after its process exits instead of
    # kept ten minutes for a restart: each mode is admitted against the machine, not against
    # the modes run before it.
    fd, config = tempfile.mkstemp(prefix="memory-plan-daemon-", suffix=".conf")
    atexit.register(os.unlink, config)
    with os.fdopen(fd, "w") as f:
        f.write("optimizer_retention_s: 1\n")
    flags.append(f"--config={config}")
    with private_daemon("85%", *flags) as socket:
        for name in args.cases:
            case = CASES[name]
            full = case["kind"] == "gpt" or case.get("tune") == "full"
            modes = args.modes or case.get("modes") or (
                ["stock", "compute", "wrap"] if full else ["stock", "wrap"])
            by_mode = {}
            for mode in modes:
                row = run_worker(__file__, mode, name, socket if mode.startswith("wrap") else None,
                                 args.timeout)
                row["case"] = name
                print(json.dumps(row), flush=True)
                by_mode[mode] = row
            report(name, by_mode, bandwidth)
            rows.extend(by_mode.values())
            if args.json:  # after every case: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"bench": "memory_plan", "date": time.strftime("%Y-%m-%d"),
                               "host": platform.node(), "gpu": torch.cuda.get_device_name(0),
                               "torch": torch.__version__, "bandwidth": bandwidth,
                               "daemon_threads": args.daemon_threads or "one per core",
                               "rows": rows}, f, indent=1)


def report(name: str, rows: dict, bandwidth: dict) -> None:
    print(f"\n== {name}")
    for mode, row in rows.items():
        if row.get("oom"):
            text = f"out of memory (peak {row['peak_vram_gib']} GiB)"
        elif row.get("failed"):
            text = "failed: " + (row.get("stderr", "").strip().splitlines() or ["?"])[-1][:160]
        else:
            text = f"{1000 * row['step_s']:.1f} ms/step, peak {row['peak_vram_gib']} GiB"
        print(f"  {mode:13s} {text}")
    for mode in rows:
        if mode.startswith("wrap") and "step_s" in rows[mode]:
            _bound(mode, rows[mode], rows, bandwidth)
    for mode, row in rows.items():
        if "cpu_phase_ms" in row:
            phases = row["cpu_phase_ms"]
            print(f"    {mode}: the CPU's step: forward issued in {phases['forward']} ms, "
                  f"backward {phases['backward']} ms, optimizer step {phases['step']} ms")
        if row.get("hook_ms_per_step"):
            print(f"      trainstream's hooks a step ({sum(row['hook_ms_per_step'].values()):.1f}"
                  " ms): " + ", ".join(f"{k} {v}" for k, v in row["hook_ms_per_step"].items()))
    for mode, row in rows.items():
        if "cprofile" in row:
            print(f"    {mode}, cProfile, per step: own ms, total ms, calls, function")
            for f in row["cprofile"]:
                print(f"      {f['own_ms_per_step']:8.2f} {f['total_ms_per_step']:8.2f} "
                      f"{f['calls'] // 2:6d}  {f['function']}")
        if "trace" in row:
            import step_trace

            print(f"    {mode}, two steps profiled:")
            for line in step_trace.describe(row["trace"]):
                print("      " + line)


def _bound(mode: str, wrap: dict, rows: dict, bandwidth: dict) -> None:
    base = rows.get("compute") or rows.get("stock") or {}
    compute = base.get("step_s", 0.0)
    # A recomputed block runs its forward again.
    compute += wrap.get("recomputed_blocks", 0) * wrap.get("block_forward_s", 0.0)
    h2d = wrap["h2d_bytes"] / (bandwidth["h2d_gbps"] * 1e9)
    d2h = wrap["d2h_bytes"] / (bandwidth["d2h_gbps"] * 1e9)
    # Bytes going both ways at once share what the link and host memory give both at once.
    both = ((wrap["h2d_bytes"] + wrap["d2h_bytes"]) / (2e9 * bandwidth["both_each_way_gbps"])
            if "both_each_way_gbps" in bandwidth else 0.0)
    pcie = max(h2d, d2h, both)
    bound = max(compute, pcie)
    wrap["compute_s"] = round(compute, 4)
    wrap["pcie_s"] = round(pcie, 4)
    wrap["lower_bound_s"] = round(bound, 4)
    wrap["step_over_bound"] = round(wrap["step_s"] / bound, 3) if bound else None
    print(f"  {mode}: {wrap['paged_blocks']} of {wrap['blocks']} blocks stream weights, "
          f"{wrap['offloaded_blocks']} page activations, {wrap['recomputed_blocks']} recompute, "
          f"{wrap.get('gpu_state_blocks', 0)} keep their AdamW state in VRAM "
          f"({wrap.get('gpu_state_elements', 0) / 1e6:.0f}M elements), "
          f"{wrap.get('staged_blocks', 0)} stage theirs through the GPU "
          f"({wrap.get('staged_elements', 0) / 1e6:.0f}M elements); "
          f"host memory {wrap['host_job_bytes'] / 2**30:.1f} GiB; wrap() took {wrap['wrap_s']} s, "
          f"settled after {wrap['settle_steps']} steps")
    print(f"    PCIe a step: {wrap['h2d_bytes'] / 1e9:.2f} GB to the GPU ({1000 * h2d:.1f} ms), "
          f"{wrap['d2h_bytes'] / 1e9:.2f} GB back ({1000 * d2h:.1f} ms), all of it at the "
          f"rate both ways at once {1000 * both:.1f} ms")
    print(f"    lower bound {1000 * bound:.1f} ms = max(compute {1000 * compute:.1f}, "
          f"PCIe {1000 * pcie:.1f}); step / bound {wrap['step_over_bound']}")
    host = wrap.get("host_update_s", 0.0)
    if host > bound:
        wrap["step_over_host_optimizer"] = round(wrap["step_s"] / host, 3)
        print(f"    host optimizer pass {1000 * host:.1f} ms (memory bandwidth; a full "
              f"fine-tune's floor): step / that {wrap['step_s'] / host:.2f}")
    if "step_s" in rows.get("stock", {}):
        print(f"    stock without the cap: {1000 * rows['stock']['step_s']:.1f} ms, peak "
              f"{rows['stock']['peak_vram_gib']} GiB; {mode} / stock "
              f"{wrap['step_s'] / rows['stock']['step_s']:.2f}")


if __name__ == "__main__":
    main()
