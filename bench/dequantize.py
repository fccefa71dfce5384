# SPDX-License-Identifier: Apache-2.0
"""GPU dequantization bandwidth per format (kernels/cuda/dequantize.cu) against the GPU's own
memory bandwidth measured in the same run (a device-to-device copy), and against dequantizing
with torch operations (what the shim does without the kernel).

    python bench/dequantize.py [--values 268435456] [--repeats 20] [--json out.json]

Each format dequantizes `--values` values into bf16. Bytes moved = the stored bytes read
(values and scales) + the bf16 bytes written; GB/s is 1e9 bytes per second; times are the
median of CUDA-event timings. Values are random stored bytes with valid scales: the kernel's
work does not depend on them. Needs a GPU; no daemon.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from trainstream.frozen.store import BaseTensor, dequantize, dequantize_cuda

BLOCKS = {"int8": 64, "nf4": 64, "fp8": 32, "nvfp4": 16}


def timed(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def stored(fmt: str, n: int) -> tuple:
    """Random stored bytes of `n` values in `fmt`, with finite scales, on the GPU."""
    block = BLOCKS[fmt]
    blocks = (n + block - 1) // block
    data_bytes = (n + 1) // 2 if fmt in ("nf4", "nvfp4") else n
    data = torch.randint(0, 256, (data_bytes,), dtype=torch.uint8, device="cuda")
    if fmt == "fp8":  # no NaN codes among the values
        data = torch.where((data & 0x7F) == 0x7F, data - 1, data)
    if fmt == "nvfp4":
        scales = torch.randint(0, 0x7F, (blocks,), dtype=torch.uint8, device="cuda")
    else:
        scales = (torch.rand(blocks, device="cuda") * 0.01).view(torch.uint8)
    t = BaseTensor(name=fmt, shape=(n,), source_dtype="BF16", stored=fmt, block=block,
                   tensor_scale=1e-3, buffer=0, data_offset=0, data_bytes=data.numel(),
                   scale_offset=0, scale_bytes=scales.numel())
    return t, data, scales


def device_copy_gbps(n: int, repeats: int) -> float:
    """The GPU's memory bandwidth as a bf16 copy of `n` values sees it (read + write)."""
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * 2 * n / timed(lambda: dst.copy_(src), repeats) / 1e9


def measure(fmt: str, n: int, repeats: int, copy_gbps: float) -> dict:
    t, data, scales = stored(fmt, n)
    moved = data.numel() + scales.numel() + 2 * n
    kernel_s = timed(lambda: dequantize_cuda(t, data, scales, torch.bfloat16), repeats)
    torch_s = timed(lambda: dequantize(t, data, scales).to(torch.bfloat16), max(3, repeats // 4))
    return {"format": fmt, "values": n, "bytes_moved": moved, "kernel_s": kernel_s,
            "kernel_gbps": moved / kernel_s / 1e9, "torch_ops_s": torch_s,
            "fraction_of_copy": moved / kernel_s / 1e9 / copy_gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--values", type=int, default=1 << 28)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    n = args.values
    copy_gbps = device_copy_gbps(n, args.repeats)
    print(f"device copy (read + write): {copy_gbps:.0f} GB/s  [{torch.cuda.get_device_name()}]")
    rows = []
    for fmt in BLOCKS:
        row = measure(fmt, n, args.repeats, copy_gbps)
        rows.append(row)
        print(f"{fmt:6s} kernel {1e3 * row['kernel_s']:7.3f} ms  {row['kernel_gbps']:6.0f} GB/s "
              f"({100 * row['fraction_of_copy']:.0f}% of the copy)   torch ops "
              f"{1e3 * row['torch_ops_s']:8.3f} ms "
              f"({row['torch_ops_s'] / row['kernel_s']:.1f}x slower)")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "dequantize", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "host": platform.node(),
                       "device_copy_gbps": copy_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
