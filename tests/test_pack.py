"""Packing is byte-exact against the reference implementation, compressed-tensors."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from quantkit.formats.pack import pack_int32, packed_width, unpack_int32


def random_ints(bits: int, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    return torch.randint(lo, -lo, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape", [(16, 64), (7, 40), (3, 13), (2, 1)])
def test_weights_pack_like_compressed_tensors(bits, shape, device):
    q = random_ints(bits, shape).to(device)
    ours = pack_int32(q, bits, dim=1)
    assert ours.dtype == torch.int32 and ours.shape == (shape[0], packed_width(shape[1], bits))
    assert torch.equal(ours.cpu(), pack_to_int32(q.cpu(), bits, packed_dim=1))


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("shape", [(64, 4), (40, 1), (13, 9)])
def test_zero_points_pack_along_output_dim_like_compressed_tensors(bits, shape, device):
    zp = random_ints(bits, shape, seed=1).to(device)
    ours = pack_int32(zp, bits, dim=0)
    assert ours.shape == (packed_width(shape[0], bits), shape[1])
    assert torch.equal(ours.cpu(), pack_to_int32(zp.cpu(), bits, packed_dim=0))


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_unpack_inverts_pack(bits, dim, device):
    q = random_ints(bits, (24, 37), seed=2).to(device)
    assert torch.equal(unpack_int32(pack_int32(q, bits, dim), bits, q.shape[dim], dim), q)


def test_element_zero_sits_in_the_lowest_bits():
    q = torch.tensor([[-8, -7, 0, 0, 0, 0, 0, 7]], dtype=torch.int8)  # +8 -> 0, 1, 8, 8, 8, 8, 8, 15
    word = int(pack_int32(q, 4)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 1, 8, 8, 8, 8, 8, 15]


def test_six_bits_straddle_words_as_a_dense_stream():
    q = torch.tensor([[-32, 31] + [0] * 14], dtype=torch.int8)  # +32 -> 0, 63, then 32s: 16 values in 3 words
    words = [int(w) & 0xFFFFFFFF for w in pack_int32(q, 6)[0]]
    stream = sum(w << (32 * i) for i, w in enumerate(words))
    assert len(words) == 3 and [(stream >> (6 * i)) & 63 for i in range(16)] == [0, 63] + [32] * 14


@pytest.mark.parametrize("bits", [1, 9])
def test_unsupported_width_is_refused(bits):
    with pytest.raises(ValueError):
        pack_int32(torch.zeros(2, 8, dtype=torch.int8), bits)


@pytest.mark.parametrize("shape", [(16, 8), (48, 64), (32, 576)])
def test_int4_panels_from_the_checkpoints_words_equal_packing_the_values(shape):
    from quantkit.formats.pack import int4_panels_from_words, pack_int4_panels

    q = random_ints(4, shape, seed=3)
    q[0, :8] = torch.tensor([-8, 7, -1, 0, 7, -8, 3, -4])  # extremes in every nibble, the sign bit set
    assert torch.equal(int4_panels_from_words(pack_int32(q, 4, dim=1)), pack_int4_panels(q))
