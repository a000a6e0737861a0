"""``ppl``, ``recon``, ``compare``, ``tune-clip`` and ``demo``: perplexity and reconstruction error of the methods."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import CLIP_GRID, PERPLEXITY_WINDOWS
from .common import (add_calibration_args, add_model_args, add_quant_args, bits_list, bits_set_by, calibration, err,
                     load_model, names, quant_config, refuse_overwriting_a_run, refuse_unread_by_auto,
                     refuse_unread_settings)


def refuse_short_sequences(seq_len: int, transforms, base) -> None:
    """Before the model loads: sequences in which a method's windows would never quantize a token are refused
    (:func:`wushkv.eval.compare.check_quantizes`; ``auto`` is asked when it is resolved)."""
    from ..eval.compare import check_quantizes
    from ..methods.spec import MethodSpec, parse

    for t in transforms:
        if isinstance(m := parse(t), MethodSpec):
            check_quantizes(seq_len, m.quant_config(base))


def cmd_ppl(args) -> int:
    from ..data import load_eval_text, tokenize_chunks
    from ..eval.clips import ClipTable
    from ..eval.compare import quantized_perplexity
    from ..eval.perplexity import perplexity
    from ..eval.prepare import check_clips, check_transforms, load_calibration
    from ..io import write_json
    from ..methods.spec import method_config

    refuse_overwriting_a_run(args.json)
    cfg = quant_config(args) if args.transform else None
    if args.transform:
        check_transforms([args.transform])
        base, cfg = cfg, method_config(args.transform, cfg)  # which refuses a method the quantizer cannot run, first
        refuse_unread_settings(args, [(args.transform, base)])
        refuse_short_sequences(args.seq_len, [args.transform], base)
    else:
        refuse_unread_settings(args, [], none_read="a quantizer flag without --transform: ppl measures full precision "
                                                   "without one; add --transform METHOD (identity: the quantizer alone)")
    clips = check_clips(args.clips, cfg)
    text, label = load_eval_text(args.text_file)
    model, tok = load_model(args, positions={"--seq-len": args.seq_len})
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks, first=args.first_chunk)
    if cfg is None:
        res = perplexity(model, chunks, desc=f"ppl {args.model}")
    else:
        cal = load_calibration(args.calibration, model)
        if clips is not None:
            clips = ClipTable.load(args.clips, model)
            cfg = clips.apply(args.transform, cfg)
        res = quantized_perplexity(model, chunks, cal, args.transform, cfg, desc=f"ppl {args.transform} {cfg.label()}")
    what = "full precision" if cfg is None else f"{args.transform} {cfg.label()}"
    print(f"{args.model}  {label}  {res['chunks']} x {args.seq_len} tokens  {what}  PPL {res['ppl']:.3f}  ({res['seconds']:.1f}s)")
    if args.json:
        write_json(args.json, {
            "model": args.model, "text": label, "seq_len": args.seq_len, "first_chunk": args.first_chunk, "chunks": res["chunks"],
            "tokens": res["tokens"], "ppl": res["ppl"], "seconds": res["seconds"], "transform": args.transform,
            "calibration": args.calibration, "quantization": cfg.to_dict() if cfg else None,
            "clips": clips.describe() if clips is not None else None})
    return 0


def cmd_recon(args) -> int:
    from ..config import QuantConfig
    from ..data import load_eval_text, tokenize_chunks
    from ..eval.prepare import check_recon_transforms, load_calibration
    from ..methods.install import transforms_for
    from ..eval.reconstruction import layer_reconstruction
    from ..eval.report import plot_recon, recon_tables
    from ..io import write_json

    refuse_overwriting_a_run(args.json)
    transforms = names(args.transforms)
    check_recon_transforms(transforms)
    cfgs = [QuantConfig(k_bits=b, v_bits=b, quantizer=args.quantizer) for b in args.bits]
    text, label = load_eval_text(args.text_file)
    model, tok = load_model(args, positions={"--seq-len": args.seq_len})
    cal = load_calibration(args.calibration, model)
    trs = {n: transforms_for(model, cal, n) for n in transforms}
    seqs = tokenize_chunks(tok, text, args.seq_len, args.samples)
    results = dict(zip(args.bits, layer_reconstruction(model, seqs, trs, cfgs)))
    print(recon_tables(results, transforms[0], args.model, args.quantizer, seqs.shape, label))
    first = args.bits[0]
    if args.json:
        write_json(args.json, {"model": args.model, "bits": first, "quantizer": args.quantizer, "text": label, "samples": int(seqs.shape[0]),
                               "seq_len": int(seqs.shape[1]), "calibration": args.calibration, "transforms": results[first],
                               "by_bits": {str(b): r for b, r in results.items()}})
    if args.plot:
        plot_recon(results[first], args.plot, args.model, first, args.quantizer)
    return 0


def cmd_compare(args) -> int:
    from ..data import load_eval_text, tokenize_chunks
    from ..eval.clips import ClipTable
    from ..eval.compare import run_compare
    from ..eval.prepare import check_clips, check_transforms
    from ..eval.report import compare_markdown, compare_report, plot_compare
    from ..io import atomic_write, write_json
    from ..methods.auto import auto_calibration_note, resolve_auto
    from ..methods.spec import AUTO_NAME as AUTO
    from ..methods.spec import canonical_name, method_config

    transforms = names(args.transforms)
    if not transforms:
        raise ValueError(f"no methods in --transforms {args.transforms!r}; give comma-separated method names such as hadamard,wush")
    check_transforms(transforms, auto=True)
    transforms = [canonical_name(t) for t in transforms]  # results are keyed by the canonical name
    twice = [t for i, t in enumerate(transforms) if t in transforms[:i]]
    if twice:
        raise ValueError(f"--transforms names {twice[0]} twice ({args.transforms!r}); give each method once")
    base = quant_config(args, k_bits=2, v_bits=2)
    for b in args.bits:
        replace(base, k_bits=b, v_bits=b)  # validates the widths before anything long runs
    for t in transforms:
        method_config(t, base)  # and each method against the quantizer
    refuse_unread_settings(args, [(t, replace(base, k_bits=b, v_bits=b)) for t in transforms for b in args.bits],
                           set_here=bits_set_by("compare"))
    refuse_short_sequences(args.seq_len, transforms, base)
    clips = check_clips(args.clips, base)
    text, label = load_eval_text(args.text_file)
    model, tok = load_model(args, positions={"--seq-len": args.seq_len})
    clips = ClipTable.load(args.clips, model) if clips else None
    cal = calibration(args, model, tok, transforms)
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks, first=args.first_chunk)
    if AUTO in transforms:
        if note := auto_calibration_note(args.model, cal, base):
            err(note)
        # what auto stands for at each width (as run_compare resolves it): the flags checked again against those
        widths = [method_config(AUTO, replace(base, k_bits=b, v_bits=b)) for b in args.bits]
        autos = [(cfg, ((r := resolve_auto(args.model, cal, cfg)).method, r.base)) for cfg in widths]
        refuse_unread_by_auto(args, autos, [(t, replace(base, k_bits=b, v_bits=b)) for t in transforms if t != AUTO
                                            for b in args.bits], set_here=bits_set_by("compare"))
    meta = {"model": args.model, "dtype": args.dtype, "text": label, "transforms": transforms, "bits": args.bits}
    if args.first_chunk:
        meta["first_chunk"] = args.first_chunk
        label = f"{label}, chunks from {args.first_chunk}"
    out = run_compare(model, tok, chunks, cal, transforms, args.bits, base, json_path=args.json, meta=meta, log=err, clips=clips)
    print(compare_report(out, transforms, args.bits, args.model, label, args.quantizer, base.windows,
                         clips=args.clips if clips is not None else None))
    if args.markdown:
        md = compare_markdown(out, transforms, args.bits)
        atomic_write(args.markdown, lambda tmp: Path(tmp).write_text(md, encoding="utf-8"))
    if args.plot:
        plot_compare(out, transforms, args.bits, args.plot, args.model, args.quantizer)
    if args.json:
        write_json(args.json, out)
    return 0


def _grid(s: str) -> list[float]:
    """``--grid``: positive multipliers on α_b, including 1."""
    try:
        grid = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--grid {s!r}: comma-separated multipliers on α_b, e.g. 0.85,1,1.15,1.3") from None
    if not grid or any(not (0 < a < float("inf")) for a in grid) or 1.0 not in grid:
        raise ValueError(f"--grid {s!r}: positive multipliers including 1 (α_b itself)")
    return grid


def cmd_tune_clip(args) -> int:
    from ..data import heldout_c4_text, read_text_file, tokenize_chunks
    from ..eval.clips import check_tunable, tune_clips
    from ..eval.prepare import check_heldout_calibration, check_transforms
    from ..eval.report import clip_report, plot_clip_curves

    from ..methods.spec import canonical_name

    transforms = names(args.transforms)
    check_transforms(transforms)
    transforms = [canonical_name(t) for t in transforms]  # the table is keyed by the canonical name, as compare looks it up
    base = quant_config(args, k_bits=2, v_bits=2)
    sides = names(args.sides)
    check_tunable(transforms, base, sides)
    searched = "tune-clip searches QuEST's clip multipliers itself, from α_b over --grid"
    refuse_unread_settings(args, [(t, replace(base, k_bits=b, v_bits=b)) for t in transforms for b in args.bits],
                           set_here=bits_set_by("tune-clip") | {"k_alpha": searched, "v_alpha": searched})
    refuse_short_sequences(args.seq_len, transforms, base)
    grid = _grid(args.grid)
    text, label = (read_text_file(args.text_file), str(args.text_file)) if args.text_file else heldout_c4_text()
    model, tok = load_model(args, positions={"--seq-len": args.seq_len})
    cal = calibration(args, model, tok, transforms)
    if not args.text_file:
        check_heldout_calibration(cal)
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks)
    table = tune_clips(model, chunks, cal, transforms, args.bits, base, grid, sides, path=args.out, text_label=label, log=err, rule=args.rule)
    print(clip_report(table, transforms, args.bits, args.model, label, args.out))
    if args.plot:
        plot_clip_curves(table, transforms, args.bits, args.plot, args.model, label)
    return 0


def cmd_demo(args) -> int:
    """The main job on the default model: calibrate (cached) and compare every transform."""
    from . import main

    argv = ["compare", "--model", args.model, "--bits", args.bits, "--transforms", args.transforms, "--chunks", str(args.chunks),
            "--calib-samples", str(args.calib_samples), "--json", f"{args.out}/compare.json", "--plot", f"{args.out}/compare.png",
            "--markdown", f"{args.out}/compare.md"]
    err(f"wushkv demo: wushkv {' '.join(argv)}")
    return main(argv)


def register(sub) -> None:
    from .misc import transforms_help

    p = sub.add_parser("ppl", help="perplexity over non-overlapping chunks (full precision, or through the quantized cache)")
    add_model_args(p)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, help="number of chunks (default: all)")
    p.add_argument("--first-chunk", type=int, default=0, help="skip this many chunks of the text first (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="UTF-8 text to evaluate instead of WikiText-2 test")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("--transform", default=None, help=f"quantize the cache with this transform: {transforms_help()}; omit for full precision")
    p.add_argument("--calibration", default=None, help="calibration file (needed by calibrated transforms)")
    p.add_argument("--clips", default=None, metavar="TABLE", help="QuEST clip multipliers for --transform from `wushkv tune-clip`")
    add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("recon", help="layer-wise module-output error per transform (the controlled experiment)")
    add_model_args(p)
    p.add_argument("--calibration", required=True, help="calibration file from `wushkv calibrate`")
    p.add_argument("--bits", type=bits_list, default=[2], help="bit widths, comma-separated; K and V at the same width (default: 2)")
    p.add_argument("--transforms", default="identity,hadamard,random,oscar,wush", help="comma-separated (default: %(default)s)")
    p.add_argument("--quantizer", default="quest", help="quest | affine (default: %(default)s)")
    p.add_argument("--samples", type=int, default=32, help="evaluation sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="evaluation text (default: WikiText-2 test, disjoint from the C4 calibration)")
    p.add_argument("--json", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="write a PNG of error per layer")
    p.set_defaults(func=cmd_recon)

    p = sub.add_parser("compare", help="perplexity of every transform at every bit width, side by side (the paper's Table 1)")
    add_model_args(p)
    p.add_argument("--bits", type=bits_list, default=[2, 3, 4], help="bit widths, comma-separated (default: 2,3,4)")
    p.add_argument("--transforms", default="identity,hadamard,random,oscar,kvarn,wush,auto",
                   help="comma-separated; 'auto' is the WUSH variant chosen per width by `wushkv select` (the calibration's selection, "
                        "else the recorded one of a shipped model, else the paper recipe) (default: %(default)s)")
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
    add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("tune-clip", help="choose QuEST clip multipliers per method and width on held-out calibration-domain text")
    add_model_args(p)
    p.add_argument("--transforms", default="identity,hadamard,random,oscar,wush", help="comma-separated (default: %(default)s)")
    p.add_argument("--bits", type=bits_list, default=[2, 3, 4], help="bit widths, comma-separated (default: 2,3,4)")
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
    add_calibration_args(p)
    p.add_argument("--out", required=True, help="the clip table (JSON; rewritten after every evaluation and resumed from)")
    p.add_argument("--plot", default=None, help="PNG of held-out perplexity against the key multiplier per method and width")
    add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_tune_clip)

    p = sub.add_parser("demo", help="the main job on the default model, sized for ~10 minutes on 2 cores: calibrate and compare")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--transforms", default="identity,hadamard,oscar,kvarn,wush,auto",
                   help="comma-separated; auto: the WUSH variant chosen per width by `wushkv select` (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=1, help="2048-token chunks (default: %(default)s; the full protocol is compare --chunks 16)")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--out", default="out/demo")
    p.set_defaults(func=cmd_demo, outputs=lambda a: [])  # --out is a folder: the compare it runs locks its files
