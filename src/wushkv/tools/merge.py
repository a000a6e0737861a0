"""``wushkv merge compare|agree|passkey``: put together runs made in parallel (one process per method or per
calibration) into one table or one resumable file.

Every merge refuses rather than mixes: files of another text, model or settings, or holding another result for the
same case, raise :class:`ValueError` naming the file and what differs.
"""

from __future__ import annotations

from ..io import read_json
from ..runs import reconcile_settings, refuse_other_command


def read_runs(paths: list[str], command: str | None = None) -> list[tuple[str, dict]]:
    """[(path, parsed JSON)] in the order given; a file another wushkv ``command`` wrote is refused by name (files from
    before session 61 record none: their structure is checked by each merge)."""
    out = []
    for p in paths:
        d = read_json(p, "run file")
        if not isinstance(d, dict) or not isinstance(d.get("settings"), dict):
            raise ValueError(f"run file {p} is not a file a wushkv run wrote (no settings)")
        if command is not None:
            refuse_other_command(d, command, f"run file {p}")
        out.append((str(p), d))
    return out


# -- compare --------------------------------------------------------------------------------------------------------
def merge_compare(runs: list[tuple[str, dict]]) -> tuple[dict, dict]:
    """(first file's run, {transform: {bits: result}}) of several ``wushkv compare --json`` files of the same text.

    Files must share the model, text hash, chunks, sequence length and the full-precision perplexity (to 1e-9
    relative); a transform that appears in two files is taken from the first."""
    first, rows = None, {}
    for p, d in runs:
        s = d["settings"]
        fp, results = d.get("fp"), d.get("results")
        if not (isinstance(fp, dict) and "ppl" in fp and isinstance(results, dict)
                and all(isinstance(r, dict) and all(str(b).isdigit() for b in r) for r in results.values())):
            raise ValueError(f"{p}: not a file `wushkv compare --json` wrote (no perplexities by method and width)")
        if first is None:
            first = d
        else:
            f = first["settings"]
            for key in ("model", "text_sha256", "chunks", "seq_len"):
                if key == "text_sha256" and None in (s.get(key), f.get(key)):
                    continue  # files written before the text hash was recorded: the full-precision check below still holds
                if s.get(key) != f.get(key):
                    raise ValueError(f"{p}: {key} {s.get(key)!r} differs from {runs[0][0]}'s {f.get(key)!r}")
            if abs(d["fp"]["ppl"] - first["fp"]["ppl"]) > 1e-9 * first["fp"]["ppl"]:
                raise ValueError(f"{p}: full-precision PPL {d['fp']['ppl']} differs from {runs[0][0]}'s {first['fp']['ppl']}")
        for t, by_bits in d["results"].items():
            for b, r in by_bits.items():
                rows.setdefault(t, {}).setdefault(b, r)
    return first, rows


def compare_report(first: dict, rows: dict, versus: str | None = None, plot: str | None = None) -> str:
    """The merged table (perplexity and Δ% per width), with ``versus`` every row's paired difference from that
    transform (95% bootstrap interval over chunks), and with ``plot`` a plot of Δ% against bits written there."""
    from ..eval.report import compare_table, plot_compare
    from ..report import format_table

    bits = sorted({int(b) for r in rows.values() for b in r})
    merged = {"results": rows, "fp": first["fp"]}  # the shape of one compare run: its table and plot builders apply
    headers, table = compare_table(merged, list(rows), bits)
    s = first["settings"]
    out = [format_table(headers, table, title=f"{s['model']}: {s['chunks']} x {s['seq_len']} tokens, full precision PPL {first['fp']['ppl']:.3f}")]
    if versus:
        from ..eval.compare import paired_difference

        if versus not in rows:
            raise ValueError(f"--versus {versus!r} is not a row; rows: {sorted(rows)}")
        out.append(f"\npaired difference from {versus} (Δ% of perplexity, 95% interval over chunks):")
        for t in rows:
            if t == versus:
                continue
            parts = []
            for b in bits:
                a, r = rows[t].get(str(b)), rows[versus].get(str(b))
                if a and r and a.get("chunk_nll") and r.get("chunk_nll"):
                    d, lo, hi = paired_difference(a["chunk_nll"], r["chunk_nll"])
                    parts.append(f"{b}-bit {d:+.2f}% ({lo:+.2f} … {hi:+.2f})")
            out.append(f"  {t:14s} " + "   ".join(parts))
    if plot:
        plot_compare(merged, list(rows), bits, plot, s["model"], f"{s['chunks']} x {s['seq_len']} tokens")
        out.append(f"-> {plot}")
    return "\n".join(out)


