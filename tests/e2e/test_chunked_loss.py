# SPDX-License-Identifier: Apache-2.0
"""The causal-LM loss wrap() computes in chunks (trainstream/chunked_loss.py): the same loss and
gradients as transformers' ForCausalLMLoss for fp32 and bf16 logits, ignored labels, shifted
labels given, and the Trainer's num_items_in_batch, across chunk boundaries; wrap() puts it on
the models that use transformers' loss (inside a PEFT model too), says so, and unwrap(), a
refused wrap() and chunked_loss=False leave transformers' own."""

from __future__ import annotations

import pytest

import trainstream
from trainstream import chunked_loss

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (scripts/bootstrap.sh "
                    "installs it)")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402


def _both(dtype, vocab=1000, batch=3, seq=37, **kwargs):
    g = torch.Generator().manual_seed(7)
    base = (4 * torch.randn(batch, seq, vocab, generator=g)).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :5] = -100  # a prompt that does not count
    out = []
    for loss_fn in (ForCausalLMLoss, chunked_loss.causal_lm_loss):
        logits = base.clone().requires_grad_(True)
        loss = loss_fn(logits, labels, vocab, **kwargs)
        loss.backward()
        out.append((loss.detach(), logits.grad))
    return out


@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": 50},
                                    {"num_items_in_batch": torch.tensor(80)}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_loss_and_gradients_as_transformers(monkeypatch, dtype, kwargs):
    # Chunks of 16 positions: 111 positions cross six chunk boundaries.
    monkeypatch.setattr(chunked_loss, "CHUNK_BYTES", 16 * 4 * 1000)
    assert chunked_loss.chunk_rows(1000) == 16
    (ref_loss, ref_grad), (loss, grad) = _both(dtype, **kwargs)
    assert loss.dtype == ref_loss.dtype == torch.float32
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6), (loss, ref_loss)
    assert grad.dtype == dtype
    tolerance = 1e-7 if dtype == torch.float32 else 1e-3  # bf16: one rounding of the same value
    assert (grad.float() - ref_grad.float()).abs().max().item() <= tolerance
    assert grad[0, :4].abs().max().item() == 0.0  # positions whose next label is ignored


def test_shift_labels_given_are_used_as_they_are():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 9, 50, generator=g, requires_grad=True)
    shifted = torch.randint(0, 50, (2, 9), generator=g)
    shifted[:, -1] = -100
    ours = chunked_loss.causal_lm_loss(logits, None, 50, shift_labels=shifted)
    ref = ForCausalLMLoss(logits, None, 50, shift_labels=shifted)
    assert torch.allclose(ours, ref, rtol=1e-6)


def test_its_working_memory_is_the_logits_and_their_gradient_beyond_a_chunk():
    rows = chunked_loss.chunk_rows(32000)
    assert rows * 32000 * 4 <= chunked_loss.CHUNK_BYTES < (rows + 1) * 32000 * 4
    bf16 = chunked_loss.working_bytes(2048, 32000, torch.bfloat16)
    assert bf16 == 2048 * 32000 * 4 + 2 * rows * 32000 * 4
    assert bf16 < 0.55 * 12 * 2048 * 32000  # transformers' own: about 12 bytes a logit


def _tiny(tune="full"):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import hf_models

    if tune == "lora":
        pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh "
                                           "installs it)")
    model, _ = hf_models.build("tiny-llama", tune)
    return model


def _hf_model(model):
    return next(m for m in model.modules() if type(m).__name__.endswith("ForCausalLM"))


@pytest.mark.parametrize("tune", ["full", "lora"])
def test_wrap_computes_the_loss_in_chunks_and_unwrap_gives_transformers_loss_back(tune):
    model = _tiny(tune)
    inner = _hf_model(model)
    assert inner.loss_function is ForCausalLMLoss
    model, opt = trainstream.wrap(model, torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3))
    assert inner.loss_function is chunked_loss.causal_lm_loss
    assert "loss_function" not in vars(model)  # a PEFT wrapper is not given a shadowing copy
    assert "wrap.loss" in [e["kind"] for e in model._trainstream_session.events]
    x = torch.randint(0, 256, (2, 24))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    assert loss.item() == loss.item()
    trainstream.unwrap(model)
    assert inner.loss_function is ForCausalLMLoss
    assert "_loss_function" not in vars(inner)


def test_chunked_loss_false_and_a_refused_wrap_keep_transformers_loss():
    model = _tiny()
    inner = _hf_model(model)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  chunked_loss=False)
    assert inner.loss_function is ForCausalLMLoss
    assert "wrap.loss" not in [e["kind"] for e in model._trainstream_session.events]
    trainstream.unwrap(model)
    with pytest.raises(ValueError, match="not supported"):
        trainstream.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert inner.loss_function is ForCausalLMLoss
    with pytest.raises(ValueError, match="chunked_loss"):
        trainstream.wrap(model, torch.optim.AdamW(model.parameters()), chunked_loss="yes")
