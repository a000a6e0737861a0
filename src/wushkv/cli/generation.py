"""``generate``, ``agree`` and ``passkey``: text generated through the quantized cache, its agreement with full
precision over long generations, and passkey retrieval."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..config import GENERATION_WINDOWS
from ..io import read_json
from ..runs import refuse_other_command
from .common import (add_calibration_args, add_model_args, add_quant_args, at_least, calibration, context_list, err,
                     load_model, quant_config, refuse_unread_by_auto, refuse_unread_settings)

GENERATE_PROMPT = "The history of the KV cache begins"
AGREE_METHODS = "identity,hadamard,random,oscar,kvarn,wush,auto"  # `agree`'s default --transforms


def cmd_generate(args) -> int:
    from ..data import read_text_file
    from ..eval.generation import cache_summary, generate
    from ..eval.prepare import check_transforms
    from ..methods.auto import resolve_auto
    from ..methods.spec import AUTO_NAME, canonical_name, method_config

    auto = args.transform == AUTO_NAME
    method = "wush" if auto else args.transform
    check_transforms([method])
    method = canonical_name(method)
    cfg = method_config(method, quant_config(args))
    refuse_unread_settings(args, [(args.transform, quant_config(args))])
    prompts = [read_text_file(f) for f in args.prompt_file or []] + list(args.prompt or [])  # before the model loads
    if not prompts:
        prompts = [GENERATE_PROMPT]
    if not all(p.strip() for p in prompts):
        raise ValueError("a prompt is empty: give each --prompt (or --prompt-file) some text to continue")
    model, tok = load_model(args)
    cal = calibration(args, model, tok, [method])
    if auto:
        r = resolve_auto(args.model, cal, cfg)
        refuse_unread_by_auto(args, [(cfg, (r.method, r.base))])
        method, cfg = r.method.name, r.config
        err(f"--transform auto: {r.describe()} ({r.why})")
    out, cache, enc = generate(model, tok, prompts, method, cfg, cal, args.max_new_tokens, device=args.device)
    if len(prompts) > 1:
        L = enc["input_ids"].shape[1]
        for i, (p, row) in enumerate(zip(prompts, out)):
            print(f"--- [{i}] {p}{tok.decode(row[L:], skip_special_tokens=True)}")
    err(cache_summary(cache, model, out, len(prompts), method, cfg, args.dtype))
    return 0


def _saved_agreement(path) -> dict:
    """``--report-only``: the run ``agree --json`` saved at ``path``."""
    if not path:
        raise ValueError("--report-only reads the results of an earlier run: give its file with --json")
    if not Path(path).is_file():
        raise ValueError(f"--report-only reads the results of an earlier run: --json {path!r} is not a file")
    saved = read_json(path, "--json")
    if not isinstance(saved, dict) or "state" not in saved or "settings" not in saved:
        raise ValueError(f"--json {path}: not a file `wushkv agree` wrote")
    refuse_other_command(saved, "agree", f"--json {path}")
    return saved


def _print_agreement(args, settings: dict, state: dict, res: dict) -> dict:
    """The table (and plot); with ``--growth-reference``, each method's late KL growth against it (returned)."""
    from ..eval.agreement import late_growth_by_method
    from ..eval.report import agreement_table, late_growth_report, plot_agreement

    print(agreement_table(settings, res))
    if args.plot:
        plot_agreement(settings, res, args.plot)
    if not args.growth_reference:
        return {}
    growth = late_growth_by_method(state, res, args.growth_reference)
    print(late_growth_report(settings, growth, args.growth_reference))
    return growth


