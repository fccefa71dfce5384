# SPDX-License-Identifier: Apache-2.0
"""Per-sequence log-probabilities of a Hugging Face causal LM, for preference training (DPO):
``causal_lm_logprobs`` from the final hidden states in chunks (the logits never exist whole),
and ``reference_logprobs``, the same base with its adapters off, computed once up front so that
no second model is needed."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

from ..errors import InvalidArgumentError
from .losses import sequence_logprobs


def plain_output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output head when the logits are exactly ``hidden @ head.weight.T (+ bias)``: a linear
    layer with no adapter of its own, on a model that neither soft-caps nor scales its logits
    (those use their own logits)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if (not isinstance(head, torch.nn.Linear) or hasattr(head, "base_layer")
            or getattr(config, "final_logit_softcapping", None)
            or getattr(config, "logit_scale", None) not in (None, 1, 1.0)):
        return None
    return head


def causal_lm_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                       labels: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, *, chunk_size: int = 1024,
                       average: bool = False, **model_kwargs: Any) -> torch.Tensor:
    """Each sequence's log-probability under ``model``, [batch] fp32, differentiable. ``labels``
    as for the model's loss (the input ids, ``-100`` where a token does not count: the
    prompt); by default ``input_ids``. The model runs its own forward (so wrap()'s hooks see
    it), but its head is handed one position: the final hidden states are taken as they enter
    it and the log-probabilities computed from them in chunks of ``chunk_size`` positions.
    ``average``: the mean per counted token instead of the sum. ``model_kwargs`` go to the
    model."""
    if input_ids.dim() != 2:
        raise InvalidArgumentError(f"input_ids of shape {tuple(input_ids.shape)}: [batch, "
                                   "positions]")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise InvalidArgumentError(f"labels of shape {tuple(labels.shape)} for input_ids of "
                                   f"shape {tuple(input_ids.shape)}")
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = plain_output_head(inner)
    if head is None:  # the model's own logits, whole
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       **model_kwargs).logits.float()
        targets = labels[:, 1:]
        counted = targets != -100
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(
            -1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total = (logp * counted).sum(-1)
        return total / counted.sum(-1).clamp(min=1) if average else total
    hidden = hidden_entering_head(
        model, head, dict(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs),
        tuple(input_ids.shape), "causal_lm_logprobs", "pass logits_to_keep=0 if it takes one")
    return sequence_logprobs(hidden, head.weight, labels.to(hidden.device), head.bias,
                             chunk_size=chunk_size, average=average)


def hidden_entering_head(model: torch.nn.Module, head: torch.nn.Module, inputs: dict,
                         positions: tuple, caller: str, remedy: str) -> torch.Tensor:
    """Runs ``model(**inputs)`` (its own forward, so hooks such as wrap()'s see it) and returns
    the final hidden states as they enter ``head``, which is handed one position only: the
    logits are never made whole. ``positions``: the [batch, positions] the hidden states must
    cover; ``caller`` and ``remedy`` name the error when they do not."""
    captured: list = []

    def take_hidden(module: torch.nn.Module, args: tuple) -> tuple:
        captured.append(args[0])
        return (args[0][:, -1:],)  # the head computes one position's logits, not all

    handle = head.register_forward_pre_hook(take_hidden)
    try:
        model(**inputs)
    finally:
        handle.remove()
    if len(captured) != 1 or tuple(captured[0].shape[:2]) != positions:
        raise InvalidArgumentError(
            f"{caller}: the model's head did not see every position's hidden state once (a "
            f"model that slices them first); {remedy}")
    return captured[0]


def reference_logprobs(model: torch.nn.Module, batches: Iterable[dict], *,
                       chunk_size: int = 1024, average: bool = False) -> torch.Tensor:
    """DPO's reference log-probabilities without a second model: ``model`` in eval mode, with
    no gradients and, for a PEFT model, its adapters off, so the frozen base is the reference.
    ``batches``: dicts with ``input_ids`` and optionally ``labels`` and ``attention_mask``.
    Returns every sequence's value, in order, as one fp32 CPU tensor."""
    was_training = model.training
    disabled = model.disable_adapter() if hasattr(model, "disable_adapter") else (
        contextlib.nullcontext())
    out = []
    try:
        model.eval()
        with torch.no_grad(), disabled:
            for batch in batches:
                if "input_ids" not in batch:
                    raise InvalidArgumentError("reference_logprobs: each batch is a dict with "
                                               "input_ids (and labels, attention_mask)")
                out.append(causal_lm_logprobs(
                    model, batch["input_ids"], batch.get("labels"), batch.get("attention_mask"),
                    chunk_size=chunk_size, average=average).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)
