"""Invertible d×d transforms applied to keys/values before quantization.

Every builder returns float32 (T, T_inv) of shape [num_heads, d, d] in the column convention:
the cache stores x' = T x (rows: ``x @ T.mT``), and ``x' @ T_inv.mT`` recovers x.

``wushkv.transforms.kvarn`` (KVarN's per-tile normalization) is imported lazily, on first
attribute access, so importing this package stays cheap and free of side effects.
"""

from __future__ import annotations

import importlib
from typing import Any

from .hadamard import hadamard_matrix, hadamard_transform, is_full_hadamard
from .orthogonal import identity_transform, oscar_rotation, oscar_transform, random_orthogonal_transform
from .registry import TRANSFORMS, TransformSpec, build_transforms, get_transform_spec
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
]


def __getattr__(name: str) -> Any:
    if name == "kvarn":
        return importlib.import_module(f"{__name__}.kvarn")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
