"""Keep the worst-quantized tokens in full precision: how much perplexity does a tiny sparse part buy?

The dense-and-sparse idea (KVQuant; KVSink for attention sinks beyond the first tokens) at token
granularity: the quantizer knows, when it encodes a token, how large that token's error is, so it can
keep the few tokens it quantizes worst in full precision (a causal choice: by a threshold on the token's
own error). Each kept token costs one full-precision vector per head and side, so a fraction r of kept
tokens adds about r·16/b of the quantized bytes at b bits (r = 0.25% at 2 bits: about +2%).

This experiment swaps the emulation's quantize-dequantize (``WushKVLayer._fake``) for one that restores
the top fraction ``r`` of the tokens of each (layer, head), ranked by a criterion, to full precision:

* ``err``: the token's squared error ‖x − x̂‖² in the transformed space (for WUSH keys, the
  query-weighted error; known to the quantizer at encode time);
* ``norm``: the token's norm ‖x‖ (transformed space);
* ``rel``: ‖x − x̂‖² / ‖x‖².

Ranking over each sequence (rather than a fixed threshold) is the upper bound of a threshold chosen on
calibration text; the first tokens and the recent window are full precision anyway.

    python benchmarks/fp_outliers.py --calibration out/s15/smollm2-c32.safetensors --text-file out/c4_heldout.txt \\
        --methods wush,hadamard --bits 2 --fractions 0,0.0025,0.01 --sides K,V,KV --criteria err
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from wushkv.cache import WushKVLayer  # noqa: E402
from wushkv.calibration import Calibration  # noqa: E402
from wushkv.config import QuantConfig, WindowConfig  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.eval.compare import paired_difference, quantized_perplexity  # noqa: E402
from wushkv.eval.perplexity import perplexity  # noqa: E402
from wushkv.models import load  # noqa: E402


class Keep:
    """The swapped quantize-dequantize: quantize as the cache does, then restore the top ``fraction`` of the
    tokens of each head to full precision, in the middle's codes (``_append_mid``/``_decode_mid``: the
    full-precision copy and the mask ride along beside the codes) and in the window (``_fake``)."""

    def __init__(self):
        self.fraction, self.sides, self.criterion = 0.0, "KV", "err"
        self._fake, self._append, self._decode = WushKVLayer._fake, WushKVLayer._append_mid, WushKVLayer._decode_mid

    def mask(self, x: torch.Tensor, xq: torch.Tensor) -> torch.Tensor | None:
        if self.fraction <= 0 or x.shape[2] == 0:
            return None
        err = (x.float() - xq.float()).pow(2).sum(-1)  # (B, H, n)
        norm = x.float().pow(2).sum(-1)
        score = {"err": err, "norm": norm, "rel": err / norm.clamp_min(1e-30)}[self.criterion]
        k = int(round(self.fraction * x.shape[2]))
        if k == 0:
            return None
        idx = score.topk(k, dim=-1).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True)

    def fake(self, layer, side, x, start=0):
        xq = self._fake(layer, side, x, start)
        m = self.mask(x, xq) if side[0].upper() in self.sides else None
        return xq if m is None else torch.where(m[..., None], x, xq)

    def append_mid(self, layer, k, v, start):
        self._append(layer, k, v, start)
        if not hasattr(layer, "_fpo"):
            layer._fpo = {}
        for name, side, x in (("k", layer.k_side, k), ("v", layer.v_side, v)):
            if side is None or name.upper() not in self.sides:
                continue
            m = self.mask(x, side.codec.fake(x.float()).to(x.dtype))
            if m is None:
                continue
            full, mask = layer._fpo.get(name, (x[:, :, :0], m[:, :, :0]))
            layer._fpo[name] = (torch.cat([full, x], dim=2), torch.cat([mask, m], dim=2))

    def decode_mid(self, layer, snap, n, dtype, first=None, start=0):
        k, v = self._decode(layer, snap, n, dtype, first, start)
        fpo = getattr(layer, "_fpo", {})
        out = []
        for name, x in (("k", k), ("v", v)):
            if name in fpo and x.shape[2]:
                full, mask = fpo[name]
                m = x.shape[2]
                x = torch.where(mask[:, :, :m, None], full[:, :, :m].to(x.dtype), x)
            out.append(x)
        return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--text-file", default=None)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--methods", default="wush,hadamard")
    ap.add_argument("--fractions", default="0,0.0025,0.01")
    ap.add_argument("--sides", default="KV", help="comma-separated: K, V, KV")
    ap.add_argument("--criteria", default="err", help="comma-separated: err, norm, rel")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    keep = Keep()
    WushKVLayer._fake = lambda layer, side, x, start=0: keep.fake(layer, side, x, start)  # the experiment (module doc)
    WushKVLayer._append_mid = lambda layer, k, v, start: keep.append_mid(layer, k, v, start)
    WushKVLayer._decode_mid = lambda layer, snap, n, dtype, first=None, start=0: keep.decode_mid(layer, snap, n, dtype, first, start)
    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    text, label = load_eval_text(args.text_file)
    chunks = tokenize_chunks(tok, text, 2048, args.chunks)
    fp = perplexity(model, chunks, show_progress=False)
    print(f"{args.model}, {label}, {args.chunks} × 2048, full precision {fp['ppl']:.3f}, {args.bits} bits", flush=True)
    cfg = QuantConfig(k_bits=args.bits, v_bits=args.bits, quantizer="quest", windows=WindowConfig(16, 128, 16))
    rows = {}
    for m in args.methods.split(","):
        keep.fraction = 0.0
        ref = quantized_perplexity(model, chunks, cal, m, cfg, show_progress=False)
        print(f"  {m:12s} r 0      : PPL {ref['ppl']:.3f} ({100 * (ref['ppl'] / fp['ppl'] - 1):+.2f}%)", flush=True)
        rows[f"{m} 0"] = {"ppl": ref["ppl"], "delta_pct": 100 * (ref["ppl"] / fp["ppl"] - 1), "chunk_nll": ref["chunk_nll"]}
        for crit in args.criteria.split(","):
            for sides in args.sides.split(","):
                for f in (float(x) for x in args.fractions.split(",")):
                    if f <= 0:
                        continue
                    keep.fraction, keep.sides, keep.criterion = f, sides, crit
                    r = quantized_perplexity(model, chunks, cal, m, cfg, show_progress=False)
                    d, lo, hi = paired_difference(r["chunk_nll"], ref["chunk_nll"])
                    key = f"{m} {crit} {sides} {f:g}"
                    rows[key] = {"ppl": r["ppl"], "delta_pct": 100 * (r["ppl"] / fp["ppl"] - 1), "chunk_nll": r["chunk_nll"]}
                    print(f"  {m:12s} {crit:4s} {sides:2s} r {f:<7g}: PPL {r['ppl']:.3f} ({rows[key]['delta_pct']:+.2f}%)"
                          f"  vs none {d:+.2f}% ({lo:+.2f} … {hi:+.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "fp": fp["ppl"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
