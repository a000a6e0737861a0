"""``export-model``: a model folder a serving engine loads as a Hugging Face checkpoint, T_V folded into its weights,
the key transforms and the quantizer in a ``wushkv`` side file (docs/reference/formats.md, "Served model folder")."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..config import GENERATION_WINDOWS
from .common import (add_model_args, add_quant_args, bits, err, load_model, quant_config, refuse_unread_by_auto,
                     refuse_unread_settings)


def cmd_export_model(args) -> int:
    from ..calibration import Calibration
    from ..methods.auto import resolve_auto
    from ..methods.spec import AUTO, parse
    from ..serving import export_model

    sink_given = args.sink is not None
    if not sink_given:
        args.sink = GENERATION_WINDOWS.S_sink
    cfg = quant_config(args)
    if hasattr(args, "bits"):  # given (16 parses to None: full precision)
        cfg = replace(cfg, k_bits=args.bits, v_bits=args.bits)
    refuse_unread_settings(args, [(args.method, cfg)], set_here=_set_here(args, parse(args.method), cfg))
    model, tok = load_model(args)
    cal = Calibration.load(args.calibration, model=model) if args.calibration else None
    if not sink_given:
        cfg = _servable_sink(cfg, cal, args)
    if parse(args.method) is AUTO:  # the flags checked again against what auto stands for (as export_model resolves it)
        r = resolve_auto(args.model, cal, cfg)
        refuse_unread_by_auto(args, [(cfg, (r.method, r.base))], set_here=_set_here(args, r.method, r.base))
    meta = export_model(model, tok, args.out, method=args.method, cfg=cfg, calibration=cal, model_key=args.model, log=err)
    c = meta["checks"]
    choice = meta["choice"]
    if choice.get("requested") == "auto":
        from ..methods.auto import auto_calibration_note

        print(f"auto: {meta['method']} ({choice.get('why')})")
        if note := auto_calibration_note(args.model, cal, cfg):
            err(note)
    from ..config import QuantConfig
    from ..served_format import tile_sink_problem

    if (why := tile_sink_problem(QuantConfig.from_dict(meta["quantization"]))) is not None:
        err(f"note: {why}")
    q = meta["quantization"]
    w = q["windows"]
    print(f"{args.model} with {meta['method']}, K{q['k_bits'] or 16}V{q['v_bits'] or 16} {q['quantizer']}"
          f"{'/keys ' + q['key_quantizer'] if q['key_quantizer'] else ''} windows {w['S_sink']}/{w['S_keep']}/{w['S_flush']} -> {args.out}")
    print(f"checked: reloaded with transformers, logits {c['reload_vs_folded']:.2e} from the folded model, "
          f"{c['reload_vs_original']:.2e} from the original (relative to max |logit| {c['max_abs_logit']:.1f}; tolerances "
          f"{c['reload_tolerance']:g}, {c['original_tolerance']:g}); key transforms inverse to {meta['max_inverse_error']:.1e}")
    return 0


def _set_here(args, method, cfg) -> dict[str, str]:
    """The settings export-model sets itself, for ``method`` at ``cfg``: both widths where ``--bits`` is given, and
    the flush for per-token keys (an engine stores them as they come)."""
    from ..methods.spec import MethodSpec, method_config

    set_here = {"k_bits": "--bits sets both widths", "v_bits": "--bits sets both widths"} if hasattr(args, "bits") else {}
    if isinstance(method, MethodSpec) and not method_config(method, cfg).key_tiles:
        set_here["S_flush"] = ("a serving engine stores per-token keys as they come (it serves the windows "
                               f"{cfg.windows.S_sink}/{cfg.windows.S_keep}/1); --flush sizes key tiles (+ktiles, kvarn, kivi)")
    return set_here


def _servable_sink(cfg, cal, args):
    """``cfg`` with the default sink raised to whole key tiles where the method keeps keys in tiles (the vLLM plugin
    serves tiles only after a sink of whole tiles: :func:`wushkv.served_format.tile_sink_problem`), the recent window
    shortened by as much, so that as many tokens stay in full precision on average; ``cfg`` itself otherwise."""
    from ..serving import resolve_method
    from ..served_format import tile_sink_problem

    m, resolved, _ = resolve_method(args.method, cal, cfg, args.model)
    if tile_sink_problem(resolved) is None:
        return cfg
    w, tile = cfg.windows, resolved.windows.S_flush
    sink = tile * -(-w.S_sink // tile)
    keep = max(0, w.S_keep - (sink - w.S_sink))
    err(f"note: {m.name} keeps keys in {tile}-token tiles, which the vLLM plugin serves after a sink of whole tiles: sink "
        f"{w.S_sink} -> {sink}, recent window {w.S_keep} -> {keep} (as many full-precision tokens on average); --sink "
        "sets the sink")
    return replace(cfg, windows=replace(w, S_sink=sink, S_keep=keep))


def register(sub) -> None:
    p = sub.add_parser("export-model", help="write a model folder an engine loads as a HF checkpoint: T_V folded, key transforms "
                                           "and quantizer in a wushkv side file (docs/reference/formats.md)")
    add_model_args(p)
    p.add_argument("--calibration", default=None, help="calibration file of --model (needed by auto and calibrated methods; "
                                                       "one of another model is refused)")
    p.add_argument("--method", default="auto", help="auto (resolved for the model, quantizer and width, recorded with why) or a "
                                                    "wushkv method, e.g. wush, wush+rmean+ktiles+ldlq (default: %(default)s)")
    p.add_argument("--bits", type=bits, default=argparse.SUPPRESS, help="key and value bits at once (overrides --k-bits/--v-bits)")
    add_quant_args(p, GENERATION_WINDOWS)
    for action in p._actions:  # no --sink: the generation default, or whole key tiles where the method needs them
        if action.dest == "sink":
            action.default = None
            action.help = (f"S_sink full-precision first tokens (default: {GENERATION_WINDOWS.S_sink}; for a method with key "
                           "tiles, whole tiles, which the vLLM plugin needs, the recent window shortened by as much)")
    p.add_argument("--out", required=True, help="the folder to create (must not exist, or be empty)")
    p.set_defaults(func=cmd_export_model, quantizer="affine", folder_outputs=("out",))
