"""The ``wushkv`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
import sys
import time

from . import __version__
from .runs import resumable


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from .models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m | gemma3-270m | a .gguf file, model folder or hub id (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--device-map", default=None,
                   help="accelerate device map ('auto', 'balanced', ...): split a model too large for one device over several; "
                        "every layer must stay resident (no cpu/disk offload)")


def _load(args):
    from .models import load

    t0 = time.perf_counter()
    model, tok = load(args.model, dtype=args.dtype, device=args.device, device_map=getattr(args, "device_map", None))
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model, tok


def cmd_info(args) -> int:
    from .models import describe, load_config

    spec = describe(load_config(args.model))  # reads the config only (GGUF metadata), no weights
    d = spec.to_dict()
    if args.json:
        print(json.dumps(d | {"gqa_map": list(spec.gqa_map)}, indent=2))
        return 0
    print(f"model          {args.model}")
    print(f"family         {spec.family}")
    print(f"layers         {spec.num_layers}")
    print(f"query heads    {spec.num_heads}")
    print(f"KV heads       {spec.num_kv_heads}  (group of {spec.group_size} query heads per KV head)")
    print(f"head_dim       {spec.head_dim}")
    print(f"hidden size    {spec.hidden_size}")
    print(f"q/k norm       {'yes' if spec.qk_norm else 'no'}")
    gqa = ", ".join(f"q{g}->kv{h}" for g, h in enumerate(spec.gqa_map))
    print(f"GQA map        {gqa}")
    n_sw = len(spec.sliding_layers)
    print(f"sliding window {n_sw} of {spec.num_layers} layers" + (f" (window {spec.sliding_window}): {list(spec.sliding_layers)}" if n_sw else ""))
    types = "".join("S" if t == "sliding_attention" else "F" for t in spec.layer_types)
    print(f"layer types    {types}  (F full, S sliding)")
    return 0


def _bits(s: str) -> int | None:
    if s.lower() in ("16", "fp", "none"):
        return None
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be one of 2, 3, 4, 8 or 16 (full precision), got {s!r}") from None


def _add_quant_args(p: argparse.ArgumentParser, windows) -> None:
    from .config import QuantConfig

    d = QuantConfig()
    p.add_argument("--k-bits", type=_bits, default=d.k_bits, help="key bits: 2, 3, 4, 8 (16 = full precision) (default: %(default)s)")
    p.add_argument("--v-bits", type=_bits, default=d.v_bits, help="value bits (default: %(default)s)")
    p.add_argument("--quantizer", default=d.quantizer, help="quest | affine | kivi | kvarn (default: %(default)s)")
    p.add_argument("--key-quantizer", default=d.key_quantizer, metavar="Q",
                   help="the keys' quantizer when it is not --quantizer, e.g. kvarn: keys per channel in KVarN's tiles of --flush "
                        "tokens, values per token (the +ktiles methods set this and their windows themselves)")
    p.add_argument("--k-clip", type=float, default=d.k_clip, help="affine key clip ratio κ_K (default: %(default)s)")
    p.add_argument("--v-clip", type=float, default=d.v_clip, help="affine value clip ratio κ_V (default: %(default)s)")
    p.add_argument("--k-alpha", type=float, default=d.k_alpha, help="QuEST key clip multiplier on α_b (default: %(default)s)")
    p.add_argument("--v-alpha", type=float, default=d.v_alpha, help="QuEST value clip multiplier on α_b (default: %(default)s)")
    p.add_argument("--clip-search", type=int, default=d.clip_search, metavar="N",
                   help="quest/affine: each token picks the clip of least squared error among N+1 candidates "
                        "(same bytes; 0 = the fixed clip) (default: %(default)s)")
    p.add_argument("--tile-clip", type=float, default=d.tile_clip, metavar="M",
                   help="kvarn, +tiles and +ktiles: quantize each tile row over its mean ± M·α_b·σ instead of its min-max (same bytes; "
                        "0 = KVarN as published) (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=d.group_size, help="channels per quantization group (default: head_dim)")
    p.add_argument("--sink", type=int, default=windows.S_sink, help="S_sink full-precision first tokens (default: %(default)s)")
    p.add_argument("--keep", type=int, default=windows.S_keep, help="S_keep full-precision recent tokens (default: %(default)s)")
    p.add_argument("--flush", type=int, default=windows.S_flush, help="S_flush tokens quantized per flush (default: %(default)s)")


def _quant_config(args, k_bits=None, v_bits=None):
    from .config import QuantConfig, WindowConfig

    return QuantConfig(
        k_bits=args.k_bits if k_bits is None else k_bits,
        v_bits=args.v_bits if v_bits is None else v_bits,
        quantizer=args.quantizer,
        key_quantizer=args.key_quantizer,
        k_clip=args.k_clip,
        v_clip=args.v_clip,
        k_alpha=args.k_alpha,
        v_alpha=args.v_alpha,
        clip_search=args.clip_search,
        tile_clip=args.tile_clip,
        group_size=args.group_size,
        windows=WindowConfig(args.sink, args.keep, args.flush),
    )


def _load_calibration(args, model):
    from .calibration import Calibration

    if not getattr(args, "calibration", None):
        return None
    return Calibration.load(args.calibration, model)


def _check_clips_args(args, cfg) -> bool | None:
    """Fail fast on ``--clips`` with settings it cannot apply to; True if a table is to be loaded."""
    path = getattr(args, "clips", None)
    if not path:
        return None
    if cfg is None:
        raise ValueError("--clips needs a quantized run (--transform)")
    if cfg.quantizer != "quest":
        raise ValueError(f"--clips holds QuEST clip multipliers; got --quantizer {cfg.quantizer!r}")
    if (args.k_alpha, args.v_alpha) != (1.0, 1.0):
        raise ValueError("give either --clips or --k-alpha/--v-alpha, not both")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--clips {path} does not exist (make one with `wushkv tune-clip --out {path}`)")
    return True


def _load_clips(args, model):
    from .eval.clips import ClipTable

    return ClipTable.load(args.clips, model)


def cmd_ppl(args) -> int:
    from .data import load_eval_text, tokenize_chunks
    from .eval.compare import config_for, quantized_perplexity
    from .eval.perplexity import perplexity
    from .io import write_json

    cfg = _quant_config(args) if args.transform else None
    if args.transform:
        _check_transforms([args.transform])
        cfg = config_for(args.transform, cfg)
    clips = _check_clips_args(args, cfg)
    text, label = load_eval_text(args.text_file)
    model, tok = _load(args)
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks, first=args.first_chunk)
    if cfg is None:
        res = perplexity(model, chunks, desc=f"ppl {args.model}")
    else:
        cal = _load_calibration(args, model)
        if clips is not None:
            clips = _load_clips(args, model)
            cfg = clips.apply(args.transform, cfg)
        res = quantized_perplexity(model, chunks, cal, args.transform, cfg, desc=f"ppl {args.transform} {cfg.label()}")
    out = {
        "model": args.model,
        "text": label,
        "seq_len": args.seq_len,
        "first_chunk": args.first_chunk,
        "chunks": res["chunks"],
        "tokens": res["tokens"],
        "ppl": res["ppl"],
        "seconds": res["seconds"],
        "transform": args.transform,
        "calibration": args.calibration,
        "quantization": cfg.to_dict() if cfg else None,
        "clips": clips.describe() if clips is not None else None,
    }
    what = "full precision" if cfg is None else f"{args.transform} {cfg.label()}"
    print(f"{args.model}  {label}  {res['chunks']} x {args.seq_len} tokens  {what}  PPL {res['ppl']:.3f}  ({res['seconds']:.1f}s)")
    if args.json:
        write_json(args.json, out)
    return 0


def cmd_calibrate(args) -> int:
    from .calibration import calibrate

    model, tok = _load(args)
    cal = calibrate(model, tok, samples=args.samples, seq_len=args.seq_len, text_file=args.calib_text_file,
                    damping=args.damping, wush_a=args.wush_a, skip_first=args.skip_first,
                    skip_first_queries=args.skip_first_queries, attention_weights=args.attention_weights)
    path = cal.save(args.out)
    print(f"calibration of {args.model}: {cal.meta['samples']} x {cal.meta['seq_len']} tokens, transforms {sorted(cal.solved)}, "
          f"{cal.meta['seconds']:.1f}s -> {path} (+ {path}.json)")
    return 0


def cmd_recon(args) -> int:
    from .calibration import Calibration
    from .config import QuantConfig
    from .data import load_eval_text, tokenize_chunks
    from .eval.reconstruction import layer_reconstruction
    from .io import write_json
    from .report import format_table, plot_lines

    from .eval.methods import KTILES_SUFFIX, LDLQ_SUFFIX, TILES_SUFFIX, transforms_for, uses_key_tiles, uses_ldlq, uses_tiles

    names = [t.strip() for t in args.transforms.split(",") if t.strip()]
    _check_transforms(names)
    if any(uses_tiles(n) or uses_key_tiles(n) for n in names):
        raise ValueError(f"recon measures transforms under --quantizer; tile methods ({TILES_SUFFIX}, {KTILES_SUFFIX}, kvarn) bring their own quantizer: "
                         f"drop them from --transforms (got {names})")
    if any(uses_ldlq(n) for n in names):
        raise ValueError(f"recon rounds every token independently; error-feedback methods ({LDLQ_SUFFIX}) are measured by ppl, "
                         f"compare, agree and passkey: drop them from --transforms (got {names})")
    cfgs = [QuantConfig(k_bits=b, v_bits=b, quantizer=args.quantizer) for b in args.bits]
    text, label = load_eval_text(args.text_file)
    model, tok = _load(args)
    cal = Calibration.load(args.calibration, model)
    transforms = {n: transforms_for(model, cal, n) for n in names}
    seqs = tokenize_chunks(tok, text, args.seq_len, args.samples)
    results = dict(zip(args.bits, layer_reconstruction(model, seqs, transforms, cfgs)))
    for bits, res in results.items():
        rows = [[n, r["geomean"], r["geomean"] / res[names[0]]["geomean"]] for n, r in res.items()]
        print(format_table(["transform", "geomean rel. error", f"/ {names[0]}"], rows,
                           title=f"\n{args.model}: module-output error, K{bits}V{bits} {args.quantizer}, {seqs.shape[0]} x {seqs.shape[1]} tokens of {label}"))
    first = args.bits[0]
    out = {"model": args.model, "bits": first, "quantizer": args.quantizer, "text": label, "samples": int(seqs.shape[0]),
           "seq_len": int(seqs.shape[1]), "calibration": args.calibration, "transforms": results[first],
           "by_bits": {str(b): r for b, r in results.items()}}
    if args.json:
        write_json(args.json, out)
    if args.plot:
        layers = list(range(len(next(iter(results[first].values()))["per_layer"])))
        plot_lines(layers, {n: r["per_layer"] for n, r in results[first].items()}, args.plot, "layer",
                   "‖Ŷ−Y‖² / ‖Y‖²", f"{args.model}: K{first}V{first} {args.quantizer}, module-output error", logy=True)
    return 0


def _bits_list(s: str) -> list[int]:
    try:
        return [int(b) for b in s.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated bit widths such as 2,3,4, got {s!r}") from None


def _check_transforms(transforms, tiles: bool = True, auto: bool = False) -> None:
    """Known transforms; with ``tiles``, also ``<transform>+tiles`` (the transform under KVarN's tile quantizer);
    with ``auto``, also ``auto`` (the calling command resolves it per model, quantizer and width)."""
    from .eval.methods import AUTO, KTILES_SUFFIX, LDLQ_SUFFIX, SIDES_SEP, TILES_SUFFIX, check_methods, is_transform_method
    from .transforms import TRANSFORMS

    for t in transforms:
        if t == AUTO:
            if not auto:
                check_methods([t])  # raises, saying which commands resolve auto
            continue
        if not (is_transform_method(t) if tiles else t in TRANSFORMS):
            also = (f", each optionally with the suffix {TILES_SUFFIX!r} (KVarN's tile quantizer), {KTILES_SUFFIX!r} (keys in "
                    f"KVarN's tiles), {LDLQ_SUFFIX!r} "
                    f"(error-feedback rounding) or +signsN (WUSH's N-th eigenvector sign pattern), or KEYS{SIDES_SEP}VALUES "
                    f"(e.g. wush{SIDES_SEP}hadamard: keys of one, values of the other)"
                    + (f", or {AUTO!r} (the WUSH variant chosen on held-out C4 for the model, quantizer and width)" if auto else "")) if tiles else ""
            raise ValueError(f"unknown transform {t!r}; known: {sorted(TRANSFORMS)}{also}")
        if tiles:
            check_methods([t])


def _calibration_for(args, model, tok, transforms):
    """The --calibration file, or a cached calibration when a calibrated transform is asked for."""
    from .eval.compare import cached_calibration
    from .eval.methods import AUTO, needs_calibration, uses_wush_a

    _check_transforms([t for t in transforms if t != AUTO])  # a command that takes auto has resolved or refused it
    if getattr(args, "calibration", None):
        return _load_calibration(args, model)
    if any(needs_calibration(t) for t in transforms):
        wush_a = any(uses_wush_a(t) for t in transforms)
        return cached_calibration(model, tok, args.calib_samples, args.calib_seq_len, wush_a=wush_a,
                                  log=lambda m: print(m, file=sys.stderr))
    return None


def cmd_compare(args) -> int:
    from dataclasses import replace

    from .data import load_eval_text, tokenize_chunks
    from .eval.compare import best_per_bits, compare_table, key_tile_windows, margins, run_compare
    from .eval.methods import AUTO, auto_calibration_note, uses_key_tiles
    from .io import write_json
    from .report import format_table, markdown_table, plot_lines

    transforms = [t.strip() for t in args.transforms.split(",") if t.strip()]
    _check_transforms(transforms, auto=True)
    base = _quant_config(args, k_bits=2, v_bits=2)
    from .eval.compare import config_for

    for b in args.bits:
        replace(base, k_bits=b, v_bits=b)  # validates the widths before anything long runs
    for t in transforms:
        config_for(t, base)  # and each method against the quantizer
    clips = _check_clips_args(args, base)
    text, label = load_eval_text(args.text_file)
    model, tok = _load(args)
    clips = _load_clips(args, model) if clips else None
    cal = _calibration_for(args, model, tok, transforms)
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks, first=args.first_chunk)
    if AUTO in transforms and (note := auto_calibration_note(args.model, cal)):
        print(note, file=sys.stderr)
    meta = {"model": args.model, "dtype": args.dtype, "text": label, "transforms": transforms, "bits": args.bits}
    if args.first_chunk:
        meta["first_chunk"] = args.first_chunk
        label = f"{label}, chunks from {args.first_chunk}"
    out = run_compare(model, tok, chunks, cal, transforms, args.bits, base, json_path=args.json, meta=meta,
                      log=lambda m: print(m, file=sys.stderr), clips=clips)
    headers, rows = compare_table(out, transforms, args.bits)
    w = base.windows
    clip_note = f", clips per method from {args.clips}" if clips is not None else ""
    kw = key_tile_windows(w)
    ran = [r.get("method", t) for t in transforms for r in out["results"].get(t, {}).values()]  # what auto resolved to, too
    ktiles_note = f"; +ktiles: key tiles of 128, windows {kw.S_sink}/{kw.S_keep}/{kw.S_flush}" if any(map(uses_key_tiles, ran)) else ""
    title = (f"\n{args.model} on {label}: {chunks.shape[0]} x {chunks.shape[1]} tokens, {args.quantizer}{clip_note}, K=V bits, "
             f"windows {w.S_sink}/{w.S_keep}/{w.S_flush} (kvarn and +tiles: tiles of 128, windows 128/0/128{ktiles_note})\n"
             f"full precision PPL {out['fp']['ppl']:.3f}")
    print(format_table(headers, rows, title=title))
    if clips is not None:
        used = [f"{t} {b}-bit αK×{c['k_alpha']:g} αV×{c['v_alpha']:g}" for t in transforms for b in args.bits
                if (c := out["results"].get(t, {}).get(str(b), {}).get("config")) and c.get("quantizer") == "quest"]
        print("clips: " + ", ".join(used))
    if AUTO in transforms:
        from .config import QuantConfig
        from .eval.methods import describe_resolved

        def _resolved(r: dict) -> str:
            return describe_resolved(r["method"], QuantConfig.from_dict(r["config"])) if "config" in r else r.get("method", "?")

        print("auto: " + ", ".join(f"{b}-bit {_resolved(out['results'][AUTO][str(b)])}" for b in args.bits)
              + " (chosen on held-out C4; docs/RESULTS.md)")
    best = best_per_bits(out, transforms, args.bits)
    print("lowest perplexity: " + ", ".join(f"{b}-bit {t}" for b, t in best.items()))
    margin_lines = []
    for b, m in margins(out, transforms, args.bits).items():
        ci = f" [95% paired bootstrap over chunks: {m['ci'][0]:+.2f}%, {m['ci'][1]:+.2f}%]" if m["ci"] else ""
        margin_lines.append(f"{b}-bit: {m['best']} vs runner-up {m['second']}: {m['delta_pct']:+.2f}%{ci}")
    print("\n".join("  " + x for x in margin_lines))
    if args.markdown:
        from .io import atomic_write

        md = (f"full precision PPL {out['fp']['ppl']:.3f}\n\n" + markdown_table(headers, rows) + "\n\n"
              + "".join(f"* {x}\n" for x in margin_lines))
        atomic_write(args.markdown, lambda tmp: open(tmp, "w").write(md))
    if args.plot:
        # % over full precision on a log scale: the transforms that matter differ by a few percent
        # while identity is off by hundreds.
        plot_lines(args.bits, {t: [max(out["results"][t][str(b)]["delta_pct"], 1e-2) for b in args.bits] for t in transforms},
                   args.plot, "bits (keys and values)", "perplexity increase over full precision (%)",
                   f"{args.model}: {args.quantizer}, full precision PPL {out['fp']['ppl']:.2f}", logy=True)
    if args.json:
        write_json(args.json, out)
    return 0


def cmd_tune_clip(args) -> int:
    from .data import HELDOUT_C4_FIRST, heldout_c4_text, read_text_file, tokenize_chunks
    from .eval.clips import check_tunable, clip_table_rows, tune_clips
    from .report import format_table

    transforms = [t.strip() for t in args.transforms.split(",") if t.strip()]
    _check_transforms(transforms)
    base = _quant_config(args, k_bits=2, v_bits=2)
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    check_tunable(transforms, base, sides)
    try:
        grid = [float(x) for x in args.grid.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--grid {args.grid!r}: comma-separated multipliers on α_b, e.g. 0.85,1,1.15,1.3") from None
    if not grid or any(not (0 < a < float("inf")) for a in grid) or 1.0 not in grid:
        raise ValueError(f"--grid {args.grid!r}: positive multipliers including 1 (α_b itself)")
    if args.text_file:
        text, label = read_text_file(args.text_file), str(args.text_file)
    else:
        text, label = heldout_c4_text()
    model, tok = _load(args)
    cal = _calibration_for(args, model, tok, transforms)
    if not args.text_file and cal is not None:
        from .calibration import calibration_documents

        used = calibration_documents(cal.meta)
        if used is not None and used > HELDOUT_C4_FIRST:
            raise ValueError(f"the calibration read C4 documents 0..{used - 1}, past {HELDOUT_C4_FIRST} where the held-out C4 text "
                             "starts: pass a held-out --text-file")
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks)
    table = tune_clips(model, chunks, cal, transforms, args.bits, base, grid, sides, path=args.out, text_label=label,
                       log=lambda m: print(m, file=sys.stderr), rule=args.rule)
    headers, rows = clip_table_rows(table, transforms, args.bits)
    w = base.windows
    print(format_table(headers, rows, title=f"\n{args.model}: QuEST clip multipliers on α_b chosen on {label} "
                       f"({chunks.shape[0]} x {chunks.shape[1]} tokens, windows {w.S_sink}/{w.S_keep}/{w.S_flush}); "
                       f"full precision PPL {table.data['fp']['ppl']:.3f}\nwritten to {args.out}"))
    if args.plot:
        from .eval.clips import key_curves
        from .report import plot_lines

        grid, series = key_curves(table, transforms, args.bits)
        plot_lines(grid, series, args.plot, "QuEST key clip multiplier on α_b (values at α_b)", "held-out perplexity increase (%)",
                   f"{args.model}: key clip on {label}",
                   logy=all(v > 0 for ys in series.values() for v in ys if v == v))  # NaN: not evaluated
    return 0


def cmd_demo(args) -> int:
    """The main job on the default model: calibrate (cached) and compare every transform."""
    argv = ["compare", "--model", args.model, "--bits", args.bits, "--transforms", args.transforms, "--chunks", str(args.chunks),
            "--calib-samples", str(args.calib_samples), "--json", f"{args.out}/compare.json", "--plot", f"{args.out}/compare.png",
            "--markdown", f"{args.out}/compare.md"]
    print(f"wushkv demo: wushkv {' '.join(argv)}", file=sys.stderr)
    return main(argv)


GENERATE_PROMPT = "The history of the KV cache begins"


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from .cache import WushKVCache
    from .eval.compare import config_for
    from .eval.methods import AUTO, auto_method, describe_resolved, transforms_for
    from .folding import apply_transforms

    auto = args.transform == AUTO
    method = "wush" if auto else args.transform
    _check_transforms([method])
    cfg = config_for(method, _quant_config(args))
    model, tok = _load(args)
    cal = _calibration_for(args, model, tok, [method])
    if auto:
        method, cfg = auto_method(args.model, cal, cfg)
        cfg = config_for(method, cfg)
        print(f"--transform auto: {describe_resolved(method, cfg)}" + ("" if method != "wush" else
              " (wush+rmean needs the affine quantizer and a calibration holding the pre-RoPE key mean; the other variants are "
              "chosen per model and quantizer at K = V bits)"), file=sys.stderr)
    trs = transforms_for(model, cal, method)
    prompts = [open(f, encoding="utf-8").read() for f in args.prompt_file or []] + list(args.prompt or [])
    if not prompts:
        prompts = [GENERATE_PROMPT]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if len(prompts) == 1:
        enc = {"input_ids": tok(prompts[0], return_tensors="pt").input_ids.to(args.device)}
    else:  # one left-padded batch: the cache counts each row's windows from its first real token
        side, pad = tok.padding_side, tok.pad_token
        tok.padding_side, tok.pad_token = "left", tok.pad_token if tok.pad_token is not None else tok.eos_token
        try:
            enc = {k: v.to(args.device) for k, v in tok(prompts, return_tensors="pt", padding=True).items() if k in ("input_ids", "attention_mask")}
        finally:
            tok.padding_side, tok.pad_token = side, pad
    with apply_transforms(model, trs, method):
        cache = WushKVCache(model, cfg, attention_mask=enc.get("attention_mask"))
        streamer = TextStreamer(tok, skip_prompt=False) if len(prompts) == 1 else None
        out = model.generate(**enc, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer, pad_token_id=pad_id)
    if len(prompts) > 1:
        L = enc["input_ids"].shape[1]
        for i, (p, row) in enumerate(zip(prompts, out)):
            print(f"--- [{i}] {p}{tok.decode(row[L:], skip_special_tokens=True)}")
    nb = cache.nbytes()
    size = next(model.parameters()).element_size()
    fp, bf16 = cache.full_precision_nbytes(size), cache.full_precision_nbytes(2)
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    cached = f"{out.shape[1] - 1} tokens" if len(prompts) == 1 else f"{len(prompts)} rows x {out.shape[1] - 1} columns"
    print(f"\n[{method} {cfg.label()}] {cached} cached: {mib(nb['total'])} held (codes {mib(nb['codes'])}, "
          f"metadata {mib(nb['metadata'])}, full-precision windows {mib(nb['full_precision'])}); a DynamicCache would hold "
          f"{mib(fp)} in {args.dtype} ({fp / max(nb['total'], 1):.2f}x) or {mib(bf16)} in bfloat16 ({bf16 / max(nb['total'], 1):.2f}x)",
          file=sys.stderr)
    return 0


def _methods(s: str, auto: bool = False) -> list[str]:
    """The comma-separated method names, checked; with ``auto``, ``auto`` too (resolved by :func:`_resolve_auto`)."""
    from .eval.methods import AUTO, check_methods

    names = [t.strip() for t in s.split(",") if t.strip()]
    check_methods([n for n in names if not (auto and n == AUTO)])
    return names


def _resolve_auto(args, methods: list[str], model, cal, cfg) -> tuple[dict, dict]:
    """For ``agree`` and ``passkey``: ``({"auto": (method, its cfg)}, {"auto": what it resolved to})`` when ``auto``
    is listed (the second goes into the run's settings, so a resumed run refuses rows of another resolution),
    else two empty dicts."""
    from .eval.compare import config_for
    from .eval.methods import AUTO, auto_calibration_note, auto_method, describe_resolved, transforms_for

    if AUTO not in methods:
        return {}, {}
    method, c = auto_method(args.model, cal, cfg)
    config_for(method, c)  # checks the method against the quantizer,
    transforms_for(model, cal, method)  # and against what the calibration holds, before anything long runs
    print(f"auto: {describe_resolved(method, c)} (chosen on held-out C4 for {args.model}, {cfg.label()})", file=sys.stderr)
    if note := auto_calibration_note(args.model, cal):
        print(note, file=sys.stderr)
    return {AUTO: (method, c)}, {"auto": {"method": method, "quantization": json.loads(json.dumps(c.to_dict()))}}


def _method_label(name: str, settings: dict) -> str:
    """``auto (wush+ktiles+ldlq)`` for ``auto`` in a run whose settings record its resolution; else ``name``."""
    from .eval.methods import AUTO

    got = settings.get("auto") if name == AUTO else None
    return f"{name} ({got['method']})" if isinstance(got, dict) and "method" in got else name


def _windows_pair(s: str) -> tuple[int, int]:
    try:
        sink, keep = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SINK,KEEP such as 16,128, got {s!r}") from None
    if sink < 0 or keep < 1:
        raise argparse.ArgumentTypeError(f"expected SINK >= 0 and KEEP >= 1, got {s!r}")
    return sink, keep


def _context_list(s: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        try:
            out.append(int(float(x[:-1]) * 1024) if x.endswith("k") else int(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected contexts such as 1k,2k,4096, got {s!r}") from None
    return out


def _calibration_recipe(cal) -> dict | None:
    """What a calibration's results depend on (its metadata less the date, timing and version)."""
    from .calibration import calibration_recipe

    return calibration_recipe(cal.meta if cal is not None else None)


def _sibling(path: str, tag: str) -> Path:
    """``out/x.png`` -> ``out/x{tag}.png``: a second file beside one the user named."""
    p = Path(path)
    return p.with_name(p.stem + tag + p.suffix)


AGREE_METHODS = "identity,hadamard,random,oscar,kvarn,wush,auto"  # `agree`'s default --transforms


def _late_growth(args, settings: dict, state: dict, res: dict) -> dict:
    """With ``--growth-reference M``: per method, its KL's 4th / 2nd-quarter ratio and that ratio against M's, with 95%
    bootstrap intervals over the prompts both have (printed, and returned for the JSON); else {}."""
    from .eval.agreement import late_growth

    ref = args.growth_reference
    if not ref:
        return {}
    if ref not in res:
        raise ValueError(f"--growth-reference {ref!r} is not among the methods reported: {list(res)}")
    rows = state["rows"]
    out = {}
    for m, r in res.items():
        k = min(r["prompts"], res[ref]["prompts"])
        out[m] = late_growth([x["kl"] for x in rows[m][:k]], [x["kl"] for x in rows[ref][:k]])
    print(f"KL from the 2nd to the 4th quarter, and against {_method_label(ref, settings)}'s (95% bootstrap over prompts):")
    for m, g in out.items():
        print(f"  {_method_label(m, settings):>24}: x{g['ratio']:.2f} [{g['ci'][0]:.2f}, {g['ci'][1]:.2f}]  "
              f"vs {ref}: x{g['vs_reference']:.2f} [{g['vs_reference_ci'][0]:.2f}, {g['vs_reference_ci'][1]:.2f}]")
    return out


def _auto_note(settings: dict, res) -> str:
    """``; auto: wush+rmean+ktiles+ldlq (tile clip 1.7), K2V2 Kkvarn/Vaffine clip1.7 64/196/128`` when ``auto`` is
    reported and its settings are recorded: what it ran at, which the run's own label does not say."""
    from .config import QuantConfig
    from .eval.compare import config_for
    from .eval.methods import AUTO, describe_resolved

    got = settings.get("auto")
    if AUTO not in res or not isinstance(got, dict) or "method" not in got or "quantization" not in got:
        return ""
    c = QuantConfig.from_dict(got["quantization"])
    return f"; auto: {describe_resolved(got['method'], c)}, {config_for(got['method'], c).label()}"


def _show_agreement(args, settings: dict, res: dict) -> None:
    from .config import QuantConfig
    from .report import format_table, plot_lines

    cfg = QuantConfig.from_dict(settings["quantization"])
    rows = [[_method_label(m, settings), r["prompts"], r["mean_kl"], 100 * r["top1"], r["median_first_divergence"], r["kl_first_quarter"], r["kl_last_quarter"],
             r["kl_growth"], r["kl_late_growth"]] for m, r in res.items()]
    print(format_table(["method", "prompts", "mean KL", "top-1 %", "median 1st div.", "KL 1st quarter", "KL last quarter", "last/first",
                        "4th/2nd"], rows,
                       title=f"\n{settings['model']}: prompts of {settings['prompt_len']} tokens from {settings['text']}, "
                             f"{settings['new_tokens']} generated, {cfg.label()}"
                             f"{' (single-pass emulation)' if settings['single_pass'] else ' (streaming)'}{_auto_note(settings, res)}"))
    if args.plot:
        n = settings["new_tokens"]
        width = max(1, n // 32)  # mean KL over bins of positions
        xs = list(range(0, n, width))
        series = {_method_label(m, settings): [sum(r["kl_by_position"][a : a + width]) / len(r["kl_by_position"][a : a + width]) for a in xs] for m, r in res.items()}
        plot_lines([x + width / 2 for x in xs], series, args.plot, "generated position", "KL(P_fp ‖ P_q), nats (mean over prompts)",
                   f"{settings['model']}: {cfg.label()}, teacher-forced", logy=True)


def cmd_agree(args) -> int:
    from .data import load_eval_text, tokenize_chunks
    from .eval.agreement import report, run_agreement
    from .io import write_json
    from .eval.methods import AUTO, is_transform_method

    from .eval.agreement import MIN_GROWTH_TOKENS

    methods = _methods(args.transforms, auto=True)
    if args.growth_reference and args.growth_reference not in methods:
        raise ValueError(f"--growth-reference {args.growth_reference!r} is not among the methods reported: {methods}")
    if args.growth_reference and not args.report_only and args.new_tokens < MIN_GROWTH_TOKENS:
        raise ValueError(f"--growth-reference compares quarters of the generation: needs --new-tokens >= {MIN_GROWTH_TOKENS}, "
                         f"got {args.new_tokens}")
    if args.report_only:
        if not args.json or not Path(args.json).is_file():
            raise ValueError(f"--report-only reads the results of an earlier run: --json {args.json!r} is not a file")
        saved = json.loads(Path(args.json).read_text())
        if not isinstance(saved, dict) or "state" not in saved or "settings" not in saved:
            raise ValueError(f"--json {args.json}: not a file `wushkv agree` wrote")
        if args.transforms == AGREE_METHODS:  # --transforms not given: every method the file holds
            methods = [m for m, r in saved["state"].get("rows", {}).items() if r] or methods
        res = report(saved["state"], methods)
        _show_agreement(args, saved["settings"], res)
        _late_growth(args, saved["settings"], saved["state"], res)
        return 0
    cfg = _quant_config(args)
    text, label = load_eval_text(args.text_file)
    model, tok = _load(args)
    cal = _calibration_for(args, model, tok, [m for m in methods if is_transform_method(m) or m == AUTO])
    resolved, auto_settings = _resolve_auto(args, methods, model, cal, cfg)
    chunks = tokenize_chunks(tok, text, args.prompt_len, args.prompts * args.stride)[:: args.stride]
    state, save, settings = resumable(args.json, {
        "model": args.model, "dtype": args.dtype, "text": label, "prompts": int(chunks.shape[0]), "prompt_len": args.prompt_len,
        "stride": args.stride, "prompt_sha256": hashlib.sha256(chunks.numpy().tobytes()).hexdigest(), "new_tokens": args.new_tokens,
        "single_pass": args.single_pass, "quantization": cfg.to_dict(), "calibration": _calibration_recipe(cal)} | auto_settings)
    res = run_agreement(model, chunks, methods, cal, cfg, args.new_tokens, single_pass=args.single_pass, batch=args.batch,
                        log=lambda m: print(m, file=sys.stderr), state=state, save=save, resolved=resolved)
    _show_agreement(args, settings, res)
    growth = _late_growth(args, settings, state, res)
    out = {"model": args.model, "text": label, "prompts": int(chunks.shape[0]), "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "single_pass": args.single_pass, "batch": args.batch, "quantization": cfg.to_dict(),
           "calibration": cal.meta if cal is not None else None, "results": res, "settings": settings, "state": state}
    if growth:
        out["late_growth"] = {"reference": args.growth_reference, "methods": growth}
    if args.json:
        write_json(args.json, out)
    return 0


def cmd_passkey(args) -> int:
    from math import exp, nan

    from .eval.passkey import run_passkey
    from .io import write_json
    from .report import format_table, plot_heatmaps
    from .eval.methods import AUTO, is_transform_method

    methods = _methods(args.transforms, auto=True)
    depths = [float(x) for x in args.depths.split(",")]
    cfg = _quant_config(args)
    model, tok = _load(args)
    cal = _calibration_for(args, model, tok, [m for m in methods if is_transform_method(m) or m == AUTO])
    resolved, auto_settings = _resolve_auto(args, methods, model, cal, cfg)
    state, save, settings = resumable(args.json, {
        "model": args.model, "dtype": args.dtype, "trials": args.trials, "seed": args.seed, "quantization": cfg.to_dict(),
        "calibration": _calibration_recipe(cal)} | auto_settings)
    res = run_passkey(model, tok, methods, cal, cfg, args.contexts, depths, args.trials, seed=args.seed,
                      log=lambda m: print(m, file=sys.stderr), state=state, save=save, resolved=resolved)
    label = lambda m: _method_label(m, settings)  # noqa: E731
    headers = ["method"] + [f"{c}" for c in args.contexts] + ["mean"]
    rows = [[label(m)] + [100 * sum(r["accuracy"].get(f"{c}/{d}", nan) for d in depths) / len(depths) for c in args.contexts] + [100 * r["mean"]]
            for m, r in res.items()]
    print(format_table(headers, rows, title=f"\n{args.model}: passkey accuracy (%) by context, mean over depths {depths}, "
                                             f"{args.trials} trials each, {cfg.label()}"))
    rows = [[label(m)] + [sum(r["logprob"].get(f"{c}/{d}", nan) for d in depths) / len(depths) for c in args.contexts] + [r["logprob_mean"]]
            for m, r in res.items()]
    print(format_table(headers, rows, title=f"\n{args.model}: mean log P(key) in nats (teacher-forced; 0 = certain), "
                                             "the same cases"))
    out = {"model": args.model, "contexts": args.contexts, "depths": depths, "trials": args.trials, "seed": args.seed,
           "quantization": cfg.to_dict(), "calibration": cal.meta if cal is not None else None, "results": res,
           "settings": settings, "state": state}
    if args.json:
        write_json(args.json, out)
    if args.plot:
        grids = {label(m): [[r["accuracy"].get(f"{c}/{d}", nan) for c in args.contexts] for d in depths] for m, r in res.items()}
        plot_heatmaps(grids, depths, args.contexts, args.plot, "context (tokens)", "depth",
                      f"{args.model}: passkey accuracy (%), {cfg.label()}")
        # the same cells as probabilities: exp(mean log P(key)), the geometric mean of P(key) over trials
        grids = {label(m): [[exp(r["logprob"].get(f"{c}/{d}", nan)) for c in args.contexts] for d in depths] for m, r in res.items()}
        plot_heatmaps(grids, depths, args.contexts, _sibling(args.plot, "_pkey"), "context (tokens)", "depth",
                      f"{args.model}: geometric-mean P(key) (%), {cfg.label()}", vmax=None)  # far below 1 even in full precision
    return 0


def cmd_export(args) -> int:
    from .calibration import Calibration
    from .export import export_transforms

    _check_transforms([args.transform], tiles=False)
    cal = Calibration.load(args.calibration)
    meta = export_transforms(cal, args.transform, args.out, dtype=args.dtype, tolerance=args.tolerance)
    print(f"{args.transform} transforms of {meta['model']} ({meta['num_layers']} layers) -> {args.out} in {args.dtype}, "
          f"row-vector convention; max |T·T⁻¹ − I| after the cast {meta['max_inverse_error']:.2e}")
    return 0


def cmd_sweep(args) -> int:
    from .report import format_table
    from .sweep import SweepConfig, run_sweep

    cfg = SweepConfig.load(args.config)
    out = run_sweep(cfg, ray_address=args.ray_address, max_jobs=args.max_jobs, log=lambda m: print(m, file=sys.stderr))
    rows = [[r["model"].split("/")[-1], r["transform"], r["quantizer"], f"K{r['k_bits'] or 16}V{r['v_bits'] or 16}",
             r["evaluation"], float("nan") if r["value"] is None else r["value"]] for r in out["results"]]
    print(format_table(["model", "transform", "quantizer", "bits", "evaluation", "value"], rows,
                       title=f"sweep: {out['finished']}/{out['total']} jobs finished ({len(out['ran'])} run now); {cfg.out}/results.{{json,md}}"))
    return 0


def cmd_lm_eval(args) -> int:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError as e:
        raise ValueError(f"`wushkv lm-eval` needs lm-evaluation-harness: pip install 'wushkv[lm-eval]' ({e})") from None
    from .io import write_json
    from .lm_eval import WushLM

    method = args.transform or "full-precision"
    cfg = _quant_config(args)
    lm = WushLM(args.model, method=method, calibration=args.calibration, k_bits=cfg.k_bits or 16, v_bits=cfg.v_bits or 16,
                quantizer=cfg.quantizer, k_clip=cfg.k_clip, v_clip=cfg.v_clip, k_alpha=cfg.k_alpha, v_alpha=cfg.v_alpha,
                clip_search=cfg.clip_search, group_size=cfg.group_size, tile_clip=cfg.tile_clip, key_quantizer=cfg.key_quantizer, sink=cfg.windows.S_sink, keep=cfg.windows.S_keep, flush=cfg.windows.S_flush,
                dtype=args.dtype, device=args.device, device_map=args.device_map, batch_size=args.batch_size)
    tm = TaskManager(include_path=args.include_path) if args.include_path else None
    res = lm_eval.simple_evaluate(model=lm, tasks=[t for t in args.tasks.split(",") if t], num_fewshot=args.num_fewshot,
                                  limit=args.limit, task_manager=tm)
    print(make_table(res))
    if args.json:
        write_json(args.json, {"method": method, "quantization": lm.quant_config.to_dict() if lm.quant_config else None,
                               "results": res["results"], "config": {k: str(v) for k, v in res.get("config", {}).items()}})
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import CLIP_GRID, GENERATION_WINDOWS, PERPLEXITY_WINDOWS
    from .transforms import TRANSFORMS

    transforms_help = ", ".join(TRANSFORMS) + " (each optionally with +tiles: KVarN's tile quantizer, +ktiles: keys in KVarN's tiles and values per token, and/or +ldlq: error-feedback rounding from the calibration's Hessians; KEYS:VALUES mixes two: wush:hadamard)"
    parser = argparse.ArgumentParser(prog="wushkv", description="WUSH-KV: low-bit KV caches with data-aware transforms.")
    parser.add_argument("--version", action="version", version=f"wushkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show the adapter's view of a model")
    p.add_argument("model", help="smollm2-135m | gemma3-270m | path | hub id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("ppl", help="perplexity over non-overlapping chunks (full precision, or through the quantized cache)")
    _add_model_args(p)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, help="number of chunks (default: all)")
    p.add_argument("--first-chunk", type=int, default=0, help="skip this many chunks of the text first (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="UTF-8 text to evaluate instead of WikiText-2 test")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("--transform", default=None, help=f"quantize the cache with this transform: {transforms_help}; omit for full precision")
    p.add_argument("--calibration", default=None, help="calibration file (needed by calibrated transforms)")
    p.add_argument("--clips", default=None, metavar="TABLE", help="QuEST clip multipliers for --transform from `wushkv tune-clip`")
    _add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("calibrate", help="collect statistics on calibration text and solve the transforms")
    _add_model_args(p)
    p.add_argument("--samples", type=int, default=32, help="calibration sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--calib-text-file", default=None, help="calibration text: UTF-8 file or C4-style .jsonl[.gz] (default: the C4 sample)")
    p.add_argument("--damping", type=float, default=0.01, help="γ: damping of H and M relative to their mean diagonal (default: %(default)s)")
    p.add_argument("--wush-a", action="store_true", help="also collect attention-aware Hessians (WUSH-A; cost grows as seq-len²: about 2.6× a plain calibration at 1024 tokens, 3.7× at 2048)")
    p.add_argument("--attention-weights", type=_windows_pair, default=None, metavar="SINK,KEEP",
                   help="also collect WUSH-W's Grams (transform wush-w): each key and value weighted by the squared attention it "
                        "receives while a cache with these windows holds it quantized, e.g. 16,128 (costs about one more "
                        "attention pass per layer)")
    p.add_argument("--skip-first", type=int, default=0, help="leave the first N positions of each sequence out of M_K/M_V (default: %(default)s)")
    p.add_argument("--skip-first-queries", type=int, default=0,
                   help="leave the queries at the first N positions out of the key Hessian H_K (queries before S_sink + S_keep "
                        "read no quantized key; default: %(default)s)")
    p.add_argument("--out", required=True, help="output .safetensors path (metadata also in PATH.json)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("recon", help="layer-wise module-output error per transform (the controlled experiment)")
    _add_model_args(p)
    p.add_argument("--calibration", required=True, help="calibration file from `wushkv calibrate`")
    p.add_argument("--bits", type=_bits_list, default=[2], help="bit widths, comma-separated; K and V at the same width (default: 2)")
    p.add_argument("--transforms", default="identity,hadamard,random,oscar,wush", help="comma-separated (default: %(default)s)")
    p.add_argument("--quantizer", default="quest", help="quest | affine (default: %(default)s)")
    p.add_argument("--samples", type=int, default=32, help="evaluation sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="evaluation text (default: WikiText-2 test, disjoint from the C4 calibration)")
    p.add_argument("--json", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="write a PNG of error per layer")
    p.set_defaults(func=cmd_recon)

    p = sub.add_parser("compare", help="perplexity of every transform at every bit width, side by side (the paper's Table 1)")
    _add_model_args(p)
    p.add_argument("--bits", type=_bits_list, default=[2, 3, 4], help="bit widths, comma-separated (default: 2,3,4)")
    p.add_argument("--transforms", default="identity,hadamard,random,oscar,kvarn,wush,auto",
                   help="comma-separated; 'auto' is the WUSH variant chosen on held-out C4 for the model, quantizer and width "
                        "(wushkv.eval.methods.AUTO_RECIPES) (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=16, help="evaluation chunks (default: %(default)s)")
    p.add_argument("--first-chunk", type=int, default=0,
                   help="skip this many chunks first: more text beyond the protocol's first 16, to narrow a tie's interval "
                        "(default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="UTF-8 text to evaluate instead of WikiText-2 test")
    p.add_argument("--calibration", default=None, help="calibration file; default: calibrate once and cache by model fingerprint")
    p.add_argument("--calib-samples", type=int, default=16, help="calibration sequences when calibrating (default: %(default)s)")
    p.add_argument("--calib-seq-len", type=int, default=2048, help="calibration sequence length (default: %(default)s)")
    p.add_argument("--json", default=None, help="write (and resume from) results JSON")
    p.add_argument("--plot", default=None, help="write a PNG of perplexity vs bits")
    p.add_argument("--markdown", default=None, help="write the table as Markdown")
    p.add_argument("--clips", default=None, metavar="TABLE",
                   help="QuEST clip multipliers per method and width from `wushkv tune-clip` (chosen on held-out text)")
    _add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("tune-clip", help="choose QuEST clip multipliers per method and width on held-out calibration-domain text")
    _add_model_args(p)
    p.add_argument("--transforms", default="identity,hadamard,random,oscar,wush", help="comma-separated (default: %(default)s)")
    p.add_argument("--bits", type=_bits_list, default=[2, 3, 4], help="bit widths, comma-separated (default: 2,3,4)")
    p.add_argument("--grid", default=",".join(f"{a:g}" for a in CLIP_GRID),
                   help="multipliers on α_b, walked downhill from 1 (default: %(default)s)")
    p.add_argument("--sides", default="keys,values", help="which clips to choose: keys, values or both (default: %(default)s)")
    p.add_argument("--rule", choices=["lower", "paired"], default="lower",
                   help="when to step to a neighbouring clip: lower = on any held-out gain; paired = only on a gain whose paired "
                        "95%% bootstrap interval over the held-out chunks lies below 0 (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="held-out chunks to choose on (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--text-file", default=None,
                   help="held-out UTF-8 text to choose on (default: C4 documents 1200..1999, which no calibration here reads; "
                        "never the evaluation text)")
    p.add_argument("--calibration", default=None, help="calibration file; default: calibrate once and cache")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=2048)
    p.add_argument("--out", required=True, help="the clip table (JSON; rewritten after every evaluation and resumed from)")
    p.add_argument("--plot", default=None, help="PNG of held-out perplexity against the key multiplier per method and width")
    _add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_tune_clip)

    p = sub.add_parser("demo", help="the main job on the default model, sized for ~10 minutes on 2 cores: calibrate and compare")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--transforms", default="identity,hadamard,oscar,kvarn,wush,auto",
                   help="comma-separated; auto: the WUSH variant chosen on held-out C4 for the model, quantizer and width (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=1, help="2048-token chunks (default: %(default)s; the full protocol is compare --chunks 16)")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--out", default="out/demo")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="stream generated text through the quantized cache")
    _add_model_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help=f"prompt text; repeat for a batch, generated together in one left-padded batch (default: {GENERATE_PROMPT!r})")
    p.add_argument("--prompt-file", action="append", default=None, help="read a prompt from a UTF-8 file (repeatable; before --prompt's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--transform", default="auto",
                   help="method, as for agree; 'auto': the WUSH variant chosen on held-out C4 for the model, quantizer and width "
                        "at K = V bits (affine, the default here: docs/GENERATION.md; QuEST: docs/RESULTS.md); elsewhere wush+rmean "
                        "(keys centered on their rotating mean) with the affine quantizer when the calibration holds the pre-RoPE key "
                        "mean, else wush (default: %(default)s)")
    p.add_argument("--calibration", default=None, help="calibration file; default: calibrate once and cache")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=2048)
    _add_quant_args(p, GENERATION_WINDOWS)
    p.set_defaults(func=cmd_generate, quantizer="affine")

    p = sub.add_parser("export", help="write solved transforms for a serving engine (row-vector convention, docs/FORMAT.md)")
    p.add_argument("--calibration", required=True, help="calibration file from `wushkv calibrate`")
    p.add_argument("--transform", default="wush", help="transform to export (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tolerance", type=float, default=None, help="largest |T·T⁻¹ − I| accepted after the cast (default: by dtype)")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("agree", help="long-generation agreement with full precision: KL and top-1 per position, first divergence")
    _add_model_args(p)
    p.add_argument("--transforms", default=AGREE_METHODS,
                   help="comma-separated transforms, stock-<quanto|hqq>-<2|4> for the stock QuantizedCache, and 'auto': what "
                        "`generate` runs by default, the WUSH variant chosen for the model, quantizer and width, at its own "
                        "settings (e.g. its tile clip); with --report-only and no --transforms, every method the file holds "
                        "(default: %(default)s)")
    p.add_argument("--calibration", default=None, help="calibration file; default: calibrate once and cache")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=16, help="prompts from the evaluation text (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--stride", type=int, default=4, help="take every N-th chunk of the text as a prompt (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=1024, help="generated tokens per prompt (default: %(default)s)")
    p.add_argument("--report-only", action="store_true",
                   help="print (and plot) what --json holds, running nothing: a partial run is reported over the prompts "
                        "every listed method has")
    p.add_argument("--batch", type=int, default=8,
                   help="prompts decoded together: on a CPU decoding is bound by reading the weights, so a batch costs little more "
                        "than one prompt; reference and streamed logits take 2 x batch x new tokens x vocabulary floats (Gemma-3, 1024 new tokens: 1 GB each per prompt; use --batch 2 on 24 GB) (default: %(default)s)")
    p.add_argument("--single-pass", action="store_true", help="teacher-force with the exact single-pass emulation instead of token-by-token streaming (same logits, much faster)")
    p.add_argument("--text-file", default=None, help="UTF-8 text to take prompts from instead of WikiText-2 test")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of KL against generated position")
    p.add_argument("--growth-reference", default=None, metavar="METHOD",
                   help="also print each method's KL growth from the 2nd to the 4th quarter against METHOD's (e.g. the best "
                        "baseline), with 95%% bootstrap intervals over the prompts")
    _add_quant_args(p, GENERATION_WINDOWS)
    p.set_defaults(func=cmd_agree, quantizer="affine")

    p = sub.add_parser("passkey", help="passkey retrieval accuracy per context and depth (full precision is the ceiling)")
    _add_model_args(p)
    p.add_argument("--transforms", default="full-precision,hadamard,kvarn,wush,auto", help="comma-separated methods, as for agree (default: %(default)s)")
    p.add_argument("--calibration", default=None)
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=2048)
    p.add_argument("--contexts", type=_context_list, default=[1024, 2048, 4096, 8192], help="prompt lengths, e.g. 1k,2k,4k,8k")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1] (default: %(default)s)")
    p.add_argument("--trials", type=int, default=10, help="prompts per (context, depth) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG heatmaps of accuracy; beside it, NAME_pkey.png: the geometric-mean probability of the key")
    _add_quant_args(p, GENERATION_WINDOWS)
    p.set_defaults(func=cmd_passkey, quantizer="affine")

    p = sub.add_parser("sweep", help="run a grid of (model, transform, bits, quantizer, evaluation) jobs, on Ray or in-process")
    p.add_argument("--config", required=True, help="sweep TOML file (docs/SWEEPS.md)")
    p.add_argument("--ray-address", default=None, help="'local' starts a local Ray instance, 'auto' joins a running cluster, or an address; omit to run in-process")
    p.add_argument("--max-jobs", type=int, default=None, help="run at most N unfinished jobs, then collect")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks through the quantized cache (extra: wushkv[lm-eval])")
    _add_model_args(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="folder of local task YAML files")
    p.add_argument("--transform", default=None, help=f"{transforms_help}; omit for full precision")
    p.add_argument("--calibration", default=None, help="calibration file (needed by calibrated transforms)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction)")
    p.add_argument("--batch-size", default="1")
    p.add_argument("--json", default=None)
    _add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_lm_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"wushkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
