# SPDX-License-Identifier: Apache-2.0
"""causal_lm_logprobs and reference_logprobs on a tiny transformers model with PEFT LoRA,
against the log-softmax of the model's whole logits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh "
                                          "installs it)")

from trainstream.integrations.huggingface import (causal_lm_logprobs,  # noqa: E402
                                                  reference_logprobs)


def _model():
    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(6)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # adapters that change the outputs (LoRA starts with B = 0)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def _from_logits(model, ids, labels, average=False):
    logits = model(input_ids=ids).logits.float()
    targets = labels[:, 1:]
    counted = targets != -100
    logp = torch.log_softmax(logits[:, :-1], -1).gather(
        -1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    total = (logp * counted).sum(-1)
    return total / counted.sum(-1) if average else total


@pytest.mark.parametrize("average", [False, True])
def test_causal_lm_logprobs_equal_the_whole_logits_and_their_gradients(average):
    model = _model()
    ids = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    ours = causal_lm_logprobs(model, ids, labels, chunk_size=7, average=average)
    expected = _from_logits(model, ids, labels, average)
    assert ours.shape == (3,) and torch.allclose(ours, expected, atol=1e-5), (ours, expected)
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(ours.sum(), lora)
    want = torch.autograd.grad(expected.sum(), lora)
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < 1e-5
    assert any(g.abs().max() > 0 for g in got)


def test_reference_logprobs_are_the_base_with_adapters_off_once():
    model = _model()
    batches = [{"input_ids": torch.randint(0, 97, (2, 8), generator=torch.Generator()
                                           .manual_seed(s))} for s in range(3)]
    model.train()
    ref = reference_logprobs(model, batches)
    assert ref.shape == (6,) and ref.dtype == torch.float32 and ref.device.type == "cpu"
    assert not ref.requires_grad and model.training  # its mode given back
    with torch.no_grad(), model.disable_adapter():
        base = torch.cat([_from_logits(model, b["input_ids"], b["input_ids"]) for b in batches])
    with torch.no_grad():
        adapted = torch.cat([_from_logits(model, b["input_ids"], b["input_ids"])
                             for b in batches])
    assert torch.allclose(ref, base, atol=1e-5)
    assert not torch.allclose(ref, adapted, atol=1e-3)  # the adapters are on again, and matter


def test_dpo_through_wrap_starts_at_log_2_and_learns_the_preferences():
    """The seed's DPO loop: the reference is the base with its adapters off, computed once, so
    the first loss is exactly log 2 (LoRA starts as no change); wrap()'s optimizer then raises
    the chosen answers' reward over the rejected ones'."""
    import math

    import trainstream

    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(6)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model, opt = trainstream.wrap(model, torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2), device="cpu")
    g = torch.Generator().manual_seed(0)
    pairs = [({"input_ids": torch.randint(0, 97, (2, 10), generator=g)},
              {"input_ids": torch.randint(0, 97, (2, 10), generator=g)}) for _ in range(3)]
    ref = reference_logprobs(model, [b for pair in pairs for b in pair]).split(2)
    losses, margins = [], []
    for _ in range(3):
        for k, (chosen, rejected) in enumerate(pairs):
            loss, chosen_reward, rejected_reward = trainstream.dpo_loss(
                causal_lm_logprobs(model, chosen["input_ids"]),
                causal_lm_logprobs(model, rejected["input_ids"]), ref[2 * k], ref[2 * k + 1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            margins.append((chosen_reward - rejected_reward).mean().item())
    trainstream.unwrap(model)
    assert abs(losses[0] - math.log(2)) < 1e-5, losses[0]
    assert losses[-1] < losses[0] - 0.02 and margins[-1] > 0.05, (losses, margins)
