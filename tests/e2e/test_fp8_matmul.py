# SPDX-License-Identifier: Apache-2.0
"""fp8 base weights multiplied on FP8 tensor cores (torch._scaled_mm) or dequantized: the
choice, its record, and how far the tensor-core path's results are from the dequantizing one.
torch runs _scaled_mm on the CPU too (2.15 and up), which the numeric tests use; the timed choice
needs a GPU with FP8 tensor cores."""

from __future__ import annotations

import pytest

import trainstream
from trainstream.frozen import fp8_matmul

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


def _with_outlier_channels(tokens: int, channels: int, planted: list, factor: float):
    """An input whose ``planted`` channels are ``factor`` times larger than the rest, as a few
    hidden dimensions of an LLM's activations are."""
    torch.manual_seed(11)
    x = torch.randn(tokens, channels)
    x[:, planted] *= factor
    return x.to(torch.bfloat16)


@cpu_scaled_mm
def test_outlier_channels_take_the_inputs_error_out_of_the_tensor_core_path():
    """With a scale per token, a channel far larger than the rest sets the scale, and the
    others' values sink into e4m3's coarse subnormals. outliers= multiplies the largest channels
    in bf16 instead, and the error falls back to what the weights' own rounding costs. The
    planted channels' weight columns are zero, so the comparison sees only what their scale
    does to the other channels. e4m3 spans 2^17 between its smallest and largest value: a
    channel 3,000 times the rest costs little (0.0331 against 0.0318), 30,000 times a lot."""
    reference, plain, split = _model(), _model(), _model()
    for net in (reference, plain, split):
        net[0].weight[:, [5, 77]] = 0
    trainstream.quantize_model(reference, "fp8", fp8_matmul=False)
    trainstream.quantize_model(plain, "fp8", fp8_matmul=True)
    trainstream.quantize_model(split, "fp8", fp8_matmul=True, outliers=0.02)
    x = _with_outlier_channels(64, 128, [5, 77], 30000.0)
    clean = _with_outlier_channels(64, 128, [], 1.0)
    exact = reference[0](x)
    error_plain, error_split = _relative(plain[0](x), exact), _relative(split[0](x), exact)
    usual = _relative(plain[0](clean), reference[0](clean))  # no outliers at all
    assert error_plain > 1.5 * usual, (error_plain, usual)
    assert error_split < 1.1 * usual, (error_split, usual)
    assert split[0].matmul_choice == {"path": "scaled_mm", "why": "fp8_matmul=True",
                                      "outliers": 0.02}
    # The input's gradient is the whole row-scaled weight's, split or not.
    xs, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    split[0](xs).float().sum().backward()
    plain[0](xp).float().sum().backward()
    assert torch.equal(xs.grad, xp.grad)


@cpu_scaled_mm
def test_channels_sent_the_slow_way_are_multiplied_exactly_and_chosen_per_call():
    """An input whose every nonzero channel is among the call's largest: the FP8 part gets
    zeros, and the result is the bf16 product with the row-scaled weight, whichever channels
    the call has."""
    layer = _model(inp=128)
    trainstream.quantize_model(layer, "fp8", fp8_matmul=True, outliers=0.05)  # 7 of 128
    first = layer[0]
    first(torch.randn(4, 128, dtype=torch.bfloat16))  # the requantized weight is made now
    weight = fp8_matmul.rowwise_weight(first.fp8_rows, first.fp8_row_scales, torch.bfloat16)
    for channels in ([3, 9, 100], [0, 64, 65, 66, 120, 121, 127]):
        x = torch.zeros(16, 128, dtype=torch.bfloat16)
        x[:, channels] = torch.randn(16, len(channels), dtype=torch.bfloat16)
        expected = x @ weight.t() + first.bias.to(torch.bfloat16)
        assert _relative(first(x), expected) < 1e-2


@cpu_scaled_mm
@pytest.mark.parametrize("outliers", [0, 0.05])
def test_an_input_with_other_strides_gives_what_its_contiguous_copy_gives(outliers):
    """_scaled_mm takes its first operand row-major only: an input laid out otherwise (a
    transposed view, as a caller's permute leaves it) is quantized into a row-major copy, split
    or not."""
    layer = _model()
    trainstream.quantize_model(layer, "fp8", fp8_matmul=True, outliers=outliers)
    first = layer[0]
    x = torch.randn(128, 24, dtype=torch.bfloat16).t()  # [24, 128], column-major
    assert not x.is_contiguous()
    # On CUDA a column-major operand is refused; the CPU's _scaled_mm takes either, so the
    # layout itself is what this checks.
    assert fp8_matmul.quantize_tokens(x)[0].is_contiguous()
    assert torch.equal(first(x), first(x.contiguous()))


def test_outliers_are_refused_where_they_would_be_ignored():
    with pytest.raises(trainstream.InvalidArgumentError, match="int8 weights quantize no input"):
        trainstream.quantize_model(_model(), "int8", outliers=0.01)
    with pytest.raises(trainstream.InvalidArgumentError, match="fp8_matmul=False never uses"):
        trainstream.quantize_model(_model(), "fp8", fp8_matmul=False, outliers=True)
    with pytest.raises(trainstream.InvalidArgumentError, match=r"fraction .* \(0, 0.1\]"):
        trainstream.quantize_model(_model(), "fp8", outliers=0.5)
    with pytest.raises(trainstream.InvalidArgumentError, match="needs quantize='fp8'"):
        trainstream.wrap(_model(), device="cpu", outliers=0.01)
    with pytest.raises(trainstream.FailedPreconditionError,
                       match=r"cpu cannot run \(not a CUDA device\)"):
        trainstream.wrap(_model(), device="cpu", quantize="fp8", outliers=0.01)
    # "auto" on a device without FP8 tensor cores: the layer can't split, and says why.
    model = _model()
    trainstream.quantize_model(model, "fp8", outliers="auto")
    assert model[0].outliers == 0.01
    with pytest.raises(trainstream.FailedPreconditionError,
                       match=r"outliers=0.01 .* cannot take that path \(not a CUDA device\)"):
        model(torch.randn(4, 128, dtype=torch.bfloat16))


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


@pytest.mark.gpu
def test_outliers_on_the_gpu_split_each_call_without_a_host_sync():
    _skip_without_fp8_tensor_cores()
    reference, split = _model(out=1024, inp=2048).cuda(), _model(out=1024, inp=2048).cuda()
    trainstream.quantize_model(reference, "fp8", fp8_matmul=False)
    trainstream.quantize_model(split, "fp8", fp8_matmul=True, outliers=0.01)
    x = torch.randn(512, 2048, dtype=torch.bfloat16, device="cuda")
    split(x)  # the first call requantizes the weight (once, with its own syncs)
    torch.cuda.set_sync_debug_mode("error")  # any host sync in the split raises
    try:
        y = split(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert split[0].matmul_choice["path"] == "scaled_mm"
    assert _relative(y, reference(x)) < 0.06
