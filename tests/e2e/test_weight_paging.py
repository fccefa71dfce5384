# SPDX-License-Identifier: Apache-2.0
"""Block paging through wrap(): paged blocks borrow a slot for their weights only while they
run (forward, and again for backward), blocks page their saved activations to host memory, and
training is bit-identical to the all-resident run. CPU here (the
"device" is the CPU, copies are plain copies); the same tests run on CUDA on the GPU machine."""

from __future__ import annotations

import copy
import os
import sys
import time

import pytest

import trainstream
from trainstream.memory.planner import fetch_bytes

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from tiny_gpt import TinyGPT, train_steps  # noqa: E402
from tiny_gpt import batch as tiny_gpt_batch  # noqa: E402
from tiny_gpt import loss_fn as tiny_gpt_loss  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def train(model, opt, steps, start=0):
    return train_steps(model, opt, steps, DEVICE, start)


def twins(seed: int, layers: int, resident: dict | None = None, **options):
    """Two copies of one TinyGPT, trained alike (offload=True, lr=3e-3, on DEVICE unless
    ``device=`` says otherwise): one wrapped with ``resident``'s options, one with ``options``.
    Returns (resident model, its optimizer, the other model, its optimizer)."""
    torch.manual_seed(seed)
    device = options.pop("device", DEVICE)
    model = TinyGPT(layers=layers).to(device)
    other = copy.deepcopy(model)
    common = dict(offload=True, device=device, lr=3e-3)
    return (*trainstream.wrap(model, **common, **(resident or {})),
            *trainstream.wrap(other, **common, **options))


def weights(model):
    trainstream.unwrap(model)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("paged", [True, [1, 2], 0.5])
def test_paged_weights_train_bit_identical_to_resident(daemon_socket, paged):
    resident, r_opt, streamed, s_opt = twins(3, 4, param_offload=paged)
    pager = streamed._trainstream_session.pager
    assert pager is not None and pager.paged
    # Between steps a paged weight holds no memory of its own: a one-element placeholder.
    w = streamed.blocks[pager.paged[0]].mlp[0].weight
    assert w.untyped_storage().nbytes() == w.element_size()
    assert train(resident, r_opt, 6) == train(streamed, s_opt, 6)
    assert pager.weights.packed > 0  # backward re-fetched the weights it saved references to
    report = trainstream.memory_report(streamed)["params"]
    assert report["paged_blocks"] == pager.paged and report["load_bytes"] == pager.bytes_fetched
    # A checkpoint of the model while paged holds the real weights, not the placeholders.
    ours, theirs = streamed.state_dict(), resident.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k].cpu(), theirs[k].cpu()) for k in ours)
    # Each streamed block is fetched for forward and again for backward, except the last ones
    # of forward, still in their slots when backward starts with them.
    sizes = [sum(n for _, _, n in pager.weights.layout[b]) for b in pager.paged]
    assert pager.bytes_fetched == 6 * fetch_bytes(sizes, pager.weights.depth) < 6 * 2 * sum(sizes)
    for a, b in zip(weights(resident), weights(streamed)):
        assert torch.equal(a, b)


def test_a_forward_between_backward_and_step_reads_the_updated_streamed_weights(daemon_socket):
    # The slots still hold blocks fetched before the updates: completing the iteration early
    # (updates land during backward) must make them fetch again, as step() does.
    resident, r_opt, streamed, s_opt = twins(14, 3, param_offload=True)
    from tiny_gpt import batch

    train(resident, r_opt, 2)
    train(streamed, s_opt, 2)
    x, _ = batch(2, device=DEVICE)
    outputs = []
    for model, opt in ((resident, r_opt), (streamed, s_opt)):
        model(x).float().pow(2).mean().backward()
        with torch.no_grad():
            between = model(x)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            after = model(x)
        assert torch.equal(between, after)
        outputs.append(after)
    assert torch.equal(outputs[0], outputs[1])


def test_param_offload_options_are_checked(daemon_socket):
    with pytest.raises(ValueError, match=r"param_offload=\[9\] names blocks outside 0..1"):
        trainstream.wrap(TinyGPT(), device=DEVICE, param_offload=[9])
    with pytest.raises(ValueError, match="prefetch_depth=0 must be >= 1"):
        trainstream.wrap(TinyGPT(), device=DEVICE, param_offload=True, prefetch_depth=0)
    model, _ = trainstream.wrap(TinyGPT(), device=DEVICE, param_offload=True, prefetch_depth=2)
    events = [e for e in trainstream.memory_report(model)["events"]
              if e["kind"] == "client.wrap.param_offload"]
    assert len(events) == 1 and "2 of 2 blocks stream their weights" in events[0]["message"]
    assert "prefetch depth 2" in events[0]["message"]
    trainstream.unwrap(model)
    # After unwrap every weight has memory of its own again.
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
               for p in model.parameters())


