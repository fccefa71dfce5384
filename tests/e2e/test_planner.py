# SPDX-License-Identifier: Apache-2.0
"""The memory plan on synthetic budgets, and finding a model's block stack."""

from __future__ import annotations

import os
import sys

import pytest

import trainstream
from trainstream import BlockFacts, MemoryPlanError, PlanInputs, plan_memory
from trainstream.memory.planner import fetch_bytes, staged_block_indices, spread_order

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from tiny_gpt import TinyGPT  # noqa: E402

GiB = 1 << 30


def inputs(vram, host, blocks=8, weight=1 * GiB, activation=2 * GiB, **kw):
    facts = tuple(BlockFacts(weight_bytes=weight, activation_bytes=activation,
                             input_bytes=activation // 16, trainable=weight // 4)
                  for _ in range(blocks))
    return PlanInputs(blocks=facts, other_weight_bytes=GiB // 2, other_trainable=GiB // 8,
                      working_bytes=GiB, vram_budget=vram, host_budget=host, **kw)


def test_everything_stays_when_it_fits():
    plan = plan_memory(inputs(vram=80 * GiB, host=200 * GiB))
    assert plan.paged_blocks == [] and set(plan.activation_policy) == {"keep"}
    assert plan.moment_dtype == "float32" and plan.pcie_bytes_per_step == 0
    assert "everything stays in VRAM" in plan.history[0]


def test_small_vram_pages_activations_before_weights():
    # 8.5 GiB of weights + 16 GiB of activations + 1 GiB working set, 16 GiB usable.
    plan = plan_memory(inputs(vram=16 * GiB, host=200 * GiB))
    assert plan.paged_blocks == []  # paging activations alone was enough
    assert plan.activation_policy[-1] == "keep"
    assert "offload" in plan.activation_policy and "recompute" not in plan.activation_policy
    assert plan.vram_bytes <= 16 * GiB
    assert plan.pcie_bytes_per_step == 2 * 2 * GiB * plan.activation_policy.count("offload")


def test_smaller_vram_also_streams_weights():
    plan = plan_memory(inputs(vram=8 * GiB, host=200 * GiB))
    # Spread over the stack, so resident blocks' compute hides each fetch.
    assert plan.paged_blocks == sorted(spread_order(8)[:len(plan.paged_blocks)])
    assert len(plan.paged_blocks) >= 2
    # Four of eight: every other block, not the first four.
    assert plan_memory(inputs(vram=12 * GiB, host=200 * GiB)).paged_blocks == [0, 2, 4, 6]
    assert plan.vram_bytes <= 8 * GiB
    assert any("streams its weights" in h for h in plan.history)


def test_small_host_memory_recomputes_instead_and_chooses_bf16_moments():
    # fp32 state: 2.125 Gi elements x (4 + 8 + 4) B = 34 GiB; bf16 moments: 25.5 GiB.
    plan = plan_memory(inputs(vram=16 * GiB, host=30 * GiB))
    assert plan.moment_dtype == "bfloat16"
    assert "recompute" in plan.activation_policy  # no host room left for activations
    assert any("moments in bf16" in h for h in plan.history)


def test_a_run_that_cannot_fit_is_refused_with_the_numbers():
    # With every block streaming: 0.5 GiB other weights + 2 one-block slots + the last block's
    # activations + one block's in flight + 1 GiB working set = 7.5 GiB.
    with pytest.raises(MemoryPlanError, match=r"needs 7\.50 GiB of VRAM even with 8 of 8 blocks"):
        plan_memory(inputs(vram=3 * GiB, host=200 * GiB))
    with pytest.raises(MemoryError, match="optimizer state needs .* host memory with bfloat16"):
        plan_memory(inputs(vram=80 * GiB, host=10 * GiB))


def test_user_choices_are_kept():
    plan = plan_memory(inputs(vram=80 * GiB, host=200 * GiB, param_offload=[0, 2],
                              activation_offload=True))
    assert plan.paged_blocks == [0, 2]
    assert plan.activation_policy == ["offload"] * 7 + ["keep"]


def test_page_or_recompute_follows_what_the_step_is_waiting_for():
    # 2 GiB of activations a block: 40 ms over a 50 GB/s link, against a 20 ms forward.
    link = dict(block_forward_s=0.020, link_bytes_per_s=50e9)
    # An idle link: the copies hide under compute, as many as the forward (8 blocks x 20 ms)
    # can hide: four of 43 ms stall it by 12 ms, less than a recompute's 20; a fifth would
    # stall it by 55 ms, and the rest recompute.
    idle = plan_memory(inputs(vram=16 * GiB, host=200 * GiB, **link))
    assert idle.activation_policy.count("offload") == 4
    assert idle.activation_policy[-1] == "keep" and "recompute" in idle.activation_policy
    assert any("172 of the forward's 160 ms" in line for line in idle.history)
    # The pages are spread over the stack, each with later blocks' compute to hide it.
    assert [i for i, p in enumerate(idle.activation_policy) if p == "offload"] == [0, 2, 4, 6]
    # A link busy for 1.2 s with the optimizer's traffic: each page would lengthen the step,
    # a recompute hides under the transfers.
    busy = plan_memory(inputs(vram=16 * GiB, host=200 * GiB, transfer_bytes=(60e9, 60e9),
                              **link))
    assert "offload" not in busy.activation_policy and "recompute" in busy.activation_policy
    assert any("the link already busy" in line for line in busy.history)


def test_a_frozen_base_leaves_more_compute_free_for_recomputing():
    # A link busy 400 ms a step. Fully trained, 8 blocks of 20 ms forwards compute 480 ms and
    # paging hides under it; under adapters (the base frozen: no weight gradients) they compute
    # 320 ms, and one more forward costs the step less than a page.
    link = dict(block_forward_s=0.020, link_bytes_per_s=50e9, transfer_bytes=(20e9, 20e9))
    trained = plan_memory(inputs(vram=16 * GiB, host=200 * GiB, **link))
    facts = tuple(BlockFacts(weight_bytes=GiB, activation_bytes=2 * GiB,
                             input_bytes=GiB // 8, trained_share=0.0) for _ in range(8))
    frozen = plan_memory(PlanInputs(blocks=facts, other_weight_bytes=GiB // 2,
                                    other_trainable=GiB // 8, working_bytes=GiB,
                                    vram_budget=16 * GiB, host_budget=200 * GiB, **link))
    assert trained.activation_policy[0] == "offload"
    assert frozen.activation_policy[0] == "recompute"
    assert frozen.activation_policy.count("recompute") > trained.activation_policy.count(
        "recompute")


def _host_bound(**kw):
    # A full fine-tune of 2.125 Gi elements whose host pass takes 1 s, against 8 blocks of
    # 20 ms forwards (480 ms of compute a step): the host is what the step waits for.
    return inputs(block_forward_s=0.020, link_bytes_per_s=50e9, host_update_s=1.0,
                  transfer_bytes=(8.5 * GiB, 8.5 * GiB), **kw)


def test_a_host_bound_step_keeps_the_first_blocks_optimizer_state_in_vram():
    everything_on_host = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB))
    plan = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state="auto"))
    assert everything_on_host.gpu_state_blocks == 0
    # The host's pass starts after the forward (160 ms) and covers every element: 1.16 s.
    assert everything_on_host.step_s["host"] == pytest.approx(1.16)
    assert plan.gpu_state_blocks >= 3 and plan.paged_blocks == []
    # The outside parameters (0.125 Gi elements) and the blocks' (0.25 Gi each) go with them.
    assert plan.gpu_state_elements == GiB // 8 + plan.gpu_state_blocks * GiB // 4
    assert plan.vram_bytes <= 40 * GiB
    assert max(plan.step_s.values()) < 0.75 * max(everything_on_host.step_s.values())
    # Their gradients (4 bytes an element) no longer cross PCIe; paged activations still do.
    paged = 2 * GiB * plan.activation_policy.count("offload")
    assert plan.step_s["d2h"] == pytest.approx(
        (8.5 * GiB - 4 * plan.gpu_state_elements + paged) / 50e9)
    assert "kept in VRAM and updated there at step()" in plan.history[0]


