# SPDX-License-Identifier: Apache-2.0
"""The daemon's host optimizer against torch.optim.AdamW/Adam, through a real daemon."""

from __future__ import annotations

import time

import pytest

import trainstream
from trainstream import HostOptimizer, ParameterSpec

torch = pytest.importorskip("torch")

SHAPES = [(33, 7), (1000,), (4, 5, 6), (1,)]


def make_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def specs(params, grad_dtype=None, groups=None):
    return [ParameterSpec(f"p{i}", tuple(p.shape), torch.float32, grad_dtype,
                          groups[i] if groups else 0) for i, p in enumerate(params)]


def max_diff(opt, ref):
    return max((opt.master(i) - p.detach()).abs().max().item() for i, p in enumerate(ref))


@pytest.fixture
def client(daemon):
    with trainstream.connect(daemon.socket, job_id="opt") as c:
        yield c


@pytest.mark.parametrize("case", [
    dict(name="adamw", kind="adamw", wd=0.1),
    dict(name="adam-l2", kind="adam", wd=0.05),
    dict(name="bf16-grads", kind="adamw", wd=0.01, grad_dtype="bf16"),
    dict(name="fp16-grads", kind="adamw", wd=0.01, grad_dtype="fp16"),
    dict(name="groups-and-schedule", kind="adamw", wd=0.1, groups=True, schedule=True),
    dict(name="clipping", kind="adamw", wd=0.1, clip=0.5),
    dict(name="accumulation", kind="adamw", wd=0.1, accumulation=3),
])
def test_matches_torch_after_20_steps(client, case):
    grad_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.get("grad_dtype"))
    ref = make_params(1)
    group_of = [0, 1, 0, 1] if case.get("groups") else None
    hyper = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=case["wd"]),
             dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
    groups = hyper if group_of else hyper[:1]
    opt = HostOptimizer(client, specs(ref, grad_dtype, group_of), groups=groups, kind=case["kind"],
                        max_grad_norm=case.get("clip", 0.0),
                        accumulation_steps=case.get("accumulation", 1))
    assert opt.initialize
    opt.load_weights([p.detach() for p in ref])
    cls = torch.optim.AdamW if case["kind"] == "adamw" else torch.optim.Adam
    if group_of:
        torch_groups = [dict(params=[p for p, g in zip(ref, group_of) if g == k], **hyper[k])
                        for k in (0, 1)]
        torch_opt = cls(torch_groups)
    else:
        torch_opt = cls(ref, **hyper[0])
    gen = torch.Generator().manual_seed(2)
    k = case.get("accumulation", 1)
    for step in range(20):
        micro = [[torch.randn(p.shape, generator=gen) for p in ref] for _ in range(k)]
        if grad_dtype is not None:
            micro = [[g.to(grad_dtype) for g in gs] for gs in micro]
        for p in ref:
            p.grad = None
        for gs in micro:  # torch accumulates micro-steps by summing into .grad
            for p, g in zip(ref, gs):
                p.grad = g.float().clone() if p.grad is None else p.grad + g.float()
        if case.get("clip"):
            norm = torch.nn.utils.clip_grad_norm_(ref, case["clip"])
        torch_opt.step()
        result = opt.step(micro if k > 1 else micro[0])
        assert not result["skipped"] and all(result["updated"])
        if case.get("clip"):
            assert opt.info().last_step.grad_norm == pytest.approx(norm.item(), rel=1e-5)
        if case.get("schedule"):
            for i, g in enumerate(torch_opt.param_groups):
                g["lr"] *= 0.9
            opt.set_groups([dict(g) for g in torch_opt.param_groups])
    assert max_diff(opt, ref) <= 1e-6
    info = opt.info()
    assert info.step == 20 and info.state == "ready"
    assert info.param_steps == [20] * len(ref)


def test_bf16_moments_stay_close_to_fp32(daemon):
    # Stochastic rounding keeps bf16 moments unbiased: after 50 steps the weights stay within a
    # small, stated tolerance of the fp32-moment run (lr 1e-2: 0.5 lr budget per weight).
    results = []
    for moment in (torch.float32, torch.bfloat16):
        with trainstream.connect(daemon.socket, job_id=f"m-{moment}") as c:
            ref = make_params(3)
            opt = HostOptimizer(c, specs(ref), groups=[dict(lr=1e-2)], moment_dtype=moment)
            opt.load_weights([p.detach() for p in ref])
            gen = torch.Generator().manual_seed(4)
            for _ in range(50):
                opt.step([torch.randn(p.shape, generator=gen) + 0.3 for p in ref])
            results.append([opt.master(i).clone() for i in range(len(ref))])
    diff = max((a - b).abs().max().item() for a, b in zip(*results))
    assert 0 < diff <= 5e-3, diff  # different (bf16 rounding happened) but close


