"""Tests for KVarN (docs/reference/math.md#7-kvarn-tiles): balancing, quantize/dequantize algebra, error bound, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wushkv.quantizers.kvarn import (
    KVarNTiles,
    balance,
    imbalance,
    kvarn_dequantize,
    kvarn_fake,
    kvarn_nbytes,
    kvarn_quantize,
)

FP16_EPS = 2.0**-11  # unit roundoff of float16 (normal range)
FP16_TINY = 2.0**-25  # half the smallest float16 subnormal: absolute rounding error below 2^-14


def _heavy_tiles(seed: int, batch: tuple[int, ...], R: int, C: int, spread: float) -> torch.Tensor:
    """Student-t (3 d.o.f.) tiles with log-normal row and column scales: [*batch, R, C]."""
    g = torch.Generator().manual_seed(seed)
    shape = (*batch, R, C)
    chi2 = sum(torch.randn(shape, generator=g) ** 2 for _ in range(3))
    t = torch.randn(shape, generator=g) / (chi2 / 3).sqrt()
    row = torch.exp(spread * torch.randn((*batch, R, 1), generator=g))
    col = torch.exp(spread * torch.randn((*batch, 1, C), generator=g))
    return t * row * col


# ---------------------------------------------------------------- slow references (from docs/reference/math.md#7-kvarn-tiles)


def _ref_std(vals: list[float]) -> float:
    n = len(vals)
    m = sum(vals) / n
    return math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1))


def _ref_imbalance(B: list[list[float]]) -> float:
    R, C = len(B), len(B[0])
    col = [_ref_std([B[r][c] for r in range(R)]) for c in range(C)]
    row = [_ref_std(B[r]) for r in range(R)]
    return max(col) / max(min(col), 1e-8) + max(row) / max(min(row), 1e-8)


def _ref_balance(A: torch.Tensor, iters: int = 16) -> tuple[list[float], list[float]]:
    """Loop-by-loop transcription of docs/reference/math.md#7-kvarn-tiles step 2 in float64 for one R×C tile."""
    a = A.double().tolist()
    R, C = len(a), len(a[0])
    lr, lc = [0.0] * R, [0.0] * C

    def divided() -> list[list[float]]:
        return [[a[r][c] / (math.exp(lr[r]) * math.exp(lc[c])) for c in range(C)] for r in range(R)]

    B = divided()
    best = (_ref_imbalance(B), list(lr), list(lc))
    for _ in range(iters):
        for c in range(C):
            s = min(max(_ref_std([B[r][c] for r in range(R)]), 1e-3), 1e3)
            lc[c] = min(max(lc[c] + math.log(s), -0.3), 10.0)
        B = divided()
        for r in range(R):
            s = min(max(_ref_std(B[r]), 1e-3), 1e3)
            lr[r] = min(max(lr[r] + math.log(s), -0.3), 10.0)
        B = divided()
        imb = _ref_imbalance(B)
        if imb < best[0]:
            best = (imb, list(lr), list(lc))
    return best[1], best[2]


def _ref_quantize_tile(B: torch.Tensor, lr: torch.Tensor, lc: torch.Tensor, bits: int):
    """docs/reference/math.md#7-kvarn-tiles steps 3-4 element by element on a balanced R×C tile (float32 scalar arithmetic).

    Returns codes [R, C] and float16 scale' [R], zp' [R], s_fold [C].
    """
    R, C = B.shape
    f32 = torch.float32
    qmax = 2**bits - 1
    q = torch.zeros(R, C, dtype=torch.uint8)
    scale_p = torch.zeros(R, dtype=torch.float16)
    zp_p = torch.zeros(R, dtype=torch.float16)
    for r in range(R):
        lo = min(B[r, c] for c in range(C))
        hi = max(B[r, c] for c in range(C))
        step = torch.maximum(
            (hi - lo) / torch.tensor(qmax, dtype=f32),
            torch.tensor(1e-10, dtype=f32),
        )
        for c in range(C):
            q[r, c] = int(torch.clamp(torch.round((B[r, c] - lo) / step), 0, qmax))
        scale_p[r] = math.exp(float(lr[r])) * float(step)
        zp_p[r] = math.exp(float(lr[r])) * float(lo)
    s_fold = torch.tensor([math.exp(float(lc[c])) for c in range(C)], dtype=torch.float16)
    return q, scale_p, zp_p, s_fold


