"""Selection: choose ``auto``'s recipe per width on held-out text of the calibration's domain (``wushkv select``).

The procedure that chose the shipped models' recipes, as a command:

1. **Text.** Held-out text of the calibration's domain that the calibration did not read (default: C4 validation
   documents 1200..1999, :func:`wushkv.data.heldout_c4_text`; a calibration that read into them is refused), cut
   into ``chunks`` sequences of ``serve_len`` tokens, the context the user will serve. Never the evaluation text.
2. **Candidates.** :class:`~wushkv.methods.auto.Recipe`\\ s, simplest first (:data:`DEFAULT_CANDIDATES`). Where
   ``serve_len`` is longer than the calibration's sequences, each is followed by itself on statistics covered to
   ``serve_len`` positions (``+coverN``, :func:`covered_candidates`), so that the selection also chooses the
   statistics: a short calibration read as it is, or averaged over the served context's positions. One over
   the ``budget`` (bits per element of the quantized middle, metadata included: :func:`bits_per_element`) or that the
   calibration cannot run (``+rmean`` without the pre-RoPE mean) is excluded before anything runs, and says why.
3. **Evaluations.** Full precision once, then every (candidate, width) through the quantized cache: per chunk, the
   mean NLL and the mean KL from full precision's next-token distributions (:func:`~wushkv.eval.perplexity.coarse_kl`),
   so that candidates compare *paired* over the same chunks. Every evaluation is kept in a JSON file that is
   rewritten after each one; a rerun with the same settings resumes from it (other settings are refused).
4. **Metric** (:data:`METRICS`): what the rule compares. ``nll``: the held-out NLL, what perplexity reports. ``kl``:
   the KL from full precision, the damage alone: at 3-4 bits the NLL's change is mostly chance (a quantized cache
   lowers the NLL of some chunks) and ties recipes that the KL separates on every chunk.
5. **Rule** (:data:`RULES`), per width, over the candidates not excluded:

   * ``lowest``: the lowest mean of the metric;
   * ``simplest``: the first listed candidate, displaced by a later one only where that one is lower on *every*
     chunk (walked in the listed order, so a more complex recipe must win everywhere to displace a simpler one).

6. **Gates** (optional): a pick must also pass each gate, run on the gate's own prompts (never a reported
   evaluation's); one that fails is removed, with the gate's numbers, and the rule picks again among the rest.
   ``passkey``: retrieval accuracy over :data:`PASSKEY_GATE` prompts (seed 1, not the ``passkey`` command's 0) no
   lower than full precision's on the same prompts. ``agreement`` (:class:`AgreementGate`): over long greedy
   generations from held-out prompts past the chunks the selection scores, teacher-forced top-1 agreement with full
   precision no more than :data:`AGREEMENT_GATE`\\ ``["margin"]`` points below the paper recipe's at the same width.
   A gate's settings are part of what a resumed file must match.

The result, per width, is a *choice* (recipe, why, held-out Δ% over full precision, paired Δ% against the paper
recipe with its 95% bootstrap interval over the chunks, bits per element) written into the calibration file with the
setting it was chosen under (:meth:`wushkv.calibration.Calibration.set_selection`), where ``auto`` reads it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from dataclasses import replace

import torch

from .. import __version__
from ..calibration import calibration_recipe
from ..codecs import make_codec, storage_nbytes
from ..config import CLIP_GRID, QuantConfig
from ..io import write_json
from ..methods.auto import RECIPE_OPTIONS, SELECTION_VERSION, Recipe, parse_recipe, selection_setting, setting_label, why_unusable
from ..models import describe
from ..progress import progress
from ..runs import as_json, read_run, resume_settings
from .compare import MIN_CHUNKS_FOR_INTERVAL, paired_difference, quantized_perplexity
from .perplexity import REFERENCE_TOP, perplexity

PAPER = "wush"
# Simplest first. The method families that won somewhere on the shipped models (docs/results.md), at the tile and
# QuEST clips that won there; `wushkv select --candidates` takes any list.
DEFAULT_CANDIDATES = ("wush", "wush+ldlq", "wush+ktiles+ldlq", "wush+ktiles+ldlq@tc=1.7", "wush+ktiles+ldlq@va=1.15",
                      "wush+ktiles+ldlq@va=1.15@tc=1.3", "wush+ldlq@ka=1.15@va=1.45", "wush+rmean+ktiles+ldlq@va=1.15@tc=1.7")
RULES = ("lowest", "simplest")
METRICS = ("nll", "kl")
DEFAULT_METRIC = "kl"
METRIC_LABELS = {"nll": "held-out NLL", "kl": "held-out KL to full precision"}
COVER_MODES = ("auto", "no")
GATES = ("passkey", "agreement")
PASSKEY_GATE = {"contexts": [1024], "depths": [0.1, 0.5, 0.9], "trials": 2, "seed": 1}
# The agreement gate's defaults (AgreementGate explains each): 4 held-out prompts of 512 tokens, 512 greedy tokens each,
# top-1 agreement no more than 1 point below the paper recipe's.
AGREEMENT_GATE = {"prompts": 4, "prompt_len": 512, "new_tokens": 512, "margin": 1.0}


def bits_per_element(recipe: Recipe, cfg: QuantConfig, head_dim: int) -> float:
    """Bits per element of the quantized middle of a cache running ``recipe`` at ``cfg`` (one width), keys and values
    together, codes and metadata (scales, offsets, tile factors) included: measured by encoding one block of random
    tokens with the codecs the cache uses (so it cannot drift from what the cache stores)."""
    run = recipe.method.quant_config(recipe.base(cfg))
    block = max(run.windows.S_flush, 1)
    n = block * max(1, math.ceil(256 / block))  # whole tiles/blocks of the codec
    x = torch.randn(1, n, head_dim, generator=torch.Generator().manual_seed(0))
    total, elements = 0, 0
    for side in ("key", "value"):
        codec = make_codec(run, side, head_dim)
        if codec is None:  # full precision on this side: 16-bit
            total, elements = total + 2 * n * head_dim, elements + n * head_dim
            continue
        codes, meta = storage_nbytes(codec.encode(x))
        total, elements = total + codes + meta, elements + n * head_dim
    return 8 * total / elements


def covered_candidates(recipes: list[Recipe], calibration, serve_len: int, mode: str = "auto") -> list[Recipe]:
    """``recipes`` with, right after each that reads calibration statistics, the same recipe on statistics covered to
    ``serve_len`` positions (``+cover{serve_len}``), where ``mode`` is ``"auto"`` and the calibration's sequences are
    shorter than ``serve_len`` (a file already covered by ``wushkv calibration cover`` is taken as it is); ``"no"``:
    ``recipes`` unchanged.

    Why a choice and not a default: covered statistics serve contexts several times the calibration's length far
    better (SmolLM2 16 x 1024 at 4096: the paper recipe +39.8% -> +14.2%, `auto` 0.62 -> 1.01 of its margin over
    Hadamard) but cost some recipes at shorter ones (docs/lab/calibration-length.md), and which recipe on which
    statistics wins differs per model; held-out text at the served length decides."""
    if mode not in COVER_MODES:
        raise ValueError(f"--cover {mode!r}: known: {', '.join(COVER_MODES)}")
    if mode == "no" or calibration is None or calibration.meta.get("positions") is not None or serve_len <= int(calibration.meta["seq_len"]):
        return list(recipes)
    out: list[Recipe] = []
    for r in recipes:
        variants = [r]
        if r.method.cover is None and r.method.needs_calibration:
            variants.append(replace(r, method=replace(r.method, cover=int(serve_len))))
        out += [v for v in variants if v.name not in {o.name for o in out}]
    return out


def _unrunnable(recipe: Recipe, cfg: QuantConfig, calibration) -> str | None:
    """Why ``recipe`` cannot run at ``cfg`` with ``calibration`` (None: it can)."""
    try:
        recipe.method.quant_config(recipe.base(cfg))
    except ValueError as e:  # e.g. +ktiles with a quantizer that has no per-token values
        return f"cannot run at {cfg.label()}: {e}"
    return why_unusable(recipe, calibration)


def _beats_everywhere(a: dict, b: dict, metric: str = "nll") -> bool:
    return all(x < y for x, y in zip(a[f"chunk_{metric}"], b[f"chunk_{metric}"]))


def apply_rule(rule: str, order: list[str], evals: dict[str, dict], metric: str = "nll") -> str:
    """The candidate ``rule`` picks among ``order`` (names, simplest first; each with an evaluation in ``evals``), by
    ``metric`` (``nll`` or ``kl``: each evaluation's mean and ``chunk_<metric>`` per chunk; lower is better)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {', '.join(METRICS)}")
    if rule == "lowest":
        return min(order, key=lambda n: (evals[n][metric], order.index(n)))
    if rule == "simplest":
        pick = order[0]
        for n in order[1:]:  # a more complex candidate displaces the pick only by being lower on every chunk
            if _beats_everywhere(evals[n], evals[pick], metric):
                pick = n
        return pick
    raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")


def _why(rule: str, pick: str, order: list[str], evals: dict[str, dict], removed: dict[str, str], metric: str = "nll") -> str:
    n = len(order)
    if rule == "lowest":
        why = f"lowest mean {METRIC_LABELS[metric]} of {n} candidate{'s' * (n != 1)}"
    else:
        why = (f"the first of {n} candidate{'s' * (n != 1)} (simplest first), displaced only by one of lower {METRIC_LABELS[metric]} "
               "on every chunk"
               + (f": lower than {order[0]} on every chunk" if pick != order[0] else ""))
    if removed:
        why += "; removed by a gate: " + "; ".join(f"{k} ({v})" for k, v in removed.items())
    return why


# The clips `--refine` walks per option (multipliers on the configured QuEST α; the tile clip, 0 = min-max tiles).
REFINE_GRIDS = {"ka": CLIP_GRID, "va": CLIP_GRID, "tc": (0.0, 1.3, 1.7, 2.2, 3.0)}


def refine_options(recipe: Recipe, cfg: QuantConfig) -> list[str]:
    """The clip options of ``recipe`` that change what it stores at ``cfg``: the tile clip of key tiles or the QuEST key
    clip of per-token keys, then the QuEST value clip of per-token values."""
    run = recipe.method.quant_config(recipe.base(cfg))
    opts = []
    if recipe.method.key_layout == "tiles":
        opts.append("tc")
    elif run.side_quantizer("key") == "quest":
        opts.append("ka")
    if recipe.method.value_layout == "token" and run.side_quantizer("value") == "quest":
        opts.append("va")
    return opts


def refine_pick(recipe: Recipe, cfg: QuantConfig, score) -> list[str]:
    """Walk each clip option of ``recipe`` (:func:`refine_options`) downhill on its grid from its current value
    (:func:`wushkv.eval.clips.line_search`; ``score(recipe)`` the selection's metric on held-out text, memoized by the caller), one option
    after the other; returns the names of the recipes visited, the last one the walk's end."""
    from .clips import line_search

    visited = [recipe.name]
    for opt in refine_options(recipe, cfg):
        attr = RECIPE_OPTIONS[opt][0]
        now = getattr(recipe, attr)
        grid = sorted(set(REFINE_GRIDS[opt]) | {now})

        def f(x, r=recipe, attr=attr):
            v = replace(r, **{attr: float(x)})
            if v.name not in visited:
                visited.append(v.name)
            return score(v)

        recipe = replace(recipe, **{attr: float(line_search(f, grid, start=now))})
    if recipe.name != visited[-1]:  # the walk ends where it started an option, not where it last looked
        visited.remove(recipe.name)
        visited.append(recipe.name)
    return visited


class PasskeyGate:
    """Passkey retrieval on the gate's own prompts (:data:`PASSKEY_GATE`, seed 1) under the selection's quantizer
    setting: a candidate passes when its accuracy is no lower than full precision's on the same prompts."""

    name = "passkey"

    def __init__(self, model, tokenizer, calibration, settings: dict | None = None):
        self.model, self.tokenizer, self.calibration = model, tokenizer, calibration
        self.settings = dict(PASSKEY_GATE, **(settings or {}))
        self._fp = None

    def _accuracy(self, method: str, cfg: QuantConfig | None) -> float:
        from .passkey import run_passkey

        s = self.settings
        res = run_passkey(self.model, self.tokenizer, [method], self.calibration, cfg, s["contexts"], s["depths"], s["trials"],
                          seed=s["seed"], show_progress=False, log=lambda m: None)
        return res[method]["mean"]

    def __call__(self, recipe: Recipe, cfg: QuantConfig) -> dict:
        if self._fp is None:
            self._fp = self._accuracy("full-precision", cfg)
        acc = self._accuracy(recipe.method.name, recipe.base(cfg))
        return {"passed": acc >= self._fp - 1e-9, "accuracy": acc, "full_precision": self._fp,
                "detail": f"passkey accuracy {100 * acc:.0f}% against full precision's {100 * self._fp:.0f}%"}


def agreement_prompts(tokenizer, text: str, scored: int, prompts: int, prompt_len: int) -> torch.Tensor:
    """The agreement gate's prompts (prompts, prompt_len): consecutive tokens of the held-out ``text`` starting right
    after the first ``scored`` tokens, the ones the selection's chunks hold (:func:`wushkv.data.tokenize_chunks` cuts
    them from the start). Never the scored text, and never the evaluation text (the held-out text is not WikiText-2)."""
    if prompts < 1 or prompt_len < 2:
        raise ValueError(f"the agreement gate needs at least 1 prompt of at least 2 tokens, got {prompts} x {prompt_len}")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    rest = ids[scored : scored + prompts * prompt_len]
    if rest.numel() < prompts * prompt_len:
        raise ValueError(f"the held-out text has {max(ids.numel() - scored, 0)} tokens past the {scored} the selection scores, fewer "
                         f"than the agreement gate's {prompts} prompts x {prompt_len} tokens: give a longer --text-file, or fewer "
                         "--agreement-prompts or a shorter --agreement-prompt-len")
    return rest.view(prompts, prompt_len)


class AgreementGate:
    """Long-generation agreement with full precision on the gate's own prompts, under the selection's quantizer setting.

    **Measure.** Full precision generates ``new_tokens`` greedy tokens after each of ``prompts`` (N, P) (EOS
    ignored), once per gate; a recipe then reads ``prompt + continuation`` through its quantized cache (the exact
    single-pass emulation of streaming decode) and, at every generated position, agrees or not with full precision's
    next token (:func:`wushkv.eval.agreement.run_agreement`, what ``wushkv agree`` reports as top-1, with its mean KL
    and first divergence). The prompts are held-out text of the calibration's domain past the chunks the selection
    scores (:func:`agreement_prompts`), never the evaluation text ``agree`` and the reports read.

    **Rule.** A recipe passes when its top-1 agreement is no more than ``margin`` percentage points below the paper
    recipe's (``wush``) at the same width on the same continuations. The paper recipe is what every choice is measured
    against and what ``auto`` falls back to, so it always passes its own gate: a width whose candidates include it (not
    excluded by a budget) never loses its last candidate to this gate.

    **Defaults** (:data:`AGREEMENT_GATE`). 512 new tokens after 512-token prompts: a long generation for the cache,
    whose recent window (128 or 256 tokens) the continuation outgrows, so most generated tokens are read back
    quantized, hundreds of steps after they were written (the regime where WUSH's KL rose late,
    docs/lab/long-generation-agreement.md); 4 prompts, one batch, so decoding them costs little more than one. Margin 1
    point: in the full ``agree`` protocol on SmolLM2 at 2 bits (16 x 1024 tokens, docs/lab/generation-key-tiles.md)
    every working quantizer (the rotations, KVarN's tiles, every WUSH variant) lies within 0.6 points of WUSH's top-1
    (98.60% ... 99.62% against 99.13%) while a cache that breaks generation loses tens of points (no transform 73.8%,
    the stock 2-bit hqq cache 45.1%, docs/lab/long-generation-agreement.md): the gate removes what breaks generation,
    and leaves ranking what works to the held-out perplexity.

    **Cost.** The full-precision continuations once per gate (``new_tokens`` decoding steps of one batch), then per
    (recipe, width), the paper recipe's included once per width: one teacher-forced pass of the prompts and their
    continuations through the quantized cache, one full-precision pass for the reference logits, and greedy decoding
    through the quantized cache until every prompt has left full precision's text.
    """

    name = "agreement"

    def __init__(self, model, calibration, prompts: torch.Tensor, new_tokens: int = AGREEMENT_GATE["new_tokens"],
                 margin: float = AGREEMENT_GATE["margin"], log=lambda m: None):
        if new_tokens < 1:
            raise ValueError(f"--agreement-new-tokens {new_tokens}: generate at least 1 token (default {AGREEMENT_GATE['new_tokens']})")
        if not (0 <= margin <= 100):  # also refuses nan
            raise ValueError(f"--agreement-margin {margin:g}: percentage points of top-1 agreement a candidate may lose against the "
                             f"paper recipe, a number from 0 to 100 (default {AGREEMENT_GATE['margin']:g})")
        if prompts.dim() != 2 or prompts.shape[0] < 1 or prompts.shape[1] < 2:
            raise ValueError(f"the agreement gate's prompts must be (prompts, tokens) with at least 1 x 2, got {tuple(prompts.shape)}")
        self.model, self.calibration, self.prompts = model, calibration, prompts
        self.new_tokens, self.margin, self.log = int(new_tokens), float(margin), log
        # what the gate's results depend on, kept with them so that a resumed file of other settings is refused
        self.settings = {"prompts": int(prompts.shape[0]), "prompt_len": int(prompts.shape[1]), "new_tokens": self.new_tokens,
                         "margin": self.margin, "reference": PAPER, "batch": int(prompts.shape[0]),
                         "prompt_sha256": hashlib.sha256(prompts.cpu().numpy().tobytes()).hexdigest()}
        self.continuations: list[list[int]] = []  # full precision's, filled by the first run and read by every other
        self._runs: dict[tuple[str, str], dict] = {}  # (recipe, width setting) -> run_agreement's summary

    def agreement(self, recipe: Recipe, cfg: QuantConfig) -> dict:
        """:func:`~wushkv.eval.agreement.run_agreement`'s summary of ``recipe`` at ``cfg`` on the gate's prompts
        (``top1``, ``mean_kl``, ``median_first_divergence``, ...), run once per (recipe, setting)."""
        from .agreement import run_agreement

        key = (recipe.name, json.dumps(cfg.to_dict(), sort_keys=True))
        if key not in self._runs:
            # listed under the recipe's name: recipes of one method at other clips must not share rows
            res = run_agreement(self.model, self.prompts, [recipe.name], self.calibration, cfg, self.new_tokens, single_pass=True,
                                batch=self.prompts.shape[0], show_progress=False, log=lambda m: self.log(f"agreement gate: {m.strip()}"),
                                state={"continuations": self.continuations},
                                resolved={recipe.name: (recipe.method.name, recipe.base(cfg))})
            self._runs[key] = res[recipe.name]
        return self._runs[key]

    def __call__(self, recipe: Recipe, cfg: QuantConfig) -> dict:
        ref = self.agreement(parse_recipe(PAPER), cfg)
        got = self.agreement(recipe, cfg)
        passed = 100 * got["top1"] >= 100 * ref["top1"] - self.margin - 1e-9
        n, P = self.prompts.shape
        return {"passed": passed, "top1": got["top1"], "mean_kl": got["mean_kl"], "seconds": got["seconds"],
                "median_first_divergence": got["median_first_divergence"], "reference": PAPER, "reference_top1": ref["top1"],
                "reference_mean_kl": ref["mean_kl"], "reference_median_first_divergence": ref["median_first_divergence"],
                "margin": self.margin,
                "detail": f"top-1 agreement with full precision {100 * got['top1']:.2f}% against {PAPER}'s {100 * ref['top1']:.2f}% "
                          f"(allowed {self.margin:g} points below) over {n} x {self.new_tokens} generated tokens after {P}-token "
                          f"prompts; mean KL {got['mean_kl']:.4f} against {ref['mean_kl']:.4f}, median first divergence "
                          f"{got['median_first_divergence']:g} against {ref['median_first_divergence']:g}"}


def run_selection(model, chunks: torch.Tensor, calibration, candidates: list[str], bits: list[int], base: QuantConfig,
                  rule: str = "lowest", budget: float | None = None, gates=(), json_path=None, meta: dict | None = None,
                  refine: bool = False, cover: str = "auto", metric: str = DEFAULT_METRIC, show_progress: bool = True, log=print) -> dict:
    """Evaluate every candidate at every width on ``chunks`` (N, serve_len) of held-out text and choose per width
    (module docstring). ``gates``: callables ``(recipe, cfg) -> {"passed", "detail", ...}`` with a ``name``.
    ``refine``: walk the clips of each width's pick downhill (:func:`refine_pick`) before the rule's final choice.
    ``cover``: ``"auto"`` also evaluates each candidate on statistics covered to the served length where the
    calibration is shorter (:func:`covered_candidates`), ``"no"`` only on the file's own. ``metric``: what the rule and the
    walk compare (:data:`METRICS`); both are measured on every evaluation, so choosing again by the other is free.

    Returns ``{"settings", "fp", "results", "choices"}``: ``results[recipe][bits]`` each evaluation (or why it was
    excluded), ``choices[bits]`` what the rule picked (:func:`selection_record` turns them into what the calibration
    stores). Resumes from ``json_path`` (a file of other settings is refused)."""
    if rule not in RULES:
        raise ValueError(f"--rule {rule!r}: known rules are {', '.join(RULES)}")
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r}: known metrics are {', '.join(METRICS)}")
    if budget is not None and not (0 < budget < float("inf")):
        raise ValueError(f"--budget {budget!r}: bits per element must be a positive number")
    recipes = [parse_recipe(c) for c in candidates]
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise ValueError(f"--candidates lists a recipe twice: {', '.join(n for n in names if names.count(n) > 1)}")
    if PAPER not in names:  # the paper recipe is what every choice is measured against
        recipes, names = [parse_recipe(PAPER)] + recipes, [PAPER] + names
    listed = len(recipes)
    recipes = covered_candidates(recipes, calibration, int(chunks.shape[1]), cover)
    names = [r.name for r in recipes]
    if len(recipes) > listed:
        log(f"plus {len(recipes) - listed} candidates: the same on statistics covered to {chunks.shape[1]} positions "
            f"(+cover{chunks.shape[1]}), the calibration's sequences being {calibration.meta['seq_len']} tokens (--cover no leaves them out)")
    head_dim = describe(model).head_dim
    cfgs = {b: replace(base, k_bits=b, v_bits=b) for b in bits}  # validates the widths before anything runs
    settings = as_json(dict(meta or {}, chunks=int(chunks.shape[0]), serve_len=int(chunks.shape[1]), setting=selection_setting(base),
                            rule=rule, metric=metric, budget=budget, gates=[g.name for g in gates],
                            gate_settings={g.name: getattr(g, "settings", None) for g in gates}, refine=refine, cover=cover,
                            text_sha256=hashlib.sha256(chunks.cpu().numpy().tobytes()).hexdigest(),
                            calibration=calibration_recipe(calibration.meta)))
    out = {"command": "select", "settings": settings, "fp": None, "results": {}}
    if json_path and (prev := read_run(json_path, ("settings", "results"), "wushkv select", command="select")) is not None:
        # what the evaluations depend on: not the candidates, widths, rule, budget or gates (choosing again is free)
        key = lambda s: {k: v for k, v in s.items()  # noqa: E731
                         if k not in ("candidates", "bits", "rule", "metric", "budget", "gates", "gate_settings", "refine", "cover")}
        resume_settings(json_path, prev["settings"], settings, key=key)
        # a gate's stored results hold only for the settings it ran with: adding a gate is free, changing one is refused
        before = prev["settings"].get("gate_settings") or {}
        for name, now in settings["gate_settings"].items():
            if name in before and before[name] != now:
                differ = sorted(k for k in set(before[name] or {}) | set(now or {}) if (before[name] or {}).get(k) != (now or {}).get(k))
                raise ValueError(f"--json {json_path} holds {name} gate results of other settings (differing: {', '.join(differ)}); "
                                 f"give the same {name} gate settings, another path to start afresh, or delete it")
        settings["gate_settings"] = before | settings["gate_settings"]  # a gate not run now keeps its results and settings
        out = {"command": "select", "settings": settings, "fp": prev.get("fp"), "results": prev["results"], "gates": prev.get("gates", {})}
        if out["fp"] is not None and len(out["fp"].get("chunk_nll", [])) != chunks.shape[0]:
            raise ValueError(f"--json {json_path}: its evaluations cover {len(out['fp']['chunk_nll'])} chunks, not {chunks.shape[0]}")
        log(f"resuming from {json_path}")
    out.setdefault("gates", {})
    out["order"] = names  # the candidates as evaluated, simplest first (covered variants after their own)

    def save():
        if json_path:
            write_json(json_path, out)

    plan = []  # (recipe, width) to evaluate; exclusions are decided afresh each run, before anything long runs
    out["excluded"] = {}
    for b, cfg in cfgs.items():
        for r in recipes:
            why, bpe = _unrunnable(r, cfg, calibration), None
            if why is None:
                bpe = bits_per_element(r, cfg, head_dim)
                if budget is not None and bpe > budget + 1e-9:
                    why = f"over the budget: {bpe:.3f} bits per element > {budget:g}"
            if why is not None:
                out["excluded"].setdefault(r.name, {})[str(b)] = {"why": why, "bits_per_element": bpe}
            elif not _measured(out["results"].get(r.name, {}).get(str(b)), metric):
                plan.append((r, b, bpe))
    reference = []  # full precision's distributions per chunk, for the KL (kept in memory only: ~6 MB per 2048-token chunk)

    def fp_reference() -> list:
        """Full precision's :class:`~wushkv.eval.perplexity.Reference` per chunk: from its own pass, run (once) before the
        first evaluation; a resumed run that has evaluations left runs it again (deterministic, one pass)."""
        if not reference:
            fp = perplexity(model, chunks, show_progress=show_progress, desc="full precision", keep_reference=REFERENCE_TOP)
            reference.extend(fp.pop("reference"))
            if out["fp"] is None:
                out["fp"] = {"ppl": fp["ppl"], "nll": fp["nll"], "chunk_nll": fp["chunk_nll"], "seconds": fp["seconds"]}
                save()
        return reference

    if out["fp"] is None:
        fp_reference()

    def evaluate(r: Recipe, b: int, bpe: float | None) -> dict:
        """The stored evaluation of ``r`` at ``b`` bits, run (and saved) if there is none or it lacks the metric (an
        evaluation from before the KL was measured)."""
        got = out["results"].get(r.name, {}).get(str(b))
        if _measured(got, metric):
            return got
        cfg = r.method.quant_config(r.base(cfgs[b]))
        res = quantized_perplexity(model, chunks, calibration, r.method, cfg, show_progress=False, reference=fp_reference())
        e = out["results"].setdefault(r.name, {})[str(b)] = {
            "ppl": res["ppl"], "nll": res["nll"], "delta_pct": 100 * (res["ppl"] / out["fp"]["ppl"] - 1), "chunk_nll": res["chunk_nll"],
            "kl": res["kl"], "chunk_kl": res["chunk_kl"], "kl_top": REFERENCE_TOP, "seconds": res["seconds"], "bits_per_element": bpe, "config": cfg.to_dict()}
        log(f"{r.name:>28} {b}-bit  held-out PPL {res['ppl']:9.3f}  ({e['delta_pct']:+.2f}%, KL {res['kl']:.5f}, {bpe:.3f} bits/element, "
            f"{res['seconds']:.0f}s)")
        save()
        return e

    bar = progress(plan, desc="select", enabled=show_progress, unit="eval")
    for r, b, bpe in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{r.name} {b}-bit")
        evaluate(r, b, bpe)
    refined: dict[int, list[str]] = {b: [] for b in cfgs}
    if refine:
        for b, cfg in cfgs.items():
            order = [n for n in names if str(b) not in out["excluded"].get(n, {})]
            if not order:
                continue
            start = parse_recipe(apply_rule(rule, order, {n: out["results"][n][str(b)] for n in order}, metric))
            bpe = out["results"][start.name][str(b)]["bits_per_element"]
            walked = refine_pick(start, cfg, lambda r: evaluate(r, b, bpe)[metric])
            refined[b] = [n for n in walked if n not in order]
            log(f"{b}-bit: clips walked from {start.name}: {', '.join(walked)}")
    out["choices"] = {}
    for b, cfg in cfgs.items():
        order = [n for n in names if str(b) not in out["excluded"].get(n, {})] + refined[b]  # refined last: the most complex
        evals = {n: out["results"][n][str(b)] for n in order}
        removed: dict[str, str] = {}
        pick = None
        while order:
            pick = apply_rule(rule, order, evals, metric)
            failed = None
            for g in gates:
                key = f"{g.name}/{pick}/{b}"
                if key not in out["gates"]:
                    out["gates"][key] = r = g(parse_recipe(pick), cfg)
                    log(f"{b}-bit {pick}: {g.name} gate {'passed' if r['passed'] else 'FAILED'}: {r['detail']}")
                    save()
                if not out["gates"][key]["passed"]:
                    failed = f"{g.name}: {out['gates'][key]['detail']}"
                    break
            if failed is None:
                break
            removed[pick] = failed
            order = [n for n in order if n != pick]
            pick = None
        if pick is None:
            out["choices"][str(b)] = None
            log(f"{b}-bit: no candidate left ({'; '.join(f'{k}: {v}' for k, v in removed.items()) or 'all excluded'}); auto keeps its fallback")
            continue
        e = evals[pick]
        choice = {"recipe": pick, "why": _why(rule, pick, order, evals, removed, metric), "delta_pct": e["delta_pct"],
                  "bits_per_element": e["bits_per_element"]}
        if "kl" in e:
            choice["kl"] = e["kl"]
        if pick != PAPER and PAPER in evals:
            d, lo, hi = paired_difference(e["chunk_nll"], evals[PAPER]["chunk_nll"])
            choice["versus_paper"] = [d, lo, hi] if len(e["chunk_nll"]) >= MIN_CHUNKS_FOR_INTERVAL else [d, None, None]
        out["choices"][str(b)] = choice
    save()
    return out


