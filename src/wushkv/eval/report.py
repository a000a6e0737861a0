"""The result tables and figures of each evaluation, as the ``wushkv`` commands print and plot them.

Each function takes an evaluation's result (the dict it returns or saves) and gives back text; ``plot_*`` write a
PNG. Generic table and plot helpers are in :mod:`wushkv.report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import exp, isnan, nan
from pathlib import Path

from ..config import QuantConfig, WindowConfig
from ..report import format_table, markdown_table, plot_heatmaps, plot_lines
from .clips import ClipTable


# -- tables: (headers, rows) of each evaluation's result ------------------------------------------------------
def compare_table(out: dict, transforms: Sequence[str], bits: Sequence[int]) -> tuple[list[str], list[list]]:
    """(headers, rows) of the comparison: per transform, perplexity and % over full precision at each width."""
    headers = ["transform"] + [f"{b}-bit PPL" for b in bits] + [f"{b}-bit Δ%" for b in bits]
    rows = []
    for t in transforms:
        r = out["results"].get(t, {})
        rows.append([t] + [r.get(str(b), {}).get("ppl", float("nan")) for b in bits]
                    + [round(r.get(str(b), {}).get("delta_pct", float("nan")), 2) for b in bits])
    return headers, rows


def clip_table_rows(table: ClipTable, methods: Sequence[str], bits: Sequence[int]) -> tuple[list[str], list[list]]:
    """Per (method, width): the chosen multipliers and the held-out perplexity at α_b and at the choice."""
    headers = ["method", "bits", "α_K ×", "α_V ×", "PPL at α_b", "Δ% at α_b", "PPL chosen", "Δ% chosen", "evaluations"]
    rows = []
    for m in methods:
        for b in bits:
            e = table.entries(m).get(str(b))
            if e is None:
                continue
            n = len(table.data["trials"].get(m, {}).get(str(b), []))
            rows.append([m, b, e["k_alpha"], e["v_alpha"], round(e["ppl_alpha_b"], 3), round(e["delta_pct_alpha_b"], 2),
                         round(e["ppl"], 3), round(e["delta_pct"], 2), n])
    return headers, rows


def key_curves(table: ClipTable, methods: Sequence[str], bits: Sequence[int]) -> tuple[list[float], dict[str, list[float]]]:
    """(grid, {"method b-bit": Δ% per key multiplier, values at α_b}) for a plot; NaN where not evaluated."""
    grid = table.data["settings"]["grid"]
    series = {}
    for b in bits:
        for m in methods:
            trials = {t["k_alpha"]: t["delta_pct"] for t in table.data["trials"].get(m, {}).get(str(b), []) if t["v_alpha"] == 1.0}
            if trials:
                series[f"{m} {b}-bit"] = [trials.get(a, float("nan")) for a in grid]
    return grid, series


# -- labels ---------------------------------------------------------------------------------------
def method_label(name: str, settings: dict) -> str:
    """``auto (wush+ktiles+ldlq)`` for ``auto`` in a run whose settings record its resolution; else ``name``."""
    from ..methods.spec import AUTO_NAME

    got = settings.get("auto") if name == AUTO_NAME else None
    return f"{name} ({got['method']})" if isinstance(got, dict) and "method" in got else name


def auto_note(settings: dict, res) -> str:
    """``; auto: wush+rmean+ktiles+ldlq (tile clip 1.7), K2V2 Kkvarn/Vaffine clip1.7 64/196/128`` when ``auto`` is
    reported and its settings are recorded: what it ran at, which the run's own label does not say."""
    from ..methods.auto import describe_resolved
    from ..methods.spec import AUTO_NAME, method_config

    got = settings.get("auto")
    if AUTO_NAME not in res or not isinstance(got, dict) or "method" not in got or "quantization" not in got:
        return ""
    c = QuantConfig.from_dict(got["quantization"])
    return f"; auto: {describe_resolved(got['method'], c)}, {method_config(got['method'], c).label()}"


def sibling(path: str | Path, tag: str) -> Path:
    """``out/x.png`` -> ``out/x{tag}.png``: a second file beside one the user named."""
    p = Path(path)
    return p.with_name(p.stem + tag + p.suffix)