def _ref_dequant_tile(q, scale_p, zp_p, s_fold, kind: str) -> torch.Tensor:
    """K̂[c,t] = s_tok[t]·(scale'_c·q + zp'_c) / V̂[t,c] = s_chan[c]·(scale'_t·q + zp'_t).

    q is given token-major [G, d]; returns token-major [G, d] float32.
    """
    G, d = q.shape
    out = torch.zeros(G, d)
    for t in range(G):
        for c in range(d):
            qq = q[t, c].float()
            if kind == "key":
                out[t, c] = s_fold[t].float() * (scale_p[c].float() * qq + zp_p[c].float())
            else:
                out[t, c] = s_fold[c].float() * (scale_p[t].float() * qq + zp_p[t].float())
    return out


def _per_token_minmax(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Baseline: asymmetric RTN, one scale/zero per token over its d channels."""
    qmax = 2**bits - 1
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    step = ((hi - lo) / qmax).clamp_min(1e-10)
    return torch.round((x - lo) / step).clamp(0, qmax) * step + lo


def _tile_view(x: torch.Tensor, tile: int, kind: str) -> torch.Tensor:
    """[..., T, d] -> tile matrices: keys [..., n, d, G], values [..., n, G, d]."""
    *lead, T, d = x.shape
    tiles = x.reshape(*lead, T // tile, tile, d)
    return tiles.transpose(-1, -2) if kind == "key" else tiles


# ---------------------------------------------------------------- balance


def test_imbalance_matches_reference():
    A = _heavy_tiles(0, (3,), 6, 10, spread=1.0)
    got = imbalance(A)
    for i in range(3):
        assert got[i].item() == pytest.approx(_ref_imbalance(A[i].double().tolist()), rel=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    R=st.integers(2, 24),
    C=st.integers(2, 24),
    spread=st.floats(0.0, 2.5),
)
def test_balance_never_worse_and_identity(seed, R, C, spread):
    A = _heavy_tiles(seed, (2, 3), R, C, spread)
    B, log_r, log_c = balance(A)
    assert B.shape == A.shape and log_r.shape == (2, 3, R) and log_c.shape == (2, 3, C)
    assert B.dtype == log_r.dtype == log_c.dtype == torch.float32
    # best-so-far rule, per batch element (the start counts)
    assert (imbalance(B) <= imbalance(A) * (1 + 1e-6)).all()
    # A = B ⊙ (exp ℓ_r · exp ℓ_cᵀ)
    rebuilt = B * log_r.exp()[..., :, None] * log_c.exp()[..., None, :]
    torch.testing.assert_close(rebuilt, A, rtol=1e-5, atol=1e-6 * A.abs().max().item())
    assert (log_r >= -0.3).all() and (log_r <= 10).all()
    assert (log_c >= -0.3).all() and (log_c <= 10).all()


def test_balance_strictly_improves_strong_imbalance():
    A = _heavy_tiles(1, (4, 2), 64, 128, spread=2.0)
    before, after = imbalance(A), imbalance(balance(A)[0])
    assert (after < 0.2 * before).all(), (before, after)


def test_balance_batched_equals_per_element():
    # one element already balanced-ish, one strongly imbalanced: selection is per element
    A = torch.stack([_heavy_tiles(2, (), 8, 12, 0.0), _heavy_tiles(3, (), 8, 12, 2.5)])
    B, lr, lc = balance(A)
    for i in range(2):
        Bi, lri, lci = balance(A[i])
        torch.testing.assert_close(B[i], Bi)
        torch.testing.assert_close(lr[i], lri)
        torch.testing.assert_close(lc[i], lci)


def test_balance_matches_loop_reference():
    for seed, spread in [(4, 0.5), (5, 1.5), (6, 2.5)]:
        A = _heavy_tiles(seed, (), 6, 9, spread)
        _, lr, lc = balance(A)
        ref_r, ref_c = _ref_balance(A)
        ref_r, ref_c = torch.tensor(ref_r), torch.tensor(ref_c)  # float32
        torch.testing.assert_close(lr, ref_r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lc, ref_c, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- quantize / dequantize algebra


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("bits", [2, 4])
def test_matches_loop_reference(kind, bits):
    tile, d = 8, 6
    x = _heavy_tiles(7, (), 2 * tile, d, spread=1.0)  # [T=16, d=6]: two tiles
    t = kvarn_quantize(x, bits, kind, tile=tile)
    out = kvarn_dequantize(t)
    A = _tile_view(x, tile, kind)  # [n, R, C]
    B, lr, lc = balance(A)
    for i in range(2):
        q, scale_p, zp_p, s_fold = _ref_quantize_tile(B[i], lr[i], lc[i], bits)
        q_tok = q.T if kind == "key" else q  # token-major [G, d]
        rows = slice(i * tile, (i + 1) * tile)
        # identical float32 arithmetic → identical codes
        assert torch.equal(t.codes[rows], q_tok)
        # metadata agrees to float16 rounding (reference exp is float64)
        torch.testing.assert_close(t.scale[i], scale_p, rtol=2 * FP16_EPS, atol=1e-7)
        torch.testing.assert_close(t.zero[i], zp_p, rtol=2 * FP16_EPS, atol=1e-7)
        torch.testing.assert_close(t.s_fold[i], s_fold, rtol=2 * FP16_EPS, atol=0)
        # dequantization is exactly the step-4 formula on the stored fp16 metadata
        own = _ref_dequant_tile(t.codes[rows], t.scale[i], t.zero[i], t.s_fold[i], kind)
        torch.testing.assert_close(out[rows], own, rtol=1e-6, atol=0)
        # and the full reference pipeline agrees up to fp16 metadata rounding
        ref = _ref_dequant_tile(q_tok, scale_p, zp_p, s_fold, kind)
        slack = 8 * FP16_EPS * (x[rows].abs() + own.abs() + 1e-6)
        assert ((out[rows] - ref).abs() <= slack).all()


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_error_bound(kind, bits):
    """|x̂ − x| ≤ ½·s·σ + η·s·(qmax·σ + |z|) + float32 slack, per element.

    With u = (B − lo)/step ∈ [0, qmax] and |q − u| ≤ ½:  x = s(σu + z), x̂ = s̃(σ̃q + z̃) where
    s, σ = e^{ℓ_r}·step, z = e^{ℓ_r}·lo are float32 and s̃, σ̃, z̃ their float16 roundings.
    x̂ − x = s̃σ̃(q − u) + (s̃σ̃ − sσ)u + (s̃z̃ − sz), and |s̃σ̃ − sσ| ≤ s̃σ̃·η with
    η = (2ε + ε²)/(1 − ε)², ε = 2^-11 (plus 2^-25 absolute per value in the subnormal range).
    """
    tile = 16
    x = _heavy_tiles(8, (2, 3), 4 * tile, 32, spread=1.5)  # [2, 3, T=64, d=32]
    t = kvarn_quantize(x, bits, kind, tile=tile)
    err = (kvarn_dequantize(t) - x).abs()

    qmax = 2**bits - 1
    eta = (2 * FP16_EPS + FP16_EPS**2) / (1 - FP16_EPS) ** 2
    s, sig, z = t.s_fold.float(), t.scale.float(), t.zero.float()
    # broadcast to tile matrices [..., n, R, C], then back to token-major [..., T, d]
    s_, sig_, z_ = s.unsqueeze(-2), sig.unsqueeze(-1), z.unsqueeze(-1)
    bound = 0.5 * s_ * sig_ + eta * s_ * (qmax * sig_ + z_.abs())
    bound = bound + s_ * (qmax + 1) * FP16_TINY * 2 + 1e-6 * s_ * (qmax * sig_ + z_.abs())
    bound = bound.transpose(-1, -2) if kind == "key" else bound
    bound = bound.reshape(x.shape) + 1e-6 * x.abs()
    assert (err <= bound).all(), (err - bound).max()
    # the bound is not vacuous: at <= 4 bits it is the half-step term plus a few percent
    if bits <= 4:
        half = (0.5 * s_ * sig_).expand_as(bound.reshape(z_.shape[:-1] + s_.shape[-1:]))
        half = half.transpose(-1, -2) if kind == "key" else half
        ratio = bound / half.reshape(x.shape)
        assert ratio.median() < 1.1, ratio.median()


def test_more_bits_less_error():
    x = _heavy_tiles(9, (), 256, 32, spread=1.0)
    for kind in ("key", "value"):
        mse = [((kvarn_fake(x, b, kind) - x) ** 2).mean().item() for b in (2, 3, 4, 8)]
        assert mse == sorted(mse, reverse=True), (kind, mse)
        assert mse[-1] < 1e-3 * mse[0]


def test_beats_per_token_minmax_on_channel_outlier_keys():
    g = torch.Generator().manual_seed(10)
    T, d = 256, 64
    chan = torch.ones(d)
    chan[torch.randperm(d, generator=g)[:4]] = 30.0  # a few outlier channels
    bias = 2.0 * torch.randn(d, generator=g)  # per-channel key offsets
    x = (torch.randn(4, T, d, generator=g) * chan + bias * chan)  # [heads=4, T, d]
    mse_kvarn = ((kvarn_fake(x, 4, "key") - x) ** 2).mean()
    mse_token = ((_per_token_minmax(x, 4) - x) ** 2).mean()
    assert mse_kvarn < 0.25 * mse_token, (mse_kvarn, mse_token)


def test_layout_shapes_dtypes_and_nbytes():
    x = torch.randn(2, 3, 256, 64, dtype=torch.float16)  # [B, H, T, d]
    for kind, row, col in [("key", 64, 128), ("value", 128, 64)]:
        t = kvarn_quantize(x, 4, kind)
        assert isinstance(t, KVarNTiles) and t.kind == kind and t.bits == 4 and t.tile == 128
        assert t.codes.dtype == torch.uint8 and t.codes.shape == (2, 3, 256, 64)
        assert int(t.codes.max()) <= 15
        assert t.scale.shape == t.zero.shape == (2, 3, 2, row)
        assert t.s_fold.shape == (2, 3, 2, col)
        assert t.scale.dtype == t.zero.dtype == t.s_fold.dtype == torch.float16
        out = kvarn_dequantize(t)
        assert out.dtype == torch.float32 and out.shape == x.shape
        # fp16 bytes × (6 heads × 2 tiles) × per-tile metadata values
        meta = 2 * (6 * 2) * (2 * row + col)
        assert kvarn_nbytes(t) == 2 * 3 * 256 * 64 * 4 // 8 + meta
    t3 = kvarn_quantize(torch.randn(1, 128, 3), 3, "value")  # 384 codes * 3 bits = 144 bytes
    assert kvarn_nbytes(t3) == 144 + 2 * (128 + 128 + 3)
    with pytest.raises(Exception):
        t3.bits = 4  # frozen


def test_tiles_are_independent():
    x = _heavy_tiles(11, (2,), 256, 32, spread=1.0)
    full = kvarn_fake(x, 2, "value")
    second = kvarn_fake(x[:, 128:], 2, "value")
    torch.testing.assert_close(full[:, 128:], second, rtol=0, atol=0)


# ---------------------------------------------------------------- degenerate tiles


@pytest.mark.parametrize("kind", ["key", "value"])
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("const", [0.0, 3.3, -1e-3, 500.0])
def test_constant_and_zero_tiles(kind, bits, const):
    x = torch.full((2, 256, 16), const)
    x[1, 128:] = 0.0  # one all-zero tile beside constant ones
    t = kvarn_quantize(x, bits, kind)
    for m in (t.scale, t.zero, t.s_fold):
        assert torch.isfinite(m).all()
    out = kvarn_dequantize(t)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, x, rtol=2 * FP16_EPS, atol=1e-7)
    assert (out[1, 128:] == 0).all()


def test_constant_rows_or_columns_finite():
    x = torch.randn(128, 8)
    x[:, 3] = 2.0  # a constant channel
    x[5, :] = -1.0  # a constant token
    for kind in ("key", "value"):
        out = kvarn_fake(x, 2, kind)
        assert torch.isfinite(out).all()
        assert (out[:, 3] - 2.0).abs().max() < 0.75 * (x.max() - x.min())


# ---------------------------------------------------------------- validation


def test_errors_name_the_value():
    x = torch.randn(200, 8)
    with pytest.raises(ValueError, match="T=200") as e:
        kvarn_quantize(x, 4, "key")
    assert "128" in str(e.value)
    with pytest.raises(ValueError, match="'query'"):
        kvarn_quantize(x[:128], 4, "query")
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"got {bad}"):
            kvarn_quantize(x[:128], bad, "value")
        with pytest.raises(ValueError, match=f"got {bad}"):
            kvarn_fake(x[:128], bad, "key")
    with pytest.raises(ValueError, match="shape"):
        balance(torch.randn(1, 5))


def _ref_clipped_row(b: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    """One balanced row quantized over mean ± clip·α_b·σ within its min-max (the docstring's formula, in float64)."""
    from wushkv.quantizers.quest import QUEST_ALPHA

    b = b.double()
    mu, sd = b.mean(), b.std(correction=0)
    lo, hi = max(b.min(), mu - clip * QUEST_ALPHA[bits] * sd), min(b.max(), mu + clip * QUEST_ALPHA[bits] * sd)
    step = (hi - lo) / (2**bits - 1)
    return lo + step * torch.round((b - lo) / step).clamp(0, 2**bits - 1)


def test_clip_zero_or_huge_is_kvarn_and_a_clip_matches_its_reference():
    x = torch.randn(2, 256, 16, generator=torch.Generator().manual_seed(12))
    for kind in ("key", "value"):
        published = kvarn_quantize(x, 2, kind)
        for same in (kvarn_quantize(x, 2, kind, clip=0.0), kvarn_quantize(x, 2, kind, clip=1e6)):
            assert torch.equal(same.codes, published.codes) and torch.equal(same.scale, published.scale)
    # A clip against the slow reference: balanced rows of one tile, quantized one by one.
    tile = torch.randn(1, 128, 8, generator=torch.Generator().manual_seed(13)) * torch.linspace(0.5, 2, 8)
    B, log_r, log_c = balance(tile.transpose(-1, -2))  # keys: rows are channels
    fast = kvarn_fake(tile, 2, "key", clip=1.15)
    ref = torch.stack([_ref_clipped_row(B[0, r], 2, 1.15) * log_r[0, r].exp() for r in range(8)])  # (R, C)
    ref = (ref * log_c[0].exp()).T  # (T, d)
    assert torch.allclose(fast[0].double(), ref, rtol=2e-3, atol=2e-3)  # float16 metadata


def test_clip_cuts_the_gaussian_error_at_two_bits_with_the_same_bytes():
    x = torch.randn(4, 512, 64, generator=torch.Generator().manual_seed(14))
    for kind in ("key", "value"):
        a, c = kvarn_quantize(x, 2, kind), kvarn_quantize(x, 2, kind, clip=1.0)
        assert kvarn_nbytes(a) == kvarn_nbytes(c) and int(c.codes.max()) <= 3
        mse_a = ((kvarn_dequantize(a) - x) ** 2).mean().item()
        mse_c = ((kvarn_dequantize(c) - x) ** 2).mean().item()
        assert mse_c < 0.6 * mse_a, (kind, mse_a, mse_c)  # min-max over 128 samples is ~1.7x too coarse at 2 bits
        assert mse_c < 1.1 * 0.1188  # near the Gaussian optimum of a 4-level grid (QUEST_MSE[2])


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), True])
def test_bad_clip_is_refused(bad):
    from wushkv.config import QuantConfig, WindowConfig

    with pytest.raises(ValueError, match="clip"):
        kvarn_quantize(torch.randn(128, 4), 2, "key", clip=bad)
    with pytest.raises(ValueError, match="tile_clip"):
        QuantConfig(quantizer="kvarn", tile_clip=bad, windows=WindowConfig(128, 0, 128))


