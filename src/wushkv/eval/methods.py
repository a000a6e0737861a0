"""Which cache a method name stands for, installed on a model: one place for every evaluation.

* a wushkv transform (``identity``, ``hadamard``, ``random``, ``oscar``, ``kvarn``, ``wush``, ``wush-a``):
  the transform installed (values folded, keys online) and a :class:`~wushkv.cache.WushKVCache`;
* ``<transform>+tiles`` (``wush+tiles``): that transform with KVarN's tile quantizer and tile windows
  instead of the configured quantizer (``kvarn`` is ``hadamard+tiles``, the way KVarN ships);
* ``<transform>+ktiles`` (``wush+ktiles``): keys in KVarN's tiles (per channel over 128-token tiles, with the
  run's ``--tile-clip``), values with the configured per-token quantizer, under windows whose average number of
  full-precision tokens equals the configured ones' (:func:`~wushkv.eval.compare.key_tile_windows`);
  docs/ABLATIONS.md section 29: the tiles' gain on SmolLM2 is in the keys, and their published windows cost it;
* ``<keys>:<values>`` (``wush:hadamard``): the key transform of one and the value transform of the
  other (docs/ABLATIONS.md section 10: on SmolLM2 WUSH's keys carry its perplexity gain, while
  Hadamard keys keep passkey retrieval); also with ``+tiles``;
* ``<method>+ldlq`` (``wush+ldlq``): the cache rounds keys and values with error feedback (LDLQ / GPTQ
  on each cached vector, :mod:`wushkv.quantizers.feedback`) against the calibration's Hessians in the
  transformed space: same codes format and bytes, a smaller expected weighted error; ``+ldlq-k`` /
  ``+ldlq-v`` for the keys / the values only (docs/ABLATIONS.md section 15: on SmolLM2 the values gain at
  2 bits and the keys lose); needs a calibration and a per-token quantizer (quest, affine). With ``+ktiles``
  the keys' feedback runs along the channel rows of each tile, every row's grid taken after the earlier rows'
  errors were pushed onto it (docs/ABLATIONS.md section 30: there the keys gain); ``+tiles+ldlq-k`` does the same
  with both sides in tiles (tile values have no feedback);
* ``<method>+signs<N>`` (``wush+signs3``): the WUSH-family sides (``wush``, ``wush-a``, ``wush-c``) with the
  N-th random sign pattern on their eigenvectors, another exact WUSH solution
  (:func:`wushkv.transforms.wush.with_signs`); compare a few to see how much of a margin is WUSH's own
  free choice (docs/ABLATIONS.md section 16). The patterns are drawn relative to the calibration's
  stored transforms;
* ``<method>+rmean`` (``wush+rmean``): keys centered on their rotating mean. The calibration's pre-RoPE
  key mean μ (``mu_K_pre``) becomes R_t μ at position t; the cache quantizes T (k_t − R_t μ) and adds
  T R_t μ back when it reads (exact; :class:`wushkv.folding.KeyTransform`). docs/ABLATIONS.md section 18:
  on Gemma-3 it cuts 2-bit degradation sharply, on SmolLM2 it costs perplexity;
* ``stock-<backend>-<bits>`` (``stock-hqq-2``, ``stock-quanto-4``, ...): the stock ``transformers``
  ``QuantizedCache`` on the unmodified model, the baseline users have today (backends: the optional
  extra ``wushkv[stock]``);
* ``full-precision``: ``DynamicCache``;
* ``auto`` (``compare``, ``generate``, ``agree``, ``passkey``): per model, quantizer and width, the WUSH variant
  chosen on held-out C4 (:data:`AUTO_RECIPES`, :data:`AUTO_AFFINE_RECIPES`, :func:`auto_method`); resolved to one
  of the names above, with its own quantizer settings, before anything runs.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from ..cache import WushKVCache
from ..config import QuantConfig

FULL_PRECISION = "full-precision"
STOCK_BACKENDS = ("quanto", "hqq")
TILES_SUFFIX = "+tiles"
KTILES_SUFFIX = "+ktiles"
LDLQ_SUFFIX = "+ldlq"
LDLQ_SIDES = {LDLQ_SUFFIX: "KV", "+ldlq-k": "K", "+ldlq-v": "V"}  # suffix -> sides rounded with feedback
RMEAN_SUFFIX = "+rmean"
SUFFIXES = (TILES_SUFFIX, KTILES_SUFFIX, RMEAN_SUFFIX, *LDLQ_SIDES)
SIGNS_SUFFIX = "+signs"  # + a pattern number: "+signs3"
_SIGNS = re.compile(r"\+signs(\d+)$")
SIGNED_TRANSFORMS = ("wush", "wush-a", "wush-c", "wush-w")  # T = c·𝓗·Λ^{-1/4}·Uᵀ·Lᵀ: each eigenvector's sign is free


def method_suffixes(name: str) -> tuple[str, tuple[str, ...]]:
    """(transform part, suffixes): ("wush", ("+ldlq",)) for "wush+ldlq", ("wush", ("+signs2", "+tiles"))
    for "wush+signs2+tiles"."""
    found: list[str] = []
    while True:
        m = _SIGNS.search(name)
        if m and m.start() > 0:
            found.insert(0, m.group())
            name = name[: m.start()]
            continue
        for suf in SUFFIXES:
            if name.endswith(suf) and len(name) > len(suf):
                name = name[: -len(suf)]
                found.insert(0, suf)
                break
        else:
            return name, tuple(found)


def sign_pattern(name: str) -> int | None:
    """N of a ``+signsN`` suffix, or None."""
    for s in method_suffixes(name)[1]:
        if s.startswith(SIGNS_SUFFIX):
            return int(s[len(SIGNS_SUFFIX):])
    return None


def method_transform(name: str) -> str:
    """The transform a method installs: ``wush`` for ``wush+tiles`` or ``wush+ldlq``."""
    return method_suffixes(name)[0]


def ldlq_sides(name: str) -> str:
    """The sides ("K", "V", "KV") a method rounds with error feedback; "" for none."""
    sides = "".join(LDLQ_SIDES[s] for s in method_suffixes(name)[1] if s in LDLQ_SIDES)
    return "".join(c for c in "KV" if c in sides)


def uses_ldlq(name: str) -> bool:
    """Whether the cache of a method rounds with error feedback (``+ldlq``, ``+ldlq-k``, ``+ldlq-v``)."""
    return bool(ldlq_sides(name))


SIDES_SEP = ":"


def method_sides(name: str) -> tuple[str, str]:
    """(key transform, value transform) a method installs: ("wush", "hadamard") for "wush:hadamard",
    ("wush", "wush") for "wush" or "wush+tiles"."""
    t = method_transform(name)
    if SIDES_SEP not in t:
        return t, t
    k, _, v = t.partition(SIDES_SEP)
    if "kvarn" in (k, v):  # KVarN is hadamard + its tiles: a side alone would silently drop the tiles
        raise ValueError(f"method {name!r}: kvarn cannot be one side of KEYS{SIDES_SEP}VALUES (it is Hadamard with KVarN's tiles); "
                         f"use hadamard on that side and the suffix {TILES_SUFFIX!r}, e.g. hadamard{SIDES_SEP}wush{TILES_SUFFIX}")
    return k, v


def is_transform_method(name: str) -> bool:
    """Whether ``name`` installs wushkv transforms (a transform, ``+tiles``, or ``keys:values``)."""
    from ..transforms import TRANSFORMS

    return all(side in TRANSFORMS for side in method_sides(name))


def uses_wush_a(name: str) -> bool:
    """Whether a method reads WUSH-A's attention-aware statistics (``wush-a`` as either side)."""
    return "wush-a" in method_sides(name)


