# SPDX-License-Identifier: Apache-2.0
"""What a shared base's tensors are: the formats the daemon stores them in, the value tables of
the 4-bit ones, and where each tensor lies (``BaseTensor``)."""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("bf16", "int8", "nf4", "fp8", "nvfp4")

# The NormalFloat-4 table (kernels/cpu/quantize.cc) and the e2m1 magnitudes, indexed by code.
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
              0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
               -4.0, -6.0)


@dataclass(frozen=True)
class BaseTensor:
    """Where one tensor of a base lies and how it is stored."""

    name: str
    shape: tuple
    source_dtype: str  # as the checkpoint stores it: "BF16", "F32", "I64", ...
    stored: str        # "bf16", "as_is", or a quantized format
    block: int
    tensor_scale: float
    buffer: int
    data_offset: int
    data_bytes: int
    scale_offset: int
    scale_bytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_SOURCE_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                  "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
                  "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
                  "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def source_dtype(t: BaseTensor) -> str:
    """The torch dtype name of the tensor as the checkpoint stores it."""
    return _SOURCE_DTYPES[t.source_dtype]
