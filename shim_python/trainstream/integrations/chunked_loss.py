# SPDX-License-Identifier: Apache-2.0
"""The causal-LM loss of Hugging Face models, computed from the logits in chunks of positions.

Hugging Face's ``ForCausalLMLoss`` upcasts the whole logits tensor to fp32 and takes its
log-softmax: at backward's peak the fp32 log-softmax, its gradient and the gradient of the
upcast are alive together, about 12 bytes for every (position, vocabulary entry); for 2,048
positions over a 152k vocabulary that is 3.7 GB, more than a 14B model's LoRA step needs for
anything else. Here only the logits themselves (in their own dtype) are kept for backward,
each chunk of positions is upcast, reduced and dropped in turn, and backward writes the
gradient chunk by chunk in the logits' dtype: 2 bytes each way for bf16 logits, plus one
chunk's fp32 working memory. The loss is the same sum, in fp32, divided the same way
(``num_items_in_batch`` when the Trainer passes it, else the positions that count); the
gradient is the same softmax-minus-one-hot, computed in fp32 and cast as autograd casts it.
On a CUDA device the chunks are one kernel each way (kernels/cuda/cross_entropy.cu): forward
reads the logits once and keeps a log-sum-exp a position, backward reads them once more and
writes the gradient; no fp32 copy of any chunk is made.

:class:`LossSwitch` puts this loss in place of ``ForCausalLMLoss`` on the models of a wrapped
module that use it (and only those: a model with a loss of its own keeps it), and puts theirs
back on ``unwrap()``. ``model(...).logits`` stays what the model returns.
"""

from __future__ import annotations

from typing import Any

import torch

# A chunk's fp32 logits: small beside a budget of gigabytes, large enough that a chunk's
# kernels are not launch-bound.
CHUNK_BYTES = 64 << 20


def chunk_rows(vocab: int) -> int:
    """Positions a chunk holds for a vocabulary of ``vocab``."""
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def bytes_per_logit(dtype: torch.dtype) -> int:
    """The loss's memory for each logit at its peak, beyond a chunk's: the logits kept for
    backward and their gradient, both in the logits' dtype."""
    return 2 * torch.empty((), dtype=dtype).element_size()


# transformers' own loss at its peak, for each logit: the fp32 upcast freed, its log-softmax
# kept, and the gradients of both.
STOCK_BYTES_PER_LOGIT = 12


def _kernels() -> Any:
    """The native module when it was built with the CUDA kernels, else None."""
    try:
        from ..transport import kernels
    except ImportError:  # the module file loaded on its own (bench/chunked_loss.py --no-kernels)
        return None
    return kernels.cross_entropy()


