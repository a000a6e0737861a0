"""The RoPE rotation R_t, in transformers' rotate-half layout.

It sits in the foundation (not in :mod:`wushkv.models`, which reads modules) because both the cache and the vLLM
plugin rotate with it, and the plugin may import only the foundation (vLLM's environment has another transformers).
"""

from __future__ import annotations

import torch


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, inverse: bool = False) -> torch.Tensor:
    """R_t x (``inverse``: R_t⁻¹ x) in transformers' rotate-half layout, for ``rope_parameters``' (inv_freq, scale).

    x (..., d) and ``positions`` (...) broadcast against each other's leading dims; computed in x's dtype."""
    ang = positions.to(x.device, x.dtype)[..., None] * inv_freq.to(x.device, x.dtype)
    ang = torch.cat([ang, ang], dim=-1)
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    if inverse:
        return (x * ang.cos() - rot * ang.sin()) / scale
    return (x * ang.cos() + rot * ang.sin()) * scale


def rope_bias_terms(u: torch.Tensor, mu: torch.Tensor, scale: float) -> torch.Tensor:
    """[A | B] (..., d) with u·R_t μ = Σ_i A_i cos tθ_i + B_i sin tθ_i (rotate-half, i < d/2), for u (..., d) and μ
    broadcast against it: A_i = s(u_i μ_i + u_{i+h} μ_{i+h}), B_i = s(u_{i+h} μ_i − u_i μ_{i+h}), s the RoPE scale.
    How a score against keys stored centered on their rotating mean gets the centers' share from the position
    alone (the cache's decode, the vLLM plugin's, the Triton kernel's ``KeyBias``)."""
    h = u.shape[-1] // 2
    u1, u2, m1, m2 = u[..., :h], u[..., h:], mu[..., :h], mu[..., h:]
    return torch.cat([u1 * m1 + u2 * m2, u2 * m1 - u1 * m2], -1) * scale

