"""QuEST clip multipliers chosen per method and bit width on held-out calibration-domain text.

QuEST clips each token at α_b·RMS, α_b the clip of least squared error for Gaussian coordinates
(docs/reference/math.md#4-the-quest-int-quantizer). A transform changes how Gaussian the coordinates are and which of them carry the
attention scores, so one α_b for every transform leaves perplexity on the table: on held-out C4, WUSH
keys want a wider clip at 2 bits (× 1.15 on SmolLM2-135M, × 1.3 on Gemma-3-270M) while Hadamard's want
α_b (docs/lab/quest-key-clip-2bit.md). A *clip table* holds, per (method, width), the multipliers on α_b
for keys and values chosen by :func:`tune_clips` on text that is never the evaluation text
(``wushkv tune-clip``); ``wushkv compare --clips TABLE`` quantizes each method at its own clips.

The search is coordinate-wise on a grid: the key multiplier first (values at α_b), walking downhill
from 1.0 until perplexity rises (:func:`line_search`), then the value multiplier at the chosen key
clip. Every evaluation is recorded, and the file is rewritten after each one, so an interrupted
search resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ..config import CLIP_GRID, QuantConfig
from ..io import read_json
from ..methods.spec import canonical_name

FORMAT = "wushkv-clips"
FORMAT_VERSION = 1
SIDES = ("keys", "values")


def line_search(f: Callable[[float], object], grid: Sequence[float], start: float = 1.0,
                better: Callable[[object, object], bool] | None = None) -> float:
    """The grid point reached by walking downhill from ``start``.

    ``f`` is evaluated at ``start`` and its upper neighbour; the walk continues up while each step is
    ``better`` than the point it leaves (default: a lower value), otherwise it goes down from ``start``
    the same way. For a unimodal ``f`` and the default that is the grid's minimum. Callers memoize ``f``
    (each point costs a perplexity run)."""
    better = better or (lambda new, old: new < old)
    g = sorted(float(x) for x in grid)
    if len(set(g)) != len(g):
        raise ValueError(f"clip grid {list(grid)} has repeated values")
    if start not in g:
        raise ValueError(f"clip grid {g} must contain the starting multiplier {start}")
    i = g.index(start)
    best, fb = i, f(g[i])
    for step in (1, -1):
        j = best + step
        moved = False
        while 0 <= j < len(g):
            fj = f(g[j])
            if not better(fj, fb):
                break
            best, fb, moved = j, fj, True
            j += step
        if moved:
            break
    return g[best]


RULES = ("lower", "paired")


def paired_better(new: dict, old: dict) -> bool:
    """``new`` is better than ``old`` when the 95% paired bootstrap interval over the held-out chunks of its
    perplexity change lies below 0 (with 4 chunks: lower on about every chunk)."""
    from .compare import paired_difference

    if "chunk_nll" not in new or "chunk_nll" not in old:
        raise ValueError("the paired rule compares per-chunk NLLs; this evaluation did not record them")
    return paired_difference(new["chunk_nll"], old["chunk_nll"])[2] < 0


def _check_alpha(name: str, a) -> float:
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not (0.0 < float(a) < float("inf")):
        raise ValueError(f"{name}={a!r}: a clip multiplier must be a finite number > 0")
    return float(a)


class ClipTable:
    """Multipliers on α_b per (method, width), with what they were chosen on; JSON on disk."""

    def __init__(self, data: dict):
        self.data = data

    @property
    def clips(self) -> dict[str, dict[str, dict]]:
        return self.data["clips"]

    def entries(self, method: str) -> dict[str, dict]:
        """The table's entries for ``method`` under any spelling of it (tables written before names were canonical
        hold the name as it was typed)."""
        want = canonical_name(method)
        for name, by_bits in self.clips.items():
            try:
                if canonical_name(name) == want:
                    return by_bits
            except ValueError:  # a name this version does not know: it cannot be the method asked for
                continue
        return {}

    def alphas(self, method: str, bits: int) -> tuple[float, float] | None:
        """(k_alpha, v_alpha) chosen for ``method`` at ``bits`` (K = V = bits), None if the table has none."""
        e = self.entries(method).get(str(bits))
        return None if e is None else (e["k_alpha"], e["v_alpha"])

    def apply(self, method: str, cfg: QuantConfig) -> QuantConfig:
        """``cfg`` with the table's clips for ``method``: the key multiplier of the key width's entry and the
        value multiplier of the value width's (tuned with K = V). Unchanged where the table has no entry,
        or where the method does not quantize with QuEST (KVarN's tiles)."""
        if cfg.quantizer != "quest":
            return cfg
        k = self.alphas(method, cfg.k_bits) if cfg.k_bits is not None else None
        v = self.alphas(method, cfg.v_bits) if cfg.v_bits is not None else None
        return replace(cfg, k_alpha=k[0] if k else cfg.k_alpha, v_alpha=v[1] if v else cfg.v_alpha)

    def covers(self, method: str, bits: int) -> bool:
        return self.alphas(method, bits) is not None

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.data["clips"], sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> dict:
        """What a result made with this table records about it."""
        s = self.data["settings"]
        return {"clips_sha256": self.sha256(), "text": s["text"], "chunks": s["chunks"], "grid": s["grid"], "rule": s.get("rule", "lower")}

    @classmethod
    def load(cls, path: str | Path, model=None) -> ClipTable:
        """Read and validate a table; with ``model``, refuse a table tuned on another model."""
        from ..models import fingerprint

        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"clip table {p} does not exist (make one with `wushkv tune-clip --out {p}`)")
        data = read_json(p, "clip table")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{p} is not a wushkv clip table (format {FORMAT!r}); make one with `wushkv tune-clip`")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"clip table {p} has version {data.get('version')!r}; this wushkv reads {FORMAT_VERSION}")
        clips = data.get("clips")
        if not isinstance(clips, dict) or not isinstance(data.get("settings"), dict):
            raise ValueError(f"clip table {p} has no 'clips' and 'settings' mappings")
        for m, by_bits in clips.items():
            for b, e in by_bits.items():
                if b not in ("2", "3", "4", "8"):
                    raise ValueError(f"clip table {p}: {m!r} has width {b!r}; widths are 2, 3, 4, 8")
                for side in ("k_alpha", "v_alpha"):
                    _check_alpha(f"clip table {p}: {m} {b}-bit {side}", e.get(side))
        if model is not None:
            fp, want = data["settings"].get("fingerprint"), fingerprint(model)
            if fp != want:
                raise ValueError(f"clip table {p} was tuned on model {fp and fp.get('family')!r} "
                                 f"(weights {fp and fp.get('weights_sha256')!r}), not on this one "
                                 f"({want['family']!r}, weights {want['weights_sha256']!r}); tune one for this model")
        return cls(data)