def _measured(e: dict | None, metric: str) -> bool:
    """Whether the stored evaluation ``e`` holds ``metric``: evaluations from before the KL was measured hold the NLL
    only, and run again when the KL is asked for, as do those whose KL kept another number of full precision's tokens
    (``kl_top``: a coarser reference gives a smaller KL, so KLs of different references do not compare)."""
    return e is not None and (metric == "nll" or ("chunk_kl" in e and e.get("kl_top") == REFERENCE_TOP))


def selection_record(out: dict, text_label: str) -> dict:
    """What the calibration file stores of a selection (:attr:`wushkv.calibration.Calibration.selections`): the choices
    per width and the settings they were chosen under."""
    s = out["settings"]
    return {"version": SELECTION_VERSION, "setting": s["setting"], "serve_len": s["serve_len"], "chunks": s["chunks"],
            "text": text_label, "text_sha256": s["text_sha256"], "rule": s["rule"], "metric": s.get("metric", "nll"), "budget": s["budget"],
            "gates": s["gates"],
            "gate_settings": {g: (s.get("gate_settings") or {}).get(g) for g in s["gates"]},
            "candidates": s.get("candidates"), "fp_ppl": out["fp"]["ppl"],
            "choices": {b: c for b, c in out["choices"].items() if c is not None},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "wushkv_version": __version__}


