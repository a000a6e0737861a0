"""A long generation through the quantized cache: does it stay finite, and do its bytes and memory grow as accounted?

Prefills ``--tokens`` − ``--new-tokens`` tokens of the evaluation text in chunks of ``--chunk`` through a
``WushKVCache`` (the method installed on the model), then generates ``--new-tokens`` tokens greedily, one at a time.
At every checkpoint (after each chunk, and at the end) it checks the last logits for NaN/inf, compares
``cache.nbytes()`` with the byte accounting (:func:`expected_nbytes`: packed codes, one fp16 step per token and
side for QuEST, the full-precision windows) and reads the resident memory of the process. It prints one row per
checkpoint and the growth of resident memory against the growth of the cache's bytes.

    python benchmarks/long_generation.py --model smollm2-135m --tokens 8192 --new-tokens 64 --chunk 512 \\
        --method hadamard --bits 2 [--calibration out/smollm2-c32.safetensors --method wush] [--json out/long.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from wushkv.config import QuantConfig, WindowConfig
from wushkv.report import format_table

PAGE = 4096


def rss() -> int:
    """Resident bytes of this process (/proc/self/statm), after glibc hands freed heap back (``malloc_trim``; else the
    allocator's hold on the last chunk's attention temporaries swamps what the cache holds)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def expected_nbytes(cache, cfg: QuantConfig, n: int) -> dict[str, int]:
    """What ``cache.nbytes()`` must be after ``n`` tokens (batch 1, full-attention layers, QuEST or affine per token
    over the whole head, no groups): per layer and KV head, Qc(n) quantized tokens of ⌈d·bits/8⌉ code bytes per side
    plus fp16 metadata (QuEST: one step per token and side; affine: a step and a zero point), and the other n − Qc(n)
    tokens in the windows at the cache's element size, keys and values."""
    nq = cfg.windows.quantized_count(n)
    codes = meta = fp = 0
    for layer in cache.layers:
        _, H, _, d = layer.sink_k.shape
        codes += H * nq * (math.ceil(d * cfg.k_bits / 8) + math.ceil(d * cfg.v_bits / 8))
        meta += H * nq * 2 * (2 if cfg.quantizer == "quest" else 4)
        fp += H * (n - nq) * d * layer.sink_k.element_size() * 2
    return {"codes": codes, "metadata": meta, "full_precision": fp, "total": codes + meta + fp}


@torch.no_grad()
def long_run(model, cache, ids: torch.Tensor, new_tokens: int, chunk: int, cfg: QuantConfig, log=None) -> list[dict]:
    """Prefill ``ids`` (1, P) in chunks, then generate ``new_tokens`` greedily; one record per checkpoint: tokens,
    finite (last logits), nbytes, expected (:func:`expected_nbytes`), rss, seconds since the start."""
    rows, t0, n = [], time.perf_counter(), 0

    def checkpoint(logits):
        row = {"tokens": n, "finite": bool(torch.isfinite(logits).all()), "nbytes": cache.nbytes(),
               "expected": expected_nbytes(cache, cfg, n), "rss": rss(), "seconds": time.perf_counter() - t0}
        rows.append(row)
        if log:
            log(f"{n} tokens: finite {row['finite']}, cache {row['nbytes']['total']} B, rss {row['rss'] / 2**20:.1f} MiB, {row['seconds']:.1f}s")

    for s in range(0, ids.shape[1], chunk):
        logits = model(ids[:, s : s + chunk], cache=cache, use_cache=True, logits_to_keep=1).logits
        n += ids[:, s : s + chunk].shape[1]
        checkpoint(logits)
    nxt = logits[:, -1:].argmax(-1)
    for i in range(new_tokens):
        logits = model(nxt, cache=cache, use_cache=True, logits_to_keep=1).logits
        n += 1
        nxt = logits[:, -1:].argmax(-1)
        if i == new_tokens - 1 or (i + 1) % max(1, new_tokens // 4) == 0:
            checkpoint(logits)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calibration", default=None, help="calibration file (calibrated methods)")
    ap.add_argument("--method", default="hadamard", help="a wushkv method (default: %(default)s)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--quantizer", default="quest", choices=["quest", "affine"])
    ap.add_argument("--windows", default="16,128,16", help="S_sink,S_keep,S_flush (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the cache at the end (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="of them, generated one at a time (default: %(default)s)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (default: %(default)s)")
    ap.add_argument("--text-file", default=None, help="prompt text (default: the evaluation text)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def run(args, model, ids: torch.Tensor, calibration=None) -> dict:
    """The checkpoints of one long run of ``ids`` (1, tokens − new_tokens) and the summary."""
    from wushkv.methods.install import method_cache

    s, k, f = (int(x) for x in args.windows.split(","))
    cfg = QuantConfig(args.bits, args.bits, args.quantizer, windows=WindowConfig(s, k, f))
    with method_cache(model, calibration, args.method, cfg) as make:
        cache = make()
        rss0 = rss()
        rows = long_run(model, cache, ids, args.new_tokens, args.chunk, cfg)
    first, last = rows[0], rows[-1]
    return {"model": args.model, "method": args.method, "config": cfg.to_dict(), "rows": rows, "rss_start": rss0,
            "all_finite": all(r["finite"] for r in rows), "bytes_as_accounted": all(r["nbytes"] == r["expected"] for r in rows),
            "cache_growth": last["nbytes"]["total"] - first["nbytes"]["total"], "rss_growth": last["rss"] - first["rss"],
            "bytes_per_token": last["nbytes"]["total"] / last["tokens"], "seconds": last["seconds"]}


def report(out: dict) -> str:
    rows = [[r["tokens"], "yes" if r["finite"] else "NO", r["nbytes"]["total"], "yes" if r["nbytes"] == r["expected"] else "NO",
             f"{r['rss'] / 2**20:.1f}", f"{r['seconds']:.1f}"] for r in out["rows"]]
    table = format_table(["tokens", "finite", "cache bytes", "= accounting", "rss MiB", "s"], rows)
    return (f"{out['model']} {out['method']} {QuantConfig.from_dict(out['config']).label()}\n{table}\n"
            f"cache grew {out['cache_growth'] / 2**20:.2f} MiB, resident memory {out['rss_growth'] / 2**20:.2f} MiB "
            f"(first checkpoint to last); {out['bytes_per_token']:.0f} cache bytes/token; all finite: {out['all_finite']}; "
            f"bytes as accounted: {out['bytes_as_accounted']}")


def main(argv: list[str] | None = None) -> dict:
    from wushkv.data import load_eval_text
    from wushkv.models import load

    args = parse_args(argv)
    torch.manual_seed(0)
    model, tok = load(args.model)
    text, _ = load_eval_text(args.text_file)
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens - args.new_tokens]
    if ids.shape[1] < args.tokens - args.new_tokens:
        raise SystemExit(f"the text gives {ids.shape[1]} tokens, fewer than {args.tokens - args.new_tokens}")
    cal = None
    if args.calibration:
        from wushkv.calibration import Calibration

        cal = Calibration.load(args.calibration, model)
    out = run(args, model, ids, cal)
    print(report(out))
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