def _slow_feedback_keys(x: torch.Tensor, bits: int, clip: float, F: torch.Tensor) -> torch.Tensor:
    """Reference for key tiles with error feedback: one tile [T=G, d], rows (channels) one at a time, float64,
    each row's grid from the row as updated; metadata rounded to float16 as stored."""
    A = x.double().T.clone()  # (d, G)
    _, log_r, log_c = balance(A.float())
    er, fold = log_r.double().exp(), log_c.double().exp()
    fold16 = fold.half().double()
    out = torch.empty_like(A)
    for r in range(A.shape[0]):
        b = A[r] / (er[r] * fold)
        lo, hi = b.min(), b.max()
        if clip > 0:
            from wushkv.quantizers.quest import QUEST_ALPHA

            mu, half = b.mean(), clip * QUEST_ALPHA[bits] * b.std(correction=0)
            lo, hi = max(lo, mu - half), min(hi, mu + half)
        step = max((hi - lo) / (2**bits - 1), 1e-10)
        q = torch.round((b - lo) / step).clamp(0, 2**bits - 1)
        s16, z16 = (er[r] * step).half().double(), (er[r] * lo).half().double()
        out[r] = fold16 * (s16 * q + z16)
        A[r + 1 :] -= F[r, r + 1 :, None].double() * (A[r] - out[r])[None]
    return out.T


