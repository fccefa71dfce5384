# SPDX-License-Identifier: Apache-2.0
"""Models over a shared base: frozen Linear weights taken from the daemon's one host copy
(bf16 or quantized), LoRA adapters beside them trained through wrap(), with the same results as
a model holding the dequantized weights itself, and as a model quantized in its own process."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest

import trainstream

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
nn = torch.nn


class Block(nn.Module):
    def __init__(self, dim: int, rank: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim, bias=False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, 4 * dim, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(nn.functional.gelu(self.up(h) + self.lora_b(self.lora_a(h))))


class Net(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def frozen_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    for name, p in net.named_parameters():
        p.requires_grad_("lora" in name or name.startswith("head"))
    return net


def base_weights(net: Net) -> dict:
    """The frozen tensors, as a checkpoint holds them."""
    return {n: p.detach().clone().contiguous() for n, p in net.named_parameters()
            if not p.requires_grad}


def with_dequantized(net: Net, base) -> Net:
    """The same model holding the base's (dequantized) values as its own frozen parameters."""
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in base.tensors:
                p.copy_(base.dequantize(name, dtype=torch.float32))
    return ref


def train(model, steps=4, seed=3):
    model, opt = trainstream.wrap(model, lr=1e-2, offload=True, device="cpu")
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 64, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture
def client(daemon, monkeypatch):
    monkeypatch.setenv("TRAINSTREAM_SOCKET", daemon.socket)
    c = trainstream.connect(daemon.socket, job_id="base-models")
    yield c
    c.close()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "nf4", "fp8", "nvfp4"])
def test_lora_on_a_shared_base_trains_as_on_its_dequantized_weights(client, tmp_path, fmt):
    net = frozen_net()
    safetensors_torch.save_file(base_weights(net), str(tmp_path / "model.safetensors"))
    base = trainstream.load_base(str(tmp_path), format=fmt, client=client, progress=False)
    reference = with_dequantized(net, base)
    taken = trainstream.attach_base(net, base)
    assert sorted(taken["linear"]) == sorted(f"blocks.{i}.{m}.weight" for i in range(3)
                                             for m in ("up", "down"))
    assert sorted(taken["copied"]) == sorted(f"blocks.{i}.norm.{w}" for i in range(3)
                                             for w in ("weight", "bias"))
    assert all(isinstance(net.blocks[i].up, trainstream.BaseLinear) for i in range(3))
    # No full-precision copy of a frozen weight stays in the model.
    assert not any("up.weight" in n or "down.weight" in n for n, _ in net.named_parameters())
    x = torch.randn(5, 64)
    assert torch.equal(net(x), reference(x))
    assert train(net) == train(reference)
    report = trainstream.memory_report(net)
    assert report["base"]["id"] == base.id and report["base"]["format"] == fmt
    assert report["mapped_segments"]["resident_bytes"] >= base.stored_bytes


def test_frozen_layers_left_unquantized_and_trained_biases_keep_working(client, tmp_path):
    net = frozen_net(2)
    net.head.weight.requires_grad_(False)  # frozen, but not among the names quantized
    net.blocks[0].up.bias.requires_grad_(True)  # trained beside a frozen weight
    trained_bias = net.blocks[0].up.bias
    safetensors_torch.save_file(base_weights(net), str(tmp_path / "model.safetensors"))
    base = trainstream.load_base(str(tmp_path), format="nf4", client=client, progress=False,
                                 quantize=[f"blocks.{i}.{m}.weight" for i in range(3)
                                           for m in ("up", "down")])
    assert base.tensors["head.weight"].stored == "as_is"  # exactly as the file has it
    reference = with_dequantized(net, base)
    trainstream.attach_base(net, base)
    assert isinstance(net.head, trainstream.BaseLinear)
    assert net.blocks[0].up.bias is trained_bias and trained_bias.requires_grad
    x = torch.randn(3, 64)
    assert torch.equal(net(x), reference(x))
    assert train(net) == train(reference)


