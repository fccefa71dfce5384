# SPDX-License-Identifier: Apache-2.0
"""DPO with LoRA on a Qwen2.5-14B-config model under a 24 GiB VRAM cap: ``wrap_hf`` with
``reference_logprobs`` (the frozen base with its adapters off, once, up front) and
``causal_lm_logprobs`` (the head handed one position, the log-probabilities taken in chunks),
against the same preference loop in plain PyTorch (the model's whole fp32 logits) without the
cap, with it, and through TrainStream 0.4.1 under it. Each engine in a fresh process on the same
pairs: each step's DPO loss, chosen and rejected rewards, time, peak VRAM, PCIe bytes.

    python bench/dpo.py [--cases qwen14b_lora_1k] [--modes ...] [--json out.json]

Every step runs the chosen and the rejected sequences of one pair as one batch of two (as TRL's
DPOTrainer concatenates them), so the weights stream once a step. ``tiny`` runs a tiny Qwen2 on
the CPU (timings that do not count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from step_bench import (add_worker_arguments, answered_as_worker, run_worker,  # noqa: E402
                        said_failure, write_results)

CASES = {
    # A 512-token prompt and 512-token answers: each step's batch is 2x1,024 positions, whose
    # fp32 logits (1.16 GiB) the plain loop holds beside the streamed base.
    "qwen14b_lora_1k": dict(preset="qwen2.5-14b", dtype="bfloat16", prompt=512, answer=512,
                            lr=5e-5, beta=0.1, cap_gib=24),
    "tiny": dict(preset="tiny-qwen2", dtype="float32", prompt=8, answer=8, lr=5e-4, beta=0.1,
                 cap_gib=0),
}
MODES = ("stock", "stock_capped", "ts041_capped", "trainstream_capped")
STEPS = int(os.environ.get("TS_BENCH_STEPS", "16"))
PAIRS = 4  # cycled: the reference is computed for each once, up front
TS041 = os.path.join(HERE, "..", ".peers", "trainstream-0.4.1")


def preference_pairs(vocab: int, case: dict) -> list:
    """``PAIRS`` (input_ids [2, T], labels [2, T]): row 0 the chosen answer (one fixed phrase),
    row 1 the rejected one (random tokens), after the same random prompt, which does not count."""
    g = torch.Generator().manual_seed(0)
    prompt, answer = case["prompt"], case["answer"]
    phrase = torch.randint(0, vocab, (answer,), generator=g)
    pairs = []
    for _ in range(PAIRS):
        question = torch.randint(0, vocab, (prompt,), generator=g)
        ids = torch.stack([torch.cat([question, phrase]),
                           torch.cat([question, torch.randint(0, vocab, (answer,), generator=g)])])
        labels = ids.clone()
        labels[:, :prompt] = -100
        pairs.append((ids, labels))
    return pairs


def whole_logits_logprobs(model: torch.nn.Module, ids: torch.Tensor,
                          labels: torch.Tensor) -> torch.Tensor:
    """What a plain PyTorch loop computes: the model's logits for every position, in fp32."""
    logits = model(input_ids=ids).logits.float()[:, :-1]
    targets = labels[:, 1:]
    counted = targets != -100
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
    return (logp.squeeze(-1) * counted).sum(-1)


