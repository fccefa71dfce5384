# SPDX-License-Identifier: Apache-2.0
"""The causal-LM loss wrap() computes in chunks (trainstream/integrations/chunked_loss.py): the
same loss and gradients as transformers' ForCausalLMLoss for fp32 and bf16 logits, ignored labels,
shifted labels given, and the Trainer's num_items_in_batch, across chunk boundaries; wrap() puts it
on the models that use transformers' loss (inside a PEFT model too), says so, and unwrap(), a
refused wrap() and chunked_loss=False leave transformers' own."""

from __future__ import annotations

import pytest

import trainstream
from trainstream.integrations import chunked_loss

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


def test_on_a_cuda_device_the_kernels_keep_only_the_logits_and_their_gradient():
    cuda = torch.device("cuda")
    if not chunked_loss.kernels_apply(cuda, torch.bfloat16):
        pytest.skip("this build has no CUDA kernels (built without a CUDA toolkit)")
    assert chunked_loss.working_bytes(2048, 32000, torch.bfloat16, device=cuda) == (
        2048 * 32000 * 4 + 8 * 2048)
    assert not chunked_loss.kernels_apply(torch.device("cpu"), torch.bfloat16)
    assert not chunked_loss.kernels_apply(cuda, torch.float64)  # the torch chunks take those


def _cuda_pair(dtype, vocab, labels_fn=None):
    """(transformers' loss and gradient, ours) for logits on the GPU: 3 x 37 positions, a
    prompt of ignored labels, and one position whose first ten logits are -inf (a masked part
    of the vocabulary)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    base = (4 * torch.randn(3, 37, vocab, generator=g, device="cuda")).to(dtype)
    base[1, 3, :10] = float("-inf")
    labels = torch.randint(10, vocab, (3, 37), generator=g, device="cuda")
    labels[0, :5] = -100
    if labels_fn is not None:
        labels_fn(labels)
    out = []
    for loss_fn in (ForCausalLMLoss, chunked_loss.causal_lm_loss):
        logits = base.clone().requires_grad_(True)
        loss = loss_fn(logits, labels, vocab)
        loss.backward()
        out.append((loss.detach(), logits.grad))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab", [1000, 32064, 1003])  # 1003: rows of odd bytes, scalar reads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cuda_kernels_give_transformers_loss_and_gradients(dtype, vocab):
    assert chunked_loss.kernels_apply(torch.device("cuda"), dtype), (
        "the package on this GPU machine was built without its CUDA kernels")
    (ref_loss, ref_grad), (loss, grad) = _cuda_pair(dtype, vocab)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert torch.allclose(loss, ref_loss, rtol=2e-6, atol=2e-6), (loss, ref_loss)
    assert grad.dtype == dtype and grad.is_contiguous()
    # One rounding of the same fp32 value apart at most (fp32: the exp's last bits).
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    diff = (grad.float() - ref_grad.float()).abs()
    assert (diff <= ulp * ref_grad.float().abs() + 1e-7).all(), diff.max()
    assert grad[0, :4].abs().max().item() == 0.0  # positions whose next label is ignored
    assert grad[1, 3, :10].abs().max().item() == 0.0  # exp(-inf) is 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_kernels_hold_no_fp32_copy_and_survive_a_bad_label():
    vocab = 32064
    logits = torch.randn(1, 2048, vocab, device="cuda", dtype=torch.bfloat16,
                         requires_grad=True)
    labels = torch.randint(0, vocab, (1, 2048), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    chunked_loss.causal_lm_loss(logits, labels, vocab).backward()
    torch.cuda.synchronize()
    beyond = torch.cuda.max_memory_allocated() - before
    # The gradient (the logits' size) and a few bytes a position; transformers' loss: ~6x.
    assert beyond <= logits.numel() * 2 + (1 << 20), beyond
    # A label outside the vocabulary: a NaN loss (which the non-finite guard reports), not a
    # device-side assertion that would end the process's CUDA context.
    labels[0, 100] = vocab + 3
    loss = chunked_loss.causal_lm_loss(logits.detach(), labels, vocab)
    assert torch.isnan(loss).item()
    assert torch.ones(4, device="cuda").sum().item() == 4.0  # the context still works


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