# The logits' dtypes the kernels read.
_KERNEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether logits of ``dtype`` on ``device`` go through the CUDA kernels (else the chunks
    are computed with torch operations)."""
    return device.type == "cuda" and dtype in _KERNEL_DTYPES and _kernels() is not None


def working_bytes(positions: int, vocab: int, dtype: torch.dtype, chunked: bool = True,
                  device: torch.device | None = None) -> int:
    """The loss's VRAM at its peak for ``positions`` over ``vocab`` logits of ``dtype`` on
    ``device``: with this module's loss, those of :func:`bytes_per_logit`, plus (where the
    kernels do not apply) a chunk's fp32 copy and its probabilities in backward; with
    transformers' own (``chunked=False``), STOCK_BYTES_PER_LOGIT each."""
    if not chunked:
        return STOCK_BYTES_PER_LOGIT * positions * vocab
    kept = positions * vocab * bytes_per_logit(dtype)
    if device is not None and kernels_apply(device, dtype):
        return kept + 8 * positions  # a log-sum-exp and a loss a position
    chunk = 4 * vocab * min(positions, chunk_rows(vocab))
    copies = 1 if dtype == torch.float32 else 2  # fp32 logits are their own fp32 copy
    return kept + copies * chunk


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _forward_kernel(logits: torch.Tensor, targets: torch.Tensor,
                    ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the counted positions' losses, each position's log-sum-exp), fp32."""
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    with torch.cuda.device(logits.device):
        _kernels().cross_entropy_forward(_KERNEL_DTYPES[logits.dtype], rows, vocab,
                                         logits.data_ptr(), targets.data_ptr(), ignore_index,
                                         lse.data_ptr(), loss.data_ptr(), _stream(logits))
    return loss.sum(), lse


def _backward_kernel(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                     lse: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    scale = scale.to(torch.float32).contiguous()
    with torch.cuda.device(logits.device):
        _kernels().cross_entropy_backward(_KERNEL_DTYPES[logits.dtype], rows, vocab,
                                          logits.data_ptr(), targets.data_ptr(), ignore_index,
                                          lse.data_ptr(), scale.data_ptr(), grad.data_ptr(),
                                          _stream(logits))
    return grad


class _ChunkedCrossEntropy(torch.autograd.Function):
    """sum over counted positions of (logsumexp(logits) - logits[target]) / divisor."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                divisor: torch.Tensor) -> torch.Tensor:
        ctx.ignore_index = ignore_index
        if kernels_apply(logits.device, logits.dtype):
            logits, targets = logits.contiguous(), targets.to(torch.int64).contiguous()
            total, lse = _forward_kernel(logits, targets, ignore_index)
            ctx.save_for_backward(logits, targets, lse, divisor)
            return total / divisor
        rows = chunk_rows(logits.shape[1])
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], rows):
                chunk = logits[start:start + rows].float()
                target = targets[start:start + rows]
                counted = target != ignore_index
                chunk_lse = torch.logsumexp(chunk, dim=1)
                lse[start:start + rows] = chunk_lse
                picked = chunk.gather(1, torch.where(counted, target, 0).unsqueeze(1))
                total += torch.where(counted, chunk_lse - picked.squeeze(1), 0.0).sum()
        ctx.save_for_backward(logits, targets, lse, divisor)
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        logits, targets, lse, divisor = ctx.saved_tensors
        scale = (grad_out.float() / divisor).reshape(1)
        if kernels_apply(logits.device, logits.dtype):
            return _backward_kernel(logits, targets, ctx.ignore_index, lse, scale), None, None, None
        grad = torch.empty_like(logits)
        rows = chunk_rows(logits.shape[1])
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], rows):
                chunk = logits[start:start + rows].float()
                target = targets[start:start + rows]
                counted = target != ctx.ignore_index
                # A new tensor first: .float() of fp32 logits is the saved tensor itself.
                probs = torch.sub(chunk, lse[start:start + rows].unsqueeze(1)).exp_()
                probs.scatter_add_(1, torch.where(counted, target, 0).unsqueeze(1),
                                   -counted.to(probs.dtype).unsqueeze(1))
                probs.mul_((counted.to(probs.dtype) * scale).unsqueeze(1))
                grad[start:start + rows] = probs
        return grad, None, None, None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: Any = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """``ForCausalLMLoss``'s arguments and result (position t predicts label t + 1; labels of
    ``ignore_index`` do not count; the mean over counted positions, or the sum over
    ``num_items_in_batch``), without the whole fp32 logits."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    flat = logits.reshape(-1, vocab_size)
    targets = shift_labels.reshape(-1).to(flat.device)
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().to(torch.float32)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=flat.device).to(torch.float32)
    return _ChunkedCrossEntropy.apply(flat, targets, ignore_index, divisor)


def _stock_causal_lm_loss() -> Any:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # no transformers, or one from before its loss functions
        return None
    return ForCausalLMLoss


class LossSwitch:
    """Puts :func:`causal_lm_loss` on every model in ``module`` whose ``loss_function`` is
    transformers' ``ForCausalLMLoss``; :meth:`restore` gives each back what it had."""

    def __init__(self, module: torch.nn.Module):
        self.switched: list = []  # (model, its own _loss_function or None)
        stock = _stock_causal_lm_loss()
        if stock is None:
            return
        for m in module.modules():
            # transformers models only (the property with a setter): a wrapper that forwards
            # attributes (a PEFT model) would only shadow its model's loss.
            declared = getattr(type(m), "loss_function", None)
            if not (isinstance(declared, property) and declared.fset is not None
                    and m.loss_function is stock):
                continue
            own = m.__dict__.get("_loss_function")
            m.loss_function = causal_lm_loss
            self.switched.append((m, own))

    def restore(self) -> None:
        for m, own in self.switched:
            if own is None:
                m.__dict__.pop("_loss_function", None)
            else:
                m.loss_function = own
        self.switched = []


def loss_working_bytes(model: torch.nn.Module, head_weight: torch.Tensor, tokens: int) -> int:
    """The loss's working memory for the logits a forward of ``tokens`` makes (autocast's dtype
    when it is on): computed in chunks when wrap() put this module's loss on the model, else
    transformers' own."""
    chunked = any(m.__dict__.get("_loss_function") is causal_lm_loss for m in model.modules())
    kind = head_weight.device.type
    dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
             else head_weight.dtype)
    return working_bytes(tokens, head_weight.shape[0], dtype, chunked, head_weight.device)
