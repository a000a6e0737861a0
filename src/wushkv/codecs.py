"""Codecs: how one side (keys or values) of a KV head is stored in the quantized middle.

A codec turns a block of tokens ``x`` (B, H, N, d) (transformed space) into a dict of tensors that
all grow along dim 2 (tokens or token blocks), and back:

* ``encode(x)`` → storage: packed ``uint8`` codes (B, H, N, ⌈d·b/8⌉) plus metadata;
* ``decode(storage, N)`` → float32 (B, H, N, d);
* ``fake(x)`` → ``decode(encode(x))`` bit for bit, without packing (used by the single-pass emulation).

``block`` is the token alignment a codec needs (1 for per-token quantizers; the flush size for
KIVI-style per-channel keys and KVarN tiles): the cache only ever encodes whole blocks that start on
the flush grid, so the emulation sees exactly what streaming would store.
"""

from __future__ import annotations

import torch

from .config import PER_TOKEN_QUANTIZERS, QuantConfig
from .quantizers import AffineQuantizer, QuestQuantizer, pack, packed_nbytes, unpack
from .quantizers.base import QTensor, dequantize
from .quantizers.feedback import feedback_round
from .quantizers.kvarn import KVarNTiles, kvarn_dequantize, kvarn_quantize
from .quantizers.quest import UNCLIPPED_FROM

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "e5m3": torch.float16}
E5M3_MAX = 0xF7  # the largest E5M3 byte: 61440 (0xF8 << 7 is float16's infinity)


def e5m3_round(x: torch.Tensor, up: bool = False) -> torch.Tensor:
    """float16 of positive steps ``x`` rounded to E5M3 (metadata dtype ``e5m3``): a float16 without its sign bit
    (steps are positive) and its 7 low mantissa bits, so one byte; 5 exponent bits keep float16's range (2^-24 to
    61440), 3 mantissa bits put neighbours 6-12% apart. Rounded half up on float16's bit pattern (monotone across its
    subnormals), as :func:`wushkv._ext`'s paged store rounds it; ``up``: to the next byte at or above instead (a step
    that must span each token's largest |x|, QuEST's from ``UNCLIPPED_FROM`` bits: rounded down, it clamped them)."""
    h = x.to(torch.float16).view(torch.int16).to(torch.int32)
    return e5m3_decode(((h + (127 if up else 64)) >> 7).clamp_(0, E5M3_MAX).to(torch.uint8))


def e5m3_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 bytes of float16 steps already on the E5M3 grid (:func:`e5m3_round`)."""
    return (x.view(torch.int16) >> 7).to(torch.uint8)


def e5m3_decode(b: torch.Tensor) -> torch.Tensor:
    """float16 steps of E5M3 bytes ``b`` (uint8): the byte is float16's bits 14..7."""
    return (b.to(torch.int16) << 7).view(torch.float16)


