"""MXFP8 against the OCP MX rules and torchao's RCEIL quantizer; emulated MXFP8 linear layers."""

import pytest
import torch

from shipyard.models.mxformat import BLOCK, dequantize, quantize
from shipyard.train.mx import MXEmbedding, MXLinear, convert_to_mxfp8, fake_quantize


def _x(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_scales_are_rounded_up_powers_of_two_and_elements_never_saturate():
    x = _x(16, 96, scale=5.0)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = 448.0 * 4  # amax exactly 448 · 2^2: scale 2^2, element 448
    mx = quantize(x)
    exps = mx.scales.view(torch.uint8).int() - 127
    amax = x.reshape(16, 3, 32).abs().amax(-1)
    nz = amax > 0
    assert (amax[nz] / torch.exp2(exps[nz].float()) <= 448).all()  # no element above E4M3's max
    assert (amax[nz] / torch.exp2(exps[nz].float() - 1) > 448).all()  # and the smallest such power of two
    assert exps[0, 0] == -127 and exps[1, 0] == 2 and float(mx.elements[1, 0].float()) == 448.0
    back = dequantize(mx)
    assert back.shape == x.shape and torch.equal(back[0, :32], torch.zeros(32))
    rel = ((back - x).abs() / x.abs().clamp(min=1e-3))[x.abs() > 0.05 * x.abs().max()]
    assert float(rel.max()) <= 2 ** -4 + 1e-6  # E4M3: 3 mantissa bits, round to nearest → ≤ 1/16 relative


def test_padding_and_payload_size():
    x = _x(3, 50)
    mx = quantize(x)
    assert mx.elements.shape == (3, 64) and mx.scales.shape == (3, 2)
    assert dequantize(mx).shape == (3, 50)
    w = _x(256, 512).bfloat16()
    assert quantize(w).nbytes / (w.numel() * 2) == pytest.approx(33 / 64)  # 0.516× bf16


def test_matches_torchao_rceil():
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    for seed, scale in ((0, 1.0), (1, 1e-3), (2, 300.0), (3, 1e-30)):
        x = _x(8, 128, seed=seed, scale=scale)
        scales, elements = mx_tensor.to_mx(x, torch.float8_e4m3fn, BLOCK, config.ScaleCalculationMode.RCEIL)
        ours = quantize(x)
        assert torch.equal(ours.scales.view(torch.uint8), scales.view(torch.uint8)), seed
        assert torch.equal(ours.elements.view(torch.uint8), elements.view(torch.uint8)), seed
        theirs = mx_tensor.to_dtype(elements, scales, torch.float8_e4m3fn, BLOCK, torch.float32)
        assert torch.equal(dequantize(ours), theirs)


def test_fake_quantize_along_a_dimension():
    x = _x(64, 40)
    assert torch.equal(fake_quantize(x, 0), dequantize(quantize(x.T.contiguous())).T)
    assert fake_quantize(x.bfloat16()).dtype == torch.bfloat16


def test_mx_linear_forward_and_backward_use_quantized_operands():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    mxl = MXLinear(64, 32)
    mxl.load_state_dict(lin.state_dict())
    x = _x(4, 8, 64, seed=5).requires_grad_(True)
    y = mxl(x)
    assert torch.equal(y, fake_quantize(x.detach()) @ fake_quantize(lin.weight.detach()).T + lin.bias.detach())
    ref = lin(x)
    assert float((y - ref).abs().max().detach()) < 0.1 * float(ref.abs().max().detach())
    g = _x(4, 8, 32, seed=6)
    y.backward(g)
    assert torch.equal(x.grad, fake_quantize(g) @ fake_quantize(lin.weight.detach(), 0))
    assert torch.equal(mxl.weight.grad, fake_quantize(g.reshape(-1, 32), 0).T @ fake_quantize(
        x.detach().reshape(-1, 64), 0))
    assert torch.allclose(mxl.bias.grad, g.sum((0, 1)))


def test_convert_swaps_linear_and_embedding_layers():
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Embedding(10, 64))
    model.add_module("up", torch.nn.Linear(64, 64))
    model.add_module("lm_head", torch.nn.Linear(64, 10))
    weight = model.up.weight
    assert convert_to_mxfp8(model, skip=("lm_head",), backend="emulated") == 2
    assert type(model.up) is MXLinear and type(model.embed) is MXEmbedding and type(model.lm_head) is torch.nn.Linear
    assert model.up.weight is weight  # the same parameter: optimizers and FSDP keep working
    ids = torch.tensor([[1, 7, 7]])
    out = model.embed(ids)
    assert torch.equal(out, fake_quantize(model.embed.weight.detach())[ids])
    out.sum().backward()  # straight-through: the gradient of a plain lookup
    assert torch.equal(model.embed.weight.grad[7], torch.full((64,), 2.0))
    with pytest.raises(ValueError, match="backend"):
        convert_to_mxfp8(model, backend="fp4")
