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
