"""Bit-exact packing of b-bit codes into bytes, b ∈ {1, 2, 3, 4, 8}.

Layout (little-endian bit stream, the same for every width): code i of a row occupies stream bits
[i·b, (i+1)·b), least significant bit first; stream bit j is bit (j mod 8) of byte ⌊j/8⌋. A row of
n codes takes exactly ⌈n·b/8⌉ bytes; unused high bits of the last byte are 0. So for b ∈ {1,2,4}
byte k holds codes k·(8/b) … with the first code in the low bits, and 3-bit codes pack 8 codes
into 3 bytes.

Fast paths (a per-byte shift-or for widths that divide 8; for b = 3, each 8 codes as one 24-bit word split into
its 3 bytes) and the generic bit-stream reference, which explodes every code into bits (ten times slower at 3 bits:
~10 ms a 4096-token layer of SmolLM2, paid at every prefill). Tests check they agree for every width.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PACK_BITS", "pack", "unpack", "packed_nbytes"]

PACK_BITS = (1, 2, 3, 4, 8)


def _check_pack_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in PACK_BITS:
        raise ValueError(f"packing supports bits in {list(PACK_BITS)}, got {bits!r}")
    return bits


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes for a row of n codes of ``bits`` bits: ⌈n·bits/8⌉."""
    _check_pack_bits(bits)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    return (n * bits + 7) // 8


def _pad_last(x: Tensor, multiple: int) -> Tensor:
    n = x.shape[-1]
    pad = (-n) % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)


def _pack_bitstream(codes: Tensor, bits: int) -> Tensor:
    """Reference packer for any width: explode to bits, regroup into bytes. uint8 [..., ⌈n·b/8⌉]."""
    n = codes.shape[-1]
    c = _pad_last(codes, 8)  # 8 codes = b bytes, so the stream ends on a byte boundary
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = (c[..., :, None] >> shifts) & 1  # [..., n8, b] bit j of each code
    stream = stream.reshape(*c.shape[:-1], -1, 8)  # [..., bytes, 8]
    weights = torch.arange(8, dtype=torch.uint8, device=codes.device)
    packed = (stream << weights).sum(-1, dtype=torch.int32).to(torch.uint8)  # bits are disjoint
    return packed[..., : (n * bits + 7) // 8]


def _unpack_bitstream(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`_pack_bitstream`. uint8 [..., n]."""
    p = _pad_last(packed, bits)  # whole 8-code blocks
    weights = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = (p[..., :, None] >> weights) & 1  # [..., bytes, 8]
    stream = stream.reshape(*p.shape[:-1], -1, bits)  # [..., codes, b]
    shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    codes = (stream << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)
    return codes[..., :n]


def _pack_bytewise(codes: Tensor, bits: int) -> Tensor:
    """Fast path for bits dividing 8: per = 8/bits codes per byte, shift-or. uint8 [..., ⌈n/per⌉]."""
    per = 8 // bits
    c = _pad_last(codes, per).reshape(*codes.shape[:-1], -1, per)  # [..., bytes, per]
    out = c[..., 0].clone()
    for i in range(1, per):  # at most 8 positions
        out |= c[..., i] << (bits * i)
    return out


def _unpack_bytewise(packed: Tensor, bits: int, n: int) -> Tensor:
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # [per]
    codes = (packed[..., :, None] >> shifts) & mask  # [..., bytes, per]
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def _pack_words3(codes: Tensor) -> Tensor:
    """Fast path for 3 bits: codes 8k..8k+7 as the 24-bit word Σ_t c_t·2^(3t), its bytes low first.
    uint8 [..., ⌈3n/8⌉]."""
    n = codes.shape[-1]
    c = _pad_last(codes, 8).reshape(*codes.shape[:-1], -1, 8).to(torch.int32)
    word = c[..., 0].clone()
    for t in range(1, 8):
        word |= c[..., t] << (3 * t)
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1).to(torch.uint8)
    return out.flatten(-2)[..., : (n * 3 + 7) // 8]


def _unpack_words3(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`_pack_words3`. uint8 [..., n]."""
    p = _pad_last(packed, 3).reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    return ((word[..., None] >> shifts) & 7).to(torch.uint8).flatten(-2)[..., :n]


def pack(codes: Tensor, bits: int, *, check: bool = True) -> Tensor:
    """Pack unsigned codes along the last dim.

    Args:
        codes: uint8 [..., n], every value < 2^bits.
        bits: 1, 2, 3, 4 or 8.
        check: verify codes < 2^bits (one reduction; on GPU it syncs, so hot paths that
            produce codes from a quantizer may pass False). Out-of-range codes would corrupt
            their neighbours.

    Returns:
        uint8 [..., ⌈n·bits/8⌉] (layout in the module docstring).
    """
    _check_pack_bits(bits)
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be a torch.uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    if codes.ndim < 1:
        raise ValueError("codes must have at least one dim [..., n], got a scalar")
    if check and bits < 8 and codes.numel() and int(codes.max()) >= (1 << bits):
        raise ValueError(f"codes must be < 2^{bits} = {1 << bits} for bits={bits}, got max {int(codes.max())}")
    if bits == 8:
        return codes.clone()
    if codes.shape[-1] == 0:
        return codes.new_zeros(*codes.shape[:-1], 0)
    if 8 % bits == 0:
        return _pack_bytewise(codes, bits)
    return _pack_words3(codes) if bits == 3 else _pack_bitstream(codes, bits)


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack`: uint8 [..., ⌈n·bits/8⌉] → uint8 [..., n]."""
    _check_pack_bits(bits)
    if not isinstance(packed, Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be a torch.uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    nbytes = packed_nbytes(n, bits)
    if packed.ndim < 1 or packed.shape[-1] != nbytes:
        raise ValueError(
            f"packed last dim must be ceil(n*bits/8) = {nbytes} for n={n}, bits={bits}, got shape {tuple(packed.shape)}"
        )
    if bits == 8:
        return packed.clone()
    if n == 0:
        return packed.new_zeros(*packed.shape[:-1], 0)
    if 8 % bits == 0:
        return _unpack_bytewise(packed, bits, n)
    return _unpack_words3(packed, n) if bits == 3 else _unpack_bitstream(packed, bits, n)