def cmd_agree(args) -> int:
    from ..data import load_eval_text, tokenize_chunks
    from ..eval.agreement import MIN_GROWTH_TOKENS, report, run_agreement
    from ..eval.prepare import calibration_recipe_of, check_methods_list, resolve_auto
    from ..methods.spec import AUTO_NAME
    from ..io import write_json
    from ..runs import resumable

    methods = check_methods_list(args.transforms, auto=True)
    if args.growth_reference and args.growth_reference not in methods:
        raise ValueError(f"--growth-reference {args.growth_reference!r} is not among the methods reported: {methods}")
    if args.growth_reference and not args.report_only and args.new_tokens < MIN_GROWTH_TOKENS:
        raise ValueError(f"--growth-reference compares quarters of the generation: needs --new-tokens >= {MIN_GROWTH_TOKENS}, "
                         f"got {args.new_tokens}")
    if args.report_only:
        refuse_unread_settings(args, [], none_read="--report-only prints the saved run, at the settings it was run with")
        saved = _saved_agreement(args.json)
        if args.transforms == AGREE_METHODS:  # --transforms not given: every method the file holds
            methods = [m for m, r in saved["state"].get("rows", {}).items() if r] or methods
        _print_agreement(args, saved["settings"], saved["state"], report(saved["state"], methods))
        return 0
    cfg = quant_config(args)
    refuse_unread_settings(args, [(m, cfg) for m in methods])
    text, label = load_eval_text(args.text_file)
    model, tok = load_model(args, positions={"--prompt-len + --new-tokens": args.prompt_len + args.new_tokens})
    cal = calibration(args, model, tok, methods)
    resolved, auto_settings = resolve_auto(args.model, methods, model, cal, cfg, log=err)
    if AUTO_NAME in resolved:
        refuse_unread_by_auto(args, [(cfg, resolved[AUTO_NAME])], [(m, cfg) for m in methods if m != AUTO_NAME])
    chunks = tokenize_chunks(tok, text, args.prompt_len, args.prompts * args.stride)[:: args.stride]
    state, save, settings = resumable(args.json, {
        "model": args.model, "dtype": args.dtype, "text": label, "prompts": int(chunks.shape[0]), "prompt_len": args.prompt_len,
        "stride": args.stride, "prompt_sha256": hashlib.sha256(chunks.numpy().tobytes()).hexdigest(), "new_tokens": args.new_tokens,
        "single_pass": args.single_pass, "quantization": cfg.to_dict(), "calibration": calibration_recipe_of(cal)} | auto_settings, command="agree")
    res = run_agreement(model, chunks, methods, cal, cfg, args.new_tokens, single_pass=args.single_pass, batch=args.batch,
                        log=err, state=state, save=save, resolved=resolved)
    growth = _print_agreement(args, settings, state, res)
    out = {"command": "agree", "model": args.model, "text": label, "prompts": int(chunks.shape[0]), "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "single_pass": args.single_pass, "batch": args.batch, "quantization": cfg.to_dict(),
           "calibration": cal.meta if cal is not None else None, "results": res, "settings": settings, "state": state}
    if growth:
        out["late_growth"] = {"reference": args.growth_reference, "methods": growth}
    if args.json:
        write_json(args.json, out)
    return 0


def cmd_passkey(args) -> int:
    from ..eval.passkey import run_passkey
    from ..eval.prepare import calibration_recipe_of, check_methods_list, resolve_auto
    from ..methods.spec import AUTO_NAME
    from ..eval.report import passkey_tables, plot_passkey
    from ..io import write_json
    from ..runs import resumable

    methods = check_methods_list(args.transforms, auto=True)
    depths = [float(x) for x in args.depths.split(",")]
    cfg = quant_config(args)
    refuse_unread_settings(args, [(m, cfg) for m in methods])
    model, tok = load_model(args, positions={"--contexts": max(args.contexts)})
    cal = calibration(args, model, tok, methods)
    resolved, auto_settings = resolve_auto(args.model, methods, model, cal, cfg, log=err)
    if AUTO_NAME in resolved:
        refuse_unread_by_auto(args, [(cfg, resolved[AUTO_NAME])], [(m, cfg) for m in methods if m != AUTO_NAME])
    state, save, settings = resumable(args.json, {
        "model": args.model, "dtype": args.dtype, "trials": args.trials, "seed": args.seed, "quantization": cfg.to_dict(),
        "calibration": calibration_recipe_of(cal)} | auto_settings, command="passkey")
    res = run_passkey(model, tok, methods, cal, cfg, args.contexts, depths, args.trials, seed=args.seed,
                      log=err, state=state, save=save, resolved=resolved)
    print(passkey_tables(res, settings, args.model, args.contexts, depths, args.trials, cfg))
    out = {"command": "passkey", "model": args.model, "contexts": args.contexts, "depths": depths, "trials": args.trials, "seed": args.seed,
           "quantization": cfg.to_dict(), "calibration": cal.meta if cal is not None else None, "results": res,
           "settings": settings, "state": state}
    if args.json:
        write_json(args.json, out)
    if args.plot:
        plot_passkey(res, settings, args.model, args.contexts, depths, cfg, args.plot)
    return 0


