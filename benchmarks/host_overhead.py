"""The host's time per decode step that wushkv's cache adds to a model's, per layer: what a GPU's host must issue
before it can queue the next layer, and so the floor of a decode step's time wherever the device is faster.

    python benchmarks/host_overhead.py [--layers 8] [--steps 60] [--threads 1] [--keys ktiles+rmean] [--json out.json]

A tiny Llama-shaped model (head_dim 32, GQA 2) on the CPU, so that the arithmetic is negligible and what a step costs
is its Python and operator dispatch, decodes ``--steps`` tokens after a 300-token prompt through ``DynamicCache``
(SDPA) and through wushkv's cache (K2V2 QuEST, windows 16/128/16, a random key transform; a middle of 150-210
tokens, a flush every 16 steps; ``--keys ktiles+rmean``: keys in KVarN tiles of 16 centered on a rotating mean, the
layout ``auto`` picks for SmolLM2): on the PyTorch path, and on
the Triton path with its kernel launches skipped (``triton_kernels.launches_through``; on a GPU each launch adds
Triton's launcher, two per layer). The ratio is each path's median step over DynamicCache's in the same run, the
overhead its excess per layer. The first 5 steps are not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the launches are skipped anyway

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keys", default="quest", choices=["quest", "ktiles+rmean"],
                    help="the keys' layout: per-token QuEST codes, or KVarN tiles centered on a rotating mean (auto's)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def tiny_llama(layers: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def run(layers: int = 8, steps: int = 60, keys: str = "quest") -> dict:
    """Every cache prefilled, then each decode step timed through every cache in turn (the machine's drift falls on
    all of them alike): the medians, their ratios to DynamicCache's, the excess per layer."""
    import contextlib

    from transformers import DynamicCache

    from wushkv import decode, triton_kernels
    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.folding import apply_transforms
    from wushkv.transforms import build_transforms

    model, stock = tiny_llama(layers), tiny_llama(layers)  # the stock one keeps transformers' SDPA
    ids = torch.randint(3, 96, (1, 300 + steps), generator=torch.Generator().manual_seed(0))
    cfg = QuantConfig(2, 2, "quest", windows=WindowConfig(16, 128, 16))
    transforms = [build_transforms("random", 2, 32, seed=layer) for layer in range(layers)]
    if keys == "ktiles+rmean":  # a pre-RoPE key mean far from 0 for the cache to center the middle's keys on
        import dataclasses

        g = torch.Generator().manual_seed(1)
        transforms = [dataclasses.replace(tr, mu_K_rope=torch.randn(2, 32, generator=g) * 3) for tr in transforms]
        cfg = QuantConfig(2, 2, "quest", key_quantizer="kvarn", windows=WindowConfig(16, 128, 16))
    skip = lambda name, grid, args, meta, run: None  # noqa: E731
    with apply_transforms(model, transforms, "random") as inst, torch.no_grad():
        # name: (model, cache, the contexts it runs under, made afresh each step)
        paths = {"dynamic": (stock, DynamicCache(config=stock.config), lambda: ()),
                 "torch": (model, inst.cache(cfg), lambda: (decode.triton_enabled(False),))}
        if triton_kernels.available():
            paths["triton"] = (model, inst.cache(cfg), lambda: (decode.triton_enabled(True), triton_kernels.launches_through(skip)))
        times = {name: [] for name in paths}
        for t in [0, *range(300, 300 + steps)]:  # the prompt, then one token a step
            chunk = ids[:, :300] if t == 0 else ids[:, t : t + 1]
            for name, (net, cache, contexts) in paths.items():
                with contextlib.ExitStack() as stack:
                    for c in contexts():
                        stack.enter_context(c)
                    t0 = time.perf_counter()
                    net(chunk, cache=cache, use_cache=True)
                    times[name].append(time.perf_counter() - t0)
    row = {"layers": layers, "steps": steps, "keys": keys}
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts[6:]) * 1e3  # the prefill and the first 5 steps not counted
    print(f"DynamicCache {row['dynamic_ms']:.2f} ms per step ({layers} layers)")
    for path in ("torch", "triton"):
        if f"{path}_ms" in row:
            row[f"{path}_over_dynamic"] = row[f"{path}_ms"] / row["dynamic_ms"]
            row[f"{path}_overhead_ms_per_layer"] = (row[f"{path}_ms"] - row["dynamic_ms"]) / layers
            print(f"wushkv, {path} path{' (launches skipped)' if path == 'triton' else ''}: {row[f'{path}_ms']:.2f} ms, "
                  f"{row[f'{path}_over_dynamic']:.2f}x, +{row[f'{path}_overhead_ms_per_layer'] * 1e3:.0f} us per layer")
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    row = run(args.layers, args.steps, args.keys)
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, {"threads": args.threads, **row})
    return row


if __name__ == "__main__":
    main()
