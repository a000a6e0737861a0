"""Low-bit quantizers for KV-cache entries and bit-exact code packing.

Every quantizer returns a :class:`QTensor` (unpacked uint8 codes + per-group float32 scale and
offset) and dequantizes with the same rule x̂ = scale·code + offset.
"""

from .affine import AffineQuantizer, percentile_clip
from .base import QTensor, dequantize
from .packing import pack, packed_nbytes, unpack
from .quest import QUEST_ALPHA, QuestQuantizer, search_multipliers
from .registry import QUANTIZERS, make_quantizer

__all__ = [
    "QTensor",
    "dequantize",
    "QuestQuantizer",
    "AffineQuantizer",
    "QUEST_ALPHA",
    "search_multipliers",
    "percentile_clip",
    "pack",
    "unpack",
    "packed_nbytes",
    "QUANTIZERS",
    "make_quantizer",
]
