"""``auto``: per model, quantizer and width, the WUSH variant a *selection* chose on held-out text of the
calibration's domain, as a :class:`MethodSpec` with its settings.

A selection (``wushkv select``, :mod:`wushkv.eval.select`) evaluates candidate :class:`Recipe`\\ s on text the
calibration did not read and writes, per width, the one its rule picks into the calibration file, together with the
quantizer setting it was chosen under. :func:`resolve_auto` reads, in this order:

1. the calibration's own selection for the run's quantizer setting (exactly, or the same quantizer at other
   windows or clips, which it says);
2. the recorded selections of the two shipped models (:data:`RECORDED`): what the same procedure chose for
   SmolLM2-135M and Gemma-3-270M from the calibration recipe of ``calibration`` in each record;
3. otherwise the paper recipe ``wush`` (with the affine quantizer, ``wush+rmean`` where the calibration holds the
   pre-RoPE key mean: :func:`generation_method`), and a line saying how to select.

Every resolution carries ``why``, printed by each command and recorded in its JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..calibration import why_not_covered
from ..config import GENERATION_WINDOWS, PERPLEXITY_WINDOWS, QuantConfig
from .spec import MethodSpec, parse

RECIPE_SEP = "@"
# recipe option -> (QuantConfig field, what it means); multipliers multiply the configured clip, the tile clip is set
RECIPE_OPTIONS = {
    "ka": ("k_alpha", "QuEST key clip multiplier on the configured α"),
    "va": ("v_alpha", "QuEST value clip multiplier on the configured α"),
    "tc": ("tile_clip", "tile clip of the key tiles (+ktiles/+tiles; 0 = min-max)"),
}
SELECTION_VERSION = 1


@dataclass(frozen=True)
class Recipe:
    """A WUSH method with the settings it runs at: the QuEST clip multipliers (on the configured α) and, for a method
    with tiles, its tile clip (:attr:`~wushkv.config.QuantConfig.tile_clip`; 0 = the configured one).

    Written ``METHOD[@ka=X][@va=Y][@tc=Z]``, e.g. ``wush+ktiles+ldlq@tc=1.7`` or ``wush+ldlq@ka=1.15@va=1.45``
    (:func:`parse_recipe` and :attr:`name` are inverse)."""

    method: MethodSpec
    k_alpha: float = 1.0
    v_alpha: float = 1.0
    tile_clip: float = 0.0

    @property
    def name(self) -> str:
        out = self.method.name
        for opt, (attr, _) in RECIPE_OPTIONS.items():
            v = getattr(self, attr)
            if v != (0.0 if attr == "tile_clip" else 1.0):
                out += f"{RECIPE_SEP}{opt}={v:g}"
        return out

    def base(self, cfg: QuantConfig) -> QuantConfig:
        """``cfg`` (the configured quantization at one width) with this recipe's settings: its clip multipliers
        multiply the configured ones, a nonzero tile clip replaces the configured one."""
        cfg = replace(cfg, k_alpha=cfg.k_alpha * self.k_alpha, v_alpha=cfg.v_alpha * self.v_alpha)
        return replace(cfg, tile_clip=self.tile_clip) if self.tile_clip else cfg


def _r(name: str) -> Recipe:
    return parse_recipe(name)


def parse_recipe(text: str) -> Recipe:
    """A :class:`Recipe` from ``METHOD[@ka=X][@va=Y][@tc=Z]``; a clear error naming what is wrong otherwise."""
    method, *opts = str(text).strip().split(RECIPE_SEP)
    m = parse(method)
    if not isinstance(m, MethodSpec):
        raise ValueError(f"recipe {text!r}: {method!r} is not a transform method (a recipe is a method such as wush+ldlq, "
                         f"with options {', '.join(f'{RECIPE_SEP}{o}=' for o in RECIPE_OPTIONS)})")
    kw: dict[str, float] = {}
    for o in opts:
        key, eq, val = o.partition("=")
        if key not in RECIPE_OPTIONS or not eq:
            raise ValueError(f"recipe {text!r}: unknown option {o!r}; known: "
                             + ", ".join(f"{RECIPE_SEP}{k}=X ({d})" for k, (_, d) in RECIPE_OPTIONS.items()))
        attr = RECIPE_OPTIONS[key][0]
        try:
            x = float(val)
        except ValueError:
            x = float("nan")
        if not math.isfinite(x) or x < 0 or (x == 0 and attr != "tile_clip"):
            raise ValueError(f"recipe {text!r}: {key}={val!r} must be a finite number "
                             + (">= 0" if attr == "tile_clip" else "> 0"))
        if attr in kw:
            raise ValueError(f"recipe {text!r}: {key} given twice")
        kw[attr] = x
    if kw.get("tile_clip") and m.key_layout != "tiles":
        raise ValueError(f"recipe {text!r}: {RECIPE_SEP}tc sets the clip of key tiles; {m.name} has none (+ktiles or +tiles)")
    return Recipe(m, **kw)


# -- what a selection was chosen under -------------------------------------------------------------------
def selection_setting(cfg: QuantConfig) -> dict:
    """The quantizer setting a selection is chosen under and looked up by: ``cfg`` less its widths (JSON-shaped)."""
    d = cfg.to_dict()
    for k in ("k_bits", "v_bits", "version"):
        d.pop(k, None)
    d["windows"] = dict(d["windows"])
    return d


def setting_label(setting: dict) -> str:
    """``quest 16/128/16`` (and any clip or group that is not the default) for a :func:`selection_setting`."""
    w = setting.get("windows", {})
    out = f"{setting.get('quantizer')} {w.get('S_sink')}/{w.get('S_keep')}/{w.get('S_flush')}"
    default = selection_setting(QuantConfig())
    extra = [f"{k}={v}" for k, v in setting.items() if k not in ("quantizer", "windows") and v != default.get(k)]
    return out + (f" ({', '.join(extra)})" if extra else "")


def _recorded(model: str, calibration: tuple[int, int], cfg: QuantConfig, recipes: dict[int, str | tuple[str, str]], chosen_on: str) -> dict:
    """A recorded selection; a recipe given as (recipe, why) was chosen otherwise than ``chosen_on`` says, as ``why`` does."""
    choices = {str(b): {"recipe": r} if isinstance(r, str) else {"recipe": r[0], "why": r[1]} for b, r in recipes.items()}
    return {"version": SELECTION_VERSION, "model": model, "setting": selection_setting(cfg), "calibration": list(calibration),
            "source": chosen_on, "choices": choices}


_QUEST = QuantConfig(quantizer="quest", windows=PERPLEXITY_WINDOWS)
_AFFINE = QuantConfig(quantizer="affine", windows=GENERATION_WINDOWS)
_C4 = "held-out C4, sessions 15-18 (docs/lab/auto-c4-picks.md, tile-clip.md, ktiles-ldlq.md)"
_KL = "held-out C4 by `wushkv select --refine`, KL to full precision, sessions 48-49 (docs/lab/selection-by-kl.md)"
# The selections recorded for the shipped models (the names ``wushkv.models.load`` takes): what the procedure of
# ``wushkv select`` chose on held-out C4 from calibrations of the given recipe (samples, tokens). The affine record is
# the generation setting's: on SmolLM2 at K2V2 held-out C4 ranks wush+ktiles+ldlq first, but it loses the 1k passkey;
# the centered variant keeps it and ties on held-out C4 (docs/results.md, generation). SmolLM2's QuEST picks were
# made by the NLL (the rule until session 48); Gemma-3's by the KL, the default since, with session 49's default
# candidates (the defaults alone choose the same; with session 48's the 4-bit pick was the centered
# wush+rmean+ktiles+ldlq@va=1.15@tc=1.7, +0.30%). Gemma-3's before, from the same calibration (bit for bit):
# wush+ldlq@ka=1.15@va=1.45 / wush+rmean+ktiles+ldlq@va=1.15@tc=1.7 / wush+ktiles+ldlq@tc=1.7, +3.37% / +0.92% / +0.26%
# on WikiText-2 16 x 2048, against +2.47% / +0.78% / +0.41% now (docs/lab/selection-by-kl.md).
RECORDED: dict[str, list[dict]] = {
    "smollm2-135m": [
        _recorded("smollm2-135m", (32, 2048), _QUEST, {2: "wush+ktiles+ldlq@tc=3", 3: "wush+ktiles+ldlq@tc=1.7", 4: "wush+ktiles+ldlq"}, _C4),
        _recorded("smollm2-135m", (32, 2048), _AFFINE, {2: "wush+rmean+ktiles+ldlq@tc=1.7"},
                  _C4 + "; passkey gate (docs/lab/generation-key-tiles.md)"),
    ],
    "gemma3-270m": [
        _recorded("gemma3-270m", (16, 2048), _QUEST, {
            2: "wush+ktiles+ldlq@va=1.15@tc=1.3", 3: "wush+ktiles+ldlq@va=1.15", 4: "wush+ktiles+ldlq@va=1.15"}, _KL),
    ],
}
WUSH = parse("wush")
WUSH_RMEAN = parse("wush+rmean")


@dataclass(frozen=True)
class Resolved:
    """What ``auto`` stands for at one setting: the method, ``base`` the configured quantization with the recipe's
    settings (clip multipliers, tile clip), ``config`` what it runs at (``method.quant_config(base)``), and ``why``:
    where the choice came from, in words (printed and recorded)."""

    method: MethodSpec
    base: QuantConfig
    why: str = ""
    source: str = "paper"  # "calibration" | "recorded" | "paper"
    extra: dict = field(default_factory=dict)

    @property
    def config(self) -> QuantConfig:
        return self.method.quant_config(self.base)

    def describe(self) -> str:
        return describe_resolved(self.method, self.config)

    def record(self) -> dict:
        """JSON-shaped: what a command records of this resolution."""
        return {"method": self.method.name, "why": self.why, "source": self.source} | self.extra


def has_rope_mean(calibration) -> bool:
    """Whether every layer of the calibration holds the pre-RoPE key mean ``+rmean`` centers on."""
    return calibration is not None and bool(calibration.stats) and all("mu_K_pre" in st for st in calibration.stats)


def generation_method(calibration, cfg: QuantConfig) -> MethodSpec:
    """What ``auto`` runs where no selection applies: WUSH with its keys centered on their rotating pre-RoPE mean
    (``wush+rmean``) under the affine quantizer when the calibration holds that mean, plain ``wush`` otherwise.

    Chosen on held-out C4 in the generation setting, K2V2 affine 64/256/8: centering lowers 2-bit perplexity there
    on both models (SmolLM2 +2.91% -> +1.26%, Gemma-3 +1.83% -> +1.68%), and it is what keeps SmolLM2's passkey to 8k.
    With QuEST it loses on SmolLM2's held-out C4, so other quantizers get plain WUSH. A calibration made before
    the mean was stored gets plain WUSH too."""
    return WUSH_RMEAN if cfg.quantizer == "affine" and has_rope_mean(calibration) else WUSH


def find_selection(records: list[dict], cfg: QuantConfig) -> tuple[dict, bool] | None:
    """(record, exact): the record chosen under ``cfg``'s quantizer setting (exact True), else one of the same
    quantizers at other windows or clips (exact False); None if there is none."""
    want = selection_setting(cfg)
    same = [r for r in records if (r.get("setting") or {}).get("quantizer") == want["quantizer"]
            and (r.get("setting") or {}).get("key_quantizer") == want["key_quantizer"]]
    for r in same:
        if r["setting"] == want:
            return r, True
    return (same[0], False) if same else None


def why_unusable(recipe: Recipe, calibration) -> str | None:
    """Why ``recipe`` cannot run with ``calibration`` (None: it can)."""
    if recipe.method.rope_mean and not has_rope_mean(calibration):
        return "its keys are centered on the pre-RoPE mean, which this calibration predates (wushkv calibration upgrade adds it)"
    if recipe.method.cover is not None and calibration is not None:
        return why_not_covered(calibration.meta, recipe.method.cover)
    return None


def resolve_auto(model_key: str | None, calibration, cfg: QuantConfig) -> Resolved:
    """The method and settings ``auto`` stands for at ``cfg`` (``compare``, ``generate``, ``agree``, ``passkey``), in
    the order of the module docstring. Only K = V widths have selections; anything else gets the paper recipe."""
    fallback = generation_method(calibration, cfg) if cfg.quantizer == "affine" else WUSH
    if cfg.k_bits != cfg.v_bits:
        return Resolved(fallback, cfg, f"selections are made at K = V bits; K{cfg.k_bits}V{cfg.v_bits} runs {fallback.name}")
    sources = [("calibration", getattr(calibration, "selections", None) or []), ("recorded", RECORDED.get(model_key or "", []))]
    skipped = []
    for source, records in sources:
        found = find_selection(records, cfg)
        if found is None:
            continue
        rec, exact = found
        choice = rec.get("choices", {}).get(str(cfg.k_bits))
        if choice is None:
            continue
        recipe = parse_recipe(choice["recipe"])
        if (why_not := why_unusable(recipe, calibration)) is not None:
            skipped.append(f"{source} selection {recipe.name} not run: {why_not}")
            continue
        under = "" if exact else f"; chosen under {setting_label(rec['setting'])}, this run is {setting_label(selection_setting(cfg))}"
        if source == "calibration":
            why = (f"selected by `wushkv select` on {rec.get('text', 'held-out text')} ({rec.get('chunks')} x {rec.get('serve_len')} "
                   f"tokens, rule {rec.get('rule')}){under}")
            if "why" in choice:
                why += f": {choice['why']}"
        else:
            s, n = rec.get("calibration", ("?", "?"))
            made = choice.get("why", rec.get("source"))
            why = f"the recorded selection for {model_key}, made on {made} from a {s} x {n} calibration{under}"
        return Resolved(recipe.method, recipe.base(cfg), why, source, {"recipe": recipe.name, "exact_setting": exact})
    why = (f"no selection for {model_key or 'this model'} under {setting_label(selection_setting(cfg))} at {cfg.k_bits} bits: "
           f"{fallback.name}" + (" (the paper recipe)" if fallback == WUSH else "")
           + "; choose one with `wushkv select --calibration FILE`")
    if skipped:
        why += " (" + "; ".join(skipped) + ")"
    return Resolved(fallback, cfg, why, "paper")


def describe_resolved(method, cfg: QuantConfig) -> str:
    """``wush+ktiles+ldlq (tile clip 1.7)``: what ``auto`` resolved to, with the settings its recipe changed."""
    m = parse(method)
    extra = []
    if cfg.quantizer == "quest" and (cfg.k_alpha, cfg.v_alpha) != (1.0, 1.0):
        extra.append(f"αK×{cfg.k_alpha:g} αV×{cfg.v_alpha:g}")
    if isinstance(m, MethodSpec) and m.key_layout == "tiles" and cfg.tile_clip:
        extra.append(f"tile clip {cfg.tile_clip:g}")
    return m.name + (f" ({', '.join(extra)})" if extra else "")


def auto_calibration_note(model_key: str | None, calibration, cfg: QuantConfig | None = None) -> str | None:
    """A line to print when ``auto`` takes a recorded selection (no selection of the calibration's own) that was made
    with another calibration recipe than ``calibration``'s."""
    if calibration is None or not RECORDED.get(model_key or ""):
        return None
    if cfg is not None and find_selection(getattr(calibration, "selections", None) or [], cfg) is not None:
        return None  # the calibration's own selection applies
    want = tuple(RECORDED[model_key][0]["calibration"])
    have = (calibration.meta.get("samples"), calibration.meta.get("seq_len"))
    if have == want:
        return None
    return (f"note: auto's recorded choices for {model_key} were made on held-out C4 with a {want[0]} x {want[1]} calibration; this "
            f"one is {have[0]} x {have[1]} (wushkv calibrate --samples {want[0]} --seq-len {want[1]} makes that file, or "
            f"`wushkv select` chooses for this one)")
