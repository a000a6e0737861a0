"""``auto``: per model, quantizer and width, the WUSH variant chosen on held-out C4, as a :class:`MethodSpec`.

The choices were made on held-out C4 (documents no calibration reads, never the evaluation text), from the
calibration recipe of :data:`AUTO_CALIBRATION` (``wushkv calibrate`` is deterministic, so that recipe gives
every user the same file). Evidence: docs/lab/README.md (the entries on tuned clips, error feedback per width,
tile clips, ``auto``'s picks, key tiles and key-tile feedback) and docs/results.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import QuantConfig
from .spec import MethodSpec, parse


@dataclass(frozen=True)
class Recipe:
    """One cell of :data:`AUTO_RECIPES`: a WUSH method, the QuEST clip multipliers it runs at (on α_b) and, for a
    method with tiles, its tile clip (:attr:`~wushkv.config.QuantConfig.tile_clip`; 0 = the configured one)."""

    method: MethodSpec
    k_alpha: float = 1.0
    v_alpha: float = 1.0
    tile_clip: float = 0.0


def _r(name: str, **kw) -> Recipe:
    return Recipe(parse(name), **kw)


# What ``auto`` runs with the QuEST quantizer at K = V bits, per model (the names ``wushkv.models.load`` takes) and
# width (windows 16/128/16).
AUTO_RECIPES: dict[str, dict[int, Recipe]] = {
    "smollm2-135m": {2: _r("wush+ktiles+ldlq", tile_clip=3.0), 3: _r("wush+ktiles+ldlq", tile_clip=1.7), 4: _r("wush+ktiles+ldlq")},
    "gemma3-270m": {2: _r("wush+ldlq", k_alpha=1.15, v_alpha=1.45), 3: _r("wush+ktiles+ldlq", tile_clip=1.7),
                    4: _r("wush+ktiles+ldlq", tile_clip=1.7)},
}
# What ``auto`` runs with the affine quantizer (the generation setting of `generate`, `agree` and `passkey`: κ_K 0.96,
# κ_V 0.92, windows 64/256/8) at K = V bits (docs/results.md, generation): on SmolLM2 at K2V2 centered keys in tiles
# with error feedback. Held-out C4 (K2V2, 4 × 2048) ranks ``wush+ktiles+ldlq`` first, but it loses SmolLM2's 1k passkey;
# the centered variant keeps it, ties ``wush+rmean`` on held-out C4 and has 0.68× its long-generation KL. Models and
# widths not listed get :func:`generation_method`.
AUTO_AFFINE_RECIPES: dict[str, dict[int, Recipe]] = {
    "smollm2-135m": {2: _r("wush+rmean+ktiles+ldlq", tile_clip=1.7)},
}
AUTO_CALIBRATION: dict[str, tuple[int, int]] = {"smollm2-135m": (32, 2048), "gemma3-270m": (16, 2048)}  # samples, tokens
WUSH = parse("wush")
WUSH_RMEAN = parse("wush+rmean")


@dataclass(frozen=True)
class Resolved:
    """What ``auto`` stands for at one setting: the method, ``base`` the configured quantization with the recipe's
    settings (clip multipliers, tile clip), and ``config`` what it runs at, ``method.quant_config(base)``."""

    method: MethodSpec
    base: QuantConfig

    @property
    def config(self) -> QuantConfig:
        return self.method.quant_config(self.base)

    def describe(self) -> str:
        return describe_resolved(self.method, self.config)


def has_rope_mean(calibration) -> bool:
    """Whether every layer of the calibration holds the pre-RoPE key mean ``+rmean`` centers on."""
    return calibration is not None and bool(calibration.stats) and all("mu_K_pre" in st for st in calibration.stats)


def generation_method(calibration, cfg: QuantConfig) -> MethodSpec:
    """What ``auto`` runs where no recipe applies: WUSH with its keys centered on their rotating pre-RoPE mean
    (``wush+rmean``) under the affine quantizer when the calibration holds that mean, plain ``wush`` otherwise.

    Chosen on held-out C4 in the generation setting, K2V2 affine 64/256/8: centering lowers 2-bit perplexity there
    on both models (SmolLM2 +2.91% -> +1.26%, Gemma-3 +1.83% -> +1.68%), and it is what keeps SmolLM2's passkey to 8k.
    With QuEST it loses on SmolLM2's held-out C4, so other quantizers get plain WUSH. A calibration made before
    the mean was stored gets plain WUSH too."""
    return WUSH_RMEAN if cfg.quantizer == "affine" and has_rope_mean(calibration) else WUSH


def resolve_auto(model_key: str | None, calibration, cfg: QuantConfig) -> Resolved:
    """The method and settings ``auto`` stands for (``compare``, ``generate``, ``agree``, ``passkey``):

    * QuEST at K = V bits on a model of :data:`AUTO_RECIPES`: that model's recipe at that width (its clip
      multipliers multiply the configured ones; a recipe with tiles sets its tile clip);
    * the affine quantizer at K = V bits on a model and width of :data:`AUTO_AFFINE_RECIPES`: that recipe;
      at other models and widths, or when the recipe centers keys and the calibration predates the pre-RoPE
      mean, :func:`generation_method`;
    * anything else: the paper recipe, ``wush``.
    """
    table = {"quest": AUTO_RECIPES, "affine": AUTO_AFFINE_RECIPES}.get(cfg.quantizer, {})
    recipe = table.get(model_key or "", {}).get(cfg.k_bits) if cfg.k_bits == cfg.v_bits else None
    if recipe is not None and recipe.method.rope_mean and not has_rope_mean(calibration):
        recipe = None  # a calibration made before the pre-RoPE mean was stored: what it can run
    if recipe is None:
        method = generation_method(calibration, cfg) if cfg.quantizer == "affine" else WUSH
        return Resolved(method, cfg)
    cfg = replace(cfg, k_alpha=cfg.k_alpha * recipe.k_alpha, v_alpha=cfg.v_alpha * recipe.v_alpha)
    if recipe.tile_clip:
        cfg = replace(cfg, tile_clip=recipe.tile_clip)
    return Resolved(recipe.method, cfg)


def describe_resolved(method, cfg: QuantConfig) -> str:
    """``wush+ktiles+ldlq (tile clip 1.7)``: what ``auto`` resolved to, with the settings its recipe changed."""
    m = parse(method)
    extra = []
    if cfg.quantizer == "quest" and (cfg.k_alpha, cfg.v_alpha) != (1.0, 1.0):
        extra.append(f"αK×{cfg.k_alpha:g} αV×{cfg.v_alpha:g}")
    if isinstance(m, MethodSpec) and m.key_layout == "tiles" and cfg.tile_clip:
        extra.append(f"tile clip {cfg.tile_clip:g}")
    return m.name + (f" ({', '.join(extra)})" if extra else "")


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
