"""What error-feedback rounding (``+ldlq``) costs when the cache flushes: the fused CPU kernel against the
PyTorch reference loop and against plain QuEST rounding of the same block, measured in the same run; and for
key tiles (``+ktiles+ldlq``), KVarN's key-tile quantizer with feedback along the channels against without, and
against its PyTorch reference loop (``fused=False``; the default runs the compiled kernels on CPU).

    python benchmarks/feedback_speed.py [--threads 1] [--repeats 50]

Shapes: one flush of 8 tokens (generation windows 64/256/8) for SmolLM2 (3 KV heads × 64) and Gemma-3
(1 KV head × 256), and one 2048-token chunk of the single-pass emulation (perplexity). Key tiles: one flush of a
128-token tile per layer, and a 2048-token chunk.
"""

from __future__ import annotations

import argparse
import time

import torch


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


FLUSH_SHAPES = ((1, 3, 8, 64), (1, 1, 8, 256), (1, 3, 2048, 64), (1, 1, 2048, 256))
TILE_SHAPES = ((1, 3, 128, 64), (1, 1, 128, 256), (1, 3, 2048, 64), (1, 1, 2048, 256))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    return ap.parse_args(argv)


def run(repeats: int, flush_shapes=FLUSH_SHAPES, tile_shapes=TILE_SHAPES) -> dict:
    """Time every shape (B, H, N, d); prints the two tables and returns {"flush": [...], "tiles": [...]}, one dict
    of median milliseconds and ratios per shape (``fused``/``fused_over_plain``/``loop_over_fused`` NaN without
    the fused kernel)."""
    from wushkv._ext import kernels
    from wushkv.quantizers import QuestQuantizer
    from wushkv.quantizers.feedback import feedback_matrix, feedback_round

    fused_ok = kernels() is not None
    print(f"threads {torch.get_num_threads()}; fused kernel {'available' if fused_ok else 'UNAVAILABLE (loop only)'}")
    print(f"{'shape (B, H, N, d)':22s} {'plain QuEST':>12s} {'loop':>10s} {'fused':>10s} {'fused/plain':>12s} {'loop/fused':>11s}")
    g = torch.Generator().manual_seed(0)
    out = {"fused_kernel": fused_ok, "flush": [], "tiles": []}
    for shape in flush_shapes:
        _, H, _, d = shape
        x = torch.randn(*shape, generator=g)
        A = torch.randn(H, d, d, generator=g, dtype=torch.float64)
        F = feedback_matrix(A @ A.mT / d + torch.eye(d, dtype=torch.float64))
        quant = QuestQuantizer(2)
        q = quant.quantize(x)
        def run_plain(x=x, quant=quant):
            quant.quantize(x)

        def run_loop(x=x, q=q, d=d, F=F):
            feedback_round(x, q.scale, q.offset, 2, d, F, fused=False)

        def run_fused(x=x, q=q, d=d, F=F, quant=quant):  # what a flush does: the grid, then the codes
            quant.quantize(x)
            feedback_round(x, q.scale, q.offset, 2, d, F)

        plain = median_ms(run_plain, repeats)
        loop = median_ms(run_loop, max(3, repeats // 10))
        fused = median_ms(run_fused, repeats) if fused_ok else float("nan")
        out["flush"].append({"shape": shape, "plain_ms": plain, "loop_ms": loop, "fused_ms": fused,
                             "fused_over_plain": fused / plain, "loop_over_fused": loop / fused})
        print(f"{str(shape):22s} {plain:10.3f}ms {loop:8.3f}ms {fused:8.3f}ms {fused / plain:11.1f}x {loop / fused:10.1f}x", flush=True)

    from wushkv.quantizers.kvarn import kvarn_quantize

    print(f"\nkey tiles (KVarN, 2 bits, tile clip 1.7; fused kernels {'on' if fused_ok else 'UNAVAILABLE'}, loop: their PyTorch "
          f"reference with feedback)\n{'shape (B, H, N, d)':22s} {'plain tiles':>12s} {'feedback':>10s} {'feedback/plain':>15s} "
          f"{'loop':>10s} {'loop/feedback':>14s}")
    for shape in tile_shapes:
        _, H, _, d = shape
        x = torch.randn(*shape, generator=g)
        A = torch.randn(H, d, d, generator=g, dtype=torch.float64)
        F = feedback_matrix(A @ A.mT / d + torch.eye(d, dtype=torch.float64))
        plain = median_ms(lambda x=x: kvarn_quantize(x, 2, "key", clip=1.7), repeats)
        fb = median_ms(lambda x=x, F=F: kvarn_quantize(x, 2, "key", clip=1.7, feedback=F), max(3, repeats // 5))
        loop = median_ms(lambda x=x, F=F: kvarn_quantize(x, 2, "key", clip=1.7, feedback=F, fused=False), max(3, repeats // 10))
        out["tiles"].append({"shape": shape, "plain_ms": plain, "feedback_ms": fb, "feedback_over_plain": fb / plain,
                             "loop_ms": loop, "loop_over_feedback": loop / fb})
        print(f"{str(shape):22s} {plain:10.3f}ms {fb:8.3f}ms {fb / plain:14.1f}x {loop:8.3f}ms {loop / fb:13.1f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return run(args.repeats)


if __name__ == "__main__":
    main()