def test_attach_base_maps_the_models_names_onto_the_checkpoints(client, tmp_path):
    net = frozen_net(5)
    # The checkpoint names everything under "model.", as Hugging Face checkpoints do.
    safetensors_torch.save_file({f"model.{n}": t for n, t in base_weights(net).items()},
                                str(tmp_path / "model.safetensors"))
    base = trainstream.load_base(str(tmp_path), format="int8", client=client, progress=False)
    # Names that differ take nothing: refused, with names from both sides, not silently.
    with pytest.raises(trainstream.FailedPreconditionError,
                       match="the model has blocks.0.norm.weight.*the base model.blocks"):
        trainstream.attach_base(copy.deepcopy(net), base)
    reference = copy.deepcopy(net)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if f"model.{name}" in base.tensors:
                p.copy_(base.dequantize(f"model.{name}", dtype=torch.float32))
    taken = trainstream.attach_base(net, base, rename=lambda name: f"model.{name}")
    assert len(taken["linear"]) == 6 and "blocks.0.up.weight" in taken["linear"]
    x = torch.randn(2, 64)
    assert torch.equal(net(x), reference(x))


def test_quantize_model_matches_a_base_quantized_by_the_daemon(client, tmp_path):
    net = frozen_net(1)
    safetensors_torch.save_file(base_weights(net), str(tmp_path / "model.safetensors"))
    local = copy.deepcopy(net)
    assert sorted(trainstream.quantize_model(local, "nf4")["layers"]) == sorted(
        f"blocks.{i}.{m}" for i in range(3) for m in ("up", "down"))
    shared = copy.deepcopy(net)
    trainstream.attach_base(shared, trainstream.load_base(str(tmp_path), format="nf4",
                                                          client=client, progress=False))
    x = torch.randn(4, 64)
    assert torch.equal(local(x), shared(x))
    with pytest.raises(trainstream.InvalidArgumentError, match="quantize='fp4'"):
        trainstream.quantize_model(copy.deepcopy(net), "fp4")


def test_quantize_model_takes_trainstream_06s_signature_and_returns_its_counts():
    """quantize_model(model, quantize="nf4", *, blocks=None, block_size=64, pin_budget=None)
    as TrainStream 0.6 has it: NF4 by default, the block stack's frozen linear weights only (a
    frozen head outside it stays), {"tensors", "bytes_before", "bytes_after"} back; block=
    (its name before 0.6) still sets block_size."""
    net = frozen_net(1)
    net.head.requires_grad_(False)
    stack = [f"blocks.{i}.{m}" for i in range(3) for m in ("up", "down")]
    before = sum(net.get_submodule(n).weight.numel() * 4 for n in stack)
    done = trainstream.quantize_model(net)
    assert done["tensors"] == 6 and sorted(done["layers"]) == sorted(stack)
    layers = [net.get_submodule(n) for n in stack]
    assert all(layer.stored.stored == "nf4" and layer.stored.block == 64 for layer in layers)
    assert done["bytes_before"] == before
    assert done["bytes_after"] == sum(layer.data.numel() + layer.scales.numel()
                                      for layer in layers) < before / 4
    assert type(net.head) is nn.Linear  # frozen, but no block's: as it was
    other = frozen_net(1)
    done = trainstream.quantize_model(other, "int8", blocks=[other.blocks[1]], block_size=32,
                                      pin_budget=1 << 20)
    assert sorted(done["layers"]) == ["blocks.1.down", "blocks.1.up"]
    assert other.blocks[1].up.stored.block == 32 and type(other.blocks[0].up) is nn.Linear
    old_name = frozen_net(1)
    trainstream.quantize_model(old_name, "int8", block=16)
    assert old_name.blocks[0].up.stored.block == 16
    older = frozen_net(1)  # 0.4's keyword for the format
    assert trainstream.quantize_model(older, format="int8")["tensors"] == 6
    assert older.blocks[0].up.stored.stored == "int8"
    for bad, message in ((dict(quantize="fp4"), r"quantize='fp4' must be one of 'int8'"),
                         (dict(block_size=3), "block_size=3 must be an even integer >= 2"),
                         (dict(pin_budget=-1), "pin_budget=-1 must be None or bytes"),
                         (dict(block=16, block_size=32), "give one of them"),
                         (dict(format="int8", quantize="fp8"), "give one of them"),
                         (dict(blocks=["blocks.0"]), "blocks=.* must be None or a list")):
        with pytest.raises(trainstream.InvalidArgumentError, match=message):
            trainstream.quantize_model(frozen_net(1), **bad)


