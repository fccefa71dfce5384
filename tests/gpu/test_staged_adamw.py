# SPDX-License-Identifier: Apache-2.0
"""The staged AdamW pipeline (moments in pinned host memory, the update on the GPU) against
torch's fused AdamW, where its first slots come from memory that kernels still queued on the
compute stream are writing."""

import pytest

torch = pytest.importorskip("torch")

from trainstream.optim.staged_adamw import StagedAdamW  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]

HYPER = (1e-2, 0.9, 0.999, 1e-8, 0.01)  # lr, beta1, beta2, eps, weight_decay


def _torch_adamw(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    lr, beta1, beta2, eps, weight_decay = HYPER
    p = weight.clone().requires_grad_()
    opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps,
                            weight_decay=weight_decay, fused=True)
    p.grad = grad.clone()
    opt.step()
    return p.detach()


def test_the_first_slots_wait_for_kernels_still_writing_their_memory():
    """Backward frees memory while its kernels are still queued; the caching allocator hands it
    out again at once, on the same stream. The pipeline's first slots are such memory: its
    upload stream must not write the moments there before the compute stream's earlier work
    is done. Before the wait, the late kernel overwrote the moments just loaded and the update
    wrote NaN into the weights (a Qwen2.5-1.5B full fine-tune, from its second step)."""
    n = 1 << 20  # one slot's elements
    device = torch.device("cuda")
    torch.manual_seed(0)
    weight = torch.randn(n, device=device)
    grad = torch.randn(n, device=device)
    expected = _torch_adamw(weight, grad)
    exp_avg = torch.zeros(n, pin_memory=True)
    exp_avg_sq = torch.zeros(n, pin_memory=True)
    updated = weight.clone()
    staged = StagedAdamW(device, slot_elements=n, slots=1)
    staged.set_steps(0, n, 0)
    compute = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the block freed below is then the only one the slot can take
    busy = torch.empty(3 * n, dtype=torch.float32, device=device)
    where = busy.data_ptr()
    torch.cuda._sleep(300_000_000)  # about 0.15 s of the compute stream, then the write
    busy.fill_(float("nan"))
    del busy  # back in the pool now, its write still queued
    staged.add(0, updated, grad, exp_avg, exp_avg_sq, HYPER, compute)
    staged.flush(compute)
    assert staged._slots[0].data_ptr() == where, "the premise: the slot reuses that block"
    staged.join(compute)
    staged.synchronize()
    torch.cuda.synchronize()
    assert torch.isfinite(exp_avg_sq).all() and torch.isfinite(updated).all()
    torch.testing.assert_close(updated, expected, rtol=1e-6, atol=1e-7)
    assert staged.steps_of(0) == 1
