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


def train(model, opt, steps, accumulation=1, clip=None, scheduler=None, start=0, device=None):
    for step in range(start, start + steps):
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro, device=device or DEVICE)
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


def stock_and_wrapped(seed, device=DEVICE, layers=2, **options):
    """One TinyGPT twice: (model, its torch AdamW, the wrapped copy, its OffloadAdamW), both
    at lr 3e-3, offloaded, with ``options`` passed to wrap()."""
    torch.manual_seed(seed)
    ref = TinyGPT(layers=layers).to(device)
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 offload=True, **options)
    return ref, ref_opt, ours, opt


def scheduled_twins(seed, accumulation, **options):
    """One TinyGPT on CUDA twice, each with two parameter groups and a decaying lr schedule,
    after one step: (model, its torch AdamW, its scheduler, the wrapped copy, its optimizer,
    its scheduler); ``options`` go to wrap()."""
    torch.manual_seed(seed)
    ref = TinyGPT().to("cuda")
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(groups_of(ref))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.9 ** s)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(groups_of(ours)), offload=True,
                                 accumulation_steps=accumulation, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    train(ref, ref_opt, 1, accumulation, scheduler=ref_sched)
    train(ours, opt, 1, accumulation, scheduler=sched)
    return ref, ref_opt, ref_sched, ours, opt, sched


def host_bound_twins(start_daemon, monkeypatch, seed, **options):
    """A wide TinyGPT on CUDA twice, the copy wrapped (``options`` go to wrap()) against a
    daemon with one optimizer thread, whose host pass is then slower than the step's compute:
    (model, its torch AdamW, the wrapped copy, its optimizer)."""
    daemon = start_daemon("--memory_budget=2G", "--threads=1", "--lease_ms=1500")
    monkeypatch.setenv("TRAINSTREAM_SOCKET", daemon.socket)
    torch.manual_seed(seed)
    ref = TinyGPT(dim=512, heads=8, layers=4).to("cuda")
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4),
                                 offload=True, **options)
    return ref, ref_opt, ours, opt


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
                                 accumulation_steps=accumulation, offload=True)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
             if case == "schedule" else None)
    train(ref, ref_opt, 20, accumulation, clip, ref_sched)
    train(ours, opt, 20, accumulation, None, sched)  # clipping happens inside the optimizer
    assert max_diff(ref, ours) <= 1e-5
    assert ours._trainstream_session.steps == 20
    if clip:
        assert opt.last_grad_norm > 0
    trainstream.unwrap(ours)


def test_a_forward_between_backward_and_step_sees_every_update(daemon_socket, tmp_path):
    # Updates are applied during backward, as each gradient arrives. A forward before step()
    # (an evaluation, say) waits for all of them rather than reading whichever have landed,
    # and step() then does not update twice.
    ref, ref_opt, ours, opt = stock_and_wrapped(13)
    train(ref, ref_opt, 2)
    train(ours, opt, 2)
    x, y = batch(2, device=DEVICE)
    loss_fn(ref, x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    loss_fn(ours, x, y).backward()
    with torch.no_grad():
        between = ours(x)
    assert opt.steps == 3  # the forward completed the iteration
    opt.step()
    opt.zero_grad()
    assert opt.steps == 3  # and step() did not start another
    with torch.no_grad():
        after, expected = ours(x), ref(x)
    assert torch.equal(between, after)
    assert (after - expected).abs().max().item() <= 1e-4
    assert max_diff(ref, ours) <= 1e-5
    train(ref, ref_opt, 2, start=3)  # and training carries on as before
    train(ours, opt, 2, start=3)
    assert max_diff(ref, ours) <= 1e-5 and opt.steps == 5
    # A checkpoint taken there holds the step's weights too.
    x, y = batch(5, device=DEVICE)
    loss_fn(ours, x, y).backward()
    saved = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    assert opt.steps == 6
    opt.step()
    assert opt.steps == 6
    assert all(torch.equal(saved[k], v) for k, v in ours.state_dict().items())
    # And the optimizer's own checkpoint there: the daemon's file, between steps again.
    x, y = batch(6, device=DEVICE)
    loss_fn(ours, x, y).backward()
    opt.save(str(tmp_path / "mid.ckpt"))
    assert opt.steps == 7
    opt.step()
    assert opt.steps == 7 and (tmp_path / "mid.ckpt").exists()


def test_state_dict_round_trip_resumes_the_same_trajectory(daemon_socket):
    torch.manual_seed(1)
    straight = TinyGPT().to(DEVICE)
    first = copy.deepcopy(straight)
    straight, s_opt = trainstream.wrap(straight, torch.optim.AdamW(straight.parameters(), lr=3e-3),
                                        offload=True)
    train(straight, s_opt, 10)
    first, f_opt = trainstream.wrap(first, torch.optim.AdamW(first.parameters(), lr=3e-3),
                                  offload=True)
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
    resumed, r_opt = trainstream.wrap(resumed, torch.optim.AdamW(resumed.parameters(), lr=3e-3),
                                      offload=True)
    r_opt.load_state_dict(saved_opt)
    train(resumed, r_opt, 5, start=5)
    assert max_diff(straight, resumed) == 0.0


def test_wrapped_model_keeps_no_gradient_or_state_in_torch(daemon_socket):
    model, opt = trainstream.wrap(TinyGPT().to(DEVICE), offload=True)
    train(model, opt, 2)
    assert all(len(s) == 0 for s in opt.state.values())
    report = trainstream.memory_report(model)
    assert report["optimizer"]["step"] == 2
    assert report["pinned"]["daemon_reserved"] > 0
    kinds = [e["kind"] for e in report["events"]]
    # wrap()'s decisions are in the daemon's log beside the daemon's own.
    assert "client.wrap.optimizer" in kinds and "optimizer.created" in kinds


@pytest.mark.parametrize("options", [
    dict(quantise="nf4"), dict(optimizer_mode="gpu"), dict(optimizer_mode="fast"),
    dict(accumulation_steps=0),
    dict(vram_headroom=1.5), dict(memory_wait_s=-1), dict(quant_block_size=3),
    dict(prefetch_depth=0), dict(param_offload="sometimes"), dict(recompute=[99]),
    dict(vram_budget=-1), dict(gpu_state_blocks=-1), dict(max_grad_norm=0),
    dict(host_arena=-5), dict(device="cpu", gradient_dtype="bfloat16"),
    dict(optimizer="sgd"), dict(guard_params=False), dict(max_activation_slowdown=-0.1),
    dict(min_offload_bytes=-5), dict(blocks=[torch.nn.Linear(4, 4)]), dict(lr="fast"),
    dict(device="tpu"), dict(threads=0), dict(peer="always"),
], ids=lambda o: ",".join(o))
def test_every_bad_option_is_a_trainstream_error_and_a_value_error(daemon_socket, options):
    """``except trainstream.TrainStreamError`` catches every option wrap() refuses, and so does
    ``except ValueError``; the model is left as it was."""
    model = TinyGPT()
    values = [p.detach().clone() for p in model.parameters()]
    named = "SGD" if "optimizer" in options else list(options)[-1]  # what the message names
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1) if options.pop("optimizer", None)
                 else None)
    with pytest.raises(trainstream.TrainStreamError) as raised:
        trainstream.wrap(model, optimizer, **options)
    assert isinstance(raised.value, ValueError), type(raised.value).__mro__
    assert named in str(raised.value), raised.value
    assert not hasattr(model, "_trainstream_session")
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters()))


