"""Decode attention that reads the packed cache directly (the performance path of one new token).

With per-token groups, a stored key is ``k̂_j = s_j·c_j + z_j`` per group (codes ``c_j`` in
``[0, 2^b)``, step/scale ``s_j``, offset ``z_j``), so for a query ``q`` (per group ``g``)::

    scores_j = Σ_g s_jg·(c_jg · q_g) + z_jg·Σ q_g                 (never forming k̂)
    out      = Σ_j p_j v̂_j = Σ_g [ C_gᵀ (p ⊙ s_g) + (Σ_j p_j z_jg)·1 ]

The quantized middle is read block by block (``block`` tokens at a time): each block's codes are
expanded to floats through a byte lookup table (one ``embedding`` gather turns a packed byte into its
``8/b`` codes), used, and dropped, so no step holds a full-precision copy of the cache; the peak is
one block. Scores of the sink, every block and the recent buffer go through one softmax; the output
sums their parts. Codecs without per-token groups (KIVI keys, KVarN tiles) are dequantized block by
block instead — the same memory bound, a slower inner loop.

Pure PyTorch: runs on any device; :func:`dequantize_then_attend` is the reference it is tested against.
"""

from __future__ import annotations

import torch

from .codecs import TokenCodec
from .quantizers import unpack

DEFAULT_BLOCK = 4096
_TABLES: dict = {}


