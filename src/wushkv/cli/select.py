"""``select``: choose ``auto``'s recipe per width on held-out text and write the choice into the calibration file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import PERPLEXITY_WINDOWS
from .common import (add_model_args, add_quant_args, bits_list, bits_set_by, err, load_model, names, quant_config,
                     refuse_unread_settings)


def default_runs_path(calibration: str, settings_key: str) -> str:
    """Where a selection keeps its evaluations by default: beside the calibration, named by what they depend on."""
    return f"{calibration}.select-{settings_key}.json"


def check_agreement_args(args) -> None:
    """Refuse agreement-gate settings out of range before anything loads (whether or not the gate is asked for:
    a bad value given is a mistake either way)."""
    import math

    from ..eval.select import AGREEMENT_GATE

    for flag, v, least in (("--agreement-prompts", args.agreement_prompts, 1), ("--agreement-prompt-len", args.agreement_prompt_len, 2),
                           ("--agreement-new-tokens", args.agreement_new_tokens, 1)):
        if v < least:
            default = AGREEMENT_GATE[flag.removeprefix("--agreement-").replace("-", "_")]
            raise ValueError(f"{flag} {v}: give a whole number >= {least} (default {default})")
    if not (math.isfinite(args.agreement_margin) and 0 <= args.agreement_margin <= 100):
        raise ValueError(f"--agreement-margin {args.agreement_margin:g}: percentage points of top-1 agreement a candidate may lose "
                         f"against the paper recipe, a number from 0 to 100 (default {AGREEMENT_GATE['margin']:g})")


def cmd_select(args) -> int:
    from ..calibration import Calibration
    from ..data import heldout_c4_text, read_text_file, tokenize_chunks, wikitext2_test
    from ..eval.prepare import check_heldout_calibration, load_calibration
    from ..eval.select import (GATES, AgreementGate, PasskeyGate, agreement_prompts, plot_selection, run_selection, selection_record,
                               selection_report)
    from ..io import exclusive_output
    from ..methods.auto import parse_recipe, selection_setting
    from ..runs import settings_key

    candidates = names(args.candidates)
    if not candidates:
        raise ValueError("--candidates is empty: give comma-separated recipes such as wush,wush+ldlq,wush+ktiles+ldlq@tc=1.7")
    for c in candidates:
        parse_recipe(c)  # every recipe is checked before anything loads
    gates = names(args.gates) if args.gates else []
    for g in gates:
        if g not in GATES:
            raise ValueError(f"--gates {g!r}: known gates are {', '.join(GATES)}")
    if len(set(gates)) != len(gates):
        raise ValueError(f"--gates {args.gates!r} lists a gate twice: give each once")
    check_agreement_args(args)
    if args.budget is not None and not (0 < args.budget < float("inf")):
        raise ValueError(f"--budget {args.budget:g}: bits per element (keys and values, metadata included), a positive number such as 2.5")
    base = quant_config(args, k_bits=2, v_bits=2)
    recipes = [parse_recipe(c) for c in ["wush", *candidates]]  # the paper recipe is always evaluated
    refuse_unread_settings(args, [(r.method, r.base(replace(base, k_bits=b, v_bits=b))) for r in recipes for b in args.bits],
                           set_here=bits_set_by("select"))
    if not Path(args.calibration).is_file():
        raise FileNotFoundError(f"--calibration {args.calibration} does not exist; make one with `wushkv calibrate --out {args.calibration}`")
    out_path = args.out or args.calibration
    if args.text_file:
        text, label = read_text_file(args.text_file), str(args.text_file)
        try:
            if text.strip() and text.strip() in wikitext2_test().strip():
                raise ValueError(f"--text-file {args.text_file} is (part of) WikiText-2 test, the evaluation text: choose on held-out "
                                 "text of the calibration's domain (default: C4 documents no calibration reads)")
        except FileNotFoundError:  # no WikiText-2 here: nothing to compare with
            pass
    else:
        text, label = heldout_c4_text()
    positions = {"--serve-len": args.serve_len}
    if "agreement" in gates:
        positions["--agreement-prompt-len + --agreement-new-tokens"] = args.agreement_prompt_len + args.agreement_new_tokens
    model, tok = load_model(args, positions=positions)
    cal = load_calibration(args.calibration, model)
    if not args.text_file:
        check_heldout_calibration(cal)
    chunks = tokenize_chunks(tok, text, args.serve_len, args.chunks)
    if chunks.shape[0] < args.chunks:
        err(f"note: the held-out text gives {chunks.shape[0]} chunks of {args.serve_len} tokens, fewer than --chunks {args.chunks}")
    runs = args.json or default_runs_path(args.calibration, settings_key([selection_setting(base), args.serve_len, int(chunks.shape[0]),
                                                                          label, args.dtype]))
    meta = {"model": args.model, "dtype": args.dtype, "text": label, "candidates": candidates, "bits": args.bits}
    gate_objs = []
    for g in gates:
        if g == "passkey":
            gate_objs.append(PasskeyGate(model, tok, cal))
        elif g == "agreement":  # its prompts: the held-out text right after the chunks the selection scores
            prompts = agreement_prompts(tok, text, chunks.numel(), args.agreement_prompts, args.agreement_prompt_len)
            gate_objs.append(AgreementGate(model, cal, prompts, new_tokens=args.agreement_new_tokens, margin=args.agreement_margin,
                                           log=err))
    err(f"select: {len(candidates)} candidates x {len(args.bits)} widths on {label}, {chunks.shape[0]} x {args.serve_len} tokens; "
        f"evaluations kept in {runs}")
    # cli.main locks the files named by flags (--json, --out, --plot); the defaults are locked here: the evaluations
    # file beside the calibration, and the calibration itself when the selection is written into it in place
    with exclusive_output(runs if args.json is None else None), exclusive_output(args.calibration if args.out is None else None):
        out = run_selection(model, chunks, cal, candidates, args.bits, base, rule=args.rule, budget=args.budget, gates=gate_objs,
                            json_path=runs, meta=meta, refine=args.refine, cover=args.cover, metric=args.metric, log=err)
        print(selection_report(out, candidates, args.bits, args.model, label))
        if args.plot:
            plot_selection(out, candidates, args.bits, args.plot, args.model, label)
        record = selection_record(out, label)
        if not args.dry_run:
            fresh = Calibration.load(args.calibration, model)  # the file as it is now, not as it was read before the run
            fresh.set_selection(record)
            fresh.save(out_path)
            print(f"\nwrote the selection for {len(record['choices'])} width(s) into {out_path}: `auto` now runs "
                  + ", ".join(f"{b}-bit {c['recipe']}" for b, c in record["choices"].items()))
    return 0


def register(sub) -> None:
    from ..eval.select import AGREEMENT_GATE, COVER_MODES, DEFAULT_CANDIDATES, DEFAULT_METRIC, GATES, METRICS, PASSKEY_GATE, RULES
    from ..methods.auto import RECIPE_OPTIONS

    p = sub.add_parser(
        "select", help="choose auto's recipe per width on held-out text and write it into the calibration file",
        description="Evaluate candidate recipes on held-out text of the calibration's domain (never the evaluation text), "
                    "compare them paired over the chunks, pick one per width by --rule, and write the choice into the "
                    "calibration file, where `auto` reads it. Resumable: every evaluation is kept in --json. "
                    "docs/reference/selection.md explains the procedure, its defaults and its cost.")
    add_model_args(p)
    p.add_argument("--calibration", required=True, help="the calibration file (from `wushkv calibrate`) to choose for")
    p.add_argument("--out", default=None, help="write the calibration with its selection here (default: rewrite --calibration in place, "
                                               "atomically; its statistics are unchanged)")
    p.add_argument("--bits", type=bits_list, default=[2, 3, 4], help="widths to choose for, K = V (default: 2,3,4)")
    p.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES),
                   help="comma-separated recipes, simplest first: a method with options "
                        + ", ".join(f"@{k}=X ({d})" for k, (_, d) in RECIPE_OPTIONS.items())
                        + "; the paper recipe wush is always evaluated (default: %(default)s)")
    p.add_argument("--rule", choices=RULES, default="lowest",
                   help="lowest: the lowest mean of --metric; simplest: the first listed candidate, displaced by a later one only "
                        "where that one is lower on every chunk (default: %(default)s)")
    p.add_argument("--metric", choices=METRICS, default=DEFAULT_METRIC,
                   help="what the rule compares: kl, the mean KL from full precision's next-token distributions (the damage "
                        "alone, which separates recipes the NLL's chance ties); nll, the held-out NLL, what perplexity reports. "
                        "Both are measured, so a resumed run with the other chooses again for free (default: %(default)s)")
    p.add_argument("--budget", type=float, default=None, metavar="BITS",
                   help="exclude candidates storing more than BITS bits per element in the quantized middle (keys and values, "
                        "metadata included)")
    p.add_argument("--gates", default="", help=f"comma-separated checks a pick must also pass, on their own prompts: {', '.join(GATES)} "
                                               f"(passkey: {PASSKEY_GATE['trials']} trials at depths "
                                               f"{','.join(map(str, PASSKEY_GATE['depths']))} of {PASSKEY_GATE['contexts'][0]} tokens, "
                                               "no lower accuracy than full precision; agreement: long greedy generations "
                                               "from held-out prompts, teacher-forced top-1 agreement with full precision no more "
                                               "than --agreement-margin points below the paper recipe's)")
    p.add_argument("--agreement-prompts", type=int, default=AGREEMENT_GATE["prompts"],
                   help="the agreement gate's prompts, held-out text past the scored chunks, decoded as one batch (default: %(default)s)")
    p.add_argument("--agreement-prompt-len", type=int, default=AGREEMENT_GATE["prompt_len"],
                   help="tokens per agreement-gate prompt (default: %(default)s)")
    p.add_argument("--agreement-new-tokens", type=int, default=AGREEMENT_GATE["new_tokens"],
                   help="greedy tokens full precision generates after each prompt, which every candidate then reads back through "
                        "its quantized cache (default: %(default)s)")
    p.add_argument("--agreement-margin", type=float, default=AGREEMENT_GATE["margin"], metavar="POINTS",
                   help="a candidate passes the agreement gate when its top-1 agreement with full precision is at most POINTS "
                        "percentage points below the paper recipe's at the same width (default: %(default)s)")
    p.add_argument("--refine", action="store_true",
                   help="also walk each width's pick's clips downhill (the tile clip or QuEST key clip, then the value clip) and "
                        "choose among what the walk visited too: a few evaluations more per width")
    p.add_argument("--serve-len", type=int, default=2048, help="the context length you will serve: held-out chunks of this many tokens "
                                                               "(default: %(default)s)")
    p.add_argument("--cover", choices=COVER_MODES, default="auto",
                   help="auto: where --serve-len is longer than the calibration's sequences, also evaluate each candidate on "
                        "statistics covered to --serve-len positions (+coverN), so that the choice includes the statistics "
                        "(twice the evaluations); no: the file's statistics only (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=4, help="held-out chunks (default: %(default)s)")
    p.add_argument("--text-file", default=None, help="held-out UTF-8 text of the calibration's domain (default: C4 documents 1200..1999, "
                                                     "which no calibration here reads; never the evaluation text)")
    p.add_argument("--json", default=None, help="keep (and resume) every evaluation here (default: beside the calibration, named by "
                                                "the settings)")
    p.add_argument("--plot", default=None, help="PNG of held-out perplexity increase against bits per candidate")
    p.add_argument("--dry-run", action="store_true", help="report the choice without writing it into the calibration")
    add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_select)