def test_a_pass_after_backward_keeps_more_state_in_vram_than_one_that_overlaps_it():
    # A host pass of 0.1 s hides under a 480 ms step while it overlaps backward: no state moves.
    # When clipping makes it wait for backward's last gradient, it adds to the step instead, and
    # every block whose state VRAM can hold (without streaming weights) shortens the step.
    quick = dict(vram=40 * GiB, host=200 * GiB, block_forward_s=0.020, link_bytes_per_s=50e9,
                 host_update_s=0.1, gpu_state="auto")
    overlapping = plan_memory(inputs(**quick))
    after = plan_memory(inputs(host_after_backward=True, **quick))
    assert overlapping.gpu_state_blocks == 0
    assert after.gpu_state_blocks >= 3 and after.paged_blocks == []
    # The pass starts when the compute ends, and covers what stays on the host.
    compute = after.step_s["compute"]
    trainable = GiB // 8 + 8 * GiB // 4
    assert after.step_s["host"] == pytest.approx(
        compute + 0.1 * (trainable - after.gpu_state_elements) / trainable)
    assert max(after.step_s.values()) < max(
        plan_memory(inputs(host_after_backward=True, **{**quick, "gpu_state": 0})).step_s.values())


def test_optimizer_state_stays_on_the_host_when_the_host_keeps_up_or_was_not_measured():
    quick = plan_memory(inputs(vram=40 * GiB, host=200 * GiB, block_forward_s=0.020,
                               link_bytes_per_s=50e9, host_update_s=0.1, gpu_state="auto"))
    unmeasured = plan_memory(inputs(vram=40 * GiB, host=200 * GiB, block_forward_s=0.020,
                                    link_bytes_per_s=50e9, gpu_state="auto"))
    assert quick.gpu_state_blocks == 0 and unmeasured.gpu_state_blocks == 0
    assert not any("VRAM and updated there" in line for line in quick.history)


