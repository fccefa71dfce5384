# SPDX-License-Identifier: Apache-2.0
"""Shared bases: how fast the daemon reads and quantizes a checkpoint, against the disk and
memory bandwidth measured in the same run, and the host memory 1, 2 and 4 processes use for
one base, against what copies of their own would take.

    python bench/shared_base.py [--preset qwen2.5-14b] [--formats bf16 nf4] [--processes 1 2 4]
                                [--dir /var/tmp/ts-bench-base] [--json out.json]

The checkpoint is written once (random bf16 weights in the preset's shapes, Hugging Face names,
5 GB shards with an index) and reused. Before each load its pages are dropped from the page
cache (posix_fadvise), so the daemon reads from the disk; "disk" is a plain sequential read of
the same files, cold; "page cache" the same read warm. Host memory per process is its
/proc/<pid>/smaps for the daemon's segments it maps, read once every process has mapped
the base: resident bytes, and Pss, its proportional share (a page mapped by n processes counts
1/n in each), so the processes' shares add up to the pages they hold between them; the
daemon's holding is its accounting of the base's buffers. Starts its own
trainstreamd. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time

import torch

import trainstream
from bench_daemon import private_daemon

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from qwen_shape import CONFIGS  # noqa: E402

SHARD_BYTES = 5 << 30


def tensor_shapes(cfg) -> list:
    head = cfg.dim // cfg.heads
    shapes = [("model.embed_tokens.weight", (cfg.vocab, cfg.dim))]
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (cfg.heads * head, cfg.dim)),
                   (p + "self_attn.q_proj.bias", (cfg.heads * head,)),
                   (p + "self_attn.k_proj.weight", (cfg.kv_heads * head, cfg.dim)),
                   (p + "self_attn.k_proj.bias", (cfg.kv_heads * head,)),
                   (p + "self_attn.v_proj.weight", (cfg.kv_heads * head, cfg.dim)),
                   (p + "self_attn.v_proj.bias", (cfg.kv_heads * head,)),
                   (p + "self_attn.o_proj.weight", (cfg.dim, cfg.heads * head)),
                   (p + "mlp.gate_proj.weight", (cfg.mlp, cfg.dim)),
                   (p + "mlp.up_proj.weight", (cfg.mlp, cfg.dim)),
                   (p + "mlp.down_proj.weight", (cfg.dim, cfg.mlp)),
                   (p + "input_layernorm.weight", (cfg.dim,)),
                   (p + "post_attention_layernorm.weight", (cfg.dim,))]
    return shapes + [("model.norm.weight", (cfg.dim,)), ("lm_head.weight", (cfg.vocab, cfg.dim))]


def checkpoint_bytes(folder: str, cfg) -> int:
    """The checkpoint of ``cfg``'s shapes in ``folder`` (written unless a complete one is
    there): its files' bytes together."""
    return sum(os.path.getsize(p) for p in write_checkpoint(folder, tensor_shapes(cfg)))


