"""``info``, ``calibrate``, ``export``, ``sweep`` and ``lm-eval``: a model's shape, the calibration and its export,
grids of jobs, and lm-evaluation-harness tasks."""

from __future__ import annotations

import json

from ..config import PERPLEXITY_WINDOWS
from .common import (add_model_args, add_quant_args, err, load_model, non_negative, quant_config,
                     refuse_overwriting_a_run, refuse_unread_settings, windows_pair)


def cmd_info(args) -> int:
    from ..models import describe, load_config

    spec = describe(load_config(args.model))  # reads the config only (GGUF metadata), no weights
    if args.json:
        print(json.dumps(spec.to_dict() | {"gqa_map": list(spec.gqa_map)}, indent=2))
        return 0
    print(f"model          {args.model}")
    print(f"family         {spec.family}")
    if spec.num_decoder_layers != spec.num_layers:  # a hybrid: the other decoder layers keep transformers' state
        others = sorted(set(spec.decoder_layer_types) - set(spec.layer_types))
        print(f"layers         {spec.num_layers} attention layers of {spec.num_decoder_layers} (the others: {', '.join(others)}, "
              f"not quantized): decoder layers {list(spec.attention_layers)}")
    else:
        print(f"layers         {spec.num_layers}")
    print(f"query heads    {spec.num_heads}")
    print(f"KV heads       {spec.num_kv_heads}  (group of {spec.group_size} query heads per KV head)")
    print(f"head_dim       {spec.head_dim}")
    print(f"hidden size    {spec.hidden_size}")
    print(f"q/k norm       {('yes, over the ' + spec.k_norm_scope) if spec.qk_norm else 'no'}")
    if spec.fused_qkv:
        print(f"projections    fused q/k/v ({spec.proj_names[0]})")
    if spec.attention_sinks:
        print("sink logits    learned, per query head (constant key/value centering refused)")
    if spec.attn_logit_softcap:
        print(f"logit softcap  {spec.attn_logit_softcap} (constant key centering refused)")
    if spec.nope_layers:
        print(f"no RoPE        attention layers {list(spec.nope_layers)}")
    gqa = ", ".join(f"q{g}->kv{h}" for g, h in enumerate(spec.gqa_map))
    print(f"GQA map        {gqa}")
    n_sw = len(spec.sliding_layers)
    print(f"sliding window {n_sw} of {spec.num_layers} layers" + (f" (window {spec.sliding_window}): {list(spec.sliding_layers)}" if n_sw else ""))
    types = "".join("S" if t == "sliding_attention" else "F" for t in spec.layer_types)
    print(f"layer types    {types}  (F full, S sliding)")
    return 0


def cmd_calibrate(args) -> int:
    from ..calibration import calibrate

    if args.samples < 1:
        raise ValueError(f"--samples {args.samples}: expected at least 1 calibration sequence")
    held = _selections_in(args.out)
    if held:
        raise ValueError(f"--out {args.out} holds {held} selection(s) `wushkv select` made for auto, which a new calibration "
                         "would drop: give another --out, or delete the file first")
    model, tok = load_model(args, positions={"--seq-len": args.seq_len})
    cal = calibrate(model, tok, samples=args.samples, seq_len=args.seq_len, text_file=args.calib_text_file,
                    damping=args.damping, wush_a=args.wush_a, skip_first=args.skip_first,
                    skip_first_queries=args.skip_first_queries, attention_weights=args.attention_weights)
    path = cal.save(args.out)
    print(f"calibration of {args.model}: {cal.meta['samples']} x {cal.meta['seq_len']} tokens, transforms {sorted(cal.solved)}, "
          f"{cal.meta['seconds']:.1f}s -> {path} (+ {path}.json)")
    return 0


def _selections_in(path: str) -> int:
    """How many selections a calibration file at ``path`` holds (its header alone is read); 0 for none, no file, or a
    file that is not one (it is replaced as before)."""
    import json
    from pathlib import Path

    if not Path(path).is_file():
        return 0
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            held = json.loads((f.metadata() or {}).get("selections", "[]"))
    except Exception:  # noqa: BLE001 - not a calibration: nothing to keep
        return 0
    return len(held) if isinstance(held, list) else 0


def cmd_export(args) -> int:
    from ..calibration import Calibration
    from ..eval.prepare import check_transforms
    from ..export import export_transforms

    check_transforms([args.transform], tiles=False)
    cal = Calibration.load(args.calibration)
    meta = export_transforms(cal, args.transform, args.out, dtype=args.dtype, tolerance=args.tolerance)
    print(f"{args.transform} transforms of {meta['model']} ({meta['num_layers']} layers) -> {args.out} in {args.dtype}, "
          f"row-vector convention; max |T·T⁻¹ − I| after the cast {meta['max_inverse_error']:.2e}")
    return 0


def cmd_sweep(args) -> int:
    from ..eval.report import sweep_table
    from ..io import exclusive_output, remove_temporaries, remove_temporaries_in
    from ..sweep import SweepConfig, run_sweep

    cfg = SweepConfig.load(args.config)
    # one sweep per folder; holding it, the temporaries in the folders the sweep owns are a killed run's leftovers
    with exclusive_output(cfg.out / "results.json"):
        for folder in (cfg.out / "jobs", cfg.out / "calibrations"):
            remove_temporaries_in(folder)
        remove_temporaries(cfg.out / "results.md")
        out = run_sweep(cfg, ray_address=args.ray_address, max_jobs=args.max_jobs, log=err)
    print(sweep_table(out, cfg.out))
    return 0


