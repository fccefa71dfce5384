# SPDX-License-Identifier: Apache-2.0
"""FP8 base weights multiplied on tensor cores (``torch._scaled_mm``), where that measures
faster than dequantizing them to the compute dtype for every use.

A stored fp8 weight has a scale per block of its input dimension; ``_scaled_mm`` takes one scale
per row of each operand. So the weight is requantized once on the device with a scale per output
row (a second rounding of values already in e4m3: the error is measured in the tests), and each
forward quantizes the input with a scale per token. Backward makes the input's gradient from the
same row-scaled weight in the compute dtype, so forward and backward use one weight.

Outlier channels (``outliers=``, TrainStream 0.6's split for NVFP4, applied here to FP8 on
Hopper): a few hidden dimensions of an LLM's activations are far larger than the rest, and with
a scale per token the largest sets the scale every other value of the token is rounded to. With
``outliers=0.01`` each call picks its largest 1% of input channels on the device (no host
sync), quantizes them as zero and multiplies them in the compute dtype against the same weight
columns: ``y = scaled_mm(fp8(x without them), W) + x[:, idx] @ W[:, idx].T``. The input's
gradient is unchanged. It removes the activations' share of the error, not the weight's.

The choice is made per weight shape and token count, by timing both paths (forward and the
input's gradient) on the device the first time the shape runs (CUDA GPUs with FP8 tensor cores:
compute capability 8.9 and up), and kept for the process; each layer records what it chose and
the two times. A layer decides at its first forward, for that forward's token count, and keeps
one copy of the weight: run that first forward at the training batch's size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgumentError

E4M3_MAX = 448.0
# The most a caller may send the slow way: past a tenth of the channels the split costs more
# than it saves.
MAX_OUTLIERS = 0.1


def outlier_fraction(value: Any) -> float:
    """``outliers=`` as a fraction: 0, False or None off; "auto" or True 0.01; a float in
    [0, 0.1] as it is."""
    if value is None or value is False or (isinstance(value, (int, float)) and value == 0
                                           and not isinstance(value, bool)):
        return 0.0
    if value is True or (isinstance(value, str) and value == "auto"):
        return 0.01
    if isinstance(value, float) and 0.0 < value <= MAX_OUTLIERS:
        return value
    raise InvalidArgumentError(
        f"outliers={value!r}: use 0, False, None, 'auto', True (0.01) or a fraction of the "
        f"input channels in (0, {MAX_OUTLIERS}]")


def outlier_count(in_features: int, fraction: float) -> int:
    """Channels a call of this width sends the slow way (0 when off)."""
    return 0 if fraction <= 0 else max(1, math.ceil(fraction * in_features))
_TIMED_RUNS = 5
# (out, in, tokens, device index, outliers) -> {"path": ..., "dequantize_ms": ...,
# "scaled_mm_ms": ...}
_CHOICES: dict = {}


def supported(device: torch.device, forced: bool = False) -> tuple[bool, str]:
    """Whether FP8 tensor-core matmuls can run on ``device``, and why not. ``forced`` (the user
    asked for them) skips the device checks: torch then says what it can't do."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"torch {torch.__version__} has no _scaled_mm"
    if forced:
        return True, ""
    if device.type != "cuda":
        return False, "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} has no FP8 tensor cores (8.9 and up)"
    return True, ""


def shape_fits(out_features: int, in_features: int) -> bool:
    """_scaled_mm's operands need both matrix dimensions of the weight in multiples of 16."""
    return out_features % 16 == 0 and in_features % 16 == 0


# Rows requantized at a time: an fp32 copy of this many rows at most, not of the whole matrix.
_ROWS_AT_A_TIME = 1024


def rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as e4m3 codes with one float32 scale per output row: (codes,
    scales [1, out])."""
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for first in range(0, weight.shape[0], _ROWS_AT_A_TIME):
        w = weight[first:first + _ROWS_AT_A_TIME].float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / E4M3_MAX
        codes[first:first + len(w)] = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(
            torch.float8_e4m3fn)
        scales[first:first + len(w)] = scale
    return codes, scales[None, :]


def _floats(scales: torch.Tensor) -> torch.Tensor:
    """Row scales as float32, whether kept as such or as their bits in int32 (BaseLinear keeps
    them as bits, out of the reach of dtype casts)."""
    return scales.view(torch.float32) if scales.dtype == torch.int32 else scales.float()


def rowwise_weight(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The row-scaled weight in ``dtype`` (backward's). e4m3 converts to bf16 exactly, so in
    bf16 the one rounding is the product's (the scale rounded to bf16 first: 2^-9 relative),
    and no fp32 copy of the matrix is made."""
    return (codes.view(torch.float8_e4m3fn).to(dtype)
            * _floats(scales).reshape(-1, 1).to(dtype))


