"""The transformers cache's fused CPU kernels alone (``wushkv._ext``: ``code_dot``, ``code_dot_tiles``,
``code_weighted_sum``), against float32 matrix products over the same context in the same run: one decode step's
scores of a GQA group against a layer's packed keys, and its weighted sum of the packed values. Each row also holds
the kernel's result against the same product over the codes as floats (largest relative difference, recorded).

    python benchmarks/code_kernels.py [--contexts 4096,16384] [--batches 1,8] [--bits 2,4] [--shapes smollm2,llama8b]
                                      [--threads 1] [--json out.json]

Shapes: ``smollm2`` (3 KV heads, GQA 3, head_dim 64), ``llama8b`` (8 KV heads, GQA 4, head_dim 128). The baselines:
``q @ Kᵀ`` and ``p @ V`` over float32 keys and values (BLAS at memory speed over 4 bytes an element); the kernels read
b/8 bytes an element. ``code_dot_tiles`` reads KVarN's key tiles of 128 tokens (``auto``'s keys: one set of
channel-scaled queries per tile, the tile's bias and each token's scale in the same pass). Time per call is the best
of ``--repeats`` means of 5 calls; ns per token-head = time / (batch · KV heads · context). The kernels print which
vector path they were built with (``avx512``, ``avx2`` or ``scalar``).
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"smollm2": (3, 3, 64), "llama8b": (8, 4, 128)}  # KV heads, GQA group, head_dim
TILE = 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _best_ns(fn, repeats: int) -> float:
    """The best of ``repeats`` means of 5 calls, after one call, in ns."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        best = min(best, (time.perf_counter() - t0) / 5)
    return best * 1e9


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def tile_reference(qt, cf_tiles, bias, s_tok) -> torch.Tensor:
    """What code_dot_tiles computes, from the codes as floats (B, H, tiles, TILE, d): s_j·(q[tile]·c_j + bias[tile])."""
    n = s_tok.shape[-1]
    dots = torch.einsum("bhtgd,bhtkd->bhgtk", qt, cf_tiles) + bias.permute(0, 1, 3, 2).unsqueeze(-1)
    return dots.flatten(-2)[..., :n] * s_tok[:, :, None]


def run(shapes: list[str], contexts: list[int], batches: list[int], bits_list: list[int], repeats: int = 5) -> list[dict]:
    from wushkv._ext import kernels
    from wushkv.quantizers import pack

    ext = kernels()
    if ext is None:
        raise SystemExit("the fused CPU kernels are not available here (no compiler, or WUSHKV_NO_EXT is set)")
    print(f"threads {torch.get_num_threads()}, kernels: {ext.simd_path()}")
    rows = []
    for shape in shapes:
        H, G, d = SHAPES[shape]
        for n in contexts:
            for B in batches:
                g = torch.Generator().manual_seed(n + B)
                K, V = torch.randn(B, H, n, d, generator=g), torch.randn(B, H, n, d, generator=g)
                q = torch.randn(B, H, G, d, generator=g)
                p = torch.softmax(torch.randn(B, H, G, n, generator=g), -1)
                dense_dot = _best_ns(lambda: torch.matmul(q, K.transpose(-1, -2)), repeats)
                dense_sum = _best_ns(lambda: torch.matmul(p, V), repeats)
                tiles = -(-n // TILE)
                qt = torch.randn(B, H, tiles, G, d, generator=g)
                bias, s_tok = torch.randn(B, H, tiles, G, generator=g), torch.rand(B, H, n, generator=g)
                for bits in bits_list:
                    c = torch.randint(0, 2**bits, (B, H, n, d), dtype=torch.uint8, generator=g)
                    codes, cf = pack(c, bits), c.float()
                    cf_tiles = torch.nn.functional.pad(cf, (0, 0, 0, tiles * TILE - n)).unflatten(2, (tiles, TILE))
                    row = {"shape": shape, "context": n, "batch": B, "bits": bits, "simd": ext.simd_path(),
                           "dense_dot_ns": dense_dot, "dense_sum_ns": dense_sum}
                    work = B * H * n
                    timed = {
                        "code_dot": (lambda: ext.code_dot(codes, q, bits), "dense_dot_ns",
                                     lambda out: _rel(out, q @ cf.transpose(-1, -2))),
                        "code_dot_tiles": (lambda: ext.code_dot_tiles(codes, qt, bits, TILE, bias, s_tok), "dense_dot_ns",
                                           lambda out: _rel(out, tile_reference(qt, cf_tiles, bias, s_tok))),
                        "code_weighted_sum": (lambda: ext.code_weighted_sum(codes, p, bits, d), "dense_sum_ns",
                                              lambda out: _rel(out, p @ cf)),
                    }
                    for name, (fn, base, check) in timed.items():
                        if not hasattr(ext, name):  # an older build (before code_dot_tiles)
                            continue
                        ns = _best_ns(fn, repeats)
                        row[f"{name}_ns_per_token_head"] = ns / work
                        row[f"{name}_over_dense"] = ns / row[base]
                        row[f"{name}_max_rel_diff"] = check(fn())
                    rows.append(row)
                    cells = [f"{name} {row[f'{name}_ns_per_token_head']:.1f} ns ({row[f'{name}_over_dense']:.2f}x)"
                             for name in timed if f"{name}_ns_per_token_head" in row]
                    print(f"{shape} n={n} B={B} {bits}-bit: " + ", ".join(cells) + f"  [dense dot {dense_dot / work:.1f} ns, "
                          f"sum {dense_sum / work:.1f} ns per token-head]", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.shapes.split(","), [int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")],
               [int(x) for x in args.bits.split(",")], args.repeats)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"threads": args.threads, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
