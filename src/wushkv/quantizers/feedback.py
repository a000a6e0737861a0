"""Rounding with linear error feedback (LDLQ / GPTQ applied to one cached vector at a time).

A per-token quantizer rounds every coordinate of x ∈ R^d to the nearest level of its group's grid,
independently. When the error e = x̂ − x costs ℓ = eᵀ H e with a non-diagonal H (the query Hessian in
the transformed key space: T^{-T} H_K T⁻¹ = c⁻²·𝓗Λ^{1/2}𝓗ᵀ for WUSH, docs/reference/math.md#2-the-wush-transform-closed-form), independent errors
cost E[ℓ] = σ²·tr H. Rounding the coordinates one after another and pushing each one's error onto the
coordinates not yet rounded (GPTQ's update, QuIP's LDLQ) costs σ²·Σ_j 1/U_jj² instead, where
H⁻¹ = UᵀU (upper Cholesky); by Hadamard's inequality Σ 1/U_jj² ≤ tr H, with equality iff H is diagonal.

The grid (scale and offset per group) is the quantizer's own, computed from the original x, so the
stored format, the bytes and the decoder are unchanged: only the codes differ.

    for j = 0 … d−1:  c_j = clamp(⌊(w_j − offset)/scale + ½⌋, 0, 2^b − 1)   (nearest level)
                      w_{k>j} −= (w_j − ŵ_j)·F_jk,   F = U / diag(U) (unit upper triangular)

starting from w = x. Pure math, no model knowledge; the matrices come from calibration statistics.
"""

from __future__ import annotations

import torch
from torch import Tensor

_TINY = torch.finfo(torch.float32).tiny  # the divisor of a step stored as 0 (feedback_round)

__all__ = ["feedback_gain", "feedback_matrix", "feedback_round"]


def _check_H(H: Tensor) -> Tensor:
    if not isinstance(H, Tensor) or H.ndim < 2 or H.shape[-1] != H.shape[-2] or H.shape[-1] < 1:
        raise ValueError(f"H must be a square tensor [..., d, d], got {type(H).__name__} {tuple(getattr(H, 'shape', ()))}")
    H = H.to(torch.float64)
    if not bool(torch.isfinite(H).all()):
        raise ValueError("H contains NaN or inf; error feedback needs finite statistics")
    return 0.5 * (H + H.mT)


def _upper_inverse_cholesky(H: Tensor, damping: float) -> Tensor:
    d = H.shape[-1]
    if not (0.0 <= float(damping) < float("inf")):
        raise ValueError(f"damping must be a finite float >= 0, got {damping!r}")
    mean_diag = torch.diagonal(H, dim1=-2, dim2=-1).sum(-1) / d
    Hd = H + (damping * mean_diag)[..., None, None] * torch.eye(d, dtype=H.dtype, device=H.device)
    L, info = torch.linalg.cholesky_ex(Hd)
    if bool((info != 0).any()):
        raise ValueError(f"H + {damping}·(tr H/d)·I is not positive definite; use a larger damping (e.g. 0.01)")
    Hinv = torch.cholesky_inverse(L)  # (H̃)⁻¹ from its Cholesky factor
    return torch.linalg.cholesky(0.5 * (Hinv + Hinv.mT), upper=True)  # H̃⁻¹ = UᵀU


def feedback_matrix(H: Tensor, damping: float = 0.01, dtype: torch.dtype = torch.float32) -> Tensor:
    """F = U / diag(U) with UᵀU = (H + γ·(tr H/d)·I)⁻¹: unit upper triangular, batched over leading dims.

    Args:
        H: [..., d, d] SPD weight of the error in the coordinates that are rounded.
        damping: γ, relative to the mean diagonal (as for the WUSH transform).
        dtype: output dtype (the math runs in float64).
    """
    U = _upper_inverse_cholesky(_check_H(H), damping)
    return (U / torch.diagonal(U, dim1=-2, dim2=-1)[..., :, None]).to(dtype).contiguous()


def feedback_gain(H: Tensor, damping: float = 0.01) -> Tensor:
    """Σ_j 1/U_jj² / tr H̃ per matrix: the expected weighted error of feedback rounding relative to
    independent rounding when every coordinate's rounding error has the same variance ([...]; ≤ 1)."""
    H = _check_H(H)
    U = _upper_inverse_cholesky(H, damping)
    tr = torch.diagonal(H, dim1=-2, dim2=-1).sum(-1) * (1.0 + damping)  # tr H̃
    return torch.diagonal(U, dim1=-2, dim2=-1).pow(-2).sum(-1) / tr


def feedback_round(x: Tensor, scale: Tensor, offset: Tensor, bits: int, group_size: int, F: Tensor, *, fused: bool = True) -> Tensor:
    """Codes of ``x`` on a given per-group grid, rounded with error feedback ``F``.

    Args:
        x: [..., H, N, d] floating (heads, tokens, channels).
        scale, offset: [..., H, N, d/G] the grid of each group: levels scale·c + offset, c ∈ [0, 2^b − 1].
        bits: code width.
        group_size: G, channels per group (divides d).
        F: [H, d, d] or [d, d] unit upper-triangular feedback (:func:`feedback_matrix`); the identity
            gives plain nearest-level rounding.
        fused: use the compiled CPU kernel (``csrc/codes.cpp``) for CPU tensors of shape (B, H, N, d)
            when it is available; this loop is its reference (equal codes but for last-ulp ties).

    Returns:
        uint8 codes [..., H, N, d].
    """
    d = x.shape[-1]
    if F.shape[-2:] != (d, d) or F.ndim not in (2, 3) or (F.ndim == 3 and x.ndim >= 3 and F.shape[0] != x.shape[-3]):
        raise ValueError(f"feedback F must be [d, d] or [heads, d, d] matching x {tuple(x.shape)} (..., heads, tokens, d), got {tuple(F.shape)}")
    if d % group_size or scale.shape[-1] != d // group_size:
        raise ValueError(f"group_size {group_size} and scale {tuple(scale.shape)} do not fit d = {d}")
    qmax = 2**bits - 1
    if fused and x.device.type == "cpu" and x.ndim == 4 and F.ndim == 3:
        from .._ext import kernels

        ext = kernels()
        if ext is not None and hasattr(ext, "feedback_round"):
            return ext.feedback_round(x.to(torch.float32), scale.to(torch.float32).expand(*x.shape[:3], -1),
                                      offset.to(torch.float32).expand(*x.shape[:3], -1), F.to(torch.float32), bits)
    w = x.to(torch.float32).clone()
    Fh = F.to(device=x.device, dtype=torch.float32)
    if Fh.ndim == 3:
        Fh = Fh[:, None]  # (H, 1, d, d): broadcasts over tokens
    s = scale.to(torch.float32)
    o = offset.to(torch.float32)
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for j in range(d):
        g = j // group_size
        sj, oj = s[..., g], o[..., g]
        # a step stored as 0 (a group of zeros, its step rounded to the metadata dtype) divides by float32's tiny:
        # its codes decode to the offset whatever they are, and its error (w itself) goes on; 0/0 would put NaN
        # into every later channel
        c = torch.floor((w[..., j] - oj) / sj.clamp_min(_TINY) + 0.5).clamp_(0, qmax)
        codes[..., j] = c.to(torch.uint8)
        if j + 1 < d:
            e = w[..., j] - (c * sj + oj)
            w[..., j + 1 :] -= e[..., None] * Fh[..., j, j + 1 :]
    return codes