def test_wrap_quantize_leaves_a_frozen_output_head_as_it_is(client):
    """wrap(quantize=) quantizes the decoder layers' frozen weights and leaves a frozen lm_head
    as it is, as TrainStream 0.6 does; memory_report() names the blocks quantized."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(4)
    model = transformers.Qwen2ForCausalLM(config)
    model.requires_grad_(False)
    model.model.norm.requires_grad_(True)  # something to train
    model, opt = trainstream.wrap(model, lr=1e-3, device="cpu", quantize="int8")
    assert type(model.lm_head) is nn.Linear
    assert all(isinstance(layer.mlp.up_proj, trainstream.BaseLinear)
               and isinstance(layer.self_attn.q_proj, trainstream.BaseLinear)
               for layer in model.model.layers)
    assert "14 frozen linear layers quantized to int8" in quantize_said(model)
    assert "output head stays as it is" in quantize_said(model)
    params = trainstream.memory_report(model)["params"]
    assert params["quantized_blocks"] == [0, 1] and params["quantized_layers"] == 14
    trainstream.unwrap(model)


@pytest.mark.parametrize("bad, message", [
    (dict(num_hidden_layers=-1), r"load_model: num_hidden_layers=-1 must be an integer >= 1"),
    (dict(hidden_size="64"), r"load_model: hidden_size='64' must be an integer >= 1"),
    (dict(dtype=torch.int8),
     r"load_model: dtype=torch.int8 must be torch.bfloat16, torch.float16 or torch.float32"),
    (dict(quantize="fp4"), r"load_model: quantize='fp4' must be one of 'auto', None"),
    (dict(quant_block_size=3), r"load_model: quant_block_size=3 must be an even integer"),
    (dict(device="tpu"), r"load_model: device='tpu' must be None, 'cpu', 'cuda'"),
], ids=["layers", "hidden_size", "dtype", "quantize", "block", "device"])
def test_load_model_refuses_a_bad_value_naming_it(tmp_path, bad, message):
    """Issue 50: num_hidden_layers=-1 built a model with no layers and dtype=torch.int8 got
    torch's error; each is an InvalidArgumentError naming the argument, the value and what it
    takes, before anything is built."""
    _tiny_qwen2_checkpoint(tmp_path)
    with pytest.raises(trainstream.InvalidArgumentError, match=message):
        trainstream.load_model(str(tmp_path), **{"random_weights": True, "device": "cpu",
                                                 **bad})


def test_wrap_quantizes_frozen_layers_when_asked(client, tmp_path):
    net = frozen_net(3)
    own = copy.deepcopy(net)
    trainstream.quantize_model(own, "int8", block=32)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    model, opt = trainstream.wrap(net, lr=1e-2, device="cpu", quantize="int8",
                                  quant_block_size=32)
    assert isinstance(model.blocks[0].up, trainstream.BaseLinear)
    assert model.blocks[0].up.stored.block == 32
    assert any(e["kind"] == "wrap.quantize" for e in model._trainstream_session.events)
    assert torch.equal(model(x), own(x))
    for bad in (dict(quantize="fp4"), dict(quant_block_size=3)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            trainstream.wrap(frozen_net(), device="cpu", **bad)


def stored_formats(model) -> set:
    return {m.stored.stored for m in model.modules() if isinstance(m, trainstream.BaseLinear)}


def quantize_said(model) -> str:
    return next(e["message"] for e in model._trainstream_session.events
                if e["kind"] == "wrap.quantize")


# frozen_net()'s blocks hold 134 KiB of fp32 weights each (2 x 16,384 frozen linear values:
# 34 KiB as int8, 18 KiB as NF4, scales included); 406 KiB in all. With two blocks' worth kept
# for gradients in flight, they all fit from about 675 KiB, and streaming from about 540 KiB;
# as int8 from about 250 KiB, streaming from about 180 KiB; as NF4 from about 130 KiB,
# streaming from about 110 KiB.
@pytest.mark.parametrize("budget,prefer,expected", [
    (4 << 20, "exact", set()),          # everything fits as it is
    (4 << 20, "speed", set()),          # ...and stays in VRAM: no reason to quantize
    (600 << 10, "exact", set()),        # blocks stream, exact: the default keeps them so
    (600 << 10, "speed", {"int8"}),     # int8 keeps every block in VRAM
    (130 << 10, "speed", {"nf4"}),      # int8 would still stream; NF4 does not
    (190 << 10, "exact", {"int8"}),     # as it is, not even streaming fits; int8 streams
    (190 << 10, "speed", {"nf4"}),      # ...but NF4 stays in VRAM
    (130 << 10, "exact", {"nf4"}),      # int8 does not fit even streaming
    (115 << 10, "exact", {"nf4"}),      # NF4 blocks stream in their stored format
])
def test_quantize_auto_quantizes_only_when_the_run_needs_it(client, budget, prefer, expected):
    net = frozen_net(4)
    model, opt = trainstream.wrap(net, lr=1e-2, device="cpu", quantize="auto", prefer=prefer,
                                  vram_budget=budget)
    said = quantize_said(model)
    assert stored_formats(model) == expected, said
    assert f"prefer='{prefer}'" in said
    assert ("kept as they are" in said) == (not expected)
    before = model.blocks[0].lora_b.weight.detach().clone()  # zeros
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()  # LoRA trains over whatever it chose
    opt.step()
    assert not torch.equal(model.blocks[0].lora_b.weight.detach(), before)
    trainstream.unwrap(model)


def test_quantize_auto_needs_host_room_for_streamed_frozen_copies(daemon):
    from trainstream.memory.blocks import find_blocks
    from trainstream.memory.quantization import candidates, choose

    net = frozen_net(4)
    blocks = find_blocks(net)
    asked = []

    def room(free):
        return lambda: asked.append(free) or free

    plenty = candidates(net, blocks, 600 << 10, 1, True, room(1 << 30))
    assert [c.fmt for c in plenty] == [None, "int8", "nf4"]
    assert plenty[0].streamed > 0 and plenty[0].fits_host and plenty[1].streamed == 0
    assert plenty[0].host_bytes >= 128 << 10  # a streamed block's frozen weights, at least
    assert choose(plenty, "exact").fmt is None and choose(plenty, "speed").fmt == "int8"
    none = candidates(net, blocks, 600 << 10, 1, True, room(1000))
    assert not none[0].fits_host and choose(none, "exact").fmt == "int8"
    assert asked == [1 << 30, 1000]  # asked once a candidate streamed, and only then
    with pytest.raises(ValueError, match="prefer"):
        trainstream.wrap(frozen_net(), device="cpu", quantize="auto", prefer="fast")
    # param_offload=False: streaming is not an option, so int8 it is, even preferring exact.
    model, _ = trainstream.wrap(frozen_net(4), device="cpu", quantize="auto",
                                vram_budget=600 << 10, param_offload=False)
    assert stored_formats(model) == {"int8"}, quantize_said(model)
    trainstream.unwrap(model)
    # A frozen head tied to a frozen embedding: quantizing it adds a copy, it saves nothing.
    tied = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000, bias=False))
    tied[1].weight = tied[0].weight
    tied.requires_grad_(False)
    as_is, int8, _ = candidates(tied, [], 1 << 30, 1, False, room(1 << 30))
    assert int8.weight_bytes == as_is.weight_bytes + 1000 * 64 + 4 * 1000
    # No VRAM budget to plan against (a CPU run without vram_budget=): nothing is quantized.
    model, _ = trainstream.wrap(frozen_net(), device="cpu", quantize="auto", prefer="speed")
    assert stored_formats(model) == set() and "no VRAM budget" in quantize_said(model)
    trainstream.unwrap(model)


TRAINER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    import torch, trainstream
    from test_base_models import frozen_net, train
    net = frozen_net()
    trainstream.attach_base(net, trainstream.load_base(sys.argv[1], format="nf4", progress=False))
    print(json.dumps(train(net)))
""")


