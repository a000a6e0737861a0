"""OSCAR-style percentile-clipped asymmetric (affine) quantizer (docs/reference/math.md#5-the-percentile-clipped-affine-quantizer).

Per row r ∈ R^D of the quantized axis (a token for axis=-1, a channel's tokens for axis=-2):

1. τ = (ascending sort of |r|)[min(⌊κ·D⌋, D − 1)] over the whole row (not per group);
   κ ≤ 0 disables clipping (plain min–max, the KIVI/HF baseline).
2. r_c = clamp(r, −τ, τ).
3. Per group: lo = min, hi = max, s = max(hi − lo, 1e-8)/(2^b − 1), z = −lo/s (float),
   q = clamp(⌊r_c/s + z + ½⌋, 0, 2^b − 1); x̂ = (q − z)·s, stored as scale = s, offset = −z·s.

With ``search = n > 0`` (per token only), each group takes, of its κ-clipped range [lo, hi] and the
shrinks [m·lo₀, m·hi₀] of its unclipped range for n multipliers m evenly spaced in [0.3, 1] (1: plain min–max),
the one with the smallest ‖r − x̂‖² against the unclipped group, ties to the κ range: the same storage
and decoder, never a larger group error than the κ rule.

From :data:`wushkv.quantizers.quest.UNCLIPPED_FROM` bits on, κ is not applied (plain min–max): at those widths
clipping costs more than it saves (docs/lab/clip-by-width.md); ``clip=True``/``False`` overrides the rule.

Arithmetic is float32 (hot path); inputs must be finite (not checked: it would force a sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import QTensor, check_bits, check_group_size
from .base import dequantize as _dequantize
from .quest import UNCLIPPED_FROM, search_multipliers

__all__ = ["AffineQuantizer", "percentile_clip"]

_MIN_RANGE = 1e-8  # floor on hi − lo, so constant groups get a finite scale


def percentile_clip(x: Tensor, clip_ratio: float) -> tuple[Tensor, Tensor]:
    """Symmetric percentile clipping along the last dim (step 1–2 above).

    Args:
        x: [..., D] floating.
        clip_ratio: κ; κ ≤ 0 returns x unchanged (τ = +inf).

    Returns:
        (x_c, tau): x_c float32 [..., D] = clamp(x, −τ, τ); tau float32 [..., 1], the
        (min(⌊κ·D⌋, D − 1))-th smallest |x| of the row (0-based).
    """
    x = x.to(torch.float32)
    D = x.shape[-1]
    if clip_ratio <= 0:
        tau = torch.full((*x.shape[:-1], 1), float("inf"), dtype=torch.float32, device=x.device)
        return x, tau
    k = min(math.floor(clip_ratio * D), D - 1)
    tau = torch.kthvalue(x.abs(), k + 1, dim=-1, keepdim=True).values  # kthvalue is 1-based
    return torch.maximum(torch.minimum(x, tau), -tau), tau


def _grid_last(x: Tensor, bits: int, group_size: int | None, clip_ratio: float, search: int = 0) -> tuple[Tensor, Tensor, Tensor, int]:
    """Clipped groups along the last dim and their grid: (xg [..., g, G], s, z [..., g], G)."""
    D = x.shape[-1]
    G = D if group_size is None else group_size
    if D == 0 or D % G:
        raise ValueError(f"group_size {group_size} must divide the quantized dim, got {D}")
    x_c, _ = percentile_clip(x, clip_ratio)
    xg = x_c.reshape(*x.shape[:-1], D // G, G)  # [..., g, G]
    lo = xg.amin(-1)
    hi = xg.amax(-1)
    qmax = 2**bits - 1
    s = (hi - lo).clamp_min(_MIN_RANGE) / qmax  # [..., g]
    if not search:
        return xg, s, -lo / s, G
    x0 = x.to(torch.float32).reshape(xg.shape)  # unclipped: the search sees the clipping error too
    lo0, hi0 = x0.amin(-1), x0.amax(-1)
    best_err = best_s = best_lo = None
    for i, m in enumerate(search_multipliers(search, 0.3, 1.0)):
        c_lo, c_hi = (lo, hi) if i == 0 else (m * lo0, m * hi0)  # first the κ-clipped range, then shrinks of the full one
        s_m = (c_hi - c_lo).clamp_min(_MIN_RANGE) / qmax
        z_m = -c_lo / s_m
        q = torch.floor(x0 / s_m[..., None] + z_m[..., None] + 0.5).clamp_(0, qmax)
        err = ((q - z_m[..., None]) * s_m[..., None] - x0).square_().sum(-1)
        if best_err is None:
            best_err, best_s, best_lo = err, s_m, c_lo
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s_m, best_s)
            best_lo = torch.where(better, c_lo, best_lo)
    return x0, best_s, -best_lo / best_s, G  # codes from the unclipped group: clamping the codes clips it


def _quantize_last(x: Tensor, bits: int, group_size: int | None, clip_ratio: float, search: int = 0) -> QTensor:
    """Affine quantization with groups along the last dim. x [..., D] → codes [..., D]."""
    xg, s, z, G = _grid_last(x, bits, group_size, clip_ratio, search)
    qmax = 2**bits - 1
    q = torch.floor(xg / s[..., None] + z[..., None] + 0.5).clamp_(0, qmax)
    codes = q.to(torch.uint8).reshape(x.shape)
    return QTensor(codes=codes, scale=s, offset=-z * s, bits=bits, group_size=G, axis=-1)


@dataclass(frozen=True)
class AffineQuantizer:
    """Asymmetric min–max quantizer with optional symmetric percentile clipping.

    Args:
        bits: 1..8.
        group_size: elements per group along the quantized axis; None = the whole axis
            (axis=-1 only). For axis=-2 it is required and must divide T.
        clip_ratio: κ (docs/reference/math.md#5-the-percentile-clipped-affine-quantizer; WUSH-KV/OSCAR use 0.96 for keys, 0.92 for values); κ ≤ 0
            disables clipping. Must be ≤ 1.
        axis: -1 = per token (groups over channels, x [..., n]); -2 = per channel, KIVI-style:
            x [..., T, d], groups of ``group_size`` tokens for each channel, scale/offset
            [..., T/group_size, d]. Clipping runs along the quantized axis (over all T tokens of
            a channel for axis=-2).
        search: 0 = off; n > 0 = each group picks the MSE-best of its κ range and n shrinks of its
            unclipped range (axis=-1 only; same storage).
        clip: None = apply κ below ``UNCLIPPED_FROM`` bits only; True = at every width; False = never.
    """

    bits: int
    group_size: int | None = None
    clip_ratio: float = 0.0
    axis: int = -1
    search: int = 0
    clip: bool | None = None

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_group_size(self.group_size)
        if not (isinstance(self.clip_ratio, (int, float)) and self.clip_ratio <= 1.0):
            raise ValueError(f"clip_ratio must be a float <= 1 (<= 0 disables clipping), got {self.clip_ratio!r}")
        if self.axis not in (-1, -2):
            raise ValueError(f"axis must be -1 (per token) or -2 (per channel), got {self.axis!r}")
        if self.axis == -2 and self.group_size is None:
            raise ValueError("axis=-2 (per-channel) needs group_size (tokens per group), got None")
        search_multipliers(self.search)
        if self.search and self.axis != -1:
            raise ValueError(f"search={self.search} is per token (axis=-1) only, got axis={self.axis}")
        if self.clip is not None and not isinstance(self.clip, bool):
            raise ValueError(f"affine clip must be None (by width), True or False, got {self.clip!r}")

    @property
    def kappa(self) -> float:
        """The percentile clip κ in effect: ``clip_ratio``, or 0 (none) where the width or ``clip`` turns it off."""
        on = self.bits < UNCLIPPED_FROM if self.clip is None else self.clip
        return self.clip_ratio if on else 0.0

    def quantize(self, x: Tensor) -> QTensor:
        """x [..., n] (axis=-1) or [..., T, d] (axis=-2), floating → QTensor (codes unpacked)."""
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise ValueError(f"x must be a floating torch.Tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}")
        if self.axis == -1:
            if x.ndim < 1:
                raise ValueError(f"x must have shape [..., n], got {tuple(x.shape)}")
            return _quantize_last(x, self.bits, self.group_size, self.kappa, self.search)
        if x.ndim < 2:
            raise ValueError(f"axis=-2 needs x of shape [..., T, d], got {tuple(x.shape)}")
        T = x.shape[-2]
        if T % self.group_size:
            raise ValueError(f"group_size {self.group_size} must divide the token dim T={T} for axis=-2")
        qt = _quantize_last(x.mT, self.bits, self.group_size, self.kappa)  # on [..., d, T]
        return QTensor(
            codes=qt.codes.mT.contiguous(),  # [..., T, d]
            scale=qt.scale.mT.contiguous(),  # [..., T/G, d]
            offset=qt.offset.mT.contiguous(),
            bits=self.bits,
            group_size=self.group_size,
            axis=-2,
        )

    def grid(self, x: Tensor) -> tuple[Tensor, Tensor, int]:
        """Per token (axis=-1) only: the per-group grid alone, levels scale·c + offset: (scale, offset)
        float32 [..., n/G] and G, as :meth:`quantize` computes them."""
        if self.axis != -1:
            raise ValueError("grid() is per token (axis=-1); per-channel groups span tokens")
        _, s, z, G = _grid_last(x, self.bits, self.group_size, self.kappa, self.search)
        return s, -z * s, G

    def dequantize(self, q: QTensor) -> Tensor:
        """x̂ = scale·code + offset per group (respects ``q.axis``). float32."""
        return _dequantize(q)

    def fake(self, x: Tensor) -> Tensor:
        """Quantize-dequantize; equals ``dequantize(quantize(x))``. float32."""
        return _dequantize(self.quantize(x))