def test_vram_bounds_the_optimizer_state_it_takes_and_weights_never_stream_for_it():
    # 20 GiB usable: the weights (8.5 GiB), the working set (1), the last block's activations
    # and one block's in flight (2 + 2) leave 6.5 GiB: the outside parameters' state (1.5 GiB)
    # and one block's (3 GiB) fit, a second block's would not, and no weights stream for it.
    roomy = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state="auto"))
    tight = plan_memory(_host_bound(vram=20 * GiB, host=200 * GiB, gpu_state="auto"))
    assert tight.gpu_state_blocks == 1 < roomy.gpu_state_blocks
    assert tight.paged_blocks == [] and tight.vram_bytes <= 20 * GiB


def test_asked_gpu_state_is_kept_or_refused_with_the_numbers():
    two = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state=2))
    assert two.gpu_state_blocks == 2
    assert two.gpu_state_elements == GiB // 8 + 2 * GiB // 4
    none = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state=0))
    # Both keep every block's activations; the state takes 12 bytes an element of VRAM more:
    # 7.5 GiB for 0.625 Gi elements.
    assert set(two.activation_policy) == set(none.activation_policy) == {"keep"}
    assert two.vram_bytes - none.vram_bytes == 12 * two.gpu_state_elements == 7.5 * GiB
    with pytest.raises(MemoryPlanError, match=r"AdamW state of 8 blocks in VRAM \(25\.50 GiB"):
        plan_memory(_host_bound(vram=20 * GiB, host=200 * GiB, gpu_state=8))


