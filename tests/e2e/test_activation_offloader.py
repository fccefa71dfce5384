# SPDX-License-Identifier: Apache-2.0
"""ActivationOffloader without wrap(), in TrainStream 0.6's terms: the blocks it pages train
bit-identically to the model left alone (on the CPU here, on the GPU under the gpu mark);
"auto" measures a probe step and pages only the blocks the VRAM target cannot keep, the earliest
first, and keep_resident() takes them back latest first; the seed's tuning arguments are taken,
checked and recorded with what replaces them; remove() leaves the model as it was."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, loss_fn, train_steps  # noqa: E402

GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]


def _twins(device, layers=4):
    torch.manual_seed(0)
    alone = TinyGPT(layers=layers).to(device)
    paged = copy.deepcopy(alone)
    return alone, paged


def _train(model, steps, start=0):
    """``steps`` steps from batch ``start``, with the model's one optimizer."""
    if not hasattr(model, "_test_opt"):
        model._test_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return train_steps(model, model._test_opt, steps, next(model.parameters()).device.type,
                       start)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_blocks_train_bit_identical_and_remove_restores(device):
    alone, paged = _twins(device)
    offloader = trainstream.ActivationOffloader(paged, paged.blocks, offload=True, min_bytes=0)
    assert offloader.policy == ["offload"] * 3 + ["keep"]
    assert not offloader.adjustable
    assert _train(alone, 3) == _train(paged, 3)
    assert offloader.stats["offloaded_bytes"] > 0 and offloader.stats["offloaded_blocks"] == 3
    assert offloader.keep_resident(2) == []  # a policy the caller set stays
    assert [e["kind"] for e in offloader.events] == ["activations.set"]
    offloader.remove()
    before = offloader.stats["offloaded_bytes"]
    assert _train(alone, 2, start=3) == _train(paged, 2, start=3)
    assert offloader.stats["offloaded_bytes"] == before  # nothing paged once removed
    assert all(p.equal(q) for p, q in zip(alone.parameters(), paged.parameters()))


@pytest.mark.parametrize("device", DEVICES)
def test_paging_and_recompute_mix_and_the_daemon_can_hold_the_copies(daemon, device):
    alone, paged = _twins(device)
    with trainstream.connect(daemon.socket, job_id="offloader") as client:
        offloader = trainstream.ActivationOffloader(paged, paged.blocks, offload=[0, 1],
                                                    recompute=[2], min_bytes=0, client=client)
        assert offloader.policy == ["offload", "offload", "recompute", "keep"]
        assert _train(alone, 3) == _train(paged, 3)
        assert offloader.stats["host_bytes"] == 64 << 20  # one chunk of the daemon's, reused
        by_tag = {r["key"]: int(r["bytes"]) for r in client.memory()["by_tag"]}
        assert by_tag["activations"] == 64 << 20  # counted by the daemon like any buffer
        offloader.remove()


@pytest.mark.parametrize("device", DEVICES)
def test_auto_pages_what_the_vram_target_cannot_keep_and_keep_resident_takes_it_back(device):
    alone, paged = _twins(device, layers=6)
    probe = copy.deepcopy(alone)
    # What a block saves at this batch, measured with everything kept.
    measuring = trainstream.ActivationOffloader(probe, probe.blocks, "auto", min_bytes=0,
                                                vram_target=1 << 40)
    _train(probe, 2)
    saved = measuring.decision["saved_bytes"]
    baseline = measuring.decision["baseline_bytes"]
    assert measuring.policy == ["keep"] * 6 and len(saved) == 6 and min(saved) > 0
    measuring.remove()
    # A target with room for the working memory and two blocks' activations.
    target = baseline + 2 * max(saved) + saved[5] + saved[4]
    offloader = trainstream.ActivationOffloader(paged, paged.blocks, "auto", min_bytes=0,
                                                vram_target=target)
    assert offloader.adjustable and offloader.policy == ["keep"] * 6  # the probe step first
    losses = _train(paged, 1)
    losses += _train(paged, 3, start=1)
    assert losses == _train(alone, 4)
    kept = offloader.decision["kept"]
    if device == "cpu":  # on a GPU the other models' memory moves the baseline a little
        assert kept == [4, 5]
    assert 1 <= len(kept) <= 3 and kept == list(range(6 - len(kept), 6))
    paged_blocks = list(range(6 - len(kept)))
    assert offloader.decision["offloaded"] == paged_blocks
    assert offloader.policy == ["offload"] * len(paged_blocks) + ["keep"] * len(kept)
    assert offloader.block_bytes == max(saved)
    assert f"{len(kept)} of 6 blocks' fit" in offloader.events[-1]["message"]
    assert offloader.stats["offloaded_bytes"] > 0
    latest = paged_blocks[-2:]
    assert offloader.keep_resident(2) == latest  # the latest first
    assert offloader.policy == ["offload"] * (len(paged_blocks) - 2) + ["keep"] * (len(kept) + 2)
    assert offloader.decision["kept_blocks"] == latest
    assert _train(paged, 2, start=4) == _train(alone, 2, start=4)
    offloader.remove()


