"""The fast kernels against the pure-torch reference ops."""

import pytest
import torch

from quantkit.kernels import cpu, reference


@pytest.mark.parametrize("group, sym", [(32, True), (64, False), (None, True), (None, False)])
def test_int4_packed_matmul_matches_reference(group, sym):
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 96, 256
    groups = 1 if group is None else in_f // group
    q = torch.randint(-8, 8, (out_f, in_f), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_f, groups, generator=gen) * 0.05 + 0.01
    zp = None if sym else torch.randint(-8, 8, (out_f, groups), generator=gen, dtype=torch.int8)
    x = torch.randn(5, in_f, generator=gen)
    packed, sz, g = cpu.repack_int4(q, scale, zp, group, torch.float32)
    want = reference.dequant_linear(x, q, scale, zp)
    got = cpu.int4_linear(x, packed, sz, g)
    assert (got - want).abs().max() < 2e-2 * want.abs().max()  # the op rounds activations to bf16


def test_int8_packed_matmul_matches_reference():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (64, 96), generator=gen, dtype=torch.int8)
    scale = torch.rand(64, 1, generator=gen) * 0.01
    x = torch.randn(3, 96, generator=gen)
    want = reference.dequant_linear(x, q, scale, None)
    assert torch.allclose(cpu.int8_linear(x, q, scale[:, 0]), want, rtol=1e-4, atol=1e-4)


def test_attention_kernels_match_reference():
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d = 6, 2, 16
    k, v = torch.randn(40, kv_heads, d, generator=gen), torch.randn(40, kv_heads, d, generator=gen)
    q = torch.randn(7, heads, d, generator=gen)
    assert torch.allclose(cpu.attention(q, k, v, 33), reference.attention(q, k, v, 33), atol=1e-5)
    lengths = torch.tensor([40, 3, 17])
    kb, vb = torch.randn(3, 40, kv_heads, d, generator=gen), torch.randn(3, 40, kv_heads, d, generator=gen)
    qd = torch.randn(3, heads, d, generator=gen)
    assert torch.allclose(cpu.decode_attention(qd, kb, vb, lengths), reference.decode_attention(qd, kb, vb, lengths), atol=1e-5)
    for i in range(3):  # one sequence alone takes its own (float32, unpadded) path
        one = (qd[i : i + 1], kb[i : i + 1], vb[i : i + 1], lengths[i : i + 1])
        assert torch.allclose(cpu.decode_attention(*one), reference.decode_attention(*one), atol=1e-5)
        bf16 = [t.bfloat16() for t in one[:3]]
        assert torch.allclose(cpu.decode_attention(*bf16, one[3]).float(), reference.decode_attention(*one), atol=3e-2)


def test_fp8_round_trip_saturates_and_keeps_precision():
    x = torch.tensor([0.0, 1.0, -3.5, 1000.0, -1e6])
    scale = torch.tensor([2.0])
    back = reference.dequantize_fp8(reference.quantize_fp8(x, scale), scale, torch.float32)
    assert back[:3].tolist() == [0.0, 1.0, -3.5] and back[3] == 896.0 and back[4] == -896.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fast_fp8_dequant_equals_reference_for_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[codes.float().isfinite()].view(-1, 1, 1).expand(-1, 3, 4)  # [254, kv_heads, d], subnormals included
    for scale in (torch.tensor([0.0371]), torch.tensor([[0.5], [3e-3], [7.0]])):  # per tensor, per KV head
        assert torch.equal(cpu.dequantize_fp8(codes, scale, dtype), reference.dequantize_fp8(codes, scale, dtype))


@pytest.mark.parametrize("sym", [True, False])
def test_int4_dequant_from_packed_words_equals_reference(sym):
    from quantkit.formats.pack import pack_int32

    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-8, 8, (48, 128), generator=gen, dtype=torch.int8)
    scale = (torch.rand(48, 4, generator=gen) * 0.05).to(torch.bfloat16)
    zp = None if sym else torch.randint(-8, 8, (48, 4), generator=gen, dtype=torch.int8)
    eye = torch.eye(128)
    for dtype in (torch.float32, torch.bfloat16):
        want = reference.dequant_linear(eye, q, scale, zp).T.to(dtype)
        assert torch.equal(cpu.dequant_int4(pack_int32(q, 4, dim=1), scale, zp, 128, dtype), want)
