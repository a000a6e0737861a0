"""Ablations of WUSH-KV (issue #9): what moves perplexity, measured side by side in one process.

    python benchmarks/ablations.py --study damping --model smollm2-135m --calibration CAL \\
        --chunks 4 --bits 2,3,4 --json out/abl_damping_smollm2.json

Studies (each a list of variants; every variant is evaluated at every ``--bits``):

* ``damping``: γ_H and γ_M of WUSH separately (1e-3 … 1), and both together; Hadamard alongside;
* ``clip``: the QuEST clip multiplier on α_b for keys and for values, for WUSH and Hadamard;
* ``calib``: calibration amount — statistics accumulated over the first 4, 8, 16, 32 (… ``--max-samples``)
  calibration sequences of one pass, so smaller sets are prefixes of larger ones;
* ``wush-a``: WUSH-A (attention-aware Hessians, from a calibration made with ``--wush-a``) end to end;
* ``sides``: keys only and values only quantized (the other side full precision), Hadamard vs WUSH:
  where does each transform win or lose?
* ``mix``: each side from another transform (Hadamard keys + WUSH values, and the reverse; WUSH-A keys
  when the calibration has WUSH-A statistics): which side of WUSH gains perplexity, and which costs
  passkey retrieval (docs/GENERATION.md);
* ``key-damping``: γ_H of the key side only (H_K + γ·(tr H_K/d)·I, γ in ``KEY_DAMPING_GRID``; values keep
  the default WUSH): shrinking the query Hessian towards the identity moves the key transform from WUSH
  towards a partial whitening of the keys alone (γ → ∞: T_K ∝ 𝓗·Λ_K^{-1/4}·Uᵀ from M_K); does that buy
  back the passkey (``--passkey``) without losing perplexity?
* ``rope-sym``: key statistics averaged over every rotary angle (each RoPE plane (j, j + d/2) of M_K and H_K
  replaced by its mean diagonal, cross-plane terms dropped): a key transform that is the same at every
  position (a per-plane scaling, then 𝓗), against WUSH, whose post-RoPE statistics only cover the
  calibration's positions; values keep WUSH;
* ``center``: keys and values centered before the transform (k' = T (k − μ_K), v' = T_V (v − μ_V), both
  exact for attention): Hadamard and WUSH each with and without, WUSH with keys only, KVarN alongside;
* ``signs``: the free sign of each eigenvector. ``eigh`` returns every eigenvector up to its sign, and
  each choice D (a ±1 diagonal between Λ^{-1/4} and 𝓗) is an exact WUSH solution:
  T_D = c·𝓗·D·Λ^{-1/4}·Uᵀ·Lᵀ = (𝓗 D 𝓗ᵀ)·T, with the same expected error. Variants: WUSH as the
  calibration file stores it (the signs of the machine that made it), with the canonical signs wushkv
  now fixes (:func:`wushkv.transforms.wush.canonical_signs`), and with ``--sign-seeds`` random sign
  patterns per (layer, side, head). The spread over them is a noise floor that no choice of settings
  can be read below;
* ``rope-mean``: keys centered on their rotating mean. RoPE turns the keys' pre-RoPE mean μ (from
  ``--mean-seqs`` calibration sequences) into a different vector R_t μ at each position, so no fixed
  shift removes it; the cache quantizes T (k_t − R_t μ) and adds T R_t μ back on reading (exact), for
  Hadamard and WUSH;
* ``search``: a per-token clip search (``--clip-search``): each token's quantizer picks, among
  ``--search`` + 1 clip levels, the one of least squared error (in the transformed space, which for
  WUSH is its weighted objective), for Hadamard and WUSH, with the tiles alongside;
* ``tiles``: the WUSH transform under KVarN's tile quantizer (its windows: first tile of 128 full
  precision, tail until a tile fills) against KVarN itself (Hadamard + tiles).
* ``clip-layer``: the QuEST clip multiplier chosen per layer and side, for Hadamard and for WUSH, as
  the one of ``LAYER_CLIP_GRID`` with the lowest module-output error (the reconstruction experiment,
  that side alone quantized, first S_sink tokens in full precision) on ``--clip-seqs`` held-out C4
  sequences, separately for each width; against the same transform with α × 1;
* ``alloc``: bit allocation at a fixed mean width (``--budgets``, between ``--low`` and ``--high``
  bits): per (layer, side) sensitivities measured on calibration text (:mod:`wushkv.eval.allocation`,
  ``--sens-seqs`` × ``--sens-seq-len`` C4 tokens, cached in ``--sensitivity``), the most sensitive
  pairs upgraded, against a random allocation of the same budget and the uniform K↑V↓ / K↓V↑ splits;
  run it with ``--bits`` = ``--low`` (the widths come from the variants).

``--passkey N`` also scores every variant on N deterministic passkey prompts per depth (1k tokens,
depths 0.1 and 0.5, K2V2 affine, windows 64/256/8: the setting of docs/GENERATION.md), with hits and
the mean teacher-forced log P(key).

Every variant also gets the layer-reconstruction geomean (paper §4; no windows) on ``--recon-seqs``
held-out calibration sequences (C4, never the evaluation text), twice: every token quantized
(``recon``, the paper's experiment) and with the first S_sink tokens full precision as in the cache
(``recon_sink``), so the table shows whether that cheap proxy predicts perplexity. Results resume
from ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


import torch  # noqa: E402

from wushkv.eval.allocation import allocate_bits, layer_sensitivity, mean_bits, random_allocation  # noqa: E402
from wushkv.cache import WushKVCache  # noqa: E402
from wushkv.calibration import Calibration, calibration_sequences, collect_statistics, pre_rope_key_mean  # noqa: E402
from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig, WindowConfig  # noqa: E402
from wushkv.data import load_eval_text, tokenize_chunks  # noqa: E402
from wushkv.eval.methods import mix_sides, with_sign_pattern  # noqa: E402
from wushkv.eval.perplexity import perplexity  # noqa: E402
from wushkv.eval.reconstruction import layer_reconstruction  # noqa: E402
from wushkv.folding import apply_transforms  # noqa: E402
from wushkv.io import write_json  # noqa: E402
from wushkv.models import describe, load  # noqa: E402
from wushkv.transforms import build_transforms  # noqa: E402

GRID = (1e-3, 1e-2, 1e-1, 1.0)
KEY_DAMPING_GRID = (1.0, 10.0, 100.0, 1000.0)
CLIP_GRID = (0.85, 1.15)
LAYER_CLIP_GRID = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4)


def wush_layers(stats, spec, damping=0.01, damping_M=None, keys=("M_K", "H_K", "M_V", "H_V")):
    name = "wush" if keys[1] == "H_K" else "wush-a"
    return [build_transforms(name, spec.num_kv_heads, spec.head_dim, st, damping=damping, damping_M=damping_M) for st in stats]


def plain_layers(name, spec):
    return [build_transforms(name, spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]


def rope_symmetrized(A):
    """A [..., d, d] averaged over every angle of each rotary plane (j, j + d/2) (the rotate-half
    convention): per plane the mean of its two diagonal entries, zero elsewhere."""
    h = A.shape[-1] // 2
    dg = torch.diagonal(A, dim1=-2, dim2=-1)
    a = 0.5 * (dg[..., :h] + dg[..., h:])
    return torch.diag_embed(torch.cat([a, a], -1))


def sum_stats(parts):
    """Add per-layer additive statistics (M_K, H_K, M_V, H_A...) of several passes; H_V is weights-only."""
    out = []
    for layers in zip(*parts):
        st = {k: sum(p[k] for p in layers) for k in ("M_K", "H_K", "M_V")}
        st["H_V"] = layers[0]["H_V"]
        out.append(st)
    return out


def variants(study, args, model, tok, spec, cal):
    """[(name, per-layer transforms, cfg overrides)] for a study."""
    if study == "damping":
        v = [("hadamard", plain_layers("hadamard", spec), {})]
        for g in GRID:
            v.append((f"wush γH={g:g} γM={g:g}", wush_layers(cal.stats, spec, g, g), {}))
        for g in GRID:
            if g != 1e-2:
                v.append((f"wush γH={g:g} γM=0.01", wush_layers(cal.stats, spec, g, 1e-2), {}))
                v.append((f"wush γH=0.01 γM={g:g}", wush_layers(cal.stats, spec, 1e-2, g), {}))
        return v
    if study == "clip":
        # global QuEST clip multipliers on α_b, keys and values separately (--sides), over --clip-grid; with a
        # calibration that holds the pre-RoPE key mean, also WUSH with keys centered on it (wush+rmean)
        grid = [float(a) for a in args.clip_grid.split(",")] if args.clip_grid else list(CLIP_GRID)
        methods = [("hadamard", plain_layers("hadamard", spec)), ("wush", cal.transforms("wush"))]
        if all("mu_K_pre" in st for st in cal.stats):
            methods.append(("wush+rmean", [t | {"mu_K_rope": st["mu_K_pre"].float()} for t, st in zip(cal.transforms("wush"), cal.stats)]))
        v = []
        for name, trs in methods:
            for a in grid:
                for side in args.sides.split(","):
                    v.append((f"{name} α{side[0].upper()}×{a:g}", trs, {f"{side[0]}_alpha": a}))
        return v
    if study == "calib":
        seqs = calibration_sequences(tok, args.max_samples, args.calib_seq_len)
        v, parts, done = [("hadamard", plain_layers("hadamard", spec), {})], [], 0
        n = 4
        while n <= args.max_samples:
            parts.append(collect_statistics(model, seqs[done:n], show_progress=True))
            done = n
            st = sum_stats(parts)
            parts = [st]
            v.append((f"wush {n}x{args.calib_seq_len}", wush_layers(st, spec), {}))
            n *= 2
        return v
    if study == "wush-a":
        if "H_K_A" not in cal.stats[0]:
            raise SystemExit("--study wush-a needs a calibration made with `wushkv calibrate --wush-a`")
        return [
            ("hadamard", plain_layers("hadamard", spec), {}),
            ("wush", cal.transforms("wush"), {}),
            ("wush-a", cal.transforms("wush-a"), {}),
        ]
    if study == "sides":
        v = []
        for name, trs in (("hadamard", plain_layers("hadamard", spec)), ("wush", cal.transforms("wush"))):
            v.append((f"{name} keys only", trs, {"v_bits": None}))
            v.append((f"{name} values only", trs, {"k_bits": None}))
        return v
    if study == "mix":
        # each side from another transform: which side of WUSH helps perplexity, and which hurts retrieval
        had, wush = plain_layers("hadamard", spec), cal.transforms("wush")
        v = [("hadamard", had, {}), ("wush", wush, {}),
             ("hadamard keys + wush values", mix_sides(had, wush), {}), ("wush keys + hadamard values", mix_sides(wush, had), {})]
        if "H_K_A" in cal.stats[0]:
            wa = cal.transforms("wush-a")
            v += [("wush-a", wa, {}), ("wush-a keys + wush values", mix_sides(wa, wush), {}),
                  ("wush-a keys + hadamard values", mix_sides(wa, had), {})]
        return v
    if study == "key-damping":
        wush = cal.transforms("wush")
        v = [("hadamard", plain_layers("hadamard", spec), {}), ("wush", wush, {})]
        for g in KEY_DAMPING_GRID:
            v.append((f"wush γK={g:g}", mix_sides(wush_layers(cal.stats, spec, g, cal.meta["damping"]), wush), {}))
        return v
    if study == "signs":
        canonical = wush_layers(cal.stats, spec, cal.meta["damping"])
        v = [("hadamard", plain_layers("hadamard", spec), {}), ("wush (file)", cal.transforms("wush"), {}),
             ("wush canonical signs", canonical, {})]
        # the same patterns as the methods wush+signs1, +signs2, ... on a calibration with canonical signs
        return v + [(f"wush signs seed {k}", with_sign_pattern(canonical, ("wush", "wush"), k), {}) for k in range(1, args.sign_seeds + 1)]
    if study == "rope-sym":
        wush = cal.transforms("wush")
        sym_keys = [build_transforms("wush", spec.num_kv_heads, spec.head_dim, st | {"M_K": rope_symmetrized(st["M_K"]), "H_K": rope_symmetrized(st["H_K"])})
                    for st in cal.stats]
        sym_m = [build_transforms("wush", spec.num_kv_heads, spec.head_dim, st | {"M_K": rope_symmetrized(st["M_K"])}) for st in cal.stats]
        return [("hadamard", plain_layers("hadamard", spec), {}), ("wush", wush, {}),
                ("wush rope-sym M_K+H_K", mix_sides(sym_keys, wush), {}), ("wush rope-sym M_K", mix_sides(sym_m, wush), {})]
    if study == "center":
        tiles = {"quantizer": "kvarn", "windows": [128, 0, 128]}
        # solved here from the statistics (a calibration file may hold transforms solved by older code)
        had_c = [build_transforms("hadamard-c", spec.num_kv_heads, spec.head_dim, st) for st in cal.stats]
        wush = wush_layers(cal.stats, spec)
        wush_c = [build_transforms("wush-c", spec.num_kv_heads, spec.head_dim, st) for st in cal.stats]
        drop = lambda trs, key: [{k: v for k, v in t.items() if k != key} for t in trs]  # noqa: E731
        values_only = [w | {"T_V": c["T_V"], "T_V_inv": c["T_V_inv"], "mu_V": c["mu_V"]} for w, c in zip(wush, wush_c)]
        return [
            ("hadamard", plain_layers("hadamard", spec), {}),
            ("hadamard-c keys only", drop(had_c, "mu_V"), {}),
            ("hadamard-c values only", drop(had_c, "mu_K"), {}),
            ("hadamard-c", had_c, {}),
            ("wush", wush, {}),
            ("wush-c keys only", drop(wush_c, "mu_V"), {}),
            ("wush-c values only", values_only, {}),
            ("wush-c", wush_c, {}),
            ("kvarn", plain_layers("hadamard", spec), tiles),
        ]
    if study == "clip-layer":
        return clip_layer_variants(args, model, tok, spec, cal)
    if study == "alloc":
        return alloc_variants(args, model, tok, spec, cal)
    if study == "rope-mean":
        # the mean from calibration text (C4), or, as a diagnostic only, from --mean-text-file
        mus = pre_rope_key_mean(model, calibration_sequences(tok, args.mean_seqs, args.calib_seq_len, text_file=args.mean_text_file))
        rc = lambda trs: [t | {"mu_K_rope": mus[i].float()} for i, t in enumerate(trs)]  # noqa: E731
        had, wush = plain_layers("hadamard", spec), cal.transforms("wush")
        half = spec.num_layers // 2
        part = lambda trs, ls: [t | {"mu_K_rope": mus[i].float()} if i in ls else t for i, t in enumerate(trs)]  # noqa: E731
        return [("hadamard", had, {}), ("hadamard + rope-mean keys", rc(had), {}), ("wush", wush, {}), ("wush + rope-mean keys", rc(wush), {}),
                # where the loss comes from: keys alone quantized, and the centering in one half of the layers
                ("wush keys only", wush, {"v_bits": None}), ("wush + rope-mean keys (keys only)", rc(wush), {"v_bits": None}),
                ("wush + rope-mean keys (first half of the layers)", part(wush, range(half)), {}),
                ("wush + rope-mean keys (second half of the layers)", part(wush, range(half, spec.num_layers)), {}),
                ] + ([("wush refit on centered keys + rope-mean keys", rc(refit_centered(args, model, tok, spec, cal, mus)), {})]
                     if args.refit_seqs else [])
    if study == "calib-files":
        # WUSH solved (canonical signs) from each of several calibration files, e.g. the same token count in
        # sequences of 512, 1024, 2048 and 4096 tokens, or another calibration text
        v = [("hadamard", plain_layers("hadamard", spec), {})]
        for path in args.calibrations.split(","):
            c = Calibration.load(path, model)
            src = Path(c.meta["calibration_source"]).name if c.meta.get("calibration_source", "").startswith("/") else "C4"
            v.append((f"wush {c.meta['samples']} x {c.meta['seq_len']} {src}", wush_layers(c.stats, spec, c.meta["damping"]), {}))
        return v
    if study == "query-skip":
        # every variant solved from one fresh pass over the same --stats-seqs calibration sequences: only which
        # positions enter H_K (queries) and M (keys, values) differs; (first queries skipped, first keys skipped)
        v = [("hadamard", plain_layers("hadamard", spec), {})]
        for q_skip, kv_skip in ((0, 0), (16, 0), (144, 0), (144, 16)):
            st = collect_statistics(model, calibration_sequences(tok, args.stats_seqs, args.calib_seq_len), skip_first=kv_skip,
                                    skip_first_queries=q_skip)
            name = "wush" + (f" H_K without the first {q_skip} queries" if q_skip else "") + (f" M without the first {kv_skip} keys" if kv_skip else "")
            v.append((name, wush_layers(st, spec), {}))
        return v
    if study == "search":
        tiles = {"quantizer": "kvarn", "clip_search": 0, "windows": [128, 0, 128]}
        v = []
        for name, trs in (("hadamard", plain_layers("hadamard", spec)), ("wush", cal.transforms("wush"))):
            v += [(name, trs, {}), (f"{name} search{args.search}", trs, {"clip_search": args.search})]
        return v + [("kvarn (hadamard + tiles)", plain_layers("hadamard", spec), tiles), ("wush + tiles", cal.transforms("wush"), tiles)]
    if study == "tiles":
        tiles = {"quantizer": "kvarn", "windows": [128, 0, 128]}
        return [("kvarn (hadamard + tiles)", plain_layers("hadamard", spec), tiles), ("wush + tiles", cal.transforms("wush"), tiles)]
    raise SystemExit(f"unknown study {study!r}")


def refit_centered(args, model, tok, spec, cal, mus):
    """WUSH whose key transform is solved from the second moment of the keys minus their rotating mean
    (M_K_res over ``--refit-seqs`` calibration sequences, scaled to the file's token count), the rest as the file."""
    st_res = collect_statistics(model, calibration_sequences(tok, args.refit_seqs, args.calib_seq_len), key_means=mus)
    out = []
    for st, r in zip(cal.stats, st_res):
        M = r["M_K_res"] * (float(st["n_K"][0]) / float(r["n_K"][0]))
        out.append(build_transforms("wush", spec.num_kv_heads, spec.head_dim, dict(st) | {"M_K": M}, damping=cal.meta["damping"]))
    return out


def clip_layer_variants(args, model, tok, spec, cal):
    """Per (layer, side) the clip multiplier of lowest module-output error on held-out C4, per width."""
    trs = {"hadamard": plain_layers("hadamard", spec), "wush": cal.transforms("wush")}
    held = calibration_sequences(tok, 64 + args.clip_seqs, args.calib_seq_len)[64:]  # past every calibration set used here
    s, k, f = (int(x) for x in args.windows.split(","))
    base = QuantConfig(quantizer="quest", windows=WindowConfig(s, k, f))
    chosen = {name: {} for name in trs}
    for b in (int(x) for x in args.bits.split(",")):
        cfgs = [replace(base, k_bits=b, v_bits=None, k_alpha=a) for a in LAYER_CLIP_GRID]
        cfgs += [replace(base, k_bits=None, v_bits=b, v_alpha=a) for a in LAYER_CLIP_GRID]
        res = layer_reconstruction(model, held, trs, cfgs, sink=s)
        n = len(LAYER_CLIP_GRID)
        for name in trs:
            err_k = [res[i][name]["per_layer"] for i in range(n)]
            err_v = [res[n + i][name]["per_layer"] for i in range(n)]
            pick = lambda errs, layer: LAYER_CLIP_GRID[min(range(n), key=lambda i: errs[i][layer])]  # noqa: E731
            chosen[name][str(b)] = [[pick(err_k, layer), pick(err_v, layer)] for layer in range(spec.num_layers)]
            print(f"{name} {b}-bit: chosen (αK, αV) per layer {chosen[name][str(b)]}")
    v = []
    for name, tr in trs.items():
        v.append((name, tr, {}))
        v.append((f"{name} per-layer α", tr, {"per_layer_alpha": chosen[name]}))
    return v


def alloc_variants(args, model, tok, spec, cal):
    """Uniform splits, sensitivity-allocated and random allocations of the same mean widths, all WUSH."""
    lo, hi = args.low, args.high
    wush = cal.transforms("wush")
    sens_path = Path(args.sensitivity or str(Path(args.json).with_suffix("")) + "_sensitivity.json")
    key = {"model": args.model, "calibration": cal.meta, "seqs": args.sens_seqs, "seq_len": args.sens_seq_len, "low": lo, "high": hi,
           "windows": args.windows, "quantizer": args.quantizer}
    done = None
    if sens_path.is_file():
        prev = json.loads(sens_path.read_text())
        if prev.get("settings") == key:
            done = prev["sensitivity"]
            print(f"resuming sensitivities from {sens_path}")
    seqs = calibration_sequences(tok, args.sens_seqs, args.sens_seq_len)
    s, k, f = (int(x) for x in args.windows.split(","))
    base = QuantConfig(quantizer=args.quantizer, windows=WindowConfig(s, k, f))
    with apply_transforms(model, wush, "wush"):
        sens = layer_sensitivity(model, seqs, base, widths=(lo, hi), done=done,
                                 on_result=lambda o: write_json(sens_path, {"settings": key, "sensitivity": o}))
    write_json(sens_path, {"settings": key, "sensitivity": sens})
    v = [
        (f"wush K{lo}V{lo} ({lo:.2f})", wush, {"k_bits": lo, "v_bits": lo}),
        (f"wush K{hi}V{lo} ({(lo + hi) / 2:.2f})", wush, {"k_bits": hi, "v_bits": lo}),
        (f"wush K{lo}V{hi} ({(lo + hi) / 2:.2f})", wush, {"k_bits": lo, "v_bits": hi}),
    ]
    for budget in (float(x) for x in args.budgets.split(",")):
        a = allocate_bits(sens, lo, hi, budget)
        r = random_allocation(spec.num_layers, lo, hi, budget, seed=0)
        v.append((f"wush allocated ({mean_bits(a):.2f})", wush, {"per_layer": a}))
        v.append((f"wush random ({mean_bits(r):.2f})", wush, {"per_layer": r}))
    v.append((f"wush K{hi}V{hi} ({hi:.2f})", wush, {"k_bits": hi, "v_bits": hi}))
    return v


def make_cfg(base, b, over):
    over = dict(over)
    if "windows" in over:
        over["windows"] = WindowConfig(*over["windows"])
    if "per_layer" in over:  # one config per layer (bit allocation)
        return [replace(base, k_bits=k, v_bits=v) for k, v in over.pop("per_layer")]
    if "per_layer_alpha" in over:  # one config per layer (clip multipliers chosen for this width)
        return [replace(base, k_bits=b, v_bits=b, k_alpha=ak, v_alpha=av) for ak, av in over.pop("per_layer_alpha")[str(b)]]
    return replace(base, **({"k_bits": b, "v_bits": b} | over))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", required=True, choices=["damping", "key-damping", "rope-sym", "rope-mean", "signs", "search", "clip", "clip-layer", "calib", "wush-a", "sides", "mix", "tiles", "center", "alloc", "query-skip", "calib-files"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", default=None, help="calibration file (statistics); not needed by --study calib")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--text-file", default=None, help="evaluate on this UTF-8 text instead of WikiText-2 test")
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--quantizer", default="quest")
    ap.add_argument("--windows", default="16,128,16", help="S_sink,S_keep,S_flush")
    ap.add_argument("--max-samples", type=int, default=32, help="--study calib: largest calibration set")
    ap.add_argument("--sign-seeds", type=int, default=3, help="--study signs: random sign patterns")
    ap.add_argument("--mean-seqs", type=int, default=4, help="--study rope-mean: calibration sequences for the pre-RoPE key mean")
    ap.add_argument("--mean-text-file", default=None,
                    help="--study rope-mean: take the mean from this text instead of the C4 calibration text (a diagnostic "
                         "of domain shift; the evaluation text itself is an oracle, never a setting)")
    ap.add_argument("--refit-seqs", type=int, default=0, help="--study rope-mean: also WUSH re-solved on the centered keys' "
                    "second moment from this many calibration sequences (0: skip)")
    ap.add_argument("--calibrations", default=None, help="--study calib-files: comma-separated calibration files")
    ap.add_argument("--clip-grid", default=None, help="--study clip: comma-separated multipliers on α_b (default 0.85,1.15)")
    ap.add_argument("--sides", default="keys,values", help="--study clip: which clips to vary (keys, values or both)")
    ap.add_argument("--stats-seqs", type=int, default=16, help="--study query-skip: calibration sequences of each fresh pass")
    ap.add_argument("--search", type=int, default=16, help="--study search: candidate clips per token")
    ap.add_argument("--calib-seq-len", type=int, default=2048)
    ap.add_argument("--recon-seqs", type=int, default=1, help="held-out C4 sequences for the reconstruction proxy (0: skip)")
    ap.add_argument("--clip-seqs", type=int, default=2, help="--study clip-layer: held-out C4 sequences to choose the clips on")
    ap.add_argument("--budgets", default="2.25,2.5", help="--study alloc: mean widths")
    ap.add_argument("--low", type=int, default=2, help="--study alloc: the width every pair starts at")
    ap.add_argument("--high", type=int, default=3, help="--study alloc: the width of an upgrade")
    ap.add_argument("--sens-seqs", type=int, default=1, help="--study alloc: calibration sequences for the sensitivities")
    ap.add_argument("--sens-seq-len", type=int, default=1024)
    ap.add_argument("--sensitivity", default=None, help="--study alloc: sensitivity cache (default: next to --json)")
    ap.add_argument("--passkey", type=int, default=0, help="passkey prompts per depth (1k tokens, depths 0.1 and 0.5, K2V2 affine 64/256/8); 0: skip")
    ap.add_argument("--only", default=None, help="comma-separated variant names: evaluate only these")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    bits = [int(b) for b in args.bits.split(",")]
    s, k, f = (int(x) for x in args.windows.split(","))
    base = replace(QuantConfig(quantizer=args.quantizer), windows=replace(PERPLEXITY_WINDOWS, S_sink=s, S_keep=k, S_flush=f))

    model, tok = load(args.model)
    spec = describe(model)
    cal = Calibration.load(args.calibration, model) if args.calibration else None
    text, text_name = load_eval_text(args.text_file)
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks)
    out = {"settings": {"study": args.study, "model": args.model, "text": text_name, "chunks": args.chunks, "seq_len": args.seq_len,
                        "base": base.to_dict(), "calibration": cal.meta if cal else None}, "fp": None, "results": {}}
    if args.mean_text_file:  # only when set, so that earlier files still resume
        out["settings"]["mean_text"] = args.mean_text_file
    path = Path(args.json)
    if path.is_file():
        prev = json.loads(path.read_text())
        if prev.get("settings") == out["settings"]:
            out = prev
            print(f"resuming from {path}")
    if out["fp"] is None:
        out["fp"] = perplexity(model, chunks, desc="ppl full precision")["ppl"]
        write_json(path, out)
    fp = out["fp"]
    print(f"full precision PPL {fp:.3f}")

    vs = variants(args.study, args, model, tok, spec, cal)
    if args.only:
        keep = args.only.split(",")
        unknown = set(keep) - {v[0] for v in vs}
        if unknown:
            raise SystemExit(f"--only: unknown variants {sorted(unknown)}; this study has {[v[0] for v in vs]}")
        vs = [v for v in vs if v[0] in keep]
    if args.recon_seqs:
        held = calibration_sequences(tok, 64 + args.recon_seqs, args.calib_seq_len)[64:]  # past every calibration set used here
        for b in bits:
            for key, sink in (("recon", 0), ("recon_sink", base.windows.S_sink)):
                todo = [v for v in vs if key not in out["results"].get(v[0], {}).get(str(b), {})]
                # one pass per distinct cfg override, every transform of that override together
                groups: dict[str, list] = {}
                for v in todo:
                    if "per_layer" in v[2] or "per_layer_alpha" in v[2]:  # the reconstruction experiment takes one config for every layer
                        continue
                    groups.setdefault(json.dumps(v[2], sort_keys=True), []).append(v)
                for over, group in groups.items():
                    cfg = make_cfg(base, b, json.loads(over))
                    if cfg.quantizer == "kvarn":  # tiles need whole tiles: recon on the longest multiple of 128
                        L = held.shape[1] // 128 * 128
                        seqs, s_ = held[:, :L], max(sink, 128)
                    else:
                        seqs, s_ = held, sink
                    res = layer_reconstruction(model, seqs, {name: trs for name, trs, _ in group}, cfg, show_progress=False, sink=s_)
                    for name, _, _ in group:
                        out["results"].setdefault(name, {}).setdefault(str(b), {})[key] = res[name]["geomean"]
                write_json(path, out)
    for b in bits:
        for name, trs, over in vs:
            entry = out["results"].setdefault(name, {}).setdefault(str(b), {})
            if "ppl" in entry:
                continue
            cfg = make_cfg(base, b, over)
            t0 = time.perf_counter()
            with apply_transforms(model, trs, name):
                r = perplexity(model, chunks, cache_factory=lambda: WushKVCache(model, cfg), desc=f"{name} {b}-bit")
            entry.update(ppl=r["ppl"], delta_pct=100 * (r["ppl"] / fp - 1), seconds=time.perf_counter() - t0, overrides=over,
                         chunk_nll=r["chunk_nll"])
            print(f"{name:<28} {b}-bit PPL {r['ppl']:8.3f} ({entry['delta_pct']:+.2f}%)  recon {entry.get('recon', math.nan):.4g}"
                  f"  recon_sink {entry.get('recon_sink', math.nan):.4g}")
            write_json(path, out)
    if args.passkey:
        for name, trs, over in vs:
            entry = out["results"].setdefault(name, {})
            if entry.get("passkey", {}).get("trials") == args.passkey:
                continue
            entry["passkey"] = passkey_probe(model, tok, trs, name, args.passkey)
            print(f"{name:<28} passkey {entry['passkey']['hits']}/{entry['passkey']['prompts']}  mean log P(key) {entry['passkey']['logprob_mean']:.3f}")
            write_json(path, out)
    print_table(out, [v[0] for v in vs], bits)