@pytest.mark.parametrize("model, options, message", [
    (TinyGPT, dict(min_offload_bytes=-5), r"min_offload_bytes=-5 must be an integer >= 0"),
    (TinyGPT, dict(blocks=[torch.nn.Linear(4, 4)]),
     r"blocks\[0\] \(a Linear\) is not a module of the model.*list of the model's own"),
    (TinyGPT, dict(blocks="layers"), r"blocks='layers' must be None or a list of the model's"),
    (TinyGPT, dict(lr="fast"), r"lr='fast' must be a float >= 0"),
    (lambda: "x", {}, r"model='x' \(a str\) must be a torch.nn.Module"),
    (TinyGPT, dict(device="tpu"), r"device='tpu' must be None, 'cpu', 'cuda', 'cuda:N'"),
    (TinyGPT, dict(threads=0), r"^trainstream.wrap: threads=0 must be None or an integer >= 1"),
    (TinyGPT, dict(peer="always"), r"peer='always' must be 'auto', False, None or bytes"),
], ids=["min_offload_bytes", "blocks", "blocks-str", "lr", "model", "device", "threads",
        "peer"])
def test_a_bad_value_names_the_option_the_value_and_what_is_allowed(daemon_socket, model,
                                                                      options, message):
    """Issue 50: values that got through (min_offload_bytes=-5, blocks outside the model) or
    got another library's error (lr='fast', a model that is no module, device='tpu'), and
    threads=0, whose message named OffloadAdamW: each an InvalidArgumentError naming the option
    as the user wrote it, before anything is set up."""
    with pytest.raises(trainstream.InvalidArgumentError, match=message) as raised:
        trainstream.wrap(model(), **options)
    assert "OffloadAdamW" not in str(raised.value)


def test_a_cuda_device_the_machine_lacks_is_refused_naming_what_it_has(daemon_socket):
    """device='cuda' without a GPU (or 'cuda:N' past the GPUs there are) is refused by wrap()
    and load_model() with what this machine takes, not torch's assertion."""
    if torch.cuda.is_available():
        device, allowed = f"cuda:{torch.cuda.device_count()}", "'cuda:0' to"
    else:
        device, allowed = "cuda", "None or 'cpu' on this machine"
    with pytest.raises(trainstream.InvalidArgumentError, match=f"device='{device}' must be "
                                                               f".*{allowed}"):
        trainstream.wrap(TinyGPT(), device=device)
    pytest.importorskip("transformers")
    with pytest.raises(trainstream.InvalidArgumentError, match=f"load_model: device='{device}'"):
        trainstream.load_model("/nonexistent", device=device)


def test_peer_is_taken_and_an_event_says_why_it_is_off(daemon_socket):
    """TrainStream 0.6's peer= ('auto', False, None, bytes): taken; on one GPU (or none) the
    decision log says pooling across GPUs is off, and why."""
    for peer in ("auto", 1 << 30):
        model, _ = trainstream.wrap(TinyGPT(), peer=peer)
        said = [e for e in model._trainstream_session.events if e["kind"] == "wrap.peer"]
        assert len(said) == 1 and f"peer={peer!r}: peer-GPU pooling is off" in \
            said[0]["message"] and "one process on one GPU" in said[0]["message"]
        events = trainstream.memory_report(model)["events"]
        assert any(e["kind"] == "client.wrap.peer" for e in events)
        assert model._trainstream_session.peer is None
        trainstream.unwrap(model)
    model, _ = trainstream.wrap(TinyGPT(), peer=False)  # off as asked: nothing to say
    assert not [e for e in model._trainstream_session.events if e["kind"] == "wrap.peer"]
    trainstream.unwrap(model)


