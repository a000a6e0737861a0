"""Add the pre-RoPE key mean (``mu_K_pre``, needed by the ``+rmean`` methods) to a calibration file made
before it was collected, keeping its statistics and solved transforms (so WUSH stays the same solution,
signs included), and write it to a new file atomically.

    python benchmarks/add_rope_mean.py --calibration out/smollm2-c32.safetensors --seqs 4 --out out/smollm2-c32-rmean.safetensors

The mean comes from the first ``--seqs`` calibration sequences (C4 by default, or ``--text-file``), of the
file's own sequence length.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from wushkv.calibration import Calibration, calibration_sequences, pre_rope_key_mean  # noqa: E402
from wushkv.models import load  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seqs", type=int, default=4, help="calibration sequences to average over (default 4)")
    p.add_argument("--text-file", default=None, help="UTF-8 text instead of C4")
    args = p.parse_args(argv)
    if Path(args.out).resolve() == Path(args.calibration).resolve():
        raise SystemExit("--out must differ from --calibration (the original is kept)")
    model, tok = load(Calibration.load(args.calibration).meta["model"])
    cal = Calibration.load(args.calibration, model=model)
    seq_len = int(cal.meta["seq_len"])
    with torch.no_grad():
        mus = pre_rope_key_mean(model, calibration_sequences(tok, args.seqs, seq_len, text_file=args.text_file))
    for st, mu in zip(cal.stats, mus):
        st["mu_K_pre"] = mu
    cal.meta["mu_K_pre"] = {"sequences": args.seqs, "seq_len": seq_len, "text_file": args.text_file}
    print(f"wrote {cal.save(args.out)}")


if __name__ == "__main__":
    main()
