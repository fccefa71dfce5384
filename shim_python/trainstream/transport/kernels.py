# SPDX-License-Identifier: Apache-2.0
"""The native module's compute kernels, for the layers above: the daemon's quantizer run in
this process (one chunk a call, so a layer spreads over a thread pool), the GPU dequantizer,
the causal-LM cross-entropy kernels and AdamW over mapped state (optimizer_mode="gpu"). Each
takes raw pointers: its caller owns the tensors and their devices."""

from __future__ import annotations

from typing import Any

from .. import _trainstream

# (format, values, block) -> (data bytes, scale bytes, the block the format uses).
quant_layout = _trainstream.quant_layout
# The NVFP4 tensor-wide scale for a tensor whose largest magnitude is the argument.
nvfp4_tensor_scale = _trainstream.nvfp4_tensor_scale
# Quantizes one block-aligned chunk of an fp32 tensor into its data and scale buffers; releases
# the GIL, so chunks run in parallel on a thread pool.
quantize_chunk = _trainstream.quantize_chunk
# kernels/cuda/dequantize.cu over stored bytes on a CUDA device, queued on the stream given.
dequantize_cuda = _trainstream.dequantize_cuda
# AdamW on raw pointers: the host path's scalar reference (first argument False) or the GPU
# kernel over state in mapped host memory or VRAM (True), which agree bit for bit.
adamw = _trainstream.adamw
# The host path's stochastic-rounding seed of parameter index's step t.
adamw_rounding_seed = _trainstream.adamw_rounding_seed


def cross_entropy() -> Any:
    """The module holding ``cross_entropy_forward`` and ``cross_entropy_backward`` when it was
    built with the CUDA kernels, else None."""
    return _trainstream if getattr(_trainstream, "has_cuda_kernels", False) else None
