# SPDX-License-Identifier: Apache-2.0
"""TrainStreamTrainer against the stock transformers Trainer on tiny Qwen2 (tied head) and
Llama models: the same schedule, accumulation, clipping and decay split step for step;
checkpoints that resume bit-identically; the options it refuses; its log figures; wrap_hf and
TrainStreamCallback. On the CPU here; the GPU variant runs the same comparison on CUDA."""

from __future__ import annotations

import copy
import gc
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                   "(scripts/bootstrap.sh installs it)")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (scripts/bootstrap.sh "
                                         "installs it)")

import trainstream  # noqa: E402
from trainstream.integrations import chunked_loss  # noqa: E402
from trainstream.integrations.huggingface import (TrainStreamCallback,  # noqa: E402
                                                  TrainStreamTrainer, decoder_layers, wrap_hf)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import hf_models  # noqa: E402

TS_KEYS = {"ts_vram_alloc_gb", "ts_vram_peak_gb", "ts_pinned_gb", "ts_host_state_gb",
           "ts_d2h_gb", "ts_h2d_gb"}


class Rows(torch.utils.data.Dataset):
    """Token rows of the preset's vocabulary, the same for every engine."""

    def __init__(self, preset: str, rows: int = 16, seq: int = 24):
        self.ids = torch.cat([hf_models.batch(preset, 1, seq, i) for i in range(rows)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, device: str, **overrides):
    settings = dict(output_dir=out, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, learning_rate=3e-3, weight_decay=0.1,
                    lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5, max_steps=6,
                    logging_steps=1, save_strategy="no", report_to="none", optim="adamw_torch",
                    seed=7, use_cpu=device == "cpu", dataloader_num_workers=0,
                    disable_tqdm=True)
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _trained(model) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()
            if p.requires_grad}


def _stock(preset: str, tune: str, tmp_path, device: str, same_loss: bool):
    model, _ = hf_models.build(preset, tune)
    # The loss wrap() puts on the model when the Trainer's chunked loss is off (agreement with
    # transformers' own: test_chunked_loss.py); Adam turns last-bit loss differences into
    # visible weight differences, so the tight comparison uses the same loss on both sides.
    switch = chunked_loss.LossSwitch(model) if same_loss else None
    trainer = transformers.Trainer(model=model, args=_args(str(tmp_path / "stock"), device),
                                   train_dataset=Rows(preset))
    trainer.train()
    if switch is not None:
        switch.restore()
    return _losses(trainer), _trained(model)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama"])
def test_equals_the_stock_trainer_step_for_step(preset, tmp_path):
    """Schedule with warmup, 2-way accumulation, clipping and the decay split, through the
    daemon, against the stock Trainer with torch's AdamW on the same loss."""
    expected, want = _stock(preset, "full", tmp_path, "cpu", same_loss=True)
    model, _ = hf_models.build(preset, "full")
    trainer = TrainStreamTrainer(model=model, args=_args(str(tmp_path / "ours"), "cpu"),
                                 train_dataset=Rows(preset),
                                 trainstream={"chunked_loss": False})
    trainer.train()
    got = _losses(trainer)
    assert len(got) == len(expected) == 6
    assert max(abs(a - b) for a, b in zip(expected, got)) < 2e-5, (expected, got)
    have = _trained(trainer.model)
    assert max((want[n] - have[n]).abs().max().item() for n in want) < 2e-5
    assert isinstance(trainer.optimizer.optimizer, trainstream.OffloadAdamW)
    # The rate the schedule gave the last step reached the daemon: lr 3e-3, warmup 2, 6 steps.
    groups = trainer.optimizer.optimizer.stats()["spec"]["groups"]
    assert groups and all(abs(g["lr"] - 3e-3 * 1 / 4) < 1e-9 for g in groups), groups
    assert {g["weight_decay"] for g in groups} == {0.1, 0.0}
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 6 and all(n > 0 for n in norms)
    trainstream.unwrap(trainer.model)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU on this machine")])])
