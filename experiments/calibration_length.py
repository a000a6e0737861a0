"""Calibrated shorter than the contexts served: how each recipe degrades, and whether covering the served positions
(:func:`wushkv.calibration.cover_positions`) recovers it (issue #34, docs/lab/calibration-length.md).

For every calibration file (its sequence length L) and every evaluation length E, WikiText-2 perplexity of each
method through the quantized cache (QuEST 16/128/16 by default), with the file as it is and, where L < E, with its
key-space statistics covered to E positions; Hadamard needs no calibration and runs once per E. Prints, per E, each
method's Δ% over full precision and its margin over Hadamard, and the share of the margin a short calibration keeps
against the one made at E (when a file of length E is given)::

    python experiments/calibration_length.py --model smollm2-135m \\
        --calibrations c1024.safetensors,c2048.safetensors,c4096.safetensors --eval-lens 2048,4096 --chunks 4 --bits 2 \\
        --methods wush,wush+ktiles+ldlq@tc=3 --json calibration_length.json

Resumable: every evaluation is kept in --json (rewritten after each).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from wushkv.calibration import Calibration, cover_positions
from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig
from wushkv.data import tokenize_chunks, wikitext2_test
from wushkv.eval.compare import paired_difference, quantized_perplexity
from wushkv.eval.perplexity import perplexity
from wushkv.io import read_json, write_json
from wushkv.methods.auto import parse_recipe
from wushkv.models import describe, load, rope_parameters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calibrations", required=True, help="comma-separated calibration files (of one model, any sequence lengths)")
    p.add_argument("--eval-lens", default="2048,4096")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--methods", default="wush", help="comma-separated recipes (METHOD[@ka=..][@va=..][@tc=..])")
    p.add_argument("--no-cover", action="store_true", help="skip the covered variants")
    p.add_argument("--paired-against", default=None, metavar="STEM",
                   help="also print each row's paired Δ%% (95%% bootstrap over chunks) against the same method with the "
                        "calibration file of this stem, as is (e.g. smollm2-L1024: covered against uncovered)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    model, tok = load(args.model)
    spec = describe(model)
    rope = [rope_parameters(model, l, spec) for l in range(spec.num_layers)]
    cals = {}  # (L, file stem) -> calibration
    for f in args.calibrations.split(","):
        c = Calibration.load(f, model)
        cals[(int(c.meta["seq_len"]), Path(f).stem)] = c
    recipes = [parse_recipe(m) for m in args.methods.split(",")]
    out = read_json(args.json, "results") if Path(args.json).exists() else {"settings": vars(args), "runs": {}}
    text = wikitext2_test()
    base = QuantConfig(args.bits, args.bits, quantizer="quest", windows=PERPLEXITY_WINDOWS)

    def run(key: str, fn):
        if key not in out["runs"]:
            out["runs"][key] = fn()
            write_json(args.json, out)
            r = out["runs"][key]
            print(f"{key:<60} PPL {r['ppl']:.3f}  ({r['seconds']:.0f}s)", flush=True)
        return out["runs"][key]

    for E in (int(x) for x in args.eval_lens.split(",")):
        chunks = tokenize_chunks(tok, text, E, args.chunks)
        fp = run(f"E{E}/full-precision", lambda: _keep(perplexity(model, chunks, show_progress=False)))
        had = run(f"E{E}/hadamard", lambda: _keep(quantized_perplexity(model, chunks, None, "hadamard", base, show_progress=False)))
        rows, against = [], {}  # against: method -> its result with the --paired-against file, as is
        for (L, stem), cal in sorted(cals.items()):
            variants = [("as is", cal)]
            if L < E and not args.no_cover:
                variants.append((f"covered to {E}", cover_positions(cal, rope, E)))
            for label, c in variants:
                for r in recipes:
                    cfg = r.method.quant_config(r.base(base))
                    key = f"E{E}/L{L}/{label}/{r.name}" + (f"/{stem}" if _extra(stem, L) else "")
                    res = run(key, lambda: _keep(quantized_perplexity(model, chunks, c, r.method, cfg, show_progress=False)))
                    rows.append((L, label + (f" ({stem})" if _extra(stem, L) else ""), r.name, res))
                    if stem == args.paired_against and label == "as is":
                        against[r.name] = res
        print(f"\nE = {E}: full precision {fp['ppl']:.3f}, Hadamard {100 * (had['ppl'] / fp['ppl'] - 1):+.2f}%")
        for L, label, name, res in rows:
            d = 100 * (res["ppl"] / fp["ppl"] - 1)
            margin = 100 * (had["ppl"] / res["ppl"] - 1)
            ref = next((x for (L2, lab2, n2, x) in rows if L2 == E and lab2 == "as is" and n2 == name), None)
            kept = f"{margin / (100 * (had['ppl'] / ref['ppl'] - 1)):.2f} of the margin at L=E" if ref is not None and ref["ppl"] < had["ppl"] else ""
            print(f"  L={L:<5} {label:<16} {name:<28} {d:+7.2f}%   margin over Hadamard {margin:+6.2f}%   {kept}")
            if name in against and res is not against[name]:
                dp, lo, hi = paired_difference(res["chunk_nll"], against[name]["chunk_nll"])
                print(f"        vs {args.paired_against} as is: {dp:+.2f}% [95% paired bootstrap over chunks: {lo:+.2f}%, {hi:+.2f}%]")
    return 0


def _extra(stem: str, L: int) -> bool:
    """A file whose name says more than its length (e.g. ``smollm2-L1024-skip16``): its runs are keyed by name too."""
    return not stem.endswith(f"L{L}")


def _keep(r: dict) -> dict:
    return {"ppl": r["ppl"], "chunk_nll": r["chunk_nll"], "seconds": r["seconds"]}


if __name__ == "__main__":
    raise SystemExit(main())
