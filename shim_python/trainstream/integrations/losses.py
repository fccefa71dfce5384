# SPDX-License-Identifier: Apache-2.0
"""Losses from the final hidden states, a chunk of positions at a time, so that the logits
(positions x vocabulary, in fp32 the largest tensor of a long-context step) never exist whole:
``chunked_cross_entropy``, ``causal_lm_loss`` (labels shifted as Hugging Face shifts them),
``sequence_logprobs`` (per-sequence log-probabilities, for preference losses) and ``dpo_loss``.

Each chunk's logits are made in forward to read their log-sum-exp and made again in backward
for their gradient, which goes straight into the hidden states', the head's and the bias's
gradients; only the per-position log-sum-exp is kept between the two. (The model-facing loss
``wrap()`` installs, ``chunked_loss.causal_lm_loss``, takes transformers' logits instead.)
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _TokenNll(torch.autograd.Function):
    """Per position: logsumexp(h W^T + b) - (h W^T + b)[target], fp32 (fp64 for fp64 inputs);
    0 where ignored."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Any,
                targets: torch.Tensor, ignore_index: int, chunk_size: int) -> torch.Tensor:
        dtype = _compute_dtype(hidden, weight)
        wide = torch.promote_types(dtype, torch.float32)  # the logits' dtype
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        counted = targets != ignore_index
        safe = torch.where(counted, targets, 0)
        nll = torch.zeros(hidden.shape[0], dtype=wide, device=hidden.device)
        lse = torch.empty_like(nll)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                end = start + chunk_size
                logits = torch.nn.functional.linear(hidden[start:end].to(dtype), w, b).to(wide)
                lse[start:end] = torch.logsumexp(logits, dim=1)
                picked = logits.gather(1, safe[start:end].unsqueeze(1)).squeeze(1)
                nll[start:end] = torch.where(counted[start:end], lse[start:end] - picked, 0.0)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0),
                              safe, counted, lse)
        ctx.has_bias, ctx.chunk_size, ctx.dtype = bias is not None, chunk_size, dtype
        return nll

    @staticmethod
    def backward(ctx: Any, grad_nll: torch.Tensor) -> tuple:
        hidden, weight, bias, safe, counted, lse = ctx.saved_tensors
        dtype = ctx.dtype
        wide = lse.dtype
        w = weight.to(dtype)
        b = bias.to(dtype) if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=wide, device=weight.device) \
            if need_b and ctx.has_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                end = start + ctx.chunk_size
                h = hidden[start:end].to(dtype)
                logits = torch.nn.functional.linear(h, w, b).to(wide)
                # d nll / d logits = softmax - onehot(target), scaled by the incoming gradient.
                grad = logits.sub_(lse[start:end].unsqueeze(1)).exp_()
                weights = grad_nll[start:end].to(wide) * counted[start:end]
                grad.scatter_add_(1, safe[start:end].unsqueeze(1),
                                  -torch.ones_like(weights).unsqueeze(1))
                grad.mul_(weights.unsqueeze(1))
                if grad_h is not None:
                    grad_h[start:end] = (grad.to(dtype) @ w).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += grad.t() @ h.to(wide)
                if grad_b is not None:
                    grad_b += grad.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None)


def _checked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             chunk_size: int) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise InvalidArgumentError(
            f"hidden states of width {hidden.shape[-1]} against a head of shape "
            f"{tuple(weight.shape)}: the head is [vocabulary, hidden width]")
    if targets.shape != hidden.shape[:-1]:
        raise InvalidArgumentError(f"targets of shape {tuple(targets.shape)} for hidden states "
                                   f"of shape {tuple(hidden.shape)}: one target a position")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgumentError(f"chunk_size={chunk_size!r}: positions a chunk, >= 1")