# -- recon ----------------------------------------------------------------------------------------
def recon_tables(results: dict[int, dict], first: str, model: str, quantizer: str, shape: Sequence[int], text: str) -> str:
    """Per width (``results``: bits -> transform -> {"geomean", "per_layer"}): each transform's module-output error
    and its ratio to transform ``first``'s; ``shape``: (sequences, tokens)."""
    out = []
    for bits, res in results.items():
        rows = [[n, r["geomean"], r["geomean"] / res[first]["geomean"]] for n, r in res.items()]
        out.append(format_table(["transform", "geomean rel. error", f"/ {first}"], rows,
                                title=f"\n{model}: module-output error, K{bits}V{bits} {quantizer}, {shape[0]} x {shape[1]} tokens of {text}"))
    return "\n".join(out)


def plot_recon(res: dict, path, model: str, bits: int, quantizer: str):
    """Error per layer of each transform (``res``: transform -> {"per_layer"}) at one width."""
    layers = list(range(len(next(iter(res.values()))["per_layer"])))
    return plot_lines(layers, {n: r["per_layer"] for n, r in res.items()}, path, "layer",
                      "‖Ŷ−Y‖² / ‖Y‖²", f"{model}: K{bits}V{bits} {quantizer}, module-output error", logy=True)


# -- compare --------------------------------------------------------------------------------------
def margin_lines(out: dict, transforms: Sequence[str], bits: Sequence[int]) -> list[str]:
    """Per width: the lowest-perplexity method against the runner-up, with its paired bootstrap interval."""
    from .compare import margins

    lines = []
    for b, m in margins(out, transforms, bits).items():
        ci = f" [95% paired bootstrap over chunks: {m['ci'][0]:+.2f}%, {m['ci'][1]:+.2f}%]" if m["ci"] else ""
        lines.append(f"{b}-bit: {m['best']} vs runner-up {m['second']}: {m['delta_pct']:+.2f}%{ci}")
    return lines


def compare_report(out: dict, transforms: Sequence[str], bits: Sequence[int], model: str, text: str, quantizer: str,
                   windows: WindowConfig, clips: str | None = None) -> str:
    """The comparison table (:func:`~wushkv.eval.compare.run_compare`'s ``out``) with its title, the clips each
    method ran at (``clips``: the table's path, if one was used), what ``auto`` stood for, the best per width and
    its margins."""
    from ..methods.auto import describe_resolved
    from ..methods.spec import AUTO_NAME as AUTO
    from ..methods.spec import KVARN_TILE, key_tile_windows, parse
    from .compare import best_per_bits

    headers, rows = compare_table(out, transforms, bits)
    w = windows
    clip_note = f", clips per method from {clips}" if clips is not None else ""
    kw = key_tile_windows(w)
    ran = [r.get("method", t) for t in transforms for r in out["results"].get(t, {}).values()]  # what auto resolved to, too
    ktiles_note = f"; +ktiles: key tiles of {KVARN_TILE}, windows {kw.S_sink}/{kw.S_keep}/{kw.S_flush}" if any(getattr(parse(m), "key_tiles", False) for m in ran) else ""
    chunks, seq_len = out["settings"]["chunks"], out["settings"]["seq_len"]
    title = (f"\n{model} on {text}: {chunks} x {seq_len} tokens, {quantizer}{clip_note}, K=V bits, "
             f"windows {w.S_sink}/{w.S_keep}/{w.S_flush} (kvarn and +tiles: tiles of {KVARN_TILE}, windows {KVARN_TILE}/0/{KVARN_TILE}{ktiles_note})\n"
             f"full precision PPL {out['fp']['ppl']:.3f}")
    lines = [format_table(headers, rows, title=title)]
    if clips is not None:
        used = [f"{t} {b}-bit αK×{c['k_alpha']:g} αV×{c['v_alpha']:g}" for t in transforms for b in bits
                if (c := out["results"].get(t, {}).get(str(b), {}).get("config")) and c.get("quantizer") == "quest"]
        lines.append("clips: " + ", ".join(used))
    if AUTO in transforms:
        def resolved(r: dict) -> str:
            return describe_resolved(r["method"], QuantConfig.from_dict(r["config"])) if "config" in r else r.get("method", "?")

        lines.append("auto: " + ", ".join(f"{b}-bit {resolved(out['results'][AUTO][str(b)])}" for b in bits))
        whys: dict[str, list[int]] = {}
        for b in bits:  # where each choice came from (results of older versions recorded none)
            whys.setdefault(out["results"][AUTO][str(b)].get("why", "chosen on held-out C4 (docs/results.md)"), []).append(b)
        lines += [f"  {', '.join(map(str, bs))}-bit: {why}" for why, bs in whys.items()]
    best = best_per_bits(out, transforms, bits)
    lines.append("lowest perplexity: " + ", ".join(f"{b}-bit {t}" for b, t in best.items()))
    lines.append("\n".join("  " + x for x in margin_lines(out, transforms, bits)))
    return "\n".join(lines)


