"""Cost of `wushkv select`: one held-out chunk through every default candidate at every width, against a
full-precision forward of the same chunk, and what the default selection therefore costs.

    python benchmarks/selection_cost.py --model smollm2-135m --calibration smollm2.safetensors [--bits 2,3,4] [--json out.json]

The selection's cost is (chunks) x (1 full-precision pass + one pass per candidate and width), plus what a recipe's
first evaluation builds once (the error-feedback matrices; timed on a short warm-up per candidate and width); each
pass's time is a ratio to the full-precision pass of the same run (absolute times drift on a shared machine). The
printed estimate is the default selection's wall time at this run's speed: 4 chunks, the default candidates, the
widths asked for. Each pass does what the selection's does: full precision keeps its next-token distributions (a
``Reference``), and every quantized pass measures its KL to them beside its NLL.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig
from wushkv.eval.compare import quantized_perplexity
from wushkv.eval.perplexity import REFERENCE_TOP, perplexity
from wushkv.eval.select import DEFAULT_CANDIDATES
from wushkv.io import write_json
from wushkv.methods.auto import parse_recipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--candidates", default=",".join(DEFAULT_CANDIDATES))
    ap.add_argument("--chunks", type=int, default=4, help="the selection's chunks the estimate is for (one is timed)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def run(args, model, calibration, chunk: torch.Tensor, windows=PERPLEXITY_WINDOWS) -> dict:
    """Time full precision, then every (candidate, width), then full precision again, on ``chunk`` (1, seq_len)."""
    perplexity(model, chunk[:, :128], show_progress=False)  # warm-up
    fp_run = perplexity(model, chunk, show_progress=False, keep_reference=REFERENCE_TOP)
    fp, reference = fp_run["seconds"], fp_run["reference"]
    rows = []
    for b in (int(x) for x in args.bits.split(",")):
        for name in args.candidates.split(","):
            r = parse_recipe(name)
            cfg = r.method.quant_config(r.base(replace(QuantConfig(windows=windows), k_bits=b, v_bits=b)))
            # a recipe's first evaluation builds what the selection builds once (the feedback matrices): a short
            # warm-up pays it, counted once in the estimate, not once per chunk
            w = cfg.windows
            short = chunk[:, : min(chunk.shape[1], w.S_sink + w.S_keep + w.S_flush + 16)]  # a few tokens quantized
            once = quantized_perplexity(model, short, calibration, r.method, cfg, show_progress=False)["seconds"]
            t = quantized_perplexity(model, chunk, calibration, r.method, cfg, show_progress=False, reference=reference)["seconds"]
            rows.append({"recipe": r.name, "bits": b, "seconds": t, "warm_up_seconds": once})
    fp2 = perplexity(model, chunk, show_progress=False, keep_reference=REFERENCE_TOP)["seconds"]
    t_fp = min(fp, fp2)
    for row in rows:
        row["ratio"] = row["seconds"] / t_fp
    per_chunk = t_fp + sum(r["seconds"] for r in rows)
    once = sum(r["warm_up_seconds"] for r in rows)
    res = {"model": args.model, "seq_len": int(chunk.shape[1]), "fp_seconds": [fp, fp2], "rows": rows,
           "seconds_per_chunk": per_chunk, "warm_up_seconds": once,
           "estimated_selection_seconds": per_chunk * args.chunks + once, "chunks": args.chunks}
    for row in rows:
        print(f"{row['recipe']:>28} {row['bits']}-bit  {row['seconds']:7.2f}s  {row['ratio']:5.2f}x full precision  "
              f"(first evaluation's warm-up {row['warm_up_seconds']:.1f}s)")
    print(f"full precision {t_fp:.2f}s per chunk (drift {max(fp, fp2) / t_fp:.2f}x); default selection over {args.chunks} chunks: "
          f"{res['estimated_selection_seconds'] / 60:.1f} min ({len(rows)} evaluations + full precision per chunk, "
          f"{per_chunk / t_fp:.1f}x one full-precision pass, plus {once:.0f}s of warm-ups once)")
    return res


def main(argv: list[str] | None = None) -> int:
    from wushkv.calibration import Calibration
    from wushkv.data import heldout_c4_text, tokenize_chunks
    from wushkv.models import load

    args = parse_args(argv)
    model, tok = load(args.model)
    cal = Calibration.load(args.calibration, model)
    text, _ = heldout_c4_text()
    res = run(args, model, cal, tokenize_chunks(tok, text, args.seq_len, 1))
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
