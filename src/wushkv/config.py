"""One typed configuration of the quantized KV cache; the CLI is built from it.

Each default lives here and only here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

CONFIG_VERSION = 1
CACHE_BITS = (2, 3, 4, 8)
QUANTIZER_NAMES = ("quest", "affine", "kivi", "kvarn")
PER_TOKEN_QUANTIZERS = ("quest", "affine")  # one grid per token (group): padding, error feedback (also KVarN key tiles), clip search
TILE_KEY_QUANTIZERS = ("kvarn", "kivi")  # keys quantized per channel over tiles of S_flush tokens (KVarN's, KIVI's)
METADATA_DTYPES = ("float16", "bfloat16", "float32", "e5m3")  # stored scales/offsets; e5m3: one byte per QuEST step
CLIP_GRID = (0.7, 0.85, 1.0, 1.15, 1.3, 1.45, 1.6)  # QuEST clip multipliers on α_b that `wushkv tune-clip` walks


@dataclass(frozen=True)
class WindowConfig:
    """Full-precision windows (docs/reference/math.md#32-full-precision-windows-and-the-batched-flush): S_sink first tokens, S_keep..S_keep+S_flush−1 recent ones.

    Tokens leave the recent buffer in blocks of ``S_flush`` once it holds ``S_keep + S_flush``.
    """

    S_sink: int = 64
    S_keep: int = 256
    S_flush: int = 8

    def __post_init__(self):
        for name in ("S_sink", "S_keep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if isinstance(self.S_flush, bool) or not isinstance(self.S_flush, int) or self.S_flush < 1:
            raise ValueError(f"S_flush must be an integer >= 1, got {self.S_flush!r}")

    def quantized_count(self, n: int) -> int:
        """Qc(n): how many tokens sit in the quantized middle when the cache holds n tokens."""
        m = n - self.S_sink
        return self.S_flush * (max(0, m - self.S_keep) // self.S_flush)


GENERATION_WINDOWS = WindowConfig(64, 256, 8)
PERPLEXITY_WINDOWS = WindowConfig(16, 128, 16)
NO_WINDOWS = WindowConfig(0, 0, 1)


@dataclass(frozen=True)
class QuantConfig:
    """How the cache quantizes keys and values.

    * ``k_bits``/``v_bits``: 2, 3, 4 or 8 (None: that side stays full precision).
    * ``quantizer``: ``quest`` (RMS-scaled midrise INT, docs/reference/math.md#4-the-quest-int-quantizer), ``affine`` (percentile-clipped
      min–max, docs/reference/math.md#5-the-percentile-clipped-affine-quantizer, clip ratios ``k_clip``/``v_clip``; ≤ 0 = plain min–max), ``kivi`` (affine min–max,
      keys per channel over blocks of ``S_flush`` tokens, values per token), ``kvarn`` (KVarN tiles of
      ``S_flush`` tokens, docs/reference/math.md#7-kvarn-tiles; use windows (tile, 0, tile)).
    * ``key_quantizer``: the keys' quantizer when it is not ``quantizer`` (None: the same). ``kvarn`` with a
      per-token ``quantizer`` quantizes keys per channel in KVarN's tiles and values per token (the
      ``+ktiles`` methods, :meth:`wushkv.methods.MethodSpec.quant_config`); a tile side needs ``S_flush`` = its tile.
    * ``k_alpha``/``v_alpha``: QuEST clip multipliers on α_b (1.0 = the Gaussian optimum); from
      :data:`wushkv.quantizers.quest.UNCLIPPED_FROM` bits (8-bit caches) on each token's max |x| (no clip), and the
      affine clips ``k_clip``/``v_clip`` are not applied there.
    * ``tile_clip``: ``kvarn`` sides only: each balanced row is quantized over its mean ± tile_clip·α_b·σ
      (within its min-max) instead of its min-max; 0 = KVarN as published
      (:func:`wushkv.quantizers.kvarn.kvarn_quantize`). Same bytes.
    * ``clip_search``: per-token quantizers (quest, affine) only: 0 = the fixed clip; n > 0 = every
      token (group) picks the clip of least squared error among n + 1 candidates when it is quantized
      (same bytes, same decoder; :func:`wushkv.quantizers.search_multipliers`).
    * ``group_size``: channels per quantization group for per-token quantizers (None: head_dim).
    * ``metadata_dtype``: dtype of stored scales/offsets: float16, bfloat16, float32, or ``e5m3``, one byte per
      QuEST step (a float16 without its sign bit and 7 low mantissa bits, the codes rounded on the rounded step:
      :func:`wushkv.codecs.e5m3_round`), for QuEST's per-token sides only (KVarN tiles keep their float16 metadata).
    """

    k_bits: int | None = 2
    v_bits: int | None = 2
    quantizer: str = "quest"
    key_quantizer: str | None = None
    k_clip: float = 0.96
    v_clip: float = 0.92
    k_alpha: float = 1.0
    v_alpha: float = 1.0
    clip_search: int = 0
    tile_clip: float = 0.0
    group_size: int | None = None
    windows: WindowConfig = field(default_factory=WindowConfig)
    metadata_dtype: str = "float16"
    version: int = CONFIG_VERSION

    def __post_init__(self):
        if self.version != CONFIG_VERSION:
            raise ValueError(f"QuantConfig version {self.version!r} is not supported (this wushkv writes and reads {CONFIG_VERSION})")
        if not isinstance(self.windows, WindowConfig):
            raise ValueError(f"windows must be a WindowConfig (e.g. WindowConfig(S_sink=16, S_keep=128, S_flush=16)), got "
                             f"{self.windows!r}")
        for name in ("k_bits", "v_bits"):
            b = getattr(self, name)
            if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b not in CACHE_BITS):
                raise ValueError(f"{name}={b!r} is not supported; the cache stores {list(CACHE_BITS)} bits (an int; or None for "
                                 "full precision)")
        for name in ("k_clip", "v_clip"):
            c = getattr(self, name)
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not (-float("inf") < c <= 1.0):
                raise ValueError(f"{name}={c!r}: the affine quantizer's clip ratio must be a number <= 1 (the kept share of "
                                 "each token's |x|; <= 0: plain min-max)")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"group_size={g!r}: must be an integer >= 1 that divides head_dim (or None: head_dim)")
        if self.quantizer not in QUANTIZER_NAMES:
            raise ValueError(f"unknown quantizer {self.quantizer!r}; known: {list(QUANTIZER_NAMES)}")
        if self.key_quantizer is not None and self.key_quantizer not in QUANTIZER_NAMES:
            raise ValueError(f"unknown key quantizer {self.key_quantizer!r}; known: {list(QUANTIZER_NAMES)} (or None: the same as quantizer)")
        for name in ("k_alpha", "v_alpha"):
            a = getattr(self, name)
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0.0 < a < float("inf")):
                raise ValueError(f"{name}={a!r}: the QuEST clip multiplier must be a finite number > 0 (1.0 = α_b)")
        t = self.tile_clip
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t < float("inf")):
            raise ValueError(f"tile_clip={t!r}: must be a finite number >= 0 (multiplier on α_b·σ per tile row; 0 = KVarN's min-max)")
        c = self.clip_search
        if isinstance(c, bool) or not isinstance(c, int) or not (0 <= c <= 256):
            raise ValueError(f"clip_search={c!r}: must be an integer in 0..256 (candidate clips per token; 0 = off)")
        if c and self.quantizer not in PER_TOKEN_QUANTIZERS:
            raise ValueError(f"clip_search={c} needs a per-token quantizer (quest, affine), got {self.quantizer!r}")
        if self.metadata_dtype not in METADATA_DTYPES:
            raise ValueError(f"metadata_dtype {self.metadata_dtype!r} is not one of {', '.join(METADATA_DTYPES)}")
        if self.metadata_dtype == "e5m3":
            for side, b in (("key", self.k_bits), ("value", self.v_bits)):
                if b is not None and self.side_quantizer(side) not in ("quest", "kvarn"):
                    raise ValueError(f"metadata_dtype 'e5m3' stores one positive step per token (QuEST); the {side}s' quantizer "
                                     f"{self.side_quantizer(side)!r} stores signed offsets: use quest (or float16 metadata)")
        if "kvarn" in (self.quantizer, self.key_quantizer) and self.windows.S_flush < 2:
            raise ValueError("kvarn quantizes tiles of S_flush tokens; S_flush must be >= 2 (128 in KVarN)")

    def side_quantizer(self, side: str) -> str:
        """The quantizer of ``side`` ("key" or "value")."""
        return self.key_quantizer or self.quantizer if side == "key" else self.quantizer

    @property
    def key_tiles(self) -> bool:
        """The keys are quantized per channel over tiles of ``S_flush`` tokens (KVarN's tiles, KIVI's blocks): a tile is
        coded when its last token arrives, so an engine writes it whole."""
        return self.k_bits is not None and self.side_quantizer("key") in TILE_KEY_QUANTIZERS

    def with_windows(self, S_sink: int, S_keep: int, S_flush: int) -> QuantConfig:
        return replace(self, windows=WindowConfig(S_sink, S_keep, S_flush))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantConfig:
        d = dict(d)
        if d.get("version", CONFIG_VERSION) != CONFIG_VERSION:
            raise ValueError(f"QuantConfig version {d.get('version')} is not supported (this wushkv reads {CONFIG_VERSION})")
        w = d.pop("windows", {})
        return cls(**d, windows=WindowConfig(**w))

    @classmethod
    def current_dict(cls, d):
        """A quantization dict as this version writes it (fields added since take their defaults), JSON-shaped, for
        comparing a saved run's settings with a new one's; what cannot be read as a QuantConfig is returned as is."""
        import json

        try:
            return json.loads(json.dumps(cls.from_dict(d).to_dict()))
        except (TypeError, ValueError, AttributeError):
            return d

    def label(self) -> str:
        k = "16" if self.k_bits is None else str(self.k_bits)
        v = "16" if self.v_bits is None else str(self.v_bits)
        w = self.windows
        q = self.quantizer if self.key_quantizer in (None, self.quantizer) else f"K{self.key_quantizer}/V{self.quantizer}"
        q += f" search{self.clip_search}" if self.clip_search else ""
        q += f" clip{self.tile_clip:g}" if "kvarn" in (self.quantizer, self.key_quantizer) and self.tile_clip else ""
        return f"K{k}V{v} {q} {w.S_sink}/{w.S_keep}/{w.S_flush}"