def compare_markdown(out: dict, transforms: Sequence[str], bits: Sequence[int]) -> str:
    """The comparison table and its margins as Markdown."""
    headers, rows = compare_table(out, transforms, bits)
    return (f"full precision PPL {out['fp']['ppl']:.3f}\n\n" + markdown_table(headers, rows) + "\n\n"
            + "".join(f"* {x}\n" for x in margin_lines(out, transforms, bits)))


def plot_compare(out: dict, transforms: Sequence[str], bits: Sequence[int], path, model: str, what: str):
    """Δ% over full precision against bits, one line per transform (``what``: the subtitle, e.g. the quantizer);
    a width a transform lacks is left out of its line."""
    # % over full precision on a log scale: the transforms that matter differ by a few percent
    # while identity is off by hundreds (symmetric log where one is below full precision: plot_lines).
    def pct(t: str, b: int) -> float:
        return out["results"][t].get(str(b), {}).get("delta_pct", nan)

    return plot_lines(bits, {t: [pct(t, b) for b in bits] for t in transforms},
                      path, "bits (keys and values)", "perplexity increase over full precision (%)",
                      f"{model}: {what}, full precision PPL {out['fp']['ppl']:.2f}", logy=True)


# -- tune-clip ------------------------------------------------------------------------------------
def clip_report(table, transforms: Sequence[str], bits: Sequence[int], model: str, text: str, path) -> str:
    """The chosen clips (:class:`~wushkv.eval.clips.ClipTable`) with what they were chosen on, and where they went."""
    headers, rows = clip_table_rows(table, transforms, bits)
    s = table.data["settings"]
    w = QuantConfig.from_dict(s["base"]).windows
    return format_table(headers, rows, title=f"\n{model}: QuEST clip multipliers on α_b chosen on {text} "
                        f"({s['chunks']} x {s['seq_len']} tokens, windows {w.S_sink}/{w.S_keep}/{w.S_flush}); "
                        f"full precision PPL {table.data['fp']['ppl']:.3f}\nwritten to {path}")


def plot_clip_curves(table, transforms: Sequence[str], bits: Sequence[int], path, model: str, text: str):

    grid, series = key_curves(table, transforms, bits)
    return plot_lines(grid, series, path, "QuEST key clip multiplier on α_b (values at α_b)", "held-out perplexity increase (%)",
                      f"{model}: key clip on {text}",
                      logy=all(v > 0 for ys in series.values() for v in ys if v == v))  # NaN: not evaluated


# -- agree ----------------------------------------------------------------------------------------
def agreement_table(settings: dict, res: dict) -> str:
    """Per method (:func:`~wushkv.eval.agreement.report`'s ``res``): KL, top-1 agreement, first divergence, growth."""
    cfg = QuantConfig.from_dict(settings["quantization"])
    rows = [[method_label(m, settings), r["prompts"], r["mean_kl"], 100 * r["top1"], r["median_first_divergence"], r["kl_first_quarter"],
             r["kl_last_quarter"], r["kl_growth"], r["kl_late_growth"]] for m, r in res.items()]
    return format_table(["method", "prompts", "mean KL", "top-1 %", "median 1st div.", "KL 1st quarter", "KL last quarter", "last/first",
                         "4th/2nd"], rows,
                        title=f"\n{settings['model']}: prompts of {settings['prompt_len']} tokens from {settings['text']}, "
                              f"{settings['new_tokens']} generated, {cfg.label()}"
                              f"{' (single-pass emulation)' if settings['single_pass'] else ' (streaming)'}{auto_note(settings, res)}")