def test_nonfinite_policies(daemon):
    ref = make_params(5, [(64,), (8,)])
    bad = [torch.randn(64), torch.randn(8)]
    bad[1][3] = float("nan")
    good = [torch.randn(64), torch.randn(8)]
    # skip: the step is skipped like GradScaler does, nothing changes, the next step runs
    with trainstream.connect(daemon.socket, job_id="nan-skip") as c:
        opt = HostOptimizer(c, specs(ref), nonfinite="skip")
        opt.load_weights([p.detach() for p in ref])
        before = [opt.master(i).clone() for i in range(2)]
        r = opt.step(bad)
        assert r["skipped"] and not any(r["updated"])
        assert all(torch.equal(opt.master(i), before[i]) for i in range(2))
        assert opt.info().param_steps == [0, 0]
        assert not opt.step(good)["skipped"]
        assert opt.info().param_steps == [1, 1]
        assert any(e["kind"] == "optimizer.step_skipped" for e in c.events())
    # error: the job fails with the parameter named, state untouched
    with trainstream.connect(daemon.socket, job_id="nan-error") as c:
        opt = HostOptimizer(c, specs(ref), nonfinite="error")
        opt.load_weights([p.detach() for p in ref])
        before = opt.master(1).clone()
        with pytest.raises(trainstream.FailedPreconditionError, match="non-finite.*'p1'"):
            opt.step(bad)
        assert torch.equal(opt.master(1), before)
    # ignore (default, like torch): applied and reported
    with trainstream.connect(daemon.socket, job_id="nan-ignore") as c:
        opt = HostOptimizer(c, specs(ref))
        opt.load_weights([p.detach() for p in ref])
        opt.step(bad)
        assert opt.info().last_step.nonfinite == 1
        assert any(e["kind"] == "optimizer.nonfinite" for e in c.events())


def test_parameters_without_gradients_are_left_alone(client):
    ref = make_params(6, [(10,), (10,)])
    opt = HostOptimizer(client, specs(ref), groups=[dict(lr=0.1)])
    opt.load_weights([p.detach() for p in ref])
    r = opt.step([torch.ones(10), None])
    assert r["updated"] == [True, False]
    assert torch.equal(opt.master(1), ref[1].detach())
    assert opt.info().param_steps == [1, 0]


def test_ranks_that_disagree_on_a_parameter_are_refused(start_daemon):
    d = start_daemon()
    with trainstream.connect(d.socket, job_id="pair", world_size=2) as first, \
            trainstream.connect(d.socket, job_id="pair", rank=1, world_size=2) as second:
        HostOptimizer(first, [ParameterSpec("p0", (16,))])
        with pytest.raises(trainstream.FailedPreconditionError,
                           match="ranks do not agree on parameter 0: this rank has 'p0' .17 "):
            HostOptimizer(second, [ParameterSpec("p0", (17,))])
        HostOptimizer(second, [ParameterSpec("p0", (16,))])  # the refusal changed nothing


def test_bad_input_gets_clear_errors(daemon, client):
    ref = make_params(7, [(16,)])
    opt = HostOptimizer(client, specs(ref))
    opt.load_weights([p.detach() for p in ref])
    with pytest.raises(trainstream.InvalidArgumentError, match="out of range"):
        opt._native.post(5, 1, 0, False)
    with pytest.raises(trainstream.InvalidArgumentError, match="gradients given"):
        opt.step([])
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        HostOptimizer(client, specs(ref), nonfinite="maybe")
    with pytest.raises(trainstream.InvalidArgumentError, match="dtype"):
        HostOptimizer(client, [ParameterSpec("x", (4,), torch.int64)])
    with trainstream.connect(daemon.socket, job_id="opt") as other:  # same job, same rank
        with pytest.raises(trainstream.FailedPreconditionError, match="do not agree"):
            HostOptimizer(other, specs(ref), moment_dtype=torch.bfloat16)
        # The rank is taken: refused before its parameters are compared, naming who holds it.
        with pytest.raises(trainstream.FailedPreconditionError,
                           match=f"rank 0 of job 'opt' is already attached .session "
                                 f"{client.session_id}"):
            HostOptimizer(other, [ParameterSpec("p0", (17,))])
    with pytest.raises(trainstream.InvalidArgumentError, match="lr"):
        opt.set_groups([dict(lr=-1.0)])
    # A step with a gradient missing: the wait names what is missing instead of hanging.
    two = trainstream.connect(daemon.socket, job_id="missing")
    o2 = HostOptimizer(two, specs(make_params(8, [(4,), (4,)])), timeout_s=1.0)
    o2.grad(0).copy_(torch.ones(4))
    o2.post(0)
    with pytest.raises(trainstream.DeadlineExceededError, match="indices 1"):
        o2.wait()
    two.close()
    # An iteration posted out of turn fails the job with the reason.
    o3c = trainstream.connect(daemon.socket, job_id="turn")
    o3 = HostOptimizer(o3c, specs(make_params(9, [(4,)])))
    o3._native.post(0, 7, 0, False)
    with pytest.raises(trainstream.FailedPreconditionError, match="iteration 7.*iteration 1"):
        o3._native.wait_iteration(7, 5000)
    o3c.close()


