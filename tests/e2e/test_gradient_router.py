# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's gradient router (optim/gradients.py) on its own: a CPU model's gradients,
produced by real backward passes, go through the router to a real daemon's host optimizer,
with no OffloadAdamW around it. What the router counts, calls and posts is checked at each
micro-step, and the daemon's pass afterwards shows what it was posted."""

from __future__ import annotations

import pytest

import trainstream
from trainstream import HostOptimizer, ParameterSpec
from trainstream.hooks import HookClock
from trainstream.optim.gradients import GradientRouter, Traffic
from trainstream.optim.iteration import Iteration, Phase
from trainstream.optim.parameters import ParameterTable

torch = pytest.importorskip("torch")


class Routed:
    """Three CPU parameters in the daemon's shared slots, their hooks on a router, and what the
    router called back."""

    def __init__(self, client, accumulation: int, held: set = frozenset()):
        g = torch.Generator().manual_seed(5)
        self.params = [torch.nn.Parameter(torch.randn(6, generator=g)) for _ in range(3)]
        specs = [ParameterSpec(f"p{i}", (6,), torch.float32, None, 0)
                 for i in range(len(self.params))]
        # A CPU model's micro-steps add up in its slots: the daemon sees one gradient each.
        self.host = HostOptimizer(client, specs, groups=[dict(lr=1e-2, betas=(0.9, 0.999),
                                                              eps=1e-8, weight_decay=0.0)])
        self.host.load_weights([p.detach() for p in self.params])
        for i, p in enumerate(self.params):
            p.data = self.host.param(i)
            p.grad = self.host.grad(i)
            p.grad.zero_()
        self.table = ParameterTable(self.params, None)
        self.table.place(set(held), set())
        self.iteration = Iteration()
        self.first, self.held, self.ended = 0, [], 0
        self.router = GradientRouter(
            host=self.host, table=self.table, iteration=self.iteration,
            accumulation_steps=accumulation, device_index=-1, copy_stream=None,
            traffic=Traffic(), clock=HookClock(), first_gradient=self._first,
            held_gradient=lambda i, p: self.held.append(i), backward_ended=self._ended)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.router.on_gradient)

    def _first(self):
        self.first += 1

    def _ended(self):
        self.ended += 1

    def backward(self, scale: float = 1.0):
        loss = sum((p * scale).sum() for p in self.params)
        loss.backward()


@pytest.fixture
def client(daemon):
    with trainstream.connect(daemon.socket, job_id="router") as c:
        yield c


def test_micro_steps_are_counted_and_the_last_one_posts(client):
    r = Routed(client, accumulation=2)
    r.backward()
    # One call before the iteration's first gradient leaves, whatever the count of them.
    assert (r.first, r.router.most_backwards, r.router.in_iteration) == (1, 1, True)
    assert r.iteration.phase is Phase.ACCUMULATING and r.ended == 0
    before = [r.host.master(i).clone() for i in range(3)]
    r.backward(scale=2.0)
    assert r.first == 1 and r.router.most_backwards == 2
    # The last micro-step marks the iteration and hooks its backward's end, which ran once.
    assert r.ended == 1
    assert r.iteration.phase is Phase.BACKWARD_ENDED and r.iteration.updates_landing
    # The slots hold the passes' sum, and the daemon was posted each parameter: its pass
    # updates all three from it (a first Adam step moves every weight by about lr).
    for i in range(3):
        assert torch.equal(r.host.grad(i), torch.full((6,), 3.0))
    result = r.host.wait()
    assert result["updated"] == [True, True, True] and not result["skipped"]
    for i in range(3):
        assert torch.allclose(before[i] - r.host.master(i), torch.full((6,), 1e-2), atol=1e-5)
    r.router.iteration_done()
    assert not r.router.in_iteration and r.router.most_backwards == 0
    r.iteration.stepped()
    for i in range(3):
        r.host.grad(i).zero_()
    r.backward()
    assert r.first == 2  # the next iteration's first gradient calls again


def test_one_backward_too_many_is_refused_with_the_count(client):
    r = Routed(client, accumulation=1)
    r.backward()
    with pytest.raises(trainstream.FailedPreconditionError,
                       match=r"backward pass 2 before step\(\); accumulation_steps is 1"):
        r.backward()


def test_a_parameter_updated_on_the_gpu_is_handed_over_not_posted(client):
    r = Routed(client, accumulation=2, held={1})
    r.backward()
    assert r.held == []  # not before its last micro-step
    r.backward()
    assert r.held == [1]
    # Only the daemon's own parameters make updates land; the held one's gradient stays.
    assert r.iteration.updates_landing
    assert torch.equal(r.params[1].grad, torch.full((6,), 2.0))
    # Posted for the other two only: the daemon's pass waits for the held one until told it
    # has no gradient there (as OffloadAdamW does at step()).
    r.host.post(1, no_grad=True)
    result = r.host.wait()
    assert result["updated"] == [True, False, True]


def test_a_gradient_after_an_early_completion_is_refused(client):
    r = Routed(client, accumulation=1)
    r.backward()
    assert r.iteration.start_early_completion()  # a forward completed the iteration
    r.iteration.completed_before_step()
    with pytest.raises(trainstream.FailedPreconditionError,
                       match="already applied this step's updates"):
        r.backward()