# -- agree ----------------------------------------------------------------------------------------------------------
def merge_agree(runs: list[tuple[str, dict]]) -> dict:
    """One ``wushkv agree --json`` file of several made in parallel (one process per method).

    Every input must hold a run with the same settings (model, prompts, tokens, quantization, calibration recipe;
    :func:`wushkv.runs.reconcile_settings`) and the same full-precision continuations, token for token. A method
    present in two files must hold the same per-prompt results over the prompts both have, bit for bit; the longer
    of the two is kept. The output is what ``wushkv agree --json`` resumes from."""
    settings, conts, rows = None, None, {}
    for path, run in runs:
        state = run.get("state")
        if not isinstance(run.get("settings"), dict) or not isinstance(state, dict) or "continuations" not in state:
            raise ValueError(f"{path}: not a file `wushkv agree --json` wrote (no settings/state)")
        if settings is None:
            settings, conts = dict(run["settings"]), state["continuations"]
        else:
            settings, differ = reconcile_settings(settings, run["settings"])
            if differ:
                raise ValueError(f"{path}: other settings than the files before it (differing: {', '.join(differ)})")
            n = min(len(conts), len(state["continuations"]))
            if conts[:n] != state["continuations"][:n]:
                raise ValueError(f"{path}: its full-precision continuations differ from the files before it")
            if len(state["continuations"]) > len(conts):
                conts = state["continuations"]
        for method, done in state.get("rows", {}).items():
            have = rows.get(method, [])
            n = min(len(have), len(done))
            if have[:n] != done[:n]:
                raise ValueError(f"{path}: {method}'s results differ from an earlier file's over their common prompts")
            rows[method] = done if len(done) > len(have) else have
    return {"command": "agree", "settings": settings, "state": {"continuations": conts, "rows": rows}}


# -- passkey --------------------------------------------------------------------------------------------------------
def merge_passkey(runs: list[tuple[str, dict]]) -> dict:
    """One ``wushkv passkey --json`` file of several made in parallel (one process per method).

    Every input must hold a run with the same settings (model, trials, seed, quantization, calibration recipe); a
    run of only uncalibrated methods (full precision) has none and fits any. Cases are keyed by method and
    ``context/depth/trial``; a case present in two files must hold the same result, bit for bit, so files of one
    case made on different devices or library versions are refused rather than mixed. The output is what
    ``wushkv passkey --json`` resumes from."""
    settings, state = None, {}
    for path, run in runs:
        cases_of = run.get("state")
        if (not isinstance(run.get("settings"), dict) or not isinstance(cases_of, dict)
                or not all(isinstance(c, dict) and all(str(k).count("/") == 2 for k in c) for c in cases_of.values())):
            raise ValueError(f"{path}: not a file `wushkv passkey --json` wrote (no settings, or no cases by method and "
                             "context/depth/trial)")
        if settings is None:
            settings = dict(run["settings"])
        else:
            settings, differ = reconcile_settings(settings, run["settings"])
            if differ:
                raise ValueError(f"{path}: other settings than the files before it (differing: {', '.join(differ)})")
        for method, cases in run["state"].items():
            into = state.setdefault(method, {})
            for key, result in cases.items():
                if key in into and into[key] != result:
                    raise ValueError(f"{path}: {method} case {key} differs from an earlier file ({result} vs {into[key]})")
                into[key] = result
    return {"command": "passkey", "settings": settings, "state": state}
