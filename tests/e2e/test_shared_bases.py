# SPDX-License-Identifier: Apache-2.0
"""Shared frozen bases through a real daemon: a checkpoint written with the safetensors package
is read once by the daemon (bf16 or quantized), mapped read-only by every process of the user
that asks, and shown by tsctl; broken checkpoints fail with the file and tensor named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import trainstream
from trainstream import _trainstream
from trainstream.frozen.store import dequantize

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def client(daemon):
    c = trainstream.connect(daemon.socket, job_id="bases")
    yield c
    c.close()


def checkpoint(path, seed=0, layers=2, dim=64) -> dict:
    """A small decoder-shaped checkpoint: embeddings, 2-D block weights, norms, an int tensor."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(100, dim, generator=g).to(torch.bfloat16)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = 0.02 * torch.randn(2 * dim, dim,
                                                                              generator=g)
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = (
            0.02 * torch.randn(dim, dim, generator=g)).to(torch.bfloat16)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(dim)
    tensors["position_ids"] = torch.arange(16, dtype=torch.int64)
    safetensors_torch.save_file(tensors, str(path))
    return tensors


def test_a_bf16_base_holds_the_checkpoint_in_bf16_and_integers_as_they_are(client, tmp_path):
    tensors = checkpoint(tmp_path / "model.safetensors")
    with trainstream.load_base(str(tmp_path), client=client, progress=False) as base:
        assert base.format == "bf16" and set(base.tensors) == set(tensors)
        for name, value in tensors.items():
            held = base.tensor(name)
            assert held.shape == value.shape, name
            expected = value if value.dtype == torch.int64 else value.to(torch.bfloat16)
            assert held.dtype == expected.dtype and torch.equal(held, expected), name
        # Half the fp32 bytes, the bf16 ones as they were, plus alignment.
        assert base.stored_bytes < sum(v.numel() * v.element_size() for v in tensors.values())
        kinds = [e["kind"] for e in client.events()]
        assert "base.loading" in kinds and "base.ready" in kinds


@pytest.mark.parametrize("fmt,mean_error", [("int8", 0.01), ("nf4", 0.12), ("fp8", 0.03),
                                             ("nvfp4", 0.12)])
def test_quantized_bases_dequantize_as_the_reference_defines(client, tmp_path, fmt, mean_error):
    tensors = checkpoint(tmp_path / "model.safetensors", seed=1)
    base = trainstream.load_base(str(tmp_path / "model.safetensors"), format=fmt, client=client,
                                 progress=False)
    quantized = [n for n, t in base.tensors.items() if t.stored == fmt]
    # The default: 2-D floats of the blocks, not the embeddings, the norms or the ids.
    assert sorted(quantized) == sorted(n for n in tensors if ".layers." in n and "norm" not in n)
    for name in quantized:
        t = base.tensors[name]
        data, scales = base.raw(name)
        ours = dequantize(t, data, scales)
        reference = torch.frombuffer(bytearray(_trainstream.dequantize_reference(
            fmt, t.block, t.numel, data.numpy().tobytes(), scales.numpy().tobytes(),
            t.tensor_scale)), dtype=torch.float32)
        assert torch.equal(ours, reference), name  # every element, as the daemon's reference
        original = tensors[name].float().reshape(-1)
        error = (ours - original).abs().sum() / original.abs().sum()
        assert error < mean_error, (name, float(error))
        assert base.dequantize(name).shape == tensors[name].shape
    with pytest.raises(trainstream.FailedPreconditionError, match="use dequantize"):
        base.tensor(quantized[0])
    base.close()