def cmd_lm_eval(args) -> int:
    refuse_overwriting_a_run(args.json)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError as e:
        raise ValueError(f"`wushkv lm-eval` needs lm-evaluation-harness: pip install 'wushkv[lm-eval]' ({e})") from None
    from ..io import write_json
    from ..lm_eval import WushLM

    method = args.transform or "full-precision"
    cfg = quant_config(args)
    if args.transform:
        refuse_unread_settings(args, [(method, cfg)])
    else:
        refuse_unread_settings(args, [], none_read="a quantizer flag without --transform: lm-eval runs full precision "
                                                   "without one; add --transform METHOD (identity: the quantizer alone)")
    lm = WushLM(args.model, method=method, calibration=args.calibration, k_bits=cfg.k_bits or 16, v_bits=cfg.v_bits or 16,
                quantizer=cfg.quantizer, k_clip=cfg.k_clip, v_clip=cfg.v_clip, k_alpha=cfg.k_alpha, v_alpha=cfg.v_alpha,
                clip_search=cfg.clip_search, group_size=cfg.group_size, tile_clip=cfg.tile_clip, key_quantizer=cfg.key_quantizer,
                metadata_dtype=cfg.metadata_dtype,
                sink=cfg.windows.S_sink, keep=cfg.windows.S_keep, flush=cfg.windows.S_flush,
                dtype=args.dtype, device=args.device, device_map=args.device_map, batch_size=args.batch_size)
    tm = TaskManager(include_path=args.include_path) if args.include_path else None
    res = lm_eval.simple_evaluate(model=lm, tasks=[t for t in args.tasks.split(",") if t], num_fewshot=args.num_fewshot,
                                  limit=args.limit, task_manager=tm)
    print(make_table(res))
    if args.json:
        write_json(args.json, {"method": method, "quantization": lm.quant_config.to_dict() if lm.quant_config else None,
                               "results": res["results"], "config": {k: str(v) for k, v in res.get("config", {}).items()}})
    return 0


def transforms_help() -> str:
    """The method grammar in one line, for the ``--transform`` of ``ppl`` and ``lm-eval``: generated where the grammar is
    defined (:func:`wushkv.methods.spec.grammar_help`), so it cannot drift."""
    from ..methods.spec import grammar_help

    return grammar_help()


def register(sub) -> None:
    p = sub.add_parser("info", help="show the adapter's view of a model")
    p.add_argument("model", help="smollm2-135m | gemma3-270m | path | hub id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("calibrate", help="collect statistics on calibration text and solve the transforms")
    add_model_args(p)
    p.add_argument("--samples", type=int, default=32, help="calibration sequences (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=2048,
                   help="tokens per sequence (default: %(default)s); serving longer contexts, calibrate at that length or run "
                        "`wushkv select --serve-len N`, which also tries the statistics covered to N positions")
    p.add_argument("--calib-text-file", default=None, help="calibration text: UTF-8 file or C4-style .jsonl[.gz] (default: the C4 sample)")
    p.add_argument("--damping", type=float, default=0.01, help="γ: damping of H and M relative to their mean diagonal (default: %(default)s)")
    p.add_argument("--wush-a", action="store_true", help="also collect attention-aware Hessians (WUSH-A; cost grows as seq-len²: about 2.6× a plain calibration at 1024 tokens, 3.7× at 2048)")
    p.add_argument("--attention-weights", type=windows_pair, default=None, metavar="SINK,KEEP",
                   help="also collect WUSH-W's Grams (transform wush-w): each key and value weighted by the squared attention it "
                        "receives while a cache with these windows holds it quantized, e.g. 16,128 (costs about one more "
                        "attention pass per layer)")
    p.add_argument("--skip-first", type=int, default=0, help="leave the first N positions of each sequence out of M_K/M_V (default: %(default)s)")
    p.add_argument("--skip-first-queries", type=int, default=0,
                   help="leave the queries at the first N positions out of the key Hessian H_K (queries before S_sink + S_keep "
                        "read no quantized key; default: %(default)s)")
    p.add_argument("--out", required=True, help="output .safetensors path (metadata also in PATH.json)")
    p.set_defaults(func=cmd_calibrate, outputs=lambda a: [a.out, a.out + ".json"])  # Calibration.save writes both

    p = sub.add_parser("export", help="write solved transforms for a serving engine (row-vector convention, docs/reference/formats.md)")
    p.add_argument("--calibration", required=True, help="calibration file from `wushkv calibrate`")
    p.add_argument("--transform", default="wush", help="transform to export (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tolerance", type=non_negative, default=None, help="largest |T·T⁻¹ − I| accepted after the cast (default: by dtype)")
    p.add_argument("--out", required=True, help="output .safetensors")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("sweep", help="run a grid of (model, transform, bits, quantizer, evaluation) jobs, on Ray or in-process")
    p.add_argument("--config", required=True, help="sweep TOML file (docs/reference/integrations.md)")
    p.add_argument("--ray-address", default=None, help="'local' starts a local Ray instance, 'auto' joins a running cluster, or an address; omit to run in-process")
    p.add_argument("--max-jobs", type=int, default=None, help="run at most N unfinished jobs, then collect")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks through the quantized cache (extra: wushkv[lm-eval])")
    add_model_args(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="folder of local task YAML files")
    p.add_argument("--transform", default=None, help=f"{transforms_help()}; omit for full precision")
    p.add_argument("--calibration", default=None, help="calibration file (needed by calibrated transforms)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction)")
    p.add_argument("--batch-size", default="1")
    p.add_argument("--json", default=None)
    add_quant_args(p, PERPLEXITY_WINDOWS)
    p.set_defaults(func=cmd_lm_eval)