def test_memory_report_has_trainstream_06s_plan_and_activation_keys(daemon_socket):
    """memory_report() fills 0.6's plan.target_vram and plan.settled, activations'
    offloaded_blocks, recompute_blocks and decision from what the run does: here a CPU run
    (no VRAM plan: no target, settled) whose options page two blocks' activations and
    recompute one."""
    torch.manual_seed(2)
    model, opt = trainstream.wrap(TinyGPT(layers=4), device="cpu", offload=True,
                                  activation_offload=0.5, recompute=[3], min_offload_bytes=0)
    train(model, opt, 1, device="cpu")
    report = trainstream.memory_report(model)
    assert report["plan"]["target_vram"] is None and report["plan"]["settled"] is True
    activations = report["activations"]
    assert activations["policy"] == ["offload", "offload", "keep", "recompute"]
    assert activations["offloaded_blocks"] == [0, 1]
    assert activations["recompute_blocks"] == [3]
    decision = activations["decision"]
    assert decision["by"] == "options" and "activation_offload=0.5" in decision["reason"]
    assert decision["offloaded"] == [0, 1] and decision["recomputed"] == [3]
    assert report["params"]["quantized_blocks"] == []
    trainstream.unwrap(model)


def test_misuse_gets_clear_errors(daemon_socket):
    model, opt = trainstream.wrap(TinyGPT().to(DEVICE))
    with pytest.raises(trainstream.FailedPreconditionError, match="already wrapped"):
        trainstream.wrap(model)
    with pytest.raises(ValueError, match="SGD is not supported"):
        other = TinyGPT()
        trainstream.wrap(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="unknown option 'quantise'.*accepted"):
        trainstream.wrap(TinyGPT(), quantise="nf4")
    with pytest.raises(ValueError, match="optimizer_mode='fast' is not one of"):
        trainstream.wrap(TinyGPT(), optimizer_mode="fast")
    with pytest.raises(ValueError, match="optimizer_mode='gpu'.* cannot run here: the model is "
                                         "on the CPU"):
        trainstream.wrap(TinyGPT(), optimizer_mode="gpu")
    with pytest.raises(ValueError, match="vram_headroom=1.5 must be"):
        trainstream.wrap(TinyGPT(), vram_headroom=1.5)
    with pytest.raises(ValueError, match="gradient_dtype='int8' is not one of"):
        trainstream.wrap(TinyGPT(), gradient_dtype="int8")
    with pytest.raises(ValueError, match="gradient_dtype applies to CUDA models"):
        trainstream.wrap(TinyGPT(), device="cpu", gradient_dtype="bfloat16")
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


