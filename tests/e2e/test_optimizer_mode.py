# SPDX-License-Identifier: Apache-2.0
"""optimizer_mode (OffloadAdamW's mode): "gpu" updates each parameter on the GPU over the state
in trainstreamd's pinned memory (zero-copy), exactly as the daemon's pass would have; "auto"
chooses from the hardware profile and says why; what cannot run on the GPU is refused with
the reason. On a real daemon; the GPU cases are marked."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import trainstream

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, batch, loss_fn, train_steps  # noqa: E402

from trainstream.optim.update_mode import choose_mode  # noqa: E402



def on_gpu(test):
    """A GPU test: marked, and skipped with the reason where no CUDA GPU is."""
    return pytest.mark.gpu(pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU on this machine")(test))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list:
    """The names of the parameters whose bits differ."""
    return [n for (n, p), q in zip(a.named_parameters(), b.parameters())
            if not torch.equal(_bits(p), _bits(q))]


def test_auto_weighs_the_host_pass_against_the_link():
    """The faster path wins, and the reason carries both estimates."""
    params = [torch.empty(1000, 1000, dtype=torch.bfloat16)]
    fast_link = {"host_copy_gbps": 20.0, "gpu": {"h2d_gbps": 50.0, "d2h_gbps": 50.0}}
    slow_link = {"host_copy_gbps": 200.0, "gpu": {"h2d_gbps": 3.0, "d2h_gbps": 3.0}}
    mode, why, figures = choose_mode(params, torch.float32, fast_link)
    assert mode == "gpu" and "chose 'gpu'" in why and figures["gpu_ms"] < figures["host_ms"]
    mode, why, figures = choose_mode(params, torch.float32, slow_link)
    assert mode == "cpu" and "chose 'cpu'" in why and figures["gpu_ms"] > figures["host_ms"]
    assert "1,000,000 parameters" in why
    mode, why, _ = choose_mode(params, torch.float32, {"host_copy_gbps": 20.0, "gpu": None})
    assert mode == "cpu" and "no host or PCIe bandwidth" in why


def test_what_the_gpu_cannot_update_is_refused_with_the_reason():
    """Each refusal names its cause; "gpu" raises it, "auto" falls back to "cpu" with it."""
    from trainstream.optim.placement import gpu_update_refusal
    from trainstream.optim.update_mode import decide_mode

    bf16 = [torch.empty(8, dtype=torch.bfloat16)]
    assert gpu_update_refusal(True, 1, 1, "guard", bf16) is None
    assert gpu_update_refusal(True, 1, 1, "ignore", bf16) is None
    cases = {
        (False, 1, 1, "guard"): "the model is on the CPU",
        (True, 2, 1, "guard"): "data-parallel",
        (True, 1, 2, "guard"): "data-parallel",
        (True, 1, 1, "skip"): "nonfinite='skip'",
        (True, 1, 1, "error"): "nonfinite='error'",
    }
    for (cuda, world, machines, nonfinite), said in cases.items():
        reason = gpu_update_refusal(cuda, world, machines, nonfinite, bf16)
        assert said in reason
        with pytest.raises(trainstream.InvalidArgumentError, match=said):
            decide_mode("gpu", reason, bf16, torch.float32)
        mode, why, _ = decide_mode("auto", reason, bf16, torch.float32)
        assert mode == "cpu" and said in why
    odd = [torch.empty(8, dtype=torch.float64), torch.empty(4, 4).t()]
    assert "fp32, bf16 or fp16" in gpu_update_refusal(True, 1, 1, "guard", odd)
    assert decide_mode("cpu", None, bf16, torch.float32)[0] == "cpu"
    assert decide_mode("gpu", None, bf16, torch.float32)[0] == "gpu"


def test_auto_on_a_cpu_model_stays_on_the_host_and_says_why(daemon_socket):
    model, opt = trainstream.wrap(TinyGPT(), optimizer_mode="auto")
    train_steps(model, opt, 1)
    said = opt.stats()["optimizer_mode"]
    assert said["mode"] == "cpu" and "the model is on the CPU" in said["why"]
    events = [e for e in trainstream.memory_report(model)["events"]
              if e["kind"] == "client.optimizer.mode"]
    assert events and "chose 'cpu'" in events[-1]["message"]
    trainstream.unwrap(model)


def test_an_optimizer_made_alone_says_its_choice_in_the_daemons_log(daemon_socket):
    """OffloadAdamW(mode="auto") without wrap(): the decision is in the events tsctl shows."""
    opt = trainstream.OffloadAdamW(TinyGPT().parameters(), mode="auto")
    said = [e for e in opt.client.events() if e["kind"] == "client.optimizer.mode"]
    assert len(said) == 1 and "optimizer_mode='auto' chose 'cpu'" in said[0]["message"]
    opt.detach()


def test_gpu_mode_refusals_name_the_reason(daemon_socket):
    with pytest.raises(trainstream.InvalidArgumentError,
                       match="optimizer_mode='gpu'.*the model is on the CPU"):
        trainstream.OffloadAdamW(TinyGPT().parameters(), mode="gpu")
    with pytest.raises(trainstream.InvalidArgumentError, match="'cpu'.*'gpu'.*'auto'"):
        trainstream.OffloadAdamW(TinyGPT().parameters(), mode="fast")


# -- on a GPU --------------------------------------------------------------------------------


def _pair(dtype: torch.dtype, moment_dtype: str, kind: str, **options):
    """A CUDA TinyGPT in ``dtype`` under mode="cpu" and an identical one under mode="gpu"."""
    torch.manual_seed(11)
    host = TinyGPT().to("cuda", dtype)
    gpu = copy.deepcopy(host)
    made = []
    for model, mode in ((host, "cpu"), (gpu, "gpu")):
        made.append(trainstream.OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.05,
                                             kind=kind, moment_dtype=moment_dtype, mode=mode,
                                             **options))
    return host, gpu, made[0], made[1]


def _train_both_to_the_same_bits(host, gpu, host_opt, gpu_opt, steps: int) -> None:
    """Trains both ``steps`` steps; the weights, moments, steps and fp32 masters of the GPU
    mode's run must be the daemon's pass's, bit for bit."""
    train_steps(host, host_opt, steps, device="cuda")
    train_steps(gpu, gpu_opt, steps, device="cuda")
    host_opt.synchronize()
    gpu_opt.synchronize()
    assert _same(host, gpu) == []
    ours, theirs = gpu_opt.state_dict(), host_opt.state_dict()
    for k in theirs["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(ours["state"][k][key]), _bits(theirs["state"][k][key])), k
        assert int(ours["state"][k]["step"]) == int(theirs["state"][k]["step"]) == steps
        assert torch.equal(_bits(ours["master"][k]), _bits(theirs["master"][k])), k


@pytest.mark.parametrize("dtype,moment_dtype,kind", [
    (torch.float32, "float32", "adamw"), (torch.bfloat16, "float32", "adamw"),
    (torch.bfloat16, "bfloat16", "adamw"), (torch.float32, "float32", "adam")])
@on_gpu
def test_gpu_mode_matches_the_daemons_pass_bit_for_bit(daemon_socket, dtype, moment_dtype,
                                                       kind):
    """Three steps updated on the GPU leave the weights, the fp32 masters and the moments
    exactly as the daemon's pass leaves them (bf16 moments' stochastic rounding included);
    nothing crosses PCIe but the state."""
    host, gpu, host_opt, gpu_opt = _pair(dtype, moment_dtype, kind)
    assert gpu_opt.updates_on_gpu and gpu_opt.staged_state_elements == sum(
        p.numel() for p in gpu.parameters())
    _train_both_to_the_same_bits(host, gpu, host_opt, gpu_opt, 3)
    stats = gpu_opt.stats()
    assert stats["staged_state"]["engine"] == "mapped"
    assert stats["staged_state"]["nonfinite_values"] == 0
    assert stats["staged_state"]["chunks"] == 3 * len(list(gpu.parameters()))
    assert gpu_opt.bytes_to_host == stats["staged_state"]["bytes_each_way"] > 0
    host_opt.detach()
    gpu_opt.detach()


@on_gpu
def test_batches_of_every_size_match_the_daemons_pass(daemon_socket, monkeypatch):
    """Small gradients wait for a batch: with the limits lowered (batches of up to 3, and
    gradients over 16 KiB at once), a step launches some at once, several batches during
    backward and the rest at its end, with the guard's flag recorded launch by launch; three
    steps still leave every bit as the daemon's pass does."""
    from trainstream.optim import mapped_adamw

    monkeypatch.setattr(mapped_adamw, "_BATCH_GRADIENTS", 3)
    monkeypatch.setattr(mapped_adamw, "_BATCH_EACH_BYTES", 16 << 10)
    host, gpu, host_opt, gpu_opt = _pair(torch.float32, "float32", "adamw")
    sizes = [4 * p.numel() for p in gpu.parameters()]
    assert any(n > 16 << 10 for n in sizes) and sum(n <= 16 << 10 for n in sizes) > 3
    _train_both_to_the_same_bits(host, gpu, host_opt, gpu_opt, 3)
    assert gpu_opt.stats()["staged_state"]["chunks"] == 3 * len(sizes)
    host_opt.detach()
    gpu_opt.detach()


@on_gpu
def test_a_non_finite_gradient_midway_stops_the_updates_from_there_on(daemon_socket,
                                                                      monkeypatch):
    """nonfinite="guard" with one parameter's gradient NaN: the parameters whose gradients
    came before it (backward's order) are updated and take their step, it and those after
    are left as they were with their step taken back, also inside one batch."""
    from trainstream.optim import mapped_adamw

    monkeypatch.setattr(mapped_adamw, "_BATCH_GRADIENTS", 4)
    torch.manual_seed(5)
    model = TinyGPT().to("cuda")
    opt = trainstream.OffloadAdamW(model.parameters(), lr=1e-2, mode="gpu")
    params = list(model.parameters())
    order = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: order.append(id(p)))
    poisoned = params[len(params) // 2]
    poisoned.register_hook(lambda g: torch.full_like(g, float("nan")))
    before = [p.detach().clone() for p in params]
    x, y = batch(0, device="cuda")
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()  # the launches' flags are back: skipped steps taken back
    after = [p.detach().clone() for p in params]
    steps = {k: int(v["step"]) for k, v in opt.state_dict()["state"].items()}
    with pytest.warns(UserWarning, match="non-finite"):
        train_steps(model, opt, 1, device="cuda", start=1)  # said a step late, as the daemon
    first_bad = order.index(id(poisoned))
    # Inside a batch of 4, not at its start: a batch must not skip the finite ones before it.
    assert 0 < first_bad < len(params) - 1 and first_bad % 4 != 0, first_bad
    position = {id(p): n for n, p in enumerate(params)}
    for n, pid in enumerate(order[:len(params)]):
        i = position[pid]
        changed = not torch.equal(before[i], after[i])
        assert changed == (n < first_bad), (n, first_bad)
        assert steps.get(i, 0) == (1 if n < first_bad else 0), (n, first_bad, steps.get(i))
    opt.detach()


@on_gpu
def test_gpu_mode_checkpoints_and_moves_back_to_the_host_losslessly(daemon_socket, tmp_path):
    """A bf16 model's checkpoint from mode="gpu" carries the kernel's fp32 masters (not the
    bf16 weights); loading it and leaving the GPU mode (detach) keep every bit, so the run
    goes on as the host-only run does."""
    host, gpu, host_opt, gpu_opt = _pair(torch.bfloat16, "float32", "adamw")
    train_steps(host, host_opt, 2, device="cuda")
    train_steps(gpu, gpu_opt, 2, device="cuda")
    path = str(tmp_path / "gpu_mode.ckpt")
    gpu_opt.save(path)
    train_steps(gpu, gpu_opt, 1, device="cuda", start=2)  # moves on; the load goes back
    gpu_opt.load(path)
    train_steps(host, host_opt, 1, device="cuda", start=2)
    train_steps(gpu, gpu_opt, 1, device="cuda", start=2)
    gpu_opt.synchronize()
    host_opt.synchronize()
    assert _same(host, gpu) == []
    gpu_opt.detach()  # the state goes home to the daemon, masters untouched
    assert not gpu_opt.updates_on_gpu or gpu_opt.staged_state_elements == 0
    assert all(torch.equal(_bits(gpu_opt.host.master(i)), _bits(host_opt.host.master(i)))
               for i in range(len(gpu_opt.trained_params)))
    host_opt.detach()


@on_gpu
def test_a_non_finite_step_is_skipped_on_the_gpu_as_in_the_daemon(daemon_socket):
    """nonfinite="guard": a step whose gradients are all NaN changes nothing on the GPU and
    takes no AdamW step, as in the daemon's pass; the next step matches the host run."""
    host, gpu, host_opt, gpu_opt = _pair(torch.float32, "float32", "adamw")
    for model, opt in ((host, host_opt), (gpu, gpu_opt)):
        train_steps(model, opt, 1, device="cuda")
        x, y = batch(1, device="cuda")
        with pytest.warns(UserWarning, match="non-finite"):
            (loss_fn(model, x, y) * float("nan")).backward()
            opt.step()
            opt.zero_grad()
            train_steps(model, opt, 1, device="cuda", start=2)  # says so at the next step
        opt.synchronize()
    assert _same(host, gpu) == []
    assert gpu_opt.state_dict()["state"][0]["step"] == host_opt.state_dict()["state"][0]["step"]
    host_opt.detach()
    gpu_opt.detach()


@on_gpu
def test_clipping_holds_the_updates_for_the_global_norm(daemon_socket):
    """max_grad_norm under mode="gpu": the gradients wait in VRAM for the step's global norm
    (their sum of squares goes to the daemon), then the kernel scales them by the daemon's
    coefficient; the norm and the weights follow the host path's to rounding (the norm's sum
    is formed in another order), and the clip is active (the norm is over the bound)."""
    host, gpu, host_opt, gpu_opt = _pair(torch.float32, "float32", "adamw", max_grad_norm=0.05)
    for model, opt in ((host, host_opt), (gpu, gpu_opt)):
        train_steps(model, opt, 3, device="cuda")
        opt.synchronize()
    assert host_opt.last_grad_norm > 0.05
    assert gpu_opt.last_grad_norm == pytest.approx(host_opt.last_grad_norm, rel=1e-5)
    for p, q in zip(host.parameters(), gpu.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    assert gpu_opt.stats()["staged_state"]["chunks"] == 3 * len(list(gpu.parameters()))
    host_opt.detach()
    gpu_opt.detach()


@on_gpu
def test_ignore_applies_non_finite_gradients_and_counts_them(daemon_socket):
    """nonfinite="ignore": applied, as torch does (the weights turn NaN), and counted."""
    _, gpu, host_opt, gpu_opt = _pair(torch.float32, "float32", "adamw", nonfinite="ignore")
    host_opt.detach()
    x, y = batch(0, device="cuda")
    (loss_fn(gpu, x, y) * float("nan")).backward()
    gpu_opt.step()
    gpu_opt.synchronize()
    assert all(p.isnan().all() for p in gpu.parameters())
    assert gpu_opt.stats()["staged_state"]["nonfinite_values"] == sum(
        p.numel() for p in gpu.parameters())
    gpu_opt.detach()


@on_gpu
def test_wrap_gpu_mode_trains_a_hugging_face_model_and_says_so(daemon_socket):
    """wrap(optimizer_mode="gpu") on a bf16 Qwen2 model: the loss falls, the memory report
    says which mode runs and how many elements the GPU updates."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(3)
    model = transformers.Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, optimizer_mode="gpu", offload=True)
    x = torch.randint(0, 512, (4, 32), device="cuda")
    losses = []
    for _ in range(8):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    report = trainstream.memory_report(model)
    said = opt.stats()["optimizer_mode"]
    assert said["mode"] == "gpu"
    # A bf16 model's state never moves to VRAM (its fp32 masters are the daemon's): all of it
    # is updated by the kernel.
    assert opt.staged_state_elements == sum(p.numel() for p in model.parameters())
    assert any(e["kind"] == "client.optimizer.mode"
               and "updated in place by the GPU" in e["message"] for e in report["events"])
    trainstream.unwrap(model)
