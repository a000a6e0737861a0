"""What a method is: a typed description, its name grammar, and the quantizer settings it implies.

A *method* is what an evaluation runs through the cache. Every method has one canonical name, and the
name grammar is only a spelling of a :class:`MethodSpec`:

* a transform (``identity``, ``hadamard``, ``random``, ``oscar``, ``kvarn``, ``wush``, ``wush-a``, ...):
  that transform on both sides, keys and values quantized per token by the configured quantizer;
* ``KEYS:VALUES`` (``wush:hadamard``): the key transform of one and the value transform of the other;
* suffixes, in any order (the canonical name lists them in :data:`SUFFIX_ORDER`):

  - ``+signsN``: the N-th random sign pattern on the eigenvectors of the WUSH-family sides (another exact
    WUSH solution; N ≥ 1);
  - ``+coverN``: the calibration's key-space statistics averaged over the positions of an N-token context before
    the transforms are solved (:func:`wushkv.calibration.cover_positions`), for contexts longer than the
    calibration's sequences;
  - ``+rmean``: keys centered on their rotating pre-RoPE mean (``key_centering="rope-mean"``);
  - ``+tiles``: both sides in KVarN's tiles, with KVarN's windows (``kvarn`` is ``hadamard``'s transform
    with these tiles, the way KVarN ships); ``+ktiles``: the keys alone in tiles, values per token;
  - ``+ldlq`` / ``+ldlq-k`` / ``+ldlq-v``: rounding with error feedback on both sides / the keys / the values;

* ``full-precision`` (:class:`FullPrecision`: transformers' ``DynamicCache``), ``stock-<quanto|hqq>-<2|4>``
  (:class:`StockCache`: the stock ``QuantizedCache``) and ``auto`` (:data:`AUTO`: resolved per model,
  quantizer and width by :func:`wushkv.methods.auto.resolve_auto` before anything runs).

``parse(name)`` and ``canonical_name(method)`` are inverse on canonical names; :func:`grammar_help` and
:func:`grammar_markdown` are the one place the grammar is described for ``--help`` and the docs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Union

from ..config import PER_TOKEN_QUANTIZERS, QuantConfig, WindowConfig
from ..transforms.registry import TRANSFORMS

FULL_PRECISION_NAME = "full-precision"
AUTO_NAME = "auto"
STOCK_BACKENDS = ("quanto", "hqq")
STOCK_BITS = (2, 4)
SIDES_SEP = ":"
KVARN = "kvarn"  # the transform KVarN ships with its tiles: never one side of KEYS:VALUES, always with tiles
KVARN_TILE = 128  # tokens per KVarN tile
SIGNED_TRANSFORMS = ("wush", "wush-a", "wush-c", "wush-w")  # T = c·𝓗·Λ^{-1/4}·Uᵀ·Lᵀ: each eigenvector's sign is free
CENTERED_TRANSFORMS = ("wush-c", "hadamard-c")  # keys shifted by a constant mean μ_K before the transform
LAYOUTS = ("token", "tiles")  # how one side is quantized: per token (the configured quantizer) or in KVarN's tiles
CENTERINGS = ("none", "rope-mean")
FEEDBACK_SIDES = ("", "K", "V", "KV")

# suffix -> what it sets; the canonical name writes them in this order
SUFFIX_ORDER = ("+signsN", "+coverN", "+rmean", "+tiles", "+ktiles", "+ldlq", "+ldlq-k", "+ldlq-v")
SUFFIX_HELP = {
    "+signsN": "WUSH's N-th random eigenvector sign pattern (N >= 1; another exact WUSH solution)",
    "+coverN": "the calibration's key statistics covered to the positions of an N-token context before solving (N longer than "
               "its sequences; what `wushkv calibration cover` writes to a file)",
    "+rmean": "keys centered on their rotating pre-RoPE mean (needs a calibration holding it)",
    "+tiles": "both sides in KVarN's tiles and windows instead of the configured quantizer",
    "+ktiles": "keys in KVarN's tiles, values per token by the configured quantizer",
    "+ldlq": "rounding with error feedback (LDLQ) on keys and values (needs a calibration and quest/affine)",
    "+ldlq-k": "error feedback on the keys only",
    "+ldlq-v": "error feedback on the values only",
}
_LDLQ = {"+ldlq": "KV", "+ldlq-k": "K", "+ldlq-v": "V"}
_TOKEN = re.compile(r"\+(signs\d+|cover\d+|rmean|tiles|ktiles|ldlq-k|ldlq-v|ldlq)(?=\+|$)")


@dataclass(frozen=True)
class MethodSpec:
    """A wushkv method: transforms installed on the model and how the cache stores each side.

    * ``key_transform`` / ``value_transform``: names in :data:`wushkv.transforms.TRANSFORMS` (the key one is
      applied online after RoPE, the value one folded into the weights);
    * ``key_layout`` / ``value_layout``: ``"token"`` (the configured per-token quantizer) or ``"tiles"``
      (KVarN's tiles of :data:`KVARN_TILE` tokens); values in tiles need keys in tiles;
    * ``feedback``: the sides ("K", "V", "KV"; "" for none) rounded with error feedback against the
      calibration's Hessians in the transformed space (same bytes, a smaller weighted error);
    * ``key_centering``: ``"none"`` or ``"rope-mean"`` (the cache quantizes T (k_t − R_t μ) and adds T R_t μ back);
    * ``signs``: N of the WUSH sign pattern drawn on the WUSH-family sides, or None;
    * ``cover``: N, the positions (tokens of context) the calibration's key-space statistics are averaged over
      before anything is solved from them (:func:`wushkv.calibration.cover_positions`), or None for the file's own.

    Frozen and hashable; two specs are equal exactly when they describe the same method (``kvarn`` and
    ``hadamard+tiles`` build the same matrices but stay two methods, as KVarN ships and as our Hadamard under its tiles).
    """

    key_transform: str
    value_transform: str | None = None  # None: the same as key_transform
    key_layout: str = "token"
    value_layout: str = "token"
    feedback: str = ""
    key_centering: str = "none"
    signs: int | None = None
    cover: int | None = None

    def __post_init__(self):
        if self.value_transform is None:
            object.__setattr__(self, "value_transform", self.key_transform)
        for side, t in (("key_transform", self.key_transform), ("value_transform", self.value_transform)):
            if t not in TRANSFORMS:
                raise ValueError(f"unknown transform {t!r} ({side}); known: {sorted(TRANSFORMS)}")
        for name, v, allowed in (("key_layout", self.key_layout, LAYOUTS), ("value_layout", self.value_layout, LAYOUTS),
                                 ("feedback", self.feedback, FEEDBACK_SIDES), ("key_centering", self.key_centering, CENTERINGS)):
            if v not in allowed:
                raise ValueError(f"{name}={v!r}; accepted: {list(allowed)}")
        if KVARN in (self.key_transform, self.value_transform):
            if self.key_transform != self.value_transform:
                raise ValueError(f"{KVARN} cannot be one side of KEYS{SIDES_SEP}VALUES (it is Hadamard with KVarN's tiles); "
                                 f"use hadamard on that side and the suffix '+tiles', e.g. hadamard{SIDES_SEP}wush+tiles")
            if (self.key_layout, self.value_layout) != ("tiles", "tiles"):
                raise ValueError(f"{KVARN} quantizes both sides in its tiles; it has no per-token layout "
                                 f"(got keys {self.key_layout!r}, values {self.value_layout!r})")
        if self.key_centering == "rope-mean" and self.key_transform in CENTERED_TRANSFORMS:
            raise ValueError(f"+rmean centers keys on their rotating mean; {self.key_transform} already centers them on a "
                             "constant mean (mu_K), and the two are exclusive")
        if self.value_layout == "tiles" and self.key_layout != "tiles":
            raise ValueError("values in KVarN's tiles need keys in tiles too ('+tiles'); '+ktiles' puts the keys alone in tiles")
        if "V" in self.feedback and self.value_layout == "tiles":
            raise ValueError("error feedback on the values cannot be combined with KVarN's tiles on both sides ('+tiles', kvarn): "
                             "tile values have no feedback; use '+ldlq-k' (keys only), or '+ktiles' for per-token values "
                             "(e.g. wush+ktiles+ldlq)")
        if self.signs is not None:
            if isinstance(self.signs, bool) or not isinstance(self.signs, int) or self.signs < 1:
                raise ValueError(f"signs={self.signs!r}: sign patterns are numbered from 1 (+signs1, +signs2, ...)")
            if not (self.key_transform in SIGNED_TRANSFORMS or self.value_transform in SIGNED_TRANSFORMS):
                raise ValueError(f"+signsN draws eigenvector signs of {list(SIGNED_TRANSFORMS)}; this method has none "
                                 f"({self.key_transform}/{self.value_transform})")
        if self.cover is not None:
            if isinstance(self.cover, bool) or not isinstance(self.cover, int) or self.cover < 2:
                raise ValueError(f"cover={self.cover!r}: +coverN covers the statistics to an N-token context, N a whole number >= 2 "
                                 "(e.g. +cover8192)")
            if not self.needs_calibration:
                raise ValueError(f"+cover{self.cover} covers calibration statistics; this method reads none "
                                 f"({self.key_transform}/{self.value_transform} without +ldlq or +rmean)")

    # --- what the method needs -------------------------------------------------------------------
    @property
    def sides(self) -> tuple[str, str]:
        """(key transform, value transform)."""
        return self.key_transform, self.value_transform

    @property
    def tiles(self) -> bool:
        """Both sides in KVarN's tiles (``+tiles``, ``kvarn``): KVarN's quantizer and windows."""
        return self.value_layout == "tiles"

    @property
    def key_tiles(self) -> bool:
        """Keys alone in KVarN's tiles, values per token (``+ktiles``)."""
        return self.key_layout == "tiles" and self.value_layout == "token"

    @property
    def rope_mean(self) -> bool:
        return self.key_centering == "rope-mean"

    @property
    def uses_wush_a(self) -> bool:
        """Whether it reads WUSH-A's attention-aware statistics."""
        return "wush-a" in self.sides

    @property
    def needs_calibration(self) -> bool:
        return bool(self.feedback) or self.rope_mean or any(TRANSFORMS[t].needs_calibration for t in self.sides)

    @property
    def name(self) -> str:
        return canonical_name(self)

    def quant_config(self, base: QuantConfig) -> QuantConfig:
        """The quantizer settings this method runs at, from the configured ones.

        Both sides in tiles bring KVarN's quantizer and tile windows (the first tile stays in full precision,
        new tokens wait in a full-precision tail until a tile fills; a per-token clip search does not apply to
        tiles and is dropped). Keys alone in tiles keep the configured per-token quantizer for the values
        under :func:`key_tile_windows`. Error feedback needs a per-token quantizer."""
        if self.feedback and base.quantizer not in PER_TOKEN_QUANTIZERS:
            raise ValueError(f"method {self.name!r}: error-feedback rounding (+ldlq) needs a per-token quantizer (quest, affine), "
                             f"got --quantizer {base.quantizer!r}")
        if self.tiles:
            return replace(base, quantizer="kvarn", key_quantizer=None, clip_search=0, windows=WindowConfig(KVARN_TILE, 0, KVARN_TILE))
        if self.key_tiles:
            if base.quantizer not in PER_TOKEN_QUANTIZERS:
                raise ValueError(f"method {self.name!r}: +ktiles quantizes the values per token; it needs --quantizer quest or "
                                 f"affine, got {base.quantizer!r}")
            return replace(base, key_quantizer="kvarn", windows=key_tile_windows(base.windows))
        return base

    @property
    def overrides(self) -> frozenset[str]:
        """The settings :meth:`quant_config` sets whatever they were configured to (names of QuantConfig's and
        WindowConfig's fields): both sides in tiles bring KVarN's quantizer, windows and no clip search; keys in tiles
        their quantizer (the windows of :func:`key_tile_windows` are computed from the configured ones)."""
        if self.tiles:
            return frozenset({"quantizer", "key_quantizer", "clip_search", "S_sink", "S_keep", "S_flush"})
        return frozenset({"key_quantizer"}) if self.key_tiles else frozenset()


def key_tile_windows(w: WindowConfig, tile: int = KVARN_TILE) -> WindowConfig:
    """The windows of a ``+ktiles`` method: flushes of one ``tile``, the same sink, and a recent window shortened
    so that the average number of full-precision tokens equals ``w``'s: S_sink + S_keep + (S_flush − 1)/2 there,
    S_sink + S_keep' + (tile − 1)/2 here, so S_keep' = S_keep + (S_flush − tile)/2 (at least 0). 16/128/16
    becomes 16/72/128 and 64/256/8 becomes 64/196/128."""
    return WindowConfig(w.S_sink, max(0, w.S_keep + (w.S_flush - tile) // 2), tile)


@dataclass(frozen=True)
class FullPrecision:
    """transformers' ``DynamicCache``, the ceiling every method is measured against."""

    @property
    def name(self) -> str:
        return FULL_PRECISION_NAME

    needs_calibration = False


@dataclass(frozen=True)
class StockCache:
    """The stock transformers ``QuantizedCache`` (``backend`` quanto or hqq, ``bits`` 2 or 4) on the unmodified model."""

    backend: str
    bits: int

    def __post_init__(self):
        if self.backend not in STOCK_BACKENDS or self.bits not in STOCK_BITS:
            raise ValueError(f"stock cache stock-{self.backend}-{self.bits}: expected stock-<backend>-<bits> with backend in "
                             f"{list(STOCK_BACKENDS)} and bits 2 or 4")

    @property
    def name(self) -> str:
        return f"stock-{self.backend}-{self.bits}"

    needs_calibration = False


@dataclass(frozen=True)
class Auto:
    """``auto``: per model, quantizer and width, the WUSH variant a selection chose on held-out text; resolved to a
    :class:`MethodSpec` and its settings by :func:`wushkv.methods.auto.resolve_auto` before anything runs."""

    @property
    def name(self) -> str:
        return AUTO_NAME

    needs_calibration = True


FULL_PRECISION = FullPrecision()
AUTO = Auto()
Method = Union[MethodSpec, FullPrecision, StockCache, Auto]


class UnknownMethodError(ValueError):
    """A name the grammar does not spell (as opposed to a known spelling of a combination that is refused)."""


def _unknown(name: str) -> UnknownMethodError:
    return UnknownMethodError(f"unknown method {name!r}; " + grammar_help())


def parse(name: str | Method) -> Method:
    """The method a name stands for (a :class:`MethodSpec`, :data:`FULL_PRECISION`, a :class:`StockCache` or
    :data:`AUTO`); a method passes through. Raises ValueError naming the bad part and what is accepted."""
    if isinstance(name, (MethodSpec, FullPrecision, StockCache, Auto)):
        return name
    if not isinstance(name, str) or not name:
        raise ValueError(f"method name must be a non-empty string, got {name!r}")
    if name == FULL_PRECISION_NAME:
        return FULL_PRECISION
    if name == AUTO_NAME:
        return AUTO
    if name.startswith("stock-"):
        parts = name.split("-")
        if len(parts) != 3 or parts[1] not in STOCK_BACKENDS or parts[2] not in ("2", "4"):
            raise ValueError(f"stock cache {name!r}: expected stock-<backend>-<bits> with backend in {list(STOCK_BACKENDS)} and bits 2 or 4")
        return StockCache(parts[1], int(parts[2]))
    base, plus, rest = name.partition("+")
    rest = plus + rest  # "" without suffixes; "+" alone (a dangling "wush+") matches no suffix below
    tokens = _TOKEN.findall(rest)
    if "".join("+" + t for t in tokens) != rest:
        raise _unknown(name)
    if not base:
        raise _unknown(name)
    k, sep, v = base.partition(SIDES_SEP)
    if sep and (not k or not v or SIDES_SEP in v):
        raise _unknown(name)
    v = v if sep else k
    if k not in TRANSFORMS or v not in TRANSFORMS:
        raise _unknown(name)
    seen = [("+signsN" if t.startswith("signs") else "+coverN" if t.startswith("cover") else "+" + t) for t in tokens]
    dup = sorted({s for s in seen if seen.count(s) > 1})
    if dup:
        raise ValueError(f"method {name!r}: suffix {dup[0]!r} given twice")
    ldlq = [s for s in seen if s in _LDLQ]
    if len(ldlq) > 1:
        raise ValueError(f"method {name!r}: use one of {list(_LDLQ)}")
    if "+tiles" in seen and "+ktiles" in seen:
        raise ValueError(f"method {name!r}: '+ktiles' puts the keys in KVarN's tiles; it cannot be combined with '+tiles'/kvarn (both sides in tiles)")
    tiles = "+tiles" in seen or k == KVARN
    if "+ktiles" in seen and tiles:
        raise ValueError(f"method {name!r}: '+ktiles' puts the keys in KVarN's tiles; it cannot be combined with '+tiles'/kvarn (both sides in tiles)")
    signs = next((int(t[len("signs"):]) for t in tokens if t.startswith("signs")), None)
    cover = next((int(t[len("cover"):]) for t in tokens if t.startswith("cover")), None)
    try:
        return MethodSpec(
            key_transform=k, value_transform=v,
            key_layout="tiles" if tiles or "+ktiles" in seen else "token",
            value_layout="tiles" if tiles else "token",
            feedback=_LDLQ[ldlq[0]] if ldlq else "",
            key_centering="rope-mean" if "+rmean" in seen else "none",
            signs=signs, cover=cover,
        )
    except ValueError as e:
        raise ValueError(f"method {name!r}: {e}") from None


def canonical_name(method: str | Method) -> str:
    """The one name of a method: transform part, then suffixes in :data:`SUFFIX_ORDER` (``kvarn`` needs no ``+tiles``)."""
    m = parse(method)
    if not isinstance(m, MethodSpec):
        return m.name
    out = m.key_transform if m.key_transform == m.value_transform else f"{m.key_transform}{SIDES_SEP}{m.value_transform}"
    if m.signs is not None:
        out += f"+signs{m.signs}"
    if m.cover is not None:
        out += f"+cover{m.cover}"
    if m.rope_mean:
        out += "+rmean"
    if m.tiles and m.key_transform != KVARN:
        out += "+tiles"
    elif m.key_tiles:
        out += "+ktiles"
    if m.feedback:
        out += {"KV": "+ldlq", "K": "+ldlq-k", "V": "+ldlq-v"}[m.feedback]
    return out


def method_config(method: str | Method, base: QuantConfig) -> QuantConfig:
    """The quantizer settings ``method`` runs at: a wushkv method's :meth:`MethodSpec.quant_config`, ``base`` for
    any other (full precision, stock caches and an unresolved ``auto`` quantize nothing of ours)."""
    m = parse(method)
    return m.quant_config(base) if isinstance(m, MethodSpec) else base


def settings_read(method: str | Method, base: QuantConfig) -> frozenset[str]:
    """The configured settings (names of QuantConfig's and WindowConfig's fields) that change what ``method`` runs at
    ``base``: what its cache reads (:func:`wushkv.codecs.settings_read`) less what the method sets itself
    (:attr:`MethodSpec.overrides`). Full precision and stock caches read none; ``auto``, not yet resolved, whatever
    the recipes it may stand for read (plain, ``+ktiles`` or ``+tiles``: a recipe's clips multiply the configured
    ones). A method that refuses ``base`` reads none (its own check says why)."""
    from ..codecs import settings_read as cache_reads

    m = parse(method)
    if m is AUTO:
        return frozenset().union(*(settings_read(f"wush{s}", base) for s in ("", "+ktiles", "+tiles")))
    if not isinstance(m, MethodSpec):
        return frozenset()
    try:
        cfg = m.quant_config(base)
    except ValueError:
        return frozenset()
    return cache_reads(cfg) - m.overrides


# what each setting sets, for the refusal of one that changes nothing (names of QuantConfig's and WindowConfig's fields)
SETTING_SETS = {
    "k_bits": "the keys' width", "v_bits": "the values' width", "quantizer": "the quantizer",
    "key_quantizer": "the keys' quantizer",
    "k_clip": "the affine quantizer's key clip (below 5 bits)", "v_clip": "the affine quantizer's value clip (below 5 bits)",
    "k_alpha": "QuEST's key clip multiplier", "v_alpha": "QuEST's value clip multiplier",
    "clip_search": "the clip search of the per-token quantizers (quest, affine)",
    "tile_clip": "the clip of KVarN's tiles (kvarn, +tiles, +ktiles, --key-quantizer kvarn)",
    "group_size": "the channels per group of the per-token quantizers (quest, affine, kivi's values)",
    "metadata_dtype": "the stored scales of quest, affine and kivi (KVarN's tiles keep float16)",
    "S_sink": "the full-precision sink", "S_keep": "the full-precision recent window",
    "S_flush": "the tokens quantized per flush",
}


def refuse_unread(runs, given: dict[str, str], set_here: dict[str, str] | None = None, none_read: str | None = None) -> None:
    """A ValueError for the first setting of ``given`` that changes nothing ``runs`` run: a silently ignored setting
    would pass for a result (``--k-clip`` under QuEST, ``--flush`` with ``+tiles``).

    ``runs``: (method, configured QuantConfig) pairs (:func:`settings_read` says what each reads; a method the
    configuration cannot run is refused first, by its own check); ``given``: {setting: how it was given, e.g.
    ``--k-clip 0.9`` or ``k_clip=0.9``} (names of QuantConfig's and WindowConfig's fields); ``set_here``: {setting: why
    the caller sets it itself} (``compare``'s ``--bits`` sets both widths); ``none_read``: the message where no run
    reads any setting (e.g. ``ppl`` without ``--transform``)."""
    if not given:
        return
    runs = list(runs)
    ran = [(m, method_config(m, c)) for m, c in runs]  # raises where a method cannot run at its configuration
    read = frozenset().union(*(settings_read(m, cfg) for m, cfg in runs))
    for setting, shown in given.items():
        if set_here and setting in set_here:
            raise ValueError(f"{shown} changes nothing here: {set_here[setting]}")
        if setting in read:
            continue
        if not read and none_read:
            raise ValueError(f"{shown}: {none_read}")
        # what each method runs at (its quantizers, widths and windows), or why it reads none of these settings
        what: dict[tuple[str, str], list[str]] = {}  # (method, quantizers and windows) -> widths
        for m, c in ran:
            if isinstance(parse(m), MethodSpec) or parse(m) is AUTO:
                widths, rest = c.label().split(" ", 1)
                what.setdefault((parse(m).name, rest), []).append(widths)
            else:
                what.setdefault((parse(m).name, ""), [])
        ran_as = "; ".join(f"{name} at {'/'.join(dict.fromkeys(w))} {rest}" if rest else f"{name}: not a wushkv cache"
                           for (name, rest), w in what.items())
        raise ValueError(f"{shown} changes nothing here: it sets {SETTING_SETS.get(setting, setting)}, which no method "
                         f"of this run reads ({ran_as}); drop it, or name a method or quantizer that reads it")


def spec_of(method: str | Method, what: str = "this command") -> MethodSpec:
    """``method`` as a :class:`MethodSpec`; a clear error for full precision, stock caches and an unresolved ``auto``."""
    m = parse(method)
    if isinstance(m, MethodSpec):
        return m
    if m is AUTO:
        raise ValueError(f"{AUTO_NAME!r} is resolved per model and width by `compare`, `generate`, `agree` and `passkey` only; "
                         "here name a method, e.g. the one `compare` printed for it")
    raise ValueError(f"{m.name!r} installs no wushkv transform; {what} takes a wushkv method ({grammar_help()})")


def grammar_help() -> str:
    """One line for ``--help`` and errors: what a method name may be."""
    return (f"a method is a transform ({', '.join(sorted(TRANSFORMS))}) or KEYS{SIDES_SEP}VALUES (the key transform of one, "
            f"the value transform of the other), with optional suffixes in any order: "
            + ", ".join(f"{s} ({h})" for s, h in SUFFIX_HELP.items())
            + f"; or {FULL_PRECISION_NAME}, stock-<{'|'.join(STOCK_BACKENDS)}>-<2|4>, {AUTO_NAME}")


def grammar_markdown() -> str:
    """The method-name reference (docs/reference/methods.md between its GENERATED markers), generated here so it cannot drift."""
    lines = ["| part | meaning |", "|---|---|"]
    for name in sorted(TRANSFORMS):
        t = TRANSFORMS[name]
        lines.append(f"| `{name}` | {t.description}{' (needs a calibration)' if t.needs_calibration else ''} |")
    lines.append(f"| `KEYS{SIDES_SEP}VALUES` | the key transform of one, the value transform of the other (e.g. `wush{SIDES_SEP}hadamard`); "
                 f"`{KVARN}` cannot be one side |")
    for s, h in SUFFIX_HELP.items():
        lines.append(f"| `{s}` | {h} |")
    lines += [f"| `{FULL_PRECISION_NAME}` | transformers' `DynamicCache` (the ceiling) |",
              "| `stock-<" + "\\|".join(STOCK_BACKENDS) + ">-<2\\|4>` | the stock transformers `QuantizedCache` on the unmodified model |",
              f"| `{AUTO_NAME}` | per model, quantizer and width, the WUSH variant `wushkv select` chose on held-out text (`wushkv.methods.auto`) |"]
    return ("Suffixes may come in any order; results are keyed by the canonical name, which writes them in the order "
            + ", ".join(f"`{s}`" for s in SUFFIX_ORDER) + ".\n\n" + "\n".join(lines) + "\n")