def needs_calibration(name: str) -> bool:
    from ..transforms import TRANSFORMS

    if name == AUTO:
        return True
    return is_transform_method(name) and (uses_ldlq(name) or uses_rmean(name) or any(TRANSFORMS[side].needs_calibration for side in method_sides(name)))


def uses_rmean(name: str) -> bool:
    """Whether a method centers its keys on their rotating pre-RoPE mean (``+rmean``)."""
    return RMEAN_SUFFIX in method_suffixes(name)[1]


AUTO = "auto"  # per model, quantizer and width, the WUSH variant chosen on held-out C4: :func:`auto_method`


def generation_method(calibration, cfg: QuantConfig) -> str:
    """What ``auto`` runs where no recipe of :data:`AUTO_AFFINE_RECIPES` or :data:`AUTO_RECIPES` applies: WUSH
    with its keys centered on their rotating pre-RoPE mean (``wush+rmean``) under the affine quantizer when
    the calibration holds that mean, plain ``wush`` otherwise.

    Chosen on held-out C4 (the calibration's domain; documents no calibration reads, never the evaluation
    text) in the generation setting, K2V2 affine 64/256/8: centering lowers 2-bit perplexity there on both
    models (SmolLM2 +2.91% -> +1.26%, Gemma-3 +1.83% -> +1.68%), and it is what keeps SmolLM2's passkey
    to 8k (docs/GENERATION.md). With QuEST it loses on SmolLM2's held-out C4, so other quantizers get
    plain WUSH. A calibration made before the mean was stored gets plain WUSH too.
    """
    return "wush" + RMEAN_SUFFIX if cfg.quantizer == "affine" and _has_rope_mean(calibration) else "wush"


