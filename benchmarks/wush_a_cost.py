"""Cost of WUSH-A's attention-aware statistics against a plain calibration, in the same process.

    python benchmarks/wush_a_cost.py --model smollm2-135m --samples 2 --seq-len 1024,2048 [--json out.json]

For each sequence length, the same C4 sequences are run through ``collect_statistics`` twice: plain
(M, H, OSCAR's statistics) and with ``wush_a=True`` (attention-aware Hessians, O(S²) per sequence). The ratio is
what matters (absolute times drift on shared machines); the seconds per sequence tell how long a
``wushkv calibrate --wush-a`` of a given size takes on this machine. (``calibration_cost.py`` sets a calibration
against plain forward passes.)
"""

from __future__ import annotations

import argparse
import time

import torch

from wushkv.calibration import calibration_sequences, collect_statistics
from wushkv.io import write_json
from wushkv.models import load


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seq-len", default="1024,2048", help="comma-separated sequence lengths")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def run(args, model, sequences) -> dict:
    """``sequences(samples, seq_len)`` -> (samples, seq_len) token ids. Times both collections at every
    ``--seq-len``, prints a line each and returns what ``--json`` holds (``rows``: one per length, with ``ratio``)."""
    rows = []
    for L in (int(x) for x in args.seq_len.split(",")):
        seqs = sequences(args.samples, L)
        collect_statistics(model, seqs[:1, :128], show_progress=False)  # warm-up
        t = {}
        for wush_a in (False, True):
            t0 = time.perf_counter()
            collect_statistics(model, seqs, wush_a=wush_a, show_progress=False)
            t[wush_a] = (time.perf_counter() - t0) / args.samples
        rows.append({"seq_len": L, "plain_s_per_seq": t[False], "wush_a_s_per_seq": t[True], "ratio": t[True] / t[False]})
        print(f"{L:>6} tokens: plain {t[False]:6.1f} s/seq, WUSH-A {t[True]:6.1f} s/seq: {t[True] / t[False]:.2f}× "
              f"({torch.get_num_threads()} threads)", flush=True)
    return {"model": args.model, "samples": args.samples, "threads": torch.get_num_threads(), "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, tok = load(args.model)
    res = run(args, model, lambda n, L: calibration_sequences(tok, n, L))
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