@pytest.mark.parametrize("clip", [0.0, 1.5])
def test_key_feedback_matches_its_reference_and_identity_is_plain(clip):
    from wushkv.quantizers.feedback import feedback_matrix

    g = torch.Generator().manual_seed(21)
    d = 8
    x = torch.randn(2, 3, 256, d, generator=g) @ torch.randn(d, d, generator=g) + torch.randn(d, generator=g)
    plain = kvarn_quantize(x, 2, "key", clip=clip)
    same = kvarn_quantize(x, 2, "key", clip=clip, feedback=torch.eye(d).expand(3, d, d))
    for f in ("codes", "scale", "zero", "s_fold"):
        assert torch.equal(getattr(plain, f), getattr(same, f)), f
    Q = torch.randn(3, d, d, generator=g)
    F = feedback_matrix(Q @ Q.mT + 0.1 * torch.eye(d))
    fast = kvarn_dequantize(kvarn_quantize(x, 2, "key", clip=clip, feedback=F))
    for b, h, t0 in ((0, 0, 0), (1, 2, 128)):
        ref = _slow_feedback_keys(x[b, h, t0 : t0 + 128], 2, clip, F[h])
        assert torch.allclose(fast[b, h, t0 : t0 + 128].double(), ref, rtol=1e-4, atol=1e-4)


