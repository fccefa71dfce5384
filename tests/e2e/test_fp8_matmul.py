# SPDX-License-Identifier: Apache-2.0
"""fp8 base weights multiplied on FP8 tensor cores (torch._scaled_mm) or dequantized: the
choice, its record, and how far the tensor-core path's results are from the dequantizing one.
torch runs _scaled_mm on the CPU too (2.15 and up), which the numeric tests use; the timed choice
needs a GPU with FP8 tensor cores."""

from __future__ import annotations

import pytest

import trainstream
from trainstream import fp8_matmul

torch = pytest.importorskip("torch")
nn = torch.nn


def _scaled_mm_runs_on_cpu() -> bool:
    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


cpu_scaled_mm = pytest.mark.skipif(not _scaled_mm_runs_on_cpu(),
                                   reason=f"torch {torch.__version__} has no _scaled_mm on the CPU")


def _model(seed: int = 3, out: int = 96, inp: int = 128) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(inp, out), nn.GELU(), nn.Linear(out, 64, bias=False))
    net.requires_grad_(False)
    return net.to(torch.bfloat16)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@cpu_scaled_mm
def test_tensor_cores_stay_within_the_bound_of_the_dequantized_weights():
    reference, tensor_cores = _model(), _model()
    trainstream.quantize_model(reference, "fp8", fp8_matmul=False)
    trainstream.quantize_model(tensor_cores, "fp8", fp8_matmul=True)
    x = torch.randn(40, 128, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = tensor_cores(x), reference(x_ref)
    # Inputs quantized to e4m3 per token and the weights requantized per row: e4m3's half step
    # is 1/16 of a value (RMS 1/(16 sqrt 3) = 3.6%) on each operand, about 5% together (4.5-4.7%
    # over eight seeds; the gradient 5.2-5.6%).
    assert 0.01 < _relative(y, y_ref) < 0.06  # and not the dequantizing path by another name
    y.float().square().sum().backward()
    y_ref.float().square().sum().backward()
    assert _relative(x.grad, x_ref.grad) < 0.08
    layer = tensor_cores[0]
    assert layer.matmul_choice == {"path": "scaled_mm", "why": "fp8_matmul=True"}
    assert reference[0].matmul_choice["path"] == "dequantize"
    # The row-scaled copy replaced the stored bytes: one byte a weight, a scale a row (kept as
    # integers, which no dtype cast touches).
    assert layer.data.numel() == 0 and layer.fp8_rows.dtype == torch.uint8
    assert layer.fp8_row_scales.dtype == torch.int32
    assert tuple(layer.fp8_rows.shape) == (96, 128)
    assert tuple(layer.fp8_row_scales.shape) == (1, 96)
    assert "matmul=scaled_mm" in repr(layer)
    # A cast of the whole model afterwards leaves the codes as they are and the layer working.
    before = tensor_cores(x.detach())
    tensor_cores.to(torch.float16)
    assert layer.fp8_rows.dtype == torch.uint8 and layer.fp8_row_scales.dtype == torch.int32
    tensor_cores.to(torch.bfloat16)
    assert torch.equal(tensor_cores(x.detach()), before)


def test_rowwise_requantization_error_is_bounded():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different size
    codes, scales = fp8_matmul.rowwise(w)
    back = fp8_matmul.rowwise_weight(codes, scales, torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value, relative, in every row.
    assert ((back - w).abs() <= w.abs() / 16 + scales.reshape(-1, 1) * 2 ** -9).all()
    q, s = fp8_matmul.quantize_tokens(w.to(torch.bfloat16))
    assert ((q.float() * s - w).abs() <= w.abs() / 16 + s * 2 ** -9 + w.abs() / 128).all()


def test_auto_dequantizes_where_there_are_no_fp8_tensor_cores_and_says_why():
    model = _model()
    trainstream.quantize_model(model, "fp8")  # fp8_matmul="auto"
    model(torch.randn(4, 128, dtype=torch.bfloat16))
    assert model[0].matmul_choice == {"path": "dequantize", "why": "not a CUDA device"}
    assert model[0].fp8_rows is None and model[0].data.numel() > 0
    other = _model()
    trainstream.quantize_model(other, "int8")  # not fp8: never asked
    other(torch.randn(4, 128, dtype=torch.bfloat16))
    assert other[0].matmul_choice is None


def test_a_bad_fp8_matmul_option_is_refused():
    with pytest.raises(trainstream.InvalidArgumentError, match="fp8_matmul"):
        trainstream.quantize_model(_model(), "fp8", fp8_matmul="always")


def _skip_without_fp8_tensor_cores() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = fp8_matmul.supported(torch.device("cuda"))
    if not ok:
        pytest.skip(why)


def _gpu_pair(fp8_matmul_option) -> tuple:
    """The same fp8 model on the GPU twice: always dequantized, and with ``fp8_matmul_option``."""
    reference, other = _model(out=1024, inp=2048).cuda(), _model(out=1024, inp=2048).cuda()
    trainstream.quantize_model(reference, "fp8", fp8_matmul=False)
    trainstream.quantize_model(other, "fp8", fp8_matmul=fp8_matmul_option)
    return reference, other


@pytest.mark.gpu
def test_auto_times_both_paths_on_a_gpu_with_fp8_tensor_cores():
    _skip_without_fp8_tensor_cores()
    reference, auto = _gpu_pair("auto")
    x = torch.randn(512, 2048, dtype=torch.bfloat16, device="cuda")
    notes = []
    auto[0].note = lambda kind, message, **numbers: notes.append((kind, numbers))
    y, y_ref = auto(x), reference(x)
    choice = auto[0].matmul_choice
    # The timing is told (wrap() routes it to the session's events).
    assert notes == [("base.fp8_matmul", {"scaled_mm_ms": choice["scaled_mm_ms"],
                                          "dequantize_ms": choice["dequantize_ms"]})]
    assert choice["why"] == "timed on this GPU"
    assert choice["scaled_mm_ms"] > 0 and choice["dequantize_ms"] > 0
    faster = "scaled_mm" if choice["scaled_mm_ms"] < choice["dequantize_ms"] else "dequantize"
    assert choice["path"] == faster
    assert _relative(y, y_ref) < 0.06
    # The same shape again (another layer, or this one in the next step) is not timed again.
    again = _model(out=1024, inp=2048).cuda()
    trainstream.quantize_model(again, "fp8")
    again(x)
    assert again[0].matmul_choice["scaled_mm_ms"] == choice["scaled_mm_ms"]


@pytest.mark.gpu
def test_tensor_cores_forward_and_backward_on_the_gpu_stay_within_the_bound():
    _skip_without_fp8_tensor_cores()
    reference, tensor_cores = _gpu_pair(True)
    x = torch.randn(512, 2048, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = tensor_cores(x), reference(x_ref)
    assert tensor_cores[0].matmul_choice["path"] == "scaled_mm"
    assert 0.01 < _relative(y, y_ref) < 0.06
    y.float().square().sum().backward()
    y_ref.float().square().sum().backward()
    assert _relative(x.grad, x_ref.grad) < 0.08
