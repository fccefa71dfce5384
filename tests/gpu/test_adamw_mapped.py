# SPDX-License-Identifier: Apache-2.0
"""The zero-copy GPU AdamW kernel (kernels/cuda/adamw_mapped.cu), the ground optimizer_mode="gpu"
is to stand on: with the master weights and moments in page-locked host memory that it reads and
writes over PCIe, and with them in VRAM, it agrees bit for bit with the host path's scalar
reference (fp32 and bf16 moments, stochastic rounding included; fp32, bf16 and fp16
parameters), counts non-finite gradients, and is within an ulp-scale distance of
torch.optim.AdamW."""

import pytest

torch = pytest.importorskip("torch")

from trainstream import _trainstream  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _state(n: int, moment_dtype, param_dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    return {"master": master,
            "exp_avg": (0.1 * torch.randn(n, generator=g)).to(moment_dtype),
            "exp_avg_sq": torch.rand(n, generator=g).mul(0.01).to(moment_dtype),
            "grad": torch.randn(n, generator=g),
            "param": master.to(param_dtype)}


def _run(s: dict, step: int, seed: int, counter: torch.Tensor | None = None,
         decoupled: bool = True, skip_if: torch.Tensor | None = None) -> int:
    """One AdamW step over ``s`` (``decoupled=False``: Adam): the GPU kernel when ``counter``
    (its non-finite count, on the device) is given, else the host reference (which returns its
    count)."""
    on_gpu = counter is not None
    return _trainstream.adamw(
        on_gpu, s["master"].data_ptr(), s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr(),
        NAMES[s["exp_avg"].dtype], s["grad"].data_ptr(), NAMES[s["grad"].dtype],
        s["param"].data_ptr(), NAMES[s["param"].dtype], s["param"].numel(), HYPER["lr"],
        HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], step, 1.0, seed,
        counter.data_ptr() if on_gpu else 0,
        torch.cuda.current_stream().cuda_stream if on_gpu else 0, decoupled,
        skip_if.data_ptr() if skip_if is not None else 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte vectors", "one at a time"])
@pytest.mark.parametrize("state_in", ["pinned host memory", "VRAM"])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_agrees_bit_for_bit_with_the_host_reference(state_in, moment_dtype,
                                                               param_dtype, aligned):
    n = (1 << 20) + 37  # not a multiple of any block, nor of a vector's 4 or 8 elements
    # Misaligned: every tensor starts one element into its storage, so the moments are not on
    # a 16-byte boundary and the kernel takes them one at a time.
    skip = 0 if aligned else 1
    reference = _state(n + skip, moment_dtype, param_dtype, seed=1)
    ours = {k: v.clone() for k, v in reference.items()}
    for key in ("master", "exp_avg", "exp_avg_sq"):  # where optimizer_mode="gpu" keeps them
        ours[key] = ours[key].pin_memory() if state_in == "pinned host memory" else \
            ours[key].cuda()
    ours["grad"], ours["param"] = ours["grad"].cuda(), ours["param"].cuda()
    reference = {k: v[skip:] for k, v in reference.items()}
    ours = {k: v[skip:] for k, v in ours.items()}
    assert (ours["exp_avg"].data_ptr() % 16 == 0) == aligned
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    for step in (1, 2, 3):
        _run(reference, step, seed=step)
        _run(ours, step, seed=step, counter=counter)
    torch.cuda.synchronize()
    for key in ("master", "exp_avg", "exp_avg_sq", "param"):
        assert torch.equal(_bits(ours[key]), _bits(reference[key])), key
    assert int(counter.item()) == 0


def test_non_finite_gradients_are_counted_and_applied_as_torch_does():
    n = 4096
    s = _state(n, torch.float32, torch.float32, seed=2)
    s["grad"][[3, 100, 4000]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    reference = {k: v.clone() for k, v in s.items()}
    gpu = {k: v.cuda() for k, v in s.items()}
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    assert _run(reference, 1, 0) == 3
    _run(gpu, 1, 0, counter)
    torch.cuda.synchronize()
    assert int(counter.item()) == 3
    assert torch.equal(gpu["master"].cpu().isnan(), reference["master"].isnan())


def test_close_to_torch_adamw_and_refuses_pageable_memory():
    n = 1 << 16
    s = _state(n, torch.float32, torch.float32, seed=3)
    p = s["master"].clone().cuda().requires_grad_()
    opt = torch.optim.AdamW([p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                            eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": s["exp_avg"].clone().cuda(),
                    "exp_avg_sq": s["exp_avg_sq"].clone().cuda()}
    p.grad = s["grad"].clone().cuda()
    opt.step()
    gpu = {k: v.cuda() for k, v in s.items()}
    gpu["master"] = s["master"].clone().pin_memory()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    _run(gpu, 1, 0, counter)
    torch.cuda.synchronize()
    assert torch.allclose(gpu["param"], p.detach(), rtol=0, atol=1e-6)
    pageable = dict(gpu, master=s["master"].clone())  # ordinary host memory: not for the GPU
    with pytest.raises(Exception, match="pageable host memory"):
        _run(pageable, 2, 0, counter)


def test_adam_and_the_guard_flag():
    """decoupled=False (Adam: the decay folded into the gradient) agrees with the host's Adam;
    a set skip_if flag (nonfinite="guard" found a bad value earlier in the step) leaves every
    tensor as it was, and a clear one lets the update through."""
    n = 70000
    reference = _state(n, torch.bfloat16, torch.bfloat16, seed=4)
    ours = {k: v.clone() for k, v in reference.items()}
    for key in ("master", "exp_avg", "exp_avg_sq"):
        ours[key] = ours[key].pin_memory()
    ours["grad"], ours["param"] = ours["grad"].cuda(), ours["param"].cuda()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    flag = torch.ones((), dtype=torch.float32, device="cuda")
    before = {k: v.clone() for k, v in ours.items()}
    _run(ours, 1, seed=9, counter=counter, decoupled=False, skip_if=flag)
    torch.cuda.synchronize()
    for key in before:
        assert torch.equal(_bits(ours[key]), _bits(before[key])), key
    flag.zero_()
    _run(reference, 1, seed=9, decoupled=False)
    _run(ours, 1, seed=9, counter=counter, decoupled=False, skip_if=flag)
    torch.cuda.synchronize()
    for key in ("master", "exp_avg", "exp_avg_sq", "param"):
        assert torch.equal(_bits(ours[key]), _bits(reference[key])), key