def test_two_jobs_train_on_one_base_as_each_would_on_its_own_copy(start_daemon, tmp_path):
    d = start_daemon("--memory_budget=256M")
    net = frozen_net()
    safetensors_torch.save_file(base_weights(net), str(tmp_path / "model.safetensors"))
    env = dict(os.environ, TRAINSTREAM_SOCKET=d.socket)
    here = os.path.dirname(__file__)
    runs = [subprocess.run([sys.executable, "-c", TRAINER, str(tmp_path), here], env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    with trainstream.connect(d.socket, job_id="observer") as observer:
        bases = trainstream.bases(observer)
        assert len(bases) == 1  # both jobs used the one base, now kept warm
        own = copy.deepcopy(net)
        trainstream.quantize_model(own, "nf4")
        os.environ["TRAINSTREAM_SOCKET"] = d.socket
        try:
            expected = train(own)
        finally:
            del os.environ["TRAINSTREAM_SOCKET"]
    assert runs[0].stdout == runs[1].stdout
    assert [float(v) for v in runs[0].stdout.strip()[1:-1].split(",")] == expected


@pytest.mark.gpu
def test_base_linear_on_cuda_matches_the_reference(client, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    net = frozen_net()
    safetensors_torch.save_file(base_weights(net), str(tmp_path / "model.safetensors"))
    for fmt in ("int8", "nf4", "fp8", "nvfp4"):
        base = trainstream.load_base(str(tmp_path), format=fmt, client=client, progress=False)
        reference = with_dequantized(net, base).cuda()
        for keep_on_host in (False, True):
            model = copy.deepcopy(net).cuda()
            trainstream.attach_base(model, base, device="cuda", keep_on_host=keep_on_host)
            x = torch.randn(6, 64, device="cuda", requires_grad=True)
            x_ref = x.detach().clone().requires_grad_(True)
            out, out_ref = model(x), reference(x_ref)
            assert torch.equal(out, out_ref), (fmt, keep_on_host)
            out.sum().backward()
            out_ref.sum().backward()
            assert torch.equal(x.grad, x_ref.grad), (fmt, keep_on_host)


@pytest.mark.parametrize("fmt,tied", [(None, False), ("nf4", False), ("int8", True)])
def test_load_model_builds_a_hugging_face_lm_over_the_shared_base(client, tmp_path, fmt, tied):
    original = _tiny_qwen2_checkpoint(tmp_path, tied).eval()
    model = trainstream.load_model(str(tmp_path), quantize=fmt, device="cpu", client=client,
                                   progress=False).eval()
    assert not any(p.requires_grad for p in model.parameters())
    base = model._trainstream_base
    assert base.format == (fmt or "bf16")
    # The reference: the original model holding the base's values, dequantized.
    with torch.no_grad():
        for name, p in original.named_parameters():
            if name in base.tensors:
                p.copy_(base.dequantize(name, dtype=p.dtype))
    idx = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(idx).logits, original(idx).logits)
    if fmt is not None:
        quantized = [n for n, t in base.tensors.items() if t.stored == fmt]
        assert quantized and all(".layers." in n for n in quantized)


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_quantize_model_writes_the_reference_quantizers_bytes(fmt):
    """quantize_model() quantizes in chunks on every core, straight into the layer's buffers:
    byte for byte what the daemon's reference quantizer makes of the whole tensor, for a layer
    of several chunks whose size is no multiple of a block."""
    from trainstream import _trainstream

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(2100, 2047, bias=False),
                              torch.nn.Linear(7, 13)).requires_grad_(False)
    weights = [m.weight.detach().clone() for m in net]
    trainstream.quantize_model(net, fmt)
    for layer, w in zip(net, weights):
        data, scales, tensor_scale, block = _trainstream.quantize_reference(
            fmt, 0, w.float().contiguous().numpy().tobytes())
        assert layer.data.numpy().tobytes() == data
        assert layer.scales.numpy().tobytes() == scales
        assert layer.stored.tensor_scale == pytest.approx(tensor_scale, rel=0, abs=0)
        assert layer.stored.block == block


def _tiny_qwen2_checkpoint(folder, tied=False):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(4)
    original = transformers.Qwen2ForCausalLM(config)
    for p in original.parameters():  # bf16 weights; computed buffers (rotary) stay fp32
        p.data = p.data.to(torch.bfloat16)
    original.save_pretrained(str(folder), safe_serialization=True)
    return original


def _lora(model):
    peft = pytest.importorskip("peft", reason="peft is not installed (scripts/bootstrap.sh "
                                              "installs it)")
    torch.manual_seed(11)  # the same adapters' initial values on either model
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"], init_lora_weights="gaussian"))


def _train_lora(model, steps=3):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for s in range(steps):
        x = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(s))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fmt", [None, "int8", "nf4", "fp8", "nvfp4"])
