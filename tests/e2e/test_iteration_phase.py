# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's iteration phase (optim/iteration.py) on its own, without a daemon: each
transition the gradient routing, the forward hooks and step() drive."""

import pytest

from trainstream.optim.iteration import Iteration, Phase


def test_a_forward_completes_only_after_the_last_backward_has_ended():
    it = Iteration()
    assert not it.start_early_completion()  # nothing to complete before the last gradients
    it.last_gradient_out(updated_by_daemon=True)
    assert it.phase is Phase.LAST_BACKWARD and it.updates_landing
    assert not it.start_early_completion()  # not from another thread while backward runs
    it.backward_ended()
    assert it.phase is Phase.BACKWARD_ENDED
    assert it.start_early_completion()
    it.updates_returned()
    it.completed_before_step()
    assert it.completed_early and not it.updates_landing
    assert not it.start_early_completion()  # once
    it.backward_ended()  # another backward's end changes nothing
    assert it.completed_early
    it.stepped()
    assert it.phase is Phase.ACCUMULATING and not it.completed_early


def test_a_gradient_after_a_backward_ended_waits_for_its_own_backward():
    # A recompute's inner backward ends before the outer one has produced every gradient.
    it = Iteration()
    it.last_gradient_out(updated_by_daemon=False)
    it.backward_ended()
    it.last_gradient_out(updated_by_daemon=False)
    assert it.phase is Phase.LAST_BACKWARD
    assert not it.start_early_completion()
    it.backward_ended()
    assert it.start_early_completion()


def test_updates_land_only_for_parameters_the_daemon_updates():
    it = Iteration()
    it.last_gradient_out(updated_by_daemon=False)  # updated in VRAM at step()
    assert not it.updates_landing
    it.last_gradient_out(updated_by_daemon=True)
    assert it.updates_landing
    it.updates_returned()
    assert not it.updates_landing


def test_a_failed_early_completion_is_left_to_step():
    it = Iteration()
    it.last_gradient_out(updated_by_daemon=True)
    it.backward_ended()
    assert it.start_early_completion()
    # The completion raised: neither completed early nor to be tried again before step().
    assert not it.completed_early
    assert not it.start_early_completion()
    assert it.updates_landing  # step() completes (and waits) again


def test_a_gradient_after_an_early_completion_is_a_bug_of_the_caller():
    it = Iteration()
    it.last_gradient_out(updated_by_daemon=True)
    it.backward_ended()
    it.start_early_completion()
    it.completed_before_step()
    with pytest.raises(AssertionError):
        it.last_gradient_out(updated_by_daemon=True)