def worker(mode: str, case: dict) -> dict:
    if mode.startswith("ts041"):
        sys.path.insert(0, os.path.abspath(TS041))  # 0.4.1, never our package
    import hf_models

    cuda = torch.cuda.is_available()
    ours = mode.startswith("trainstream")
    capped = mode.endswith("capped") and cuda and case["cap_gib"]
    device = "cuda" if cuda else "cpu"
    row: dict = {"mode": mode, **case, "steps": STEPS, "error": None}
    began = time.perf_counter()
    # Drawn on the GPU (seconds for 14B), then where the engine wants it: an offloading engine
    # takes it from the CPU; the plain loop holds it in VRAM (under the cap, its first
    # allocation past the cap fails, as a user's would).
    offloading = not mode.startswith("stock")
    model, trainable = hf_models.build(case["preset"], "lora", getattr(torch, case["dtype"]),
                                       device="cpu" if offloading or not cuda else "cuda",
                                       init_device=device)
    row.update(trainable=trainable, build_s=round(time.perf_counter() - began, 1))
    if cuda:
        torch.cuda.empty_cache()
        if capped:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, case["cap_gib"] * 2**30 / total))
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=case["lr"])
    import trainstream

    row["engine"] = (f"trainstream {getattr(trainstream, '__version__', 'main')}"
                     if not mode.startswith("stock") else f"torch {torch.__version__}")
    pairs = preference_pairs(hf_models.PRESETS[case["preset"]].config["vocab_size"], case)
    times, losses, margins = [], [], []
    try:
        began = time.perf_counter()
        if ours:
            from trainstream.integrations.huggingface import (causal_lm_logprobs,
                                                              reference_logprobs, wrap_hf)

            model, opt = wrap_hf(model, opt, device=device)
            logprobs = causal_lm_logprobs
        elif mode.startswith("ts041"):
            model, opt = trainstream.wrap(model, opt, device=device, quantize="none")
            logprobs = whole_logits_logprobs
        else:
            logprobs = whole_logits_logprobs
        row["wrap_s"] = round(time.perf_counter() - began, 1)
        began = time.perf_counter()
        batches = [dict(input_ids=ids.to(device), labels=labels.to(device))
                   for ids, labels in pairs]
        if ours:
            reference = reference_logprobs(model, batches)
        else:  # the same recipe by hand: the adapters off, no gradients, eval mode
            model.eval()
            with torch.no_grad(), model.disable_adapter():
                reference = torch.cat([logprobs(model, b["input_ids"], b["labels"]).float().cpu()
                                       for b in batches])
            model.train()
        row["reference_s"] = round(time.perf_counter() - began, 2)
        row["reference"] = [round(float(v), 3) for v in reference]
        reference = reference.view(PAIRS, 2)
        pcie_from = None
        for step in range(STEPS):
            if ours and step == STEPS // 2:
                pcie_from = trainstream.memory_report(model)["pcie"]
            k = step % PAIRS
            start = time.perf_counter()
            policy = logprobs(model, batches[k]["input_ids"], batches[k]["labels"])
            ref = reference[k].to(policy.device)
            loss, chosen, rejected = trainstream.dpo_loss(
                policy[:1], policy[1:], ref[:1], ref[1:], beta=case["beta"]) if ours else (
                _dpo(policy, ref, case["beta"]))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(round(loss.item(), 5))
            margins.append(round(float(chosen.sum() - rejected.sum()), 5))
    except torch.OutOfMemoryError as e:
        row.update(oom=True, error=str(e).splitlines()[0][:240])
        return row
    later = times[len(times) // 2:] or times
    row.update(losses=losses, margins=margins, times=[round(t, 4) for t in times],
               step_s=round(statistics.median(later), 4),
               nonfinite=sum(1 for v in losses if v != v or abs(v) == float("inf")))
    if cuda:
        row.update(peak_vram_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    if ours and pcie_from is not None:
        pcie = trainstream.memory_report(model)["pcie"]
        counted = STEPS - STEPS // 2
        row["h2d_bytes"] = (int(pcie["to_device_bytes"]) - int(pcie_from["to_device_bytes"])) \
            // counted
        row["d2h_bytes"] = (int(pcie["to_host_bytes"]) - int(pcie_from["to_host_bytes"])) \
            // counted
    return row


def _dpo(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple:
    """DPO's loss and rewards written out as a plain loop would (row 0 chosen, row 1 rejected):
    the reference for trainstream.dpo_loss, which the other rows do not use."""
    chosen = beta * (policy[0] - reference[0])
    rejected = beta * (policy[1] - reference[1])
    loss = -torch.nn.functional.logsigmoid(chosen - rejected)
    return loss, chosen.detach(), rejected.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["qwen14b_lora_1k"], choices=list(CASES))
    parser.add_argument("--timeout", type=int, default=900)
    add_worker_arguments(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker, CASES):
        return
    bandwidth = {}
    if torch.cuda.is_available():
        from step_bench import pinned_bandwidth

        bandwidth = pinned_bandwidth()
        print(f"pinned copies: {bandwidth}", flush=True)
    rows = []
    for name in args.cases:
        print(f"\n== {name}: {CASES[name]}", flush=True)
        by_mode = {}
        for mode in args.modes or MODES:
            row = run_worker(__file__, mode, name, None, args.timeout)
            row["case"] = name
            by_mode[mode] = row
            rows.append(row)
            if said_failure(mode, row):
                continue
            bound = ""
            if "h2d_bytes" in row and bandwidth:
                pcie_s = max(row["h2d_bytes"] / (bandwidth["h2d_gbps"] * 1e9),
                             row["d2h_bytes"] / (bandwidth["d2h_gbps"] * 1e9))
                compute = by_mode.get("stock", {}).get("step_s") or 0.0
                row["pcie_s"], row["lower_bound_s"] = round(pcie_s, 4), round(
                    max(pcie_s, compute), 4)
                bound = (f", bound {row['lower_bound_s']:.3f} s (PCIe {pcie_s:.3f} s, "
                         f"stock {compute:.3f} s) = {row['step_s'] / row['lower_bound_s']:.2f}x")
            print(f"  {mode:20s} {row['step_s']:.3f} s/step{bound}, peak "
                  f"{row.get('peak_vram_gib', 0)} GiB, wrap {row.get('wrap_s')} s, reference "
                  f"{row['reference_s']} s, losses {row['losses'][:2]} ... {row['losses'][-1]}, "
                  f"margin {row['margins'][0]:+.3f} -> {row['margins'][-1]:+.3f}", flush=True)
        stock = by_mode.get("stock", {})
        for mode in ("trainstream_capped", "ts041_capped"):
            other = by_mode.get(mode, {})
            if stock.get("losses") and other.get("losses"):
                other["loss_diff"] = round(max(abs(a - b) for a, b in
                                               zip(stock["losses"], other["losses"])), 5)
                other["reference_diff"] = round(max(abs(a - b) for a, b in
                                                    zip(stock["reference"], other["reference"])), 4)
                print(f"  {mode} against stock without the cap: losses within "
                      f"{other['loss_diff']}, reference log-probabilities within "
                      f"{other['reference_diff']}")
        ours, peer = by_mode.get("trainstream_capped", {}), by_mode.get("ts041_capped", {})
        if ours.get("step_s") and peer.get("step_s"):
            print(f"  trainstream's step over 0.4.1's: {ours['step_s'] / peer['step_s']:.2f}")
    if args.json:
        write_results(args.json, "dpo", rows, steps=STEPS, bandwidth=bandwidth)


if __name__ == "__main__":
    main()
