# SPDX-License-Identifier: Apache-2.0
"""GPU pools: a shared base placed once in a GPU's VRAM by the daemon and read in place by every
process of the user on that GPU. The requests' checks run everywhere (this daemon has no GPU
in CI, and says so); the pools themselves on the GPU machine: one copy for two processes,
training bit-identical to private copies, and a killed client that leaves the pool to the
others until the last one goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import trainstream

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

GOOD_UUID = "GPU-00000000-1111-2222-3333-444444444444"


def checkpoint(path, layers=2, dim=64, seed=0) -> None:
    g = torch.Generator().manual_seed(seed)
    safetensors_torch.save_file(
        {f"layers.{i}.weight": (0.02 * torch.randn(dim, dim, generator=g)).to(torch.bfloat16)
         for i in range(layers)}, str(path / "model.safetensors"))


@pytest.fixture
def client(daemon):
    c = trainstream.connect(daemon.socket, job_id="pools")
    yield c
    c.close()


def test_requests_for_a_pool_are_checked_and_a_missing_gpu_is_named(client, daemon, tmp_path):
    checkpoint(tmp_path)
    base = trainstream.load_base(str(tmp_path), format="nf4", client=client, progress=False)
    native = client._native
    with pytest.raises(trainstream.InvalidArgumentError, match="not a GPU UUID"):
        native.place_base_on_gpu(base.id, "0")
    with pytest.raises(trainstream.InvalidArgumentError, match="not a GPU UUID"):
        native.place_base_on_gpu(base.id, "GPU-ABCDEF00-1111-2222-3333-444444444444")
    # A base this session is not attached to, or none at all.
    with pytest.raises(trainstream.NotFoundError, match="load_base first"):
        native.place_base_on_gpu(base.id + 100, GOOD_UUID)
    with trainstream.connect(daemon.socket, job_id="other") as other:
        with pytest.raises(trainstream.NotFoundError, match="load_base first"):
            other._native.place_base_on_gpu(base.id, GOOD_UUID)
    # No such GPU here (none at all in CI): refused, naming both ways a pool could have been
    # made and why each failed.
    with pytest.raises(trainstream.FailedPreconditionError) as refused:
        native.place_base_on_gpu(base.id, GOOD_UUID)
    assert "virtual-memory API" in str(refused.value) and "legacy IPC" in str(refused.value)
    kinds = [e["kind"] for e in client.events()]
    assert "pool.refused" in kinds
    assert trainstream.gpu_pools(client)["pools"] == []


def test_the_data_socket_hands_a_pool_only_to_its_importers(client):
    # The data plane checks on its own: a pool this session never imported is not handed out.
    with pytest.raises(trainstream.NotFoundError, match="has not imported GPU pool 7"):
        client._native.import_gpu_pool(7, 0)
    with pytest.raises(trainstream.NotFoundError, match="has not imported GPU pool 7"):
        client._native.release_gpu_pool(7)


def test_attach_base_refuses_a_pool_off_the_gpu(client, tmp_path):
    checkpoint(tmp_path)
    base = trainstream.load_base(str(tmp_path), format="nf4", client=client, progress=False)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(2)])
    model.requires_grad_(False)
    with pytest.raises(trainstream.InvalidArgumentError, match="needs a CUDA device"):
        trainstream.attach_base(model, base, device="cpu", gpu_pool=True,
                                rename=lambda n: "layers." + n)
    with pytest.raises(trainstream.InvalidArgumentError, match="gpu_pool="):
        trainstream.attach_base(model, base, device="cpu", gpu_pool="yes")


def test_tsctl_pools_says_what_there_is(daemon, tsctl_binary):
    out = subprocess.run([tsctl_binary, "--socket", daemon.socket, "pools"], capture_output=True,
                         text=True, check=True).stdout
    with trainstream.connect(daemon.socket, job_id="observer") as observer:
        note = trainstream.gpu_pools(observer)["note"]
    assert out.strip() == ("no GPU pools" + (f": {note}" if note else ""))
    listed = json.loads(subprocess.run([tsctl_binary, "--socket", daemon.socket, "--json",
                                        "pools"], capture_output=True, text=True,
                                       check=True).stdout)
    assert listed.get("pools", []) == []


# ---- On the GPU machine ---------------------------------------------------------------------

# A process training LoRA over the base, told when to attach and when to train (stdin), saying
# what it measured (stdout, one JSON object a line).
WORKER = r'''
import json, sys, torch, trainstream
from torch import nn

path, mode, layers, dim = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def say(**what):
    print(json.dumps(what), flush=True)


def used():
    free, total = torch.cuda.mem_get_info()
    return total - free


class LoRALinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False, device="meta",
                              dtype=torch.bfloat16).requires_grad_(False)
        g = torch.Generator(device="cuda").manual_seed(1)
        self.a = nn.Parameter(0.01 * torch.randn(8, dim, device="cuda", generator=g,
                                                 dtype=torch.bfloat16))
        self.b = nn.Parameter(torch.zeros(dim, 8, device="cuda", dtype=torch.bfloat16))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


model = nn.Module()
model.layers = nn.ModuleList(LoRALinear() for _ in range(layers))
torch.cuda.synchronize()
base = trainstream.load_base(path, format="nf4", progress=False)
say(ready=True)
sys.stdin.readline()
before = used()
taken = trainstream.attach_base(model, base, device="cuda", gpu_pool=mode == "pool",
                                rename=lambda n: n.replace(".base", ""))
torch.cuda.synchronize()
pool = getattr(model, "_trainstream_gpu_base", None)
say(attached=used() - before, linear=len(taken["linear"]),
    pool=pool.report() if pool is not None else None)


def forward(x):
    for layer in model.layers:
        x = x + 0.5 * layer(x)
    return x.float().pow(2).mean()


params = [p for p in model.parameters() if p.requires_grad]
model, opt = trainstream.wrap(model, torch.optim.AdamW(params, lr=1e-2), device="cuda")
command = sys.stdin.readline().strip()
g = torch.Generator(device="cuda").manual_seed(0)
losses, step = [], 0
while command == "forever" or step < int(command):
    x = torch.randn(64, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    loss = forward(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    step += 1
    if step == 2 and command == "forever":
        say(training=True)
torch.save({n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad},
           sys.argv[5])
report = trainstream.memory_report(model)
say(losses=losses, gpu_pool=report.get("gpu_pool"))
sys.stdin.readline()
'''


def _skip_without_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (runs on the GPU machine: pytest -m gpu)")


class Worker:
    def __init__(self, socket, path, mode, out, layers, dim):
        env = dict(os.environ, TRAINSTREAM_SOCKET=socket)
        self.out = out
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(path), mode, str(layers),
                                      str(dim), str(out)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def hear(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"worker {self.proc.pid} ended (exit {self.proc.poll()})"
        return json.loads(line)

    def finish(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tell("exit")
            except BrokenPipeError:
                pass
        self.proc.wait(timeout=60)


def _pools(socket) -> list:
    with trainstream.connect(socket, job_id="observer") as observer:
        return trainstream.gpu_pools(observer)["pools"]


def _wait_for(predicate, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.gpu
@pytest.mark.parametrize("export", ["auto", "legacy_ipc"])
def test_two_processes_train_over_one_vram_copy_as_over_their_own(start_daemon, tmp_path,
                                                                  export):
    _skip_without_gpu()
    layers, dim = 16, 4096  # 268M values: 134 MB as nf4, beside which the rest is noise
    checkpoint(tmp_path, layers=layers, dim=dim)
    d = start_daemon("--memory_budget=4G", "--base_keep_warm_s=0", f"--gpu_pool_export={export}")
    runs = {}
    for mode in ("pool", "private"):
        workers = [Worker(d.socket, tmp_path, mode, tmp_path / f"{mode}{i}.pt", layers, dim)
                   for i in range(2)]
        try:
            for w in workers:
                assert w.hear() == {"ready": True}
            attached = []
            for w in workers:  # one after the other: each measures the GPU while the other waits
                w.tell("attach")
                attached.append(w.hear())
                assert attached[-1]["linear"] == layers
            if mode == "pool":
                pools = _pools(d.socket)
                assert len(pools) == 1 and len(pools[0]["importers"]) == 2
                pool_bytes = int(pools[0]["bytes"])
                # A session of the user that never placed the base is not handed the pool.
                with trainstream.connect(d.socket, job_id="observer") as observer:
                    with pytest.raises(trainstream.NotFoundError, match="has not imported"):
                        observer._native.import_gpu_pool(int(pools[0]["pool_id"]), 0)
            for w in workers:
                w.tell("5")
            results = [w.hear() for w in workers]
            runs[mode] = {"attached": attached, "results": results,
                          "params": [torch.load(w.out) for w in workers]}
        finally:
            for w in workers:
                w.finish()
    pooled, private = runs["pool"], runs["private"]
    # One copy in VRAM: the second process's attach added (nearly) nothing on the GPU, where a
    # private copy adds the whole base again.
    assert pool_bytes >= layers * dim * dim // 2
    assert pooled["attached"][1]["attached"] < 0.05 * pool_bytes, pooled["attached"]
    assert private["attached"][1]["attached"] > 0.9 * pool_bytes, private["attached"]
    for i in range(2):
        info = pooled["attached"][i]["pool"]
        if export == "legacy_ipc":
            assert info["kind"] == "legacy_ipc" and not info["read_only"] and info["note"]
        else:
            assert info["kind"] in ("vmm", "legacy_ipc")  # legacy where VMM can't export
        assert pooled["results"][i]["gpu_pool"]["importers"] == 2
    # The same training, bit for bit, whether the base is read from the pool or a private copy.
    for i in range(2):
        assert pooled["results"][i]["losses"] == private["results"][i]["losses"]
        for name, value in private["params"][i].items():
            assert torch.equal(pooled["params"][i][name], value), name
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in pooled["results"])
    # The last importer gone, the pool is freed.
    assert _wait_for(lambda: _pools(d.socket) == [])


@pytest.mark.gpu
def test_a_killed_client_leaves_the_pool_to_the_others_until_the_last_one_goes(start_daemon,
                                                                                tmp_path):
    _skip_without_gpu()
    layers, dim = 4, 2048
    checkpoint(tmp_path, layers=layers, dim=dim)
    d = start_daemon("--memory_budget=2G", "--base_keep_warm_s=0")
    survivor = Worker(d.socket, tmp_path, "pool", tmp_path / "survivor.pt", layers, dim)
    victim = Worker(d.socket, tmp_path, "pool", tmp_path / "victim.pt", layers, dim)
    try:
        for w in (survivor, victim):
            assert w.hear() == {"ready": True}
            w.tell("attach")
            assert w.hear()["pool"] is not None
        pool_id = _pools(d.socket)[0]["pool_id"]
        victim.tell("forever")
        assert victim.hear() == {"training": True}
        victim.proc.send_signal(signal.SIGKILL)  # mid-step, reading the pool
        victim.proc.wait(timeout=30)
        # Its session ends with its data connection: its import goes, the pool stays.
        assert _wait_for(lambda: [len(p["importers"]) for p in _pools(d.socket)] == [1])
        assert _pools(d.socket)[0]["pool_id"] == pool_id
        survivor.tell("4")
        result = survivor.hear()
        assert len(result["losses"]) == 4
        assert all(torch.isfinite(torch.tensor(result["losses"])))
    finally:
        victim.finish()
        survivor.finish()
    assert _wait_for(lambda: _pools(d.socket) == [])
    with trainstream.connect(d.socket, job_id="observer") as observer:
        kinds = [e["kind"] for e in observer.events()]
    assert kinds.count("pool.freed") == 1 and "pool.joined" in kinds


# Maps the base's pool and tries to write to it: a read-only mapping must fault.
WRITER = r'''
import json, sys, torch, trainstream
base = trainstream.load_base(sys.argv[1], format="nf4", progress=False)
pool = base.on_gpu("cuda")
print(json.dumps({"read_only": pool.read_only, "note": pool.note,
                  "head": pool._pool[:64].tolist()}), flush=True)
if sys.stdin.readline().strip() == "write":
    pool._pool[:64].fill_(7)
    torch.cuda.synchronize()
    print("WROTE", flush=True)
'''


@pytest.mark.gpu
def test_a_process_cannot_write_to_the_pool_it_reads(start_daemon, tmp_path):
    _skip_without_gpu()
    checkpoint(tmp_path, layers=2, dim=1024)
    d = start_daemon("--memory_budget=1G", "--base_keep_warm_s=0")
    env = dict(os.environ, TRAINSTREAM_SOCKET=d.socket)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for _ in range(2)]
    reader, writer = procs
    try:
        first = json.loads(reader.stdout.readline())
        mapped = json.loads(writer.stdout.readline())
        if not mapped["read_only"]:
            pytest.skip(f"this driver maps pools read-write: {mapped['note']}")
        writer.stdin.write("write\n")
        writer.stdin.flush()
        out, err = writer.communicate(timeout=60)
        assert "WROTE" not in out and writer.returncode != 0, (out, err)
        assert "CUDA error" in err or "illegal" in err.lower(), err[-2000:]
        # The pool is intact for the other process, and still there.
        assert [len(p["importers"]) for p in _pools(d.socket)] == [1]
        check = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], env=env, text=True,
                               input="", capture_output=True, timeout=60)
        assert json.loads(check.stdout.splitlines()[0])["head"] == first["head"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=60)
