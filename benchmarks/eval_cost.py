"""Cost of perplexity that sees quantization: the single-pass emulation vs a full-precision forward.

    python benchmarks/eval_cost.py --model smollm2-135m --chunks 2 [--transform hadamard] [--seq-len 2048] [--json out.json]

Both run over the same chunks in the same process; the ratio is what matters (absolute times drift).
The emulation runs twice: with its query blocks (the default, each block reading only the columns
it needs) and as one SDPA call over all 2S columns (how it ran before), to show what the blocks save.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv import attention  # noqa: E402
from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig  # noqa: E402
from wushkv.data import tokenize_chunks, wikitext2_test  # noqa: E402
from wushkv.eval.compare import quantized_perplexity  # noqa: E402
from wushkv.eval.perplexity import perplexity  # noqa: E402
from wushkv.models import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--transform", default="hadamard", help="a calibration-free transform (the cost does not depend on which)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, tok = load(args.model)
    chunks = tokenize_chunks(tok, wikitext2_test(), args.seq_len, args.chunks)
    perplexity(model, chunks[:1, :128], show_progress=False)  # warm-up
    fp = perplexity(model, chunks, show_progress=False)
    cfg = QuantConfig(args.bits, args.bits, "quest", windows=PERPLEXITY_WINDOWS)
    q = quantized_perplexity(model, chunks, None, args.transform, cfg, show_progress=False)
    block, attention.QUERY_BLOCK = attention.QUERY_BLOCK, None  # one SDPA call over all 2S columns
    try:
        q1 = quantized_perplexity(model, chunks, None, args.transform, cfg, show_progress=False)
    finally:
        attention.QUERY_BLOCK = block
    fp2 = perplexity(model, chunks, show_progress=False)  # again: drift check
    t_fp = min(fp["seconds"], fp2["seconds"])
    res = {"model": args.model, "chunks": args.chunks, "seq_len": args.seq_len, "transform": args.transform, "bits": args.bits,
           "fp_seconds": [fp["seconds"], fp2["seconds"]], "emulation_seconds": q["seconds"], "ratio": q["seconds"] / t_fp,
           "one_call_seconds": q1["seconds"], "one_call_ratio": q1["seconds"] / t_fp, "query_block": block,
           "fp_ppl": fp["ppl"], "quantized_ppl": q["ppl"], "one_call_ppl": q1["ppl"]}
    print(f"{args.model}: {args.chunks} x {args.seq_len} tokens")
    print(f"  full-precision forward          {fp['seconds']:7.1f} s / {fp2['seconds']:7.1f} s (before / after)  PPL {fp['ppl']:.3f}")
    print(f"  emulation K{args.bits}V{args.bits}, query blocks     {q['seconds']:7.1f} s  {res['ratio']:5.2f} x         PPL {q['ppl']:.4f} ({args.transform})")
    print(f"  emulation K{args.bits}V{args.bits}, one SDPA call    {q1['seconds']:7.1f} s  {res['one_call_ratio']:5.2f} x         PPL {q1['ppl']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
