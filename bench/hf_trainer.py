# SPDX-License-Identifier: Apache-2.0
"""The Hugging Face Trainer through trainstreamd: ``TrainStreamTrainer`` under a VRAM cap against
the stock ``transformers.Trainer`` (without the cap, and under it), each in a fresh process on the
same token rows, bf16: each step's loss and time, peak VRAM, and the ``ts_*`` figures.

    python bench/hf_trainer.py [--cases qwen1.5b_full qwen14b_lora_2k ...] [--modes ...]
        [--steps 12] [--json out.json]

Cases: Qwen2.5-1.5B full fine-tune (4x512) and Qwen2.5-14B LoRA r=16 at 1x2048, where the
stock Trainer's logits (fp32, 1.16 GiB) do not fit beside the model under 24 GiB. ``tiny`` runs
a tiny Qwen2 on the CPU (timings that do not count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from step_bench import (add_worker_arguments, answered_as_worker, run_worker,  # noqa: E402
                        said_failure, write_results)

CASES = {
    "qwen1.5b_full": dict(preset="qwen2.5-1.5b", tune="full", dtype="float32", batch=4, seq=512,
                          lr=2e-5, cap_gib=24),
    "qwen14b_lora_2k": dict(preset="qwen2.5-14b", tune="lora", dtype="bfloat16", batch=1,
                            seq=2048, lr=1e-4, cap_gib=24),
    "tiny": dict(preset="tiny-qwen2", tune="full", dtype="float32", batch=2, seq=32, lr=1e-3,
                 cap_gib=0),
}
MODES = ("stock", "stock_capped", "trainstream_capped")
# Not run by default: the same run without clipping (max_grad_norm=0), the bound clipping's
# wait for the step's last gradient is measured against.
EXTRA_MODES = ("trainstream_capped_noclip",)
# 24: the plan settles within about a dozen steps; the later half is timed.
STEPS = int(os.environ.get("TS_BENCH_STEPS", "24"))


def worker(mode: str, case: dict) -> dict:
    import transformers
    import hf_models
    from hf_common import TokenRows

    cuda = torch.cuda.is_available()
    ours = mode.startswith("trainstream")
    clip = 0.0 if mode.endswith("noclip") else 1.0
    dtype = getattr(torch, case["dtype"])
    # Built where the engine wants it: on the CPU for trainstream (a model bigger than the cap
    # never goes to the GPU whole), drawn on the GPU either way (quick).
    model, _ = hf_models.build(case["preset"], case["tune"], dtype,
                               device="cpu" if ours or not cuda else "cuda",
                               init_device="cuda" if cuda else "cpu")
    if cuda and "capped" in mode and case["cap_gib"]:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, case["cap_gib"] * 2**30 / total))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    vocab = hf_models.PRESETS[case["preset"]].config["vocab_size"]
    rows = TokenRows(vocab, STEPS * case["batch"], case["seq"])
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-bench-"),
        per_device_train_batch_size=case["batch"], learning_rate=case["lr"], max_steps=STEPS,
        logging_steps=1, save_strategy="no", report_to="none", bf16=cuda, use_cpu=not cuda,
        optim="adamw_torch", max_grad_norm=clip, disable_tqdm=True)
    times: list = []

    class Clock(transformers.TrainerCallback):
        began = 0.0

        def on_step_begin(self, *a, **k):
            Clock.began = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - Clock.began)

    row = {"mode": mode, "max_grad_norm": clip, **case}
    try:
        if ours:
            from trainstream.integrations.huggingface import TrainStreamTrainer

            trainer = TrainStreamTrainer(model=model, args=args, train_dataset=rows,
                                         callbacks=[Clock()])
        else:
            trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                           callbacks=[Clock()])
        trainer.train()
    except torch.OutOfMemoryError as e:
        row.update(oom=True, error=str(e).splitlines()[0][:200])
        return row
    history = trainer.state.log_history
    later = times[len(times) // 2:] or times
    row.update(losses=[round(h["loss"], 5) for h in history if "loss" in h],
               grad_norms=[round(float(h["grad_norm"]), 4) for h in history
                           if h.get("grad_norm") is not None],
               step_s=round(statistics.median(later), 4), times=[round(t, 4) for t in times],
               peak_vram_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0,
               ts=[{k: v for k, v in h.items() if k.startswith("ts_")} for h in history
                   if "ts_host_state_gb" in h][-1:])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["qwen1.5b_full", "qwen14b_lora_2k"],
                        choices=list(CASES))
    parser.add_argument("--timeout", type=int, default=1200)
    add_worker_arguments(parser)
    args = parser.parse_args()
    if answered_as_worker(args, worker, CASES):
        return
    rows = []
    for name in args.cases:
        print(f"\n== {name}: {CASES[name]}", flush=True)
        by_mode = {}
        for mode in args.modes or MODES:
            row = run_worker(__file__, mode, name, None, args.timeout)
            row["case"] = name
            by_mode[mode] = row
            rows.append(row)
            if not said_failure(mode, row):
                print(f"  {mode:20s} {row['step_s']:.3f} s/step, peak {row['peak_vram_gib']} GiB, "
                      f"losses {row['losses'][:3]} ... {row['losses'][-1]}", flush=True)
        stock = by_mode.get("stock", {}).get("losses")
        ours = by_mode.get("trainstream_capped", {}).get("losses")
        if stock and ours:
            print(f"  largest loss difference, trainstream under the cap against stock without "
                  f"it: {max(abs(a - b) for a, b in zip(stock, ours)):.4f}")
    if args.json:
        write_results(args.json, "hf_trainer", rows, steps=STEPS)


if __name__ == "__main__":
    main()