def test_speculated_clipping_trains_the_same_bits_as_clipping_after_the_last_gradient(
        device, tmp_path):
    """50 Trainer steps, max_grad_norm between the norms the steps have (some clip, some do
    not): the daemon's updates speculated (the default, and eager=True on every step) against
    updates that wait for each step's last gradient (eager=False). Rolled-back steps must leave
    the weights exactly as waiting would have."""
    runs = {}
    for eager in (False, None, True):
        model, _ = hf_models.build("tiny-qwen2", "full")
        options = {"eager": eager}
        if device == "cuda":
            options["offload"] = True  # the daemon's pass, not torch's fused AdamW in VRAM
        trainer = TrainStreamTrainer(
            model=model, args=_args(str(tmp_path / f"eager-{eager}"), device, max_steps=50,
                                    max_grad_norm=2.0, logging_steps=50),
            train_dataset=Rows("tiny-qwen2"), trainstream=options)
        trainer.train()
        stats = trainer.optimizer.optimizer.stats()
        runs[eager] = (_trained(trainer.model), int(stats.get("speculated_steps", 0)),
                       int(stats.get("rolled_back_steps", 0)))
        trainstream.unwrap(trainer.model)
    want = runs[False][0]
    assert runs[False][1:] == (0, 0)
    for eager in (None, True):
        have, speculated, rolled_back = runs[eager]
        assert all(torch.equal(want[n], have[n]) for n in want), (
            eager, max((want[n] - have[n]).abs().max().item() for n in want))
        # Both kinds of step happened: some kept what they speculated, some rolled it back.
        assert 0 < rolled_back < speculated, (eager, speculated, rolled_back)


@pytest.mark.parametrize("tune", ["full", "lora"])
def test_the_chunked_loss_trains_like_the_model_own(tune, tmp_path):
    """The default: the loss from the final hidden states in chunks of 7 positions (the head
    computes one position), against the stock Trainer with transformers' loss."""
    if tune == "lora":
        pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh "
                                           "installs it)")
    expected, want = _stock("tiny-qwen2", tune, tmp_path, "cpu", same_loss=False)
    model, _ = hf_models.build("tiny-qwen2", tune)
    trainer = TrainStreamTrainer(model=model, args=_args(str(tmp_path / "ours"), "cpu"),
                                 train_dataset=Rows("tiny-qwen2"),
                                 trainstream={"loss_chunk_size": 7})
    heads = []
    head = (model.get_base_model() if tune == "lora" else model).get_output_embeddings()
    handle = head.register_forward_hook(lambda m, a, out: heads.append(tuple(out.shape)))
    trainer.train()
    handle.remove()
    got = _losses(trainer)
    assert max(abs(a - b) for a, b in zip(expected, got)) < 2e-4, (expected, got)
    assert heads and all(shape[1] == 1 for shape in heads), heads  # never the whole logits
    have = _trained(trainer.model)
    assert max((want[n] - have[n]).abs().max().item() for n in want) < 1e-3
    trainstream.unwrap(trainer.model)