class TokenCodec:
    """Per-token groups along head_dim: QuEST (only the step Δ is stored) or affine (scale and offset).

    With ``feedback`` (heads, d, d), the codes are rounded with error feedback on the quantizer's own
    grid (:mod:`wushkv.quantizers.feedback`): same storage, same decoder, a smaller weighted error.

    ``step_byte``: QuEST's step is stored in one byte (metadata dtype ``e5m3``, :func:`e5m3_round`), and the codes are
    rounded on that rounded step, so the stored grid is the one the codes were made on (``scale`` is then uint8).
    """

    block = 1

    def __init__(self, quantizer, head_dim: int, metadata_dtype: torch.dtype, feedback: torch.Tensor | None = None,
                 step_byte: bool = False):
        if feedback is not None and tuple(feedback.shape[-2:]) != (head_dim, head_dim):
            raise ValueError(f"feedback must be (heads, {head_dim}, {head_dim}), got {tuple(feedback.shape)}")
        if step_byte and not isinstance(quantizer, QuestQuantizer):
            raise ValueError(f"one-byte steps (e5m3) are for QuEST, whose only metadata is a positive step; got {type(quantizer).__name__}")
        self.step_byte = step_byte
        self.feedback = feedback
        self.quantizer = quantizer
        self.bits = quantizer.bits
        self.d = head_dim
        self.meta_dtype = metadata_dtype
        self.symmetric = isinstance(quantizer, QuestQuantizer)  # offset = (½ − 2^{b−1})·Δ
        self._half = 0.5 - 2 ** (self.bits - 1)

    def grid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The grid tokens x [..., d] are stored on: (scale, offset or None (symmetric)) in the metadata dtype
        (float16 for ``e5m3``), [..., d/G], and G."""
        scale, offset, G = self.quantizer.grid(x.float())
        # from UNCLIPPED_FROM bits QuEST's step spans each token's max |x| exactly: one byte rounded down would clamp it
        scale = e5m3_round(scale, up=self.bits >= UNCLIPPED_FROM) if self.step_byte else scale.to(self.meta_dtype)
        return scale, None if self.symmetric else offset.to(self.meta_dtype), G

    def _quant(self, x):
        if self.feedback is None and not self.step_byte:  # the quantizer's own rounding, its grid stored as it is
            q = self.quantizer.quantize(x.float())
            scale = q.scale.to(self.meta_dtype)
            offset = None if self.symmetric else q.offset.to(self.meta_dtype)
            return q.codes, scale, offset, q.group_size
        scale, offset, G = self.grid(x)  # the grid alone, then codes rounded on it as stored
        s, o = self.scale_offset({"scale": scale} | ({} if offset is None else {"offset": offset}))
        if self.feedback is not None:
            return feedback_round(x, s, o, self.bits, G, self.feedback), scale, offset, G
        # one-byte steps: QuEST's ⌊x/Δ⌋ on the rounded step (one rounded to 0 decodes to zeros)
        half = 2 ** (self.bits - 1)
        xg = x.float().reshape(*x.shape[:-1], -1, G)
        q = torch.floor(xg / s.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).clamp_(-half, half - 1)
        return (q + half).to(torch.uint8).reshape(x.shape), scale, None, G

    def _dequant(self, codes, scale, offset, group_size):
        s, o = self.scale_offset({"scale": scale} | ({} if offset is None else {"offset": offset}))
        return dequantize(QTensor(codes, s, o, self.bits, group_size))

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale, offset, _ = self._quant(x)
        out = {"codes": pack(codes, self.bits, check=False), "scale": e5m3_encode(scale) if self.step_byte else scale}
        if offset is not None:
            out["offset"] = offset
        return out

    def decode(self, s: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        codes = unpack(s["codes"], self.bits, self.d)
        return self._dequant(codes, s["scale"], s.get("offset"), self.d // s["scale"].shape[-1])

    def fake(self, x: torch.Tensor) -> torch.Tensor:
        return self._dequant(*self._quant(x))

    def scale_offset(self, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-group float32 (scale, offset) of stored tokens: x̂ = scale·code + offset."""
        scale = s["scale"]
        scale = (e5m3_decode(scale) if scale.dtype == torch.uint8 else scale).float()
        return scale, (scale * self._half if "offset" not in s else s["offset"].float())


class ChannelCodec:
    """KIVI-style keys: affine min–max per channel over blocks of ``block`` tokens."""

    def __init__(self, bits: int, head_dim: int, block: int, metadata_dtype: torch.dtype, clip: float = 0.0):
        self.quantizer = AffineQuantizer(bits, group_size=block, clip_ratio=clip, axis=-2)
        self.bits, self.d, self.block, self.meta_dtype = bits, head_dim, block, metadata_dtype

    def _quant(self, x):
        q = self.quantizer.quantize(x.float())
        return q.codes, q.scale.to(self.meta_dtype), q.offset.to(self.meta_dtype)

    def _dequant(self, codes, scale, offset):
        return dequantize(QTensor(codes, scale.float(), offset.float(), self.bits, self.block, axis=-2))

    def encode(self, x):
        codes, scale, offset = self._quant(x)
        return {"codes": pack(codes, self.bits, check=False), "scale": scale, "offset": offset}

    def decode(self, s, n):
        return self._dequant(unpack(s["codes"], self.bits, self.d), s["scale"], s["offset"])

    def fake(self, x):
        return self._dequant(*self._quant(x))


class KVarNCodec:
    """KVarN tiles of ``block`` tokens (docs/reference/math.md#7-kvarn-tiles) on Hadamard-rotated keys or values.

    With ``feedback`` (heads, d, d), keys only: each tile's channel rows are rounded one after another
    with error feedback (:func:`wushkv.quantizers.kvarn.kvarn_quantize`); same storage and decoder."""

    def __init__(self, bits: int, head_dim: int, block: int, kind: str, clip: float = 0.0, feedback: torch.Tensor | None = None):
        if feedback is not None and (kind != "key" or tuple(feedback.shape[-2:]) != (head_dim, head_dim)):
            raise ValueError(f"tile feedback is for keys, (heads, {head_dim}, {head_dim}); got kind {kind!r}, "
                             f"{tuple(feedback.shape)}")
        self.bits, self.d, self.block, self.kind, self.clip = bits, head_dim, block, kind, clip
        self.feedback = feedback

    def _quant(self, x):
        return kvarn_quantize(x.float(), self.bits, self.kind, tile=self.block, clip=self.clip, feedback=self.feedback)

    def encode(self, x):
        t = self._quant(x)
        return {"codes": pack(t.codes, self.bits, check=False), "scale": t.scale, "zero": t.zero, "s_fold": t.s_fold}

    def decode(self, s, n):
        codes = unpack(s["codes"], self.bits, self.d)
        return kvarn_dequantize(KVarNTiles(codes, s["scale"], s["zero"], s["s_fold"], self.bits, self.kind, self.block))

    def fake(self, x):
        return kvarn_dequantize(self._quant(x))