def test_auto_on_the_cpu_without_a_target_pages_nothing_and_says_why():
    torch.manual_seed(0)
    model = TinyGPT(layers=4)  # on the CPU, whatever this machine has
    offloader = trainstream.ActivationOffloader(model, model.blocks)
    for step in range(2):
        x, y = batch(step)
        loss_fn(model, x, y).backward()
    assert offloader.policy == ["keep"] * 4 and offloader.stats["offloaded_bytes"] == 0
    assert "no VRAM target" in offloader.decision["reason"]
    offloader.remove()


def test_the_seeds_tuning_arguments_are_taken_and_recorded_with_what_replaces_them():
    """TrainStream 0.6's calibrate_steps, max_slowdown, tune_window, profile,
    reserved_link_bytes, memory_pressure and recompute='auto': taken, recorded in .tuning with
    an event saying what each tuned there, and training is what it is without them."""
    alone, paged = _twins("cpu")
    tuning = dict(calibrate_steps=3, max_slowdown=0.2, tune_window=3, profile=None,
                  reserved_link_bytes=(1 << 20, 0), memory_pressure=False)
    offloader = trainstream.ActivationOffloader(paged, paged.blocks, offload=[0, 1],
                                                recompute="auto", min_bytes=0, **tuning)
    assert offloader.tuning == tuning
    [said] = [e["message"] for e in offloader.events if e["kind"] == "activations.tuning"]
    for name in tuning:
        assert f"{name}=" in said
    assert "max_slowdown=0.2 recorded, no effect" in said and "vram_target" in said
    assert offloader.policy == ["offload", "offload", "keep", "keep"]  # recompute="auto": none
    assert _train(alone, 2) == _train(paged, 2)
    offloader.remove()
    auto = trainstream.ActivationOffloader(paged, paged.blocks)  # 0.6's default: "auto"
    assert auto.tuning == {} and auto.policy == ["keep"] * 4
    auto.remove()


@pytest.mark.parametrize("name, value, allowed", [
    ("calibrate_steps", 1, "an integer >= 2"), ("max_slowdown", -0.1, "a float >= 0"),
    ("tune_window", 0, "an integer >= 1"), ("profile", "fast", "None or a HardwareProfile"),
    ("reserved_link_bytes", -1, "bytes >= 0"), ("memory_pressure", "yes", "True or False"),
])
def test_a_bad_tuning_value_is_refused_naming_what_it_takes(name, value, allowed):
    _, model = _twins("cpu")
    with pytest.raises(trainstream.InvalidArgumentError,
                       match=f"ActivationOffloader: {name}={value!r} must be {allowed}"):
        trainstream.ActivationOffloader(model, model.blocks, **{name: value})


def test_bad_choices_are_refused_with_the_reason():
    _, model = _twins("cpu")
    make = trainstream.ActivationOffloader
    with pytest.raises(trainstream.InvalidArgumentError, match="names the last block"):
        make(model, model.blocks, offload=[3])
    with pytest.raises(trainstream.InvalidArgumentError, match="outside 0..3"):
        make(model, model.blocks, offload=[7])
    with pytest.raises(trainstream.InvalidArgumentError, match="both paged and recomputed"):
        make(model, model.blocks, offload=[1], recompute=[1])
    with pytest.raises(trainstream.InvalidArgumentError, match="is not one of"):
        make(model, model.blocks, offload="half")
    with pytest.raises(trainstream.InvalidArgumentError, match="two or more"):
        make(model, model.blocks[:1])
    with pytest.raises(TypeError, match="unexpected keyword argument 'tuning'"):
        make(model, model.blocks, tuning=1)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
def test_auto_on_a_gpu_plans_against_what_the_process_may_use(device):
    """No target given: the device's (what this process may use, less 10%). A small model's
    activations fit in it, so the probe step ends with everything kept, and says so."""
    alone, paged = _twins(device)
    offloader = trainstream.ActivationOffloader(paged, paged.blocks, min_bytes=0)
    assert offloader.vram_target > 0
    assert _train(alone, 3) == _train(paged, 3)
    assert offloader.policy == ["keep"] * 4 and offloader.decision["kept"] == [0, 1, 2, 3]
    assert "4 of 4 blocks' fit" in offloader.decision["reason"]
    offloader.remove()
