"""GPTQ-style perplexity: non-overlapping chunks, PPL = exp(mean token NLL).

With a quantized-cache factory, every chunk runs through a fresh wushkv cache whose prefill attention
is the exact single-pass emulation of streaming decoding (docs/reference/math.md#32-full-precision-windows-and-the-batched-flush), so the score truly sees the
quantized keys and values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..progress import progress


@torch.no_grad()
def chunk_nll(model, input_ids: torch.Tensor, cache=None) -> tuple[float, int]:
    """Summed next-token NLL (float64) and the number of predicted tokens of ``input_ids`` [B, L]."""
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    kwargs = {"use_cache": cache is not None}
    if cache is not None:
        kwargs["cache"] = cache
    logits = model(input_ids, **kwargs).logits  # (B, L, V)
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1).to(logits.device), reduction="sum"
    )
    return float(nll.double()), input_ids[:, 1:].numel()


def perplexity(
    model,
    chunks: torch.Tensor,
    cache_factory: Callable[[], object] | None = None,
    show_progress: bool = True,
    desc: str = "ppl",
) -> dict:
    """Perplexity of ``model`` over ``chunks`` [N, L] (int64 token ids).

    ``cache_factory`` returns a fresh cache per chunk (None: full precision, no cache).
    Returns ``{"ppl", "nll", "chunk_nll", "tokens", "chunks", "seconds"}`` with ``nll`` the mean token NLL
    and ``chunk_nll`` the mean token NLL of each chunk (for paired comparisons over chunks).
    """
    total, count, per_chunk = 0.0, 0, []
    t0 = time.perf_counter()
    for i in progress(range(chunks.shape[0]), desc=desc, enabled=show_progress, unit="chunk"):
        cache = cache_factory() if cache_factory is not None else None
        s, n = chunk_nll(model, chunks[i : i + 1], cache)
        total += s
        count += n
        per_chunk.append(s / n)
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "chunk_nll": per_chunk, "tokens": count, "chunks": int(chunks.shape[0]),
            "seconds": time.perf_counter() - t0}
