# SPDX-License-Identifier: Apache-2.0
"""PagedKVCache (resident layers on the device, the others in the daemon's host pages read back
through two shared device slots) against plain concatenation, and TrainStreamCache generating
with tiny Qwen2 and Llama models exactly as transformers' own cache does. On the CPU here; the
GPU variant runs the copy stream and the prefetches."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

import trainstream  # noqa: E402
from trainstream import PagedKVCache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _feed(cache, layers, steps, device, dtype=torch.float32):
    """Appends a prompt of 5 positions, then ``steps`` single positions, to every layer in
    order (as a decoder does); returns what each update handed back and the reference."""
    g = torch.Generator().manual_seed(3)
    want = [None] * layers
    for step in range(steps + 1):
        tokens = 5 if step == 0 else 1
        for layer in range(layers):
            k = torch.randn(2, 3, tokens, 8, generator=g).to(device, dtype)
            v = torch.randn(2, 3, tokens, 8, generator=g).to(device, dtype)
            got_k, got_v = cache.update(layer, k, v)
            want[layer] = (k, v) if want[layer] is None else (
                torch.cat([want[layer][0], k], 2), torch.cat([want[layer][1], v], 2))
            assert torch.equal(got_k, want[layer][0]) and torch.equal(got_v, want[layer][1]), \
                (step, layer)
    return want


@pytest.mark.parametrize("resident", [0, 1, 2, [0, 3], 4])
def test_every_layer_reads_back_what_was_appended(resident):
    cache = PagedKVCache(4, 16, resident_layers=resident, page_tokens=4)
    _feed(cache, 4, 20, "cpu")  # past max_tokens (16) and over several pages
    offloaded = 4 - (len(resident) if isinstance(resident, list) else resident)
    assert len(cache.offloaded) == offloaded and len(cache.resident) == 4 - offloaded
    memory = cache.memory()
    assert memory["tokens"] == 25 and cache.seq_length(3) == 25
    # 25 positions: an extent of max_tokens (16), then one as large again (16 >= 9 missing),
    # each holding keys and values.
    assert cache.stats["extents"] == 2 * offloaded
    assert memory["host_page_bytes"] == 32 * offloaded * 2 * (2 * 3 * 8 * 4)
    assert cache.stats["d2h_bytes"] == offloaded * 2 * 25 * (2 * 3 * 8 * 4)
    if offloaded:
        assert cache.stats["reallocations"] >= 1  # the slots grew past max_tokens
    cache.reset()
    assert cache.seq_length(0) == 0
    _feed(cache, 4, 2, "cpu")  # the same extents again after reset()
    assert cache.stats["extents"] == 2 * offloaded
    cache.close()


def test_memory_and_stats_carry_trainstream_06s_keys_beside_ours():
    """memory(): 0.6's device_bytes (resident layers and slots) and host_bytes (the pages);
    .stats: 0.6's pages, prefetched and gathered beside h2d_bytes and d2h_bytes. On the CPU
    nothing is filled ahead: every read of an offloaded layer is gathered when asked."""
    cache = PagedKVCache(4, 16, resident_layers=2, page_tokens=4)
    _feed(cache, 4, 20, "cpu")
    memory, stats = cache.memory(), cache.stats
    assert memory["device_bytes"] == memory["resident_bytes"] + memory["slot_bytes"] > 0
    assert memory["host_bytes"] == memory["host_page_bytes"] > 0
    # Two offloaded layers, each with extents of 16 and 16 positions: 8 pages of 4 apiece.
    assert stats["pages"] == 2 * 8
    assert stats["prefetched"] == 0 and stats["gathered"] == stats["prefetch_misses"] == 2 * 20
    assert stats["h2d_bytes"] > 0 and stats["d2h_bytes"] == 2 * 2 * 25 * (2 * 3 * 8 * 4)
    cache.close()


def test_appends_that_straddle_two_extents_read_back_whole():
    cache = PagedKVCache(2, 4, resident_layers=0, page_tokens=2)
    g = torch.Generator().manual_seed(5)
    want = None
    for _ in range(6):  # 3 positions at a time: 0-3, 3-6 (over 4), ... up to 18
        k = torch.randn(1, 2, 3, 4, generator=g)
        got, _ = cache.update(0, k, -k)
        want = k if want is None else torch.cat([want, k], 2)
        assert torch.equal(got, want)
    # extents of 4, then 4 (8), then 8 (16), then 16 (32): four in all for 18 positions
    assert cache.stats["extents"] == 4 and cache.memory()["host_page_bytes"] == 32 * 2 * 8 * 4
    cache.close()


def test_other_prompts_after_reset_are_sized_afresh_and_before_it_refused():
    cache = PagedKVCache(2, 8, resident_layers=0, page_tokens=4)
    cache.update(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(trainstream.InvalidArgumentError, match="reset\\(\\) before"):
        cache.update(1, torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    cache.reset()
    k, v = cache.update(0, torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4))
    assert k.shape == (2, 2, 3, 4) and bool((k == 1).all())
    cache.close()


@pytest.mark.parametrize("arguments, message", [
    (dict(num_layers=0, max_tokens=8), "num_layers=0"),
    (dict(num_layers=2, max_tokens=8, resident_layers=3), "resident_layers=3"),
    (dict(num_layers=2, max_tokens=8, resident_layers=[0, 0]), "distinct"),
    (dict(num_layers=2, max_tokens=8, page_tokens=0), "page_tokens=0"),
    (dict(num_layers=2, max_tokens=8, vram_fraction=1.5), "vram_fraction=1.5"),
])
def test_bad_arguments_say_why(arguments, message):
    with pytest.raises(trainstream.InvalidArgumentError, match=message):
        PagedKVCache(**arguments)


def test_keys_of_the_wrong_shape_are_refused():
    cache = PagedKVCache(2, 8)
    with pytest.raises(trainstream.InvalidArgumentError, match="batch, heads, tokens"):
        cache.update(0, torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(trainstream.InvalidArgumentError, match="layer 2 of 2"):
        cache.update(2, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))


def _generate(preset, device, make_cache=None):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(scripts/bootstrap.sh installs it)")
    sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
    import hf_models

    model, _ = hf_models.build(preset, "full", device=device)
    model.eval()
    prompt = hf_models.batch(preset, 2, 9, 0, device)
    options = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = model.generate(prompt, **options)
    cache = make_cache(model) if make_cache else None
    got = model.generate(prompt, past_key_values=cache, **options)
    assert isinstance(transformers.__version__, str)
    return expected, got, cache


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])
def test_greedy_generation_equals_transformers_own_cache(preset):
    from trainstream.integrations.huggingface import TrainStreamCache

    expected, got, cache = _generate(preset, "cpu", lambda m: TrainStreamCache(
        m, max_tokens=16, resident_layers=2, page_tokens=8))
    assert torch.equal(expected, got), (expected, got)
    assert len(cache.kv.offloaded) == 2 and cache.kv.stats["extents"] == 2 * 2  # 29: 16, then 16
    assert cache.get_seq_length() == 28  # the last token is returned, not fed back
    cache.reset()
    assert cache.get_seq_length() == 0
    cache.kv.close()


def test_wrap_changes_nothing_generation_sees(tmp_path):
    """Issue 50: TrainStreamCache gave other tokens once another model was wrapped in the
    process. wrap() wrote use_cache=False into the config, and a model built from the same
    config object (a reference model; the policy itself generating between steps) read it.
    Now the config is never written: a model sharing it generates as it did, with either
    cache, and so does the wrapped model itself under no_grad between its training steps."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(scripts/bootstrap.sh installs it)")
    from trainstream.integrations.huggingface import TrainStreamCache

    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.Qwen2ForCausalLM(config)
    policy = transformers.Qwen2ForCausalLM(config)  # the same config object
    prompt = torch.randint(0, 256, (2, 8))
    options = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)

    def generate(model, paged):
        cache = TrainStreamCache(model, max_tokens=20) if paged else None
        with torch.no_grad():
            out = model.generate(prompt, past_key_values=cache, **options)
        if cache is not None:
            cache.close()
        return out

    before = {}
    for name, model in (("reference", reference), ("policy", policy)):
        for paged in (False, True):
            before[name, paged] = generate(model, paged)
    config_seen = config.to_dict()
    policy, opt = trainstream.wrap(policy, torch.optim.AdamW(policy.parameters(), lr=0.0))
    for _ in range(2):
        loss = policy(input_ids=prompt, labels=prompt).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        # The policy generates between its steps (lr 0: its weights are as they were).
        for paged in (False, True):
            assert torch.equal(generate(policy, paged), before["policy", paged])
    assert config.to_dict() == config_seen and config.use_cache is True
    for paged in (False, True):
        got = generate(reference, paged)
        assert torch.equal(got, before["reference", paged]), (paged, got)
    trainstream.unwrap(policy)


