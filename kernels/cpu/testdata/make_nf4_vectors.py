# SPDX-License-Identifier: Apache-2.0
"""Writes nf4_bitsandbytes.txt: inputs and what bitsandbytes' own quantize_4bit(quant_type="nf4")
makes of them (packed codes and fp32 absmax), for quantize_test.cc to compare with bit for bit.

    pip install bitsandbytes torch && python make_nf4_vectors.py

Each case is four lines: "case <blocksize> <n>", the inputs as float32 bit patterns (hex), the
packed bytes (hex), the absmax values as float32 bit patterns (hex)."""

import struct

import bitsandbytes
import bitsandbytes.functional as F
import torch


def hex_floats(t):
    return " ".join(struct.pack(">f", v).hex() for v in t.tolist())


def main():
    torch.manual_seed(2026)
    lines = [f"# bitsandbytes {bitsandbytes.__version__}, torch {torch.__version__}"]
    for blocksize, n, scale in ((64, 256, 0.02), (64, 301, 1.0), (128, 384, 3.0), (32, 96, 0.5)):
        x = torch.randn(n) * scale
        x[5] = 0.0
        q, state = F.quantize_4bit(x, blocksize=blocksize, quant_type="nf4")
        assert not state.nested
        lines += [f"case {blocksize} {n}", hex_floats(x), bytes(q.view(-1).tolist()).hex(),
                  hex_floats(state.absmax)]
    with open("nf4_bitsandbytes.txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
