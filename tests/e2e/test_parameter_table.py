# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's parameter table without a daemon: the daemon's tensor order, the gradient
dtypes, a group added later, and where each parameter's update happens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainstream.optim.parameters import ParameterTable  # noqa: E402


def _params(*shapes, frozen=()):
    out = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for i in frozen:
        out[i].requires_grad_(False)
    return out


def test_trained_parameters_take_the_daemons_order_and_frozen_ones_stay_for_checkpoints():
    ps = _params(3, 4, 5, frozen=(1,))
    table = ParameterTable(ps, None)
    assert table.all == ps and table.params == [ps[0], ps[2]] and len(table) == 2
    assert table.index == {id(ps[0]): 0, id(ps[2]): 1}
    assert table.grad_dtypes == [torch.float32] * 2 and table.grad_sizes == [4, 4]
    assert ParameterTable(ps, torch.bfloat16).grad_sizes == [2, 2]


def test_a_later_group_takes_the_next_indices_with_the_gradient_dtype_asked_for():
    table = ParameterTable(_params(2), torch.bfloat16)
    late = _params(6, 7, frozen=(0,))
    assert table.extend(late) == [late[1]]
    assert table.index[id(late[1])] == 1 and table.all[-2:] == late
    assert table.grad_dtypes == [torch.bfloat16, torch.bfloat16] and len(table) == 2


def test_where_updates_happen_decides_which_come_back_to_the_device():
    table = ParameterTable(_params(1, 1, 1, 1), None)
    table.paged = {0}
    table.place({1, 2}, {2})
    assert table.state_in_vram() == {1}
    assert [table.returned(i) for i in range(4)] == [False, False, False, True]
    table.place(set(), set())
    assert [table.returned(i) for i in range(4)] == [False, True, True, True]