def test_peft_adds_lora_to_a_load_model_base_in_every_format(client, tmp_path, fmt):
    """get_peft_model takes load_model's frozen layers as linear layers: LoRA on every
    projection trains, as it does on the same model holding the base's values in nn.Linear."""
    original = _tiny_qwen2_checkpoint(tmp_path)
    model = trainstream.load_model(str(tmp_path), quantize=fmt, device="cpu", client=client,
                                   progress=False)
    base = model._trainstream_base
    with torch.no_grad():
        for name, p in original.named_parameters():
            if name in base.tensors:
                p.copy_(base.dequantize(name, dtype=p.dtype))
    original.requires_grad_(False)
    ours, reference = _lora(model), _lora(original)
    lora_layers = [m for m in ours.modules() if type(m).__name__ == "Linear"
                   and isinstance(getattr(m, "base_layer", None), trainstream.BaseLinear)]
    assert len(lora_layers) == 7 * 2
    before = {n: p.detach().clone() for n, p in ours.named_parameters() if p.requires_grad}
    got, expected = _train_lora(ours), _train_lora(reference)
    assert all(abs(a - b) < 2e-2 for a, b in zip(got, expected)), (got, expected)
    moved = [n for n, p in ours.named_parameters() if p.requires_grad
             and not torch.equal(p.detach(), before[n])]
    assert len(moved) == len(before) == 7 * 2 * 2
    with pytest.raises(trainstream.FailedPreconditionError, match="cannot be replaced"):
        lora_layers[0].base_layer.weight = torch.zeros(1)