SHARER = textwrap.dedent("""
    import hashlib, json, sys
    import trainstream
    path, fmt = sys.argv[1], sys.argv[2]
    base = trainstream.load_base(path, format=fmt, progress=False)
    digest = hashlib.sha256()
    for name in sorted(base.tensors):
        data, scales = base.raw(name)
        digest.update(data.numpy().tobytes()); digest.update(scales.numpy().tobytes())
    print("mapped", flush=True)
    sys.stdin.readline()  # every process has mapped the base
    from trainstream.frozen.store import mapped_segments
    seg = mapped_segments()
    print(json.dumps({"id": base.id, "digest": digest.hexdigest(), "users": base.info()["users"],
                      "rss": seg["resident_bytes"], "pss": seg["proportional_bytes"]}), flush=True)
    sys.stdin.read()  # stays attached until the test lets it go
""")


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_of_a_user_share_one_copy_of_a_base(start_daemon, tmp_path, processes,
                                                      tsctl_binary):
    d = start_daemon("--memory_budget=512M", "--base_keep_warm_s=0")
    # Big enough that a second copy would show: 2 x 8M fp32 values, held as 32 MB of bf16.
    safetensors_torch.save_file({f"model.layers.{i}.w": torch.randn(4096, 2048) for i in range(2)},
                                str(tmp_path / "model.safetensors"))
    env = dict(os.environ, TRAINSTREAM_SOCKET=d.socket)
    procs = [subprocess.Popen([sys.executable, "-c", SHARER, str(tmp_path), "bf16"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "mapped"
        for p in procs:
            p.stdin.write("measure\n")
            p.stdin.flush()
        results = [json.loads(p.stdout.readline()) for p in procs]
        assert len({r["id"] for r in results}) == 1  # one base
        assert len({r["digest"] for r in results}) == 1  # the same bytes in every process
        with trainstream.connect(d.socket, job_id="observer") as observer:
            memory = observer.memory()
            listed = trainstream.bases(observer)
        held = {r["key"]: int(r["bytes"]) for r in memory["by_tag"]}
        assert len(listed) == 1 and int(listed[0]["users"]) == processes
        stored = int(listed[0]["stored_bytes"])
        assert stored >= 32 << 20
        assert held["base"] == stored  # the daemon holds one copy, not one per process
        # Each process has the whole base resident, and their proportional shares of those
        # pages add up to one copy: the pages are the same pages.
        for r in results:
            assert r["rss"] >= stored
        assert 0.95 * stored <= sum(r["pss"] for r in results) <= 1.05 * stored
        out = subprocess.run([tsctl_binary, "--socket", d.socket, "bases"], capture_output=True,
                             text=True, check=True, env=env).stdout
        row = next(line for line in out.splitlines() if tmp_path.name[:20] in line)
        assert "bf16" in row and f" {processes} " in row and "ready" in row, out
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    # The last user gone and no keep-warm time: the base and its memory go.
    with trainstream.connect(d.socket, job_id="observer") as observer:
        for _ in range(100):
            if not trainstream.bases(observer):
                break
            import time
            time.sleep(0.05)
        assert trainstream.bases(observer) == []
        assert "base" not in {r["key"] for r in observer.memory()["by_tag"]}


def test_a_hugging_face_cache_snapshot_of_links_to_blobs_loads(client, daemon, pb, stub,
                                                               tmp_path):
    """The hub's cache keeps each file of a snapshot as a link to a blob named by its hash: the
    index is told from a shard by the name of the link, and the shards are found beside it,
    whether the client hands the files over or the daemon opens the path itself."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    first = checkpoint(blobs / "1f0e", seed=1, layers=1)
    second = {"lm_head.weight": torch.randn(100, 64)}
    safetensors_torch.save_file(second, str(blobs / "2a9b"))
    index = {"weight_map": {**{k: "model-00001-of-00002.safetensors" for k in first},
                            **{k: "model-00002-of-00002.safetensors" for k in second}}}
    (blobs / "3c7d").write_text(json.dumps(index))
    for link, blob in (("model-00001-of-00002.safetensors", "1f0e"),
                       ("model-00002-of-00002.safetensors", "2a9b"),
                       ("model.safetensors.index.json", "3c7d")):
        (snapshot / link).symlink_to(os.path.join("..", "..", "blobs", blob))
    def plan_by_path():
        return stub.LoadBase(pb.LoadBaseRequest(session_id=client.session_id,
                                                path=str(snapshot), plan_only=True))
    planned = plan_by_path()
    assert planned.state == "planned" and planned.stored_bytes > 0
    with trainstream.load_base(str(snapshot), client=client, progress=False) as base:
        assert set(base.tensors) == set(first) | set(second)
        assert torch.equal(base.tensor("lm_head.weight"), second["lm_head.weight"].bfloat16())
        # The same files by path are the same base: content is known by inode, not by name.
        held = plan_by_path()
        assert held.state == "ready" and held.base_id == base.id
        assert held.stored_bytes == planned.stored_bytes


def test_broken_checkpoints_and_bad_requests_fail_with_the_reason(client, tmp_path):
    good = tmp_path / "model.safetensors"
    checkpoint(good)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-100])
    with pytest.raises(trainstream.TrainStreamError, match="truncated.safetensors.*truncated"):
        trainstream.load_base(str(truncated), client=client, progress=False)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(trainstream.InvalidArgumentError, match="garbage.safetensors.*not valid"):
        trainstream.load_base(str(garbage), client=client, progress=False)
    with pytest.raises(trainstream.NotFoundError):
        trainstream.load_base(str(tmp_path / "absent.safetensors"), client=client, progress=False)
    with pytest.raises(trainstream.InvalidArgumentError, match="control characters"):
        trainstream.load_base(str(good), name="evil\x1b[2J", client=client, progress=False)
    with pytest.raises(trainstream.InvalidArgumentError, match="format='fp4'"):
        trainstream.load_base(str(good), format="fp4", client=client, progress=False)
    with pytest.raises(trainstream.InvalidArgumentError, match="not in"):
        trainstream.load_base(str(good), format="nf4", quantize=["model.layers.7.w"],
                              client=client, progress=False)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "../x.safetensors"}}))
    with pytest.raises(trainstream.TrainStreamError, match="is not a file name"):
        trainstream.load_base(str(tmp_path), client=client, progress=False)
    # A weight that can't be quantized fails the load in the daemon, naming the tensor.
    bad = checkpoint(tmp_path / "nan.safetensors")
    bad["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    safetensors_torch.save_file(bad, str(tmp_path / "nan.safetensors"))
    with pytest.raises(trainstream.FailedPreconditionError,
                       match="model.layers.1.mlp.up_proj.weight.*value 197 is inf"):
        trainstream.load_base(str(tmp_path / "nan.safetensors"), format="int8", client=client,
                              progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", [("int8", 0), ("nf4", 0), ("fp8", 0), ("nvfp4", 0),
                                       ("int8", 6), ("nf4", 6), ("fp8", 6)])
def test_the_cuda_dequantizer_matches_the_reference_on_every_element(client, tmp_path, fmt,
                                                                     block):
    """Default blocks take the kernel's one-scale-per-unit path, a block of 6 its per-value
    one; the data is read aligned (vector loads) and one byte off (byte loads)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the kernel runs there")
    from trainstream.frozen.store import dequantize_cuda

    g = torch.Generator().manual_seed(5)
    # Odd sizes: partial blocks, partial 8-value units, a half byte at the end of 4-bit ones.
    shapes = [(1, 1), (3, 7), (33, 65), (512, 1001), (4096, 1024)]
    tensors = {f"model.layers.{i}.w": torch.randn(*s, generator=g) * 10 ** (i - 2)
               for i, s in enumerate(shapes)}
    tensors["model.layers.9.w"] = torch.zeros(64, 64)  # all-zero blocks
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    base = trainstream.load_base(str(tmp_path), format=fmt, block=block, client=client,
                                 progress=False, quantize=list(tensors))
    for name in tensors:
        t = base.tensors[name]
        data, scales = base.raw(name)
        reference = torch.frombuffer(bytearray(_trainstream.dequantize_reference(
            fmt, t.block, t.numel, data.numpy().tobytes(), scales.numpy().tobytes(),
            t.tensor_scale)), dtype=torch.float32)
        on_gpu = dequantize_cuda(t, data.cuda(), scales.cuda(), torch.float32).cpu()
        assert torch.equal(on_gpu, reference), name
        as_bf16 = dequantize_cuda(t, data.cuda(), scales.cuda(), torch.bfloat16).cpu()
        assert torch.equal(as_bf16, reference.to(torch.bfloat16)), name
        off_by_one = torch.empty(data.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
        off_by_one.copy_(data)
        assert torch.equal(dequantize_cuda(t, off_by_one, scales.cuda(), torch.float32).cpu(),
                           reference), name
        assert torch.equal(base.dequantize(name, device="cuda").cpu().reshape(-1),
                           reference.to(torch.bfloat16)), name
    base.close()
