"""Decode of a left-padded batch (prompts of different lengths, as ``generate`` batches them) in wushkv's
transformers cache, one layer's attention of one new token per row: read from the codes with one mask per row
(``KVView._decode_padded``) against the emulation it replaced (every column of every row built in full precision
and quantized, ``KVView._attend_padded``) and against the same batch without padding read from the codes, in the same
run.

    python benchmarks/padded_decode.py [--contexts 4096,16384] [--batches 4,8] [--shapes smollm2,llama8b]
                                        [--threads 2] [--json out.json]

Shapes: ``smollm2`` (3 KV heads, GQA 3, head_dim 64), ``llama8b`` (8 KV heads, GQA 4, head_dim 128); keys and values
K2V2 affine, float32; sink 64 and recent 256 tokens in full precision (the generation windows). Row ``b`` of a batch
of B holds ``context − pad_b`` real tokens, the pads spread evenly over ``[0, context / 4]``. The cache is filled
through the layer's own ``update`` with random keys and values (no model: the attention is what is timed). Time per
call is the best of ``--repeats`` means of 3 calls; ``largest_mb`` is the largest single allocation of one call
(torch's profiler), where the emulation holds the whole middle in full precision; ``fp_mb_padded`` / ``_unpadded``
what the layer holds in full precision (the rows' sinks and the recent buffer) with and without the padding.
"""

from __future__ import annotations

import argparse
import timeit
from types import SimpleNamespace

import torch

SHAPES = {"smollm2": (3, 3, 64), "llama8b": (8, 4, 128)}  # KV heads, GQA group, head_dim


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--batches", default="4,8")
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


def _view(H: int, d: int, B: int, n: int, pads: list[int] | None):
    """One layer (K2V2 affine, generation windows) filled with n random columns per row (``pads[b]`` of them padding,
    or none), then given one more: the view of that decode step."""
    from wushkv.config import GENERATION_WINDOWS, QuantConfig
    from wushkv.layer import WushKVLayer

    g = torch.Generator().manual_seed(0)
    layer = WushKVLayer(QuantConfig(2, 2, "affine", windows=GENERATION_WINDOWS), d)
    layer.set_padding(pads)
    for a in range(0, n, 4096):  # a chunked prefill: what a long prompt's forward hands the cache
        m = min(4096, n - a)
        layer.update(torch.randn(B, H, m, d, generator=g), torch.randn(B, H, m, d, generator=g))
    view, _ = layer.update(torch.randn(B, H, 1, d, generator=g), torch.randn(B, H, 1, d, generator=g))
    return view


def run(contexts: list[int], batches: list[int], shapes: list[str], repeats: int = 3) -> list[dict]:
    from wushkv.attention import as_allowed

    module = SimpleNamespace(wushkv_key=None)  # the layers hold no key transform
    rows = []
    print(f"{'shape':8s} {'context':>7s} {'batch':>5s} {'unpadded ms':>11s} {'codes':>9s} {'emulation':>10s} "
          f"{'emul/codes':>10s} {'codes/unpad':>11s} {'largest MB codes/emul':>22s} {'full-precision MB pad/unpad':>28s}")
    for shape in shapes:
        H, G, d = SHAPES[shape]
        for n in contexts:
            for B in batches:
                pads = [round(b * n / 4 / max(B - 1, 1)) for b in range(B)]
                padded, plain = _view(H, d, B, n, pads), _view(H, d, B, n, None)
                q = torch.randn(B, H * G, 1, d, generator=torch.Generator().manual_seed(1))
                mask = (torch.arange(n + 1).view(1, -1) >= torch.tensor(pads).view(-1, 1)).view(B, 1, 1, n + 1)
                allowed = as_allowed(mask, n + 1)

                def codes():
                    return padded.attend(module, q, mask, d**-0.5, None)

                def emulation():  # the replaced path: both versions of every column in full precision
                    return padded._attend_padded(q, allowed, d**-0.5, None)

                def unpadded():
                    return plain.attend(module, q, None, d**-0.5, None)

                ref = emulation()
                err = float((codes() - ref).abs().max() / ref.abs().max())
                row = {"shape": shape, "context": n, "batch": B, "pads": pads, "unpadded_ms": _best_ms(unpadded, repeats),
                       "codes_ms": _best_ms(codes, repeats), "emulation_ms": _best_ms(emulation, repeats),
                       "largest_mb_codes": _largest_mb(codes), "largest_mb_emulation": _largest_mb(emulation),
                       "codes_vs_emulation": err,
                       # what the layers hold in full precision (sinks, recent buffers): the padding costs none of it
                       "fp_mb_padded": padded.layer.nbytes()["full_precision"] / 2**20,
                       "fp_mb_unpadded": plain.layer.nbytes()["full_precision"] / 2**20}
                row["emulation_over_codes"] = row["emulation_ms"] / row["codes_ms"]
                row["codes_over_unpadded"] = row["codes_ms"] / row["unpadded_ms"]
                rows.append(row)
                print(f"{shape:8s} {n:7d} {B:5d} {row['unpadded_ms']:11.2f} {row['codes_ms']:9.2f} {row['emulation_ms']:10.2f} "
                      f"{row['emulation_over_codes']:9.1f}x {row['codes_over_unpadded']:10.2f}x "
                      f"{row['largest_mb_codes']:11.1f}/{row['largest_mb_emulation']:<10.1f} "
                      f"{row['fp_mb_padded']:13.2f}/{row['fp_mb_unpadded']:.2f}"
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
