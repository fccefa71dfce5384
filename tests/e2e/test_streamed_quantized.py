# SPDX-License-Identifier: Apache-2.0
"""Quantized blocks that stream: a block whose frozen linear layers are stored quantized
(``quantize=`` at wrap, or a shared base) moves its stored bytes, as stored, into a device slot
around its forward and backward, and trains exactly as when it stays resident. CPU here (the
"device" is the CPU, copies are plain copies); the same tests run on CUDA on the GPU machine."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import trainstream
from trainstream.memory.blocks import stored_buffers, streamed_tensors, weight_bytes

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, train_steps  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def frozen_gpt(seed: int, layers: int = 4) -> torch.nn.Module:
    """A TinyGPT whose blocks' linear layers are frozen (a base, quantized below) while its
    norms, attention and embeddings train."""
    torch.manual_seed(seed)
    model = TinyGPT(layers=layers)
    for block in model.blocks:
        for layer in block.mlp:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.requires_grad_(False)
    return model.to(DEVICE)


def trained(model) -> list:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("fmt", ["int8", "nf4", "fp8", "nvfp4"])
def test_streamed_quantized_blocks_train_bit_identical_to_resident(daemon_socket, fmt):
    model = frozen_gpt(5)
    twin = copy.deepcopy(model)
    common = dict(offload=True, device=DEVICE, lr=3e-3, quantize=fmt, param_offload=False,
                  activation_offload=False, recompute=False)
    resident, r_opt = trainstream.wrap(model, **common)
    streamed, s_opt = trainstream.wrap(twin, **{**common, "param_offload": True})
    pager = streamed._trainstream_session.pager
    assert pager.paged == [0, 1, 2, 3]
    layer = streamed.blocks[1].mlp[0]
    assert isinstance(layer, trainstream.BaseLinear) and layer.streams
    # The stored bytes are in the streamed set, and between steps hold no memory of their own.
    stored = stored_buffers(streamed.blocks[1])
    assert stored and all(any(t is s for t in pager.weights.params[1]) for s in stored)
    assert all(s.untyped_storage().nbytes() <= s.element_size() for s in stored)
    # The slots hold a block's weights as stored: NF4 codes, not bf16 or fp32 values.
    block_bytes = weight_bytes(resident.blocks[1])
    assert pager.weights.layout_bytes[1] == block_bytes
    assert pager.weights.layout_bytes[1] < weight_bytes(frozen_gpt(5).blocks[1])
    assert train_steps(resident, r_opt, 5, DEVICE) == train_steps(streamed, s_opt, 5, DEVICE)
    assert pager.weights.packed > 0  # backward fetched the stored bytes again: its saved views
    said = [e["message"] for e in streamed._trainstream_session.events
            if e["kind"] == "wrap.param_offload"]
    assert said and "4 of 4 blocks stream" in said[0]
    # Unwrapped (a streamed block's parameters are placeholders until then), the trained
    # weights are equal, and each streamed layer holds its stored bytes on the device again.
    trainstream.unwrap(streamed)
    trainstream.unwrap(resident)
    for a, b in zip(trained(resident), trained(streamed)):
        assert torch.equal(a, b)
    for mine, theirs in zip(stored_buffers(streamed), stored_buffers(resident)):
        assert mine.device == theirs.device and torch.equal(mine, theirs)
    assert not streamed.blocks[1].mlp[0].streams


def test_streamed_blocks_page_activations_without_copying_their_stored_bytes(daemon_socket):
    # Blocks that page activations too: the stored bytes their layers save for backward are
    # weights, kept as references, never copied out as activations.
    model = frozen_gpt(6)
    twin = copy.deepcopy(model)
    common = dict(offload=True, device=DEVICE, lr=3e-3, quantize="nf4", recompute=False,
                  min_offload_bytes=1)
    resident, r_opt = trainstream.wrap(model, **common, param_offload=False,
                                       activation_offload=False)
    paged, p_opt = trainstream.wrap(twin, **common, param_offload=[1, 2],
                                    activation_offload=True)
    pager = paged._trainstream_session.pager
    assert pager.paged == [1, 2] and pager.offloading == [0, 1, 2]
    assert train_steps(resident, r_opt, 3, DEVICE) == train_steps(paged, p_opt, 3, DEVICE)
    # Block 0 keeps its weights in VRAM, block 1 streams them (its saved views of the slot are
    # layouts): both page the same activations, and not a stored byte of the resident block.
    paged_sizes = [sorted(i.host.numel() * i.host.element_size()
                          for i in pager.activations.saved[b]) for b in (0, 1)]
    assert paged_sizes[0] and paged_sizes[0] == paged_sizes[1]
    trainstream.unwrap(paged)
    trainstream.unwrap(resident)
    for a, b in zip(trained(resident), trained(paged)):
        assert torch.equal(a, b)


def test_a_streamed_shared_base_is_read_where_the_daemon_holds_it(daemon_socket, tmp_path):
    # On the CPU the base is attached in place; on a GPU with keep_on_host, its layers read the
    # daemon's registered host copy. Either way, streaming fetches from that copy itself.
    checkpoint = frozen_gpt(7)
    frozen = {n: p.detach().clone().contiguous() for n, p in checkpoint.named_parameters()
              if not p.requires_grad}
    safetensors_torch.save_file({n: t.cpu() for n, t in frozen.items()},
                                str(tmp_path / "model.safetensors"))
    with trainstream.connect(daemon_socket, job_id="streamed-base") as client:
        base = trainstream.load_base(str(tmp_path), format="nf4", client=client, progress=False)
        model, twin = copy.deepcopy(checkpoint), copy.deepcopy(checkpoint)
        trainstream.attach_base(model, base, keep_on_host=True)
        trainstream.attach_base(twin, base, keep_on_host=True)
        common = dict(offload=True, device=DEVICE, lr=3e-3, activation_offload=False,
                      recompute=False)
        resident, r_opt = trainstream.wrap(model, **common, param_offload=False)
        streamed, s_opt = trainstream.wrap(twin, **common, param_offload=True)
        session = streamed._trainstream_session
        layer = streamed.blocks[2].mlp[2]
        assert set(layer.host_views) == {"data", "scales"}
        # The host copy a streamed layer is fetched from is the base's memory: no copy made.
        data, _ = base.raw("blocks.2.mlp.2.weight")
        host = session.pager.weights.host[id(layer._buffers["data"])]
        assert host.data_ptr() == data.data_ptr()
        shared = sum(t.numel() * t.element_size() for b in streamed.blocks
                     for t in stored_buffers(b))
        assert shared > 0 and session.frozen.bytes == 0  # nothing else in the blocks is frozen
        assert train_steps(resident, r_opt, 4, DEVICE) == train_steps(streamed, s_opt, 4,
                                                                      DEVICE)
        # A resident layer whose buffer wrap() moved to the GPU (a copy: here, a clone) still
        # streams from the base's memory when a later plan streams its block.
        from trainstream.memory.blocks import shared_host_buffers

        kept = resident.blocks[0].mlp[0]
        kept._buffers["data"] = kept.data.clone()
        data, _ = base.raw("blocks.0.mlp.0.weight")
        assert shared_host_buffers(resident)[id(kept.data)].data_ptr() == data.data_ptr()
        trainstream.unwrap(streamed)
        trainstream.unwrap(resident)
        for a, b in zip(trained(resident), trained(streamed)):
            assert torch.equal(a, b)


def test_the_plan_counts_stored_bytes_as_block_weights(daemon_socket):
    from trainstream.memory.weight_plan import weight_plan

    model = frozen_gpt(8, layers=6)
    trainstream.quantize_model(model, "nf4")
    blocks = list(model.blocks)
    size = weight_bytes(blocks[0])
    assert size == sum(t.numel() * t.element_size() for t in streamed_tensors(blocks[0]))
    assert size > sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    # A budget for the weights outside the stack, the slots and two blocks, and about half the
    # stack: about half the blocks stream, which counting parameters alone would not see.
    outside = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(
        p.numel() * p.element_size() for b in blocks for p in b.parameters())
    budget = outside + 7 * size
    streamed = weight_plan(model, blocks, budget, 1, probe=False)
    assert 2 <= len(streamed) <= 5


def test_layers_read_from_a_gpu_pool_are_not_block_weights(daemon_socket):
    # A pooled layer's bytes are a view of the daemon's VRAM, off the budget already: counting
    # them as block weights would stream a block that fits, and free nothing.
    from trainstream.memory.blocks import base_host_views, weight_tensors
    from trainstream.memory.weight_slots import mark_streaming

    model = frozen_gpt(9, layers=2)
    trainstream.quantize_model(model, "nf4")
    block = model.blocks[0]
    layers = [m for m in block.modules() if isinstance(m, trainstream.frozen.linear.BaseLinear)]
    assert layers and len(stored_buffers(block)) == 2 * len(layers)
    layers[0].pooled = True
    assert len(stored_buffers(block)) == 2 * (len(layers) - 1)
    assert all(b is not layers[0].data and b is not layers[0].scales
               for b in stored_buffers(block))
    assert weight_bytes(block, trained=False) == sum(
        t.numel() * t.element_size() for t in streamed_tensors(block) if not t.requires_grad)
    assert base_host_views(block) == []  # quantized here: no shared base's bytes to read
    # Still weights the block reads (the pager tells them from saved activations), and never
    # marked as streaming (which would refuse their FP8 tensor-core matmul for no reason).
    held = weight_tensors(block)
    assert any(t is layers[0].data for t in held) and any(t is layers[0].scales for t in held)
    mark_streaming(block, True)
    assert not layers[0].streams and all(m.streams for m in layers[1:])


def test_a_fetch_by_raw_pointers_never_spans_two_cuda_registrations():
    # A segment the driver would not register whole is registered in 1 GiB pieces; a streamed
    # block's fetch copies by raw pointers, which fails across two. Such bytes are then not read
    # in place (the pager makes a copy of its own).
    from types import SimpleNamespace

    from trainstream.transport.client import in_one_registration

    gib = 1 << 30
    whole = SimpleNamespace(offset=5 * gib, registration_piece_bytes=0)  # whole, or unregistered
    assert in_one_registration(whole, gib - 10, 20)
    pieces = SimpleNamespace(offset=gib - 4096, registration_piece_bytes=gib)
    assert in_one_registration(pieces, 0, 4096)  # ends on the boundary
    assert not in_one_registration(pieces, 0, 4097)  # one byte past it
    assert in_one_registration(pieces, 4096, gib)  # the whole next piece
    assert not in_one_registration(pieces, 4095, 2)
    assert in_one_registration(pieces, 4095, 0)  # nothing to copy
