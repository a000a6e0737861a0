"""The vLLM plugin's prefill attention (``wushkv_vllm.paged.attend``) alone, against torch's causal attention over the
same tokens in the same run: one prefill chunk of a request of SmolLM2's shape (3 KV heads, GQA 3, head_dim 64), its
keys and values decoded from the codes plus the full-precision copies of the windows a key-tile recipe keeps
(sink 128, recent 72, tiles of 128: ``auto``'s ``wush+ktiles+ldlq`` served), for each query block size.

    python benchmarks/paged_prefill.py [--contexts 1024,4096] [--chunk 0] [--blocks 256,1024] [--threads 1] [--json out.json]

``--chunk`` N > 0: the last N tokens of the context are the chunk's queries (chunked prefill); 0: the whole context
is one prompt. The baselines are ``scaled_dot_product_attention(is_causal=True)`` over the chunk's queries and the
whole context, in float32 (the plugin's arithmetic) and in bfloat16; a chunk after context takes an explicit causal
mask instead (torch's ``is_causal`` aligns the diagonal to the top left). Not vLLM's own CPU attention kernel, which
needs the vLLM environment. Time per call is the best of ``--repeats`` calls after one warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch

H, G, D = 3, 3, 64
SINK, RECENT, TILE = 128, 72, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--chunk", type=int, default=0, help="queries: the context's last N tokens (0: all of it)")
    ap.add_argument("--blocks", default="256,1024", help="query block sizes of attend to time")
    ap.add_argument("--threads", type=int, default=1, help="vLLM's CPU worker runs one (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def run(contexts: list[int], chunk: int, blocks: list[int], repeats: int) -> list[dict]:
    """One row per context: ms of torch's causal attention (float32, bfloat16) and of ``attend`` at each block size,
    with its ratios to both, and its largest difference from the float32 baseline where every copy is the code's
    value (the same attention by another route)."""
    from wushkv_vllm.paged import attend

    rows = []
    print(f"threads {torch.get_num_threads()}, {H} KV heads x GQA {G}, head_dim {D}, windows {SINK}/{RECENT}/{TILE}")
    for n in contexts:
        T = min(chunk, n) if chunk > 0 else n
        g = torch.Generator().manual_seed(n)
        q = torch.randn(T, H * G, D, generator=g)
        kq, vq = torch.randn(H, n, D, generator=g), torch.randn(H, n, D, generator=g)
        pos = torch.arange(n)
        known = (pos < SINK) | (pos >= n - T - RECENT - TILE)  # the sink, and the copies the chunk's windows read
        q_pos = pos[n - T:]
        causal = None if T == n else pos[None, :] <= q_pos[:, None]
        qh = q.transpose(0, 1)[None]

        def sdpa(dt):
            a, k, v = qh.to(dt), kq[None].to(dt), vq[None].to(dt)
            return lambda: torch.nn.functional.scaled_dot_product_attention(a, k, v, attn_mask=causal, is_causal=causal is None,
                                                                            scale=0.125, enable_gqa=True)

        row = {"context": n, "queries": T, "sdpa_f32_ms": _best_ms(sdpa(torch.float32), repeats),
               "sdpa_bf16_ms": _best_ms(sdpa(torch.bfloat16), repeats)}
        ref = sdpa(torch.float32)()[0].transpose(0, 1)
        for b in blocks:  # the copies equal the codes' values: attend must give plain causal attention
            call = lambda: attend(q, q_pos, kq, vq, kq, vq, known, pos, SINK, RECENT, 0.125, block=b, flush=TILE)  # noqa: E731
            row[f"attend_{b}_ms"] = _best_ms(call, repeats)
            row[f"attend_{b}_over_f32"] = row[f"attend_{b}_ms"] / row["sdpa_f32_ms"]
            row[f"attend_{b}_over_bf16"] = row[f"attend_{b}_ms"] / row["sdpa_bf16_ms"]
            row[f"attend_{b}_max_diff"] = float((call() - ref).abs().max())
        rows.append(row)
        print(f"context {n}, {T} queries: causal SDPA float32 {row['sdpa_f32_ms']:.1f} ms, bfloat16 {row['sdpa_bf16_ms']:.1f} ms; "
              + "; ".join(f"attend block {b}: {row[f'attend_{b}_ms']:.1f} ms = {row[f'attend_{b}_over_f32']:.2f}x float32, "
                          f"{row[f'attend_{b}_over_bf16']:.2f}x bfloat16 (max diff {row[f'attend_{b}_max_diff']:.1e})"
                          for b in blocks), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run([int(c) for c in args.contexts.split(",")], args.chunk, [int(b) for b in args.blocks.split(",")], args.repeats)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"settings": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
