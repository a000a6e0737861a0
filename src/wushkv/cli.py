"""The ``wushkv`` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import __version__


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from .models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m | gemma3-270m | a .gguf file, model folder or hub id (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")


def _load(args):
    from .models import load

    t0 = time.perf_counter()
    model, tok = load(args.model, dtype=args.dtype, device=args.device)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model, tok


def cmd_info(args) -> int:
    from .models import describe, load

    model, _ = load(args.model, dtype="float32")
    spec = describe(model)
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


def cmd_ppl(args) -> int:
    from .data import load_eval_text, tokenize_chunks
    from .eval.perplexity import perplexity
    from .io import write_json

    text, label = load_eval_text(args.text_file)
    model, tok = _load(args)
    chunks = tokenize_chunks(tok, text, args.seq_len, args.chunks)
    res = perplexity(model, chunks, desc=f"ppl {args.model}")
    out = {
        "model": args.model,
        "text": label,
        "seq_len": args.seq_len,
        "chunks": res["chunks"],
        "tokens": res["tokens"],
        "ppl": res["ppl"],
        "seconds": res["seconds"],
        "quantization": None,
    }
    print(f"{args.model}  {label}  {res['chunks']} x {args.seq_len} tokens  PPL {res['ppl']:.3f}  ({res['seconds']:.1f}s)")
    if args.json:
        write_json(args.json, out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wushkv", description="WUSH-KV: low-bit KV caches with data-aware transforms.")
    parser.add_argument("--version", action="version", version=f"wushkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show the adapter's view of a model")
    p.add_argument("model", help="smollm2-135m | gemma3-270m | path | hub id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("ppl", help="perplexity over non-overlapping chunks")
    _add_model_args(p)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per chunk (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, help="number of chunks (default: all)")
    p.add_argument("--text-file", default=None, help="UTF-8 text to evaluate instead of WikiText-2 test")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.set_defaults(func=cmd_ppl)
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
