"""The key-error proxy for keys centered on their rotating pre-RoPE mean (docs/ABLATIONS.md section 18).

    python benchmarks/rope_mean_proxy.py --calibration out/smollm2-c32.safetensors [--json out/rope_mean_proxy.json]

For every layer, with the model's true (full-precision) post-RoPE queries and keys of one WikiText-2 chunk
(positions past the 16-token sink), keys are quantized per token with QuEST in the transformed space,
plain (k̂ = T⁻¹ Q(T k)) or centered on the rotating mean c_t = R_t μ (k̂ = T⁻¹ Q(T (k − c_t)) + c_t, μ from
``--mean-seqs`` calibration sequences, as ``ablations.py --study rope-mean`` uses it). Reported, geometric
means over layers: the relative logit error ‖Q (K̂ − K)ᵀ‖² / ‖Q Kᵀ‖²; the same with each query's mean error
over the keys removed (a shift softmax ignores); and the error variance under the true causal attention
weights. The transforms are ``hadamard`` and the calibration's ``wush``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.calibration import Calibration, calibration_sequences, pre_rope_key_mean  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.folding import KeyTransform  # noqa: E402
from wushkv.io import write_json  # noqa: E402
from wushkv.models import attention_modules, describe, load, projections, rope_parameters, rope_rotate  # noqa: E402
from wushkv.progress import progress  # noqa: E402
from wushkv.quantizers import QuestQuantizer  # noqa: E402
from wushkv.transforms import build_transforms  # noqa: E402


@torch.no_grad()
def post_rope(model, ids):
    """Per layer: (queries (Hq, T, d), keys (Hkv, T, d)) after RoPE (and q/k norms), as attention sees them."""
    from wushkv.models import pre_rope_keys

    spec = describe(model)
    H, Hq, d, T = spec.num_kv_heads, spec.num_heads, spec.head_dim, ids.shape[1]
    got = {}
    hooks = []
    for i, a in enumerate(attention_modules(model, spec)):
        q_proj, k_proj = projections(a, spec)[:2]
        hooks.append(q_proj.register_forward_hook(lambda m, x, o, i=i: got.__setitem__(("q", i), o.detach())))
        hooks.append(k_proj.register_forward_hook(lambda m, x, o, i=i, a=a: got.__setitem__(("k", i), pre_rope_keys(a, spec, o.detach()))))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, a in enumerate(attention_modules(model, spec)):
        q = got[("q", i)].reshape(T, Hq, d)
        if spec.qk_norm:
            q = a.q_norm(q)
        k = got[("k", i)].reshape(T, H, d)
        inv_freq, scale = rope_parameters(model, i, spec)
        pos = torch.arange(T)[:, None]  # (T, 1): every head of a position
        out.append((rope_rotate(q, pos, inv_freq, scale).transpose(0, 1).float(), rope_rotate(k, pos, inv_freq, scale).transpose(0, 1).float()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--bits", default="2,3")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--mean-seqs", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, tok = load(args.model)
    spec = describe(model)
    cal = Calibration.load(args.calibration, model)
    H, d, G = spec.num_kv_heads, spec.head_dim, spec.group_size
    mus = pre_rope_key_mean(model, calibration_sequences(tok, args.mean_seqs, 2048))
    ids = tokenize_chunks(tok, load_eval_text(None)[0], 2048, 1)
    layers = post_rope(model, ids)
    trs = {"hadamard": [build_transforms("hadamard", H, d) for _ in range(spec.num_layers)], "wush": cal.transforms("wush")}
    res: dict = {}
    for b in (int(x) for x in args.bits.split(",")):
        quant = QuestQuantizer(b)
        acc: dict = {}
        for l in progress(range(spec.num_layers), desc=f"{b}-bit layers", unit="layer"):
            q, k = layers[l]
            s = args.sink
            qq, kk = q[:, s:].reshape(H, G * (q.shape[1] - s), d), k[:, s:]
            n = kk.shape[1]
            true = qq @ kk.transpose(1, 2)
            allowed = torch.ones(n, n, dtype=torch.bool).tril().repeat(G, 1)
            P = (true / math.sqrt(d)).masked_fill(~allowed, float("-inf")).softmax(-1)
            for name, trl in trs.items():
                tr = trl[l]
                for centered in (False, True):
                    kt = KeyTransform(tr["T_K"].float(), tr["T_K_inv"].float(),
                                      mu_rope=mus[l].float() if centered else None, rope=rope_parameters(model, l, spec) if centered else None)
                    x = kk @ kt.T_t
                    c = kt.center(torch.arange(s, s + n)[None], torch.float32)[0] if centered else 0.0
                    k_hat = (quant.fake(x - c) + c) @ kt.T_inv.transpose(1, 2)
                    E = qq @ (k_hat - kk).transpose(1, 2)
                    ref = true.pow(2).mean()
                    Es = E / math.sqrt(d)
                    m1 = (P * Es).sum(-1, keepdim=True)
                    key = f"{name}{', centered on R_t mu' if centered else ''}"
                    for metric, v in (("logit_error", E.pow(2).mean() / ref),
                                      ("without_common_mode", (E - E.mean(-1, keepdim=True)).pow(2).mean() / ref),
                                      ("attention_weighted", (P * (Es - m1).pow(2)).sum(-1).mean())):
                        acc.setdefault(key, {}).setdefault(metric, []).append(float(v))
        res[str(b)] = {k: {m: math.exp(sum(math.log(x) for x in v) / len(v)) for m, v in ms.items()} for k, ms in acc.items()}
        print(f"\n{b} bits | logit error | without the common mode | attention-weighted")
        for k, ms in res[str(b)].items():
            print(f"{k:<32} | {ms['logit_error']:.4f} | {ms['without_common_mode']:.4f} | {ms['attention_weighted']:.3f}")
    if args.json:
        write_json(Path(args.json), {"settings": vars(args), "results": res})


if __name__ == "__main__":
    main()