def _settings(model, chunks: torch.Tensor, calibration, base: QuantConfig, grid, sides, text_label: str) -> dict:
    from ..calibration import calibration_recipe
    from ..models import fingerprint

    return {"fingerprint": fingerprint(model), "calibration": calibration_recipe(calibration.meta if calibration is not None else None),
            "base": base.to_dict(), "grid": [float(x) for x in sorted(grid)], "sides": list(sides), "text": text_label,
            "text_sha256": hashlib.sha256(chunks.cpu().numpy().tobytes()).hexdigest(), "chunks": int(chunks.shape[0]),
            "seq_len": int(chunks.shape[1])}


class _Memo:
    """Perplexity at (k_alpha, v_alpha) for one (method, width): each point run once, recorded in ``trials``."""

    def __init__(self, evaluate, cfg: QuantConfig, trials: list, fp_ppl: float, save, log, label: str):
        self.evaluate, self.cfg, self.trials, self.fp_ppl, self.save, self.log, self.label = evaluate, cfg, trials, fp_ppl, save, log, label
        self.memo = {(t["k_alpha"], t["v_alpha"]): t for t in trials}

    def __call__(self, ka: float, va: float) -> float:
        return self.trial(ka, va)["ppl"]

    def trial(self, ka: float, va: float) -> dict:
        if (ka, va) not in self.memo:
            r = self.evaluate(replace(self.cfg, k_alpha=ka, v_alpha=va))
            if not math.isfinite(r["ppl"]):
                raise ValueError(f"{self.label.strip()} at αK×{ka:g}, αV×{va:g}: perplexity is {r['ppl']} (NaN or inf)")
            delta = 100 * (r["ppl"] / self.fp_ppl - 1)
            trial = {"k_alpha": ka, "v_alpha": va, "ppl": r["ppl"], "delta_pct": delta}
            if "chunk_nll" in r:  # per held-out chunk, for paired comparisons of two clips
                trial["chunk_nll"] = list(r["chunk_nll"])
            self.trials.append(trial)
            self.memo[ka, va] = trial
            self.save()
            self.log(f"{self.label} αK×{ka:<5g} αV×{va:<5g} PPL {r['ppl']:.3f} ({delta:+.2f}%)")
        return self.memo[ka, va]


def check_tunable(methods: Sequence[str], base: QuantConfig, sides: Sequence[str] = SIDES) -> None:
    """Refuse, before anything runs, what a clip search cannot tune."""
    from ..methods.spec import method_config

    if base.quantizer != "quest":
        raise ValueError(f"clip multipliers are QuEST's (α_b); got --quantizer {base.quantizer!r} (the affine quantizer's clips are "
                         "--k-clip/--v-clip)")
    if (base.k_alpha, base.v_alpha) != (1.0, 1.0):
        raise ValueError(f"the search starts from α_b: leave --k-alpha/--v-alpha at 1 (got {base.k_alpha}, {base.v_alpha})")
    for m in methods:
        if method_config(m, base).quantizer != "quest":
            raise ValueError(f"method {m!r} quantizes with KVarN's tiles, not QuEST: it has no clip to tune; leave it out")
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        raise ValueError(f"sides {list(sides)}: choose from {list(SIDES)}")
    tile_keys = [m for m in methods if method_config(m, base).side_quantizer("key") != "quest"]
    if tile_keys and "keys" in sides:
        raise ValueError(f"methods {tile_keys} keep their keys in KVarN's tiles (their clip is --tile-clip): tune their values "
                         "only (--sides values), or leave them out")


