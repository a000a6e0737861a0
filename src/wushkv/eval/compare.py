"""The paper's Table 1 on our models: perplexity of every (transform, bits) against full precision."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import torch

from ..calibration import Calibration, calibrate
from ..config import QuantConfig
from ..folding import apply_transforms
from ..methods.auto import resolve_auto
from ..methods.install import transforms_for
from ..methods.spec import AUTO_NAME, MethodSpec, canonical_name, method_config, spec_of
from ..models import fingerprint
from ..runs import settings_key
from .perplexity import perplexity

MIN_CHUNKS_FOR_INTERVAL = 4  # a bootstrap over fewer chunks says nothing


def cache_dir() -> Path:
    return Path(os.environ.get("WUSHKV_CACHE", Path.home() / ".cache" / "wushkv"))


def cached_calibration(model, tokenizer, samples: int, seq_len: int, damping: float = 0.01, wush_a: bool = False,
                       text_file: str | None = None, show_progress: bool = True, log=print) -> Calibration:
    """Calibrate once per (model fingerprint, settings); later calls load the file."""
    fp = fingerprint(model)
    key = settings_key([fp, samples, seq_len, damping, wush_a, text_file])
    path = cache_dir() / "calibrations" / f"{fp['family']}-{key}.safetensors"
    if path.is_file():
        log(f"using cached calibration {path}")
        return Calibration.load(path, model)
    log(f"calibrating on {samples} x {seq_len} tokens (cached at {path})")
    cal = calibrate(model, tokenizer, samples=samples, seq_len=seq_len, text_file=text_file, damping=damping, wush_a=wush_a, show_progress=show_progress)
    cal.save(path)
    return cal


def check_quantizes(seq_len: int, cfg: QuantConfig) -> None:
    """Refuse sequences of ``seq_len`` tokens in which ``cfg``'s windows would never quantize a token (a perplexity
    through the cache that measured full precision); the CLI asks before the model loads."""
    w = cfg.windows
    if seq_len <= w.S_sink + w.S_keep + w.S_flush - 1:
        raise ValueError(
            f"sequences of {seq_len} tokens are too short for windows {w.S_sink}/{w.S_keep}/{w.S_flush}: no token "
            f"would ever be quantized; use --seq-len > {w.S_sink + w.S_keep + w.S_flush - 1} or smaller windows"
        )


def quantized_perplexity(model, chunks: torch.Tensor, calibration: Calibration | None, transform: str | MethodSpec,
                         cfg: QuantConfig, show_progress: bool = True, desc: str = "ppl", reference=None) -> dict:
    """Install the method ``transform`` (a name or a :class:`~wushkv.methods.MethodSpec`), evaluate ``chunks`` (N, L)
    through a fresh quantized cache per chunk at ``cfg`` (the method's own settings,
    :meth:`~wushkv.methods.MethodSpec.quant_config`), restore the model. ``reference``: full precision's
    :class:`~wushkv.eval.perplexity.Reference` per chunk, for the KL to it (:func:`~wushkv.eval.perplexity.perplexity`)."""
    check_quantizes(chunks.shape[1], cfg)
    m = spec_of(transform, "quantized_perplexity")
    trs = transforms_for(model, calibration, m)
    with apply_transforms(model, trs, m.name) as installed:
        return perplexity(model, chunks, cache_factory=lambda: installed.cache(cfg), show_progress=show_progress, desc=desc,
                          reference=reference)


def _resume_key(settings: dict) -> dict:
    """What a stored result depends on: everything but which transforms and widths the run lists, and
    of the calibration only its recipe (None, a run of uncalibrated transforms, matches any)."""
    from ..calibration import calibration_recipe

    key = {k: v for k, v in settings.items() if k not in ("transforms", "bits")}
    key["calibration"] = calibration_recipe(settings.get("calibration"))
    key.setdefault("dtype", "float32")  # files from before the dtype was recorded ran float32
    if isinstance(key.get("base"), dict):  # as this version writes it (fields added since get their defaults)
        try:
            key["base"] = QuantConfig.from_dict(key["base"]).to_dict()
        except (TypeError, ValueError):
            pass
    return json.loads(json.dumps(key))  # as it reads back from JSON


def _resume(json_path, settings: dict) -> dict | None:
    """The stored run to continue (its settings: this run's, with a calibration it lacks taken from the file), None
    if there is no file; a file from other settings is refused (not overwritten: it may hold hours of results).
    Files from before the text's hash was recorded match any text (:func:`wushkv.runs.reconcile_settings`)."""
    from ..runs import read_run, resume_settings

    path = Path(json_path)
    prev = read_run(path, ("settings", "results"), "compare", command="compare")
    if prev is None:
        return None
    prev.setdefault("fp", None)
    prev["settings"] = resume_settings(path, prev["settings"], settings, key=_resume_key, since=("text_sha256",))
    return prev


def run_compare(model, tokenizer, chunks: torch.Tensor, calibration: Calibration | None, transforms: list[str], bits: list[int],
                base: QuantConfig, json_path=None, meta: dict | None = None, show_progress: bool = True, log=print,
                clips=None) -> dict:
    """Full precision once, then every (transform, bits); resumes from ``json_path`` (a file from other settings is refused).

    ``clips`` (:class:`~wushkv.eval.clips.ClipTable`): each method quantizes with QuEST at its own chosen clip
    multipliers where the table has them (α from ``base`` elsewhere); each result records the config it ran."""
    from ..io import write_json

    transforms = [canonical_name(t) for t in transforms]  # results are keyed by the canonical name
    settings = dict(meta or {}, chunks=int(chunks.shape[0]), seq_len=int(chunks.shape[1]), base=base.to_dict(),
                    text_sha256=hashlib.sha256(chunks.cpu().numpy().tobytes()).hexdigest())
    if clips is not None:
        from ..calibration import calibration_recipe

        settings["clips"] = clips.describe()
        tuned = clips.data.get("settings", {})
        if tuned.get("text_sha256") == settings["text_sha256"]:
            log("warning: the clip table was chosen on this very text; its numbers are not a held-out result")
        if calibration is not None and "calibration" in tuned and tuned["calibration"] != json.loads(json.dumps(calibration_recipe(calibration.meta))):
            log("note: the clip table was chosen with a calibration of another recipe than this run's")
        for t in transforms:
            missing = [b for b in bits if method_config(t, replace(base, k_bits=b, v_bits=b)).quantizer == "quest" and not clips.covers(t, b)]
            if missing:
                log(f"clip table has no entry for {t} at {', '.join(map(str, missing))} bits: those run at the base clip")
    settings["calibration"] = calibration.meta if calibration is not None else None  # what the results were made with
    out = {"command": "compare", "settings": settings, "fp": None, "results": {}}
    if json_path and (prev := _resume(json_path, settings)) is not None:
        out, settings = {"command": "compare"} | prev, prev["settings"]
        write_json(json_path, out)  # the settings as they are now (e.g. the calibration a run without one kept)
        log(f"resuming from {json_path}")
    if out["fp"] is None:
        fp = perplexity(model, chunks, show_progress=show_progress, desc="ppl full precision")
        out["fp"] = {"ppl": fp["ppl"], "seconds": fp["seconds"], "chunk_nll": fp["chunk_nll"]}
        log(f"full precision: PPL {fp['ppl']:.3f}")
        if json_path:
            write_json(json_path, out)
    for t in transforms:
        for b in bits:
            done = out["results"].get(t, {}).get(str(b))
            name, cfg = t, method_config(t, replace(base, k_bits=b, v_bits=b))
            why = None
            if t == AUTO_NAME:  # the calibration's selection at this width (or a recorded one, or the paper recipe)
                r = resolve_auto(settings.get("model"), calibration, cfg)
                name, cfg, why = r.method.name, r.config, r.why
            if clips is not None:
                cfg = clips.apply(name, cfg)
            if done is not None and t == AUTO_NAME and (done.get("method"), QuantConfig.current_dict(done.get("config"))) != (
                    name, QuantConfig.current_dict(cfg.to_dict())):
                log(f"auto at {b} bits now stands for {name} ({cfg.label()}), not the saved {done.get('method')}: running it again")
                done = None
            if done is not None:
                continue
            label = t if name == t else f"{t} ({name})"
            r = quantized_perplexity(model, chunks, calibration, name, cfg, show_progress=show_progress, desc=f"{label} {cfg.label()}")
            entry = {"ppl": r["ppl"], "delta_pct": 100 * (r["ppl"] / out["fp"]["ppl"] - 1), "seconds": r["seconds"], "config": cfg.to_dict(),
                     "method": name, "chunk_nll": r["chunk_nll"]} | ({"why": why} if why is not None else {})
            out["results"].setdefault(t, {})[str(b)] = entry
            log(f"{label:>9} {cfg.label():<24} PPL {r['ppl']:9.3f}  ({entry['delta_pct']:+.2f}% over full precision, {r['seconds']:.0f}s)")
            if json_path:
                write_json(json_path, out)
    return out


def _ranked(out: dict, transforms: list[str], b: int) -> list[str]:
    """The transforms with a result at width ``b``, lowest perplexity first."""
    return [t for _, t in sorted((out["results"][t][str(b)]["ppl"], t) for t in transforms if str(b) in out["results"].get(t, {}))]


def best_per_bits(out: dict, transforms: list[str], bits: list[int]) -> dict[int, str]:
    return {b: r[0] for b in bits if (r := _ranked(out, transforms, b))}


def paired_difference(a: list[float], b: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """How much higher method a's perplexity is than method b's on the same chunks, in percent, with a
    95% paired bootstrap interval over chunks: (Δ%, low, high). ``a``/``b``: per-chunk mean token NLLs
    (every chunk has the same number of tokens, so the mean of the chunk means is the mean NLL).

    The interval covers the choice of evaluation text only (which chunks), not calibration noise.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired chunks needed: got {len(a)} and {len(b)}")
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(d), (resamples, len(d)), generator=g)
    boot = d[idx].mean(1)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    pct = lambda x: 100 * (math.exp(x) - 1)  # noqa: E731
    return pct(float(d.mean())), pct(lo), pct(hi)


def margins(out: dict, transforms: list[str], bits: list[int]) -> dict[int, dict]:
    """Per width: the lowest-perplexity transform, the runner-up, and the best's margin with its paired
    bootstrap interval (None with fewer than ``MIN_CHUNKS_FOR_INTERVAL`` chunks, or where per-chunk NLLs
    were not recorded, e.g. results of older versions)."""
    res = {}
    for b in bits:
        ranked = _ranked(out, transforms, b)
        if len(ranked) < 2:
            continue
        best, second = ranked[:2]
        ea, eb = out["results"][best][str(b)], out["results"][second][str(b)]
        paired = "chunk_nll" in ea and "chunk_nll" in eb and len(ea["chunk_nll"]) >= MIN_CHUNKS_FOR_INTERVAL
        ci = paired_difference(ea["chunk_nll"], eb["chunk_nll"]) if paired else None
        res[b] = {"best": best, "second": second, "delta_pct": 100 * (ea["ppl"] / eb["ppl"] - 1), "ci": ci and list(ci[1:])}
    return res