def make_codec(cfg: QuantConfig, side: str, head_dim: int, feedback: torch.Tensor | None = None):
    """The codec for ``side`` ("key" or "value") of a cache configured by ``cfg``; None = full precision.

    ``feedback`` (heads, d, d): round with error feedback (per-token quantizers, and KVarN's key tiles
    along their channels)."""
    bits = cfg.k_bits if side == "key" else cfg.v_bits
    if bits is None:
        return None
    meta = _DTYPES[cfg.metadata_dtype]
    step_byte = cfg.metadata_dtype == "e5m3"  # QuEST sides only (QuantConfig checks)
    quantizer = cfg.side_quantizer(side)
    if feedback is not None and quantizer not in PER_TOKEN_QUANTIZERS and not (quantizer == "kvarn" and side == "key"):
        raise ValueError(f"error-feedback rounding (+ldlq) needs a per-token quantizer (quest, affine) or KVarN's key tiles, "
                         f"got {quantizer!r} for the {side}s")
    if quantizer == "quest":
        alpha = cfg.k_alpha if side == "key" else cfg.v_alpha
        return TokenCodec(QuestQuantizer(bits, cfg.group_size, alpha_scale=alpha, search=cfg.clip_search), head_dim, meta, feedback,
                          step_byte=step_byte)
    if quantizer == "affine":
        clip = cfg.k_clip if side == "key" else cfg.v_clip
        return TokenCodec(AffineQuantizer(bits, cfg.group_size, clip_ratio=clip, search=cfg.clip_search), head_dim, meta, feedback)
    if quantizer == "kivi":
        if side == "key":
            return ChannelCodec(bits, head_dim, cfg.windows.S_flush, meta)
        return TokenCodec(AffineQuantizer(bits, cfg.group_size, clip_ratio=0.0), head_dim, meta)
    if quantizer == "kvarn":
        return KVarNCodec(bits, head_dim, cfg.windows.S_flush, side, clip=cfg.tile_clip, feedback=feedback)
    raise ValueError(f"unknown quantizer {quantizer!r}")


# what each quantizer reads of QuantConfig, per side (the key side's clip fields start with k_, the value side's with
# v_): the fields make_codec hands it. The affine clip only below UNCLIPPED_FROM bits (plain min-max from there on)
_READ_BY = {
    "quest": ("{s}_alpha", "group_size", "clip_search", "metadata_dtype"),
    "affine": ("{s}_clip", "group_size", "clip_search", "metadata_dtype"),
    "kivi": {"key": ("metadata_dtype",), "value": ("group_size", "metadata_dtype")},
    "kvarn": ("tile_clip",),
}


def settings_read(cfg: QuantConfig) -> frozenset[str]:
    """The settings a cache configured by ``cfg`` reads: the names of :class:`~wushkv.config.QuantConfig`'s fields,
    and of :class:`~wushkv.config.WindowConfig`'s for its windows, that change what it stores. The rest change
    nothing: the affine clips under QuEST, QuEST's α under affine, the tile clip without KVarN tiles, a full-precision
    side's everything. What lets a command refuse a setting it would silently ignore (``wushkv.cli``), and what
    ``tests/quantizers/test_settings_read.py`` holds to :func:`make_codec`'s output."""
    read = {"k_bits", "v_bits"}
    for side, bits in (("key", cfg.k_bits), ("value", cfg.v_bits)):
        if bits is None:
            continue
        read |= {"S_sink", "S_keep", "S_flush"}
        read.add("key_quantizer" if side == "key" and cfg.key_quantizer is not None else "quantizer")
        if side == "key":
            read.add("key_quantizer")  # given, it decides the keys' quantizer even where it names --quantizer's
        q = cfg.side_quantizer(side)
        fields = _READ_BY[q][side] if isinstance(_READ_BY[q], dict) else _READ_BY[q]
        read |= {f.format(s=side[0]) for f in fields if not (q == "affine" and f.startswith("{s}_clip") and bits >= UNCLIPPED_FROM)}
    return frozenset(read)


def storage_nbytes(s: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(code bytes, metadata bytes) of a codec storage dict."""
    codes = s["codes"].numel() * s["codes"].element_size()
    meta = sum(t.numel() * t.element_size() for k, t in s.items() if k != "codes")
    return codes, meta


__all__ = ["ChannelCodec", "KVarNCodec", "TokenCodec", "e5m3_decode", "e5m3_encode", "e5m3_round", "make_codec", "packed_nbytes", "settings_read", "storage_nbytes"]