def tune_clips(model, chunks: torch.Tensor, calibration, methods: Sequence[str], bits: Sequence[int], base: QuantConfig,
               grid: Sequence[float] = CLIP_GRID, sides: Sequence[str] = SIDES, path: str | Path | None = None,
               text_label: str = "", show_progress: bool = True, log=print, evaluate=None, rule: str = "lower") -> ClipTable:
    """Choose (k_alpha, v_alpha) per (method, width) by held-out perplexity on ``chunks`` (see the module doc).

    ``path``: the table is written there after every evaluation and resumed from it (a file from other
    settings is refused). ``rule``: ``lower`` moves to a neighbouring clip on any held-out gain; ``paired``
    only on a gain whose paired 95% bootstrap interval over the held-out chunks lies below 0
    (:func:`paired_better`; at 4 bits on SmolLM2 the ``lower`` rule followed noise, docs/lab/tune-clip-per-method.md). ``evaluate(method, cfg) -> {"ppl", "chunk_nll"}`` replaces the perplexity run
    (tests)."""
    from ..io import write_json
    from ..runs import as_json, differing, read_run
    from ..methods.spec import method_config
    from .compare import quantized_perplexity
    from .perplexity import perplexity

    check_tunable(methods, base, sides)
    for b in bits:
        replace(base, k_bits=b, v_bits=b)  # validates the widths
    if evaluate is None:
        def evaluate(method, cfg):
            return quantized_perplexity(model, chunks, calibration, method, cfg, show_progress=show_progress,
                                        desc=f"{method} {cfg.label()} αK×{cfg.k_alpha:g} αV×{cfg.v_alpha:g}")

    if rule not in RULES:
        raise ValueError(f"rule {rule!r}: choose from {list(RULES)} (lower: move on any gain; paired: only on a gain the held-out chunks agree on)")
    settings = _settings(model, chunks, calibration, base, grid, sides, text_label)
    if rule != "lower":  # tables from before the rule existed moved on any gain
        settings["rule"] = rule
    data = {"format": FORMAT, "version": FORMAT_VERSION, "settings": settings, "fp": None, "clips": {}, "trials": {}}
    if path is not None and (prev := read_run(path, ("settings",), "`wushkv tune-clip`", flag="--out")) is not None:
        want = as_json(settings)
        if prev.get("format") != FORMAT or prev["settings"] != want:  # a clip search resumes only at exactly its settings
            differ = differing(prev["settings"], want)
            raise ValueError(f"{path} holds a clip search with other settings (differing: {', '.join(differ) or 'format'}); "
                             "give another --out or delete it")
        data = prev
        log(f"resuming from {path}")
    save = (lambda: write_json(path, data)) if path is not None else (lambda: None)
    if data["fp"] is None:
        fp = perplexity(model, chunks, show_progress=show_progress, desc="ppl full precision")
        data["fp"] = {"ppl": fp["ppl"]}
        save()
    fp_ppl = data["fp"]["ppl"]
    for m in methods:
        for b in bits:
            trials = data["trials"].setdefault(m, {}).setdefault(str(b), [])
            cfg_b = method_config(m, replace(base, k_bits=b, v_bits=b))
            ppl = _Memo(lambda cfg, m=m: evaluate(m, cfg), cfg_b, trials, fp_ppl, save, log, f"{m:>9} {b}-bit")
            if rule == "paired":
                ka = line_search(lambda a: ppl.trial(a, 1.0), grid, better=paired_better) if "keys" in sides else 1.0
                va = line_search(lambda a: ppl.trial(ka, a), grid, better=paired_better) if "values" in sides else 1.0  # noqa: B023
            else:
                ka = line_search(lambda a: ppl(a, 1.0), grid) if "keys" in sides else 1.0
                va = line_search(lambda a: ppl(ka, a), grid) if "values" in sides else 1.0  # noqa: B023 (called here)
            best = ppl(ka, va)
            data["clips"].setdefault(m, {})[str(b)] = {
                "k_alpha": ka, "v_alpha": va, "ppl": best, "delta_pct": 100 * (best / fp_ppl - 1),
                "ppl_alpha_b": ppl(1.0, 1.0), "delta_pct_alpha_b": 100 * (ppl(1.0, 1.0) / fp_ppl - 1)}
            save()
    return ClipTable(data)


__all__ = ["CLIP_GRID", "ClipTable", "check_tunable", "line_search", "tune_clips"]
