"""Cost of WUSH-A's attention-aware statistics against a plain calibration, in the same process.

    python benchmarks/calib_cost.py --model smollm2-135m --samples 2 --seq-len 1024,2048 [--json out.json]

For each sequence length, the same C4 sequences are run through ``collect_statistics`` twice: plain
(M, H, OSCAR's statistics) and with ``wush_a=True`` (METHOD §3.1, O(S²) per sequence). The ratio is
what matters (absolute times drift on shared machines); the seconds per sequence tell how long a
``wushkv calibrate --wush-a`` of a given size takes on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from wushkv.calibration import calibration_sequences, collect_statistics  # noqa: E402
from wushkv.io import write_json  # noqa: E402
from wushkv.models import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seq-len", default="1024,2048", help="comma-separated sequence lengths")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model, tok = load(args.model)
    rows = []
    for L in (int(x) for x in args.seq_len.split(",")):
        seqs = calibration_sequences(tok, args.samples, L)
        collect_statistics(model, seqs[:1, :128], show_progress=False)  # warm-up
        t = {}
        for wush_a in (False, True):
            t0 = time.perf_counter()
            collect_statistics(model, seqs, wush_a=wush_a, show_progress=False)
            t[wush_a] = (time.perf_counter() - t0) / args.samples
        rows.append({"seq_len": L, "plain_s_per_seq": t[False], "wush_a_s_per_seq": t[True], "ratio": t[True] / t[False]})
        print(f"{L:>6} tokens: plain {t[False]:6.1f} s/seq, WUSH-A {t[True]:6.1f} s/seq: {t[True] / t[False]:.2f}× "
              f"({torch.get_num_threads()} threads)", flush=True)
    if args.json:
        write_json(args.json, {"model": args.model, "samples": args.samples, "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