PASSKEY_DEPTHS = (0.1, 0.5)


def passkey_probe(model, tok, trs, name, trials, context=1024, seed=0):
    """Hits and mean log P(key) on the deterministic prompts of `wushkv passkey` (K2V2 affine, 64/256/8)."""
    from wushkv.config import GENERATION_WINDOWS
    from wushkv.eval.passkey import answer_and_logprob, answer_key, key_tokens, passkey_prompt, trial_seed

    cfg = QuantConfig(2, 2, "affine", windows=GENERATION_WINDOWS)
    hits, lps = 0, []
    with apply_transforms(model, trs, name):
        for d in PASSKEY_DEPTHS:
            for t in range(trials):
                ids, key = passkey_prompt(tok, context, d, trial_seed(seed, context, d, t))
                gen, lp = answer_and_logprob(model, ids, key_tokens(tok, key), 8, lambda: WushKVCache(model, cfg))
                hits += answer_key(tok.decode(gen[0], skip_special_tokens=True)) == key
                lps.append(lp)
    return {"trials": trials, "prompts": len(lps), "hits": hits, "logprob_mean": sum(lps) / len(lps), "context": context,
            "depths": list(PASSKEY_DEPTHS)}


def print_table(out, names, bits):
    print(f"\nfull precision PPL {out['fp']:.3f}")
    print("| variant | " + " | ".join(f"{b}-bit PPL (Δ%) | {b}-bit recon | {b}-bit recon (sink FP)" for b in bits) + " |")
    print("|---|" + "---|---|---|" * len(bits))
    for n in names:
        cells = []
        for b in bits:
            e = out["results"].get(n, {}).get(str(b), {})
            cells.append(f"{e['ppl']:.3f} ({e['delta_pct']:+.2f})" if "ppl" in e else "–")
            cells.append(f"{e['recon']:.4g}" if "recon" in e else "–")
            cells.append(f"{e['recon_sink']:.4g}" if "recon_sink" in e else "–")
        pk = out["results"].get(n, {}).get("passkey")
        print(f"| {n} | " + " | ".join(cells) + " |" + (f" passkey {pk['hits']}/{pk['prompts']}, log P {pk['logprob_mean']:.3f}" if pk else ""))


if __name__ == "__main__":
    main()
