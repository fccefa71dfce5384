# SPDX-License-Identifier: Apache-2.0
"""What the Hugging Face examples share: a model by preset name (random weights, examples/
hf_models.py) or from a checkpoint (a folder, or a Hub id already in the local cache), and a
dataset of token rows that is the same for every engine and run."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402


def model_for(name: str, tune: str, dtype: torch.dtype) -> torch.nn.Module:
    """A preset of hf_models.py with random weights, or a checkpoint (never downloaded)."""
    if name in hf_models.PRESETS:
        return hf_models.build(name, tune, dtype)[0]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype,
                                                              local_files_only=True)
    if tune == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules="all-linear"))
    return model


def vocabulary(model: torch.nn.Module) -> int:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.config.vocab_size


class TokenRows(torch.utils.data.Dataset):
    """``rows`` rows of ``seq`` random token ids (labels = inputs), seeded."""

    def __init__(self, vocab: int, rows: int, seq: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