def _has_rope_mean(calibration) -> bool:
    """Whether every layer of the calibration holds the pre-RoPE key mean ``+rmean`` centers on."""
    return calibration is not None and bool(calibration.stats) and all("mu_K_pre" in st for st in calibration.stats)


@dataclass(frozen=True)
class Recipe:
    """One cell of :data:`AUTO_RECIPES`: a WUSH method, the QuEST clip multipliers it runs at (on α_b) and, for
    a ``+tiles`` or ``+ktiles`` method, its tile clip (:attr:`~wushkv.config.QuantConfig.tile_clip`)."""

    method: str
    k_alpha: float = 1.0
    v_alpha: float = 1.0
    tile_clip: float = 0.0


# What ``auto`` runs with the QuEST quantizer at K = V bits: per model (the names ``wushkv.models.load`` takes)
# and width, the WUSH variant that held-out C4 picked (documents no calibration reads, never the evaluation
# text; windows 16/128/16), from the calibration recipe of AUTO_CALIBRATION (wushkv calibrate is deterministic,
# so that recipe gives every user the same file). Evidence: docs/ABLATIONS.md sections 24, 25, 27, 28, 29 and 30.
AUTO_RECIPES: dict[str, dict[int, Recipe]] = {
    "smollm2-135m": {2: Recipe("wush+ktiles+ldlq", tile_clip=3.0), 3: Recipe("wush+ktiles+ldlq", tile_clip=1.7), 4: Recipe("wush+ktiles+ldlq")},
    "gemma3-270m": {2: Recipe("wush+ldlq", k_alpha=1.15, v_alpha=1.45), 3: Recipe("wush+ktiles+ldlq", tile_clip=1.7),
                    4: Recipe("wush+ktiles+ldlq", tile_clip=1.7)},
}
# What ``auto`` runs with the affine quantizer (the generation setting of `generate`, `agree` and `passkey`: κ_K 0.96,
# κ_V 0.92, windows 64/256/8) at K = V bits, per model and width (docs/GENERATION.md "Keys in tiles with error
# feedback"): on SmolLM2 at K2V2 centered keys in tiles with error feedback. Held-out C4 (K2V2, 4 × 2048) ranks
# ``wush+ktiles+ldlq`` first, but it loses SmolLM2's 1k passkey; the centered variant keeps it, ties ``wush+rmean`` on
# held-out C4 and has 0.68× its long-generation KL. Models and widths not listed get :func:`generation_method`.
AUTO_AFFINE_RECIPES: dict[str, dict[int, Recipe]] = {
    "smollm2-135m": {2: Recipe("wush+rmean+ktiles+ldlq", tile_clip=1.7)},
}
AUTO_CALIBRATION: dict[str, tuple[int, int]] = {"smollm2-135m": (32, 2048), "gemma3-270m": (16, 2048)}  # samples, tokens


