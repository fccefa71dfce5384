# SPDX-License-Identifier: Apache-2.0
"""Whole plans timed against each other (issue 53): the planner's activation choices on
synthetic budgets, and the trial's bookkeeping driven by a fake clock."""

from __future__ import annotations

import pytest

from trainstream import BlockFacts, MemoryPlanError, PlanInputs, plan_memory
from trainstream.memory.plan_trial import WholePlanTrial

GiB = 1 << 30


def inputs(vram, host=200 * GiB, blocks=8, **kw):
    facts = tuple(BlockFacts(weight_bytes=GiB, activation_bytes=2 * GiB,
                             input_bytes=GiB // 8, trainable=GiB // 4) for _ in range(blocks))
    return PlanInputs(blocks=facts, other_weight_bytes=GiB // 2, other_trainable=GiB // 8,
                      working_bytes=GiB, vram_budget=vram, host_budget=host,
                      block_forward_s=0.010, link_bytes_per_s=50e9, **kw)


def test_each_choice_handles_the_blocks_vram_cannot_keep_its_own_way():
    # 8.5 GiB of weights, 16 GiB of activations: 16 GiB usable keeps only some of them.
    model = plan_memory(inputs(16 * GiB))
    page = plan_memory(inputs(16 * GiB, activation_choice="page"))
    never = plan_memory(inputs(16 * GiB, activation_choice="recompute"))
    every = plan_memory(inputs(16 * GiB, activation_choice="recompute_all"))
    assert "recompute" not in page.activation_policy and "offload" in page.activation_policy
    assert "offload" not in never.activation_policy and "recompute" in never.activation_policy
    assert every.activation_policy == ["recompute"] * 7 + ["keep"]
    # "recompute" recomputes only the blocks VRAM cannot keep: with more room, fewer.
    roomier = plan_memory(inputs(20 * GiB, activation_choice="recompute"))
    assert 0 < roomier.activation_policy.count("recompute") < 7
    assert "offload" not in roomier.activation_policy
    for plan in (model, page, never, every):
        assert plan.vram_bytes <= 16 * GiB and plan.paged_blocks == []
    assert any("as gradient checkpointing does" in h for h in every.history)
    assert any("this plan pages none" in h for h in never.history)


def test_every_block_recomputed_is_refused_where_weights_stream():
    with pytest.raises(MemoryPlanError, match="fetch a third time"):
        plan_memory(inputs(16 * GiB, activation_choice="recompute_all", param_offload=[0]))


def test_every_block_recomputed_is_refused_where_it_would_still_stream_weights():
    # 8.5 GiB of weights: under 9 GiB even every block recomputed needs some to stream.
    with pytest.raises(MemoryPlanError, match="not checkpointing's plan"):
        plan_memory(inputs(9 * GiB, activation_choice="recompute_all"))


def test_an_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="activation_choice='fast'"):
        plan_memory(inputs(16 * GiB, activation_choice="fast"))


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_trial(step_s: dict, skip: tuple = ()) -> tuple:
    """Drives a trial of step_s's choices, each step taking its time on the fake clock; the
    plans in ``skip`` cannot be applied. Returns the trial, the applied order and the end."""
    clock = FakeClock()
    trial = WholePlanTrial(list(step_s), clock=clock, steps=3)
    running, applied, serial = trial.current, [trial.current], 0
    for _ in range(100):
        clock.now += step_s[running]
        step = trial.settled_step(serial)
        while step.action == "apply" and step.choice in skip:
            step = trial.skip("cannot fit")
        if step.action == "apply":
            running = step.choice
            applied.append(running)
            serial += 1
        elif step.action == "done":
            return trial, applied, step
    raise AssertionError("the trial never ended")


def test_the_fastest_whole_plan_wins_and_each_is_timed_over_its_window():
    trial, applied, end = run_trial({"model": 0.868, "recompute": 0.721, "page": 0.80,
                                     "recompute_all": 0.74})
    assert applied == ["model", "recompute", "page", "recompute_all"]
    assert end.choice == "recompute"
    assert trial.seconds == pytest.approx({"model": 0.868, "recompute": 0.721, "page": 0.80,
                                           "recompute_all": 0.74})
    assert "recompute 721.0 ms" in trial.summary()


def test_the_running_plan_stays_when_it_is_fastest():
    _, _, end = run_trial({"model": 0.5, "recompute": 0.52, "recompute_all": 0.6})
    assert end.choice == "model"


def test_a_plan_that_cannot_be_applied_is_skipped_with_its_reason():
    trial, applied, end = run_trial({"model": 0.9, "page": 0.5, "recompute": 0.7},
                                    skip=("page",))
    assert applied == ["model", "recompute"] and end.choice == "recompute"
    assert trial.skipped == {"page": "cannot fit"}


def test_a_plan_applied_mid_window_restarts_its_timing():
    clock = FakeClock()
    trial = WholePlanTrial(["model", "recompute"], clock=clock, steps=2)
    assert trial.settled_step(0).action == "time"  # window opens
    clock.now += 10.0  # a slow step, then settling re-plans: serial 1
    assert trial.settled_step(1).action == "time"  # window opens again
    clock.now += 1.0
    assert trial.settled_step(1).action == "time"
    clock.now += 1.0
    step = trial.settled_step(1)
    assert step == type(step)("apply", "recompute")
    assert trial.seconds["model"] == pytest.approx(1.0)
