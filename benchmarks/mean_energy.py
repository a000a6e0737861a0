"""Share of key and value energy carried by their mean, per (layer, KV head): n‖μ‖² / Σ‖x‖².

    python benchmarks/mean_energy.py --model smollm2-135m --samples 2

A large share means most of each cached vector is one offset shared by all tokens (see
docs/ABLATIONS.md, section 3). Statistics come from the first ``--samples`` C4 calibration sequences.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from wushkv.calibration import calibration_sequences, collect_statistics  # noqa: E402
from wushkv.models import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    model, tok = load(args.model)
    stats = collect_statistics(model, calibration_sequences(tok, args.samples, args.seq_len), show_progress=True)
    keys, values = [], []
    for l, s in enumerate(stats):
        n = float(s["n_K"])
        fk = (n * s["mu_K"].pow(2).sum(-1) / s["M_K"].diagonal(dim1=-2, dim2=-1).sum(-1)).tolist()
        fv = (n * s["mu_V"].pow(2).sum(-1) / s["M_V"].diagonal(dim1=-2, dim2=-1).sum(-1)).tolist()
        keys += fk
        values += fv
        print(f"layer {l:2d}  keys {' '.join(f'{x:.3f}' for x in fk)}   values {' '.join(f'{x:.3f}' for x in fv)}")
    for name, xs in (("keys", keys), ("values", values)):
        print(f"{name}: min {min(xs):.3f}  median {statistics.median(xs):.3f}  max {max(xs):.3f}")


if __name__ == "__main__":
    main()
