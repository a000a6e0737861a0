"""Attention math: plain, and the exact single-pass emulation of streaming a quantized cache.

Nothing here knows of the cache or of transformers: the cache's views (:mod:`wushkv.layer`) and the
registered attention function (:mod:`wushkv.hf`) call these functions.

Shapes: queries ``(B, Hq, T, d)``, keys/values ``(B, Hkv, S, d)``, ``Hq = G·Hkv`` with query head
``g`` reading KV head ``g // G`` (transformers' ``repeat_kv`` order).
"""

from __future__ import annotations

import contextlib

import torch


def grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, Hq, T, d) -> (B, Hkv, G, T, d)."""
    B, Hq, T, d = q.shape
    return q.view(B, num_kv_heads, Hq // num_kv_heads, T, d)


def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax probabilities ``(B, Hkv, G, T, S)`` of grouped queries ``(B, Hkv, G, T, d)`` over keys ``(B, Hkv, S, d)``.

    ``allowed``: bool ``(B, 1, T, S)`` (True = attend) or None. ``sinks``: learned sink logits ``(Hq,)`` (gpt-oss),
    one more softmax column per query head whose value is zero: with them the probabilities sum to less than 1.
    """
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scaling  # (B, Hkv, G, T, S)
    return _softmax(scores, allowed, softcap, sinks)


def _softmax(scores: torch.Tensor, allowed: torch.Tensor | None, softcap: float | None,
             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of scores ``(B, Hkv, G, T, S)``; ``sinks`` (Hq,) join as a column and are dropped
    again (their share of the probability goes to a zero value)."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed.unsqueeze(2), torch.finfo(scores.dtype).min)
    acc = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype  # float64 stays float64
    if sinks is None:
        return torch.softmax(scores.to(acc), dim=-1).to(scores.dtype)
    B, H, G, T, _ = scores.shape
    column = sinks.to(scores.device, acc).view(1, H, G, 1, 1).expand(B, H, G, T, 1)
    return torch.softmax(torch.cat([scores.to(acc), column], dim=-1), dim=-1)[..., :-1].to(scores.dtype)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain attention. q (B, Hq, T, d), k/v (B, Hkv, S, d) -> (B, T, Hq, d) (transformers' output layout).
    ``sinks``: learned sink logits (Hq,) or None (:func:`attention_probs`)."""
    B, Hq, T, d = q.shape
    qg = grouped(q, k.shape[1])
    p = attention_probs(qg, k, allowed, scaling, softcap, sinks)
    out = torch.matmul(p, v.unsqueeze(2))  # (B, Hkv, G, T, d)
    return out.reshape(B, Hq, T, -1).transpose(1, 2).contiguous()


def selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    quantized: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention where query ``i`` sees key/value ``t`` quantized (``k_hat``, ``v_hat``) iff ``quantized[i, t]``.

    This is the exact single-pass emulation of docs/reference/math.md#32-full-precision-windows-and-the-batched-flush: scores come from the right keys, and the
    output is ``(P⊙Mask)·V̂ + (P⊙(1−Mask))·V``. ``quantized``: bool (T, S), or (B, 1, T, S) when rows
    differ (left padding). Returns (B, T, Hq, d).
    """
    B, Hq, T, d = q.shape
    qg = grouped(q, k.shape[1])
    if quantized.dim() == 4:
        quantized = quantized.unsqueeze(2)  # (B, 1, 1, T, S) against (B, Hkv, G, T, S)
    s_fp = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))
    s_q = torch.matmul(qg, k_hat.unsqueeze(2).transpose(-1, -2))
    p = _softmax(torch.where(quantized, s_q, s_fp) * scaling, allowed, softcap, sinks)  # (B, Hkv, G, T, S)
    pq = p * quantized
    out = torch.matmul(pq, v_hat.unsqueeze(2)) + torch.matmul(p - pq, v.unsqueeze(2))
    return out.reshape(B, Hq, T, -1).transpose(1, 2).contiguous()


QUERY_BLOCK: int | None = 256  # query rows per SDPA call in the emulation (see fused_selective_attention)


