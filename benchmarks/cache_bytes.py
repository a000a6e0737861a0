"""Bytes a cache really holds after one prefill, per quantizer layout: to compare methods at equal bytes.

Perplexity tables compare methods at the same nominal width, but the layouts do not spend the same
bytes: QuEST stores one fp16 step per token and head (per group with ``group_size``), KVarN's tiles
add per-channel scales per tile and keep their first tile and a tail of up to 127 tokens in full
precision. This prefills one sequence of ``--tokens`` tokens of the evaluation text through a
``WushKVCache`` for each layout and prints ``cache.nbytes()`` (codes, metadata, full-precision windows),
summed over layers, per token, and against the QuEST layout of the same width; and the full-precision bytes the
layers really keep alive (:func:`held_full_precision`: the windows, and the copies a crop takes back from).

    python benchmarks/cache_bytes.py --model smollm2-135m --tokens 2048 --bits 2,3,4 \\
        --layouts "quest g64 16/128/16,quest g32 16/128/16,kvarn tiles,ktiles 16/128/16"
"""

from __future__ import annotations

import argparse

import torch

from wushkv.cache import WushKVCache
from wushkv.config import QuantConfig, WindowConfig
from wushkv.data import load_eval_text, tokenize_chunks
from wushkv.models import load
from wushkv.report import format_table


def layout_config(name: str, bits: int) -> QuantConfig:
    """``quest gG S/K/F`` (QuEST, group G, windows S/K/F), ``affine gG S/K/F``, ``kvarn tiles`` or ``ktiles [quest|affine] S/K/F``
    (keys in KVarN's tiles, QuEST values or affine ones, under the ``+ktiles`` windows derived from S/K/F)."""
    parts = name.split()
    if parts == ["kvarn", "tiles"]:
        return QuantConfig(bits, bits, quantizer="kvarn", windows=WindowConfig(128, 0, 128))
    if parts and parts[0] == "ktiles" and len(parts) in (2, 3) and parts[1:-1] in ([], ["quest"], ["affine"]):
        from wushkv.methods import parse

        s, k, f = (int(x) for x in parts[-1].split("/"))
        q = parts[1] if len(parts) == 3 else "quest"
        return parse("wush+ktiles").quant_config(QuantConfig(bits, bits, quantizer=q, windows=WindowConfig(s, k, f)))
    if len(parts) != 3 or parts[0] not in ("quest", "affine") or not parts[1].startswith("g"):
        raise ValueError(f"layout {name!r}: expected 'quest g64 16/128/16', 'affine g64 64/256/8', 'kvarn tiles', 'ktiles 16/128/16' "
                         "or 'ktiles affine 64/256/8'")
    s, k, f = (int(x) for x in parts[2].split("/"))
    return QuantConfig(bits, bits, quantizer=parts[0], group_size=int(parts[1][1:]), windows=WindowConfig(s, k, f))


HEADERS = ["bits", "layout", "codes", "metadata", "full precision (bf16)", "total", "bytes/token", "× first layout",
           "full precision held (bf16)"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--bits", default="2,3,4")
    ap.add_argument("--layouts", default="quest g64 16/128/16,quest g32 16/128/16,kvarn tiles")
    return ap.parse_args(argv)


@torch.no_grad()
def measure(model, ids: torch.Tensor, bits: list[int], layouts: list[str]) -> list[list]:
    """One row (:data:`HEADERS`) per width and layout: ``cache.nbytes()`` after a prefill of ``ids`` (1, tokens)
    through a fresh ``WushKVCache``, its full-precision part counted at 2 bytes per element (bf16, as deployed;
    the run itself is in the model's dtype), per token, and against the first layout of the same width."""
    elem = next(model.parameters()).element_size()
    rows = []
    for b in bits:
        ref = None
        for name in layouts:
            cache = WushKVCache(model, layout_config(name, b))
            model(ids, cache=cache, use_cache=True)
            n = cache.nbytes()
            n["full_precision"] = n["full_precision"] * 2 // elem  # counted as bf16, as deployed (this run is float32)
            total = n["codes"] + n["metadata"] + n["full_precision"]
            ref = ref or total
            rows.append([b, name, n["codes"], n["metadata"], n["full_precision"], total, round(total / ids.shape[1], 1), round(total / ref, 3),
                         held_full_precision(cache) * 2 // elem])
    return rows


def held_full_precision(cache) -> int:
    """Bytes of every storage the layers' full-precision tensors keep alive after the prefill (sink, recent buffer,
    the copies ``take_back`` keeps of what the last update coded), each storage once: what the accounting's windows
    really cost, which a buffer kept as a view of the prompt's whole window once multiplied by the prompt's length."""
    seen = {}
    for layer in cache.quantized_layers:
        for t in (layer.sink_k, layer.sink_v, layer.recent_k, layer.recent_v, *(layer._undo or ())[1:]):
            if torch.is_tensor(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def main(argv: list[str] | None = None) -> list[list]:
    args = parse_args(argv)
    model, tok = load(args.model)
    text, _ = load_eval_text(None)
    ids = tokenize_chunks(tok, text, args.tokens, 1)
    rows = measure(model, ids, [int(x) for x in args.bits.split(",")], args.layouts.split(","))
    print(f"{args.model}, one prefill of {args.tokens} tokens, bytes summed over layers and KV heads (identity transform)")
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
