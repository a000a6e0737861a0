"""One quantizer for the keys, another for the values: which side do KVarN's tiles win on?

On SmolLM2's WikiText-2 WUSH with KVarN's (clipped) tiles beats WUSH with QuEST at 2 bits, while on held-out
C4 and Python source QuEST wins (docs/ABLATIONS.md sections 27-28). The tiles quantize keys per channel over
128 tokens (with a per-token scale) and values per token (with a per-channel scale); QuEST quantizes every
vector per token. This experiment builds each side's codec from its own quantizer, under one set of windows
(the tiles' 128/0/128 by default, which every tile side needs), so that the four combinations compare on the
same full-precision tokens:

    python benchmarks/side_quantizers.py --calibration out/s15/smollm2-c32.safetensors --text-file out/c4_heldout.txt \\
        --methods wush --pairs quest/quest,tiles/quest,quest/tiles,tiles/tiles --tile-clip 1.3

``--pairs`` lists KEY/VALUE quantizers (``quest``, ``tiles``); a ``+ldlq`` method's feedback applies to its QuEST
sides only. The experiment swaps the codec factory the cache layer calls (``wushkv.cache.make_codec``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import wushkv.cache as cache_mod  # noqa: E402
from wushkv.calibration import Calibration  # noqa: E402
from wushkv.codecs import make_codec  # noqa: E402
from wushkv.config import PER_TOKEN_QUANTIZERS, QuantConfig, WindowConfig  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.eval.compare import paired_difference, quantized_perplexity  # noqa: E402
from wushkv.eval.perplexity import perplexity  # noqa: E402
from wushkv.models import load  # noqa: E402

QUANTIZERS = {"quest": "quest", "tiles": "kvarn"}


class SideCodecs:
    """The swapped factory: side "key" from ``self.k``'s config, "value" from ``self.v``'s."""

    def __init__(self):
        self.k = self.v = None

    def __call__(self, cfg, side, head_dim, feedback=None):
        c = self.k if side == "key" else self.v
        if c is None:
            return make_codec(cfg, side, head_dim, feedback)
        return make_codec(c, side, head_dim, feedback if c.quantizer in PER_TOKEN_QUANTIZERS else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--text-file", default=None)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--methods", default="wush")
    ap.add_argument("--pairs", default="quest/quest,tiles/quest,quest/tiles,tiles/tiles")
    ap.add_argument("--tile-clip", type=float, default=1.3)
    ap.add_argument("--k-tile-clip", type=float, default=None, help="the key side's tile clip (default --tile-clip)")
    ap.add_argument("--k-alpha", type=float, default=1.0)
    ap.add_argument("--v-alpha", type=float, default=1.0)
    ap.add_argument("--windows", default="128,0,128", help="S_sink,S_keep,S_flush for every pair")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    sides = SideCodecs()
    cache_mod.make_codec = sides  # the experiment (module doc)
    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    text, label = load_eval_text(args.text_file)
    chunks = tokenize_chunks(tok, text, 2048, args.chunks)
    fp = perplexity(model, chunks, show_progress=False)
    w = WindowConfig(*(int(x) for x in args.windows.split(",")))
    print(f"{args.model}, {label}, {args.chunks} × 2048, full precision {fp['ppl']:.3f}, {args.bits} bits, windows "
          f"{w.S_sink}/{w.S_keep}/{w.S_flush}, tile clip {args.tile_clip:g}"
          + ("" if args.k_tile_clip is None else f" (keys {args.k_tile_clip:g})"), flush=True)
    base = QuantConfig(k_bits=args.bits, v_bits=args.bits, quantizer="quest", k_alpha=args.k_alpha, v_alpha=args.v_alpha,
                       tile_clip=args.tile_clip, windows=w)
    rows, ref = {}, None
    for m in args.methods.split(","):
        for pair in args.pairs.split(","):
            kq, vq = pair.split("/")
            sides.k, sides.v = (replace(base, quantizer=QUANTIZERS[q]) for q in (kq, vq))
            if args.k_tile_clip is not None:
                sides.k = replace(sides.k, tile_clip=args.k_tile_clip)
            r = quantized_perplexity(model, chunks, cal, m, base, show_progress=False)
            key = f"{m} {pair}"
            rows[key] = {"ppl": r["ppl"], "delta_pct": 100 * (r["ppl"] / fp["ppl"] - 1), "chunk_nll": r["chunk_nll"]}
            vs = ""
            if ref is not None:
                d, lo, hi = paired_difference(r["chunk_nll"], rows[ref]["chunk_nll"])
                vs = f"  vs {ref} {d:+.2f}% ({lo:+.2f} … {hi:+.2f})"
            ref = ref or key
            print(f"  {key:28s}: PPL {r['ppl']:.3f} ({rows[key]['delta_pct']:+.2f}%){vs}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "fp": fp["ppl"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
