"""Greedy generation through the quantized cache (``wushkv generate``): one prompt streamed, or several in one
left-padded batch, and what the cache held."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import QuantConfig


def encode_prompts(tokenizer, prompts: Sequence[str], device) -> dict[str, torch.Tensor]:
    """``input_ids`` (1, n) for one prompt; for several, ``input_ids`` and ``attention_mask`` (prompts, n) of one
    left-padded batch (the tokenizer's padding side and pad token are restored afterwards)."""
    if len(prompts) == 1:
        return {"input_ids": tokenizer(prompts[0], return_tensors="pt").input_ids.to(device)}
    # one left-padded batch: the cache counts each row's windows from its first real token
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.pad_token if tokenizer.pad_token is not None else tokenizer.eos_token
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
        return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad


def generate(model, tokenizer, prompts: Sequence[str], method: str, cfg: QuantConfig, calibration, max_new_tokens: int,
             device="cpu"):
    """Greedy decoding of ``prompts`` through a :class:`~wushkv.cache.WushKVCache` under ``method``; a single prompt
    is streamed to stdout as it decodes. Returns (token ids (prompts, n + new), the cache, the encoded prompts)."""
    from transformers import TextStreamer

    from ..folding import apply_transforms
    from ..methods.install import transforms_for

    trs = transforms_for(model, calibration, method)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    enc = encode_prompts(tokenizer, prompts, device)
    with apply_transforms(model, trs, method) as installed:
        cache = installed.cache(cfg, attention_mask=enc.get("attention_mask"))
        streamer = TextStreamer(tokenizer, skip_prompt=False) if len(prompts) == 1 else None
        out = model.generate(**enc, cache=cache, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer, pad_token_id=pad_id)
    return out, cache, enc


def cache_summary(cache, model, out: torch.Tensor, prompts: int, method: str, cfg: QuantConfig, dtype: str) -> str:
    """What the cache held after generating ``out`` (prompts, columns), against a full-precision DynamicCache."""
    nb = cache.nbytes()
    size = next(model.parameters()).element_size()
    fp, bf16 = cache.full_precision_nbytes(size), cache.full_precision_nbytes(2)
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    cached = f"{out.shape[1] - 1} tokens" if prompts == 1 else f"{prompts} rows x {out.shape[1] - 1} columns"
    return (f"\n[{method} {cfg.label()}] {cached} cached: {mib(nb['total'])} held (codes {mib(nb['codes'])}, "
            f"metadata {mib(nb['metadata'])}, full-precision windows {mib(nb['full_precision'])}); a DynamicCache would hold "
            f"{mib(fp)} in {dtype} ({fp / max(nb['total'], 1):.2f}x) or {mib(bf16)} in bfloat16 ({bf16 / max(nb['total'], 1):.2f}x)")
