# SPDX-License-Identifier: Apache-2.0
"""The losses from hidden states (trainstream.chunked_cross_entropy, causal_lm_loss,
sequence_logprobs, dpo_loss) against the same losses computed from the whole logits by torch
and transformers: values and the gradients of the hidden states, the head and its bias."""

from __future__ import annotations

import pytest

import trainstream

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _inputs(seed=0, batch=3, positions=11, width=16, vocab=37, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, positions, width, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64) / 4
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, vocab, (batch, positions), generator=g)
    labels[0, :4] = -100  # a prompt that does not count
    leaves = [t.requires_grad_(True) for t in (hidden, weight, b) if t is not None]
    return hidden, weight, b, labels, leaves


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("reduction,num_items", [("mean", None), ("sum", None), ("mean", 7)])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_chunked_cross_entropy_is_cross_entropy_of_the_logits(reduction, num_items, chunk_size):
    hidden, weight, bias, labels, leaves = _inputs()
    ours = trainstream.chunked_cross_entropy(hidden, weight, labels, bias, chunk_size=chunk_size,
                                             reduction=reduction, num_items=num_items)
    logits = F.linear(hidden, weight, bias).reshape(-1, weight.shape[0])
    if num_items is None:
        reference = F.cross_entropy(logits, labels.reshape(-1), reduction=reduction)
    else:
        reference = F.cross_entropy(logits, labels.reshape(-1), reduction="sum") / num_items
    assert ours.dtype == torch.float64  # the logits are fp32, or as wide as the inputs
    assert torch.allclose(ours.double(), reference, rtol=1e-6), (ours, reference)
    for a, b in zip(_grads(ours, leaves), _grads(reference, leaves)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_causal_lm_loss_is_transformers_loss_of_the_models_logits():
    transformers = pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(config)
    x = torch.randint(0, 61, (2, 13))
    labels = x.clone()
    labels[:, :3] = -100
    hidden = model.model(input_ids=x).last_hidden_state
    head = model.get_output_embeddings().weight
    ours = trainstream.causal_lm_loss(hidden, head, labels, chunk_size=4)
    reference = ForCausalLMLoss(F.linear(hidden, head), labels, 61)
    assert torch.allclose(ours, reference, rtol=1e-5), (ours, reference)
    params = [p for p in model.parameters()]
    ours_g = torch.autograd.grad(ours, params, retain_graph=True)
    ref_g = torch.autograd.grad(reference, params)
    assert max((a - b).abs().max().item() for a, b in zip(ours_g, ref_g)) < 1e-5


@pytest.mark.parametrize("shift,average", [(True, False), (False, False), (True, True)])
def test_sequence_logprobs_are_the_log_softmax_of_each_label(shift, average):
    hidden, weight, bias, labels, leaves = _inputs(seed=3)
    ours = trainstream.sequence_logprobs(hidden, weight, labels, bias, chunk_size=4,
                                         shift=shift, average=average)
    logp = F.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    if shift:
        logp, targets = logp[:, :-1], labels[:, 1:]
    else:
        targets = labels
    counted = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * counted
    reference = picked.sum(-1)
    if average:
        reference = reference / counted.sum(-1)
    assert ours.shape == (3,)
    assert torch.allclose(ours.double(), reference, rtol=1e-6)
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for a, b in zip(_grads((ours.double() * weights).sum(), leaves),
                    _grads((reference * weights).sum(), leaves)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_under_bf16_autocast_the_loss_follows_autocasts_dtype():
    hidden, weight, bias, labels, _ = _inputs(seed=5, bias=False)
    hidden, weight = hidden.float(), weight.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = trainstream.chunked_cross_entropy(hidden, weight, labels)
        reference = F.cross_entropy(F.linear(hidden, weight).float().reshape(-1, 37),
                                    labels.reshape(-1))
    assert ours.dtype == torch.float32 and abs(ours.item() - reference.item()) < 2e-2


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_loss_is_its_formula(smoothing):
    g = torch.Generator().manual_seed(9)
    pc, pr, rc, rr = (torch.randn(5, generator=g, dtype=torch.float64) for _ in range(4))
    pc.requires_grad_(True)
    loss, chosen, rejected = trainstream.dpo_loss(pc, pr, rc, rr, beta=0.3,
                                                  label_smoothing=smoothing)
    margin = 0.3 * ((pc - pr) - (rc - rr))
    expected = (-(1 - smoothing) * torch.log(torch.sigmoid(margin))
                - smoothing * torch.log(torch.sigmoid(-margin))).mean()
    assert torch.allclose(loss, expected)
    assert torch.allclose(chosen, 0.3 * (pc - rc)) and not chosen.requires_grad
    assert torch.allclose(rejected, 0.3 * (pr - rr))
    loss.backward()
    assert pc.grad is not None and (pc.grad < 0).all()  # raising the chosen lowers the loss


def test_bad_arguments_are_refused_with_what_is_expected():
    hidden, weight, bias, labels, _ = _inputs()
    with pytest.raises(trainstream.InvalidArgumentError, match="head of shape"):
        trainstream.chunked_cross_entropy(hidden, weight.t(), labels)
    with pytest.raises(trainstream.InvalidArgumentError, match="one target a position"):
        trainstream.chunked_cross_entropy(hidden, weight, labels[:, :3])
    with pytest.raises(trainstream.InvalidArgumentError, match="chunk_size"):
        trainstream.chunked_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="reduction"):
        trainstream.chunked_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(trainstream.InvalidArgumentError, match="beta"):
        trainstream.dpo_loss(*(torch.zeros(2) for _ in range(4)), beta=0)
