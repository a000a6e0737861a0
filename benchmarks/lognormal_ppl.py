"""Perplexity with two zero-byte corrections of quantized keys' logits (an experiment, not a method).

``logit_bias.py`` shows that a 2-bit QuEST cache gives the quantized middle ~1.5× the attention mass it
has in full precision: the rounding noise n of a logit raises E[exp(s + n)] by exp(σ²/2) (the log-normal
bias), and the clip shrinks logits toward zero (slope ≈ 0.92). This script measures what undoing either
does to perplexity, through the exact single-pass emulation of the cache:

* ``lam`` λ: every quantized key's logit gets −λ·σ²/2, with σ² = scaling²·‖q'‖²·mse_b(α)·r_t², where r_t² is
  the key's mean square in the transformed space (known to a decoder from the stored step) and mse_b(α)
  the per-unit squared error of the QuEST grid on a Gaussian. λ = 1 removes the log-normal bias. It is
  one extra channel on queries and keys, so the fused attention stays one SDPA call;
* ``gain`` g: the reconstruction g·x̂ (a factor on the stored scale, no bytes); g = 1/slope unshrinks.

Variants are written ``LAMgGAIN``: ``0.5`` (λ 0.5), ``0g1.07`` (gain 1.07), ``-0.5g1.07``.

For the run, the script replaces the emulation's attention function inside ``wushkv.cache`` (this is an
experiment on our own code: the shipped cache has neither correction). Text: held-out text only
(``--text-file``); never tune on the evaluation text.

    python benchmarks/heldout_text.py --out out/c4_heldout.txt
    python benchmarks/lognormal_ppl.py --calibration out/s15/smollm2-c32.safetensors --text-file out/c4_heldout.txt \\
        --chunks 4 --bits 2 --methods wush,hadamard --variants 0,0.5,1,-0.5,0g1.07 --json out/s15/lognormal.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import wushkv.cache as cache_module  # noqa: E402
from wushkv.attention import fused_selective_attention  # noqa: E402
from wushkv.calibration import Calibration  # noqa: E402
from wushkv.config import QuantConfig, WindowConfig  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.eval.compare import paired_difference, quantized_perplexity  # noqa: E402
from wushkv.eval.perplexity import perplexity  # noqa: E402
from wushkv.models import load  # noqa: E402
from wushkv.quantizers.quest import QUEST_ALPHA  # noqa: E402


def gaussian_mse(bits: int, alpha_scale: float = 1.0) -> float:
    """Per-unit-variance squared error of the QuEST midrise grid at α_b·alpha_scale on N(0, 1) (numerical)."""
    x = torch.linspace(-10, 10, 400_001, dtype=torch.float64)
    w = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    d = 2 * alpha_scale * QUEST_ALPHA[bits] / (2**bits - 1)
    h = 2 ** (bits - 1)
    xh = (torch.floor(x / d).clamp(-h, h - 1) + 0.5) * d
    return float(((xh - x) ** 2 * w).sum() * (x[1] - x[0]))


class Correction:
    """The emulation's attention with λ and g applied to the quantized keys' logits."""

    def __init__(self):
        self.lam, self.gain, self.mse = 0.0, 1.0, 0.0

    def __call__(self, q, k, v, k_hat, v_hat, quantized, allowed, scaling, block="default"):
        k_hat = k_hat * self.gain if self.gain != 1.0 else k_hat
        if self.lam == 0.0:
            return fused_selective_attention(q, k, v, k_hat, v_hat, quantized, allowed, scaling, block)
        var = self.mse * k.pow(2).mean(-1, keepdim=True)  # per-coordinate error variance of each key (B, Hkv, S, 1)
        qe = -0.5 * self.lam * scaling * q.pow(2).sum(-1, keepdim=True)  # scaling·qe·var = −λ/2·scaling²‖q'‖²·var
        z = torch.zeros_like(var)
        out = fused_selective_attention(torch.cat([q, qe], -1), torch.cat([k, z], -1), torch.cat([v, z], -1),
                                        torch.cat([k_hat, var], -1), torch.cat([v_hat, z], -1), quantized, allowed, scaling, block)
        return out[..., :-1]


def parse_variant(s: str) -> tuple[float, float]:
    lam, _, g = s.partition("g")
    return float(lam), float(g or 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--text-file", required=True)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=1.0, help="QuEST clip multiplier on α_b, keys and values")
    ap.add_argument("--methods", default="wush,hadamard")
    ap.add_argument("--variants", default="0,0.5,1", help="λ or λgGAIN, comma-separated; the first is the reference")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    corr = Correction()
    cache_module.fused_selective_attention = corr  # the experiment (see the module doc)
    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    text, label = load_eval_text(args.text_file)
    chunks = tokenize_chunks(tok, text, 2048, args.chunks)
    fp = perplexity(model, chunks, show_progress=False)
    print(f"{args.model}, {label}, {args.chunks} × 2048, full precision {fp['ppl']:.3f}", flush=True)
    cfg = QuantConfig(k_bits=args.bits, v_bits=args.bits, quantizer="quest", k_alpha=args.alpha, v_alpha=args.alpha,
                      windows=WindowConfig(16, 128, 16))
    corr.mse = gaussian_mse(args.bits, args.alpha)
    rows = {}
    for m in args.methods.split(","):
        ref = None
        for v in args.variants.split(","):
            corr.lam, corr.gain = parse_variant(v)
            r = quantized_perplexity(model, chunks, cal, m, cfg, show_progress=False)
            rows[f"{m} {v}"] = {"ppl": r["ppl"], "delta_pct": 100 * (r["ppl"] / fp["ppl"] - 1), "chunk_nll": r["chunk_nll"]}
            pd = ""
            if ref is None:
                ref = r["chunk_nll"]
            else:
                d, lo, hi = paired_difference(r["chunk_nll"], ref)
                pd = f"  vs λ-first: {d:+.2f}% ({lo:+.2f} … {hi:+.2f})"
            print(f"  {m:10s} λ {corr.lam:+.2f} gain {corr.gain:.3f}: PPL {r['ppl']:.3f} ({rows[f'{m} {v}']['delta_pct']:+.2f}%){pd}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "fp": fp["ppl"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