def test_key_feedback_cuts_the_weighted_error_at_the_same_bytes():
    """LDLQ along the channels of key tiles: the error weighted by the Hessian H falls (by Hadamard's inequality in
    expectation); the unweighted error may rise; storage is unchanged."""
    from wushkv.quantizers.feedback import feedback_matrix

    g = torch.Generator().manual_seed(22)
    d = 16
    x = torch.randn(2, 3, 512, d, generator=g) @ (0.5 * torch.randn(d, d, generator=g)) + torch.randn(d, generator=g)
    Q = torch.randn(3, d, d, generator=g)
    H = Q @ Q.mT + 0.1 * torch.eye(d)
    for clip in (0.0, 1.5):
        a = kvarn_quantize(x, 2, "key", clip=clip)
        c = kvarn_quantize(x, 2, "key", clip=clip, feedback=feedback_matrix(H))
        assert kvarn_nbytes(a) == kvarn_nbytes(c) and int(c.codes.max()) <= 3
        w = [torch.einsum("bhtd,hde,bhte->", e, H, e).item() for e in (kvarn_dequantize(t) - x for t in (a, c))]
        assert w[1] < 0.85 * w[0], (clip, w)


def test_feedback_is_for_keys_only():
    with pytest.raises(ValueError, match="channels of key tiles"):
        kvarn_quantize(torch.randn(128, 4), 2, "value", feedback=torch.eye(4))
    with pytest.raises(ValueError, match=r"feedback must be a tensor \[..., 4, 4\]"):
        kvarn_quantize(torch.randn(128, 4), 2, "key", feedback=torch.eye(3))
    with pytest.raises(ValueError, match="does not broadcast"):
        kvarn_quantize(torch.randn(1, 3, 128, 4), 2, "key", feedback=torch.eye(4).expand(2, 4, 4))


