# SPDX-License-Identifier: Apache-2.0
"""Direct Preference Optimization with LoRA, through trainstreamd: the reference is the same
base with its adapters off (``reference_logprobs``, computed once up front), so no second model
is held; each sequence's log-probability comes from the hidden states in chunks
(``causal_lm_logprobs``), so the logits never exist whole.

    python examples/dpo_lora.py [--model tiny-qwen2|qwen2.5-1.5b|PATH] [--steps 30] [--beta 0.1]

The preferences are made up so that learning them is visible: after a random prompt, the
chosen answer repeats one fixed phrase and the rejected answer is random tokens. The chosen
reward should pull ahead of the rejected one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import model_for, vocabulary  # noqa: E402

import trainstream  # noqa: E402
from trainstream.integrations.huggingface import (causal_lm_logprobs,  # noqa: E402
                                                  reference_logprobs, wrap_hf)


def pairs(vocab: int, count: int, batch: int, prompt: int, answer: int, device: str) -> list:
    g = torch.Generator().manual_seed(0)
    phrase = torch.randint(0, vocab, (answer,), generator=g)
    out = []
    for _ in range(count):
        question = torch.randint(0, vocab, (batch, prompt), generator=g)
        chosen = torch.cat([question, phrase.expand(batch, answer)], 1)
        rejected = torch.cat([question, torch.randint(0, vocab, (batch, answer), generator=g)], 1)
        batches = []
        for ids in (chosen, rejected):
            labels = ids.clone()
            labels[:, :prompt] = -100  # the prompt does not count
            batches.append({"input_ids": ids.to(device), "labels": labels.to(device)})
        out.append(tuple(batches))
    return out


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b" if cuda else "tiny-qwen2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=8, help="preference pairs, cycled")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=5e-4)
    options = parser.parse_args()
    device = "cuda" if cuda else "cpu"
    model = model_for(options.model, "lora", torch.bfloat16 if cuda else torch.float32)
    model, optimizer = wrap_hf(model, torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=options.lr), device=device)
    data = pairs(vocabulary(model), options.pairs, options.batch, 8, 8, device)
    reference = reference_logprobs(model, [b for pair in data for b in pair]).split(options.batch)
    margins = []
    for step in range(options.steps):
        k = step % len(data)
        chosen, rejected = data[k]
        pc = causal_lm_logprobs(model, chosen["input_ids"], chosen["labels"])
        pr = causal_lm_logprobs(model, rejected["input_ids"], rejected["labels"])
        loss, chosen_reward, rejected_reward = trainstream.dpo_loss(
            pc, pr, reference[2 * k].to(pc.device), reference[2 * k + 1].to(pc.device),
            beta=options.beta)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        margins.append(float((chosen_reward - rejected_reward).mean()))
        print(f"step {step + 1:3d}  loss {loss.item():.4f}  chosen {chosen_reward.mean():+.4f}  "
              f"rejected {rejected_reward.mean():+.4f}", flush=True)
    first, last = margins[0], sum(margins[-3:]) / len(margins[-3:])
    verdict = "learned" if last > first else "did not learn"
    print(f"reward margin (chosen - rejected): {first:+.4f} at the first step, {last:+.4f} at "
          f"the last: the preferences were {verdict}")
    trainstream.unwrap(model)
    if last <= first:
        sys.exit(1)


if __name__ == "__main__":
    main()