@contextlib.contextmanager
def query_block(block: int | None):
    """Within the block, :func:`fused_selective_attention` called with its default ``block`` takes
    ``block`` query rows per SDPA call (None: one call over every column), e.g. to time the
    unblocked emulation; the previous value comes back afterwards, also on error."""
    global QUERY_BLOCK
    if block is not None and (not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive number of query rows or None, got {block!r}")
    previous, QUERY_BLOCK = QUERY_BLOCK, block
    try:
        yield
    finally:
        QUERY_BLOCK = previous


def fused_selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    quantized: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    block: int | None | str = "default",
) -> torch.Tensor:
    """:func:`selective_attention` as fused SDPA calls over the concatenation [K; K̂].

    Every position appears once in the softmax, as its full-precision column when query ``i`` sees it
    in full precision and as its quantized column otherwise, so the result is the same; the fused
    kernel never materializes the (T, 2S) probabilities.

    Queries go in blocks of ``block`` rows (``"default"``: :data:`QUERY_BLOCK`, read at call time; None:
    one call), each against only the columns some row
    of the block can read: in a causal prefill a block reads the sink and the recent tokens in full
    precision and the middle before it quantized, about as many columns as causal attention itself,
    instead of all 2S (4× the work of causal attention at long contexts; sliding windows shrink it
    further). Returns (B, T, Hq, d).
    """
    if block == "default":
        block = QUERY_BLOCK
    if block is not None and (not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive number of query rows or None, got {block!r}")
    T, S = quantized.shape[-2:]
    base = allowed if allowed is not None else torch.ones(1, 1, T, S, dtype=torch.bool, device=q.device)
    fp, qz = base & ~quantized, base & quantized  # (B | 1, 1, T, S): read in full precision / quantized
    gqa = q.shape[1] != k.shape[1]

    def sdpa(qb, f, z):
        if block is not None:  # read only the columns some row of this block needs
            cf, cz = f.reshape(-1, S).any(0).nonzero().squeeze(1), z.reshape(-1, S).any(0).nonzero().squeeze(1)
            if cf.numel() + cz.numel() < 2 * S:
                keys = torch.cat([k.index_select(2, cf), k_hat.index_select(2, cz)], dim=2)
                vals = torch.cat([v.index_select(2, cf), v_hat.index_select(2, cz)], dim=2)
                mask = torch.cat([f.index_select(-1, cf), z.index_select(-1, cz)], dim=-1)
                return torch.nn.functional.scaled_dot_product_attention(qb, keys, vals, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        keys, vals, mask = torch.cat([k, k_hat], dim=2), torch.cat([v, v_hat], dim=2), torch.cat([f, z], dim=-1)
        return torch.nn.functional.scaled_dot_product_attention(qb, keys, vals, attn_mask=mask, scale=scaling, enable_gqa=gqa)

    step = T if block is None else block
    out = torch.cat([sdpa(q[:, :, a : a + step], fp[..., a : a + step, :], qz[..., a : a + step, :]) for a in range(0, T, step)], dim=2)
    return out.transpose(1, 2).contiguous()


def needs_reference(q: torch.Tensor, softcap: float | None, sinks: torch.Tensor | None) -> bool:
    """Whether attention must run the explicit reference instead of fused SDPA: SDPA has no logit softcap and no
    sink column, and float64 keeps the explicit reference so float64 runs are computed the same way on every path."""
    return softcap is not None or sinks is not None or q.dtype == torch.float64


def fast_attention(q, k, v, allowed, scaling, softcap=None, sinks=None) -> torch.Tensor:
    """Fused SDPA where possible (:func:`needs_reference`), else :func:`reference_attention`. Returns (B, T, Hq, d)."""
    if needs_reference(q, softcap, sinks):
        return reference_attention(q, k, v, allowed, scaling, softcap, sinks)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous()


def as_allowed(attention_mask: torch.Tensor | None, S: int) -> torch.Tensor | None:
    """The mask transformers hands us as bool (B, 1, T, S), True = attend."""
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    if attention_mask.shape[-1] != S:
        attention_mask = attention_mask[..., -S:]
    # A query row with nothing to attend to (a left-padding position) would give NaN, and NaN values
    # leak into real rows through 0·NaN in P·V: let such rows attend everywhere (their output is unused).
    return attention_mask | ~attention_mask.any(-1, keepdim=True)

