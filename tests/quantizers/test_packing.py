"""Bit packing: exact round trips for every width, exact sizes, fast path == bit-stream reference."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wushkv.quantizers import QuestQuantizer, dequantize, pack, packed_nbytes, unpack
from wushkv.quantizers.packing import _pack_bitstream, _unpack_bitstream

WIDTHS = [1, 2, 3, 4, 8]


def _codes(shape, bits, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, shape, generator=gen, dtype=torch.uint8)


@settings(max_examples=150, deadline=None)
@given(
    bits=st.sampled_from(WIDTHS),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    n=st.integers(0, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_and_size(bits, lead, n, seed):
    codes = _codes((*lead, n), bits, seed)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, math.ceil(n * bits / 8)) == (*lead, packed_nbytes(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)
    # The fast paths (per byte; 3 bits: per 24-bit word) and the generic bit-stream reference agree bit for bit.
    if n:
        assert torch.equal(_pack_bitstream(codes, bits), packed)
        assert torch.equal(_unpack_bitstream(packed, bits, n), codes)


def test_layout_lsb_first():
    c = torch.tensor([1, 2, 3, 0, 1], dtype=torch.uint8)
    # 2-bit: byte 0 = 1 | 2<<2 | 3<<4 | 0<<6, byte 1 = 1
    assert pack(c, 2).tolist() == [1 | 2 << 2 | 3 << 4, 1]
    # 3-bit: 8 codes in 3 bytes; codes 0..7 give the stream 000 100 010 110 001 101 011 111 (LSB first)
    c3 = torch.arange(8, dtype=torch.uint8)
    bits = "".join(format(int(v), "03b")[::-1] for v in c3)  # LSB-first stream
    expect = [int(bits[8 * i : 8 * i + 8][::-1], 2) for i in range(3)]
    assert pack(c3, 3).tolist() == expect
    assert pack(torch.tensor([1], dtype=torch.uint8), 1).tolist() == [1]


def test_packed_quantizer_codes_round_trip():
    x = torch.randn(4, 6, 128, generator=torch.Generator().manual_seed(0))
    q = QuestQuantizer(3).quantize(x)
    packed = pack(q.codes, 3)
    assert packed.shape == (4, 6, 48)  # 128·3/8
    restored = dataclasses.replace(q, codes=unpack(packed, 3, 128))
    assert torch.equal(dequantize(restored), QuestQuantizer(3).fake(x))


@pytest.mark.parametrize("n, bits, nbytes", [(0, 3, 0), (1, 3, 1), (8, 3, 3), (9, 3, 4), (5, 2, 2), (128, 4, 64)])
def test_packed_nbytes(n, bits, nbytes):
    assert packed_nbytes(n, bits) == nbytes


def test_errors():
    c = torch.zeros(4, dtype=torch.uint8)
    for bad in (5, 6, 7, 0, 16):
        with pytest.raises(ValueError, match=r"bits in \[1, 2, 3, 4, 8\], got " + str(bad)):
            pack(c, bad)
        with pytest.raises(ValueError, match="bits in"):
            packed_nbytes(4, bad)
    with pytest.raises(ValueError, match="uint8"):
        pack(c.to(torch.int32), 2)
    with pytest.raises(ValueError, match=r"< 2\^2 = 4.*got max 4"):
        pack(torch.tensor([4], dtype=torch.uint8), 2)
    assert pack(torch.tensor([4], dtype=torch.uint8), 2, check=False).shape == (1,)  # unchecked
    with pytest.raises(ValueError, match="ceil"):
        unpack(torch.zeros(3, dtype=torch.uint8), 3, 9)  # needs 4 bytes