def _listed(out: dict, candidates: list[str]) -> list[str]:
    """The paper recipe, the candidates in their order (each followed by its covered variant), then what a refinement
    walk added."""
    names = out.get("order") or [parse_recipe(c).name for c in candidates]
    names = ([PAPER] if PAPER not in names else []) + names
    return names + [n for n in out["results"] if n not in names]


def selection_report(out: dict, candidates: list[str], bits: list[int], model: str, text_label: str) -> str:
    """Per width, every candidate: held-out PPL and Δ% over full precision, paired Δ% against the paper recipe, mean KL to
    full precision, bits per element, and what became of it (chosen, excluded and why, removed by a gate)."""
    from ..report import format_table

    s = out["settings"]
    names = _listed(out, candidates)
    lines = [f"\n{model}: selection on {text_label} ({s['chunks']} x {s['serve_len']} tokens) under {setting_label(s['setting'])}, "
             f"rule {s['rule']} by {METRIC_LABELS[s.get('metric', 'nll')]}" + (f", budget {s['budget']:g} bits/element" if s.get("budget") else "")
             + (f", gates {', '.join(s['gates'])}" if s.get("gates") else "")
             + f"; full precision PPL {out['fp']['ppl']:.3f}"]
    for b in bits:
        rows = []
        choice = out["choices"].get(str(b))
        for n in names:
            x = out.get("excluded", {}).get(n, {}).get(str(b))
            if x is not None:
                bpe = x["bits_per_element"]
                rows.append([n, "-", "-", "-", "-", bpe if bpe is not None else "-", f"excluded: {x['why']}"])
                continue
            e = out["results"].get(n, {}).get(str(b))
            if e is None:
                continue
            bpe = e.get("bits_per_element")
            paired = "-"
            if n != PAPER and PAPER in out["results"] and "chunk_nll" in out["results"][PAPER].get(str(b), {}):
                d, lo, hi = paired_difference(e["chunk_nll"], out["results"][PAPER][str(b)]["chunk_nll"])
                paired = f"{d:+.2f}" + (f" ({lo:+.2f} … {hi:+.2f})" if len(e["chunk_nll"]) >= MIN_CHUNKS_FOR_INTERVAL else "")
            gate = [(k.split("/")[0], v) for k, v in out.get("gates", {}).items()  # failures of the gates this run applied
                    if k.endswith(f"/{n}/{b}") and k.split("/")[0] in s["gates"] and not v["passed"]]
            status = "CHOSEN" if choice and choice["recipe"] == n else (f"removed by gate {gate[0][0]}: {gate[0][1]['detail']}" if gate else "")
            rows.append([n, e["ppl"], f"{e['delta_pct']:+.2f}", paired, f"{e['kl']:.5f}" if "kl" in e else "-", bpe, status])
        lines.append(format_table(["candidate", "held-out PPL", "Δ% vs FP", "Δ% vs wush (95% CI)", "KL to FP", "bits/elem", ""], rows,
                                  title=f"\n{b} bits" + (f": {choice['recipe']} ({choice['why']})" if choice else ": no choice")))
    return "\n".join(lines)