def token_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
              bias: torch.Tensor | None = None, chunk_size: int = 1024,
              ignore_index: int = -100) -> torch.Tensor:
    """Each position's negative log-likelihood of its target (fp32, or fp64 for fp64 inputs;
    the shape of ``targets``; 0 where the target is ``ignore_index``), differentiable in
    ``hidden``, ``weight`` and ``bias``."""
    _checked(hidden, weight, targets, chunk_size)
    flat = hidden.reshape(-1, hidden.shape[-1])
    nll = _TokenNll.apply(flat, weight, bias, targets.reshape(-1).to(flat.device), ignore_index,
                          chunk_size)
    return nll.reshape(targets.shape)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: torch.Tensor | None = None, *, chunk_size: int = 1024,
                          ignore_index: int = -100, reduction: str = "mean",
                          num_items: Any = None) -> torch.Tensor:
    """The cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` without the
    logits: ``hidden`` [..., D] (after the last norm), ``weight`` [V, D], ``targets`` the class
    of each position (``ignore_index``: does not count). ``reduction``: "mean" over counted
    positions, or "sum"; ``num_items`` divides the sum instead (as transformers does under
    gradient accumulation)."""
    if reduction not in ("mean", "sum"):
        raise InvalidArgumentError(f"reduction={reduction!r}: 'mean' or 'sum'")
    total = token_nll(hidden, weight, targets, bias, chunk_size, ignore_index).sum()
    if num_items is not None:
        return total / torch.as_tensor(num_items, device=total.device).float()
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1).to(total.device).float()


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Position t's target is label t + 1 (the last position has none)."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   bias: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The next-token loss as transformers computes it from ``labels`` (the input ids, with
    ``ignore_index`` where a token does not count): position t predicts label t + 1. ``kwargs``
    as for :func:`chunked_cross_entropy`."""
    ignore_index = kwargs.get("ignore_index", -100)
    return chunked_cross_entropy(hidden, weight, _shifted(labels, ignore_index), bias, **kwargs)


def sequence_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                      bias: torch.Tensor | None = None, *, chunk_size: int = 1024,
                      ignore_index: int = -100, shift: bool = True,
                      average: bool = False) -> torch.Tensor:
    """Each sequence's log-probability of its labels, [B] fp32 (fp64 for fp64 inputs),
    differentiable, without the logits: ``hidden`` [B, T, D], ``labels`` [B, T]. ``shift``:
    labels are the input ids
    (position t predicts label t + 1), as transformers takes them; else position t predicts
    label t. ``average``: the mean per counted token instead of the sum."""
    if hidden.dim() != 3:
        raise InvalidArgumentError(f"hidden states of shape {tuple(hidden.shape)}: [batch, "
                                   "positions, width]")
    targets = _shifted(labels, ignore_index) if shift else labels
    logprob = -token_nll(hidden, weight, targets, bias, chunk_size, ignore_index).sum(-1)
    if average:
        logprob = logprob / (targets != ignore_index).sum(-1).clamp(min=1).to(logprob.device)
    return logprob


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             reference_chosen: torch.Tensor, reference_rejected: torch.Tensor, *,
             beta: float = 0.1, label_smoothing: float = 0.0) -> tuple:
    """Direct Preference Optimization from per-sequence log-probabilities ([B] each): the mean
    of -log sigmoid(beta * margin) (with ``label_smoothing`` > 0, that share of the pairs taken
    as mislabelled: the conservative variant), where the margin is how much more the policy
    prefers the chosen answer than the reference does. Returns (loss, chosen rewards, rejected
    rewards), the rewards ``beta * (policy - reference)``, detached."""
    if beta <= 0:
        raise InvalidArgumentError(f"beta={beta!r}: > 0")
    if not 0.0 <= label_smoothing < 0.5:
        raise InvalidArgumentError(f"label_smoothing={label_smoothing!r}: in [0, 0.5)")
    margin = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    logsig = torch.nn.functional.logsigmoid
    losses = (-(1 - label_smoothing) * logsig(beta * margin)
              - label_smoothing * logsig(-beta * margin))
    return (losses.mean(), (beta * (policy_chosen - reference_chosen)).detach(),
            (beta * (policy_rejected - reference_rejected)).detach())