# ---------------------------------------------------------------- the compiled tile kernels (csrc/codes.cpp)


@pytest.mark.parametrize("d,tile", [(6, 8), (64, 128), (24, 20)])  # row lengths under, at and off the 16-wide loops
@pytest.mark.parametrize("kind,bits,clip,feedback", [("key", 2, 0.0, False), ("key", 2, 3.0, True), ("key", 3, 1.5, False),
                                                     ("value", 4, 0.0, False), ("value", 2, 1.3, False), ("key", 4, 0.0, True)])
def test_fused_tile_kernels_match_the_pytorch_loop(d, tile, kind, bits, clip, feedback):
    """kvarn_balance and kvarn_rows (C++) against this module's PyTorch code, their reference: the same balanced tiles
    and row + column scales to float32 rounding, the same codes but where rounding order puts a value across a
    boundary, the same dequantized values to float16 metadata rounding; and the kernels really ran.

    Not the same split of the scales between rows and columns: (ℓ_r + s, ℓ_c − s) balances a tile alike for any s,
    and once the balance has converged (imbalance ≈ 2, every std ≈ 1) later rounds differ by such a shift while
    their imbalances tie to float32 rounding, so which round is kept may differ between the two; the float16
    ``scale``/``zero`` and ``s_fold`` then differ by e^±s with the same product."""
    from wushkv import _ext
    from wushkv.quantizers.feedback import feedback_matrix

    from conftest import require_kernels

    require_kernels()
    g = torch.Generator().manual_seed(d + tile + bits)
    x = (torch.randn(2, 3, 4 * tile, d, generator=g) @ torch.randn(d, d, generator=g) * torch.rand(d, generator=g) * 3
         + torch.randn(d, generator=g))
    F = None
    if feedback:
        Q = torch.randn(3, d, d, generator=g)
        F = feedback_matrix(Q @ Q.mT + 0.1 * torch.eye(d))
    _ext.reset_calls()
    fast = kvarn_quantize(x, bits, kind, tile=tile, clip=clip, feedback=F)
    assert _ext.calls() == {"kvarn_balance": 1, "kvarn_rows": 1}
    ref = kvarn_quantize(x, bits, kind, tile=tile, clip=clip, feedback=F, fused=False)
    assert _ext.calls() == {"kvarn_balance": 1, "kvarn_rows": 1}, "fused=False ran a kernel"
    assert (fast.codes == ref.codes).float().mean() >= 0.999
    same = fast.codes == ref.codes
    xf, xr = kvarn_dequantize(fast), kvarn_dequantize(ref)
    # a float16 rounding of each of scale, zero and s_fold: relative to s_fold·(scale·q + |zero|), as the sum may cancel
    size = kvarn_dequantize(KVarNTiles(ref.codes, ref.scale.abs(), ref.zero.abs(), ref.s_fold.abs(), bits, kind, tile))
    slack = 8 * FP16_EPS * size + 1e-6
    assert ((xf - xr).abs()[same] <= slack[same]).all()
    A = _tile_view(x.reshape(-1, d), tile, kind)
    Bf, rf, cf = balance(A)
    Br, rr, cr = balance(A, fused=False)
    torch.testing.assert_close(Bf, Br, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rf[..., :, None] + cf[..., None, :], rr[..., :, None] + cr[..., None, :], rtol=0, atol=1e-5)


def test_fused_balance_keeps_the_start_of_constant_and_nan_tiles():
    """The kernel's tie and NaN rules are the loop's: a constant tile (imbalance 0 at the start) keeps ℓ = 0; a tile
    with a NaN never takes a round whose imbalance is NaN."""
    from conftest import require_kernels

    require_kernels()
    A = torch.stack([torch.full((4, 5), 2.5), torch.randn(4, 5, generator=torch.Generator().manual_seed(3))])
    A[1, 0, 0] = float("nan")
    for fused in (True, False):
        _, lr, lc = balance(A, fused=fused)
        assert torch.equal(lr, torch.zeros_like(lr)) and torch.equal(lc, torch.zeros_like(lc)), fused