def test_checkpoint_round_trip_continues_bit_identical(daemon, tmp_path):
    path = str(tmp_path / "opt.safetensors")
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(10)]

    def run(c, steps, load=None, save_after=None):
        ref = make_params(10)
        opt = HostOptimizer(c, specs(ref), groups=[dict(lr=1e-2, weight_decay=0.1)],
                            moment_dtype=torch.bfloat16)
        opt.load_weights([p.detach() for p in ref])
        if load:
            opt.load(load)
        for k in steps:
            opt.step(grads[k])
            if save_after == k:
                opt.save(path)
        return [opt.master(i).clone() for i in range(len(ref))], opt

    with trainstream.connect(daemon.socket, job_id="straight") as c:
        straight, _ = run(c, range(10))
    with trainstream.connect(daemon.socket, job_id="first-half") as c:
        _, opt = run(c, range(5), save_after=4)
        assert opt.info().step == 5
    with trainstream.connect(daemon.socket, job_id="second-half") as c:
        resumed, opt = run(c, range(5, 10), load=path)
        assert opt.info().step == 10
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    # It is a real safetensors file: tensors and metadata readable by others.
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        assert "0.master" in f.keys() and f.get_tensor("1.exp_avg").dtype == torch.bfloat16
        assert "trainstream" in f.metadata()


