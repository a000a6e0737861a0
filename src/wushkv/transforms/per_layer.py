"""The transforms of one attention layer, as one typed object.

Every tensor is per KV head, in the column convention of :mod:`wushkv.transforms` (the cache stores
k' = T_K k, rows ``k @ T_K.mT``). The four matrices are always there; the rest only when a method needs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from torch import Tensor

MATRICES = ("T_K", "T_K_inv", "T_V", "T_V_inv")


@dataclass(frozen=True, eq=False)
class LayerTransforms:
    """One layer's transforms.

    * ``T_K``, ``T_K_inv`` [Hkv, d, d]: the key transform, applied online after RoPE (queries get T_K^{-T});
    * ``T_V``, ``T_V_inv`` [Hkv, d, d]: the value transform, folded into v_proj / o_proj;
    * ``mu_K``, ``mu_V`` [Hkv, d]: constant shifts subtracted before the transform (centered transforms, ``*-c``);
    * ``mu_K_rope`` [Hkv, d]: the pre-RoPE key mean the cache centers the middle's keys on (``+rmean``);
    * ``F_K``, ``F_V`` [Hkv, d, d]: the error-feedback matrices the cache rounds keys / values with (``+ldlq``).
    """

    T_K: Tensor
    T_K_inv: Tensor
    T_V: Tensor
    T_V_inv: Tensor
    mu_K: Tensor | None = None
    mu_V: Tensor | None = None
    mu_K_rope: Tensor | None = None
    F_K: Tensor | None = None
    F_V: Tensor | None = None

    def tensors(self) -> dict[str, Tensor]:
        """The tensors held, by field name (for files and checksums)."""
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor]) -> LayerTransforms:
        """From tensors named as the fields (a file's); a name that is not a field is refused, naming the accepted ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(tensors) - known)
        missing = [k for k in MATRICES if k not in tensors]
        if unknown or missing:
            raise ValueError(f"layer transforms: unknown {unknown}, missing {missing}; accepted: {sorted(known)} "
                             f"({', '.join(MATRICES)} required)")
        return cls(**tensors)

    def replace(self, **changes) -> LayerTransforms:
        return replace(self, **changes)

    def side(self, s: str) -> dict[str, Tensor | None]:
        """The key (``s`` = "K") or value ("V") side: its matrix, inverse and shift, by field name."""
        if s not in ("K", "V"):
            raise ValueError(f"side {s!r}: 'K' or 'V'")
        return {f"T_{s}": getattr(self, f"T_{s}"), f"T_{s}_inv": getattr(self, f"T_{s}_inv"), f"mu_{s}": getattr(self, f"mu_{s}")}