def auto_method(model_key: str | None, calibration, cfg: QuantConfig) -> tuple[str, QuantConfig]:
    """The method (and its quantizer settings) that ``auto`` stands for, in ``compare``, ``generate``, ``agree``
    and ``passkey``:

    * QuEST at K = V bits on a model of :data:`AUTO_RECIPES`: that model's recipe at that width (its clip
      multipliers multiply the configured ones; a ``+tiles`` / ``+ktiles`` recipe sets its tile clip, and
      ``config_for`` then gives it the tiles' quantizer and windows);
    * the affine quantizer at K = V bits on a model and width of :data:`AUTO_AFFINE_RECIPES`: that recipe;
      at other models and widths, or when the recipe centers keys and the calibration predates the pre-RoPE
      mean, :func:`generation_method` (``wush+rmean`` when the calibration holds that mean, else ``wush``);
    * anything else: the paper recipe, ``wush``.
    """
    from dataclasses import replace

    table = {"quest": AUTO_RECIPES, "affine": AUTO_AFFINE_RECIPES}.get(cfg.quantizer, {})
    recipe = table.get(model_key or "", {}).get(cfg.k_bits) if cfg.k_bits == cfg.v_bits else None
    if recipe is not None and uses_rmean(recipe.method) and not _has_rope_mean(calibration):
        recipe = None  # a calibration made before the pre-RoPE mean was stored: what it can run
    if recipe is None:
        return (generation_method(calibration, cfg) if cfg.quantizer == "affine" else "wush"), cfg
    cfg = replace(cfg, k_alpha=cfg.k_alpha * recipe.k_alpha, v_alpha=cfg.v_alpha * recipe.v_alpha)
    return recipe.method, (replace(cfg, tile_clip=recipe.tile_clip) if recipe.tile_clip else cfg)


def describe_resolved(method: str, cfg: QuantConfig) -> str:
    """``wush+ktiles+ldlq (tile clip 1.7)``: what ``auto`` resolved to, with the settings its recipe changed."""
    extra = []
    if cfg.quantizer == "quest" and (cfg.k_alpha, cfg.v_alpha) != (1.0, 1.0):
        extra.append(f"αK×{cfg.k_alpha:g} αV×{cfg.v_alpha:g}")
    if (uses_tiles(method) or uses_key_tiles(method)) and cfg.tile_clip:
        extra.append(f"tile clip {cfg.tile_clip:g}")
    return method + (f" ({', '.join(extra)})" if extra else "")


def auto_calibration_note(model_key: str | None, calibration) -> str | None:
    """A line to print when ``auto``'s choices were made with another calibration recipe than ``calibration``'s."""
    want = AUTO_CALIBRATION.get(model_key or "")
    if want is None or calibration is None:
        return None
    have = (calibration.meta.get("samples"), calibration.meta.get("seq_len"))
    if have == want:
        return None
    return (f"note: auto's choices for {model_key} were made on held-out C4 with a {want[0]} x {want[1]} calibration; this one is "
            f"{have[0]} x {have[1]} (wushkv calibrate --samples {want[0]} --seq-len {want[1]} makes that file)")


def uses_tiles(name: str) -> bool:
    """Whether a method quantizes with KVarN's tiles (its own quantizer and windows)."""
    return method_transform(name) == "kvarn" or TILES_SUFFIX in method_suffixes(name)[1]


def uses_key_tiles(name: str) -> bool:
    """Whether a method quantizes its keys in KVarN's tiles and its values per token (``+ktiles``)."""
    return KTILES_SUFFIX in method_suffixes(name)[1]


def parse_stock(name: str) -> tuple[str, int] | None:
    """("hqq", 2) for "stock-hqq-2"; None for other names; ValueError for a malformed stock name."""
    if not name.startswith("stock-"):
        return None
    parts = name.split("-")
    if len(parts) != 3 or parts[1] not in STOCK_BACKENDS or parts[2] not in ("2", "4"):
        raise ValueError(f"stock cache {name!r}: expected stock-<backend>-<bits> with backend in {list(STOCK_BACKENDS)} and bits 2 or 4")
    return parts[1], int(parts[2])


