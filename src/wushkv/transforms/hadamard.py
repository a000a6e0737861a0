"""Normalized Hadamard matrices and the Hadamard transform (docs/reference/math.md#1-conventions, docs/reference/math.md#8-other-baselines).

𝓗 has entries ±1/√d and is orthogonal: 𝓗 𝓗ᵀ = I. Construction, by order d:

1. d a power of two: Sylvester, 𝓗_{2n} = [[𝓗_n, 𝓗_n], [𝓗_n, −𝓗_n]] (symmetric).
2. d = 2^k · m with m = q + 1 for a prime q ≡ 3 (mod 4) (m = 12, 20, 24, 44, 48, 60, ...):
   Sylvester(2^k) ⊗ Paley-I(m). The Paley matrix is generated from quadratic residues mod q,
   never pasted. It is not symmetric (use 𝓗ᵀ for the inverse), but all |entries| are 1/√d.
3. Otherwise: block-diagonal Sylvester, blocks of the powers of two in the binary expansion of d,
   largest first (e.g. 72 = 64 + 8). Still orthogonal, but the blocks do not mix with each other
   and entries outside them are 0; :func:`is_full_hadamard` tells which case applies.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "hadamard_matrix",
    "hadamard_transform",
    "is_full_hadamard",
]


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    i = 2
    while i * i <= q:
        if q % i == 0:
            return False
        i += 1
    return True


def _sylvester(n: int, dtype: torch.dtype) -> Tensor:
    """Unnormalized ±1 Sylvester Hadamard of order n (a power of two). Shape [n, n]."""
    H = torch.ones(1, 1, dtype=dtype)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=dtype)
    while H.shape[0] < n:
        H = torch.kron(base, H)
    return H


def _paley_order(m: int) -> bool:
    """True if a Paley-I Hadamard of order m exists here: m − 1 is a prime ≡ 3 (mod 4)."""
    q = m - 1
    return m > 2 and q % 4 == 3 and _is_prime(q)


def _paley1(m: int, dtype: torch.dtype) -> Tensor:
    """Unnormalized ±1 Paley-I Hadamard of order m = q + 1, q prime ≡ 3 (mod 4). Shape [m, m].

    Q[i, j] = χ(j − i) is the Jacobsthal matrix (χ the Legendre symbol mod q); it is
    antisymmetric because χ(−1) = −1 for q ≡ 3 (mod 4). Then 𝓗 = I + [[0, 1ᵀ], [−1, Q]].
    """
    q = m - 1
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in residues else -1.0 for a in range(1, q)], dtype=dtype)
    idx = torch.arange(q)
    Q = chi[(idx[None, :] - idx[:, None]) % q]  # [q, q]
    S = torch.zeros(m, m, dtype=dtype)
    S[0, 1:] = 1.0
    S[1:, 0] = -1.0
    S[1:, 1:] = Q
    return torch.eye(m, dtype=dtype) + S


def _full_factorization(d: int) -> tuple[int, int] | None:
    """(2^k, m) with d = 2^k·m and a full Hadamard of order m known, or None."""
    if _is_power_of_two(d):
        return d, 1
    p = 1
    while d % p == 0:
        m = d // p
        if _paley_order(m):
            return p, m
        p *= 2
    return None


def is_full_hadamard(d: int) -> bool:
    """Whether :func:`hadamard_matrix` (d) is a full Hadamard (all |entries| = 1/√d)."""
    if d < 1:
        raise ValueError(f"Hadamard order must be >= 1, got d={d}")
    return _full_factorization(d) is not None


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Tensor:
    """Normalized orthogonal Hadamard-type matrix 𝓗 of order d.

    Args:
        d: order, >= 1.
        dtype: floating dtype of the result (computed in float64, then cast).
        device: device of the result.

    Returns:
        Tensor [d, d] with 𝓗 𝓗ᵀ = I. Entries ±1/√d whenever :func:`is_full_hadamard` (d);
        otherwise block-diagonal Sylvester (see the module docstring).
    """
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"Hadamard order must be an integer >= 1, got d={d!r}")
    f64 = torch.float64
    fact = _full_factorization(d)
    if fact is not None:
        p, m = fact
        H = _sylvester(p, f64)
        if m > 1:
            H = torch.kron(H, _paley1(m, f64))
        H = H / d**0.5
    else:
        # Block-diagonal fallback: binary expansion of d, largest power-of-two block first.
        blocks = []
        rest = d
        while rest:
            b = 1 << (rest.bit_length() - 1)
            blocks.append(_sylvester(b, f64) / b**0.5)
            rest -= b
        H = torch.block_diag(*blocks)
    return H.to(dtype=dtype, device=device)


def hadamard_transform(num_heads: int, d: int) -> tuple[Tensor, Tensor]:
    """The Hadamard transform T = 𝓗 for every KV head (docs/reference/math.md#8-other-baselines; no random signs).

    Returns:
        (T, T_inv), float32 [num_heads, d, d], T_inv = 𝓗ᵀ. Column convention x' = T x.
    """
    _check_heads(num_heads, d)
    H = hadamard_matrix(d)
    T = H.to(torch.float32).expand(num_heads, d, d).contiguous()
    T_inv = H.mT.to(torch.float32).expand(num_heads, d, d).contiguous()
    return T, T_inv


def _check_heads(num_heads: int, d: int) -> None:
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be an integer >= 1, got {num_heads!r}")
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"head dim d must be an integer >= 1, got {d!r}")