def test_attach_base_takes_the_base_after_peft_wrapped_the_layers(client, tmp_path):
    """Adapters added first: the layers are PEFT's (base_model.model....q_proj.base_layer), and
    the base still gives every frozen weight; a model of which the base holds nothing is
    refused rather than silently left as it was."""
    transformers = pytest.importorskip("transformers")
    original = _tiny_qwen2_checkpoint(tmp_path)
    base = trainstream.load_base(str(tmp_path), format="nf4", client=client, progress=False)
    model = _lora(copy.deepcopy(original))
    taken = trainstream.attach_base(model, base, device="cpu")
    adapted = [n for n in taken["linear"] if ".base_layer." in n]
    assert len(adapted) == 14 and set(taken["linear"]) - set(adapted) == {
        "base_model.model.lm_head.weight"}
    assert "base_model.model.model.embed_tokens.weight" in taken["copied"]
    assert all(not isinstance(m, torch.nn.Linear) or isinstance(m, trainstream.BaseLinear)
               or m.weight.requires_grad or "lm_head" in n for n, m in model.named_modules())
    stranger = transformers.Qwen2ForCausalLM(original.config)
    for n, p in stranger.named_parameters():
        p.requires_grad_(False)
    with pytest.raises(trainstream.FailedPreconditionError, match="holds none of the model"):
        trainstream.attach_base(stranger, base, device="cpu",
                                rename=lambda name: "elsewhere." + name)


