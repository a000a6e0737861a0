"""The 2-bit key errors of a long generation, as the model's own queries see them, per transform.

Companion of ``agree_sides.py``: for prompts of an earlier ``wushkv agree`` run (prompt + its stored
full-precision continuation), every layer's post-RoPE keys are transformed, quantized per token with
the run's key quantizer, dequantized and transformed back. For each method it prints

* the RMS logit error ``scaling · q_t · (k̂_s − k_s)`` of the last-quarter queries against keys in
  bins of key position (does a key's error depend on where it sits?);
* the same of the 2nd- and of the 4th-quarter queries against the quantized middle, relative to the
  first method (does a transform's advantage change between the quarters, per layer and head?);
* the correlation of the logit errors of two copies of the same 8-gram (generation loops repeat
  text; correlated errors would not average out over copies), against random pairs;
* with ``--attention``: the same errors weighed by the full-precision attention of the 2nd- and
  4th-quarter queries (the attention mass on the quantized middle, Σ a·δ² over it, relative to the
  first method), and the error ratio by the attention weight a key receives (do the keys a query
  attends to get a larger share of the error under one transform than under another?).

    python benchmarks/key_errors.py --agree out/agree_smollm2_full.json --calibration out/smollm2-c32.safetensors \\
        --methods random,wush --prompts 5,13
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from agree_sides import load_agree_run  # noqa: E402  (beside this script)
from wushkv.attention import grouped, observe_sequences  # noqa: E402
from wushkv.calibration import Calibration  # noqa: E402
from wushkv.config import QuantConfig  # noqa: E402
from wushkv.quantizers.base import dequantize  # noqa: E402
from wushkv.quantizers.registry import make_quantizer  # noqa: E402


class _Keys:
    def __init__(self):
        self.k, self.q, self.scaling = {}, {}, None

    def observe(self, module, q, k, v, allowed, scaling, softcap=None):
        self.k[module.layer_idx], self.q[module.layer_idx], self.scaling = k[0].double(), q[0].double(), scaling


def copy_pairs(tokens: list[int], lo: int, hi: int, n: int = 8) -> list[tuple[int, int]]:
    """(earlier, later) positions in [lo, hi) whose n tokens ending there are the same."""
    last, out = {}, []
    for s in range(n - 1, hi):
        g = tuple(tokens[s - n + 1 : s + 1])
        if g in last and last[g] >= lo:
            out.append((last[g], s))
        last[g] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agree", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--methods", default="random,wush", help="the first is the reference of the ratios")
    ap.add_argument("--prompts", default="5,13", help="prompt indices of the agree run")
    ap.add_argument("--attention", action="store_true", help="also weigh the errors by the full-precision attention")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    saved, model, _, prompts = load_agree_run(args.agree)
    st = saved["settings"]
    cfg = QuantConfig.from_dict(st["quantization"])
    quant = make_quantizer(cfg.quantizer, cfg.k_bits, **({"clip_ratio": cfg.k_clip} if cfg.quantizer == "affine" else {}))
    cal = Calibration.load(args.calibration, model)
    methods = args.methods.split(",")
    trs = {m: cal.transforms(m) for m in methods}
    P, n = st["prompt_len"], st["new_tokens"]
    L, sink, keep = P + n, cfg.windows.S_sink, cfg.windows.S_keep
    q2, q4 = (P + n // 4, P + n // 2), (P + 3 * n // 4, L)
    edges = torch.linspace(sink, q4[0], 6).long().tolist()
    bins = list(zip(edges[:-1], edges[1:]))
    spec_layers, Hkv = len(trs[methods[0]]), trs[methods[0]][0]["T_K"].shape[0]
    by_bin = {m: torch.zeros(len(bins)) for m in methods}
    by_head = {m: torch.zeros(2, spec_layers, Hkv) for m in methods}
    corr = {m: torch.zeros(4) for m in methods}  # Σ e1·e2 (copies), Σ e1², Σ e2², Σ e1·e2 (random pairs)
    a_edges = (0.0, 1e-3, 1e-2, 1e-1, 1.01)  # attention-weight bins of (query, quantized key) pairs
    weighted = {m: torch.zeros(2) for m in methods}  # Σ a·δ² over the quantized middle, 2nd / 4th quarter
    by_weight = {m: torch.zeros(2, len(a_edges) - 1) for m in methods}  # Σ δ² per weight bin, per quarter
    pairs_in = torch.zeros(2, len(a_edges) - 1)  # (query, key) pairs per weight bin
    mass = torch.zeros(2)  # attention on the quantized middle
    which = [int(x) for x in args.prompts.split(",")]
    for p in which:
        tokens = prompts[p].tolist() + saved["state"]["continuations"][p]
        obs = _Keys()
        observe_sequences(model, torch.tensor([tokens]), obs, f"prompt {p}", show_progress=False)
        pairs = copy_pairs(tokens, sink, q4[0])
        rnd = random.Random(0)
        rpairs = [tuple(rnd.sample(range(sink, q4[0]), 2)) for _ in pairs]
        a, b = torch.tensor([x for x, _ in pairs]), torch.tensor([y for _, y in pairs])
        ra, rb = torch.tensor([x for x, _ in rpairs]), torch.tensor([y for _, y in rpairs])
        print(f"prompt {p}: {len(pairs)} copy pairs among the keys at {sink}..{q4[0] - 1}")
        for m in methods:
            for layer, tr in enumerate(trs[m]):
                k, q = obs.k[layer], obs.q[layer]
                qg = grouped(q[None], k.shape[0])[0]  # (Hkv, G, T, d)
                for h in range(k.shape[0]):
                    T, T_inv = tr["T_K"][h].double(), tr["T_K_inv"][h].double()
                    e = dequantize(quant.quantize((k[h] @ T.T).float())).double() @ T_inv.T - k[h]
                    dl = torch.einsum("gtd,sd->gts", qg[h, :, q4[0] : q4[1]], e) * obs.scaling  # last-quarter queries
                    for i, (lo, hi) in enumerate(bins):
                        by_bin[m][i] += dl[:, :, lo:hi].pow(2).mean()
                    c = corr[m]
                    c[0] += (dl[..., a] * dl[..., b]).mean()
                    c[1] += dl[..., a].pow(2).mean()
                    c[2] += dl[..., b].pow(2).mean()
                    c[3] += (dl[..., ra] * dl[..., rb]).mean()
                    for i, (lo, hi) in enumerate((q2, q4)):  # queries of a quarter against that time's quantized middle
                        d2 = torch.einsum("gtd,sd->gts", qg[h, :, lo:hi], e[sink : lo - keep]) * obs.scaling
                        by_head[m][i, layer, h] += d2.pow(2).mean()
                        if args.attention:
                            t = torch.arange(lo, hi)[:, None]
                            s_ = torch.arange(hi)[None, :]
                            logits = torch.einsum("gtd,sd->gts", qg[h, :, lo:hi], k[h, :hi]) * obs.scaling
                            att = logits.masked_fill(s_ > t, float("-inf")).softmax(-1)
                            mid = ((s_ >= sink) & (s_ < t - keep)).expand_as(att)  # keys in the quantized middle at query t
                            dl2 = (torch.einsum("gtd,sd->gts", qg[h, :, lo:hi], e[:hi]) * obs.scaling).pow(2)
                            weighted[m][i] += (att * dl2 * mid).sum() / att.shape[0] / att.shape[1]
                            for j in range(len(a_edges) - 1):
                                sel = mid & (att >= a_edges[j]) & (att < a_edges[j + 1])
                                by_weight[m][i, j] += dl2[sel].sum()
                                if m == methods[0]:
                                    pairs_in[i, j] += sel.sum()
                            if m == methods[0]:
                                mass[i] += (att * mid).sum() / att.shape[0] / att.shape[1]
    count = len(which) * spec_layers * Hkv
    print(f"\nRMS logit error of the 4th-quarter queries against keys at positions {bins}:")
    for m in methods:
        print(f"  {m:12s} " + "  ".join(f"{float(x):.3f}" for x in (by_bin[m] / count).sqrt()))
    print("\ncorrelation of the logit errors of two copies of the same 8-gram (random pairs in brackets):")
    for m in methods:
        c = corr[m]
        print(f"  {m:12s} {float(c[0] / (c[1] * c[2]).sqrt()):.3f}  ({float(c[3] / (c[1] * c[2]).sqrt()):.3f})")
    ref = methods[0]
    print(f"\nRMS logit error against the quantized middle, relative to {ref}, mean over layers and heads:")
    for m in methods[1:]:
        r = (by_head[m] / by_head[ref]).sqrt()
        print(f"  {m:12s} 2nd-quarter queries {float(r[0].mean()):.3f}, 4th-quarter queries {float(r[1].mean()):.3f}; "
              f"largest change of a head {float((r[1] - r[0]).abs().max()):.3f}")
    if args.attention:
        print(f"\nattention of the queries on the quantized middle (full precision): 2nd quarter {float(mass[0] / count):.3f}, "
              f"4th quarter {float(mass[1] / count):.3f}")
        print("attention-weighted squared logit error over the quantized middle, sum a·δ², mean per query:")
        for m in methods:
            w = weighted[m] / count
            print(f"  {m:12s} 2nd quarter {float(w[0]):.4f}, 4th {float(w[1]):.4f} (x{float(w[1] / w[0]):.2f}); "
                  f"relative to {ref}: {float((weighted[m][0] / weighted[ref][0]).sqrt()):.3f} / "
                  f"{float((weighted[m][1] / weighted[ref][1]).sqrt()):.3f} (RMS ratio)")
        bins_a = [f"[{a_edges[j]:g}, {min(a_edges[j + 1], 1):g})" for j in range(len(a_edges) - 1)]
        print(f"RMS logit error by the attention weight of the (query, key) pair, relative to {ref}; bins {bins_a}")
        for i, q in enumerate(("2nd", "4th")):
            print(f"  {q} quarter, pairs per bin: " + " ".join(f"{int(x)}" for x in pairs_in[i]))
            for m in methods[1:]:
                r = (by_weight[m][i] / by_weight[ref][i]).sqrt()
                print(f"    {m:12s} " + "  ".join(f"{float(x):.3f}" for x in r))


if __name__ == "__main__":
    main()
