# SPDX-License-Identifier: Apache-2.0
"""Host<->device copy bandwidth through daemon segments against torch's own pinned tensors, in
the same run: host to device, device to host, and both at once (two streams).

    python bench/h2d_bandwidth.py [--gib 1] [--repeats 20] [--json out.json]

Daemon copies go through the client library's CopyToDevice/CopyToHost (cudaMemcpyAsync on
registered memfd segments, split at 1 GiB registration chunks). Torch copies use
`torch.empty(..., pin_memory=True)` and `Tensor.copy_(non_blocking=True)`. Times come from CUDA
events; GB/s is 1e9 bytes per second. Needs a GPU; starts its own trainstreamd.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

import trainstream
from bench_daemon import private_daemon


def timed(fn, repeats: int, streams) -> float:
    """Median seconds of `fn()` over `repeats`, measured with events on every stream used."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(streams[0])
        for s in streams[1:]:
            s.wait_event(start)
        fn()
        for s in streams[1:]:
            ev = torch.cuda.Event()
            ev.record(s)
            streams[0].wait_event(ev)
        end.record(streams[0])
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    nbytes = int(args.gib * (1 << 30))
    with private_daemon(str(4 * nbytes + (1 << 30))) as socket:
        client = trainstream.connect(socket, job_id="bw")
        t0 = time.perf_counter()
        up = client.allocate("up", nbytes)
        down = client.allocate("down", nbytes)
        map_register_s = time.perf_counter() - t0
        assert up.cuda_registered and down.cuda_registered
        up.tensor().fill_(7)
        pinned_up = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(7)
        pinned_down = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def daemon_h2d():
            up.copy_to_device(dev_a, stream=s1)

        def daemon_d2h():
            down.copy_from_device(dev_b, stream=s1)

        def daemon_both():
            up.copy_to_device(dev_a, stream=s1)
            down.copy_from_device(dev_b, stream=s2)

        def torch_h2d():
            with torch.cuda.stream(s1):
                dev_a.copy_(pinned_up, non_blocking=True)

        def torch_d2h():
            with torch.cuda.stream(s1):
                pinned_down.copy_(dev_b, non_blocking=True)

        def torch_both():
            with torch.cuda.stream(s1):
                dev_a.copy_(pinned_up, non_blocking=True)
            with torch.cuda.stream(s2):
                pinned_down.copy_(dev_b, non_blocking=True)

        rows = {}
        for name, fn, streams, moved in [
            ("h2d", (daemon_h2d, torch_h2d), [s1], nbytes),
            ("d2h", (daemon_d2h, torch_d2h), [s1], nbytes),
            ("both", (daemon_both, torch_both), [s1, s2], 2 * nbytes),
        ]:
            # Interleave the two so drift in clocks or load hits both alike.
            d = timed(fn[0], args.repeats, streams)
            t = timed(fn[1], args.repeats, streams)
            d2 = timed(fn[0], args.repeats, streams)
            t2 = timed(fn[1], args.repeats, streams)
            dg, tg = moved / min(d, d2) / 1e9, moved / min(t, t2) / 1e9
            rows[name] = {"daemon_gbps": round(dg, 2), "torch_pinned_gbps": round(tg, 2),
                          "ratio": round(dg / tg, 4)}
        assert torch.equal(dev_a[:4096].cpu(), torch.full((4096,), 7, dtype=torch.uint8))
        client.close()

    result = {
        "bench": "h2d_bandwidth", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes": nbytes,
        "repeats": args.repeats, "map_and_register_2_buffers_s": round(map_register_s, 3),
        "rows": rows,
    }
    print(f"{'copy':6} {'daemon GB/s':>12} {'torch pinned GB/s':>18} {'ratio':>7}")
    for name, r in rows.items():
        print(f"{name:6} {r['daemon_gbps']:12.2f} {r['torch_pinned_gbps']:18.2f} {r['ratio']:7.3f}")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
