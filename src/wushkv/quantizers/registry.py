"""Name → quantizer class registry, used by the cache and the CLI."""

from __future__ import annotations

from typing import Any

from .affine import AffineQuantizer
from .base import check_bits
from .quest import QuestQuantizer

__all__ = ["QUANTIZERS", "make_quantizer"]

QUANTIZERS: dict[str, type] = {
    "quest": QuestQuantizer,
    "affine": AffineQuantizer,
}


def make_quantizer(name: str, bits: int, **kwargs: Any) -> QuestQuantizer | AffineQuantizer:
    """Instantiate ``QUANTIZERS[name](bits, **kwargs)``.

    Raises:
        ValueError: unknown name (lists the known ones) or bits outside 1..8.
    """
    try:
        cls = QUANTIZERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantizer {name!r}; known quantizers: {sorted(QUANTIZERS)}") from None
    check_bits(bits)
    return cls(bits, **kwargs)
