# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's knobs of the daemon's pass as TrainStream 0.6 named them (threads,
chunk_elems, eager, pin_moments), against stock torch.optim.AdamW, on a real daemon with two
AdamW workers. CPU models: the pass is the daemon's either way."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, max_param_diff, train_steps  # noqa: E402


@pytest.fixture
def two_workers(start_daemon, monkeypatch):
    daemon = start_daemon("--memory_budget=256M", "--lease_ms=1500", "--threads=2")
    monkeypatch.setenv("TRAINSTREAM_SOCKET", daemon.socket)
    return daemon


def test_one_worker_and_small_chunks_follow_stock_adamw(two_workers):
    torch.manual_seed(4)
    ref = TinyGPT()
    ours = copy.deepcopy(ref)
    assert max(p.numel() for p in ours.parameters()) > 4096  # split into several chunks
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=3e-3, threads=1, chunk_elems=4096)
    train_steps(ref, ref_opt, 5)
    train_steps(ours, opt, 5)
    assert max_param_diff(ref, ours) <= 1e-5
    spec = opt.stats()["spec"]
    assert spec["threads"] == 1 and int(spec["chunk_elements"]) == 4096
    assert opt.stats()["threads"] == 2  # the daemon's workers, of which the job uses one


def test_eager_false_waits_for_every_gradient(two_workers):
    # A deferred pass measures every gradient before it updates any: its report carries the
    # norm, which an eager pass (each update as its gradient lands) never computes.
    torch.manual_seed(5)
    ref = TinyGPT()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    waiting, eager = copy.deepcopy(ref), copy.deepcopy(ref)
    opt_waiting = trainstream.OffloadAdamW(waiting.parameters(), lr=3e-3, eager=False)
    opt_eager = trainstream.OffloadAdamW(eager.parameters(), lr=3e-3, eager=None)
    train_steps(ref, ref_opt, 3)
    train_steps(waiting, opt_waiting, 3)
    train_steps(eager, opt_eager, 3)
    assert max_param_diff(ref, waiting) <= 1e-5 and max_param_diff(ref, eager) <= 1e-5
    assert opt_waiting.stats()["spec"].get("defer_updates") is True
    assert opt_waiting.stats()["last_step"].get("grad_norm", 0) > 0
    assert opt_eager.stats()["last_step"].get("grad_norm", 0) == 0


def test_wrap_passes_threads_on(two_workers):
    model, opt = trainstream.wrap(TinyGPT(), device="cpu", offload=True, threads=1)
    train_steps(model, opt, 1)
    assert opt.stats()["spec"]["threads"] == 1
    trainstream.unwrap(model)


@pytest.mark.parametrize("options, error, message", [
    (dict(threads=3), trainstream.InvalidArgumentError,
     "threads=3, but trainstreamd runs 2 AdamW workers"),
    (dict(threads=0), trainstream.InvalidArgumentError, "threads=0 must be None or an integer"),
    (dict(threads=True), trainstream.InvalidArgumentError, "threads=True must be None"),
    (dict(chunk_elems=1000), trainstream.InvalidArgumentError,
     "chunk_elements 1000 is not a multiple of 256 between 4096 and 2"),
    (dict(eager="yes"), trainstream.InvalidArgumentError, "eager='yes' must be None, True"),
    (dict(pin_moments=False), trainstream.InvalidArgumentError,
     "pin_moments=False: the moments live in trainstreamd's memory"),
])
def test_bad_pass_options_say_why(two_workers, options, error, message):
    with pytest.raises(error, match=message):
        trainstream.OffloadAdamW(TinyGPT().parameters(), **options)
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
        trainstream.OffloadAdamW(TinyGPT().parameters(), **options)


def test_eager_true_and_pinned_moments_are_the_default_behaviour(two_workers):
    torch.manual_seed(6)
    ref = TinyGPT()
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=3e-3, eager=True, pin_moments=True)
    train_steps(ref, ref_opt, 2)
    train_steps(ours, opt, 2)
    assert max_param_diff(ref, ours) <= 1e-5
    assert not opt.stats()["spec"].get("defer_updates", False)


def _speculation(opt) -> tuple:
    stats = opt.stats()
    # Integers, not the protobuf JSON's strings of 64-bit fields.
    return stats.get("speculated_steps", 0), stats.get("rolled_back_steps", 0)


@pytest.mark.parametrize("max_grad_norm, rolled_back", [(0.05, 6), (1e6, 0)])
def test_clipping_speculates_and_matches_updating_after_the_last_gradient(
        two_workers, max_grad_norm, rolled_back):
    # eager=False clips after the step's last gradient; eager=True updates each tensor as its
    # gradient lands and, when the norm says so, puts its state back and updates it again: the
    # weights must be the same bits.
    torch.manual_seed(7)
    ref = TinyGPT()
    runs = {}
    for eager in (False, None, True):
        model = copy.deepcopy(ref)
        opt = trainstream.OffloadAdamW(model.parameters(), lr=3e-3, eager=eager,
                                       max_grad_norm=max_grad_norm)
        train_steps(model, opt, 6)
        runs[eager] = (model, _speculation(opt), opt.last_grad_norm)
    barrier = runs[False][0]
    for eager in (None, True):
        for a, b in zip(barrier.parameters(), runs[eager][0].parameters()):
            assert torch.equal(a, b), f"eager={eager} differs from eager=False"
        assert runs[eager][2] == runs[False][2]
    assert runs[False][1] == (0, 0)
    assert runs[True][1] == (6, rolled_back)
    if rolled_back:
        # The default speculates only after a step that needed no clipping: the first step.
        assert runs[None][1] == (1, 1)
    else:
        assert runs[None][1] == (6, 0)


def test_eager_true_with_a_reported_norm_follows_stock_adamw(two_workers):
    torch.manual_seed(8)
    ref = TinyGPT()
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = trainstream.OffloadAdamW(ours.parameters(), lr=3e-3, eager=True,
                                   compute_grad_norm=True)
    train_steps(ref, ref_opt, 3)
    train_steps(ours, opt, 3)
    assert max_param_diff(ref, ours) <= 1e-5
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0