def test_offload_auto_on_a_cpu_model_keeps_the_daemon_and_says_so(daemon_socket):
    model, opt = trainstream.wrap(TinyGPT(), device="cpu")
    assert model._trainstream_session.adapting
    train(model, opt, 3, device="cpu")
    assert not model._trainstream_session.adapting and not opt.on_gpu
    decisions = [e for e in trainstream.memory_report(model)["events"]
                 if e["kind"] == "client.wrap.offload"]
    assert len(decisions) == 1 and "CPU model" in decisions[0]["message"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_auto_switches_to_fused_gpu_adamw_when_the_model_fits(daemon_socket):
    torch.manual_seed(4)
    ref = TinyGPT().to("cuda")
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(groups_of(ref))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.9 ** s)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(groups_of(ours)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    # The memory plan's probe step and the two steps that confirm its plan come first; the
    # choice is made on the settled plan's peak.
    train(ref, ref_opt, 3, scheduler=ref_sched)
    train(ours, opt, 2, scheduler=sched)
    assert not opt.on_gpu and ours._trainstream_session.adapting
    train(ours, opt, 1, scheduler=sched, start=2)
    assert opt.on_gpu and not ours._trainstream_session.adapting
    # The moments moved with it: the trajectory continues as stock AdamW's, scheduler and all.
    train(ref, ref_opt, 17, scheduler=ref_sched, start=3)
    train(ours, opt, 17, scheduler=sched, start=3)
    assert max_diff(ref, ours) <= 1e-5
    assert ours._trainstream_session.steps == 20
    assert all(p.grad is None for p in ours.parameters())  # zero_grad reached the GPU optimizer
    decisions = [e for e in trainstream.memory_report(ours)["events"]
                 if e["kind"] == "client.wrap.offload"]
    assert len(decisions) == 1 and decisions[0]["message"].startswith("switched to torch fused")
    assert decisions[0]["numbers"]["need_bytes"] < decisions[0]["numbers"]["allowed_bytes"]
    assert opt.state_dict()["state"][0]["step"].item() == 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_auto_keeps_offloading_when_the_model_would_not_fit(daemon_socket, monkeypatch):
    # A VRAM cap far below what stock AdamW would need.
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1e-6)
    # The block stack's plan is left out: under that cap it would stream every block.
    model, opt = trainstream.wrap(TinyGPT().to("cuda"), param_offload=False,
                                  activation_offload=False, recompute=False)
    train(model, opt, 3)
    assert not opt.on_gpu
    assert all(len(s) == 0 for s in opt.state.values())
    decisions = [e for e in trainstream.memory_report(model)["events"]
                 if e["kind"] == "client.wrap.offload"]
    assert len(decisions) == 1 and decisions[0]["message"].startswith("kept offloaded")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_updates_follow_a_parameter_given_new_storage(daemon_socket):
    # The native side copies each update straight into the parameter's device memory; a
    # parameter whose storage is replaced between steps must get its updates at the new address.
    ref, ref_opt, ours, opt = stock_and_wrapped(5, "cuda")
    train(ref, ref_opt, 3)
    train(ours, opt, 3)
    opt.synchronize()
    moved = ours.blocks[0].mlp[0].weight
    old = moved.data
    moved.data = old.clone()
    old.fill_(float("nan"))  # a stale copy target would leave the real weight behind
    train(ref, ref_opt, 5, start=3)
    train(ours, opt, 5, start=3)
    assert max_diff(ref, ours) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_block_waits_for_its_own_updates_once_per_forward(daemon_socket):
    # Updates are copied back to the GPU during backward, and a forward waits for its own
    # parameters' copies. A block waits once for everything inside it, rather than each of its
    # layers on its own (a LoRA block would call seven hooks); training stays exact.
    ref, ref_opt, ours, opt = stock_and_wrapped(11, "cuda", layers=3)

    def waits():
        hooks = trainstream.memory_report(ours)["hooks"]["per_hook"]
        return hooks["optimizer.forward_wait"]["calls"]

    before = waits()
    train(ref, ref_opt, 3)
    train(ours, opt, 3)
    # Each forward: the 3 blocks, and the 4 modules outside them that own a trained parameter
    # (wte, wpe, ln_f and the tied head).
    assert waits() - before == 3 * (3 + 4)
    assert max_diff(ref, ours) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_gradients_leave_in_batches_by_the_end_of_backward(daemon_socket):
    # TinyGPT's gradients are all under 1 MiB: they leave in batches, and the last batch when
    # backward ends, not at step() (the host optimizer starts on them meanwhile).
    ref, ref_opt, ours, opt = stock_and_wrapped(12, "cuda", layers=3, accumulation_steps=2)
    for step in range(3):
        for micro in range(2):
            x, y = batch(2 * step + micro, device="cuda")
            (loss_fn(ref, x, y) / 2).backward()
            (loss_fn(ours, x, y) / 2).backward()
            assert opt.gradients.batched == 0  # sent when backward ended
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    hooks = trainstream.memory_report(ours)["hooks"]["per_hook"]
    # The end-of-backward send ran for each of the six backward passes.
    assert hooks["optimizer.gradient_batch"]["calls"] >= 6
    assert max_diff(ref, ours) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_gradients_and_moments_stay_close_to_fp32_adamw(daemon_socket):
    ref, ref_opt, ours, opt = stock_and_wrapped(6, "cuda", gradient_dtype="bfloat16",
                                                moment_dtype="bfloat16")
    # The daemon's gradient slots are bf16: half the bytes cross PCIe.
    assert all(opt.host.grad(i).dtype == torch.bfloat16 for i in range(len(opt.table)))
    train(ref, ref_opt, 20)
    train(ours, opt, 20)
    # bf16 keeps 8 bits of mantissa: each update is off by about 2^-9 of its size.
    assert 0 < max_diff(ref, ours) <= 2e-3


def test_add_param_group_mid_run_matches_stock_adamw(daemon_socket):
    # Train the blocks first, then unfreeze the embeddings and head with their own lr, as a
    # fine-tune that thaws layers does; stock AdamW does the same.
    def frozen_start(model):
        for p in (model.wte.weight, model.wpe.weight):
            p.requires_grad_(False)
        rest = [p for p in model.parameters() if p.requires_grad]
        return rest, [model.wte.weight, model.wpe.weight]

    torch.manual_seed(9)
    ref = TinyGPT().to(DEVICE)
    ours = copy.deepcopy(ref)
    ref_rest, ref_thawed = frozen_start(ref)
    our_rest, our_thawed = frozen_start(ours)
    ref_opt = torch.optim.AdamW(ref_rest, lr=3e-3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(our_rest, lr=3e-3), offload=True)
    train(ref, ref_opt, 3)
    train(ours, opt, 3)
    for p in ref_thawed + our_thawed:
        p.requires_grad_(True)
    ref_opt.add_param_group(dict(params=ref_thawed, lr=1e-3, weight_decay=0.0))
    opt.add_param_group(dict(params=our_thawed, lr=1e-3, weight_decay=0.0))
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 1e-3
    train(ref, ref_opt, 5, start=3)
    train(ours, opt, 5, start=3)
    assert max_diff(ref, ours) <= 1e-5
    assert opt.state_dict()["state"][len(our_rest)]["step"].item() == 5
    kinds = [e["kind"] for e in trainstream.memory_report(ours)["events"]]
    assert "optimizer.extended" in kinds
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group(dict(params=our_thawed))


