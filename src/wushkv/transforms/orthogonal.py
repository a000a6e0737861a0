"""Orthogonal transforms: identity, seeded random rotation, OSCAR (docs/reference/math.md#6-the-oscar-transform, docs/reference/math.md#8-other-baselines).

All builders return (T, T_inv) float32 [num_heads, d, d] in the column convention: the cache
stores T x (rows: ``x @ T.mT``) and T_inv undoes it. For an orthogonal T, T_inv = Tᵀ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .hadamard import _check_heads, hadamard_matrix
from .per_layer import LayerTransforms
from .wush import canonical_signs

__all__ = [
    "identity_transform",
    "random_orthogonal_transform",
    "oscar_rotation",
    "oscar_transform",
]


def identity_transform(num_heads: int, d: int) -> tuple[Tensor, Tensor]:
    """T = T_inv = I for every head. Returns float32 [num_heads, d, d] (separate storage)."""
    _check_heads(num_heads, d)
    I = torch.eye(d, dtype=torch.float32).expand(num_heads, d, d)
    return I.contiguous(), I.contiguous()


def random_orthogonal_transform(num_heads: int, d: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Seeded random rotations, one per head (docs/reference/math.md#8-other-baselines).

    Q R = G for a float64 standard Gaussian G [num_heads, d, d] drawn from a
    ``torch.Generator`` seeded with ``seed``; Q's columns are multiplied by sign(diag R) so the
    factorization is unique (Haar-distributed Q). Deterministic for a seed; heads differ.

    Returns:
        (T, T_inv) float32 [num_heads, d, d], T = Q, T_inv = Qᵀ.
    """
    _check_heads(num_heads, d)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    G = torch.randn(num_heads, d, d, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)
    signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    Q = Q * signs[..., None, :]  # scale column j by sign(R_jj)
    return Q.to(torch.float32).contiguous(), Q.mT.to(torch.float32).contiguous()


def _check_square_stats(name: str, A: Tensor) -> Tensor:
    if not isinstance(A, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(A).__name__}")
    if A.ndim < 2 or A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name} must have shape [..., d, d], got {tuple(A.shape)}")
    A = A.to(torch.float64)
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return A


def oscar_rotation(Sigma: Tensor) -> Tensor:
    """OSCAR rotation R = U·𝓗 (docs/reference/math.md#6-the-oscar-transform).

    Args:
        Sigma: [..., d, d] symmetric PSD (cast to float64; symmetrized).

    Returns:
        R float64 [..., d, d], orthogonal. U holds the eigenvectors of Sigma sorted by descending
        eigenvalue, so Uᵀ Σ U = diag(λ₁ ≥ … ≥ λ_d) and R 𝓗ᵀ = U. The cached vector is Rᵀ x.
    """
    Sigma = _check_square_stats("Sigma", Sigma)
    d = Sigma.shape[-1]
    Sigma = 0.5 * (Sigma + Sigma.mT)
    _, U = torch.linalg.eigh(Sigma)  # ascending eigenvalues
    U = canonical_signs(U).flip(-1)  # descending eigenvalue order; signs fixed as in WUSH
    H = hadamard_matrix(d, dtype=torch.float64, device=Sigma.device)
    return U @ H


def oscar_transform(C_Q: Tensor, Sigma_V: Tensor, num_heads: int | None = None) -> LayerTransforms:
    """OSCAR key/value transforms, one rotation per layer shared by its KV heads (docs/reference/math.md#6-the-oscar-transform).

    Args:
        C_Q: [Hkv, d, d] mean query outer product per KV head (or [d, d], already shared).
        Sigma_V: [Hkv, d, d] score-weighted value covariance per KV head, weights normalized to
            mean 1 (or [d, d]).
        num_heads: number of KV heads to broadcast to; default C_Q.shape[0] (1 for [d, d] input).

    Returns:
        LayerTransforms (T_K, T_K_inv, T_V, T_V_inv), float32 [num_heads, d, d] with T = Rᵀ, T_inv = R,
        R_K = oscar_rotation(mean_h C_Q(h)), R_V = oscar_rotation(mean_h Sigma_V(h)).
    """
    C_Q = _check_square_stats("C_Q", C_Q)
    Sigma_V = _check_square_stats("Sigma_V", Sigma_V)
    if C_Q.shape[-1] != Sigma_V.shape[-1]:
        raise ValueError(
            f"C_Q and Sigma_V must have the same head dim, got {tuple(C_Q.shape)} and {tuple(Sigma_V.shape)}"
        )
    for name, A in (("C_Q", C_Q), ("Sigma_V", Sigma_V)):
        if A.ndim not in (2, 3):
            raise ValueError(f"{name} must have shape [Hkv, d, d] or [d, d], got {tuple(A.shape)}")
    if num_heads is None:
        num_heads = C_Q.shape[0] if C_Q.ndim == 3 else 1
    d = C_Q.shape[-1]
    _check_heads(num_heads, d)
    Sigma_K = C_Q.mean(0) if C_Q.ndim == 3 else C_Q
    Sigma_Vm = Sigma_V.mean(0) if Sigma_V.ndim == 3 else Sigma_V
    R_K = oscar_rotation(Sigma_K)
    R_V = oscar_rotation(Sigma_Vm)

    def heads(A: Tensor) -> Tensor:
        return A.to(torch.float32).expand(num_heads, d, d).contiguous()

    return LayerTransforms(heads(R_K.mT), heads(R_K), heads(R_V.mT), heads(R_V))