def test_models_with_sliding_windows_are_refused():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(scripts/bootstrap.sh installs it)")
    from trainstream.integrations.huggingface import TrainStreamCache

    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=8)
    with pytest.raises(trainstream.InvalidArgumentError, match="not full attention"):
        TrainStreamCache(transformers.MistralForCausalLM(config), max_tokens=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_on_a_gpu_the_pages_cross_on_a_copy_stream_and_generation_matches():
    cache = PagedKVCache(6, 64, resident_layers=2, page_tokens=16)
    _feed(cache, 6, 40, "cuda", torch.bfloat16)
    assert cache.stats["prefetch_hits"] > 30 * 3, cache.stats  # the slots were filled ahead
    # Every extent is registered with CUDA: copies by the transport's DMA path, none pageable.
    assert cache.stats["extents"] == 4 and cache.stats["pageable_extents"] == 0, cache.stats
    # Other prompts in the same slots: each offloaded layer's prompt rows leave for host memory
    # from the slot the layer two further on writes next (a race, once, when it did not wait).
    for _ in range(3):
        cache.reset()
        _feed(cache, 6, 12, "cuda", torch.bfloat16)
    cache.close()
    from trainstream.integrations.huggingface import TrainStreamCache

    expected, got, cache = _generate("tiny-llama", "cuda", lambda m: TrainStreamCache(
        m, max_tokens=32, resident_layers=1, page_tokens=8))
    assert torch.equal(expected, got)
    assert cache.kv.memory()["host_page_bytes"] > 0
    cache.kv.close()


def test_pointer_copies_stay_inside_one_registration():
    """An extent's halves go by raw pointer copies only where each lies inside one of the
    segment's CUDA registrations (a copy across two fails); the others by the buffer's copies,
    which split at the edges."""
    from trainstream.memory.paged_kv_cache import inside_one_registration

    gib = 1 << 30
    assert inside_one_registration(5 * gib + 7, 12345, 0)  # one registration for it all
    assert inside_one_registration(gib, gib, gib)
    assert inside_one_registration(gib - 100, 100, gib)
    assert not inside_one_registration(gib - 100, 101, gib)
    assert not inside_one_registration(3 * gib - 1, 2, gib)
    assert inside_one_registration(gib, 0, gib)
