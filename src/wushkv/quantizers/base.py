"""The quantized-tensor container and the one dequantization rule every quantizer shares.

Every quantizer stores unsigned codes plus a per-group affine map, x̂ = scale·code + offset.
QuEST's symmetric midrise grid fits it too (offset = (½ − 2^{b−1})·Δ), so attention kernels can
read codes from any quantizer the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["QTensor", "dequantize", "check_bits", "BITS_RANGE"]

BITS_RANGE = range(1, 9)  # codes live in uint8


def check_bits(bits: int) -> int:
    """Validate a bit width: an integer in 1..8. Returns it."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS_RANGE:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return bits


def check_group_size(group_size: int | None) -> int | None:
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be None or an integer >= 1, got {group_size!r}")
    return group_size


@dataclass
class QTensor:
    """Quantized tensor, codes UNPACKED (one uint8 per element; see ``packing`` for storage).

    Attributes:
        codes: uint8 [..., n] (axis=-1) or [..., T, d] (axis=-2), values in [0, 2^bits − 1].
        scale: float32 [..., n/group_size] (axis=-1) or [..., T/group_size, d] (axis=-2).
        offset: float32, same shape as ``scale``.
        bits: code width, 1..8.
        group_size: elements per group along the quantized axis (resolved, never None).
        axis: -1: groups run along the last dim (per token); -2: along dim -2 (per channel,
            KIVI-style keys: groups of tokens for each channel).

    Dequantization: x̂ = scale·code + offset, per group.
    """

    codes: Tensor
    scale: Tensor
    offset: Tensor
    bits: int
    group_size: int
    axis: int = -1

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def _dequantize_last(codes: Tensor, scale: Tensor, offset: Tensor, group_size: int) -> Tensor:
    """codes [..., n], scale/offset [..., n/G] → float32 [..., n]."""
    n = codes.shape[-1]
    n_groups = n // group_size
    c = codes.to(torch.float32).reshape(*codes.shape[:-1], n_groups, group_size)  # [..., g, G]
    x = c * scale[..., None] + offset[..., None]
    return x.reshape(codes.shape)


def dequantize(q: QTensor) -> Tensor:
    """x̂ = scale·code + offset per group. Returns float32 with the shape of ``q.codes``."""
    if q.codes.dtype != torch.uint8:
        raise ValueError(f"QTensor.codes must be torch.uint8 (unpacked), got {q.codes.dtype}")
    if q.axis == -1:
        expect = (*q.codes.shape[:-1], q.codes.shape[-1] // q.group_size)
        if q.codes.shape[-1] % q.group_size or tuple(q.scale.shape) != expect:
            raise ValueError(
                f"inconsistent QTensor: codes {tuple(q.codes.shape)}, group_size {q.group_size}, "
                f"scale {tuple(q.scale.shape)}"
            )
        return _dequantize_last(q.codes, q.scale.float(), q.offset.float(), q.group_size)
    if q.axis == -2:
        if q.codes.ndim < 2:
            raise ValueError(f"QTensor with axis=-2 needs codes [..., T, d], got {tuple(q.codes.shape)}")
        T, d = q.codes.shape[-2:]
        expect = (*q.codes.shape[:-2], T // q.group_size, d)
        if T % q.group_size or tuple(q.scale.shape) != expect:
            raise ValueError(
                f"inconsistent QTensor (axis=-2): codes {tuple(q.codes.shape)}, group_size {q.group_size}, "
                f"scale {tuple(q.scale.shape)}"
            )
        # Per-channel groups: work on the transposed view [..., d, T], transpose back.
        x = _dequantize_last(
            q.codes.mT, q.scale.float().mT, q.offset.float().mT, q.group_size
        )  # [..., d, T]
        return x.mT.contiguous()
    raise ValueError(f"QTensor.axis must be -1 or -2, got {q.axis!r}")
