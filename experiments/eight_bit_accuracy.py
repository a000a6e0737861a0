"""What limits an 8-bit cache's accuracy? Logits and perplexity of a model through the quantized cache against full
precision, for variants that each remove one suspect (docs/lab/eight-bit-accuracy.md).

Suspects: the per-token group of the whole head dim (its step is set by the token's largest channel: groups of 32,
16, 8), the float16 storage of the step and offset (``metadata_dtype="float32"``), the full-precision windows (none:
every token but the current one quantized, windows 0/0/1), keys against values (one side at 8 bits, the other at
full precision), the grid (QuEST's symmetric midrise against the affine min–max), a rotation spreading outlier
channels (Hadamard). Two floors are printed with them: full precision run through the same cache (16 bits: the
float32 noise of the emulation path) and 4 bits (how the error scales with the width).

Each variant prefills the whole chunk through a fresh :class:`wushkv.cache.WushKVCache` (the single-pass
emulation: the logits of every position see the cache as streaming decode would hold it) and is compared with a
``DynamicCache`` run, over the positions that read at least one quantized token:

* ``rel_l2``: mean over positions of ‖ℓ̂ − ℓ‖ / ‖ℓ‖ (the logits' norm-relative error);
* ``rel_max``: max |ℓ̂ − ℓ| over the chunk / max |ℓ| (the largest logit error over the largest logit);
* ``kl``: mean KL(p ‖ p̂) of the next-token distributions, nats;
* ``dnll``: (mean NLL − full precision's) / full precision's mean NLL, signed: the relative change of log-perplexity;
* ``dppl``: perplexity ratio − 1.

``--model tiny``: a tiny random llama (tests/conftest.py's shape) with two output channels of every KV head's
key and value projections ×8 (outlier channels on the raw coordinates), on random tokens; the test of the 8-bit
cache (tests/test_cache.py) bounds what this measures.

    python experiments/eight_bit_accuracy.py --model smollm2-135m --seq-len 2048 [--json out/eight_bit.json]
    python experiments/eight_bit_accuracy.py --model tiny --seq-len 256
"""

from __future__ import annotations

import argparse
import math

import torch

from wushkv.config import PERPLEXITY_WINDOWS, QuantConfig, WindowConfig
from wushkv.io import write_json
from wushkv.methods.install import method_cache
from wushkv.report import format_table

# name -> (method, QuantConfig keywords); every variant is QuEST 8/8 per token, float16 metadata, the perplexity
# windows, unless it says otherwise
VARIANTS: dict[str, tuple[str, dict]] = {
    "16 bits through the cache (float32 floor)": ("identity", {"k_bits": None, "v_bits": None}),
    "quest 8 (default)": ("identity", {}),
    "quest 8, float32 metadata": ("identity", {"metadata_dtype": "float32"}),
    "quest 8, groups of 32": ("identity", {"group_size": 32}),
    "quest 8, groups of 16": ("identity", {"group_size": 16}),
    "quest 8, groups of 8": ("identity", {"group_size": 8}),
    "quest 8, no windows (0/0/1)": ("identity", {"windows": WindowConfig(0, 0, 1)}),
    "quest 8, sink only (16/0/1)": ("identity", {"windows": WindowConfig(16, 0, 1)}),
    "quest 8, recent only (0/128/16)": ("identity", {"windows": WindowConfig(0, 128, 16)}),
    "quest 8, keys only": ("identity", {"v_bits": None}),
    "quest 8, values only": ("identity", {"k_bits": None}),
    "quest 8, hadamard": ("hadamard", {}),
    "affine 8": ("identity", {"quantizer": "affine"}),
    "affine 8, float32 metadata": ("identity", {"quantizer": "affine", "metadata_dtype": "float32"}),
    "quest 4 (width scaling)": ("identity", {"k_bits": 4, "v_bits": 4}),
}


def outlier_tiny_model(seed: int = 0, scale: float = 8.0):
    """A tiny random llama whose keys and values have two ×``scale`` output channels per KV head (raw coordinates)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.view(cfg.num_key_value_heads, cfg.head_dim, -1)[:, :2].mul_(scale)
    return model


def compare(ref: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, first: int) -> dict[str, float]:
    """Metrics of logits ``out`` against ``ref`` (1, T, V) over positions ``first``..T−2 (those with a next token)."""
    r, o = ref[0, first:-1].double(), out[0, first:-1].double()
    target = ids[0, first + 1:]
    lp, lq = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
    nll_r = -lp.gather(-1, target[:, None]).mean()
    nll_q = -lq.gather(-1, target[:, None]).mean()
    d = o - r
    return {"rel_l2": float((d.norm(dim=-1) / r.norm(dim=-1)).mean()), "rel_max": float(d.abs().max() / r.abs().max()),
            "kl": float((lp.exp() * (lp - lq)).sum(-1).mean()), "dnll": float((nll_q - nll_r) / nll_r),
            "dppl": math.expm1(float(nll_q - nll_r)), "nll": float(nll_r)}


@torch.no_grad()
def run(model, ids: torch.Tensor, variants=VARIANTS, log=print) -> list[dict]:
    from transformers import DynamicCache

    ref = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits
    rows = []
    for name, (method, kw) in variants.items():
        kw = {"k_bits": 8, "v_bits": 8, "quantizer": "quest", "windows": PERPLEXITY_WINDOWS} | kw
        cfg = QuantConfig(**kw)
        first = next(t for t in range(ids.shape[1]) if cfg.windows.quantized_count(t + 1) > 0)
        with method_cache(model, None, method, cfg) as make:
            out = model(ids, cache=make(), use_cache=True).logits
        row = {"variant": name, "method": method, "config": cfg.to_dict(), "first_position": first} | compare(ref, out, ids, first)
        rows.append(row)
        log(f"{name}: rel_l2 {row['rel_l2']:.2e}  rel_max {row['rel_max']:.2e}  KL {row['kl']:.2e}  ΔNLL {row['dnll']:+.2e}")
    return rows


def report(rows: list[dict], title: str) -> str:
    table = format_table(["variant", "‖Δℓ‖/‖ℓ‖", "max|Δℓ|/max|ℓ|", "KL", "ΔNLL/NLL", "ppl ratio − 1"],
                         [[r["variant"], f"{r['rel_l2']:.2e}", f"{r['rel_max']:.2e}", f"{r['kl']:.2e}", f"{r['dnll']:+.2e}",
                           f"{r['dppl']:+.2e}"] for r in rows])
    return f"{title}\n{table}"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a wushkv model name, or 'tiny' (outlier channels, random tokens)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=0, help="which chunk of the evaluation text (default: the first)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.model == "tiny":
        model = outlier_tiny_model()
        ids = torch.randint(3, 128, (1, args.seq_len), generator=torch.Generator().manual_seed(args.chunk))
        title = f"tiny llama, two ×8 key/value channels per KV head, {args.seq_len} random tokens"
    else:
        from wushkv.data import load_eval_text, tokenize_chunks
        from wushkv.models import load

        model, tok = load(args.model)
        text, label = load_eval_text(None)
        ids = tokenize_chunks(tok, text, args.seq_len, 1, first=args.chunk)
        title = f"{args.model}, {label}, chunk {args.chunk} of {args.seq_len} tokens"
    rows = run(model, ids)
    print(report(rows, title))
    if args.json:
        write_json(args.json, {"model": args.model, "seq_len": args.seq_len, "chunk": args.chunk, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
