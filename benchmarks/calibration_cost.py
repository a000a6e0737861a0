"""Calibration cost relative to a plain forward pass over the same tokens (one run, ratios).

    python benchmarks/calibration_cost.py --model smollm2-135m --samples 4 --seq-len 2048 [--wush-a] [--json out.json]

Measures, on the same calibration sequences: (1) the plain forward passes (sdpa attention, no cache),
(2) wushkv's statistics collection (same forwards + streaming float64 statistics). Prints wall time
and peak RSS growth of each, and their ratios. (``wush_a_cost.py`` sets WUSH-A's statistics against plain ones.)
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import torch

from wushkv.calibration import calibration_sequences, collect_statistics
from wushkv.io import write_json
from wushkv.models import load


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--wush-a", action="store_true")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def run(args, model, seqs: torch.Tensor) -> dict:
    """Time the plain forwards and the statistics collection over ``seqs`` (N, seq_len) token ids; prints the lines
    and returns what ``--json`` holds (``time_ratio``: calibration over forward; ``memory_ratio``: peak growth)."""
    with torch.no_grad():
        model(seqs[:1, :64])  # warm-up
    gc.collect()

    # peak RSS is monotone within a process: measure the forward first, then calibration; the
    # calibration's extra peak is an upper bound on its true extra memory.
    base = peak_rss_mib()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(seqs.shape[0]):
            model(seqs[i : i + 1], use_cache=False)
    t_fwd = time.perf_counter() - t0
    peak_fwd = peak_rss_mib()

    t0 = time.perf_counter()
    collect_statistics(model, seqs, wush_a=args.wush_a, show_progress=False)
    t_cal = time.perf_counter() - t0
    peak_cal = peak_rss_mib()

    res = {
        "model": args.model, "samples": args.samples, "seq_len": args.seq_len, "wush_a": args.wush_a,
        "forward_seconds": t_fwd, "calibration_seconds": t_cal, "time_ratio": t_cal / t_fwd,
        "peak_rss_mib_after_forward": peak_fwd, "peak_rss_mib_after_calibration": peak_cal,
        "memory_ratio": (peak_cal - base + 1e-9) / max(peak_fwd - base, 1e-9) if peak_cal > peak_fwd else 1.0,
        "torch_threads": torch.get_num_threads(),
    }
    print(f"{args.model}: {args.samples} x {args.seq_len} tokens{' (WUSH-A)' if args.wush_a else ''}")
    print(f"  plain forward   {t_fwd:8.1f} s   peak RSS {peak_fwd:8.0f} MiB")
    print(f"  calibration     {t_cal:8.1f} s   peak RSS {peak_cal:8.0f} MiB")
    print(f"  ratio           {t_cal / t_fwd:8.2f} x time, peak RSS grew {peak_cal - peak_fwd:+.0f} MiB over the forward's peak")
    return res


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model, tok = load(args.model)
    res = run(args, model, calibration_sequences(tok, args.samples, args.seq_len))
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
