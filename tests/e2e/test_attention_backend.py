# SPDX-License-Identifier: Apache-2.0
"""wrap(attention=...): the kernel chosen for scaled-dot-product attention, applied around each
attention module's call (recomputed blocks included), read again at every call so that
deterministic mode leaves out the non-deterministic kernels, reported in memory_report(). On
the CPU here (the kernels that run there); "auto"'s pick on a GPU is bench/'s to measure."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, max_param_diff, train_steps  # noqa: E402


@pytest.fixture
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)


def test_a_named_kernel_trains_as_stock_and_is_reported(daemon_socket):
    torch.manual_seed(3)
    ref = TinyGPT()
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        train_steps(ref, ref_opt, 3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 device="cpu", offload=True, attention="math")
    train_steps(ours, opt, 3)
    assert max_param_diff(ref, ours) <= 1e-5
    report = trainstream.memory_report(ours)["attention"]
    assert report["mode"] == "math" and report["backend"] == "math"
    assert report["kernels_now"][0] == "math" and report["timings_ms"] == {}
    assert report["calls"] == {"math": 3 * 2}  # three steps of two blocks, math alone
    trainstream.unwrap(ours)


def test_auto_times_the_kernels_on_the_first_training_call_and_keeps_the_fastest(
        daemon_socket):
    torch.manual_seed(4)
    model, opt = trainstream.wrap(TinyGPT(), device="cpu", offload=True, attention="auto")
    with torch.no_grad():  # no training call: nothing is measured yet
        model(batch(0)[0])
    assert trainstream.memory_report(model)["attention"]["timings_ms"] == {}
    train_steps(model, opt, 2)
    report = trainstream.memory_report(model)["attention"]
    timed = {n: t for n, t in report["timings_ms"].items() if isinstance(t, float)}
    assert "math" in timed and all(t > 0 for t in timed.values())
    assert report["backend"] == min(timed, key=timed.get)
    # Two steps of two blocks (the no-grad forward before it ran in PyTorch's order).
    assert report["calls"] == {report["backend"]: 2 * 2}
    # PyTorch's own pick is timed beside the kernels: "auto" keeps it when it is fastest.
    assert set(report["timings_ms"]) == {"flash", "efficient", "cudnn", "math", "default"}
    events = [e for e in model._trainstream_session.events if e["kind"] == "attention"]
    assert len(events) == 1 and f"attention='auto': {report['backend']}" in events[0]["message"]
    trainstream.unwrap(model)


def test_deterministic_mode_leaves_out_flash_in_forward_and_in_recompute(daemon_socket,
                                                                          deterministic):
    original = torch.nn.functional.scaled_dot_product_attention
    model, opt = trainstream.wrap(TinyGPT(), device="cpu", offload=True, attention="flash",
                                  recompute=True)
    assert model._trainstream_session.recompute.indices == [0, 1]
    chooser = model._trainstream_session.attention
    train_steps(model, opt, 1)
    # Two blocks, each run in forward and again in backward: flash every time.
    assert chooser.calls == {"flash": 4}
    torch.use_deterministic_algorithms(True)
    train_steps(model, opt, 1)
    # Read again at every call: flash is left out, and the CPU has no memory-efficient kernel.
    assert chooser.calls == {"flash": 4, "math": 4}
    assert "flash" not in trainstream.memory_report(model)["attention"]["kernels_now"]
    torch.use_deterministic_algorithms(False)
    trainstream.unwrap(model)
    assert torch.nn.functional.scaled_dot_product_attention is original
    train_steps(model, opt, 0)
    with torch.no_grad():  # unwrapped: no hook is left
        model(batch(0)[0])
    assert chooser.calls == {"flash": 4, "math": 4}


def test_a_named_kernel_that_cannot_run_gives_way_in_pytorchs_order(daemon_socket):
    # No cuDNN attention on a CPU: flash, next in PyTorch's order, runs every call.
    model, opt = trainstream.wrap(TinyGPT(), device="cpu", offload=True, attention="cudnn")
    train_steps(model, opt, 2)
    report = trainstream.memory_report(model)["attention"]
    assert report["backend"] == "cudnn" and report["kernels_now"][0] == "cudnn"
    assert report["calls"] == {"flash": 2 * 2}
    trainstream.unwrap(model)


def test_deterministic_warn_only_leaves_out_the_memory_efficient_kernel(deterministic):
    from trainstream.integrations.attention_backend import allowed

    every = ["flash", "efficient", "cudnn", "math"]
    assert allowed(every) == every
    torch.use_deterministic_algorithms(True)
    assert allowed(every) == ["efficient", "math"]
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert allowed(every) == ["math"]


def test_an_unknown_attention_kernel_is_refused(daemon_socket):
    with pytest.raises(ValueError, match="attention"):
        trainstream.wrap(TinyGPT(), device="cpu", attention="fastest")
