"""A calibration whose key-space statistics mix the file as it is with the file covered to a served length
(issue #34, item 4; docs/lab/calibration-length.md): M = (1 − a)·M_as_is + a·M_covered for every key-space statistic
(:data:`wushkv.calibration.KEY_SPACE_MATRICES`, :data:`~wushkv.calibration.KEY_SPACE_VECTORS`), the transforms solved
again from them. ``a`` = 1 is ``wushkv calibration cover``; covering is a uniform average over offsets
s ∈ [0, N − L], so the mixture puts a point mass (1 − a) back at the offset the calibration was read at.

    python experiments/mix_covered.py --calibration smollm2-L1024.safetensors --serve-len 4096 --weight 0.5 \\
        --out smollm2-L1024-mix50-4096.safetensors
"""

from __future__ import annotations

import argparse

from wushkv.calibration import KEY_SPACE_MATRICES, KEY_SPACE_VECTORS, Calibration, cover_positions
from wushkv.models import describe, load, rope_parameters


def mix(cal: Calibration, covered: Calibration, a: float) -> Calibration:
    """``cal``'s statistics with each key-space one replaced by (1 − a)·as is + a·covered (float64)."""
    stats = []
    for st, cv in zip(cal.stats, covered.stats):
        new = dict(st)
        for k in (*KEY_SPACE_MATRICES, *KEY_SPACE_VECTORS):
            if k in st:
                new[k] = (1 - a) * st[k].double() + a * cv[k].double()
        stats.append(new)
    meta = dict(covered.meta) | {"covered_weight": a}
    return Calibration(meta, stats, {}, list(cal.selections))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", required=True)
    p.add_argument("--serve-len", type=int, required=True)
    p.add_argument("--weight", type=float, default=0.5, help="a, the covered statistics' share (default: %(default)s)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not 0.0 <= args.weight <= 1.0:
        raise SystemExit(f"--weight {args.weight}: a share in [0, 1]")
    model, _ = load(Calibration.load(args.calibration).meta["model"])
    cal = Calibration.load(args.calibration, model=model)
    spec = describe(model)
    covered = cover_positions(cal, [rope_parameters(model, l, spec) for l in range(spec.num_layers)], args.serve_len)
    print(f"wrote {mix(cal, covered, args.weight).save(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