def write_checkpoint(folder: str, shapes: list) -> list:
    """Writes a checkpoint of random bf16 tensors with these (name, shape) pairs unless a
    complete one is there; returns its shard paths."""
    from safetensors.torch import save_file

    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    os.makedirs(folder, exist_ok=True)
    groups, current, size = [], [], 0
    for name, shape in shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    groups.append(current)
    weight_map = {}
    g = torch.Generator().manual_seed(0)
    for k, group in enumerate(groups):
        shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
                   for name, shape in group}
        save_file(tensors, os.path.join(folder, shard))
        weight_map.update({name: shard for name in tensors})
        print(f"  wrote {shard} ({sum(t.numel() * 2 for t in tensors.values()) / 1e9:.2f} GB)",
              flush=True)
    with open(index_path + ".tmp", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.replace(index_path + ".tmp", index_path)
    return [os.path.join(folder, f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors")
            for k in range(len(groups))]


def drop_cache(paths: list) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_gbps(paths: list) -> float:
    total, start = 0, time.perf_counter()
    buf = bytearray(64 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total / (time.perf_counter() - start) / 1e9


SHARER = textwrap.dedent("""
    import json, sys
    import trainstream
    base = trainstream.load_base(sys.argv[1], format=sys.argv[2], progress=False)
    for name in base.tensors:  # touch every page, as training would
        data, scales = base.raw(name)
        int(data[::4096].sum()) if data.numel() else 0
    print("mapped", flush=True)
    sys.stdin.readline()  # every process has mapped the base: measure now
    from trainstream.frozen.store import mapped_segments
    seg = mapped_segments()
    print(json.dumps({"segment_rss": seg["resident_bytes"],
                      "segment_pss": seg["proportional_bytes"]}), flush=True)
    sys.stdin.read()
""")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen2.5-14b", choices=list(CONFIGS))
    parser.add_argument("--formats", nargs="+", default=["bf16", "int8", "nf4", "fp8", "nvfp4"])
    parser.add_argument("--processes", nargs="*", type=int, default=[1, 2, 4])
    parser.add_argument("--share-format", default="bf16")
    parser.add_argument("--dir", default="/var/tmp/ts-bench-base")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cfg = CONFIGS[args.preset]
    folder = os.path.join(args.dir, args.preset)
    print(f"checkpoint: {args.preset} in {folder}", flush=True)
    shards = write_checkpoint(folder, tensor_shapes(cfg))
    file_bytes = sum(os.path.getsize(p) for p in shards)
    drop_cache(shards)
    disk = read_gbps(shards)
    cache = read_gbps(shards)
    memory = trainstream.profile_hardware()["host_copy_gbps"]
    print(f"{file_bytes / 1e9:.1f} GB in {len(shards)} shards; sequential read: disk "
          f"{disk:.2f} GB/s, page cache {cache:.2f} GB/s; memory copy {memory:.1f} GB/s")
    rows = []

    def record(row: dict) -> None:
        # Written after every row: a run cut short keeps what it measured.
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "shared_base", "preset": args.preset,
                           "host": platform.node(), "cpus": os.cpu_count(), "rows": rows}, f,
                          indent=1)

    budget = f"{max(256 << 20, int(file_bytes * 1.2)) >> 20}M"
    with private_daemon(budget, "--base_keep_warm_s=0") as socket:
        env = dict(os.environ, TRAINSTREAM_SOCKET=socket)
        for fmt in args.formats:
            drop_cache(shards)
            with trainstream.connect(socket, job_id=f"load-{fmt}") as client:
                start = time.perf_counter()
                base = trainstream.load_base(folder, format=fmt, client=client, progress=False)
                seconds = time.perf_counter() - start
                row = {"case": "load", "format": fmt, "seconds": seconds,
                       "file_bytes": file_bytes, "stored_bytes": base.stored_bytes,
                       "read_gbps": file_bytes / seconds / 1e9, "disk_gbps": disk,
                       "page_cache_gbps": cache, "memory_copy_gbps": memory}
                base.close()
            record(row)
            print(f"load {fmt:6s} {seconds:6.1f} s  {row['read_gbps']:5.2f} GB/s of file "
                  f"({row['read_gbps'] / disk:.2f}x the cold read)  held "
                  f"{base.stored_bytes / 1e9:6.2f} GB", flush=True)
        for n in args.processes:
            procs = [subprocess.Popen([sys.executable, "-c", SHARER, folder, args.share_format],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True) for _ in range(n)]
            try:
                for p in procs:
                    assert p.stdout.readline().strip() == "mapped"
                for p in procs:
                    p.stdin.write("measure\n")
                    p.stdin.flush()
                seen = [json.loads(p.stdout.readline()) for p in procs]
                with trainstream.connect(socket, job_id="observer") as observer:
                    held = {r["key"]: int(r["bytes"]) for r in observer.memory()["by_tag"]}
                    listed = trainstream.bases(observer)
            finally:
                for p in procs:
                    p.stdin.close()
                    p.wait(timeout=120)
            stored = int(listed[0]["stored_bytes"])
            row = {"case": "share", "format": args.share_format, "processes": n,
                   "bases": len(listed), "daemon_base_bytes": held.get("base", 0),
                   "stored_bytes": stored,
                   "mapped_resident_bytes": [s["segment_rss"] for s in seen],
                   "proportional_bytes": [s["segment_pss"] for s in seen],
                   "own_copies_bytes": n * stored}
            record(row)
            total = sum(row["proportional_bytes"])
            print(f"{n} processes: {len(listed)} base; the daemon holds "
                  f"{held.get('base', 0) / 1e9:.2f} GB; each process maps "
                  f"{min(row['mapped_resident_bytes']) / 1e9:.2f} GB resident; their shares add up "
                  f"to {total / 1e9:.2f} GB = {total / stored:.3f}x one copy (copies of their own: "
                  f"{n * stored / 1e9:.2f} GB)", flush=True)


if __name__ == "__main__":
    main()