def test_checkpoint_refuses_a_mismatched_or_broken_file(client, tmp_path, monkeypatch):
    ref = make_params(11, [(8,)])
    opt = HostOptimizer(client, specs(ref))
    opt.load_weights([p.detach() for p in ref])
    opt.step([torch.ones(8)])
    good = str(tmp_path / "good.safetensors")
    opt.save(good)
    data = open(good, "rb").read()
    truncated = str(tmp_path / "truncated.safetensors")
    open(truncated, "wb").write(data[: len(data) - 10])
    with pytest.raises(trainstream.TrainStreamError, match="truncated"):
        opt.load(truncated)
    garbage = str(tmp_path / "garbage.safetensors")
    open(garbage, "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(trainstream.InvalidArgumentError, match="not valid JSON"):
        opt.load(garbage)
    with pytest.raises(trainstream.NotFoundError):
        opt.load(str(tmp_path / "missing.safetensors"))
    # A relative path is the caller's, in its working directory (the caller opens the file).
    monkeypatch.chdir(tmp_path)
    opt.save("relative.safetensors")
    opt.load("relative.safetensors")
    assert (tmp_path / "relative.safetensors").stat().st_size == len(data)


def test_daemon_killed_mid_checkpoint_leaves_the_previous_one(start_daemon, tmp_path):
    import glob
    import signal
    import threading

    path = str(tmp_path / "ckpt.safetensors")
    n = 40_000_000  # ~480 MB of state to write: long enough to be killed in the middle
    gen = torch.Generator().manual_seed(12)
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    first = start_daemon("--memory_budget=4G")
    c = trainstream.connect(first.socket, job_id="big")
    opt = HostOptimizer(c, [ParameterSpec("w", (n,))], groups=[dict(lr=1e-3)], timeout_s=60)
    opt.load_weights([torch.zeros(n)])
    opt.step([grads[0]])
    opt.save(path)
    saved = open(path, "rb").read(4096)
    opt.step([grads[1]])
    failure = []

    def save_again():
        try:
            opt.save(path)
        except trainstream.TrainStreamError as e:
            failure.append(e)

    writer = threading.Thread(target=save_again)
    writer.start()
    deadline = time.monotonic() + 10
    while not glob.glob(path + ".tmp-*") and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert glob.glob(path + ".tmp-*"), "the second checkpoint never started writing"
    first.process.send_signal(signal.SIGKILL)
    writer.join(30)
    assert failure and isinstance(failure[0], trainstream.DaemonUnavailableError)
    c._native = None  # the session died with its daemon

    # The previous checkpoint is whole and loads in a new daemon, at the step it was taken.
    assert open(path, "rb").read(4096) == saved
    second = start_daemon("--memory_budget=4G")
    with trainstream.connect(second.socket, job_id="big") as c2:
        restored = HostOptimizer(c2, [ParameterSpec("w", (n,))], groups=[dict(lr=1e-3)],
                                 timeout_s=60)
        restored.load(path)
        assert restored.info().step == 1
        restored.step([grads[1]])
        with trainstream.connect(second.socket, job_id="straight") as c3:
            straight = HostOptimizer(c3, [ParameterSpec("w", (n,))], groups=[dict(lr=1e-3)],
                                     timeout_s=60)
            straight.load_weights([torch.zeros(n)])
            straight.step([grads[0]])
            straight.step([grads[1]])
            assert torch.equal(straight.master(0), restored.master(0))


def test_state_dict_round_trips_with_torch(daemon):
    ref = make_params(13)
    gen = torch.Generator().manual_seed(14)
    grads = [[torch.randn(p.shape, generator=gen) for p in ref] for _ in range(10)]
    hyper = dict(lr=1e-2, weight_decay=0.1)
    with trainstream.connect(daemon.socket, job_id="export") as c:
        opt = HostOptimizer(c, specs(ref), groups=[hyper])
        opt.load_weights([p.detach() for p in ref])
        for k in range(5):
            opt.step(grads[k])
        exported = opt.state_dict()
        # Export to torch: a torch AdamW continues where the daemon left off.
        params = [torch.nn.Parameter(m.clone()) for m in exported["master"]]
        torch_opt = torch.optim.AdamW(params, **hyper)
        torch_opt.load_state_dict({"state": exported["state"],
                                   "param_groups": exported["param_groups"]})
        for k in range(5, 10):
            for p, g in zip(params, grads[k]):
                p.grad = g.clone()
            torch_opt.step()
            opt.step(grads[k])
        assert max_diff(opt, params) <= 1e-6
    with trainstream.connect(daemon.socket, job_id="import") as c:
        # Import from torch: the daemon continues a torch AdamW's run.
        torch_params = make_params(13)
        torch_opt = torch.optim.AdamW(torch_params, **hyper)
        for k in range(5):
            for p, g in zip(torch_params, grads[k]):
                p.grad = g.clone()
            torch_opt.step()
        opt = HostOptimizer(c, specs(torch_params), groups=[hyper])
        opt.load_weights([p.detach() for p in torch_params])
        opt.load_state_dict(torch_opt.state_dict())
        assert opt.iteration == 5
        for k in range(5, 10):
            for p, g in zip(torch_params, grads[k]):
                p.grad = g.clone()
            torch_opt.step()
            opt.step(grads[k])
        assert max_diff(opt, torch_params) <= 1e-6


def test_cross_machine_reduction_updates_with_every_machines_gradient(daemon):
    # One rank per "machine" here; the other machine's gradient is added into the reduce buffer
    # by hand, as the all-reduce would, before the daemon is told to update.
    ref = make_params(7)
    mine = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in
            enumerate(ref)]
    theirs = [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)) for i, p in
              enumerate(ref)]
    unused = len(ref) - 1  # no machine has a gradient for the last parameter
    with trainstream.connect(daemon.socket, job_id="machines") as c:
        opt = HostOptimizer(c, specs(ref), groups=[dict(lr=1e-2, weight_decay=0.1)], machines=2)
        opt.load_weights([p.detach() for p in ref])
        for i, g in enumerate(mine):
            if i == unused:
                opt.post(i, no_grad=True)
                continue
            opt.grad(i).copy_(g)
            opt.post(i)
        for i, g in enumerate(theirs):
            had = opt.wait_reduce_ready(i)
            assert had == (i != unused)
            if i == unused:
                opt.post_reduced(i, any_gradient=False)
                continue
            assert torch.equal(opt.reduce(i), mine[i])  # this machine's sum
            opt.reduce(i).add_(g)
            opt.post_reduced(i)
        result = opt.wait()
        assert result["updated"] == [True] * unused + [False]
        assert opt.info().param_steps[unused] == 0
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for i, (p, a, b) in enumerate(zip(ref, mine, theirs)):
        p.grad = None if i == unused else (a + b) / 2  # the mean over both machines' ranks
    torch_opt.step()
    assert max_diff(opt, ref) <= 1e-6


def test_a_reduction_announced_out_of_turn_fails_the_job_clearly(daemon):
    ref = make_params(8)
    with trainstream.connect(daemon.socket, job_id="machines-bad") as c:
        opt = HostOptimizer(c, specs(ref), machines=2, timeout_s=10)
        opt.load_weights([p.detach() for p in ref])
        opt.post_reduced(0)  # nothing was out for reduction yet
        with pytest.raises(trainstream.FailedPreconditionError, match="not out for reduction"):
            opt.wait()
        with pytest.raises(trainstream.InvalidArgumentError, match="no reduce buffer"):
            opt._native.post_reduced(99, 1, True)