def plot_agreement(settings: dict, res: dict, path):
    """Mean KL over bins of generated positions, per method."""
    cfg = QuantConfig.from_dict(settings["quantization"])
    n = settings["new_tokens"]
    width = max(1, n // 32)  # mean KL over bins of positions
    xs = list(range(0, n, width))
    series = {method_label(m, settings): [sum(r["kl_by_position"][a : a + width]) / len(r["kl_by_position"][a : a + width]) for a in xs]
              for m, r in res.items()}
    return plot_lines([x + width / 2 for x in xs], series, path, "generated position", "KL(P_fp ‖ P_q), nats (mean over prompts)",
                      f"{settings['model']}: {cfg.label()}, teacher-forced", logy=True)


def late_growth_report(settings: dict, growth: dict, reference: str) -> str:
    """:func:`~wushkv.eval.agreement.late_growth_by_method`'s result, one line per method."""
    lines = [f"KL from the 2nd to the 4th quarter, and against {method_label(reference, settings)}'s (95% bootstrap over prompts):"]
    for m, g in growth.items():
        lines.append(f"  {method_label(m, settings):>24}: x{g['ratio']:.2f} [{g['ci'][0]:.2f}, {g['ci'][1]:.2f}]  "
                     f"vs {reference}: x{g['vs_reference']:.2f} [{g['vs_reference_ci'][0]:.2f}, {g['vs_reference_ci'][1]:.2f}]")
    return "\n".join(lines)


# -- passkey --------------------------------------------------------------------------------------
def passkey_tables(res: dict, settings: dict, model: str, contexts: Sequence[int], depths: Sequence[float], trials: int,
                   cfg: QuantConfig) -> str:
    """Accuracy and mean log P(key) per method (:func:`~wushkv.eval.passkey.run_passkey`'s ``res``) by context,
    averaged over depths."""
    label = lambda m: method_label(m, settings)  # noqa: E731
    headers = ["method"] + [f"{c}" for c in contexts] + ["mean"]
    rows = [[label(m)] + [100 * sum(r["accuracy"].get(f"{c}/{d}", nan) for d in depths) / len(depths) for c in contexts] + [100 * r["mean"]]
            for m, r in res.items()]
    acc = format_table(headers, rows, title=f"\n{model}: passkey accuracy (%) by context, mean over depths {list(depths)}, "
                                            f"{trials} trials each, {cfg.label()}")
    rows = [[label(m)] + [sum(r["logprob"].get(f"{c}/{d}", nan) for d in depths) / len(depths) for c in contexts] + [r["logprob_mean"]]
            for m, r in res.items()]
    return acc + "\n" + format_table(headers, rows, title=f"\n{model}: mean log P(key) in nats (teacher-forced; 0 = certain), "
                                                          "the same cases")


def plot_passkey(res: dict, settings: dict, model: str, contexts: Sequence[int], depths: Sequence[float], cfg: QuantConfig, path) -> None:
    """Heatmaps of accuracy at ``path``; beside it (``NAME_pkey.png``) the geometric-mean probability of the key."""
    label = lambda m: method_label(m, settings)  # noqa: E731
    grids = {label(m): [[r["accuracy"].get(f"{c}/{d}", nan) for c in contexts] for d in depths] for m, r in res.items()}
    plot_heatmaps(grids, depths, contexts, path, "context (tokens)", "depth", f"{model}: passkey accuracy (%), {cfg.label()}")
    # the same cells as probabilities: exp(mean log P(key)), the geometric mean of P(key) over trials
    grids = {label(m): [[exp(r["logprob"].get(f"{c}/{d}", nan)) for c in contexts] for d in depths] for m, r in res.items()}
    plot_heatmaps(grids, depths, contexts, sibling(path, "_pkey"), "context (tokens)", "depth",
                  f"{model}: geometric-mean P(key) (%), {cfg.label()}", vmax=None)  # far below 1 even in full precision


# -- sweep ----------------------------------------------------------------------------------------
def sweep_table(out: dict, results_dir) -> str:
    """One row per job of :func:`~wushkv.sweep.run_sweep`'s result (NaN: not finished)."""
    rows = [[r["model"].split("/")[-1], r["transform"], r["quantizer"], f"K{r['k_bits'] or 16}V{r['v_bits'] or 16}",
             r["evaluation"], float("nan") if r["value"] is None else r["value"]] for r in out["results"]]
    return format_table(["model", "transform", "quantizer", "bits", "evaluation", "value"], rows,
                        title=f"sweep: {out['finished']}/{out['total']} jobs finished ({len(out['ran'])} run now); {results_dir}/results.{{json,md}}")