@pytest.mark.parametrize("page_weights", [False, True])
def test_paged_activations_train_bit_identical_to_resident(daemon_socket, page_weights):
    resident, r_opt, streamed, s_opt = twins(4, 4, activation_offload=True,
                                             param_offload=page_weights, min_offload_bytes=0)
    pager = streamed._trainstream_session.pager
    assert pager.activation_policy() == ["offload"] * 3 + ["keep"]
    assert train(resident, r_opt, 5) == train(streamed, s_opt, 5)
    assert pager.bytes_offloaded > 0
    report = trainstream.memory_report(streamed)
    assert report["activations"]["offloaded_bytes"] == pager.bytes_offloaded
    # In the daemon's memory, reused step after step: one 64 MiB chunk for five steps.
    assert report["activations"]["host_bytes"] == 64 << 20
    assert report["pinned_by_tag"].get("activations", 0) > 0
    kinds = [e["kind"] for e in report["events"]]
    assert "client.wrap.activation_offload" in kinds
    assert ("client.wrap.param_offload" in kinds) == page_weights
    # The CPU time of trainstream's own hooks, by hook: one gradient hook call per trained
    # tensor and step, a pack per saved tensor of the three paging blocks.
    hooks = report["hooks"]["per_hook"]
    trained = sum(p.requires_grad for p in streamed.parameters())
    assert hooks["optimizer.gradient_out"]["calls"] == 5 * trained
    assert hooks["paging.pack"]["calls"] >= 5 * 3 and hooks["paging.unpack"]["calls"] > 0
    assert all(h["ms"] > 0 for h in hooks.values() if h["calls"])
    assert report["hooks"]["ms_per_step"] == pytest.approx(
        sum(h["ms_per_step"] for h in hooks.values()), abs=0.01)
    for a, b in zip(weights(resident), weights(streamed)):
        assert torch.equal(a, b)
    assert not pager.hooks  # unwrap took the paging hooks away


def _saved_storage_bytes(block, x) -> int:
    """The bytes of the distinct storages ``block``'s forward on ``x`` saves for backward, its
    weights left out: what paging its activations has to move off the device to free them."""
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        # (attention's random-number offsets live on the CPU: nothing to page)
        if storage.data_ptr() not in weights and t.device == x.device:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(seen.values())


def test_views_of_one_storage_are_paged_once_and_whole(daemon_socket):
    """Attention saves q, k and v, permuted views of one fused projection's output (as Phi-3's
    qkv_proj and gate_up_proj make them): paging them pages that storage, once, so that it
    leaves the device; views kept as they were held the whole output in VRAM for every paging
    block (the GPU model matrix's Phi-3 case ran out of memory on that, 2026-12-02)."""
    torch.manual_seed(6)
    model = TinyGPT(layers=4).to(DEVICE)
    reference = copy.deepcopy(model)
    x, _ = tiny_gpt_batch(0, device=DEVICE)
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0].detach()))
             for b in reference.blocks]
    with torch.no_grad():
        reference(x)
    for h in hooks:
        h.remove()
    expected = sum(_saved_storage_bytes(reference.blocks[b], inputs[b].requires_grad_())
                   for b in range(3))
    resident, r_opt = trainstream.wrap(reference, offload=True, device=DEVICE, lr=3e-3)
    paged, p_opt = trainstream.wrap(model, offload=True, device=DEVICE, lr=3e-3,
                                    activation_offload=True, recompute=False,
                                    min_offload_bytes=0)
    pager = paged._trainstream_session.pager
    assert pager.activation_policy() == ["offload"] * 3 + ["keep"]
    assert train(resident, r_opt, 1) == train(paged, p_opt, 1)
    assert pager.bytes_offloaded == expected
    # One host copy of the fused projection's output, a view of it for each of q, k and v.
    qkv_bytes = x.numel() * 3 * model.blocks[0].attn.qkv.in_features * 4
    assert sum(item.host.nbytes == qkv_bytes for item in pager.activations.saved[0]) == 1
    assert train(resident, r_opt, 3, start=1) == train(paged, p_opt, 3, start=1)
    for a, b in zip(weights(resident), weights(paged)):
        assert torch.equal(a, b)


