"""Decode steps of a left-padded batch through a whole model (prompts of different lengths, as ``generate`` batches
them): wushkv's cache against ``DynamicCache``, each step timed through every cache in turn (the machine's drift falls
on all alike).

    python benchmarks/padded_generation.py [--model smollm2-135m] [--lengths 512,112,300,450,200,512,380,260]
                                           [--steps 40] [--threads 2] [--dtype float32] [--json out.json]

Row b holds ``lengths[b]`` tokens of WikiText-2 after ``max(lengths) − lengths[b]`` pads; every cache is prefilled
with the batch and its attention mask, then decodes ``--steps`` greedy tokens per row with the mask grown by one
column a step and each row's own positions. Caches: ``DynamicCache`` (transformers' SDPA); wushkv K2V2 QuEST
(per-token codes: one store, a mask and held columns per row, ``KVView._decode_padded``) and K2V2 with KVarN key tiles
(``auto``'s key codec: ragged rows, ``RaggedView``), windows 64/256/128 and 64/256/16, no transform (identity). The
table gives each cache's median step (the first 4 steps not counted) and its ratio to DynamicCache's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CACHES = {  # name: QuantConfig arguments (None: DynamicCache)
    "dynamic": None,
    "quest-K2V2": dict(k_bits=2, v_bits=2, quantizer="quest", windows=(64, 256, 128)),
    "ktiles-K2V2": dict(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn", windows=(64, 256, 16)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="512,112,300,450,200,512,380,260")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def padded_batch(text: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) (B, max length): row b's ``lengths[b]`` tokens of ``text`` (1-D), each row its own slice, after
    its pads (id 0, mask 0)."""
    B, P = len(lengths), max(lengths)
    ids, mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, P - n :] = text[b * P : b * P + n]
        mask[b, P - n :] = 1
    return ids, mask


@torch.no_grad()
def run(model, text: torch.Tensor, lengths: list[int], steps: int, caches: dict = CACHES) -> dict:
    """Every cache of ``caches`` prefilled with the padded batch, then ``steps`` decode steps, one step of every cache
    in turn: {"rows": [{cache, ms, ratio}], "lengths", "steps"}; the greedy tokens of each wushkv cache are its own."""
    from transformers import DynamicCache

    from wushkv.config import QuantConfig, WindowConfig
    from wushkv.folding import apply_transforms
    from wushkv.models import describe
    from wushkv.transforms import build_transforms

    spec = describe(model)
    identity = [build_transforms("identity", spec.num_kv_heads, spec.head_dim) for _ in range(spec.num_layers)]
    ids, mask = padded_batch(text, lengths)
    dev = next(model.parameters()).device
    ids, mask = ids.to(dev), mask.to(dev)
    times: dict[str, list[float]] = {name: [] for name in caches}
    with apply_transforms(model, identity, "identity") as inst:  # wushkv's attention; identity: the model unchanged
        state = {}
        for name, kw in caches.items():
            if kw is None:
                cache = DynamicCache(config=model.config)
            else:
                cfg = QuantConfig(**{**kw, "windows": WindowConfig(*kw["windows"])})
                cache = inst.cache(cfg, attention_mask=mask)
            out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
                        use_cache=True)
            state[name] = (cache, mask, out.logits[:, -1:].argmax(-1))
        for _ in range(steps):
            for name in caches:
                cache, m, nxt = state[name]
                m = torch.cat([m, m.new_ones(m.shape[0], 1)], 1)
                t0 = time.perf_counter()
                out = model(nxt, attention_mask=m, position_ids=m.sum(-1, keepdim=True) - 1, cache=cache,
                            use_cache=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
                state[name] = (cache, m, out.logits[:, -1:].argmax(-1))
    skip = min(4, steps - 1)
    ms = {name: statistics.median(ts[skip:]) * 1e3 for name, ts in times.items()}
    base = ms.get("dynamic")
    rows = [{"cache": name, "ms": v, "ratio": v / base if base else float("nan")} for name, v in ms.items()]
    for r in rows:
        print(f"{r['cache']:<12} {r['ms']:8.1f} ms per step  {r['ratio']:.2f}x DynamicCache")
    return {"rows": rows, "lengths": lengths, "steps": steps}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from wushkv.data import wikitext2_test
    from wushkv.models import load

    model, tok = load(args.model, dtype=args.dtype)
    lengths = [int(x) for x in args.lengths.split(",")]
    text = tok(wikitext2_test()[: 8 * max(lengths) * len(lengths)], return_tensors="pt").input_ids[0]
    if len(text) < max(lengths) * len(lengths):
        raise SystemExit(f"--lengths: WikiText-2's first {len(text)} tokens hold fewer than {len(lengths)} rows of "
                         f"{max(lengths)}")
    print(f"{args.model} {args.dtype}, a left-padded batch of {len(lengths)} rows of {args.lengths} tokens, "
          f"{args.steps} steps, {args.threads} threads")
    out = run(model, text, lengths, args.steps) | {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    if args.json:
        from wushkv.io import write_json

        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