def test_after_the_switch_clipping_steps_and_checkpoints_carry_on(daemon_socket, tmp_path):
    # The GPU switch's bookkeeping, exercised on a CPU model (torch's fused AdamW runs on the
    # CPU too): clipping keeps happening, step counts continue, and a daemon checkpoint taken
    # after the switch restores the same trajectory.
    torch.manual_seed(10)
    ref = TinyGPT()
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=3e-3),
                                 offload=True, max_grad_norm=0.5, device="cpu")
    train(ref, ref_opt, 2, clip=0.5, device="cpu")
    train(ours, opt, 2, device="cpu")
    opt._switch_to_gpu()
    assert opt.on_gpu and opt.steps == 2
    train(ref, ref_opt, 3, clip=0.5, start=2, device="cpu")
    train(ours, opt, 3, start=2, device="cpu")
    assert max_diff(ref, ours) <= 1e-5 and opt.steps == 5 and opt.last_grad_norm > 0
    opt.save(str(tmp_path / "opt.safetensors"))
    assert opt.steps == 5
    train(ours, opt, 2, start=5, device="cpu")
    after = [p.detach().clone() for p in ours.parameters()]
    opt.load(str(tmp_path / "opt.safetensors"))  # weights, moments and steps of step 5
    assert opt.steps == 5
    train(ours, opt, 2, start=5, device="cpu")
    assert max((a - p.detach()).abs().max().item() for a, p in zip(after, ours.parameters())) == 0


def test_optimizer_state_in_vram_is_refused_with_the_reason(daemon_socket):
    torch.manual_seed(11)
    model = TinyGPT()
    ref = copy.deepcopy(model)
    # A torch AdamW with moments already (lr 0: the weights stay as they are).
    user_opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    loss_fn(model, *batch(0)).backward()
    user_opt.step()
    user_opt.zero_grad()
    with pytest.raises(ValueError, match="gpu_state_blocks=1: a CPU model's updates land in "
                                         "place"):
        trainstream.wrap(model, user_opt, device="cpu", gpu_state_blocks=1)
    assert len(user_opt.state) == len(list(model.parameters()))  # its moments stayed
    # ...and the job it made is gone from the daemon, not kept for a restart to re-attach.
    with trainstream.connect(daemon_socket, job_id="observer") as observer:
        assert observer.memory()["plans"] == [] and observer.memory()["reserved_bytes"] == 0
        assert [e["kind"] for e in observer.events() if e["kind"] == "optimizer.ended"] == [
            "optimizer.ended"]
    for bad in (-1, True):
        with pytest.raises(ValueError, match=f"gpu_state_blocks={bad} must be 'auto' or an"):
            trainstream.wrap(model, device="cpu", gpu_state_blocks=bad)
    # The refused wrap left nothing on the model: wrapped again, it trains as stock does.
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                                  device="cpu", offload=True)
    train(ref, ref_opt, 3, device="cpu")
    train(model, opt, 3, device="cpu")
    assert max_diff(ref, model) <= 1e-5
    trainstream.unwrap(model)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="staged_state_blocks=1: max_grad_norm and "
                                             "compute_grad_norm need the global gradient norm"):
            trainstream.wrap(model, max_grad_norm=1.0, staged_state_blocks=1)
        with pytest.raises(ValueError, match="gpu_state_blocks=3 but the model has 2 blocks"):
            trainstream.wrap(model, gpu_state_blocks=3)