def test_paged_storages_come_back_for_a_second_backward():
    """retain_graph=True: the first backward frees each paged storage with the last of its
    views; the second brings every one back from its host copy, and the gradients (summed over
    both) are the unpaged model's exactly."""
    from trainstream.memory.pager import BlockPager

    torch.manual_seed(8)
    reference = TinyGPT(layers=3)
    model = copy.deepcopy(reference)
    pager = BlockPager(model.blocks, [], host_copy=lambda p: p, activations=[0, 1],
                       min_offload_bytes=0, device="cpu")
    x, y = tiny_gpt_batch(0)
    for m in (reference, model):
        loss = tiny_gpt_loss(m, x, y)
        loss.backward(retain_graph=True)
        loss.backward()
    assert pager.bytes_offloaded > 0
    assert all(item.device is None and item.views >= 1 for b in (0, 1)
               for item in pager.activations.saved[b])
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_offload_choices_are_checked(daemon_socket):
    with pytest.raises(ValueError, match=r"activation_offload=\[1\] is not one of"):
        trainstream.wrap(TinyGPT(), device=DEVICE, activation_offload=[1])
    with pytest.raises(ValueError, match="param_offload=1 is not one of"):
        trainstream.wrap(TinyGPT(), device=DEVICE, param_offload=1)


@pytest.mark.parametrize("paged", [False, True])
def test_load_state_dict_reaches_the_daemons_weights(daemon_socket, paged):
    # Loading a checkpoint into a wrapped model must move what the next update starts from (the
    # daemon's master weights), and for paged blocks the host copies their fetches read.
    torch.manual_seed(5)
    model, opt = trainstream.wrap(TinyGPT(layers=3).to(DEVICE), offload=True, device=DEVICE,
                                  param_offload=paged, lr=3e-3)
    train(model, opt, 2)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(model, opt, 3, start=2)
    model.load_state_dict(saved)
    for i, (name, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad):
        assert torch.equal(opt.host.master(i).cpu(), saved[name].cpu().float()), name
    assert all(torch.equal(v.cpu(), saved[k].cpu()) for k, v in model.state_dict().items())
    train(model, opt, 1, start=5)  # and training goes on from there
    trainstream.unwrap(model)


def test_recomputed_blocks_train_bit_identical_and_run_forward_twice(daemon_socket):
    resident, r_opt, again, a_opt = twins(6, 3, recompute=[0, 1])
    calls = []
    again.blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    assert train(resident, r_opt, 4) == train(again, a_opt, 4)
    assert len(calls) == 2 * 4  # forward, and again in each backward
    report = trainstream.memory_report(again)
    assert report["activations"]["policy"] == ["recompute", "recompute", "keep"]
    for a, b in zip(weights(resident), weights(again)):
        assert torch.equal(a, b)
    assert "forward" not in again.blocks[0].__dict__  # unwrap restored the block
    with pytest.raises(ValueError, match=r"blocks \[1\] are both paged and recomputed"):
        trainstream.wrap(TinyGPT(), device=DEVICE, param_offload=[1], recompute=[1])


class _AdaptedBlock(torch.nn.Module):
    """A frozen layer with a trained low-rank adapter beside it; ``gate`` (a keyword tensor)
    scales the adapter when given."""

    def __init__(self, dim: int):
        super().__init__()
        self.base = torch.nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.down = torch.nn.Linear(dim, 4, bias=False)
        self.up = torch.nn.Linear(4, dim, bias=False)

    def forward(self, x, gate=None):
        adapter = self.up(self.down(x))
        return torch.tanh(self.base(x) + (adapter if gate is None else adapter * gate))


class _Adapted(torch.nn.Module):
    """A frozen embedding, then adapted blocks: no input of the first block needs a gradient.
    With ``gated``, a trained gate outside the blocks reaches each as a keyword argument."""

    def __init__(self, gated: bool, layers: int = 3, dim: int = 32, vocab: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.embed.requires_grad_(False)
        self.blocks = torch.nn.ModuleList(_AdaptedBlock(dim) for _ in range(layers))
        self.gate = torch.nn.Parameter(torch.ones(dim)) if gated else None
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, gate=self.gate) if self.gate is not None else block(x)
        return self.head(x)


