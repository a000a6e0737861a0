"""How much do float32 rounding differences move KVarN's tiles? SmolLM2's keys and values quantized as the ``kvarn``
method stores them, as they are and after a perturbation of the size two float32 implementations of the same model
differ by (docs/lab/kvarn-rounding.md).

Served by vLLM, the ``kvarn`` method agrees with wushkv's own cache at 98.90% of SmolLM2's positions where ``auto``
agrees at 99.94% and KIVI at 100.00% (docs/reference/performance.md, session 71): vLLM's float32 model computes the
same keys as transformers' up to the last bits, and KVarN's balance keeps the best of 16 rounds of near-equal
imbalance. This captures every layer's keys (after RoPE) and values on real text, rotates them per head (Hadamard, as
the ``kvarn`` method does), quantizes them in tiles of 128 tokens with the library's KVarN
(:func:`wushkv.quantizers.kvarn.kvarn_quantize`, 2 bits: the served width) and again after multiplying each
element by 1 + ε·g (g standard normal, ε from 1e-7, a float32 ulp, to 1e-3, what 30 layers of another summation
order can add up to), and counts the tiles whose codes
differ anywhere, the codes that differ, and how far the dequantized tiles move against their own quantization
error. The same for QuEST per token (``auto``'s values, whose codes can flip only where an element sits on a
rounding boundary) as the control.

    python experiments/kvarn_rounding.py --model smollm2-135m --tokens 2048 [--json out/kvarn_rounding.json]
"""

from __future__ import annotations

import argparse

import torch

from wushkv.data import wikitext2_test
from wushkv.hf import observe_sequences
from wushkv.io import write_json
from wushkv.models import describe, load
from wushkv.quantizers import QuestQuantizer
from wushkv.quantizers.kvarn import kvarn_dequantize, kvarn_quantize
from wushkv.transforms import build_transforms

TILE = 128


class Capture:
    """Keys and values (1, Hkv, T, d) of every layer, as attention sees them."""

    def __init__(self):
        self.k, self.v = {}, {}

    def observe(self, module, q, k, v, *args, **kwargs):
        self.k[module.layer_idx], self.v[module.layer_idx] = k.float().clone(), v.float().clone()


def compare(xs: list[torch.Tensor], kind: str, bits: int, eps: float, seed: int = 0) -> dict:
    """KVarN tiles (and, as the control, QuEST per token) of each x (1, H, T, d) as is and perturbed by 1 + eps·g:
    the share of tiles (tokens, for QuEST) whose codes differ, the share of codes that differ, and ‖x̂ − x̂'‖² over
    ‖x − x̂‖² summed over the tensors (how far the perturbation moves the reconstruction, in units of its error)."""
    g = torch.Generator().manual_seed(seed)
    out = {"kvarn": [0, 0, 0, 0, 0.0, 0.0], "quest": [0, 0, 0, 0, 0.0, 0.0]}  # units differing, units, codes..., move, err
    quest = QuestQuantizer(bits)
    for x in xs:
        y = x * (1 + eps * torch.randn(x.shape, generator=g))
        a, b = kvarn_quantize(x, bits, kind, tile=TILE), kvarn_quantize(y, bits, kind, tile=TILE)
        ca, cb = a.codes.reshape(-1, TILE * x.shape[-1]), b.codes.reshape(-1, TILE * x.shape[-1])  # a row a tile
        xa, xb = kvarn_dequantize(a), kvarn_dequantize(b)
        qa, qb = quest.quantize(x), quest.quantize(y)
        for name, (c1, c2, r1, r2) in (("kvarn", (ca, cb, xa, xb)),
                                        ("quest", (qa.codes.reshape(-1, x.shape[-1]), qb.codes.reshape(-1, x.shape[-1]),
                                                   quest.fake(x), quest.fake(y)))):
            s = out[name]
            diff = c1 != c2
            s[0] += int(diff.any(1).sum())
            s[1] += diff.shape[0]
            s[2] += int(diff.sum())
            s[3] += diff.numel()
            s[4] += float((r1 - r2).double().pow(2).sum())
            s[5] += float((r1 - x).double().pow(2).sum())
    return {name: {"units_differing": s[0] / s[1], "codes_differing": s[2] / s[3], "move_over_error": s[4] / s[5]}
            for name, s in out.items()}


def run(model, tok, tokens: int, bits: int = 2, eps=(1e-7, 1e-6, 1e-5, 1e-4, 1e-3)) -> list[dict]:
    spec = describe(model)
    tokens = tokens // TILE * TILE  # whole tiles
    ids = tok(wikitext2_test()[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    cap = Capture()
    observe_sequences(model, ids, cap, "capture", show_progress=False)
    tr = build_transforms("hadamard", spec.num_kv_heads, spec.head_dim, seed=0)
    T_K, T_V = tr.T_K.float(), tr.T_V.float()  # (Hkv, d, d): x' = T x per head
    keys = [torch.matmul(cap.k[l], T_K.mT[None]) for l in sorted(cap.k)]
    values = [torch.matmul(cap.v[l], T_V.mT[None]) for l in sorted(cap.v)]
    rows = []
    for e in eps:
        for side, xs, kind in (("keys", keys, "key"), ("values", values, "value")):
            res = compare(xs, kind, bits, e)
            rows.append({"eps": e, "side": side, "bits": bits, "tokens": tokens} | {
                f"{q}_{k}": v for q, r in res.items() for k, v in r.items()})
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    model, tok = load(a.model)
    rows = run(model, tok, a.tokens, a.bits)
    print("| ε | side | KVarN tiles differing | KVarN codes differing | KVarN move / error | QuEST tokens differing | "
          "QuEST codes differing | QuEST move / error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['eps']:.0e} | {r['side']} | {100 * r['kvarn_units_differing']:.2f}% | {100 * r['kvarn_codes_differing']:.3f}% "
              f"| {r['kvarn_move_over_error']:.2e} | {100 * r['quest_units_differing']:.2f}% | "
              f"{100 * r['quest_codes_differing']:.4f}% | {r['quest_move_over_error']:.2e} |")
    if a.json:
        write_json(a.json, {"args": vars(a), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