def _passkey_outputs(args) -> list[str]:
    """The files ``passkey`` writes: ``--json``, ``--plot`` and the NAME_pkey.png beside the plot."""
    from ..eval.report import sibling

    return [f for f in (args.json, args.plot, args.plot and str(sibling(args.plot, "_pkey"))) if f]


def register(sub) -> None:
    p = sub.add_parser("generate", help="stream generated text through the quantized cache")
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help=f"prompt text; repeat for a batch, generated together in one left-padded batch (default: {GENERATE_PROMPT!r})")
    p.add_argument("--prompt-file", action="append", default=None, help="read a prompt from a UTF-8 file (repeatable; before --prompt's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--transform", default="auto",
                   help="method, as for agree; 'auto': the WUSH variant chosen per width by `wushkv select` (the calibration's selection, else "
                        "the recorded one of a shipped model) at K = V bits; elsewhere wush+rmean "
                        "(keys centered on their rotating mean) with the affine quantizer when the calibration holds the pre-RoPE key "
                        "mean, else wush (default: %(default)s)")
    add_calibration_args(p)
    add_quant_args(p, GENERATION_WINDOWS)
    p.set_defaults(func=cmd_generate, quantizer="affine")

    p = sub.add_parser("agree", help="long-generation agreement with full precision: KL and top-1 per position, first divergence")
    add_model_args(p)
    p.add_argument("--transforms", default=AGREE_METHODS,
                   help="comma-separated methods (docs/reference/methods.md), stock-<quanto|hqq>-<2|4> for the stock QuantizedCache, and 'auto': what "
                        "`generate` runs by default, the WUSH variant chosen for the model, quantizer and width, at its own "
                        "settings (e.g. its tile clip); with --report-only and no --transforms, every method the file holds "
                        "(default: %(default)s)")
    add_calibration_args(p)
    p.add_argument("--prompts", type=at_least(1), default=16, help="prompts from the evaluation text (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--stride", type=at_least(1), default=4, help="take every N-th chunk of the text as a prompt (default: %(default)s)")
    p.add_argument("--new-tokens", type=at_least(1), default=1024, help="generated tokens per prompt (default: %(default)s)")
    p.add_argument("--report-only", action="store_true",
                   help="print (and plot) what --json holds, running nothing: a partial run is reported over the prompts "
                        "every listed method has")
    p.add_argument("--batch", type=int, default=8,
                   help="prompts decoded together: on a CPU decoding is bound by reading the weights, so a batch costs little more "
                        "than one prompt; reference and streamed logits take 2 x batch x new tokens x vocabulary floats (Gemma-3, "
                        "1024 new tokens: 1 GB each per prompt; use --batch 2 on 24 GB) (default: %(default)s)")
    p.add_argument("--single-pass", action="store_true", help="teacher-force with the exact single-pass emulation instead of token-by-token streaming (same logits, much faster)")
    p.add_argument("--text-file", default=None, help="UTF-8 text to take prompts from instead of WikiText-2 test")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of KL against generated position")
    p.add_argument("--growth-reference", default=None, metavar="METHOD",
                   help="also print each method's KL growth from the 2nd to the 4th quarter against METHOD's (e.g. the best "
                        "baseline), with 95%% bootstrap intervals over the prompts")
    add_quant_args(p, GENERATION_WINDOWS)
    p.set_defaults(func=cmd_agree, quantizer="affine")

    p = sub.add_parser("passkey", help="passkey retrieval accuracy per context and depth (full precision is the ceiling)")
    add_model_args(p)
    p.add_argument("--transforms", default="full-precision,hadamard,kvarn,wush,auto", help="comma-separated methods, as for agree (default: %(default)s)")
    add_calibration_args(p, help=None)
    p.add_argument("--contexts", type=context_list, default=[1024, 2048, 4096, 8192], help="prompt lengths, e.g. 1k,2k,4k,8k")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1] (default: %(default)s)")
    p.add_argument("--trials", type=at_least(1), default=10, help="prompts per (context, depth) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG heatmaps of accuracy; beside it, NAME_pkey.png: the geometric-mean probability of the key")
    add_quant_args(p, GENERATION_WINDOWS)
    p.set_defaults(func=cmd_passkey, quantizer="affine", outputs=_passkey_outputs)
