# SPDX-License-Identifier: Apache-2.0
"""trainstream.wrap() on a small GPT against stock torch.optim.AdamW (CPU here; the same tests
run on CUDA on the GPU machine)."""

from __future__ import annotations

import copy
import os
import signal
import sys
import time

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, loss_fn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def groups_of(model, lr=3e-3):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=0.1, lr=lr), dict(params=no_decay, weight_decay=0.0,
                                                            lr=lr)]


def train(model, opt, steps, accumulation=1, clip=None, scheduler=None, start=0):
    for step in range(start, start + steps):
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro, device=DEVICE)
            (loss_fn(model, x, y) / accumulation).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def max_diff(a, b):
    if hasattr(b, "_trainstream_session"):
        b._trainstream_session.optimizer.synchronize()
    return max((p.detach().float() - q.detach().float()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture
def daemon_socket(daemon, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_SOCKET", daemon.socket)
    return daemon.socket


@pytest.mark.parametrize("case", ["plain", "clip", "accumulate", "schedule"])
def test_wrap_matches_stock_adamw_over_20_steps(daemon_socket, case):
    torch.manual_seed(0)
    ref = TinyGPT().to(DEVICE)
    ours = copy.deepcopy(ref)
    clip = 1.0 if case == "clip" else None
    accumulation = 2 if case == "accumulate" else 1
    ref_opt = torch.optim.AdamW(groups_of(ref))
    ref_sched = (torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.9 ** s)
                 if case == "schedule" else None)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(groups_of(ours)), max_grad_norm=clip,
                                 accumulation_steps=accumulation)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
             if case == "schedule" else None)
    train(ref, ref_opt, 20, accumulation, clip, ref_sched)
    train(ours, opt, 20, accumulation, None, sched)  # clipping happens inside the optimizer
    assert max_diff(ref, ours) <= 1e-5
    assert ours._trainstream_session.steps == 20
    if clip:
        assert opt.last_grad_norm > 0
    trainstream.unwrap(ours)


def test_state_dict_round_trip_resumes_the_same_trajectory(daemon_socket):
    torch.manual_seed(1)
    straight = TinyGPT().to(DEVICE)
    first = copy.deepcopy(straight)
    straight, s_opt = trainstream.wrap(straight, torch.optim.AdamW(straight.parameters(), lr=3e-3))
    train(straight, s_opt, 10)
    first, f_opt = trainstream.wrap(first, torch.optim.AdamW(first.parameters(), lr=3e-3))
    train(first, f_opt, 5)
    saved_model = copy.deepcopy(trainstream.unwrap(first).state_dict())
    saved_opt = f_opt.state_dict()
    assert "master" in saved_opt and saved_opt["param_groups"][0]["lr"] == 3e-3
    # A plain torch AdamW accepts it too (the master weights are an extra key it ignores).
    plain = TinyGPT().to(DEVICE)
    torch.optim.AdamW(plain.parameters(), lr=3e-3).load_state_dict(
        {k: v for k, v in saved_opt.items() if k in ("state", "param_groups")})
    resumed = TinyGPT().to(DEVICE)
    resumed.load_state_dict(saved_model)
    resumed, r_opt = trainstream.wrap(resumed, torch.optim.AdamW(resumed.parameters(), lr=3e-3))
    r_opt.load_state_dict(saved_opt)
    train(resumed, r_opt, 5, start=5)
    assert max_diff(straight, resumed) == 0.0


def test_wrapped_model_keeps_no_gradient_or_state_in_torch(daemon_socket):
    model, opt = trainstream.wrap(TinyGPT().to(DEVICE))
    train(model, opt, 2)
    assert all(len(s) == 0 for s in opt.state.values())
    report = trainstream.memory_report(model)
    assert report["optimizer"]["step"] == 2
    assert report["pinned"]["daemon_reserved"] > 0
    kinds = [e["kind"] for e in report["events"]]
    # wrap()'s decisions are in the daemon's log beside the daemon's own.
    assert "client.wrap.optimizer" in kinds and "optimizer.created" in kinds


def test_misuse_gets_clear_errors(daemon_socket):
    model, opt = trainstream.wrap(TinyGPT().to(DEVICE))
    with pytest.raises(trainstream.FailedPreconditionError, match="already wrapped"):
        trainstream.wrap(model)
    with pytest.raises(ValueError, match="SGD is not supported"):
        other = TinyGPT()
        trainstream.wrap(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="unknown option 'quantise'.*accepted"):
        trainstream.wrap(TinyGPT(), quantise="nf4")
    with pytest.raises(ValueError, match="optimizer_mode='gpu' is not one of"):
        trainstream.wrap(TinyGPT(), optimizer_mode="gpu")
    with pytest.raises(trainstream.FailedPreconditionError, match="GradScaler"):
        opt.step(grad_scaler=object())
    x, y = batch(0, device=DEVICE)
    loss_fn(model, x, y).backward()
    with pytest.raises(trainstream.FailedPreconditionError, match="backward pass 2 before step"):
        loss_fn(model, x, y).backward()


def test_daemon_gone_is_a_clear_error_within_seconds(start_daemon, monkeypatch):
    d = start_daemon("--memory_budget=512M")
    monkeypatch.setenv("TRAINSTREAM_SOCKET", d.socket)
    model, opt = trainstream.wrap(TinyGPT().to(DEVICE))
    train(model, opt, 1)
    d.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(trainstream.TrainStreamError):
        train(model, opt, 1, start=1)
    assert time.monotonic() - start < 15
