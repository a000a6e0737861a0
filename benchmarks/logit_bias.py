"""Is a quantized key's logit biased, and does the bias move the attention? Per transform and clip.

A per-token quantizer with a clip is not unbiased along the token: for QuEST at 2 bits on Gaussian
coordinates, E[x̂ · x] = E[x̂²] ≈ 0.88 E[x²], so the regression of a quantized logit ŝ = q·k̂ on the
true one s = q·k has slope β ≈ 0.88 (1 − the per-unit MSE): every logit of the quantized middle is
shrunk toward zero by ~12%. Where the keys share a large common part (SmolLM2's keys keep ~80% of
their energy in their mean), the shrink is a common shift of the whole middle against the full-precision
sink and recent windows: a bias that does not average out over keys, unlike the rounding noise.

For held-out text (``--text-file``; never the evaluation text), every layer's post-RoPE keys are
transformed, quantized per token as the cache does (QuEST at ``--alphas`` × α_b, or affine), dequantized
and transformed back. Over the (query, quantized-middle key) pairs of the perplexity windows it prints,
per method and clip, averaged over layers and heads:

* ``slope``: the regression slope of ŝ on s (1 = unbiased along the logit);
* ``shift``: the mean logit error over the middle keys of each query (nats; the common-mode shift);
* ``Δlog mass``: the change of the log attention mass a query puts on the quantized middle, exact
  (softmax over [sink; middle with ŝ; recent]) against full precision;
* ``KL``: the mean KL of the attention distributions (full precision ‖ quantized), per query;
* the same three with the reconstruction multiplied by ``--gains`` (a gain g on x̂ costs no bytes: it is
  a factor on the stored scale), to see whether undoing the shrink undoes the shift.

    python benchmarks/logit_bias.py --calibration out/s15/smollm2-c32.safetensors --text-file out/c4_heldout.txt \\
        --methods wush,hadamard --bits 2 --alphas 1,1.15 --gains 1,1.07 --lognormal 0,0.5,1 --seqs 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from key_errors import _Keys  # noqa: E402  (beside this script: records every layer's queries and keys)
from lognormal_ppl import gaussian_mse  # noqa: E402
from wushkv.attention import grouped, observe_sequences  # noqa: E402
from wushkv.calibration import Calibration  # noqa: E402
from wushkv.config import WindowConfig  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.models import load  # noqa: E402
from wushkv.quantizers.affine import AffineQuantizer  # noqa: E402
from wushkv.quantizers.quest import QuestQuantizer  # noqa: E402


def middle_mask(L: int, windows: WindowConfig) -> torch.Tensor:
    """(L, L) bool: key t is in the quantized middle for query i (METHOD §3.2, ``WindowConfig.quantized_count``)."""
    qc = torch.tensor([windows.quantized_count(i + 1) for i in range(L)])[:, None]
    t = torch.arange(L)[None, :]
    return (t >= windows.S_sink) & (t < windows.S_sink + qc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--text-file", required=True, help="held-out text (not the evaluation text)")
    ap.add_argument("--methods", default="wush,hadamard")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--quantizer", default="quest", choices=("quest", "affine"))
    ap.add_argument("--alphas", default="1", help="QuEST clip multipliers on α_b")
    ap.add_argument("--gains", default="1", help="reconstruction gains g (x̂ → g·x̂)")
    ap.add_argument("--lognormal", default="0", help="factors λ of the log-normal correction ŝ − λ·σ²/2 (σ² from the stored step)")
    ap.add_argument("--oracle", action="store_true", help="also the correction from each token's true error (not available at run time)")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--windows", default="16,128,16")
    ap.add_argument("--queries", type=int, default=256, help="the last N queries of each sequence are scored")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    text, label = load_eval_text(args.text_file)
    seqs = tokenize_chunks(tok, text, args.seq_len, args.seqs)
    sink, keep, flush = (int(x) for x in args.windows.split(","))
    methods = args.methods.split(",")
    alphas = [float(a) for a in args.alphas.split(",")]
    gains = [float(g) for g in args.gains.split(",")]
    mses = {a: gaussian_mse(args.bits, a) for a in alphas}  # per-unit error of the QuEST grid at each clip
    lams = [float(x) for x in args.lognormal.split(",")]
    trs = {m: cal.transforms(m) for m in methods}
    L = seqs.shape[1]
    lo = L - args.queries
    mid = middle_mask(L, WindowConfig(sink, keep, flush))[lo:]  # (Qn, L)
    causal = (torch.arange(L)[None, :] <= torch.arange(lo, L)[:, None])
    stats: dict = {}
    for s in range(seqs.shape[0]):
        obs = _Keys()
        observe_sequences(model, seqs[s : s + 1], obs, f"{label} seq {s}", show_progress=False)
        for layer in sorted(obs.k):
            k, q = obs.k[layer], obs.q[layer]
            qg = grouped(q[None], k.shape[0])[0][:, :, lo:]  # (Hkv, G, Qn, d)
            for h in range(k.shape[0]):
                s_true = torch.einsum("gtd,sd->gts", qg[h], k[h]) * obs.scaling  # (G, Qn, L)
                p_true = s_true.masked_fill(~causal, float("-inf")).softmax(-1)
                for m in methods:
                    T, T_inv = trs[m][layer]["T_K"][h].double(), trs[m][layer]["T_K_inv"][h].double()
                    for a in alphas if args.quantizer == "quest" else [None]:
                        qz = QuestQuantizer(args.bits, alpha_scale=a) if a is not None else AffineQuantizer(args.bits, clip_ratio=0.96)
                        xhat = qz.fake((k[h] @ T.T).float()).double()
                        xt = (k[h] @ T.T).float().double()
                        r2 = xt.pow(2).mean(-1)  # per-token mean square in the transformed space (= (Δ·(2^b−1)/(2α))², known to the decoder)
                        mse = mses[a] if a is not None else 0.0  # the grid's error at this clip
                        qn2 = (qg[h] @ T_inv).pow(2).sum(-1)  # ‖q'‖² = ‖T^{-T} q‖², (G, Qn)
                        variants = [(g, lam, "model") for g in gains for lam in lams]
                        if args.oracle:
                            variants += [(g, lam, "oracle") for g in gains for lam in lams if lam]
                        for g, lam, src in variants:
                            kh = (g * xhat) @ T_inv.T
                            s_q = torch.einsum("gtd,sd->gts", qg[h], kh) * obs.scaling
                            if lam:
                                v = mse * r2 if src == "model" else (g * xhat - xt).pow(2).mean(-1)
                                s_q = s_q - lam * 0.5 * obs.scaling**2 * qn2[..., None] * v[None, None, :]
                            s_mix = torch.where(mid, s_q, s_true)
                            d = (s_q - s_true)[:, mid]  # pairs over the middle
                            st = s_true[:, mid]
                            slope = float(((d + st) * st).sum() / (st * st).sum())
                            shift = float((torch.where(mid, s_q - s_true, 0.0).sum(-1) / mid.sum(-1).clamp_min(1)).mean())
                            p_q = s_mix.masked_fill(~causal, float("-inf")).softmax(-1)
                            mass_t = (p_true * mid).sum(-1).clamp_min(1e-30)
                            mass_q = (p_q * mid).sum(-1).clamp_min(1e-30)
                            dlm = float((mass_q.log() - mass_t.log()).mean())
                            kl = float(torch.where(causal, p_true * (p_true.clamp_min(1e-30).log() - p_q.clamp_min(1e-30).log()), 0.0).sum(-1).mean())
                            key = f"{m} a{a if a is not None else 'affine'} g{g}" + (f" ln{lam:g}{'*' if src == 'oracle' else ''}" if lam else "")
                            acc = stats.setdefault(key, {"slope": 0.0, "shift": 0.0, "dlogmass": 0.0, "kl": 0.0, "n": 0})
                            acc["slope"] += slope
                            acc["shift"] += shift
                            acc["dlogmass"] += dlm
                            acc["kl"] += kl
                            acc["n"] += 1
        print(f"sequence {s + 1}/{seqs.shape[0]} done", file=sys.stderr, flush=True)
    print(f"\n{args.model}, {label}, {args.seqs} × {L} tokens, last {args.queries} queries, windows {sink}/{keep}/{flush}, "
          f"{args.quantizer} {args.bits}-bit keys (values full precision); means over layers × KV heads × sequences")
    print(f"{'method, clip, gain':34s} {'slope':>7s} {'shift':>8s} {'Δlog mass':>10s} {'attn KL':>10s}")
    out = {}
    for key, acc in stats.items():
        n = acc["n"]
        row = {k: acc[k] / n for k in ("slope", "shift", "dlogmass", "kl")}
        out[key] = row
        print(f"{key:34s} {row['slope']:7.3f} {row['shift']:+8.3f} {row['dlogmass']:+10.4f} {row['kl']:10.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
