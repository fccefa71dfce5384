# SPDX-License-Identifier: Apache-2.0
"""nonfinite="guard", wrap()'s default: a step whose gradients hold a NaN or an infinity stops
updating at the first such tensor (no non-finite value ever reaches a weight or a moment), says
so in an event and a warning, and the next clean step trains as usual. On the GPU, the same for
the parameters the GPU updates (state in VRAM, staged, or the whole optimizer)."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, loss_fn  # noqa: E402


def _poison_once(param, steps_to_poison: set, counter: list):
    """Makes ``param``'s gradient NaN in the steps named (counted by backward passes)."""
    def hook(grad):
        step = counter[0]
        return grad * float("nan") if step in steps_to_poison else grad
    return param.register_hook(hook)


def _step(model, opt, step, device):
    x, y = batch(step, device=device)
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def _weights(model):
    model._trainstream_session.optimizer.synchronize()
    return [p.detach().clone() for p in model.parameters()]


GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_guard_stops_a_step_at_its_first_nonfinite_gradient(device):
    torch.manual_seed(0)
    model = TinyGPT(layers=2).to(device)
    ref = copy.deepcopy(model)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  offload=True)
    assert model._trainstream_session.config.optimizer.nonfinite == "guard"
    counter = [0]
    # The first parameter's gradient is the last backward makes: every other tensor's update
    # may have started before it; from it on, nothing more is applied.
    poisoned = next(model.parameters())
    handle = _poison_once(poisoned, {1}, counter)
    _step(model, opt, 0, device)
    before = _weights(model)
    counter[0] = 1
    with pytest.warns(UserWarning, match="non-finite gradient values"):
        _step(model, opt, 1, device)
    after = _weights(model)
    assert all(torch.isfinite(w).all() for w in after)
    assert torch.equal(after[0], before[0])  # the poisoned tensor kept its value
    kinds = [e["kind"] for e in trainstream.memory_report(model)["events"]]
    assert "optimizer.step_skipped" in kinds or "client.optimizer.nonfinite" in kinds
    counter[0] = 2
    handle.remove()
    _step(model, opt, 2, device)  # a clean step trains every tensor again
    again = _weights(model)
    assert all(not torch.equal(a, b) for a, b in zip(after, again))
    assert all(torch.isfinite(w).all() for w in again)
    del ref


def test_ignore_applies_them_as_torch_does():
    torch.manual_seed(0)
    model = TinyGPT(layers=1)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  nonfinite="ignore", offload=True)
    counter = [1]
    _poison_once(next(model.parameters()), {1}, counter)
    _step(model, opt, 0, "cpu")
    assert not torch.isfinite(_weights(model)[0]).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_device_flag_catches_nan_and_infinity_in_every_gradient_dtype(dtype):
    """The GPU paths' flag (optimizer_mode="gpu" checks bf16 gradients, which torch's own
    GradScaler check does not take): set by a NaN, +inf or -inf anywhere, left clear by finite
    values, 0 or 1 as torch's fused AdamW reads it, the gradients unchanged."""
    from trainstream.optim.nonfinite_guard import DeviceGuard

    guard = DeviceGuard(torch.device("cpu"))
    finite = torch.linspace(-3, 3, 100).to(getattr(torch, dtype))
    kept = finite.clone()
    guard.check([finite, None])
    assert float(guard.found) == 0.0 and torch.equal(finite, kept)
    for bad in (float("nan"), float("inf"), float("-inf")):
        guard.found.zero_()
        grad = finite.clone()
        grad[57] = bad
        guard.check([finite, grad])
        guard.check([grad])  # twice: still 1, not 2
        assert float(guard.found) == 1.0, bad