def test_state_vram_cannot_hold_is_staged_through_the_gpu_while_the_host_binds():
    # 20 GiB holds the state of one block (see above); the host's pass over the rest still
    # binds the step, so the blocks after it are updated on the GPU with their moments staged
    # from host memory: 8 bytes an element over PCIe each way instead of 4, no host pass.
    held = plan_memory(_host_bound(vram=20 * GiB, host=200 * GiB, gpu_state="auto"))
    plan = plan_memory(_host_bound(vram=20 * GiB, host=200 * GiB, gpu_state="auto",
                                   staged_state="auto"))
    host_side = max(held.step_s["host"], held.step_s["host_memory"])
    assert held.staged_blocks == 0 and host_side == max(held.step_s.values())
    assert plan.staged_blocks >= 1 and plan.paged_blocks == []
    k, staged = plan.gpu_state_blocks, plan.staged_blocks
    assert plan.staged_elements == staged * GiB // 4
    assert max(plan.step_s.values()) < 0.8 * max(held.step_s.values())
    paged = 2 * GiB * plan.activation_policy.count("offload")
    assert plan.step_s["h2d"] == pytest.approx(
        (8.5 * GiB - 4 * (plan.gpu_state_elements + plan.staged_elements)
         + 8 * plan.staged_elements + paged) / 50e9)
    # The host's pass covers only what neither takes: after the forward (160 ms, or its
    # paged activations' copies where longer), its share of the 1 s pass.
    rest = 1 - (plan.gpu_state_elements + plan.staged_elements) / (2.125 * GiB)
    assert plan.step_s["host"] == pytest.approx(max(0.16, paged / 50e9) + rest)
    # The host's memory serves that pass and the staged moments' copies (16 bytes an element
    # against the pass's 28).
    per_element = 1.0 / (2.125 * GiB)
    assert plan.step_s["host_memory"] == pytest.approx(per_element * (
        rest * 2.125 * GiB + plan.staged_elements * 16 / 28))
    # It stops where staging one more block would no longer shorten the step.
    assert k + staged < 8
    more = plan_memory(_host_bound(vram=20 * GiB, host=200 * GiB, gpu_state=k,
                                   staged_state=staged + 1))
    assert max(more.step_s.values()) >= max(plan.step_s.values())
    said = [line for line in plan.history if f"{staged} of blocks {k}-7" in line]
    assert len(said) == 1 and "moments staged from host memory" in said[0]
    # The staging slots may take the room one block's VRAM-held state had (k 1 or 0).
    assert k <= held.gpu_state_blocks
    assert (k > 0) == any("kept in VRAM and updated there" in line for line in plan.history)


def test_staged_blocks_are_spread_over_the_rest_of_the_stack_last_one_first():
    assert staged_block_indices(44, 4, 1) == [43]  # backward reaches it first
    assert staged_block_indices(44, 4, 4) == [13, 23, 33, 43]
    assert staged_block_indices(8, 2, 6) == [2, 3, 4, 5, 6, 7]
    assert staged_block_indices(8, 2, 0) == []
    spread = staged_block_indices(44, 4, 24)
    assert len(set(spread)) == 24 and min(spread) >= 4 and max(spread) == 43


def test_nothing_is_staged_when_the_host_keeps_up_or_was_not_measured():
    quick = plan_memory(inputs(vram=20 * GiB, host=200 * GiB, block_forward_s=0.020,
                               link_bytes_per_s=50e9, host_update_s=0.1, gpu_state="auto",
                               staged_state="auto"))
    unmeasured = plan_memory(inputs(vram=20 * GiB, host=200 * GiB, block_forward_s=0.020,
                                    link_bytes_per_s=50e9, gpu_state="auto",
                                    staged_state="auto"))
    assert quick.staged_blocks == 0 and unmeasured.staged_blocks == 0


