"""Decode over keys centered on their rotating mean (``+rmean``, what ``auto`` picks with the affine quantizer) in
wushkv's transformers cache, one layer's attention of one new token: read in the code domain (the centers' share of
the scores a function of the position, :class:`wushkv.layer.KeyCenters`) against the path it replaced (the whole
middle's keys dequantized and given their centers at every step) and against the same codes read without centers,
in the same run.

    python benchmarks/centered_decode.py [--contexts 4096,16384,32768] [--batches 1,8] [--shapes smollm2,llama8b]
                                          [--threads 2] [--json out.json]

Shapes: ``smollm2`` (3 KV heads, GQA 3, head_dim 64), ``llama8b`` (8 KV heads, GQA 4, head_dim 128); keys and values
K2V2 affine (``wush+rmean``'s default), float32 queries; sink 64 and recent 256 tokens in full precision. Time per
call is the best of ``--repeats`` means of 3 calls; ``largest_mb`` is the largest single allocation of one call
(torch's profiler), where the dequantized path holds the whole middle's keys.
"""

from __future__ import annotations

import argparse
import timeit

import torch

SHAPES = {"smollm2": (3, 3, 64), "llama8b": (8, 4, 128)}  # KV heads, GQA group, head_dim


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _best_ms(fn, repeats: int) -> float:
    """The best of ``repeats`` means of 3 calls, after one call (the tables built, the allocator warm)."""
    fn()
    return min(timeit.repeat(fn, repeat=repeats, number=3)) / 3 * 1e3


def _largest_mb(fn) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.self_cpu_memory_usage for e in prof.events()), default=0) / 2**20


def _parts(H: int, d: int, B: int, n: int):
    """Key and value parts (sink, K2V2 affine middle of n tokens centered on a rotating mean, recent) of random keys."""
    from wushkv.codecs import make_codec
    from wushkv.config import QuantConfig
    from wushkv.layer import KeyCenters, RotatingKeyMean

    g = torch.Generator().manual_seed(0)
    T = torch.linalg.qr(torch.randn(H, d, d, generator=g, dtype=torch.float64))[0]
    km = RotatingKeyMean(torch.randn(H, d, generator=g) * 4, T, (10000.0 ** (-torch.arange(d // 2) / (d / 2)), 1.0))
    cfg = QuantConfig(2, 2, "affine")
    kc, vc = make_codec(cfg, "key", d), make_codec(cfg, "value", d)
    x = lambda m: torch.randn(B, H, m, d, generator=g)
    center = KeyCenters(km, 64, None)
    pk = [x(64), (kc, kc.encode(x(n)), n, center), x(256)]
    pv = [x(64), (vc, vc.encode(x(n)), n), x(256)]
    return pk, pv


def run(contexts: list[int], batches: list[int], shapes: list[str], repeats: int = 3) -> list[dict]:
    from wushkv import decode

    rows = []
    print(f"{'shape':8s} {'context':>7s} {'batch':>5s} {'plain ms':>9s} {'code domain':>12s} {'dequantized':>12s} "
          f"{'deq/code':>8s} {'code/plain':>10s} {'largest MB code/deq':>20s}")
    for shape in shapes:
        H, G, d = SHAPES[shape]
        for n in contexts:
            for B in batches:
                pk, pv = _parts(H, d, B, n)
                q = torch.randn(B, H * G, 1, d, generator=torch.Generator().manual_seed(1))
                codec, store, m, center = pk[1]

                def plain():
                    return decode.decode_attention(q, [pk[0], pk[1][:3], pk[2]], pv, None, d**-0.5)

                def code():
                    center._terms = None  # a new query each step: its terms computed again
                    return decode.decode_attention(q, pk, pv, None, d**-0.5)

                def dequantized():  # the replaced path: the middle's keys dequantized, their centers added
                    mk = (codec.decode(store, m) + center.dense(0, m)).to(q.dtype)
                    return decode.decode_attention(q, [pk[0], mk, pk[2]], pv, None, d**-0.5)

                err = float((code() - dequantized()).abs().max() / dequantized().abs().max())
                row = {"shape": shape, "context": n, "batch": B, "plain_ms": _best_ms(plain, repeats),
                       "code_ms": _best_ms(code, repeats), "dequantized_ms": _best_ms(dequantized, repeats),
                       "largest_mb_code": _largest_mb(code), "largest_mb_dequantized": _largest_mb(dequantized),
                       "code_vs_dequantized": err}
                row["dequantized_over_code"] = row["dequantized_ms"] / row["code_ms"]
                row["code_over_plain"] = row["code_ms"] / row["plain_ms"]
                rows.append(row)
                print(f"{shape:8s} {n:7d} {B:5d} {row['plain_ms']:9.2f} {row['code_ms']:12.2f} {row['dequantized_ms']:12.2f} "
                      f"{row['dequantized_over_code']:7.1f}x {row['code_over_plain']:9.2f}x "
                      f"{row['largest_mb_code']:9.1f}/{row['largest_mb_dequantized']:.1f}"
                      + ("" if err < 1e-4 else f"  MISMATCH {err:.1e}"), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run([int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")],
               args.shapes.split(","), args.repeats)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"threads": args.threads, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
