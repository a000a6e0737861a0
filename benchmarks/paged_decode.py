"""The vLLM plugin's fused decode (``wushkv._ext.paged_decode``) alone, against dense float32 attention over the same
context in the same run: one decode query per request over paged cells of SmolLM2's shape (3 KV heads, GQA 3,
head_dim 64, 128-token blocks), per-token 2-bit keys and values (``wush+ldlq`` served), 2-bit key tiles
(``auto``'s ``wush+ktiles+ldlq``), and the baselines' layouts: KIVI's (keys per channel over 128-token tiles, values
affine per token) and KVarN's (``kvarn``, ``+tiles``: both sides in 128-token tiles), every token read from its codes. It prints which vector path the kernels were
built with for this CPU (``avx512``, ``avx2`` or ``scalar``: ``wushkv._ext`` compiles with ``-march=native``).

    python benchmarks/paged_decode.py [--contexts 1024,4096,8192] [--requests 4] [--threads 1] [--json out.json]

The baseline is dense attention over float32 keys and values with torch's batched matmuls (the GQA group against its
KV head, a softmax between): BLAS at memory speed over 4 bytes an element, not vLLM's own CPU kernel (torch's bfloat16
attention on CPU is several times slower than this, so it would flatter the codes). Time per call is the
best of ``--repeats`` means of 10 calls; ns per token-head = time / (requests · KV heads · context).
"""

from __future__ import annotations

import argparse
import time

import torch

H, G, D, BLOCK = 3, 3, 64, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="vLLM's CPU worker runs one (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        best = min(best, (time.perf_counter() - t0) / 10)
    return best * 1e3


LAYOUTS = ("per_token", "ktiles", "kivi", "kvarn")


def _cells(layout: str, n: int, R: int):
    """(SlotCodec, cache, block tables, Windows) of R requests × n tokens of random codes with finite metadata."""
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv_vllm.paged import SlotCodec, Windows

    if layout == "ktiles":
        cfg = QuantConfig(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn", tile_clip=3.0,
                          windows=WindowConfig(BLOCK, 72, BLOCK))
    elif layout in ("kivi", "kvarn"):
        cfg = QuantConfig(k_bits=2, v_bits=2, quantizer=layout, windows=WindowConfig(BLOCK, 72, BLOCK))
    else:
        cfg = QuantConfig(k_bits=2, v_bits=2, quantizer="quest", windows=WindowConfig(BLOCK, 128, 1))
    F = torch.eye(D).expand(H, D, D).contiguous() if layout in ("per_token", "ktiles") else None  # +ldlq's feedback
    sc = SlotCodec(cfg, D, F)
    per = -(-n // BLOCK)
    g = torch.Generator().manual_seed(0)
    cache = torch.randint(0, 256, (R * per, H, BLOCK, sc.slot_bytes), dtype=torch.uint8, generator=g)
    step = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for side in sc.sides()[:2]:  # every float16 field a small step: random bytes could be NaN
        offsets = [o for o in side[1:3] if o >= 0] + (list(range(side[6], side[6] + side[7], 2)) if len(side) == 8 else [])
        for o in offsets:
            cache[..., o], cache[..., o + 1] = step[0], step[1]
    w = Windows(BLOCK, H, D, cfg.windows.S_sink, cfg.windows.S_keep, capacity=16, dtype=torch.bfloat16, flush=cfg.windows.S_flush)
    return sc, cache, torch.arange(R * per, dtype=torch.int32).view(R, per), w


def run(contexts: list[int], requests: int, repeats: int) -> list[dict]:
    """One row per context: ms per call of dense float32 attention and of both layouts, their ratios to it, and ns per
    token-head."""
    from wushkv._ext import kernels
    from wushkv_vllm.paged import decode_batch

    if kernels() is None:
        raise SystemExit("the fused CPU kernels are not available here (no compiler, or WUSHKV_NO_EXT): nothing to time")
    rows = []
    simd = kernels().simd_path()  # avx512, avx2 or scalar: the vector path this CPU's build took
    print(f"threads {torch.get_num_threads()}, {requests} requests, {H} KV heads x GQA {G}, head_dim {D}, kernels: {simd}")
    print(f"{'context':>8s} {'float32 ms':>11s} {'per-token ms':>13s} {'ktiles ms':>10s} {'per-token/float32':>18s} "
          f"{'ktiles/float32':>15s} {'ktiles ns/tok-head':>19s} {'kivi/float32':>13s} {'kvarn/float32':>14s}")
    for n in contexts:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(requests, H * G, D, generator=g)
        k = torch.randn(requests, H, n, D, generator=g)
        v = torch.randn(requests, H, n, D, generator=g)
        qg = q.view(requests, H, G, D)

        def dense():  # the GQA group against its KV head: two batched matmuls and a softmax
            return torch.softmax(qg @ k.transpose(-1, -2) * 0.125, -1) @ v

        row = {"context": n, "requests": requests, "simd": simd, "dense_ms": _best_ms(dense, repeats)}
        lens = torch.full((requests,), n)
        for layout in LAYOUTS:
            sc, cache, tables, w = _cells(layout, n, requests)
            row[f"{layout}_ms"] = _best_ms(lambda: decode_batch(sc, cache, tables, lens, q, w, 0.125), repeats)
            row[f"{layout}_over_dense"] = row[f"{layout}_ms"] / row["dense_ms"]
            row[f"{layout}_ns_per_token_head"] = row[f"{layout}_ms"] * 1e6 / (requests * H * n)
        rows.append(row)
        print(f"{n:8d} {row['dense_ms']:11.2f} {row['per_token_ms']:13.2f} {row['ktiles_ms']:10.2f} "
              f"{row['per_token_over_dense']:17.2f}x {row['ktiles_over_dense']:14.2f}x {row['ktiles_ns_per_token_head']:19.1f} "
              f"{row['kivi_over_dense']:12.2f}x {row['kvarn_over_dense']:13.2f}x", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run([int(c) for c in args.contexts.split(",")], args.requests, args.repeats)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"settings": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