def check_methods(names: list[str]) -> None:
    from ..transforms import TRANSFORMS

    for n in names:
        if n == AUTO:
            raise ValueError(f"{AUTO!r} is resolved per model and width by `compare`, `generate`, `agree` and `passkey` only; "
                             "here name a method, e.g. the one `compare` printed for it")
        if n == FULL_PRECISION or parse_stock(n) is not None:
            continue
        if not is_transform_method(n):
            raise ValueError(f"unknown method {n!r}; known: {sorted(TRANSFORMS)}, each optionally with the suffix "
                             f"{TILES_SUFFIX!r} (KVarN's tile quantizer), {KTILES_SUFFIX!r} (keys in KVarN's tiles), "
                             f"{LDLQ_SUFFIX!r} (error-feedback rounding), "
                             f"{RMEAN_SUFFIX!r} (keys centered on their rotating pre-RoPE mean) or "
                             f"{SIGNS_SUFFIX}N (WUSH's N-th eigenvector sign pattern), "
                             f"KEYS{SIDES_SEP}VALUES (e.g. wush{SIDES_SEP}hadamard: "
                             f"the key transform of one, the value transform of the other), stock-<quanto|hqq>-<2|4>, {FULL_PRECISION}")
        if "V" in ldlq_sides(n) and uses_tiles(n):
            raise ValueError(f"method {n!r}: {LDLQ_SUFFIX!r} (error-feedback rounding) cannot be combined with KVarN's tiles on "
                             f"both sides ({TILES_SUFFIX!r}, kvarn): tile values have no feedback; use '+ldlq-k' (keys only), "
                             f"or {KTILES_SUFFIX!r} for per-token values (e.g. wush{KTILES_SUFFIX}{LDLQ_SUFFIX})")
        if uses_key_tiles(n) and uses_tiles(n):
            raise ValueError(f"method {n!r}: {KTILES_SUFFIX!r} puts the keys in KVarN's tiles; it cannot be combined with "
                             f"{TILES_SUFFIX!r}/kvarn (both sides in tiles)")
        if sum(s in LDLQ_SIDES for s in method_suffixes(n)[1]) > 1:
            raise ValueError(f"method {n!r}: use one of {list(LDLQ_SIDES)}")
        signs = [s for s in method_suffixes(n)[1] if s.startswith(SIGNS_SUFFIX)]
        if len(signs) > 1:
            raise ValueError(f"method {n!r}: one {SIGNS_SUFFIX}N suffix at most")
        if signs and int(signs[0][len(SIGNS_SUFFIX):]) < 1:
            raise ValueError(f"method {n!r}: sign patterns are numbered from 1 ({SIGNS_SUFFIX}1, {SIGNS_SUFFIX}2, ...)")
        if signs and not any(side in SIGNED_TRANSFORMS for side in method_sides(n)):
            raise ValueError(f"method {n!r}: {SIGNS_SUFFIX}N draws eigenvector signs of {list(SIGNED_TRANSFORMS)}; "
                             f"this method has none ({'/'.join(method_sides(n))})")


def mix_sides(keys: list[dict], values: list[dict]) -> list[dict]:
    """Per-layer transforms with the key side (T_K, its inverse, μ_K) of ``keys`` and the value side
    (T_V, its inverse, μ_V) of ``values``."""
    def side(tr: dict, s: str) -> dict:
        return {k: t for k, t in tr.items() if k in (f"T_{s}", f"T_{s}_inv", f"mu_{s}")}

    return [side(k, "K") | side(v, "V") for k, v in zip(keys, values, strict=True)]


def feedback_hessians(calibration, name: str) -> list[dict]:
    """Per layer, the Hessians the cache's error feedback weighs keys and values by: the calibration's
    H_K and H_V (WUSH-A's attention-aware ones for a ``wush-a`` side), [Hkv, d, d] float64."""
    ks, vs = method_sides(name)
    keys = ("H_K_A" if ks == "wush-a" else "H_K", "H_V_A" if vs == "wush-a" else "H_V")
    out = []
    for st in calibration.stats:
        missing = [k for k in keys if k not in st]
        if missing:
            raise ValueError(f"method {name!r} needs calibration statistics {missing} for its error feedback; recalibrate")
        out.append({"K": st[keys[0]], "V": st[keys[1]]})
    return out


def with_feedback(trs: list[dict], hessians: list[dict], damping: float = 0.01, sides: str = "KV") -> list[dict]:
    """Add ``F_K``/``F_V`` (for ``sides``) to per-layer transforms: the feedback matrices of the Hessians seen
    in the transformed space, T^{-T} H T⁻¹ (the cached vector is T x, its error e costs eᵀ T^{-T} H T⁻¹ e)."""
    from ..quantizers.feedback import feedback_matrix

    out = []
    for tr, hs in zip(trs, hessians, strict=True):
        f = {}
        for s in sides:
            Ti = tr[f"T_{s}_inv"].double()
            Hs = Ti.mT @ hs[s].double().to(Ti.device) @ Ti
            f[f"F_{s}"] = feedback_matrix(Hs, damping)
        out.append(tr | f)
    return out


