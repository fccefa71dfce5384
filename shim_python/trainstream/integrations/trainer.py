# SPDX-License-Identifier: Apache-2.0
"""Hugging Face's ``Trainer`` through trainstreamd: ``TrainStreamTrainer`` (one class name
changed in a training script) and ``TrainStreamCallback`` (a stock ``Trainer`` handed an
``OffloadAdamW``). The Trainer keeps its loop, data, schedule, logging and checkpoints; the
optimizer state, gradients and activations go where ``wrap()`` puts them, and the causal-LM
loss is computed from the final hidden states in chunks, so the logits never exist whole."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..errors import InvalidArgumentError
from ..optim.offload_adamw import OffloadAdamW
from ..options import check_options
from ..inspection import pcie_bytes
from ..session import session_of
from ..wrap import wrap
from .logprobs import hidden_entering_head, plain_output_head
from .losses import causal_lm_loss

__all__ = ["TrainStreamCallback", "TrainStreamTrainer", "TrainingMetrics"]

GIB = 2 ** 30
# TrainingArguments.optim values that mean plain AdamW: the update the daemon runs.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                "adamw_torch_xla", "adamw_torch_npu_fused")
# wrap() options the Trainer's own arguments decide.
FROM_TRAINING_ARGUMENTS = {"accumulation_steps": "gradient_accumulation_steps",
                           "max_grad_norm": "max_grad_norm", "lr": "learning_rate"}


class TrainingMetrics:
    """The ``ts_*`` figures of a log line. Peaks are sampled at each step's end of backward
    (before the memory plan resets the allocator's peak for the next step) and reported as the
    highest since the previous log; PCIe bytes are those crossed since the previous log."""

    def __init__(self) -> None:
        self._peak = 0
        self._pcie: tuple[int, int] | None = None

    def sample_peak(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._peak = max(self._peak, torch.cuda.max_memory_allocated())

    def read(self, model: torch.nn.Module) -> dict:
        self.sample_peak()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        out = {"ts_vram_alloc_gb": round(torch.cuda.memory_allocated() / GIB, 3) if cuda else 0.0,
               "ts_vram_peak_gb": round(self._peak / GIB, 3)}
        self._peak = 0
        session = session_of(model)
        if session is None:
            return out
        # Two calls to the daemon a log line, not memory_report()'s whole survey (its events,
        # this process's mappings): a Trainer may log at every step.
        optimizer = session.optimizer.stats()
        memory = session.client.memory()
        job = optimizer["job_id"]  # the daemon's name for it (wrap() makes one)
        held = sum(int(p.get("used_bytes", 0)) for p in memory.get("plans", [])
                   if p.get("job_id") == job)
        mine = sum(int(r["bytes"]) for r in memory.get("by_session", [])
                   if r["key"] == session.client.session_id)
        out["ts_pinned_gb"] = round((held + mine) / GIB, 3)
        out["ts_host_state_gb"] = round(int(optimizer.get("state_bytes", 0)) / GIB, 3)
        to_device, to_host = pcie_bytes(session)
        pcie = (to_host, to_device)
        before = self._pcie or (0, 0)
        out["ts_d2h_gb"] = round((pcie[0] - before[0]) / GIB, 3)
        out["ts_h2d_gb"] = round((pcie[1] - before[1]) / GIB, 3)
        self._pcie = pcie
        return out


class TrainStreamCallback(TrainerCallback):
    """For a stock ``Trainer`` given an ``OffloadAdamW`` (or a model and optimizer from
    ``wrap()``): prints the ``ts_*`` figures at each log step."""

    def __init__(self, optimizer: Any = None) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper, if any
        if inner is not None and not isinstance(inner, OffloadAdamW):
            raise InvalidArgumentError(
                f"TrainStreamCallback: the optimizer is a {type(inner).__name__}; it reports "
                "an OffloadAdamW (the optimizer trainstream.wrap() returns)")
        self.optimizer = inner
        self.metrics = TrainingMetrics()
        self.last: dict = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.metrics.sample_peak()

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if model is None or session_of(model) is None:
            return
        self.last = self.metrics.read(model)
        if state.is_world_process_zero:
            print(" ".join(f"{k}={v}" for k, v in self.last.items()), flush=True)


class TrainStreamTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer state, gradients and activations live where
    ``trainstream.wrap()`` puts them. ``trainstream``: any ``wrap()`` option, plus
    ``chunked_loss`` (default ``True``: the causal-LM loss from the final hidden states, a
    chunk of positions at a time) and ``loss_chunk_size`` (positions per chunk, default 1024).

    From ``TrainingArguments``: the learning rate, betas, epsilon and weight decay (with the
    Trainer's decay / no-decay split), the schedule (the daemon takes each step's rate),
    ``gradient_accumulation_steps`` (the daemon sums that many backward passes),
    ``max_grad_norm`` (clipped in the daemon's pass; the logged ``grad_norm`` is its norm),
    checkpoints and ``resume_from_checkpoint`` (the optimizer's state, fp32 master weights
    included). ``optim`` must be AdamW; ``fp16`` is refused (gradients leave the GPU during
    backward, before a loss scaler could unscale them): train in bf16 or fp32."""

    def __init__(self, *args: Any, trainstream: dict | None = None, **kwargs: Any) -> None:
        if trainstream is not None and not isinstance(trainstream, dict):
            raise InvalidArgumentError(
                f"TrainStreamTrainer: trainstream={trainstream!r} must be a dict of wrap() "
                "options")
        options = dict(trainstream or {})
        self.chunked_loss = options.pop("chunked_loss", True)
        self.loss_chunk_size = options.pop("loss_chunk_size", 1024)
        if self.chunked_loss not in (True, False):
            raise InvalidArgumentError(
                f"TrainStreamTrainer: chunked_loss={self.chunked_loss!r} must be True or False")
        if not (isinstance(self.loss_chunk_size, int) and not isinstance(self.loss_chunk_size,
                                                                         bool)
                and self.loss_chunk_size >= 1):
            raise InvalidArgumentError(
                f"TrainStreamTrainer: loss_chunk_size={self.loss_chunk_size!r} must be an "
                "integer >= 1 (positions per chunk)")
        for name, argument in FROM_TRAINING_ARGUMENTS.items():
            if name in options:
                raise InvalidArgumentError(
                    f"TrainStreamTrainer: {name} comes from TrainingArguments.{argument}; "
                    "set it there")
        check_options(options)
        self.trainstream_options = options
        self.trainstream_metrics = TrainingMetrics()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_training_arguments(training_args)
        super().__init__(*args, **kwargs)
        _check_training_arguments(self.args)
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if scheduler is not None and not isinstance(optimizer, OffloadAdamW):
            raise InvalidArgumentError(
                "TrainStreamTrainer: a scheduler given with a torch optimizer would keep "
                "scheduling that optimizer, not the one trainstream makes from it; pass "
                "optimizers=(optimizer, None) and set the schedule in TrainingArguments "
                "(lr_scheduler_type, warmup_steps), or wrap() first and schedule the "
                "OffloadAdamW it returns")
        if optimizer is not None and not isinstance(optimizer, (OffloadAdamW,
                                                                torch.optim.AdamW,
                                                                torch.optim.Adam)):
            raise InvalidArgumentError(
                f"TrainStreamTrainer: optimizers=({type(optimizer).__name__}, ...): the daemon "
                "runs AdamW; pass a torch.optim.AdamW or Adam, an OffloadAdamW, or none")
        # The daemon clips inside its pass: the Trainer's own clipping would find no gradient
        # on a GPU (they have left it) and, on a CPU, scale the daemon's slots a second time.
        self.trainstream_max_grad_norm = self.args.max_grad_norm or None
        if not (hasattr(Trainer, "_clip_grad_norm") and hasattr(Trainer, "_get_grad_norm")):
            self.args = copy.copy(self.args)
            self.args.max_grad_norm = 0.0
        # wrap() places the model and the optimizer's state; accelerate must not move either
        # (a model bigger than the GPU would not fit there whole).
        self.accelerator.device_placement = False

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        """wrap() puts each part of the model where the memory plan says, at train()."""

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if isinstance(_inner(self.optimizer), OffloadAdamW):  # given, or made by a train()
            return self.optimizer
        model = self.model if model is None else model
        optimizer = self.optimizer
        if optimizer is None:
            decay = set(self.get_decay_parameter_names(model))
            trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in trained if n in decay],
                       "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0}]
            optimizer = torch.optim.AdamW(
                [g for g in groups if g["params"]], lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon)
        options = {"device": self.args.device,
                   "accumulation_steps": self.args.gradient_accumulation_steps,
                   "max_grad_norm": self.trainstream_max_grad_norm,
                   **self.trainstream_options}
        wrapped, self.optimizer = wrap(model, optimizer, **options)
        self.model = self.model_wrapped = wrapped
        return self.optimizer

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # clipped by the daemon (max_grad_norm): read back after step()

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        return None

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, *args: Any,
                                 **kwargs: Any) -> Any:
        norm = getattr(_inner(self.optimizer), "last_grad_norm", None)
        return super()._maybe_log_save_evaluate(tr_loss, norm if norm is not None else grad_norm,
                                                *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.trainstream_metrics.sample_peak()  # backward's peak, before step() resets it
        return loss

    def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and session_of(self.model) is not None:
            logs = {**logs, **self.trainstream_metrics.read(self.model)}
        super().log(logs, *args, **kwargs)

    def compute_loss(self, model: torch.nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        head = _chunkable_head(model) if (self.chunked_loss and model.training
                                           and not return_outputs and "labels" in inputs
                                           and self.label_smoother is None
                                           and self.compute_loss_func is None) else None
        if head is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        hidden = hidden_entering_head(model, head, inputs, tuple(labels.shape),
                                      "TrainStreamTrainer", "pass trainstream={'chunked_loss': "
                                      "False} for this model")
        # As the model's own loss: summed over the accumulated batch's tokens and divided by
        # their count when the Trainer counts them (it then leaves the loss unscaled).
        num_items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        return causal_lm_loss(hidden, head.weight, labels.to(hidden.device), head.bias,
                              chunk_size=self.loss_chunk_size, num_items=num_items)


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _chunkable_head(model: torch.nn.Module) -> torch.nn.Module | None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return plain_output_head(inner)


def _check_training_arguments(args: Any) -> None:
    if getattr(args, "fp16", False):
        raise InvalidArgumentError(
            "TrainStreamTrainer: fp16=True needs a loss scaler, and gradients leave the GPU "
            "during backward, before it could unscale them; use bf16=True (no scaler) or fp32")
    optim = str(getattr(getattr(args, "optim", "adamw_torch"), "value",
                        getattr(args, "optim", "adamw_torch")))
    if optim not in ADAMW_OPTIMS:
        raise InvalidArgumentError(
            f"TrainStreamTrainer: optim={optim!r}; the daemon runs AdamW: use one of "
            f"{', '.join(ADAMW_OPTIMS)}")
