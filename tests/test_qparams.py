"""Quantization parameters and RTN against hand computations and compressed-tensors' own math."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from quantkit.config import Scheme
from quantkit.quant.qparams import dequantize, grouped, minmax_qparams, quantize
from quantkit.quant.rtn import rtn


def weight(out=32, inp=128, seed=0, device="cpu"):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)).to(device)


def test_symmetric_int4_scale_is_absmax_over_7_5(device):
    w = weight(device=device)
    scale, zp = minmax_qparams(w, Scheme(4, 64, True), torch.float32)
    absmax = w.reshape(32, 2, 64).abs().amax(-1)
    assert zp is None and torch.allclose(scale, absmax / 7.5)


def test_symmetric_int8_channel_scale_is_absmax_over_127_5(device):
    w = weight(device=device)
    scale, _ = minmax_qparams(w, Scheme(8, None, True), torch.float32)
    assert scale.shape == (32, 1) and torch.allclose(scale[:, 0], w.abs().amax(1) / 127.5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, None])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matches_compressed_tensors(bits, group_size, symmetric):
    w = weight(seed=3)
    scheme = Scheme(bits, group_size, symmetric)
    scale, zp = minmax_qparams(w, scheme, torch.float32)
    g = grouped(w, group_size)
    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=scheme.strategy, group_size=group_size)
    ct_scale, ct_zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    assert torch.allclose(scale, ct_scale, rtol=1e-6)
    if not symmetric:
        assert torch.equal(zp, ct_zp.to(torch.int8))
    q = quantize(w, scale, zp, scheme)
    ct_q = ct_quantize(w, ct_scale, ct_zp, args, dtype=torch.int8)
    assert (q != ct_q).float().mean() < 1e-3  # only ties at .5 may round differently


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_is_at_most_half_a_step(symmetric, device):
    w = weight(device=device)
    qw = rtn(w, Scheme(4, 32, symmetric), torch.float32)
    lo, hi = (-8, 7)
    assert int(qw.q.min()) >= lo and int(qw.q.max()) <= hi
    err = (dequantize(qw.q, qw.scale, qw.zero_point) - w).abs().reshape(32, 4, 32)
    # Symmetric: +absmax sits at 7.5 steps and clamps to 7, still half a step away.
    assert (err <= qw.scale.unsqueeze(-1) * 0.5001).all()


def test_zero_group_gets_no_nan():
    w = torch.zeros(4, 64)
    qw = rtn(w, Scheme(4, 32, False), torch.bfloat16)
    assert torch.isfinite(qw.scale.float()).all() and torch.equal(qw.dequantize(torch.float32), w)


def test_scales_round_to_dtype_before_rounding_weights():
    w = weight(seed=5)
    qw = rtn(w, Scheme(4, 64, True), torch.bfloat16)
    assert qw.scale.dtype == torch.bfloat16
    assert torch.equal(qw.q, quantize(w, qw.scale, None, Scheme(4, 64, True)))


def test_group_size_must_divide():
    with pytest.raises(ValueError):
        grouped(torch.zeros(2, 96), 64)