def with_sign_pattern(trs: list[dict], sides: tuple[str, str], pattern: int) -> list[dict]:
    """Per-layer transforms with the ``pattern``-th random sign pattern on the eigenvectors of the sides
    (keys, values) whose transform is in :data:`SIGNED_TRANSFORMS` (the others unchanged). The draws go
    layer by layer, keys then values, from one generator seeded with ``pattern``, for every side alike,
    so a pattern is the same whichever sides it applies to."""
    import torch

    from ..transforms.wush import with_signs

    gen = torch.Generator().manual_seed(int(pattern))
    out = []
    for tr in trs:
        new = dict(tr)
        for s, t in zip("KV", sides):
            D = torch.randint(0, 2, tr[f"T_{s}"].shape[:-1], generator=gen).double() * 2 - 1
            if t in SIGNED_TRANSFORMS:
                new[f"T_{s}"], new[f"T_{s}_inv"] = with_signs(tr[f"T_{s}"], tr[f"T_{s}_inv"], D.to(tr[f"T_{s}"].device))
        out.append(new)
    return out


def transforms_for(model, calibration, transform: str):
    """Per-layer transforms of ``transform`` (or of a method ``transform+tiles`` / ``+ldlq`` / ``+signsN``):
    from the calibration, or built (calibration-free ones); ``+signsN`` redraws the eigenvector signs of
    the WUSH sides, then ``+ldlq`` adds the feedback matrices of the transforms so obtained."""
    from ..models import describe
    from ..transforms import TRANSFORMS, build_transforms

    if uses_rmean(transform):
        base, sufs = method_suffixes(transform)
        if calibration is None:
            raise ValueError(f"method {transform!r} centers keys on the calibration's pre-RoPE key mean; it needs a calibration (--calibration PATH)")
        if any("mu_K_pre" not in st for st in calibration.stats):
            raise ValueError(f"method {transform!r} needs the pre-RoPE key mean (mu_K_pre), which this calibration file predates; "
                             "make a new one with `wushkv calibrate`, or add the mean to this file's statistics (same transforms) "
                             "with `python benchmarks/add_rope_mean.py --calibration FILE --out NEW` in a source checkout")
        trs = transforms_for(model, calibration, base + "".join(s for s in sufs if s != RMEAN_SUFFIX))
        return [t | {"mu_K_rope": st["mu_K_pre"].float()} for t, st in zip(trs, calibration.stats)]
    if uses_ldlq(transform):
        if calibration is None:
            raise ValueError(f"method {transform!r} rounds with error feedback from calibration Hessians; it needs a calibration (--calibration PATH)")
        base, sufs = method_suffixes(transform)
        trs = transforms_for(model, calibration, base + "".join(s for s in sufs if s not in LDLQ_SIDES))
        return with_feedback(trs, feedback_hessians(calibration, base), calibration.meta.get("damping", 0.01), ldlq_sides(transform))
    pattern = sign_pattern(transform)
    transform = method_transform(transform)
    if SIDES_SEP in transform:
        ks, vs = method_sides(transform)
        trs = mix_sides(transforms_for(model, calibration, ks), transforms_for(model, calibration, vs))
    elif calibration is not None:
        trs = calibration.transforms(transform)
    elif TRANSFORMS[transform].needs_calibration:
        raise ValueError(f"transform {transform!r} needs a calibration (--calibration PATH)")
    else:
        spec = describe(model)
        trs = [build_transforms(transform, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    return trs if pattern is None else with_sign_pattern(trs, method_sides(transform), pattern)


@contextmanager
def method_cache(model, calibration, name: str, cfg: QuantConfig):
    """Install method ``name`` on ``model`` for the duration; yields a factory of fresh caches."""
    from transformers import DynamicCache

    from ..folding import apply_transforms
    from .compare import config_for

    stock = parse_stock(name)
    if name == FULL_PRECISION:
        yield lambda: DynamicCache(config=model.config)
    elif stock is not None:
        from transformers import QuantizedCache

        backend, bits = stock
        try:
            __import__("optimum.quanto" if backend == "quanto" else "hqq")
        except ImportError as e:
            raise ValueError(f"{name} needs the {backend} package: pip install 'wushkv[stock]' ({e})") from None
        yield lambda: QuantizedCache(backend=backend, config=model.config, nbits=bits)
    else:
        c = config_for(name, cfg)
        with apply_transforms(model, transforms_for(model, calibration, name), name):
            yield lambda: WushKVCache(model, c)
