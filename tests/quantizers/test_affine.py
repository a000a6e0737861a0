"""Percentile-clipped affine quantizer (docs/reference/math.md#5-the-percentile-clipped-affine-quantizer): error ≤ s/2, exact clip counts, per-channel
(KIVI) orientation."""

import math

import pytest
import torch

from wushkv.quantizers import AffineQuantizer, dequantize, percentile_clip


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _per_element(t, G):
    """[..., g] per-group values → [..., g·G] per element."""
    return t.repeat_interleave(G, dim=-1)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 16])
def test_minmax_error_at_most_half_step(bits, group_size):
    x = 5 * _randn(64, 64, seed=bits) + 1.0  # asymmetric range
    qz = AffineQuantizer(bits, group_size=group_size)
    q = qz.quantize(x)
    G = group_size or 64
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    assert int(q.codes.max()) <= 2**bits - 1
    assert q.scale.shape == (64, 64 // G) and q.group_size == G
    xg = x.reshape(64, 64 // G, G)
    s = (xg.amax(-1) - xg.amin(-1)) / (2**bits - 1)
    torch.testing.assert_close(q.scale, s)
    xh = qz.fake(x)
    assert torch.equal(xh, dequantize(q))
    err = (xh - x).abs()
    assert bool((err <= _per_element(q.scale, G) / 2 + 1e-5).all())
    # Group min and max are on the grid: codes 0 and 2^b − 1 hit them.
    torch.testing.assert_close(xh.reshape(xg.shape).amin(-1), xg.amin(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xh.reshape(xg.shape).amax(-1), xg.amax(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kappa", [0.0, -1.0])
def test_nonpositive_kappa_is_plain_minmax(kappa):
    x = _randn(8, 32, seed=2)
    assert torch.equal(AffineQuantizer(2, clip_ratio=kappa).fake(x), AffineQuantizer(2).fake(x))
    xc, tau = percentile_clip(x, kappa)
    assert torch.equal(xc, x) and bool(torch.isinf(tau).all())


@pytest.mark.parametrize("kappa, d", [(0.96, 64), (0.92, 128), (0.5, 10), (1.0, 16)])
def test_clip_counts_exact(kappa, d):
    x = _randn(50, d, seed=d)  # continuous: |x| distinct within a row
    k = min(math.floor(kappa * d), d - 1)
    xc, tau = percentile_clip(x, kappa)
    torch.testing.assert_close(tau, x.abs().sort(-1).values[:, k : k + 1], rtol=0, atol=0)
    changed = xc != x
    assert torch.equal(changed, x.abs() > tau)
    assert bool((changed.sum(-1) == d - 1 - k).all())  # exactly the entries above the order statistic
    torch.testing.assert_close(xc[changed], tau.expand_as(x)[changed] * x[changed].sign())
    # Quantized: inside the clip error ≤ s/2; clipped entries land within s/2 of ±τ.
    qz = AffineQuantizer(3, clip_ratio=kappa)
    q = qz.quantize(x)
    xh = dequantize(q)
    assert bool(((xh - xc).abs() <= q.scale / 2 + 1e-5).all())
    assert xh.abs().max() <= tau.max() + 1e-5


def test_per_channel_axis_round_trip():
    B, T, d, G = 3, 64, 16, 32
    x = _randn(B, T, d, seed=7) * torch.logspace(-1, 1, d)  # per-channel scales (KIVI's case)
    qz = AffineQuantizer(2, group_size=G, axis=-2)
    q = qz.quantize(x)
    assert q.axis == -2 and q.group_size == G
    assert q.codes.shape == (B, T, d) and q.codes.dtype == torch.uint8
    assert q.scale.shape == q.offset.shape == (B, T // G, d)
    xh = qz.fake(x)
    assert xh.shape == x.shape and torch.equal(xh, dequantize(q))
    # Same as the per-token quantizer on the transposed tensor.
    ref = AffineQuantizer(2, group_size=G).fake(x.mT.contiguous()).mT
    torch.testing.assert_close(xh, ref, rtol=0, atol=0)
    # Error bound with the scale of each (token group, channel).
    s = q.scale.repeat_interleave(G, dim=-2)  # [B, T, d]
    assert bool(((xh - x).abs() <= s / 2 + 1e-6).all())
    xg = x.reshape(B, T // G, G, d)
    torch.testing.assert_close(q.scale, (xg.amax(-2) - xg.amin(-2)) / 3)


def test_per_channel_clip_runs_over_tokens():
    x = _randn(2, 64, 8, seed=8)
    qz = AffineQuantizer(4, group_size=16, clip_ratio=0.9, axis=-2)
    xc, tau = percentile_clip(x.mT, 0.9)  # τ per channel over all 64 tokens
    xh = qz.fake(x)
    s = qz.quantize(x).scale.repeat_interleave(16, dim=-2)
    assert bool(((xh - xc.mT).abs() <= s / 2 + 1e-6).all())


def test_constant_rows_and_errors():
    x = torch.full((2, 8), 3.0)
    xh = AffineQuantizer(2).fake(x)
    torch.testing.assert_close(xh, x)  # 1e-8 range floor: finite scale, exact constant
    with pytest.raises(ValueError, match="bits must be an integer in 1..8, got 0"):
        AffineQuantizer(0)
    with pytest.raises(ValueError, match="clip_ratio"):
        AffineQuantizer(2, clip_ratio=1.5)
    with pytest.raises(ValueError, match="axis"):
        AffineQuantizer(2, axis=0)
    with pytest.raises(ValueError, match="needs group_size"):
        AffineQuantizer(2, axis=-2)
    with pytest.raises(ValueError, match="divide the token dim T=30"):
        AffineQuantizer(2, group_size=16, axis=-2).quantize(torch.zeros(30, 8))
    with pytest.raises(ValueError, match="must divide"):
        AffineQuantizer(2, group_size=5).quantize(torch.zeros(3, 8))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clip_search_picks_the_least_error_range(bits):
    """search=n: each token takes, of its κ-clipped range and n shrinks m·[min, max] of its unclipped range,
    the one with the least squared error against the unclipped token (slow reference below)."""
    from wushkv.quantizers import dequantize, search_multipliers

    g = torch.Generator().manual_seed(bits)
    x = torch.cat([torch.randn(200, 64, generator=g), torch.distributions.StudentT(3.0).sample((200, 64))])
    q = AffineQuantizer(bits, clip_ratio=0.96, search=10)
    got = q.fake(x)
    cands = [AffineQuantizer(bits, clip_ratio=0.96).fake(x)]
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    for m in search_multipliers(10, 0.3, 1.0)[1:]:
        s = (m * (hi - lo)) / (2**bits - 1)
        z = -m * lo / s
        cands.append(((x / s + z + 0.5).floor().clamp(0, 2**bits - 1) - z) * s)
    xh = torch.stack(cands)
    err = (xh - x).pow(2).sum(-1)
    torch.testing.assert_close(got, xh[err.argmin(0), torch.arange(len(x))], rtol=1e-5, atol=1e-5)
    assert ((got - x).pow(2).sum(-1) <= err[0] * (1 + 1e-6)).all()
    torch.testing.assert_close(dequantize(q.quantize(x)), got, rtol=0, atol=0)
    with pytest.raises(ValueError, match="per token"):
        AffineQuantizer(bits, group_size=8, axis=-2, search=4)
