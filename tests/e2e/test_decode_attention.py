# SPDX-License-Identifier: Apache-2.0
"""The attention kernel of decoding (``TrainStreamCache(attention=...)``, ``DecodeAttention``)
with tiny transformers models on the CPU: the decoding calls go to the kernel chosen, prefill and
other caches' calls do not, "auto" times its candidates each on a key length of its own and keeps
the fastest, and the tokens stay those of PyTorch's own pick."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(scripts/bootstrap.sh installs it)")
import torch.nn.functional as F  # noqa: E402

import trainstream  # noqa: E402
from trainstream.integrations.decode_attention import (TRIAL_LENGTHS,  # noqa: E402
                                                       DecodeAttention)
from trainstream.integrations.huggingface import TrainStreamCache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import hf_models  # noqa: E402

NEW = 6


def _model(preset="tiny-qwen2"):
    model, _ = hf_models.build(preset, "full", device="cpu")
    return model.eval()


def _generate(model, prompt_tokens, cache=None):
    prompt = hf_models.batch("tiny-qwen2", 2, prompt_tokens, 0, "cpu")
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, past_key_values=cache)


def _decoding_calls(model):
    # The first new token comes from prefill; each later one is a decoding call a layer.
    return (NEW - 1) * model.config.num_hidden_layers


def test_auto_times_each_candidate_on_key_lengths_of_its_own_and_keeps_the_fastest():
    model = _model()
    expected = _generate(model, TRIAL_LENGTHS + 5)
    chooser = DecodeAttention("auto", trial_devices=("cpu",))  # any cache, timed on the CPU
    chooser.install(model)
    try:
        got = _generate(model, TRIAL_LENGTHS + 5)
    finally:
        chooser.remove()
    report = chooser.report()
    assert report["decided"], report
    timed = {n: t for n, t in report["timings_ms"].items() if isinstance(t, float)}
    # The CPU runs PyTorch's pick and its flash kernel; cuDNN's and the memory-efficient
    # kernel are CUDA's, and say so.
    assert {"default", "flash"} <= set(timed), report
    assert all(t > 0 for t in timed.values()), report
    assert report["timings_ms"]["cudnn"].startswith("not available"), report
    assert report["backend"] == min(timed, key=timed.get), report
    assert sum(report["calls"].values()) == _decoding_calls(model), report
    assert "each call on a length of its own" in report["note"]
    assert torch.equal(got, expected), (got, expected)


def test_a_context_shorter_than_the_trial_keeps_pytorchs_pick_until_it_is_long_enough():
    model = _model()
    chooser = DecodeAttention("auto", trial_devices=("cpu",))
    chooser.install(model)
    try:
        _generate(model, 9)  # keys of 10 to 14 positions: too few lengths below them to time
    finally:
        chooser.remove()
    assert not chooser.report()["decided"] and chooser.report()["timings_ms"] == {}
    assert chooser.report()["calls"] == {"default": _decoding_calls(model)}


def test_a_named_kernel_runs_the_decoding_calls_that_read_the_cache_and_nothing_else():
    model = _model("tiny-llama")
    expected = _generate(model, 9)
    cache = TrainStreamCache(model, max_tokens=32, resident_layers=1, page_tokens=8,
                             attention="math")
    try:
        got = _generate(model, 9, cache)
        assert cache.attention["calls"] == {"math": _decoding_calls(model)}, cache.attention
        assert torch.allclose(got.float(), expected.float())  # the same tokens
        assert torch.equal(got, expected)
        # transformers' own cache on the same model: the hooks pass its calls on untouched.
        _generate(model, 9)
        assert cache.attention["calls"] == {"math": _decoding_calls(model)}
    finally:
        cache.close()


def test_auto_on_the_cpu_keeps_pytorchs_pick_and_says_why():
    model = _model()
    expected = _generate(model, 9)
    cache = TrainStreamCache(model, max_tokens=32, resident_layers=1, page_tokens=8)
    try:
        assert torch.equal(_generate(model, 9, cache), expected)
        report = cache.attention
        assert report["mode"] == "auto" and report["backend"] == "default", report
        assert "PyTorch's pick on cpu" in report["note"], report
        assert report["calls"] == {"default": _decoding_calls(model)}
    finally:
        cache.close()


def test_close_takes_the_hooks_off_the_model():
    model = _model()
    hooked = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in hooked]
    cache = TrainStreamCache(model, max_tokens=32, attention="math")
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in hooked] != before
    _generate(model, 9, cache)
    cache.close()
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in hooked] == before
    # Outside an attention module's call PyTorch's own function is in place.
    assert F.scaled_dot_product_attention.__module__.startswith("torch")


def test_an_unknown_kernel_is_refused_with_the_choices():
    with pytest.raises(trainstream.InvalidArgumentError, match="attention='fast' must be one of"):
        TrainStreamCache(_model(), max_tokens=16, attention="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_on_a_gpu_auto_decides_for_bf16_decoding_and_the_tokens_begin_as_pytorchs():
    model, _ = hf_models.build("tiny-qwen2", "full", torch.bfloat16, device="cuda",
                               init_device="cuda")
    model.eval()
    prompt = hf_models.batch("tiny-qwen2", 1, TRIAL_LENGTHS + 30, 0, "cuda")
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(prompt, **options)
        cache = TrainStreamCache(model, max_tokens=prompt.shape[1] + NEW, resident_layers=1)
        try:
            got = model.generate(prompt, past_key_values=cache, **options)
            report = cache.attention
        finally:
            cache.close()
    assert report["decided"] and report["backend"] in report["timings_ms"], report
    assert sum(report["calls"].values()) == _decoding_calls(model), report
    # Kernels that sum in another order may part ways at a near tie of random weights, but
    # not at the first new token, which prefill (untouched) decides.
    assert torch.equal(got[:, :prompt.shape[1] + 1], expected[:, :prompt.shape[1] + 1])
