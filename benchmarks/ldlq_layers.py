"""Which layers' key feedback moves perplexity? WUSH with error-feedback rounding of the keys (``+ldlq-k``)
in one group of layers only, every other layer rounding plainly, side by side in one process.

    python benchmarks/ldlq_layers.py --calibration out/smollm2-c32.safetensors --text-file out/c4_heldout.txt \\
        --chunks 4 --bits 2 --groups 3 [--json out/ldlq_layers.json]

Rows: plain WUSH, WUSH with key feedback in every layer, and with key feedback in each of ``--groups``
contiguous layer groups. QuEST, windows 16/128/16, K = V bits. (docs/ABLATIONS.md section 15.)
"""

from __future__ import annotations

import argparse
import itertools


def main() -> None:
    from wushkv.cache import WushKVCache
    from wushkv.calibration import Calibration
    from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig
    from wushkv.data import load_eval_text, tokenize_chunks
    from wushkv.eval.methods import transforms_for
    from wushkv.eval.perplexity import perplexity
    from wushkv.folding import apply_transforms
    from wushkv.models import load

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--text-file", default=None)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    text, label = load_eval_text(args.text_file)
    chunks = tokenize_chunks(tok, text, 2048, args.chunks)
    fp = perplexity(model, chunks, show_progress=False)["ppl"]
    plain = transforms_for(model, cal, "wush")
    fb = transforms_for(model, cal, "wush+ldlq-k")
    L = len(plain)
    bounds = [round(i * L / args.groups) for i in range(args.groups + 1)]
    variants = {"WUSH": set(), "key feedback, every layer": set(range(L))}
    for a, b in itertools.pairwise(bounds):
        variants[f"key feedback, layers {a}-{b - 1}"] = set(range(a, b))
    cfg = QuantConfig(args.bits, args.bits, "quest", windows=PERPLEXITY_WINDOWS)
    out = {"model": args.model, "text": label, "chunks": args.chunks, "bits": args.bits, "fp": fp, "results": {}}
    print(f"{args.model} on {label}: {args.chunks} x 2048, K{args.bits}V{args.bits} QuEST 16/128/16, full precision {fp:.3f}")
    for name, layers in variants.items():
        trs = [fb[i] if i in layers else plain[i] for i in range(L)]
        with apply_transforms(model, trs, name):
            r = perplexity(model, chunks, cache_factory=lambda: WushKVCache(model, cfg), show_progress=False)
        out["results"][name] = {"ppl": r["ppl"], "delta_pct": 100 * (r["ppl"] / fp - 1), "chunk_nll": r["chunk_nll"]}
        print(f"  {name:32s} {r['ppl']:8.3f}  ({100 * (r['ppl'] / fp - 1):+.2f}%)", flush=True)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, out)


if __name__ == "__main__":
    main()
