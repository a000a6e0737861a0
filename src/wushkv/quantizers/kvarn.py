"""KVarN: calibration-free tile quantization of the KV cache (docs/reference/math.md#7-kvarn-tiles), a quantizer of token tiles.

Per (layer, KV head) the cache is cut into tiles of G = ``tile`` consecutive tokens × d channels.
Step 1 (the normalized Hadamard 𝓗 along channels) is the caller's key/value transform: every
function here receives tiles that are *already rotated*.

Per tile, with A the R×C tile matrix (keys: A = Xᵀ-tile [d × G], channels × tokens; values:
A = [G × d], tokens × channels):

2. ``balance``: dual-axis variance normalization in the log domain,
   A = B ⊙ (exp ℓ_r · exp ℓ_cᵀ).
3. Asymmetric round-to-nearest along the rows of B (keys: one scale/zero per channel over the
   tile's tokens; values: one per token):  scale_r = max((hi_r − lo_r)/(2^b − 1), 1e-10),
   q = clamp(round((B − lo_r)/scale_r), 0, 2^b − 1).
4. Fold the normalization into fp16 metadata:
   Â[r, c] = s_fold[c] · (scale'_r · q[r, c] + zp'_r),
   scale'_r = exp(ℓ_r)·scale_r,  zp'_r = exp(ℓ_r)·lo_r,  s_fold[c] = exp(ℓ_c).
   For keys (r = channel, c = token) this is K̂[c,t] = s_tok[t]·(scale'_c·q + zp'_c); for values
   (r = token, c = channel) it is V̂[t,c] = s_chan[c]·(scale'_t·q + zp'_t).

Dequantization is exactly that formula, in float32, from the stored float16 metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .quest import QUEST_ALPHA

__all__ = [
    "KVarNTiles",
    "balance",
    "imbalance",
    "kvarn_dequantize",
    "kvarn_fake",
    "kvarn_nbytes",
    "kvarn_quantize",
]

_KINDS = ("key", "value")
# Constants of docs/reference/math.md#7-kvarn-tiles step 2-3 (KVarN reference code).
_STD_FLOOR = 1e-8  # denominator floor of the imbalance ratio
_STD_CLAMP = (1e-3, 1e3)  # per-iteration std clamp
_LOG_CLAMP = (-0.3, 10.0)  # log-scale clamp: scales live in [e^-0.3, e^10], inside fp16 range
_SCALE_FLOOR = 1e-10  # quantizer step floor, keeps constant rows finite


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"KVarN `bits` must be an int in 1..8, got {bits!r}")


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"KVarN `kind` must be one of {list(_KINDS)}, got {kind!r}")


def _check_tile(tile: int) -> None:
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 2:
        raise ValueError(f"KVarN `tile` must be an int >= 2, got {tile!r}")


def imbalance(B: Tensor) -> Tensor:
    """Imbalance of tiles B [..., R, C] → [...] (float32).

    max_col std / max(min_col std, 1e-8) + max_row std / max(min_row std, 1e-8), with the
    unbiased (correction=1), mean-centred standard deviation. 0 for a constant tile.
    """
    B = B.float()
    std_col = B.std(dim=-2, correction=1)  # (..., C)
    std_row = B.std(dim=-1, correction=1)  # (..., R)
    ratio_col = std_col.amax(-1) / std_col.amin(-1).clamp_min(_STD_FLOOR)
    ratio_row = std_row.amax(-1) / std_row.amin(-1).clamp_min(_STD_FLOOR)
    return ratio_col + ratio_row


def _divide_out(A: Tensor, log_r: Tensor, log_c: Tensor) -> Tensor:
    # B = A ⊘ (exp ℓ_r · exp ℓ_cᵀ), (..., R, C)
    return A / (log_r.exp().unsqueeze(-1) * log_c.exp().unsqueeze(-2))


def _fused_kernels(t: Tensor):
    # the compiled tile kernels (csrc/codes.cpp) for a CPU tensor, None where they are not built
    if t.device.type != "cpu":
        return None
    from .._ext import kernels

    ext = kernels()
    return ext if ext is not None and hasattr(ext, "kvarn_balance") else None


def balance(A: Tensor, iters: int = 16, *, fused: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Dual-axis variance normalization in the log domain (docs/reference/math.md#7-kvarn-tiles step 2), batched.

    Args:
        A: tiles [..., R, C], any float dtype; computed in float32. R, C >= 2.
        iters: number of (column, row) update rounds.

    Returns:
        (B, log_r, log_c): B float32 [..., R, C], log_r float32 [..., R], log_c float32 [..., C],
        with A == B * exp(log_r)[..., :, None] * exp(log_c)[..., None, :] up to float32 rounding.
        Per batch element the scales are those of lowest ``imbalance`` among the start
        (ℓ = 0, B = A) and the ``iters`` rounds; ties keep the earlier one. All ℓ lie in
        [-0.3, 10].

    ``fused``: CPU tiles go through the compiled kernel (``csrc/codes.cpp``, about 17× faster) when it is built; this
    loop is its reference. The two agree to float32 rounding (their reductions sum in different orders), so a tile
    whose two best rounds have nearly equal imbalance may keep a different round.
    """
    if A.dim() < 2 or A.shape[-1] < 2 or A.shape[-2] < 2:
        raise ValueError(
            f"balance needs tiles [..., R, C] with R, C >= 2 (unbiased std), got shape "
            f"{tuple(A.shape)}"
        )
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"balance `iters` must be an int >= 0, got {iters!r}")
    A = A.float()
    log_r = A.new_zeros(A.shape[:-1])  # (..., R)
    log_c = A.new_zeros(A.shape[:-2] + A.shape[-1:])  # (..., C)
    if A.numel() == 0:  # empty batch: nothing to balance (and std would warn)
        return A, log_r, log_c
    ext = _fused_kernels(A) if fused else None
    if ext is not None:
        B, log_r, log_c = ext.kvarn_balance(A.reshape(-1, *A.shape[-2:]), iters)
        return B.view(A.shape), log_r.view(A.shape[:-1]), log_c.view(*A.shape[:-2], A.shape[-1])
    best_r, best_c = log_r, log_c
    best_imb = imbalance(A)  # (...,) the starting point counts
    B = A
    lo_std, hi_std = _STD_CLAMP
    lo_log, hi_log = _LOG_CLAMP
    for _ in range(iters):
        std_c = B.std(dim=-2, correction=1).clamp(lo_std, hi_std)  # (..., C)
        log_c = (log_c + std_c.log()).clamp(lo_log, hi_log)
        B = _divide_out(A, log_r, log_c)
        std_r = B.std(dim=-1, correction=1).clamp(lo_std, hi_std)  # (..., R)
        log_r = (log_r + std_r.log()).clamp(lo_log, hi_log)
        B = _divide_out(A, log_r, log_c)
        imb = imbalance(B)
        # Strictly better only: a NaN imbalance never replaces the incumbent.
        better = imb < best_imb  # (...,)
        best_imb = torch.where(better, imb, best_imb)
        best_r = torch.where(better.unsqueeze(-1), log_r, best_r)
        best_c = torch.where(better.unsqueeze(-1), log_c, best_c)
    return _divide_out(A, best_r, best_c), best_r, best_c


