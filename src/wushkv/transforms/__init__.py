"""Invertible d×d transforms applied to keys/values before quantization.

Every builder returns float32 (T, T_inv) of shape [num_heads, d, d] in the column convention:
the cache stores x' = T x (rows: ``x @ T.mT``), and ``x' @ T_inv.mT`` recovers x.

KVarN's per-tile normalization and rounding is a quantizer: :mod:`wushkv.quantizers.kvarn`
(its transform, the normalized Hadamard rotation, is built here as ``"kvarn"``).
"""

from __future__ import annotations

from .hadamard import hadamard_matrix, hadamard_transform, is_full_hadamard
from .orthogonal import identity_transform, oscar_rotation, oscar_transform, random_orthogonal_transform
from .per_layer import LayerTransforms
from .registry import TRANSFORMS, TransformSpec, build_transforms, get_transform_spec
from .rope import rope_rotate
from .wush import wush_transform

__all__ = [
    "hadamard_matrix",
    "hadamard_transform",
    "is_full_hadamard",
    "identity_transform",
    "random_orthogonal_transform",
    "oscar_rotation",
    "oscar_transform",
    "wush_transform",
    "TransformSpec",
    "TRANSFORMS",
    "build_transforms",
    "get_transform_spec",
    "rope_rotate",
    "LayerTransforms",
]

