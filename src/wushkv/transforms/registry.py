"""Name → transform registry, used by calibration and the CLI.

``build_transforms`` returns the four matrices a (layer) needs, float32 [num_kv_heads, d, d]:
``T_K``/``T_K_inv`` for keys (applied online after RoPE) and ``T_V``/``T_V_inv`` for values
(folded into v_proj/o_proj). Column convention: cached k' = T_K k.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .hadamard import _check_heads, hadamard_transform
from .orthogonal import identity_transform, oscar_transform, random_orthogonal_transform
from .per_layer import LayerTransforms
from .wush import wush_transform

__all__ = ["TransformSpec", "TRANSFORMS", "build_transforms", "get_transform_spec"]


@dataclass(frozen=True)
class TransformSpec:
    """What a named transform is and which calibration statistics it reads.

    Attributes:
        name: registry key.
        needs_calibration: True if ``build_transforms`` needs ``stats``.
        description: one line for ``--help`` and reports.
        stats_keys: the keys of ``stats`` it reads, each [num_kv_heads, d, d] (float64).
    """

    name: str
    needs_calibration: bool
    description: str
    stats_keys: tuple[str, ...] = ()


TRANSFORMS: dict[str, TransformSpec] = {
    spec.name: spec
    for spec in (
        TransformSpec("identity", False, "no transform (T = I)"),
        TransformSpec("hadamard", False, "normalized Hadamard rotation T = 𝓗, no random signs"),
        TransformSpec(
            "random", False, "seeded random orthogonal rotation per head (keys: seed, values: seed + 1)"
        ),
        TransformSpec(
            "wush",
            True,
            "WUSH closed form T = c·𝓗·Λ^{-1/4}·Uᵀ·Lᵀ from M and the Hessian H",
            ("M_K", "H_K", "M_V", "H_V"),
        ),
        TransformSpec(
            "wush-c",
            True,
            "WUSH on centered keys and values: k' = T_K (k − μ_K), v' = T_V (v − μ_V), T from the centered Grams (exact shifts)",
            ("M_K", "H_K", "M_V", "H_V", "mu_K", "mu_V", "n_K"),
        ),
        TransformSpec(
            "hadamard-c",
            True,
            "Hadamard on centered keys and values: k' = 𝓗 (k − μ_K), v' = 𝓗 (v − μ_V) (the centering alone)",
            ("mu_K", "mu_V"),
        ),
        TransformSpec(
            "wush-a",
            True,
            "WUSH with attention-aware Hessians H^A (docs/reference/math.md#31-wush-a-the-attention-aware-hessian)",
            ("M_K", "H_K_A", "M_V", "H_V_A"),
        ),
        TransformSpec(
            "wush-w",
            True,
            "WUSH with key and value Grams weighted by the squared attention each token receives while quantized",
            ("M_K_W", "H_K", "M_V_W", "H_V"),
        ),
        TransformSpec(
            "oscar",
            True,
            "OSCAR: eigenvectors of query / score-weighted value covariance times 𝓗, shared per layer",
            ("C_Q", "Sigma_V"),
        ),
        TransformSpec(
            "kvarn",
            False,
            "KVarN static part: Hadamard rotation (per-tile normalization lives in the quantizer)",
        ),
    )
}


def get_transform_spec(name: str) -> TransformSpec:
    """The :class:`TransformSpec` of ``name``; ValueError listing known names if unknown."""
    try:
        return TRANSFORMS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown transform {name!r}; known transforms: {sorted(TRANSFORMS)}") from None


def _get_stat(stats: Mapping[str, Tensor] | None, key: str, name: str, num_kv_heads: int, d: int) -> Tensor:
    if stats is None or key not in stats:
        raise ValueError(f"transform {name!r} needs calibration statistic {key!r}, which is missing from stats")
    A = stats[key]
    if not isinstance(A, Tensor) or tuple(A.shape) != (num_kv_heads, d, d):
        shape = tuple(A.shape) if isinstance(A, Tensor) else type(A).__name__
        raise ValueError(
            f"stats[{key!r}] for transform {name!r} must have shape {(num_kv_heads, d, d)}, got {shape}"
        )
    return A


def _get_mean(stats: Mapping[str, Tensor] | None, name: str, num_kv_heads: int, d: int, key: str = "mu_K") -> Tensor:
    if stats is None or key not in stats:
        raise ValueError(f"transform {name!r} needs calibration statistic {key!r} (a mean), which is missing from stats")
    mu = stats[key]
    if not isinstance(mu, Tensor) or tuple(mu.shape) != (num_kv_heads, d):
        raise ValueError(f"stats[{key!r}] for transform {name!r} must have shape {(num_kv_heads, d)}, got {tuple(getattr(mu, 'shape', ()))}")
    if not bool(torch.isfinite(mu).all()):
        raise ValueError(f"stats[{key!r}] for transform {name!r} contains NaN or inf")
    return mu


def build_transforms(
    name: str,
    num_kv_heads: int,
    head_dim: int,
    stats: Mapping[str, Tensor] | None = None,
    *,
    seed: int = 0,
    damping: float = 0.01,
    damping_M: float | None = None,
) -> LayerTransforms:
    """Build the key and value transforms of one layer.

    Args:
        name: a key of :data:`TRANSFORMS`.
        num_kv_heads, head_dim: Hkv and d.
        stats: calibration statistics, [Hkv, d, d] each (see ``TransformSpec.stats_keys``).
        seed: for "random" (keys use ``seed``, values ``seed + 1``).
        damping, damping_M: WUSH damping (see :func:`wush_transform`).

    Returns:
        :class:`LayerTransforms` with ``T_K``, ``T_K_inv``, ``T_V``, ``T_V_inv`` float32 [num_kv_heads, head_dim, head_dim];
        centered transforms (``*-c``) add ``mu_K`` and ``mu_V`` [num_kv_heads, head_dim], subtracted from keys and
        values before ``T_K`` and ``T_V``.
    """
    spec = get_transform_spec(name)
    _check_heads(num_kv_heads, head_dim)
    Hkv, d = num_kv_heads, head_dim
    if spec.name == "identity":
        T_K, T_K_inv = identity_transform(Hkv, d)
        T_V, T_V_inv = identity_transform(Hkv, d)
    elif spec.name in ("hadamard", "kvarn"):
        T_K, T_K_inv = hadamard_transform(Hkv, d)
        T_V, T_V_inv = hadamard_transform(Hkv, d)
    elif spec.name == "random":
        T_K, T_K_inv = random_orthogonal_transform(Hkv, d, seed=seed)
        T_V, T_V_inv = random_orthogonal_transform(Hkv, d, seed=seed + 1)
    elif spec.name == "hadamard-c":
        T_K, T_K_inv = hadamard_transform(Hkv, d)
        T_V, T_V_inv = hadamard_transform(Hkv, d)
        return LayerTransforms(T_K, T_K_inv, T_V, T_V_inv, mu_K=_get_mean(stats, spec.name, Hkv, d).float(),
                               mu_V=_get_mean(stats, spec.name, Hkv, d, "mu_V").float())
    elif spec.name == "wush-c":
        kM, kH, vM, vH = (_get_stat(stats, k, spec.name, Hkv, d) for k in spec.stats_keys[:4])
        mu = _get_mean(stats, spec.name, Hkv, d).double()
        mu_v = _get_mean(stats, spec.name, Hkv, d, "mu_V").double()
        n = float(stats["n_K"].reshape(-1)[0]) if "n_K" in stats else None
        if n is None or not n > 0:
            raise ValueError(f"transform {spec.name!r} needs calibration statistic 'n_K' (> 0 keys counted)")
        outer = lambda m: n * m[..., :, None] * m[..., None, :]  # noqa: E731
        T_K, T_K_inv = wush_transform(kM.double() - outer(mu), kH, damping, damping_M=damping_M)  # Σ (k − μ)(k − μ)ᵀ
        T_V, T_V_inv = wush_transform(vM.double() - outer(mu_v), vH, damping, damping_M=damping_M)
        return LayerTransforms(T_K, T_K_inv, T_V, T_V_inv, mu_K=mu.float(), mu_V=mu_v.float())
    elif spec.name in ("wush", "wush-a", "wush-w"):
        kM, kH, vM, vH = (_get_stat(stats, k, spec.name, Hkv, d) for k in spec.stats_keys)
        T_K, T_K_inv = wush_transform(kM, kH, damping, damping_M=damping_M)
        T_V, T_V_inv = wush_transform(vM, vH, damping, damping_M=damping_M)
    elif spec.name == "oscar":
        C_Q, Sigma_V = (_get_stat(stats, k, spec.name, Hkv, d) for k in spec.stats_keys)
        return oscar_transform(C_Q, Sigma_V, num_heads=Hkv)
    else:  # pragma: no cover - every registry entry is handled above
        raise AssertionError(spec.name)
    return LayerTransforms(T_K, T_K_inv, T_V, T_V_inv)