def test_a_checkpoint_resumes_bit_identically(tmp_path):
    def trainer_for(out):
        model, _ = hf_models.build("tiny-llama", "full")
        return TrainStreamTrainer(model=model, args=_args(out, "cpu", save_strategy="steps",
                                                          save_steps=3),
                                  train_dataset=Rows("tiny-llama"))

    whole = trainer_for(str(tmp_path / "whole"))
    whole.train()
    want, expected = _trained(whole.model), _losses(whole)
    assert os.path.isfile(tmp_path / "whole" / "checkpoint-3" / "optimizer.pt")
    trainstream.unwrap(whole.model)
    del whole
    gc.collect()
    resumed = trainer_for(str(tmp_path / "whole"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"))
    have = _trained(resumed.model)
    assert _losses(resumed)[-3:] == expected[3:], (_losses(resumed), expected)
    assert all(torch.equal(want[n], have[n]) for n in want), \
        max((want[n] - have[n]).abs().max().item() for n in want)
    trainstream.unwrap(resumed.model)


def test_logs_carry_the_trainstream_figures(tmp_path):
    model, _ = hf_models.build("tiny-qwen2", "full")
    trainer = TrainStreamTrainer(model=model, args=_args(str(tmp_path), "cpu", max_steps=2),
                                 train_dataset=Rows("tiny-qwen2"))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(TS_KEYS <= set(h) for h in logged), logged
    # Full fine-tune: the daemon holds fp32 masters and two moments (12 bytes a parameter).
    parameters = sum(p.numel() for p in model.parameters())
    assert logged[-1]["ts_host_state_gb"] >= round(12 * parameters / 2**30, 3) > 0
    assert logged[-1]["ts_pinned_gb"] >= logged[-1]["ts_host_state_gb"]
    trainstream.unwrap(trainer.model)


@pytest.mark.parametrize("arguments, trainstream_options, message", [
    (dict(fp16=True), None, "bf16=True"),
    (dict(optim="sgd"), None, "the daemon runs AdamW"),
    ({}, {"accumulation_steps": 2}, "gradient_accumulation_steps"),
    ({}, {"max_grad_norm": 1.0}, "TrainingArguments.max_grad_norm"),
    ({}, {"no_such_option": 1}, "unknown option 'no_such_option'"),
    ({}, {"loss_chunk_size": 0}, "loss_chunk_size=0"),
    ({}, {"chunked_loss": "yes"}, "chunked_loss='yes'"),
    ({}, ["not", "a", "dict"], "must be a dict"),
])
def test_refused_options_say_why(arguments, trainstream_options, message, tmp_path):
    model, _ = hf_models.build("tiny-qwen2", "full")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if arguments.get("fp16"):
        # TrainingArguments refuses fp16 on a CPU itself; the Trainer's own check is reached
        # through an arguments object that says fp16 after construction.
        args = _args(str(tmp_path), "cpu")
        args.fp16 = True
    else:
        args = _args(str(tmp_path), "cpu", **arguments)
    with pytest.raises(trainstream.TrainStreamError, match=message) as raised:
        TrainStreamTrainer(model=model, args=args, train_dataset=Rows("tiny-qwen2"),
                           trainstream=trainstream_options)
    assert isinstance(raised.value, ValueError)
    assert trainstream.session.session_of(model) is None  # refused before wrap()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_a_scheduler_for_a_torch_optimizer_is_refused(tmp_path):
    model, _ = hf_models.build("tiny-qwen2", "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(trainstream.InvalidArgumentError, match="optimizers=\\(optimizer, None\\)"):
        TrainStreamTrainer(model=model, args=_args(str(tmp_path), "cpu"),
                           train_dataset=Rows("tiny-qwen2"), optimizers=(opt, schedule))


def test_wrap_hf_takes_the_decoder_layers():
    peft = pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh "
                                              "installs it)")
    model, _ = hf_models.build("tiny-llama", "lora")
    assert isinstance(model, peft.PeftModel)
    layers = decoder_layers(model)
    assert layers == list(model.get_base_model().model.layers)
    model, opt = wrap_hf(model, torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-3))
    x = hf_models.batch("tiny-llama", 2, 16, 0)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert trainstream.memory_report(model)["optimizer"]["step"] == 1
    trainstream.unwrap(model)
    with pytest.raises(trainstream.InvalidArgumentError, match="no stack of decoder layers"):
        wrap_hf(torch.nn.Linear(4, 4))


def test_the_callback_reports_a_stock_trainer_given_wrap(tmp_path, capsys):
    model, _ = hf_models.build("tiny-qwen2", "full")
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  device="cpu")
    callback = TrainStreamCallback(opt)
    trainer = transformers.Trainer(model=model, args=_args(str(tmp_path), "cpu", max_steps=2,
                                                           gradient_accumulation_steps=1,
                                                           max_grad_norm=0.0),
                                   train_dataset=Rows("tiny-qwen2"), optimizers=(opt, None),
                                   callbacks=[callback])
    trainer.train()
    assert TS_KEYS <= set(callback.last), callback.last
    assert "ts_host_state_gb=" in capsys.readouterr().out
    trainstream.unwrap(model)
    with pytest.raises(trainstream.InvalidArgumentError, match="an OffloadAdamW"):
        TrainStreamCallback(torch.optim.SGD(copy.deepcopy(model).parameters(), lr=1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_equals_the_stock_trainer_on_a_gpu(tmp_path):
    expected, want = _stock("tiny-qwen2", "full", tmp_path, "cuda", same_loss=False)
    model, _ = hf_models.build("tiny-qwen2", "full")
    trainer = TrainStreamTrainer(model=model, args=_args(str(tmp_path / "ours"), "cuda"),
                                 train_dataset=Rows("tiny-qwen2"))
    trainer.train()
    got = _losses(trainer)
    assert max(abs(a - b) for a, b in zip(expected, got)) < 5e-4, (expected, got)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["ts_vram_peak_gb"] > 0 and h["ts_d2h_gb"] >= 0 for h in logged), logged
    trainstream.unwrap(trainer.model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_optimizer_mode_gpu_through_the_trainer(tmp_path):
    """trainstream={"optimizer_mode": "gpu"}: the Trainer's steps update on the GPU, with the
    schedule, accumulation and clipping (max_grad_norm=0.5: the updates wait for the global
    norm), as the stock Trainer does. offload=True: the tiny model would otherwise keep its
    state in VRAM (torch's fused AdamW), and the mapped path would not run."""
    expected, _ = _stock("tiny-qwen2", "full", tmp_path, "cuda", same_loss=False)
    model, _ = hf_models.build("tiny-qwen2", "full")
    trainer = TrainStreamTrainer(model=model, args=_args(str(tmp_path / "ours"), "cuda"),
                                 train_dataset=Rows("tiny-qwen2"),
                                 trainstream={"optimizer_mode": "gpu", "offload": True})
    trainer.train()
    got = _losses(trainer)
    assert len(got) == len(expected) == 6
    assert max(abs(a - b) for a, b in zip(expected, got)) < 5e-4, (expected, got)
    stats = trainer.optimizer.optimizer.stats()
    assert stats["optimizer_mode"]["mode"] == "gpu" and stats["staged_state"]["elements"] > 0
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 6 and all(n > 0 for n in norms)
    trainstream.unwrap(trainer.model)