@pytest.mark.parametrize("gated", [False, True])
def test_recompute_trains_adapters_after_frozen_layers_and_keyword_tensors(daemon_socket, gated):
    """The first block's input needs no gradient (a frozen embedding) yet its adapter trains;
    a trained tensor passed by keyword gets its gradient through every recomputed block."""
    torch.manual_seed(9)
    model = _Adapted(gated).to(DEVICE)
    other = copy.deepcopy(model)
    common = dict(offload=True, device=DEVICE, lr=3e-3, param_offload=False,
                  activation_offload=False)
    kept, k_opt = trainstream.wrap(model, blocks=list(model.blocks), recompute=False, **common)
    again, a_opt = trainstream.wrap(other, blocks=list(other.blocks), recompute=[0, 1, 2],
                                    **common)
    first_adapter = again.blocks[0].up.weight.detach().clone()
    assert train(kept, k_opt, 3) == train(again, a_opt, 3)
    for a, b in zip(weights(kept), weights(again)):
        assert torch.equal(a, b)
    assert not torch.equal(again.blocks[0].up.weight.detach(), first_adapter)
    if gated:
        assert not torch.equal(again.gate.detach(), torch.ones_like(again.gate))


def test_recompute_replays_dropout_bit_identically(daemon_socket):
    """A recomputed block draws the same dropout mask again in backward, and the random
    numbers after it are those of a run without recompute."""
    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.drop = torch.nn.Dropout(0.3)

        def forward(self, x):
            return torch.tanh(self.drop(self.linear(x)))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Dropped() for _ in range(3))
            self.head = torch.nn.Linear(16, 1)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Stack().to(DEVICE)
    other = copy.deepcopy(model)
    common = dict(offload=True, device=DEVICE, lr=1e-2, param_offload=False,
                  activation_offload=False)
    kept, k_opt = trainstream.wrap(model, blocks=list(model.blocks), recompute=False, **common)
    again, a_opt = trainstream.wrap(other, blocks=list(other.blocks), recompute=[0, 1, 2],
                                    **common)

    def run(m, opt):
        torch.manual_seed(5)
        losses = []
        for _ in range(4):
            loss = m(torch.randn(8, 16, device=DEVICE)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert run(kept, k_opt) == run(again, a_opt)
    for a, b in zip(weights(kept), weights(again)):
        assert torch.equal(a, b)


def test_gradients_through_a_recomputed_block_come_from_backward(daemon_socket):
    """torch.autograd.grad through a recomputed block is refused by torch, naming .grad() (the
    optimizer takes gradients from backward() in any case); backward() gets them."""
    torch.manual_seed(10)
    model, _ = trainstream.wrap(_Adapted(False).to(DEVICE), offload=True, device=DEVICE,
                                recompute=[1], param_offload=False, activation_offload=False)
    hidden = model.embed(torch.randint(0, 128, (2, 8), device=DEVICE)).detach()
    hidden.requires_grad_(True)
    loss = model.blocks[1](hidden).float().pow(2).mean()
    with pytest.raises(RuntimeError, match=r"\.grad\(\)"):
        torch.autograd.grad(loss, [hidden])
    loss = model.blocks[1](hidden).float().pow(2).mean()
    loss.backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    trainstream.unwrap(model)


def test_activations_stay_on_the_device_when_the_daemon_has_no_room(start_daemon, monkeypatch):
    d = start_daemon("--memory_budget=160M")  # two jobs of one 64 MiB segment each, no more
    monkeypatch.setenv("TRAINSTREAM_SOCKET", d.socket)
    resident, r_opt, streamed, s_opt = twins(7, 3, dict(check_memory=False), check_memory=False,
                                             activation_offload=True, min_offload_bytes=0)
    assert train(resident, r_opt, 2) == train(streamed, s_opt, 2)
    report = trainstream.memory_report(streamed)["activations"]
    assert report["host_bytes"] == 0 and "budget" in report["host_refused"]
    trainstream.unwrap(streamed)
    trainstream.unwrap(resident)


@pytest.mark.parametrize("host_arena", [False, 256 << 10])
def test_host_arena_private_or_capped(daemon_socket, host_arena):
    resident, r_opt, paged, p_opt = twins(
        8, 3, dict(activation_offload=False, recompute=False), activation_offload=True,
        recompute=False, min_offload_bytes=0, host_arena=host_arena, param_offload=[1])
    assert train(resident, r_opt, 3) == train(paged, p_opt, 3)
    report = trainstream.memory_report(paged)
    activations = report["activations"]
    assert activations["offloaded_bytes"] > 0
    if host_arena is False:  # private pinned memory: nothing of it in the daemon
        assert activations["host_bytes"] == 0 and "activations" not in report["pinned_by_tag"]
    else:  # reserved up front, never more; what did not fit stayed on the device
        assert activations["host_bytes"] == host_arena
        assert "host_arena" in activations["host_refused"]
    pcie = report["pcie"]
    pager = paged._trainstream_session.pager
    assert pcie["steps"] == 3
    assert pcie["to_host_bytes"] >= pager.bytes_offloaded
    assert pcie["to_device_bytes"] >= pager.bytes_fetched + pager.bytes_offloaded
    for a, b in zip(weights(resident), weights(paged)):
        assert torch.equal(a, b)


def test_blocks_the_model_never_calls_are_refused(daemon_socket):
    # Lists of a layer's parts are iterated, not called: no hook around them would ever run.
    model = TinyGPT()
    parts = torch.nn.ModuleList(torch.nn.ModuleList([b.attn, b.mlp]) for b in model.blocks)
    with pytest.raises(ValueError, match=r"blocks\[0\] is a ModuleList without a forward of "
                                         r"its own"):
        trainstream.wrap(model, device=DEVICE, blocks=list(parts), param_offload=True)


def test_paging_options_are_checked(daemon_socket):
    for bad in (dict(host_arena="big"), dict(host_arena=-1), dict(max_inflight_bytes=0),
                dict(profile="yes")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            trainstream.wrap(TinyGPT(), device=DEVICE, **bad)


@pytest.mark.gpu
def test_copies_in_flight_are_capped_and_training_stays_exact(start_daemon, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: copies in flight are CUDA events")
    # Two jobs whose activations both page: four 64 MiB segments, within the per-user quota
    # (90% of the budget) of a 320 MiB daemon, not of the usual 256 MiB one.
    monkeypatch.setenv("TRAINSTREAM_SOCKET", start_daemon("--memory_budget=320M",
                                                          "--lease_ms=1500").socket)
    options = dict(activation_offload=True, recompute=False, min_offload_bytes=0)
    resident, r_opt, paged, p_opt = twins(9, 4, options, device="cuda",
                                          max_inflight_bytes=1, **options)

    def train_behind_a_busy_gpu(model, opt):
        # A long kernel queued before each block holds its copies back (the copy stream waits
        # for compute) while the CPU runs ahead, so copies pile up unless the cap makes each
        # offload wait for the one before it. Queued inside forward: the batch's own copy to
        # the device would wait out a kernel queued before it.
        hooks = [block.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(20_000_000))
                 for block in model.blocks]
        losses = train(model, opt, 3)
        for h in hooks:
            h.remove()
        return losses

    assert train_behind_a_busy_gpu(resident, r_opt) == train_behind_a_busy_gpu(paged, p_opt)
    uncapped = trainstream.memory_report(resident)["activations"]["inflight_waits"]
    capped = trainstream.memory_report(paged)["activations"]["inflight_waits"]
    assert uncapped == 0 and capped > 0, trainstream.memory_report(paged)["activations"]
    for a, b in zip(weights(resident), weights(paged)):
        assert torch.equal(a, b)


def test_a_dropped_wrap_is_freed_with_its_daemon_session(daemon_socket):
    """Hooks on parameters reach the optimizer and the pager weakly: dropping the model and the
    optimizer frees them (and their buffers) at once, and the daemon ends the job's session."""
    import gc
    import weakref

    torch.manual_seed(9)
    model = TinyGPT(layers=4).to(DEVICE)
    model, opt = trainstream.wrap(model, offload=True, device=DEVICE, lr=3e-3,
                                  param_offload=[1, 2])
    train(model, opt, 2)
    pager = model._trainstream_session.pager
    assert pager is not None and pager.paged == [1, 2]
    dropped = [weakref.ref(opt), weakref.ref(pager)]
    with trainstream.connect(daemon_socket, job_id="observer") as observer:
        def others():
            return [s for s in observer.sessions() if s["session_id"] != observer.session_id]
        assert len(others()) == 1
        del model, opt, pager
        gc.collect()
        assert [ref() for ref in dropped] == [None, None]
        deadline = time.monotonic() + 10
        while others() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert others() == []