def test_staging_moments_through_a_cpu_model_is_refused(daemon_socket):
    for bad in (-1, True, "all"):
        with pytest.raises(ValueError, match=f"staged_state_blocks={bad!r} must be 'auto' or"):
            trainstream.wrap(TinyGPT(), device="cpu", staged_state_blocks=bad)
    with pytest.raises(ValueError, match="staged_state_blocks=1: a CPU model's updates land"):
        trainstream.wrap(TinyGPT(), device="cpu", staged_state_blocks=1)
    model, opt = trainstream.wrap(TinyGPT(), device="cpu", offload=True)
    with pytest.raises(trainstream.FailedPreconditionError,
                       match="cannot move to VRAM: a CPU model's updates land in place"):
        opt.keep_state_on_device(set(), {id(p) for p in model.blocks[1].parameters()})
    assert opt.stats()["staged_state"] == {"tensors": 0, "elements": 0, "engine": "staged",
                                           "chunks": 0,
                                           "bytes_each_way": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_clipping_with_state_in_vram_clips_by_the_whole_models_norm(daemon_socket,
                                                                     accumulation):
    # The first block's and the embeddings' state is updated in VRAM, the other block's in the
    # daemon: the clip still uses the norm over every gradient, as clip_grad_norm_ does (the
    # Trainer's default max_grad_norm=1.0 no longer sends all state to the host).
    torch.manual_seed(21)
    ref = TinyGPT().to("cuda")
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(groups_of(ref))
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(groups_of(ours)), offload=True,
                                 accumulation_steps=accumulation, max_grad_norm=0.1,
                                 gpu_state_blocks=1)
    train(ref, ref_opt, 10, accumulation, clip=0.1)
    train(ours, opt, 10, accumulation)  # clipped inside the optimizer
    assert opt.stats()["gpu_state"]["elements"] > 0
    assert opt.last_grad_norm > 0.1  # the clip bit
    assert max_diff(ref, ours) <= 1e-5
    trainstream.unwrap(ours)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_optimizer_state_kept_in_vram_follows_stock_adamw(daemon_socket, accumulation):
    # The first block's and the embeddings' AdamW state move to VRAM after the probe step and
    # are updated there by torch's fused AdamW; the other block's stays in the daemon. The
    # trajectory is stock AdamW's, with two groups and a scheduler.
    ref, ref_opt, ref_sched, ours, opt, sched = scheduled_twins(12, accumulation,
                                                                gpu_state_blocks=1)
    held = opt.stats()["gpu_state"]
    inside = {id(p) for p in ours.blocks[0].parameters()}
    outside = [p for p in ours.parameters() if id(p) not in
               {id(q) for b in ours.blocks for q in b.parameters()}]
    assert held["tensors"] == len(inside) + len(outside)
    assert held["elements"] == sum(p.numel() for p in ours.blocks[0].parameters()) + sum(
        p.numel() for p in outside)
    sent = opt.bytes_to_host
    train(ref, ref_opt, 9, accumulation, scheduler=ref_sched, start=1)
    train(ours, opt, 9, accumulation, scheduler=sched, start=1)
    assert max_diff(ref, ours) <= 1e-5
    # Only the second block's gradients left the GPU since.
    assert opt.bytes_to_host - sent == 9 * accumulation * 4 * sum(
        p.numel() for p in ours.blocks[1].parameters())
    assert all(p.grad is None for p in ours.parameters())
    events = [e for e in trainstream.memory_report(ours)["events"]
              if e["kind"] == "client.plan.gpu_state"]
    assert len(events) == 1 and "blocks 0-0" in events[0]["message"]
    assert events[0]["numbers"]["gpu_state_elements"] == held["elements"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("accumulation", [1, 2])
def test_optimizer_state_staged_through_the_gpu_follows_stock_adamw(daemon_socket, tmp_path,
                                                                     accumulation):
    # Block 1's moments stay in the daemon and go through VRAM for each of its updates, made
    # by torch's fused AdamW as backward finishes its gradients; block 0's live in VRAM. With
    # two groups and a scheduler the trajectory is stock AdamW's, a checkpoint holds it, and
    # it moves back to the daemon between steps.
    ref, ref_opt, ref_sched, ours, opt, sched = scheduled_twins(16, accumulation,
                                                                gpu_state_blocks=0)
    held = {id(p) for p in ours.blocks[0].parameters()}
    staged = {id(p) for p in ours.blocks[1].parameters()}
    elements = sum(p.numel() for p in ours.blocks[1].parameters())
    assert opt.keep_state_on_device(held, staged) == sum(
        p.numel() for p in ours.blocks[0].parameters())
    assert opt.stats()["staged_state"]["tensors"] == len(staged)
    assert opt.stats()["staged_state"]["elements"] == elements
    sent = opt.bytes_to_host
    train(ref, ref_opt, 5, accumulation, scheduler=ref_sched, start=1)
    train(ours, opt, 5, accumulation, scheduler=sched, start=1)
    assert max_diff(ref, ours) <= 1e-5
    # Their moments went up and down once a step, 8 bytes an element each way; no other
    # gradient left the GPU (the embeddings' are the daemon's: 4 bytes each micro-step).
    outside = sum(p.numel() for p in ours.parameters()) - elements - sum(
        p.numel() for p in ours.blocks[0].parameters())
    assert opt.stats()["staged_state"]["bytes_each_way"] == 5 * 8 * elements
    assert opt.bytes_to_host - sent == 5 * 8 * elements + 5 * accumulation * 4 * outside
    assert all(p.grad is None for p in ours.parameters())
    # Its state_dict holds every moment and step as they are now.
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    for key, entry in ref_state["state"].items():
        assert state["state"][key]["step"].item() == entry["step"].item() == 6
        for name in ("exp_avg", "exp_avg_sq"):
            assert (state["state"][key][name].to("cuda") - entry[name]).abs().max() < 1e-6
    # The daemon's checkpoint too: restored without staging, the run carries on as stock.
    opt.save(str(tmp_path / "opt.ckpt"))
    # Loaded right after a step, whose staged copies may still be in flight, it lands whole.
    saved = {name: p.detach().clone() for name, p in ours.named_parameters()}
    train(ours, opt, 1, accumulation, start=6)
    opt.load(str(tmp_path / "opt.ckpt"))
    assert all(torch.equal(p, saved[name]) for name, p in ours.named_parameters())
    assert opt.state_dict()["state"][0]["step"].item() == 6
    torch.manual_seed(0)
    restored = TinyGPT().to("cuda")
    restored.load_state_dict(ours.state_dict())
    restored, r_opt = trainstream.wrap(restored, torch.optim.AdamW(groups_of(restored)),
                                       offload=True, gpu_state_blocks=0,
                                       accumulation_steps=accumulation)
    r_opt.load(str(tmp_path / "opt.ckpt"))
    after = copy.deepcopy(ref)
    after_opt = torch.optim.AdamW(groups_of(after))
    after_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # not ref_opt's tensors
    for g, scheduled in zip(r_opt.param_groups, after_opt.param_groups):
        g["lr"] = scheduled["lr"]  # the scheduler's lr at step 6 (the file has the daemon's)
    train(after, after_opt, 2, accumulation, start=6)
    train(restored, r_opt, 2, accumulation, start=6)
    assert max_diff(after, restored) <= 1e-5
    # Back in the daemon between steps, training goes on there.
    opt.keep_state_on_device(set())
    assert opt.stats()["staged_state"]["tensors"] == 0
    train(ref, ref_opt, 2, accumulation, scheduler=ref_sched, start=6)
    train(ours, opt, 2, accumulation, scheduler=sched, start=6)
    assert max_diff(ref, ours) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wrap_stages_the_blocks_asked_for_and_follows_stock_adamw(daemon_socket):
    ref, ref_opt, ours, opt = stock_and_wrapped(17, device="cuda", gpu_state_blocks=1,
                                                staged_state_blocks=1)
    train(ref, ref_opt, 4)
    train(ours, opt, 4)
    staged = opt.stats()["staged_state"]
    assert staged["tensors"] == len(list(ours.blocks[1].parameters()))
    assert staged["chunks"] >= 3 and staged["bytes_each_way"] > 0
    assert max_diff(ref, ours) <= 1e-5
    said = [e["message"] for e in trainstream.memory_report(ours)["events"]
            if e["kind"] == "client.plan.gpu_state"]
    assert said and "moments staged" in said[-1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_optimizer_state_in_vram_checkpoints_and_moves_back(daemon_socket, tmp_path):
    ref, ref_opt, ours, opt = stock_and_wrapped(14, device="cuda", gpu_state_blocks=1)
    train(ref, ref_opt, 4)
    train(ours, opt, 4)
    assert opt.stats()["gpu_state"]["tensors"] > 0
    # Its state_dict holds the VRAM part as it is now (steps 2-4 ran there).
    state = opt.state_dict()
    ref_state = ref_opt.state_dict()
    assert len(state["state"]) == len(ref_state["state"])
    for key, entry in ref_state["state"].items():
        assert state["state"][key]["step"].item() == entry["step"].item() == 4
        for name in ("exp_avg", "exp_avg_sq"):
            assert (state["state"][key][name].to("cuda") - entry[name]).abs().max() < 1e-6
    assert all(torch.equal(master.to("cuda").reshape(p.shape), p.detach())
               for master, p in zip(state["master"], ours.parameters()))
    # The daemon's file holds it too: a run restored from it, without state in VRAM, carries
    # on as stock AdamW does.
    opt.save(str(tmp_path / "opt.ckpt"))
    weights = copy.deepcopy(ours.state_dict())
    torch.manual_seed(0)
    restored = TinyGPT().to("cuda")
    restored.load_state_dict(weights)
    restored, r_opt = trainstream.wrap(restored, torch.optim.AdamW(restored.parameters(),
                                                                   lr=3e-3),
                                       offload=True, gpu_state_blocks=0)
    r_opt.load(str(tmp_path / "opt.ckpt"))
    assert r_opt.stats()["gpu_state"]["tensors"] == 0
    train(ref, ref_opt, 3, start=4)
    train(restored, r_opt, 3, start=4)
    assert max_diff(ref, restored) <= 1e-5
    # The state moves back to the daemon between steps, and training goes on there.
    opt.keep_state_on_device(set())
    assert opt.stats()["gpu_state"]["tensors"] == 0
    train(ours, opt, 3, start=4)
    assert max_diff(ref, ours) <= 1e-5
    # Loading a checkpoint into a run that keeps state in VRAM puts it there, weights and all.
    blocks_0 = {id(p) for p in ours.blocks[0].parameters()}
    assert opt.keep_state_on_device(blocks_0) == sum(p.numel() for p in ours.blocks[0].parameters())
    opt.load(str(tmp_path / "opt.ckpt"))
    assert all(torch.equal(p, weights[name]) for name, p in ours.named_parameters())
    train(ours, opt, 3, start=4)
    assert max_diff(ref, ours) <= 1e-5
    # A stock AdamW state_dict (no master weights) loads moments and steps and leaves every
    # weight as it is, those updated in VRAM included.
    before = [p.detach().clone() for p in ours.parameters()]
    opt.load_state_dict(ref_opt.state_dict())
    assert all(torch.equal(a, p) for a, p in zip(before, ours.parameters()))
    train(ref, ref_opt, 2, start=7)
    train(ours, opt, 2, start=7)
    assert max_diff(ref, ours) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_the_plan_chose_is_timed_against_the_plan_without_it(start_daemon,
                                                                       monkeypatch):
    # A host-bound run (one optimizer thread) whose first block's state is held in VRAM: the
    # planner stages the others' moments through the GPU, and the settled steps are then
    # timed with staging and without; the faster plan stays (kept, the very plan timed runs
    # again), the events say both times, and the trajectory is stock AdamW's all along.
    ref, ref_opt, ours, opt = host_bound_twins(start_daemon, monkeypatch, 16,
                                               gpu_state_blocks=1)
    session = ours._trainstream_session

    def decisions():
        plan = session.plan
        return (plan.state.blocks, plan.state.staged_blocks, tuple(plan.plan.paged_blocks),
                tuple(plan.plan.activation_policy))

    staged_at, chunks_at, plans_at, plan_objects, decided_at = [], [], [], [], []
    for step in range(40):
        train(ref, ref_opt, 1, start=step)
        train(ours, opt, 1, start=step)
        decided_at.append(sum(e["kind"] == "plan.staging_trial" for e in session.events))
        staged_at.append(session.plan.state.staged_blocks)
        plans_at.append(decisions())
        plan_objects.append(session.plan.plan)
        chunks_at.append(opt.stats()["staged_state"]["chunks"])
        if not session.plan.adapting:
            break
    assert not session.plan.adapting
    first = next(i for i, n in enumerate(staged_at) if n)  # the probe's plan staged blocks
    # The side without staging ran for a while (settling, then timed), staging no chunk.
    unstaged = [i for i in range(first, len(staged_at)) if staged_at[i] == 0]
    assert len(unstaged) >= 3
    assert chunks_at[unstaged[-1]] == chunks_at[unstaged[0]]
    trial = [e for e in trainstream.memory_report(ours)["events"]
             if e["kind"] == "client.plan.staging_trial"]
    assert len(trial) == 2, trial
    assert trial[0]["message"].startswith("staging measured: ")
    staged_ms, unstaged_ms = (trial[1]["numbers"][k] for k in ("staged_ms", "unstaged_ms"))
    assert staged_ms > 0 and unstaged_ms > 0
    assert trial[0]["numbers"]["step_ms"] == pytest.approx(staged_ms)
    kept = staged_ms < unstaged_ms
    assert trial[1]["message"].startswith("staging kept" if kept else "staging dropped")
    assert (session.plan.state.staged_blocks > 0) == kept
    # Either way the plan that runs was timed, its peaks read: it settles on the deciding step.
    assert decided_at[-1] == 2 and decided_at[-2] == 1, decided_at
    if kept:  # the plan timed, not one made again with as many staged blocks
        assert session.plan.plan is plan_objects[unstaged[0] - 1]
        assert decisions() == plans_at[unstaged[0] - 1]
        assert session.plan.state.staged_blocks == trial[0]["numbers"]["staged_blocks"]
    assert (opt.stats()["staged_state"]["tensors"] > 0) == kept
    assert max_diff(ref, ours) <= 1e-5
    # Decided once: later steps neither time nor switch again.
    train(ref, ref_opt, 3, start=40)
    train(ours, opt, 3, start=40)
    assert len([e for e in trainstream.memory_report(ours)["events"]
                if e["kind"] == "client.plan.staging_trial"]) == 2
    assert max_diff(ref, ours) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_bound_run_moves_optimizer_state_to_vram_by_itself(start_daemon, monkeypatch):
    # One optimizer thread and wide blocks under a tiny batch: the host's AdamW pass over 13M
    # parameters takes longer than the step's compute, and VRAM has room, so the plan made
    # after the probe step keeps state in VRAM on its own, says so, and the trajectory stays
    # stock AdamW's.
    ref, ref_opt, ours, opt = host_bound_twins(start_daemon, monkeypatch, 15)
    train(ref, ref_opt, 4)
    train(ours, opt, 4)
    report = trainstream.memory_report(ours)
    plan = report["plan"]
    assert plan["measured"]["host_pass_s"] > 0
    assert plan["gpu_state_blocks"] >= 1
    assert report["optimizer"]["gpu_state"]["elements"] == plan["gpu_state_elements"] > 0
    moves = [e for e in report["events"] if e["kind"] == "client.plan.gpu_state"]
    assert moves and "lives in VRAM" in moves[-1]["message"]
    assert any("kept in VRAM and updated there at step()" in line
               for line in plan["history"])
    train(ref, ref_opt, 4, start=4)
    train(ours, opt, 4, start=4)
    assert max_diff(ref, ours) <= 1e-5


def test_two_offload_adamw_of_one_process_are_two_jobs():
    """Without a job_id, each OffloadAdamW of a single-rank process is a job of its own (they
    collided before: "rank 0 of job 'default' is already attached"), and each steps like
    torch.optim.AdamW on its own parameters."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    references = [copy.deepcopy(m) for m in models]
    ours = [trainstream.OffloadAdamW(m.parameters(), lr=1e-2) for m in models]
    theirs = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in references]
    assert len({o.stats()["job_id"] for o in ours}) == 2
    for _ in range(3):
        x = torch.randn(5, 8)
        for model, opt in [*zip(models, ours), *zip(references, theirs)]:
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for model, reference in zip(models, references):
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-6), (p, q)
    for opt in ours:
        opt.detach()


def test_trainstream_06_options_are_taken_with_their_meaning(daemon_socket):
    """guard_params=True (forwards wait for the updates of the weights they read: how it always
    works) and max_activation_slowdown (activation paging's bound where there is no VRAM
    target; wrap() always has one) are accepted, as TrainStream 0.6 took them."""
    model, opt = trainstream.wrap(TinyGPT(), guard_params=True, max_activation_slowdown=0.3)
    assert model._trainstream_session.config.compatibility.max_activation_slowdown == 0.3
    trainstream.unwrap(model)


def test_offload_adamw_takes_trainstream_06s_arguments(daemon_socket):
    """mode='cpu' and attach(model) as TrainStream 0.6 had them: after attach, a forward between
    the last backward and step() reads every update (it completes the iteration); mode='gpu',
    attach(guard=False) and distributed=True without a process group say why they are refused."""
    model = TinyGPT()
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-2, mode="cpu")
    # torch keeps a module's forward pre-hooks in this dict: attach() adds the model's own.
    hooks = len(model._forward_pre_hooks)
    assert opt.attach(model) is opt
    assert len(model._forward_pre_hooks) == hooks + 1
    x = torch.randint(0, 64, (2, 8))
    before = [p.detach().clone() for p in model.parameters()]
    model(x).float().mean().backward()
    model(x)  # the attached model's forward waits for the iteration's updates first
    assert opt.stats()["step"] == 1
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.step()
    opt.zero_grad()
    assert opt.stats()["step"] == 1  # step() finds the iteration done; it does not step again
    with pytest.raises(trainstream.InvalidArgumentError, match="guard=False"):
        opt.attach(model, guard=False)
    opt.detach()
    assert len(model._forward_pre_hooks) == hooks
    with pytest.raises(trainstream.InvalidArgumentError, match="mode='gpu'"):
        trainstream.OffloadAdamW(TinyGPT().parameters(), mode="gpu")
    with pytest.raises(trainstream.FailedPreconditionError, match="process group"):
        trainstream.OffloadAdamW(TinyGPT().parameters(), distributed=True)
