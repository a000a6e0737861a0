"""WUSH transform in closed form (docs/reference/math.md#2-the-wush-transform-closed-form).

Given M = X Xᵀ (Gram of the quantized factor) and the Hessian H (Gram of its partner):

    H̃ = H + γ_H·(tr H/d)·I,   M̃ = M + γ_M·(tr M/d)·I
    L Lᵀ = H̃                   (lower Cholesky)
    Lᵀ M̃ L = U Λ Uᵀ            (eigh, Λ > 0)
    T     = c · 𝓗 · Λ^{-1/4} · Uᵀ · Lᵀ
    T⁻¹   = c⁻¹ · L^{-T} · U · Λ^{1/4} · 𝓗ᵀ      (triangular solve)
    c²    = tr(M̃) / tr(Λ^{1/2})                  so tr(T M̃ Tᵀ) = tr(M̃)

Invariants (undamped): T M Tᵀ = c²·𝓗Λ^{1/2}𝓗ᵀ and T^{-T} H T⁻¹ = c^{-2}·𝓗Λ^{1/2}𝓗ᵀ, both with a
constant diagonal when 𝓗 is a full Hadamard; TᵀT = c²·(M⁻¹ # H); and
tr(T M Tᵀ)·tr(T^{-T} H T⁻¹) = (Σ λᵢ^{1/2})², the minimum over all invertible T.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .hadamard import hadamard_matrix

__all__ = ["canonical_signs", "with_signs", "wush_transform"]


def canonical_signs(U: Tensor) -> Tensor:
    """Eigenvectors (columns of U [..., d, d]) with a fixed sign: each column's largest-magnitude entry
    is made positive (the first of equal magnitudes).

    ``eigh`` returns each eigenvector up to its sign, and which sign can change with the last bits of
    its input: statistics accumulated on another device or with another thread count (seen: a GPU and
    a one-thread CPU calibration of the same data, one head of one layer). Every sign gives an exact
    solution, but a sign between Λ^{-1/4} and 𝓗 changes which values the per-token quantizer rounds.
    Fixing it makes statistics that agree to rounding solve to the same transform, except where two
    entries of an eigenvector tie in magnitude to rounding, or an eigenvalue repeats (its eigenvectors
    are then free to rotate).
    """
    idx = U.abs().argmax(dim=-2, keepdim=True)  # [..., 1, d]: row of each column's largest entry
    s = torch.sign(torch.gather(U, -2, idx))
    return U * torch.where(s == 0, torch.ones_like(s), s)


def with_signs(T: Tensor, T_inv: Tensor, D: Tensor) -> tuple[Tensor, Tensor]:
    """Another exact WUSH solution: the eigenvectors of T = c·𝓗·Λ^{-1/4}·Uᵀ·Lᵀ taken with signs D.

    ``D`` [..., d] holds ±1 per eigenvector (in T's eigenvalue order). Since D commutes with Λ^{-1/4},
    c·𝓗·D·Λ^{-1/4}·Uᵀ·Lᵀ = (𝓗 D 𝓗ᵀ)·T, and its inverse is T⁻¹·(𝓗 D 𝓗ᵀ)ᵀ. Same trace objective, same
    constant diagonals; other values to round (docs/lab/eigenvector-sign-noise.md). Works for any transform
    whose last factor is 𝓗 (WUSH, WUSH-A, centered WUSH). Computed in float64, returned in T's dtype.
    """
    if D.shape != T.shape[:-1] or T.shape[-1] != T.shape[-2] or T_inv.shape != T.shape:
        raise ValueError(f"signs of shape {tuple(D.shape)} do not fit transforms of shape {tuple(T.shape)} (expected {tuple(T.shape[:-1])})")
    if not bool((D.abs() == 1).all()):
        raise ValueError("signs must be +1 or -1")
    Hd = hadamard_matrix(T.shape[-1], dtype=torch.float64, device=T.device)
    R = (Hd * D.to(torch.float64)[..., None, :]) @ Hd.mT
    return (R @ T.double()).to(T.dtype), (T_inv.double() @ R.mT).to(T_inv.dtype)


def _check_damping(name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a float >= 0, got {value!r}") from None
    if not (v >= 0.0) or v == float("inf"):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
    return v


def _check_gram(name: str, A: Tensor) -> Tensor:
    if not isinstance(A, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape [..., d, d], got {type(A).__name__}")
    if A.ndim < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name} must be square with shape [..., d, d], got {tuple(A.shape)}")
    if A.shape[-1] < 1:
        raise ValueError(f"{name} must have d >= 1, got {tuple(A.shape)}")
    A = A.to(torch.float64)
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{name} contains NaN or inf; WUSH needs finite statistics")
    # Accumulated Grams are symmetric up to rounding; symmetrize so eigh sees exact symmetry.
    return 0.5 * (A + A.mT)


def _damp(A: Tensor, gamma: float) -> Tensor:
    """A + γ·(tr A/d)·I, batched. A [..., d, d] float64."""
    d = A.shape[-1]
    mean_diag = torch.diagonal(A, dim1=-2, dim2=-1).sum(-1) / d  # [...]
    I = torch.eye(d, dtype=A.dtype, device=A.device)
    return A + (gamma * mean_diag)[..., None, None] * I


def wush_transform(
    M: Tensor,
    H: Tensor,
    damping: float = 0.01,
    *,
    damping_M: float | None = None,
    dtype: torch.dtype = torch.float32,
    signs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Closed-form WUSH transform, batched over leading dims (e.g. KV heads).

    Args:
        M: [..., d, d] Gram of the quantized factor, Σ_t x_t x_tᵀ (float64 preferred; cast).
        H: [..., d, d] Hessian (SPD Gram of the partner), same shape as M.
        damping: γ_H >= 0, relative to the mean diagonal of H (0 = undamped; needs H SPD).
        damping_M: γ_M >= 0 for M; defaults to ``damping``.
        dtype: output dtype (default float32; the math always runs in float64).
        signs: [..., d] of ±1, optional: each eigenvector's sign after the canonical choice (another exact WUSH
            solution; :func:`with_signs` applies the same to a solved T).

    Returns:
        (T, T_inv), each [..., d, d] in ``dtype``: cache x' = T x (rows ``x @ T.mT``), and
        T_inv T = I up to float32 rounding. c is chosen so tr(T M̃ Tᵀ) = tr(M̃), i.e.
        ‖T X‖_F ≈ ‖X‖_F on the calibration tokens (exact when undamped).

    Raises:
        ValueError: non-finite or mis-shaped M/H, negative damping, H̃ not positive definite
            (Cholesky fails) or M̃ numerically singular: raise the damping.
    """
    M = _check_gram("M", M)
    H = _check_gram("H", H)
    if M.shape != H.shape:
        raise ValueError(f"M and H must have the same shape, got M {tuple(M.shape)} and H {tuple(H.shape)}")
    gamma_H = _check_damping("damping", damping)
    gamma_M = gamma_H if damping_M is None else _check_damping("damping_M", damping_M)
    d = M.shape[-1]

    H_t = _damp(H, gamma_H)  # H̃
    M_t = _damp(M, gamma_M)  # M̃

    L, info = torch.linalg.cholesky_ex(H_t)  # L Lᵀ = H̃, lower
    if bool((info != 0).any()):
        raise ValueError(
            f"Cholesky of the damped Hessian H + {gamma_H}·(tr H/d)·I failed (not positive definite); "
            "use a larger damping (e.g. 0.01 or 0.1)"
        )

    A = L.mT @ M_t @ L  # Lᵀ M̃ L
    A = 0.5 * (A + A.mT)
    Lam, U = torch.linalg.eigh(A)  # Λ ascending, U orthogonal
    U = canonical_signs(U)  # the same T on every device and BLAS
    if signs is not None:
        U = U * signs.to(U)[..., None, :]
    lam_max = Lam.amax(-1, keepdim=True)
    # Relative floor: below it Λ^{-1/4} amplifies rounding noise rather than signal.
    if not bool((Lam > lam_max * (d * torch.finfo(torch.float64).eps)).all()):
        raise ValueError(
            f"damped M + {gamma_M}·(tr M/d)·I is numerically singular (eigenvalues of LᵀM̃L not > 0); "
            "use a larger damping_M (e.g. 0.01)"
        )

    Hd = hadamard_matrix(d, dtype=torch.float64, device=M.device)  # 𝓗, not the Hessian
    sqrt_Lam = Lam.sqrt()
    c2 = torch.diagonal(M_t, dim1=-2, dim2=-1).sum(-1) / sqrt_Lam.sum(-1)  # tr M̃ / tr Λ^{1/2}
    c = c2.sqrt()[..., None, None]

    # T = c·𝓗·Λ^{-1/4}·Uᵀ·Lᵀ
    T = c * (Hd @ (Lam.pow(-0.25)[..., :, None] * (U.mT @ L.mT)))
    # T⁻¹ = c⁻¹·L^{-T}·(U·Λ^{1/4}·𝓗ᵀ): solve Lᵀ Y = B with Lᵀ upper-triangular
    B = (U * Lam.pow(0.25)[..., None, :]) @ Hd.mT
    T_inv = torch.linalg.solve_triangular(L.mT, B, upper=True) / c
    return T.to(dtype).contiguous(), T_inv.to(dtype).contiguous()