def test_asked_staging_takes_its_slots_and_the_blocks_after_the_vram_held_ones():
    two = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state=1, staged_state=2))
    none = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state=1))
    assert (two.gpu_state_blocks, two.staged_blocks) == (1, 2)
    assert two.staged_elements == 2 * GiB // 4
    assert two.vram_bytes - none.vram_bytes == 768 << 20  # the staging slots only
    assert two.step_s["d2h"] - none.step_s["d2h"] == pytest.approx(
        4 * two.staged_elements / 50e9)


def test_asked_staging_makes_room_or_says_why_not():
    # "auto" VRAM-held state gives blocks back for the slots and the staged ones; an asked-for
    # count that cannot fit, or staged blocks the user streams, are refused with the numbers.
    auto = plan_memory(_host_bound(vram=20 * GiB, host=200 * GiB, gpu_state="auto",
                                   staged_state=7))
    assert auto.staged_blocks == 7 and auto.gpu_state_blocks <= 1
    with pytest.raises(MemoryPlanError, match="staged_state_blocks=8 with gpu_state_blocks=1"):
        plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, gpu_state=1, staged_state=8))
    with pytest.raises(MemoryPlanError, match=r"blocks \[7\] would stage their moments"):
        plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, staged_state=1,
                                param_offload=[7]))
    # With gradient accumulation a staged block's gradient waits in VRAM for the last
    # micro-step: 4 bytes an element more.
    once = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, staged_state=2))
    accumulated = plan_memory(_host_bound(vram=40 * GiB, host=200 * GiB, staged_state=2,
                                          staged_grad_bytes=4))
    assert accumulated.vram_bytes - once.vram_bytes == 4 * once.staged_elements


def test_find_blocks_returns_the_repeated_stack():
    model = TinyGPT(layers=3)
    assert trainstream.find_blocks(model) == list(model.blocks)
    from gpt import GPT, PRESETS

    gpt = GPT(PRESETS["tiny"])
    assert trainstream.find_blocks(gpt) == list(gpt.blocks)
    assert trainstream.find_blocks(torch.nn.Linear(4, 4)) == []
    # A stack of ModuleLists holding each layer's parts (iterated by the model, never called)
    # is no block stack: hooks around its entries would never run.
    parts = torch.nn.ModuleList(torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])
                                for _ in range(3))
    assert trainstream.find_blocks(torch.nn.ModuleDict({"layers": parts})) == []


def test_profile_hardware_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    import trainstream.transport.hardware as hardware

    monkeypatch.setattr(hardware, "_CACHE", str(tmp_path))
    first = trainstream.profile_hardware(nbytes=8 << 20, repeats=2)
    assert first["cached"] is False and first["host_copy_gbps"] > 0
    assert (first["gpu"] is None) == (not torch.cuda.is_available())
    again = trainstream.profile_hardware(nbytes=8 << 20, repeats=2)
    assert again["cached"] is True and again["host_copy_gbps"] == first["host_copy_gbps"]
    assert trainstream.profile_hardware(refresh=True, nbytes=8 << 20, repeats=2)["cached"] is False


def test_profile_hardware_takes_trainstream_06s_signature(tmp_path, monkeypatch):
    import trainstream.transport.hardware as hardware

    monkeypatch.setattr(hardware, "_CACHE", str(tmp_path))
    profile = trainstream.profile_hardware(quick=True, repeats=2, nbytes=8 << 20)
    assert profile["cached"] is False
    # The seed exports the class its profile_hardware() returns (type hints, isinstance).
    assert isinstance(profile, trainstream.HardwareProfile)
    text = profile.summary()
    assert f"host memory copy: {profile['host_copy_gbps']} GB/s" in text
    assert ("no CUDA GPU" in text) == (not torch.cuda.is_available())
    assert trainstream.profile_hardware()["cached"] is True
    assert trainstream.profile_hardware(force=True, repeats=2, nbytes=8 << 20)["cached"] is False


