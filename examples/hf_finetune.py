# SPDX-License-Identifier: Apache-2.0
"""Fine-tunes a Hugging Face causal LM with ``TrainStreamTrainer`` (the transformers Trainer
with its optimizer state, gradients and activations where trainstream puts them), optionally
beside the stock Trainer on the same batches.

    python examples/hf_finetune.py [--model qwen2.5-1.5b|tiny-qwen2|PATH] [--lora] [--steps 10]
        [--batch 4] [--seq 512] [--accumulation 1] [--compare] [--activation-offload]

``--model``: a preset of examples/hf_models.py (random weights; the default is tiny-qwen2 on a
machine without a GPU) or a checkpoint folder / Hub id in the local cache. bf16 on a GPU.
``--compare``: the stock Trainer too, each step's loss side by side with its time and peak VRAM.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import TokenRows, model_for, vocabulary  # noqa: E402

from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402


class StepClock(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.times: list = []
        self._began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._began)


def run(trainer_class, model, dataset, args, **extra) -> dict:
    clock = StepClock()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, callbacks=[clock],
                            **extra)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return {"losses": losses, "times": clock.times, "peak_gib": peak, "trainer": trainer}


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b" if cuda else "tiny-qwen2")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4 if cuda else 2)
    parser.add_argument("--seq", type=int, default=512 if cuda else 32)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--activation-offload", action="store_true")
    options = parser.parse_args()
    tune = "lora" if options.lora else "full"
    model = model_for(options.model, tune, torch.float32)
    stock_model = copy.deepcopy(model) if options.compare else None
    rows = options.steps * options.batch * options.accumulation
    dataset = TokenRows(vocabulary(model), rows, options.seq)
    out = tempfile.mkdtemp(prefix="hf-finetune-")
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=options.batch,
        gradient_accumulation_steps=options.accumulation, learning_rate=options.lr,
        max_steps=options.steps, logging_steps=1, save_strategy="no", report_to="none",
        bf16=cuda, use_cpu=not cuda, optim="adamw_torch", max_grad_norm=1.0,
        disable_tqdm=True)
    ours = run(TrainStreamTrainer, model, dataset, args,
               trainstream={"activation_offload": True} if options.activation_offload else None)
    rows_out = [("TrainStreamTrainer", ours)]
    if stock_model is not None:
        rows_out.append(("Trainer (stock)", run(transformers.Trainer, stock_model, dataset,
                                                args)))
    print(f"\n{options.model} {tune}, {options.batch}x{options.seq}, {options.steps} steps")
    print("step  " + "  ".join(f"{name:>22s}" for name, _ in rows_out))
    for s in range(options.steps):
        print(f"{s + 1:4d}  " + "  ".join(
            f"{r['losses'][s]:10.4f} {r['times'][s]:9.3f}s" if s < len(r["losses"]) else " " * 22
            for _, r in rows_out))
    for name, r in rows_out:
        later = sorted(r["times"][len(r["times"]) // 2:]) or [0.0]
        print(f"{name}: median of the later steps {later[len(later) // 2]:.3f} s, "
              f"peak VRAM {r['peak_gib']:.2f} GiB")
    if len(rows_out) == 2:
        a, b = rows_out[0][1]["losses"], rows_out[1][1]["losses"]
        print(f"largest loss difference: {max(abs(x - y) for x, y in zip(a, b)):.2e}")
    logged = [h for h in ours["trainer"].state.log_history if "ts_host_state_gb" in h]
    if logged:
        print("trainstream's figures at the last log: " + ", ".join(
            f"{k}={v}" for k, v in logged[-1].items() if k.startswith("ts_")))


if __name__ == "__main__":
    main()
