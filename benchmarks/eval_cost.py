"""Cost of perplexity that sees quantization: the single-pass emulation vs a full-precision forward.

    python benchmarks/eval_cost.py --model smollm2-135m --chunks 2 [--transform hadamard] [--seq-len 2048] [--json out.json]

Both run over the same chunks in the same process; the ratio is what matters (absolute times drift). The
full-precision forward runs before and after the emulation (a drift check) and the ratio is taken to the faster.
The emulation runs with its query blocks (the default, each block reading only the columns it needs) and, for
comparison, as one SDPA call over all 2S columns (``wushkv.attention.query_block(None)``; docs/reference/performance.md).
"""

from __future__ import annotations

import argparse

import torch

from wushkv.attention import query_block
from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig
from wushkv.data import tokenize_chunks, wikitext2_test
from wushkv.eval.compare import quantized_perplexity
from wushkv.eval.perplexity import perplexity
from wushkv.io import write_json
from wushkv.models import load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--transform", default="hadamard", help="a calibration-free transform (the cost does not depend on which)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def run(args, model, chunks: torch.Tensor, windows=PERPLEXITY_WINDOWS) -> dict:
    """Time the full-precision forward, the emulation, and the forward again over ``chunks`` (N, seq_len) token
    ids; prints the lines and returns what ``--json`` holds (``ratio``: emulation seconds over the faster forward)."""
    perplexity(model, chunks[:1, :128], show_progress=False)  # warm-up
    fp = perplexity(model, chunks, show_progress=False)
    cfg = QuantConfig(args.bits, args.bits, "quest", windows=windows)
    q = quantized_perplexity(model, chunks, None, args.transform, cfg, show_progress=False)
    with query_block(None):  # the same emulation as one SDPA call over all 2S columns
        q1 = quantized_perplexity(model, chunks, None, args.transform, cfg, show_progress=False)
    fp2 = perplexity(model, chunks, show_progress=False)  # again: drift check
    t_fp = min(fp["seconds"], fp2["seconds"])
    res = {"model": args.model, "chunks": args.chunks, "seq_len": args.seq_len, "transform": args.transform, "bits": args.bits,
           "fp_seconds": [fp["seconds"], fp2["seconds"]], "emulation_seconds": q["seconds"], "ratio": q["seconds"] / t_fp,
           "one_call_seconds": q1["seconds"], "one_call_ratio": q1["seconds"] / t_fp,
           "fp_ppl": fp["ppl"], "quantized_ppl": q["ppl"], "one_call_ppl": q1["ppl"]}
    print(f"{args.model}: {args.chunks} x {args.seq_len} tokens")
    print(f"  full-precision forward          {fp['seconds']:7.1f} s / {fp2['seconds']:7.1f} s (before / after)  PPL {fp['ppl']:.3f}")
    print(f"  emulation K{args.bits}V{args.bits}, query blocks     {q['seconds']:7.1f} s  {res['ratio']:5.2f} x         PPL {q['ppl']:.4f} ({args.transform})")
    print(f"  emulation K{args.bits}V{args.bits}, one SDPA call    {q1['seconds']:7.1f} s  {res['one_call_ratio']:5.2f} x         PPL {q1['ppl']:.4f}")
    return res


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, tok = load(args.model)
    chunks = tokenize_chunks(tok, wikitext2_test(), args.seq_len, args.chunks)
    res = run(args, model, chunks)
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