def plot_selection(out: dict, candidates: list[str], bits: list[int], path, model: str, text_label: str):
    """What the rule compared against bits, one line per candidate: the held-out Δ% over full precision (log scale;
    symmetric log where a candidate is below full precision, as held-out text can put a 3-4-bit cache), as ``compare``
    plots, or the mean KL to full precision; for one width, one bar per candidate in the listed order, the pick
    highlighted."""
    from ..report import plot_bars, plot_lines

    names = _listed(out, candidates)
    chosen = {(out["choices"].get(str(b)) or {}).get("recipe") for b in bits}
    key, label = (("kl", "held-out KL to full precision (nats per token)") if out["settings"].get("metric") == "kl"
                  else ("delta_pct", "held-out perplexity increase over full precision (%)"))
    series = {}
    for n in names:
        ys = [float("nan") if str(b) in out.get("excluded", {}).get(n, {}) else
              out["results"].get(n, {}).get(str(b), {}).get(key, float("nan")) for b in bits]
        series[n] = ys
    if len(bits) == 1:
        s = out["settings"]
        return plot_bars({n: ys[0] for n, ys in series.items()}, path, label,
                         f"{model}, {bits[0]} bits: selection on {text_label}, {s['chunks']} x {s['serve_len']} tokens (chosen in orange)",
                         highlight=chosen, logx=True)
    series = {n + (" *" if n in chosen else ""): ys for n, ys in series.items()}
    return plot_lines(bits, series, path, "bits (keys and values)", label,
                      f"{model}: selection on {text_label} (* chosen at some width)", logy=True)
