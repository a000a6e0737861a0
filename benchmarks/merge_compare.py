"""Merge the results of several ``wushkv compare --json`` files run on the same text into one table and plot.

Long tables are run in pieces (one file per core, or another calibration for one transform); this
puts the pieces side by side. Files must share the text (hash), the model and the full-precision
perplexity; a transform that appears in two files is taken from the first.

    python benchmarks/merge_compare.py out/compare_gemma3_c16.json out/compare_gemma3_c16_oscar.json \\
        --plot docs/img/compare_gemma3_16chunks.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.report import format_table, plot_lines


def merge(paths: list[str]) -> tuple[dict, dict]:
    """(first file's settings and fp, {transform: {bits: result}}), refusing files from another text or model."""
    first, rows = None, {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        s = d["settings"]
        if first is None:
            first = d
        else:
            f = first["settings"]
            for key in ("model", "text_sha256", "chunks", "seq_len"):
                if key == "text_sha256" and None in (s.get(key), f.get(key)):
                    continue  # files written before the text hash was recorded: the full-precision check below still holds
                if s.get(key) != f.get(key):
                    raise SystemExit(f"{p}: {key} {s.get(key)!r} differs from {paths[0]}'s {f.get(key)!r}")
            if abs(d["fp"]["ppl"] - first["fp"]["ppl"]) > 1e-9 * first["fp"]["ppl"]:
                raise SystemExit(f"{p}: full-precision PPL {d['fp']['ppl']} differs from {paths[0]}'s {first['fp']['ppl']}")
        for t, by_bits in d["results"].items():
            for b, r in by_bits.items():
                rows.setdefault(t, {}).setdefault(b, r)
    return first, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--versus", default=None, help="also print every row's paired difference from this transform (95%% bootstrap "
                                                   "interval over chunks), at each width")
    args = ap.parse_args()
    first, rows = merge(args.json)
    bits = sorted({int(b) for r in rows.values() for b in r})
    cell = lambda t, b, k: rows[t].get(str(b), {}).get(k, float("nan"))
    headers = ["transform"] + [f"{b}-bit PPL" for b in bits] + [f"{b}-bit Δ%" for b in bits]
    table = [[t] + [cell(t, b, "ppl") for b in bits] + [cell(t, b, "delta_pct") for b in bits] for t in rows]
    s = first["settings"]
    print(format_table(headers, table, title=f"{s['model']}: {s['chunks']} x {s['seq_len']} tokens, full precision PPL {first['fp']['ppl']:.3f}"))
    if args.versus:
        from wushkv.eval.compare import paired_difference

        if args.versus not in rows:
            raise SystemExit(f"--versus {args.versus!r} is not a row; rows: {sorted(rows)}")
        print(f"\npaired difference from {args.versus} (Δ% of perplexity, 95% interval over chunks):")
        for t in rows:
            if t == args.versus:
                continue
            parts = []
            for b in bits:
                a, r = rows[t].get(str(b)), rows[args.versus].get(str(b))
                if a and r and a.get("chunk_nll") and r.get("chunk_nll"):
                    d, lo, hi = paired_difference(a["chunk_nll"], r["chunk_nll"])
                    parts.append(f"{b}-bit {d:+.2f}% ({lo:+.2f} … {hi:+.2f})")
            print(f"  {t:14s} " + "   ".join(parts))
    if args.plot:
        series = {t: [max(cell(t, b, "delta_pct"), 1e-2) for b in bits] for t in rows}
        plot_lines(bits, series, args.plot, "bits (keys and values)", "perplexity increase over full precision (%)",
                   f"{s['model']}: {s['chunks']} x {s['seq_len']} tokens, full precision PPL {first['fp']['ppl']:.2f}", logy=True)
        print(f"-> {args.plot}")


if __name__ == "__main__":
    main()
