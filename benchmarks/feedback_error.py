"""How much error-feedback rounding (``+ldlq``) cuts the weighted cache error on held-out text.

    python benchmarks/feedback_error.py --model smollm2-135m --calibration out/smollm2-c32.safetensors \\
        --text-file out/c4_heldout.txt --tokens 2048 --bits 2,3,4 --methods wush,hadamard

For each method and width, every key and value the cache would quantize (positions ≥ 16) of one held-out
sequence is rounded twice on the same QuEST grid, independently and with feedback, and the errors are
weighed as the cache's consumers see them:

* keys by the Gram of this sequence's own queries in the transformed space, Σ_q (q'ᵀ e)² (the logit error);
* values by the output projection, ‖W_O T_V⁻¹ e‖² (the attention-output error of one fully attended value);
* keys also unweighted (plain MSE), and as attention sees them (``--attention``): Σ_i Σ_t p_it (q_i'ᵀ e_t)², each query's logit errors
  on the keys it reads quantized (windows ``--sink``/``--keep``), weighted by its full-precision attention
  probabilities p_it, against the same sum with every visible quantized key weighted 1.

Printed: the weighted error with feedback over that without (1 = no gain), and the prediction of
:func:`wushkv.quantizers.feedback.feedback_gain` for equal-variance independent rounding errors.
"""

from __future__ import annotations

import argparse
import math

import torch


def capture(model, ids):
    """Every layer's raw queries, keys (after RoPE) and values of one sequence, float64."""
    from wushkv.attention import observe_sequences

    seen = {}

    class Obs:
        def observe(self, module, q, k, v, allowed, scaling, softcap=None):
            seen[module.layer_idx] = (q.double(), k.double(), v.double())

    with torch.no_grad():
        observe_sequences(model, ids, Obs(), "capture", show_progress=False)
    return seen


def main() -> None:
    from wushkv.calibration import Calibration
    from wushkv.codecs import TokenCodec
    from wushkv.data import load_eval_text
    from wushkv.eval.methods import transforms_for
    from wushkv.models import attention_modules, describe, load, projections
    from wushkv.quantizers import QuestQuantizer
    from wushkv.quantizers.feedback import feedback_gain

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--text-file", default=None, help="held-out text (default: WikiText-2 test)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--methods", default="wush,hadamard")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--keep", type=int, default=128)
    ap.add_argument("--attention", action="store_true", help="also weigh key errors by attention probabilities (S² memory per layer)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, tok = load(args.model)
    spec = describe(model)
    cal = Calibration.load(args.calibration, model)
    text, label = load_eval_text(args.text_file)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    seen = capture(model, ids)
    W_O = [projections(a, spec)[3].weight.detach().double() for a in attention_modules(model, spec)]
    Hkv, d, G = spec.num_kv_heads, spec.head_dim, spec.group_size
    out = {"model": args.model, "text": label, "tokens": int(ids.shape[1]), "results": {}}
    for method in args.methods.split(","):
        trs = transforms_for(model, cal, f"{method}+ldlq")
        for b in (int(x) for x in args.bits.split(",")):
            tot = {"keys": [0.0, 0.0], "values": [0.0, 0.0], "keys_attention": [0.0, 0.0], "keys_visible": [0.0, 0.0],
                   "keys_mse": [0.0, 0.0]}
            pred: dict[str, list[float]] = {"keys": [], "values": []}
            for layer, (q, k, v) in sorted(seen.items()):
                tr = trs[layer]
                kt = k[:, :, args.sink :] @ tr["T_K"].double().mT  # (1, Hkv, S, d)
                qt = q.reshape(1, Hkv, -1, d) @ tr["T_K_inv"].double()  # T^{-T} q, the group's queries
                Hq = (qt.mT @ qt)[0]  # (Hkv, d, d)
                vt = v[:, :, args.sink :] @ tr["T_V"].double().mT
                Wo = W_O[layer].view(-1, Hkv, G, d)  # o_proj columns per (KV head, group member)
                Tvi = tr["T_V_inv"].double()
                Hv = Tvi.mT @ torch.einsum("ohgd,ohge->hde", Wo, Wo) @ Tvi  # (W_O T_V⁻¹)ᵀ(W_O T_V⁻¹) per KV head
                for side, x, Hw, F in (("keys", kt, Hq, tr["F_K"]), ("values", vt, Hv, tr["F_V"])):
                    plain = TokenCodec(QuestQuantizer(b), d, torch.float16)
                    fb = TokenCodec(QuestQuantizer(b), d, torch.float16, feedback=F)
                    for i, codec in enumerate((plain, fb)):
                        e = codec.fake(x.float()).double() - x
                        tot[side][i] += torch.einsum("bhsd,hde,bhse->", e, Hw, e).item()
                        if side == "keys":
                            tot["keys_mse"][i] += e.pow(2).sum().item()
                    pred[side].append(feedback_gain(Hw).mean().item())
                if args.attention:
                    S = k.shape[2]
                    i, t = torch.arange(S)[:, None], torch.arange(S)[None, :]
                    seen_q = (t >= args.sink) & (t <= i - args.keep)  # keys query i reads quantized (approximately)
                    scores = (q @ k.repeat_interleave(G, 1).mT) / math.sqrt(d)
                    p = torch.softmax(scores.masked_fill(t > i, float("-inf")), -1) * seen_q  # (1, Hq, S, S)
                    for j, F in enumerate((None, tr["F_K"])):
                        kt_all = k @ tr["T_K"].double().mT
                        e = TokenCodec(QuestQuantizer(b), d, torch.float16, feedback=F).fake(kt_all.float()).double() - kt_all
                        de2 = ((q.reshape(1, Hkv, G * S, d) @ tr["T_K_inv"].double()) @ e.mT).reshape(1, Hkv * G, S, S) ** 2
                        tot["keys_attention"][j] += (p * de2).sum().item()
                        tot["keys_visible"][j] += (de2 * seen_q).sum().item()
                    del scores, p, de2
            row = {s: {"ratio": tot[s][1] / tot[s][0] if tot[s][0] else float("nan"),
                       "predicted_mean": sum(pred[s]) / len(pred[s]) if pred.get(s) else float("nan")} for s in tot}
            out["results"][f"{method}/{b}"] = row
            print(f"{method:10s} {b}-bit  keys: feedback/plain {row['keys']['ratio']:.3f} (predicted {row['keys']['predicted_mean']:.3f})   "
                  f"values: {row['values']['ratio']:.3f} (predicted {row['values']['predicted_mean']:.3f})   "
                  f"unweighted key MSE: {row['keys_mse']['ratio']:.3f}"
                  + (f"   keys by attention: {row['keys_attention']['ratio']:.3f} (every visible quantized key alike: "
                     f"{row['keys_visible']['ratio']:.3f})" if args.attention else ""), flush=True)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, out)


if __name__ == "__main__":
    main()
