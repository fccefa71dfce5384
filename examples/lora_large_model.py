# SPDX-License-Identifier: Apache-2.0
"""LoRA on a base bigger than the GPU (QLoRA-style): ``load_model`` has trainstreamd read the
checkpoint once, quantizing while it reads, and every process of the user shares that one host
copy; PEFT adds the adapters; ``TrainStreamTrainer`` trains them.

    python examples/lora_large_model.py --model PATH_OR_HUB_ID [--quantize nf4] [--steps 10]
    python examples/lora_large_model.py --random tiny-qwen2 [--quantize int8]

``--model``: a checkpoint folder (config.json beside its .safetensors) or a Hub id already in
the local Hugging Face cache (nothing is downloaded). ``--random PRESET``: writes a checkpoint
of an examples/hf_models.py preset with random weights to a temporary folder first, to try
this without one.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402
from hf_common import TokenRows  # noqa: E402

import trainstream  # noqa: E402
from trainstream.integrations.huggingface import TrainStreamTrainer  # noqa: E402


def random_checkpoint(preset: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"{preset}-")
    atexit.register(shutil.rmtree, folder, True)
    model, _ = hf_models.build(preset, "full", torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model")
    source.add_argument("--random", choices=sorted(hf_models.PRESETS))
    parser.add_argument("--quantize", default="nf4" if cuda else None,
                        choices=[None, "int8", "nf4", "fp8", "nvfp4"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512 if cuda else 32)
    parser.add_argument("--rank", type=int, default=16)
    options = parser.parse_args()
    import peft

    path = options.model or random_checkpoint(options.random)
    model = trainstream.load_model(path, quantize=options.quantize)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=options.rank, lora_alpha=2 * options.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules="all-linear"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    vocab = model.get_base_model().config.vocab_size
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="lora-out-"), per_device_train_batch_size=options.batch,
        learning_rate=1e-4, max_steps=options.steps, logging_steps=1, save_strategy="no",
        report_to="none", bf16=cuda, use_cpu=not cuda, optim="adamw_torch", disable_tqdm=True)
    trainer = TrainStreamTrainer(model=model, args=args, train_dataset=TokenRows(
        vocab, options.steps * options.batch, options.seq))
    trainer.train()
    report = trainstream.memory_report(trainer.model)
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print(f"\nLoRA r={options.rank} ({trained:,} parameters) over {path} "
          f"({options.quantize or 'bf16'}): losses {losses}")
    base = report.get("base")
    if base:
        print(f"the base: {base['stored_bytes'] / 2**20:,.1f} MiB in the daemon, shared by "
              f"{base['users']} process(es); the adapters' optimizer state: "
              f"{report['optimizer']['state_bytes'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