def input_grad(grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """grad W for the row-scaled weight W = diag(scales) codes, as (grad diag(scales)) codes: the
    scales go on the gradient (tokens x out, small) instead of on the whole matrix, so the
    weight's one pass is its codes' conversion to the gradient's dtype."""
    scaled = grad * _floats(scales).reshape(-1).to(grad.dtype)
    return scaled @ codes.view(torch.float8_e4m3fn).to(grad.dtype)


def quantize_tokens(x: torch.Tensor, drop: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A [tokens, in] input as e4m3 with one float32 scale per token: (codes, scales [tokens,
    1]). ``drop``: channels quantized as zero (the outliers a call multiplies in bf16). The
    work is done in place on one float32 copy: a call at 512 tokens is short enough that each
    extra pass over the input shows in its time."""
    # Row-major, as _scaled_mm wants its first operand, whatever the strides of x.
    xf = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if drop is not None:
        xf.index_fill_(1, drop, 0)
    # The largest magnitude of each token in one reduction (no |x| tensor made first).
    scales = (torch.linalg.vector_norm(xf, ord=math.inf, dim=1, keepdim=True) / E4M3_MAX
              ).clamp_(min=torch.finfo(torch.float32).tiny)
    return xf.div_(scales).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scales


def linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype, outliers: float = 0.0) -> torch.Tensor:
    """y = x W^T (+ bias) on FP8 tensor cores, W the row-scaled weight; with ``outliers`` the
    largest channels of this call multiplied in ``out_dtype`` instead (see module doc)."""
    tokens = x.reshape(-1, x.shape[-1])
    idx = None
    count = outlier_count(tokens.shape[1], outliers)
    if count:
        # Picked on the device from this call's values: no host sync, no index leaves the GPU.
        idx = torch.linalg.vector_norm(tokens, ord=math.inf, dim=0).topk(count).indices
    xq, xs = quantize_tokens(tokens, drop=idx)
    # The weight's codes [out, in] row-major are the column-major [in, out] operand it wants;
    # the input must be row-major. (Codes may be kept as bytes, which no .to(dtype) casts.)
    y = torch._scaled_mm(xq, codes.view(torch.float8_e4m3fn).t(), scale_a=xs,
                         scale_b=_floats(scales), out_dtype=out_dtype)
    if idx is not None:
        columns = (codes.view(torch.float8_e4m3fn).index_select(1, idx).to(out_dtype)
                   * _floats(scales).reshape(-1, 1).to(out_dtype))
        # Added by the matmul itself (beta=1): no product tensor, no second pass over y.
        y.addmm_(tokens.index_select(1, idx).to(out_dtype), columns.t())
    if bias is not None:
        y.add_(bias.to(out_dtype))
    return y.reshape(*x.shape[:-1], codes.shape[0])


def _time_ms(fn) -> float:
    fn()  # warm-up: kernel selection, workspaces
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_TIMED_RUNS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / _TIMED_RUNS


def choose(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, make_weight,
           out_dtype: torch.dtype, outliers: float = 0.0) -> tuple[dict, bool]:
    """Which path is faster for this input's token count and this weight's shape, timed once
    per shape on the device, each as a training step uses it (forward, then the input's
    gradient): ``make_weight()`` and a matmul with it, twice (the dequantizing path), against
    :func:`linear` and the row-scaled weight's matmul. Returns the choice record (see module
    doc) and whether it was timed now."""
    tokens = x.reshape(-1, x.shape[-1])
    key = (codes.shape[0], codes.shape[1], tokens.shape[0], x.device.index, outliers)
    timed_now = key not in _CHOICES
    if timed_now:
        grad = torch.ones(tokens.shape[0], codes.shape[0], dtype=out_dtype, device=x.device)

        def dequantizing():
            torch.nn.functional.linear(tokens, make_weight())
            return grad @ make_weight()

        def tensor_cores():
            linear(tokens, codes, scales, None, out_dtype, outliers)
            return input_grad(grad, codes, scales)

        # Events record on the current device's stream: the layer's device made current.
        with torch.no_grad(), torch.cuda.device(x.device):
            dequantize_ms = _time_ms(dequantizing)
            scaled_mm_ms = _time_ms(tensor_cores)
        _CHOICES[key] = {"path": "scaled_mm" if scaled_mm_ms < dequantize_ms else "dequantize",
                         "dequantize_ms": round(dequantize_ms, 4),
                         "scaled_mm_ms": round(scaled_mm_ms, 4)}
    return dict(_CHOICES[key]), timed_now