def test_profile_hardware_times_a_matmul_and_a_host_adamw_step(tmp_path, monkeypatch):
    """As TrainStream 0.6's profile did: a matmul's throughput and a host AdamW step's (a torch
    CPU AdamW step, on ``threads`` threads), cached with the copies; a profile cached before
    they were measured gets them; threads and quick are checked."""
    import json

    import trainstream.transport.hardware as hardware

    monkeypatch.setattr(hardware, "_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    profile = trainstream.profile_hardware(threads=1, repeats=2, nbytes=8 << 20)
    assert torch.get_num_threads() == threads  # set back after the step
    matmul, adamw = profile["matmul"], profile["host_adamw"]
    assert matmul["tflops"] > 0 and matmul["ms"] > 0
    assert matmul["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert adamw["threads"] == 1 and adamw["elements"] == 1 << 20
    assert adamw["gelems_per_s"] > 0 and "torch.optim.AdamW" in adamw["how"]
    text = profile.summary()
    assert f"matmul: {matmul['tflops']} TFLOPS" in text and "host AdamW: " in text
    assert trainstream.profile_hardware(threads=1)["cached"] is True
    # Other threads: the AdamW step is timed again on them.
    assert trainstream.profile_hardware(threads=2, repeats=2)["host_adamw"]["threads"] == 2
    # A profile cached without these figures (an older one) has them measured.
    [path] = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    with open(path) as f:
        old = json.load(f)
    del old["matmul"], old["host_adamw"]
    with open(path, "w") as f:
        json.dump(old, f)
    again = trainstream.profile_hardware(repeats=2)
    assert again["cached"] is False and again["matmul"]["tflops"] > 0
    assert again["host_copy_gbps"] == old["host_copy_gbps"]
    for bad, message in ((dict(quick="yes"), "quick='yes' must be True or False"),
                         (dict(force=1), "force=1 must be True or False"),
                         (dict(threads=0), "threads=0 must be None or an integer >= 1"),
                         (dict(threads=True), "threads=True must be None")):
        with pytest.raises(trainstream.InvalidArgumentError, match=message):
            trainstream.profile_hardware(**bad)


def test_a_70b_nf4_base_streams_most_blocks_in_its_stored_format_under_24_gib():
    # Qwen2.5-72B in NF4 under a 24 GiB cap: 80 blocks of about 0.49 GiB as stored (a quarter
    # of bf16's 1.75 GiB), the bf16 embeddings and head outside (4.6 GiB), LoRA adapters the
    # only trained weights, 2048 tokens of activations. No plan keeps every block; the plan
    # streams enough of them, and its PCIe a step is their fetches as stored (plus the
    # activations it pages).
    stored, bf16 = int(0.49 * GiB), int(1.75 * GiB)
    facts = tuple(BlockFacts(weight_bytes=stored, activation_bytes=GiB // 4,
                             input_bytes=32 << 20, trained_share=0.01, trainable=2_700_000)
                  for _ in range(80))
    budget = 21 * GiB

    def plan(blocks):
        return plan_memory(PlanInputs(blocks=blocks, other_weight_bytes=int(4.6 * GiB),
                                      other_trainable=0, working_bytes=2 * GiB,
                                      vram_budget=budget, host_budget=100 * GiB))

    nf4 = plan(facts)
    assert 40 <= len(nf4.paged_blocks) < 80
    assert nf4.vram_bytes <= budget
    paged_activations = nf4.activation_policy.count("offload") * (GiB // 4)
    assert nf4.pcie_bytes_per_step == (fetch_bytes([stored] * len(nf4.paged_blocks), 1)
                                       + 2 * paged_activations)
    # The same stack as bf16 streams more blocks, four times the bytes each.
    as_bf16 = plan(tuple(BlockFacts(weight_bytes=bf16, activation_bytes=GiB // 4,
                                    input_bytes=32 << 20, trained_share=0.01,
                                    trainable=2_700_000) for _ in range(80)))
    assert len(as_bf16.paged_blocks) > len(nf4.paged_blocks)
    assert as_bf16.pcie_bytes_per_step > 3 * nf4.pcie_bytes_per_step