def test_load_model_finds_a_hub_id_in_the_local_cache_and_never_downloads(client, tmp_path):
    """An ``org/name`` id resolves as from_pretrained would offline (the cache's refs/main to
    its snapshot); one that is not there fails saying it is not downloaded. With no device
    named, the model goes to the GPU when there is one, else the CPU."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-qwen2" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (cache / "models--tiny-org--tiny-qwen2" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen2" / "refs" / "main").write_text("ab" * 20)
    _tiny_qwen2_checkpoint(snapshot)
    model = trainstream.load_model("tiny-org/tiny-qwen2", cache_dir=str(cache), client=client,
                                   progress=False)
    assert model._trainstream_base.format == "bf16"
    wanted = "cuda" if torch.cuda.is_available() else "cpu"
    assert {p.device.type for p in model.parameters()} == {wanted}
    with pytest.raises(trainstream.NotFoundError, match="does not download"):
        trainstream.load_model("tiny-org/absent", cache_dir=str(cache), client=client)
    with pytest.raises(trainstream.InvalidArgumentError, match="no field 'hiden_size'"):
        trainstream.load_model(str(snapshot), hiden_size=3, client=client)


def test_wrap_trains_peft_lora_over_a_load_model_base_like_stock_adamw(client, tmp_path):
    """The issue's path as a user writes it: get_peft_model(load_model(path, quantize="nf4")),
    then wrap() with torch.optim.AdamW and every other option at its default; the same model
    under stock AdamW gives the same losses."""
    _tiny_qwen2_checkpoint(tmp_path)

    def build():
        return _lora(trainstream.load_model(str(tmp_path), quantize="nf4", device="cpu",
                                            client=client, progress=False))

    ours, reference = build(), build()
    # The reference computes the loss wrap() puts on the model (the same values as
    # transformers' loss to its last bits: test_chunked_loss.py), so that the optimizers are
    # what differs.
    from trainstream.integrations import chunked_loss

    assert chunked_loss.LossSwitch(reference).switched
    ours, opt = trainstream.wrap(ours, torch.optim.AdamW(
        [p for p in ours.parameters() if p.requires_grad], lr=1e-2), device="cpu")
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for s in range(4):
        x = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(s))
        got = ours(input_ids=x, labels=x).loss
        got.backward()
        opt.step()
        opt.zero_grad()
        expected = reference(input_ids=x, labels=x).loss
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # Adam divides by the root of the second moment: elements with rounding-sized
        # gradients move by a good part of lr on the losses' last bits (as in test_hf_models).
        assert abs(got.item() - expected.item()) < 2e-4, (s, got.item(), expected.item())
    assert expected.item() < 4.85  # trained: ln(128) = 4.85 is a guess among 128 tokens
    trainstream.unwrap(ours)


def _planned(client, folder, fmt):
    info = client.load_base(str(folder), fmt, 0, [], "", plan_only=True)
    assert info["state"] == "planned" and int(info["base_id"]) == 0, info
    return int(info["stored_bytes"])


def _room(client):
    memory = client.memory()
    return int(memory["budget_bytes"]) - int(memory["committed_bytes"])


def test_a_plan_only_request_sizes_the_base_as_the_load_stores_it(client, tmp_path):
    _tiny_qwen2_checkpoint(tmp_path)
    sizes = {fmt: _planned(client, tmp_path, fmt) for fmt in ("bf16", "int8", "nf4")}
    assert sizes["bf16"] > sizes["int8"] > sizes["nf4"] > 0, sizes
    assert trainstream.bases(client) == []  # nothing loaded
    base = trainstream.load_base(str(tmp_path), format="int8", client=client, progress=False)
    assert base.stored_bytes == sizes["int8"]


def test_quantize_auto_takes_bf16_when_it_fits_and_says_why(client, tmp_path):
    _tiny_qwen2_checkpoint(tmp_path)
    model = trainstream.load_model(str(tmp_path), device="cpu", client=client, progress=False)
    assert model.trainstream_format == "bf16"
    said = [e for e in client.events() if e["kind"] == "client.load_model.quantize"]
    assert said and "bf16: " in said[-1]["message"] and "fits in" in said[-1]["message"], said


def test_quantize_auto_quantizes_when_bf16_does_not_fit(client, tmp_path):
    _tiny_qwen2_checkpoint(tmp_path)
    bf16, int8 = _planned(client, tmp_path, "bf16"), _planned(client, tmp_path, "int8")
    between = (bf16 + int8) / 2 / _room(client)  # room for int8, not for bf16
    model = trainstream.load_model(str(tmp_path), device="cpu", client=client, progress=False,
                                   ram_fraction=between)
    assert model.trainstream_format == "int8"
    said = [e for e in client.events() if e["kind"] == "client.load_model.quantize"]
    assert "not bf16" in said[-1]["message"], said


def test_quantize_auto_refuses_with_every_formats_size_when_none_fits(client, tmp_path):
    _tiny_qwen2_checkpoint(tmp_path)
    nf4 = _planned(client, tmp_path, "nf4")
    with pytest.raises(trainstream.ResourceExhaustedError, match="in any format \\(bf16 .*nf4"):
        trainstream.load_model(str(tmp_path), device="cpu", client=client, progress=False,
                               ram_fraction=nf4 / 2 / _room(client))
    assert trainstream.bases(client) == []


def test_quantize_auto_takes_a_base_this_user_holds_already(client, tmp_path):
    _tiny_qwen2_checkpoint(tmp_path)
    held = trainstream.load_base(str(tmp_path), format="int8", client=client, progress=False)
    tiny = 1e-9  # no room for anything new
    model = trainstream.load_model(str(tmp_path), device="cpu", client=client, progress=False,
                                   ram_fraction=tiny)
    assert model.trainstream_format == "int8"
    assert [b["base_id"] for b in trainstream.bases(client)] == [held.id]


def test_random_weights_build_the_architecture_without_reading_a_checkpoint(client, tmp_path):
    original = _tiny_qwen2_checkpoint(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # the config alone
    model = trainstream.load_model(str(tmp_path), random_weights=True, quantize="int8",
                                   device="cpu", client=client, progress=False)
    assert trainstream.bases(client) == []
    assert not any(p.requires_grad for p in model.parameters())
    assert sum(isinstance(m, trainstream.BaseLinear) for m in model.modules()) == 2 * 7
    assert type(model) is type(original)
    idx = torch.randint(0, 128, (1, 6))
    assert torch.isfinite(model(idx).logits).all()
    with pytest.raises(trainstream.InvalidArgumentError, match="ram_fraction=0"):
        trainstream.load_model(str(tmp_path), random_weights=True, ram_fraction=0)