def _byte_table(bits: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(256, 8/bits): the codes packed in each byte value (low bits first, as :func:`wushkv.quantizers.pack`)."""
    key = (bits, dtype, str(device))
    if key not in _TABLES:
        per, mask = 8 // bits, (1 << bits) - 1
        v = torch.arange(256).unsqueeze(1)
        _TABLES[key] = ((v >> (bits * torch.arange(per))) & mask).to(dtype=dtype, device=device)
    return _TABLES[key]


def codes_as_float(packed: torch.Tensor, bits: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed uint8 (..., ⌈d·b/8⌉) -> codes as ``dtype`` (..., d), via the byte table for 1/2/4 bits."""
    if bits == 8:
        return packed.to(dtype)
    if 8 % bits:
        return unpack(packed, bits, d).to(dtype)
    out = torch.nn.functional.embedding(packed.int(), _byte_table(bits, dtype, packed.device))
    return out.flatten(-2)[..., :d]


def _token_groups(codec: TokenCodec, part: dict, dtype):
    """(codes (B,H,N,ng,gs), scale (B,H,N,ng), offset (B,H,N,ng)) of a block of a TokenCodec store."""
    c = codes_as_float(part["codes"], codec.bits, codec.d, dtype)
    scale, offset = codec.scale_offset(part)
    ng = scale.shape[-1]
    return c.unflatten(-1, (ng, codec.d // ng)), scale.to(dtype), offset.to(dtype)


def _slices(store: dict, n: int, a: int, b: int) -> dict:
    """Tokens [a, b) of a codec store holding n tokens (stores may index blocks of tokens along dim 2)."""
    return {k: t[:, :, t.shape[2] * a // n : t.shape[2] * b // n] for k, t in store.items()}


def _fast(codec, dtype) -> bool:
    """The code-domain path; float64 runs dequantize exactly as the codec does (in float32), so they
    reproduce the single-pass emulation bit for bit and the exactness tests stay exact."""
    return isinstance(codec, TokenCodec) and dtype != torch.float64


def _block_scores(qg, codec, part, n_tok, dtype):
    """Scores (B, H, G, N) of grouped queries (B, H, G, d) against a block of a quantized store."""
    if _fast(codec, dtype):
        c, s, z = _token_groups(codec, part, dtype)  # c (B,H,N,ng,gs)
        B, H, G, d = qg.shape
        ng = s.shape[-1]
        if ng == 1:
            cq = torch.matmul(qg, c.squeeze(-2).transpose(-1, -2))  # (B,H,G,N)
            return cq * s[..., 0].unsqueeze(2) + qg.sum(-1, keepdim=True) * z[..., 0].unsqueeze(2)
        q5 = qg.unflatten(-1, (ng, d // ng))  # (B,H,G,ng,gs)
        cq = torch.einsum("bhngk,bhqgk->bhqng", c, q5)
        return (cq * s.unsqueeze(2)).sum(-1) + torch.einsum("bhqg,bhng->bhqn", q5.sum(-1), z)
    k_hat = codec.decode(part, n_tok).to(dtype)
    return torch.matmul(qg, k_hat.transpose(-1, -2))


def _block_output(p, codec, part, n_tok, dtype):
    """Σ_j p_j v̂_j (B, H, G, d) over a block of a quantized store; p (B, H, G, N)."""
    if _fast(codec, dtype):
        c, s, z = _token_groups(codec, part, dtype)
        ng = s.shape[-1]
        if ng == 1:
            return torch.matmul(p * s[..., 0].unsqueeze(2), c.squeeze(-2)) + torch.matmul(p, z)
        out = torch.einsum("bhqn,bhng,bhngk->bhqgk", p, s, c) + torch.einsum("bhqn,bhng->bhqg", p, z).unsqueeze(-1)
        return out.flatten(-2)
    return torch.matmul(p, codec.decode(part, n_tok).to(dtype))


def decode_attention(
    query: torch.Tensor,
    parts_k: list,
    parts_v: list,
    allowed: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Attention of one new query per row over a cache given as parts, in position order.

    ``query`` (B, Hq, 1, d) (already in transformed space). ``parts_k``/``parts_v``: lists of either a
    full-precision tensor (B, Hkv, n, d) or a tuple ``(codec, store, n)`` (a quantized run of ``n``
    tokens; ``store`` as the codec encodes it). Every part is read; ``allowed`` (B, 1, 1, S) masks the
    last ``S`` columns (earlier columns are not visible, e.g. outside a sliding window).
    Returns (B, 1, Hq, d), transformers' layout.
    """
    B, Hq, T, d = query.shape
    if T != 1:
        raise ValueError(f"decode_attention takes one query position, got {T}")
    first = parts_k[0]
    Hkv = first.shape[1] if torch.is_tensor(first) else first[1]["codes"].shape[1]
    G = Hq // Hkv
    dtype = query.dtype
    qg = query.view(B, Hkv, G, d)
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    # 1. scores of every part, in position order, block by block for quantized runs
    pieces = []  # (kind, payload) for the output pass
    scores = []
    for pk in parts_k:
        if torch.is_tensor(pk):
            if pk.shape[2]:
                scores.append(torch.matmul(qg, pk.transpose(-1, -2)).to(acc_dtype))
        else:
            codec, store, n = pk
            step = max(codec.block, block // codec.block * codec.block)
            for a in range(0, n, step):
                b = min(n, a + step)
                scores.append(_block_scores(qg, codec, _slices(store, n, a, b), b - a, dtype).to(acc_dtype))
    s = torch.cat(scores, dim=-1) * scaling  # (B, Hkv, G, N_all)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n_all = s.shape[-1]
    if allowed is not None:
        S = allowed.shape[-1]
        keep = torch.zeros(B, 1, 1, n_all, dtype=torch.bool, device=s.device)
        keep[..., n_all - S :] = allowed.reshape(B, 1, 1, S)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).to(dtype)

    # 2. output: the same parts, in the same order, weighted by their slice of p
    out = None
    col = 0
    for pv in parts_v:
        if torch.is_tensor(pv):
            n = pv.shape[2]
            if n:
                o = torch.matmul(p[..., col : col + n], pv)
                out = o if out is None else out + o
            col += n
        else:
            codec, store, n = pv
            step = max(codec.block, block // codec.block * codec.block)
            for a in range(0, n, step):
                b = min(n, a + step)
                o = _block_output(p[..., col + a : col + b], codec, _slices(store, n, a, b), b - a, dtype)
                out = o if out is None else out + o
            col += n
    if col != n_all:
        raise ValueError(f"keys cover {n_all} positions but values {col}")
    return out.reshape(B, Hq, 1, -1).transpose(1, 2)


def dequantize_then_attend(query, parts_k, parts_v, allowed, scaling, softcap=None) -> torch.Tensor:
    """Reference: dequantize every part, concatenate, plain attention. Returns (B, 1, Hq, d)."""
    from .attention import reference_attention

    def full(parts):
        xs = [p if torch.is_tensor(p) else p[0].decode(p[1], p[2]).to(query.dtype) for p in parts if torch.is_tensor(p) or p[2]]
        return torch.cat(xs, dim=2)

    K, V = full(parts_k), full(parts_v)
    if allowed is not None:
        S = allowed.shape[-1]
        K, V = K[:, :, -S:], V[:, :, -S:]
    return reference_attention(query, K, V, allowed, scaling, softcap)


__all__ = ["decode_attention", "dequantize_then_attend", "codes_as_float", "DEFAULT_BLOCK"]