@dataclass(frozen=True, eq=False)
class KVarNTiles:
    """KVarN-quantized keys or values of shape [..., T, d], n = T / tile tiles.

    Dequantization, per tile, with A the tile matrix (keys: [d × G], values: [G × d]):
        Â[r, c] = s_fold[c] · (scale[r] · q[r, c] + zero[r])      (float32 arithmetic)

    Fields (``...`` are the caller's leading dims, e.g. batch and KV head):
        codes:  uint8 [..., T, d], unpacked codes in 0..2^bits−1, token-major (original layout).
        scale:  float16 scale'_r = exp(ℓ_r)·scale_r;  keys [..., n, d] (per channel),
                values [..., n, tile] (per token).
        zero:   float16 zp'_r = exp(ℓ_r)·lo_r; same shape as ``scale``.
        s_fold: float16 exp(ℓ_c);  keys: s_tok [..., n, tile] (per token),
                values: s_chan [..., n, d] (per channel).
        bits:   1..8.  kind: "key" or "value".  tile: tokens per tile G.
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor
    s_fold: Tensor
    bits: int
    kind: str
    tile: int

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_kind(self.kind)
        _check_tile(self.tile)
        if self.codes.dtype != torch.uint8 or self.codes.dim() < 2:
            raise ValueError(
                f"codes must be uint8 [..., T, d], got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        *lead, T, d = self.codes.shape
        if T % self.tile:
            raise ValueError(f"codes have T={T} tokens, not a multiple of tile={self.tile}")
        n = T // self.tile
        row, col = (d, self.tile) if self.kind == "key" else (self.tile, d)
        expect = {"scale": (*lead, n, row), "zero": (*lead, n, row), "s_fold": (*lead, n, col)}
        for name, shape in expect.items():
            t = getattr(self, name)
            if t.dtype != torch.float16 or tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} must be float16 {shape} for kind={self.kind!r}, got {t.dtype} "
                    f"{tuple(t.shape)}"
                )

    @property
    def shape(self) -> torch.Size:
        """Shape [..., T, d] of the quantized tensor."""
        return self.codes.shape


def _to_tiles(x: Tensor, tile: int, kind: str) -> Tensor:
    # (..., T, d) -> (..., n, G, d) -> tile matrices A: keys (..., n, d, G), values (..., n, G, d)
    *lead, T, d = x.shape
    tiles = x.reshape(*lead, T // tile, tile, d)
    return tiles.transpose(-1, -2) if kind == "key" else tiles


def _from_tiles(A: Tensor, kind: str) -> Tensor:
    # inverse of _to_tiles: (..., n, R, C) -> (..., T, d)
    tiles = A.transpose(-1, -2) if kind == "key" else A  # (..., n, G, d)
    *lead, n, G, d = tiles.shape
    return tiles.reshape(*lead, n * G, d)


def _check_clip(clip: float) -> None:
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (0.0 <= clip < float("inf")):
        raise ValueError(f"KVarN `clip` must be a finite number >= 0 (0 = each row's min-max, as KVarN ships), got {clip!r}")


def kvarn_quantize(x: Tensor, bits: int, kind: str, tile: int = 128, clip: float = 0.0, feedback: Tensor | None = None, *,
                   fused: bool = True) -> KVarNTiles:
    """Quantize already-rotated keys or values x [..., T, d] with KVarN (docs/reference/math.md#7-kvarn-tiles steps 2-4).

    T must be a multiple of ``tile`` (the cache keeps the remainder in its fp16 tail) and
    d >= 2. Computation is float32 whatever x's dtype. Inputs are assumed finite and within the
    float16 range (the folded zero points are stored in float16).

    ``clip`` (wushkv's addition; 0 = KVarN as published): each balanced row is quantized over
    [max(lo_r, μ_r − c), min(hi_r, μ_r + c)] with c = clip·α_b·σ_r (μ_r, σ_r the row's mean and
    standard deviation, α_b QuEST's Gaussian-optimal clip level) instead of its full [lo_r, hi_r];
    values outside clamp to the end levels. Same codes, metadata and bytes. The min-max range of a
    Gaussian row of 128 samples is about ±2.6σ while the 4-level grid of least squared error spans
    ±1.49σ, so at 2 bits the published grid is ~1.7× too coarse (docs/lab/tile-clip.md).

    ``feedback`` (keys only; wushkv's addition): F [..., d, d], unit upper triangular
    (:func:`wushkv.quantizers.feedback.feedback_matrix` of the query Hessian in this key space),
    broadcastable to x's leading dims (e.g. [heads, d, d] for x [batch, heads, T, d]). The channel
    rows of each tile are then quantized one after another, GPTQ-style with one group per row: row r's
    grid (min-max or clip) is taken from the row as updated by the earlier rows' errors, and its error
    over the tile's tokens, e_r = A_r − Â_r (Â from the float16 metadata as stored), is pushed onto the
    rows not yet quantized, A_{r'} −= F[r, r']·e_r. The balance scales come from the original tile.
    Same codes format, metadata and bytes; F = I gives the plain codes exactly.

    ``fused``: on CPU, the balance and the rows run in the compiled kernels (``csrc/codes.cpp``) when they are built;
    the PyTorch code here is their reference (:func:`balance`; codes equal but where float32 rounding puts a value on
    a rounding boundary). wushkv's cache and the vLLM plugin both quantize through this function, so they store the
    same tiles either way.
    """
    _check_bits(bits)
    _check_kind(kind)
    _check_tile(tile)
    _check_clip(clip)
    if x.dim() < 2:
        raise ValueError(f"x must be [..., T, d], got shape {tuple(x.shape)}")
    T, d = x.shape[-2], x.shape[-1]
    if T % tile:
        raise ValueError(f"T={T} tokens is not a multiple of tile={tile}")
    if d < 2:
        raise ValueError(f"head dim d={d} must be >= 2")

    if feedback is not None:
        _check_feedback(feedback, x, kind)

    A = _to_tiles(x.float(), tile, kind)  # (..., n, R, C)
    ext = _fused_kernels(A) if fused and A.numel() else None
    B, log_r, log_c = balance(A, fused=fused)
    if ext is not None:
        R, C = A.shape[-2:]
        F = (feedback.to(torch.float32).unsqueeze(-3).expand(*A.shape[:-2], R, R).reshape(-1, R, R) if feedback is not None
             else A.new_empty(0))
        q, lo, step = ext.kvarn_rows(A.reshape(-1, R, C), log_r.reshape(-1, R), log_c.reshape(-1, C), F, bits, float(clip),
                                     float(QUEST_ALPHA[bits]))
        q, lo, step = q.view(A.shape), lo.view(log_r.shape), step.view(log_r.shape)
    elif feedback is None:
        lo, step = _row_grid(B, bits, clip)  # (..., n, R)
        q = torch.round((B - lo.unsqueeze(-1)) / step.unsqueeze(-1)).clamp_(0, 2**bits - 1)  # (..., n, R, C)
    else:
        q, lo, step = _feedback_rows(A, log_r, log_c, bits, clip, feedback)

    row_exp = log_r.exp()  # (..., n, R)
    return KVarNTiles(
        codes=_from_tiles(q.to(torch.uint8), kind).contiguous(),  # (..., T, d)
        scale=(row_exp * step).to(torch.float16),
        zero=(row_exp * lo).to(torch.float16),
        s_fold=log_c.exp().to(torch.float16),
        bits=bits,
        kind=kind,
        tile=tile,
    )


def _row_grid(b: Tensor, bits: int, clip: float) -> tuple[Tensor, Tensor]:
    # (lo, step) of balanced rows b (..., C): min-max, or clipped to mean ± clip·α_b·σ
    lo, hi = b.amin(-1), b.amax(-1)
    if clip > 0:
        mu, half = b.mean(-1), clip * QUEST_ALPHA[bits] * b.std(-1, correction=0)
        lo, hi = torch.maximum(lo, mu - half), torch.minimum(hi, mu + half)
    return lo, ((hi - lo) / (2**bits - 1)).clamp_min(_SCALE_FLOOR)


def _check_feedback(feedback: Tensor, x: Tensor, kind: str) -> None:
    d = x.shape[-1]
    if kind != "key":
        raise ValueError(f"KVarN error feedback runs along the channels of key tiles; got kind={kind!r}")
    if not isinstance(feedback, Tensor) or feedback.shape[-2:] != (d, d):
        raise ValueError(f"KVarN feedback must be a tensor [..., {d}, {d}], got {tuple(getattr(feedback, 'shape', ()))}")
    try:
        torch.broadcast_shapes(feedback.shape[:-2], x.shape[:-2])
    except RuntimeError:
        raise ValueError(f"KVarN feedback {tuple(feedback.shape)} does not broadcast over the leading dims {tuple(x.shape[:-2])} of x "
                         "(e.g. [heads, d, d] for x [batch, heads, T, d])") from None


def _feedback_rows(A: Tensor, log_r: Tensor, log_c: Tensor, bits: int, clip: float, feedback: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # (codes, lo, step) of key tiles A (..., n, d, G), channel rows in order, each row's error pushed onto the later rows.
    d = A.shape[-2]
    F = feedback.to(device=A.device, dtype=torch.float32).unsqueeze(-3)  # (..., 1, d, d): broadcasts over tiles
    W = A.clone()
    row_exp, fold = log_r.exp(), log_c.exp()  # (..., n, d), (..., n, G)
    fold16 = fold.to(torch.float16).float()
    q, lo, step = torch.empty_like(W), torch.empty_like(log_r), torch.empty_like(log_r)
    for r in range(d):
        b = W[..., r, :] / (row_exp[..., r, None] * fold)  # the balanced row as updated so far
        lo[..., r], step[..., r] = lo_r, step_r = _row_grid(b, bits, clip)
        q[..., r, :] = q_r = torch.round((b - lo_r.unsqueeze(-1)) / step_r.unsqueeze(-1)).clamp_(0, 2**bits - 1)
        if r + 1 < d:  # the error as the decoder will read it (float16 metadata)
            s16 = (row_exp[..., r] * step_r).to(torch.float16).float().unsqueeze(-1)
            z16 = (row_exp[..., r] * lo_r).to(torch.float16).float().unsqueeze(-1)
            e = W[..., r, :] - fold16 * (s16 * q_r + z16)  # (..., n, G)
            W[..., r + 1 :, :] -= F[..., r, r + 1 :].unsqueeze(-1) * e.unsqueeze(-2)
    return q, lo, step


def kvarn_dequantize(t: KVarNTiles) -> Tensor:
    """float32 [..., T, d]: Â[r, c] = s_fold[c]·(scale[r]·q[r, c] + zero[r]) per tile."""
    q = _to_tiles(t.codes, t.tile, t.kind).float()  # (..., n, R, C)
    scale = t.scale.float().unsqueeze(-1)  # (..., n, R, 1)
    zero = t.zero.float().unsqueeze(-1)  # (..., n, R, 1)
    s_fold = t.s_fold.float().unsqueeze(-2)  # (..., n, 1, C)
    return _from_tiles(s_fold * (scale * q + zero), t.kind).contiguous()


def kvarn_fake(x: Tensor, bits: int, kind: str, tile: int = 128, clip: float = 0.0, feedback: Tensor | None = None) -> Tensor:
    """Fake-quantize: ``kvarn_dequantize(kvarn_quantize(x, bits, kind, tile, clip, feedback))``, float32."""
    return kvarn_dequantize(kvarn_quantize(x, bits, kind, tile, clip, feedback))


def kvarn_nbytes(t: KVarNTiles) -> int:
    """Storage bytes: codes packed at ``t.bits`` per code plus float16 metadata."""
    code_bytes = math.ceil(t.codes.numel() * t.bits / 8)
    meta_bytes = sum(m.numel() * m.element_size() for m in (t.scale, t.zero, t.s_fold))
    return code_bytes + meta_bytes
