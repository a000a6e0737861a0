"""At which widths does clipping stop paying? Relative squared error of SmolLM2's keys and values quantized per
token with and without the clip, per width (docs/lab/clip-by-width.md).

QuEST clips each token (group) at α_b·RMS, the affine quantizer at its κ percentile (0.96 keys, 0.92 values). At
few bits the rounding error dominates and clipping the tails shrinks the step; at many bits the step is tiny and
the clipped tails dominate. This captures every layer's keys (after RoPE) and values on real text, and reports
‖x − x̂‖²/‖x‖² (summed over layers, heads and tokens) for each quantizer with ``clip=True`` and ``clip=False`` at
each width, in the coordinates of each transform (identity: raw; hadamard: rotated per head, as the cache stores
them). Quantizers are the library's own (:class:`wushkv.quantizers.QuestQuantizer`,
:class:`wushkv.quantizers.AffineQuantizer`).

    python experiments/clip_by_width.py --model smollm2-135m --tokens 2048 --bits 2,3,4,5,6,7,8 [--json out/clip_by_width.json]
"""

from __future__ import annotations

import argparse
import torch

from wushkv.data import wikitext2_test
from wushkv.hf import observe_sequences
from wushkv.io import write_json
from wushkv.models import describe, load
from wushkv.quantizers import AffineQuantizer, QuestQuantizer
from wushkv.transforms import build_transforms


class Capture:
    """Keys and values (1, Hkv, T, d) of every layer, as attention sees them."""

    def __init__(self):
        self.k, self.v = {}, {}

    def observe(self, module, q, k, v, *args, **kwargs):
        self.k[module.layer_idx], self.v[module.layer_idx] = k.float().clone(), v.float().clone()


def rel_error(quantizer, xs: list[torch.Tensor]) -> float:
    num = sum(float((quantizer.fake(x) - x).double().pow(2).sum()) for x in xs)
    return num / sum(float(x.double().pow(2).sum()) for x in xs)


def run(model, tok, tokens: int, bits: list[int], transforms=("identity", "hadamard")) -> list[dict]:
    spec = describe(model)
    ids = tok(wikitext2_test()[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    cap = Capture()
    observe_sequences(model, ids, cap, "capture", show_progress=False)
    rows = []
    for name in transforms:
        tr = build_transforms(name, spec.num_kv_heads, spec.head_dim, seed=0)
        T_K, T_V = tr.T_K.float(), tr.T_V.float()  # (Hkv, d, d): x' = T x per head
        keys = [torch.matmul(cap.k[l], T_K.mT[None]) for l in sorted(cap.k)]
        values = [torch.matmul(cap.v[l], T_V.mT[None]) for l in sorted(cap.v)]
        for b in bits:
            for side, xs, kappa in (("keys", keys, 0.96), ("values", values, 0.92)):
                for qname, make in (("quest", lambda c: QuestQuantizer(b, clip=c)),
                                    ("affine", lambda c: AffineQuantizer(b, clip_ratio=kappa, clip=c))):
                    clipped, unclipped = rel_error(make(True), xs), rel_error(make(False), xs)
                    rows.append({"transform": name, "bits": b, "side": side, "quantizer": qname,
                                 "clipped": clipped, "unclipped": unclipped, "ratio": unclipped / clipped})
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--bits", default="2,3,4,5,6,7,8")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    model, tok = load(a.model)
    rows = run(model, tok, a.tokens, [int(b) for b in a.bits.split(",")])
    print("| transform | side | quantizer | " + " | ".join(f"{b} bits" for b in sorted({r['bits'] for r in rows})) + " |")
    print("|---|---|---|" + "---|" * len({r["bits"] for r in rows}))
    for key in dict.fromkeys((r["transform"], r["side"], r["quantizer"]) for r in rows):
        cells = [f"{r['clipped']:.2e} / {r['unclipped']:.2e}" for r in rows if (r["transform"], r["side"], r["quantizer"]) == key]
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    if a.json:
        write_json(a.json, {"model": a.model, "tokens": a.tokens, "rows": rows})


if __name__ == "__main__":
    main()
