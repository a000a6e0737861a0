"""QuEST quantizer (docs/reference/math.md#4-the-quest-int-quantizer): Gaussian MSE at the optimum, code range, saturation at ±α_b·RMS,
the unified affine storage, grouping; plus the quantizer registry."""

import pytest
import torch

from wushkv.quantizers import (
    QUANTIZERS,
    QUEST_ALPHA,
    AffineQuantizer,
    QTensor,
    QuestQuantizer,
    dequantize,
    make_quantizer,
)
from wushkv.quantizers.quest import UNCLIPPED_FROM

GAUSS_MSE = {1: 0.3634, 2: 0.1188, 3: 0.0374, 4: 0.0115}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_mse_matches_theory(bits):
    x = 3.0 * _randn(1024, 512, seed=bits)  # per-unit-variance: the MSE scales with σ²
    mse = ((QuestQuantizer(bits).fake(x) - x) ** 2).mean().item() / 9.0
    assert mse == pytest.approx(GAUSS_MSE[bits], rel=0.03)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_codes_scale_offset_layout(bits):
    x = _randn(3, 5, 64, seed=bits)
    qz = QuestQuantizer(bits)
    q = qz.quantize(x)
    assert isinstance(q, QTensor) and q.bits == bits and q.group_size == 64 and q.axis == -1
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    assert int(q.codes.max()) <= 2**bits - 1
    assert q.scale.shape == q.offset.shape == (3, 5, 1) and q.scale.dtype == torch.float32
    half = 2 ** (bits - 1)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    top = QUEST_ALPHA[bits] * rms if bits < UNCLIPPED_FROM else x.abs().amax(-1, keepdim=True)  # clipped below 5 bits
    torch.testing.assert_close(q.scale, 2 * top / (2**bits - 1))
    torch.testing.assert_close(q.offset, (0.5 - half) * q.scale)
    # Midrise reconstruction (q + ½)Δ with signed q = code − 2^{b−1} and q = floor(x/Δ).
    signed = q.codes.float() - half
    torch.testing.assert_close(dequantize(q), (signed + 0.5) * q.scale)
    expect = torch.floor(x / q.scale).clamp(-half, half - 1)
    assert torch.equal(signed, expect)
    # fake is bit-identical to dequantize(quantize(x)), and the method matches the function.
    assert torch.equal(qz.fake(x), dequantize(q))
    assert torch.equal(qz.dequantize(q), dequantize(q))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_error_bound_and_saturation(bits):
    x = _randn(200, 64, seed=10 + bits)
    x[:, 7] = 40.0  # outliers beyond the clip
    x[:, 9] = -40.0
    qz = QuestQuantizer(bits)
    q = qz.quantize(x)
    xh = qz.fake(x)
    r = x.pow(2).mean(-1, keepdim=True).sqrt()
    clip = QUEST_ALPHA[bits] * r
    # Outermost levels are ±α_b·RMS: outliers saturate there, with extreme codes.
    torch.testing.assert_close(xh[:, 7:8], clip)
    torch.testing.assert_close(xh[:, 9:10], -clip)
    assert bool((q.codes[:, 7] == 2**bits - 1).all() and (q.codes[:, 9] == 0).all())
    assert xh.abs().max() <= clip.max() * (1 + 1e-6)
    # Inside the clip the error is at most Δ/2.
    inside = x.abs() < clip
    err = (xh - x).abs()
    assert bool((err[inside] <= (q.scale / 2 * (1 + 1e-5)).expand_as(x)[inside]).all())


def test_groups_and_dtypes():
    x = _randn(4, 128, seed=3)
    qz = QuestQuantizer(3, group_size=32)
    q = qz.quantize(x)
    assert q.scale.shape == (4, 4) and q.group_size == 32
    # Grouping is the same as quantizing the reshaped groups as whole rows.
    ref = QuestQuantizer(3).fake(x.reshape(4, 4, 32)).reshape(4, 128)
    assert torch.equal(qz.fake(x), ref)
    xb = x.to(torch.bfloat16)
    assert qz.fake(xb).dtype == torch.float32
    # All-zero groups stay (essentially) zero and finite.
    z = QuestQuantizer(2).fake(torch.zeros(2, 16))
    assert bool(torch.isfinite(z).all()) and z.abs().max() < 1e-30


def test_quest_errors():
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="bits must be an integer in 1..8"):
            QuestQuantizer(bad)
    with pytest.raises(ValueError, match="group_size"):
        QuestQuantizer(2, group_size=0)
    with pytest.raises(ValueError, match="must divide the last dim, got last dim 100"):
        QuestQuantizer(2, group_size=32).quantize(torch.zeros(2, 100))


def test_quantizer_registry():
    assert QUANTIZERS == {"quest": QuestQuantizer, "affine": AffineQuantizer}
    q = make_quantizer("quest", 3, group_size=16)
    assert q == QuestQuantizer(3, group_size=16) and q.bits == 3
    a = make_quantizer("affine", 2, clip_ratio=0.96)
    assert isinstance(a, AffineQuantizer) and a.clip_ratio == 0.96
    with pytest.raises(ValueError, match="unknown quantizer 'int'.*'affine'.*'quest'"):
        make_quantizer("int", 2)
    with pytest.raises(ValueError, match="got 12"):
        make_quantizer("affine", 12)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_alpha_scale_moves_the_clip_level(bits):
    """alpha_scale multiplies α_b: the outermost level is ±(α_b·s)·RMS; the MSE of a Gaussian is lowest at s = 1."""
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    r = x.pow(2).mean(-1, keepdim=True).sqrt()
    mse = {}
    for s in (0.8, 1.0, 1.25):
        q = QuestQuantizer(bits, alpha_scale=s)
        xh = q.fake(x)
        top = QUEST_ALPHA[bits] * s * r  # outermost level (2^{b−1} − ½)·Δ = α·RMS
        ratio = xh.abs().amax(-1, keepdim=True) / top
        assert float(ratio.max()) == pytest.approx(1.0, rel=1e-5)  # reached by rows that saturate, never exceeded
        mse[s] = float((xh - x).pow(2).mean())
    assert mse[1.0] < mse[0.8] and mse[1.0] < mse[1.25]
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="alpha_scale"):
            QuestQuantizer(bits, alpha_scale=bad)


def test_quant_config_alpha():
    from wushkv.codecs import make_codec
    from wushkv.config import QuantConfig

    c = make_codec(QuantConfig(2, 2, "quest", k_alpha=0.9, v_alpha=1.1), "key", 64)
    assert c.quantizer.alpha == pytest.approx(QUEST_ALPHA[2] * 0.9)
    assert make_codec(QuantConfig(2, 2, "quest", k_alpha=0.9, v_alpha=1.1), "value", 64).quantizer.alpha == pytest.approx(QUEST_ALPHA[2] * 1.1)
    with pytest.raises(ValueError, match="k_alpha=0"):
        QuantConfig(k_alpha=0)


def _row_errors(quantizer_for, x, multipliers):
    """Slow reference: every candidate quantizer on every row; (x̂ per candidate, squared error per row)."""
    xh = torch.stack([quantizer_for(m).fake(x) for m in multipliers])  # [C, rows, n]
    return xh, (xh - x).pow(2).sum(-1)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clip_search_picks_the_least_error_candidate(bits):
    """search=n: each token gets the x̂ of the candidate clip with the least squared error (ties to the first,
    m = 1), as a slow per-candidate reference computes it; never worse than the fixed clip; same layout."""
    from wushkv.quantizers import search_multipliers

    g = torch.Generator().manual_seed(bits)
    x = torch.cat([torch.randn(300, 64, generator=g), torch.distributions.StudentT(3.0).sample((300, 64))])
    ms = search_multipliers(12)
    assert ms[0] == 1.0 and len(ms) == 13 and min(ms[1:]) == 0.5 and max(ms[1:]) == 1.5
    xh, err = _row_errors(lambda m: QuestQuantizer(bits, alpha_scale=m), x, ms)
    q = QuestQuantizer(bits, search=12)
    got = q.fake(x)
    best = err.argmin(0)  # argmin returns the first of equal minima
    torch.testing.assert_close(got, xh[best, torch.arange(len(x))], rtol=1e-6, atol=1e-6)
    e = (got - x).pow(2).sum(-1)
    assert (e <= err[0] * (1 + 1e-6)).all() and float(e.mean()) < 0.99 * float(err[0].mean())
    qt = q.quantize(x)
    assert qt.scale.shape == (600, 1) and qt.codes.dtype == torch.uint8
    torch.testing.assert_close(dequantize(qt), got, rtol=0, atol=0)
    torch.testing.assert_close(qt.offset, (0.5 - 2 ** (bits - 1)) * qt.scale)  # still QuEST's symmetric grid: Δ alone is stored


def test_clip_search_errors_and_config():
    from wushkv.codecs import make_codec
    from wushkv.config import QuantConfig
    from wushkv.quantizers import search_multipliers

    assert search_multipliers(0) == [1.0] and search_multipliers(1) == [1.0, 0.5]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="search must be an integer >= 0"):
            QuestQuantizer(2, search=bad)
    assert make_codec(QuantConfig(2, 2, "quest", clip_search=16), "key", 64).quantizer.search == 16
    assert make_codec(QuantConfig(2, 2, "affine", clip_search=16), "value", 64).quantizer.search == 16
    assert "search16" in QuantConfig(clip_search=16).label()
    with pytest.raises(ValueError, match=r"clip_search=4 needs a per-token quantizer \(quest, affine\), got 'kvarn'"):
        QuantConfig(quantizer="kvarn", clip_search=4)
    with pytest.raises(ValueError, match="clip_search=-2: must be an integer in 0..256"):
        QuantConfig(clip_search=-2)
    assert QuantConfig.from_dict(QuantConfig(clip_search=8).to_dict()).clip_search == 8


def test_e5m3_steps_round_to_one_byte_and_back():
    """E5M3 (metadata dtype ``e5m3``): float16's bits 14..7, so every byte decodes to a float16 and back to itself;
    rounding is monotone, to nearest within float16's normal range (relative error ≤ 1/16: 3 mantissa bits), and
    saturates at 61440 instead of reaching infinity."""
    from wushkv.codecs import E5M3_MAX, e5m3_decode, e5m3_encode, e5m3_round

    b = torch.arange(E5M3_MAX + 1, dtype=torch.int32).to(torch.uint8)
    f = e5m3_decode(b)
    assert torch.equal(e5m3_encode(f), b) and torch.equal(e5m3_round(f.float()), f)
    assert bool((f[1:].float() > f[:-1].float()).all()) and float(f[-1]) == 61440.0
    x = torch.logspace(-4.2, 4.7, 5001)  # float16's normal range (2^-14 = 6.1e-5 up)
    r = e5m3_round(x).float()
    assert bool((r[1:] >= r[:-1]).all())
    assert float((r / x - 1).abs().max()) <= 1 / 16 + 1e-3
    # nearest: no other byte is closer (up to twice float16's own rounding first, 2^-11)
    err = (f.float()[None, :] - x[:, None]).abs()
    assert bool((err.min(1).values >= (r - x).abs() - 2 ** -10 * x).all())
    assert float(e5m3_round(torch.tensor([1e30]))) == 61440.0 and float(e5m3_round(torch.tensor([0.0]))) == 0.0


def test_e5m3_steps_of_unclipped_widths_round_up():
    """From UNCLIPPED_FROM bits QuEST's step spans each token's max |x| (no clip), so its byte is rounded up: 8-bit
    codes with one-byte steps then clamp nothing, every value within half a stored step of its own (rounded to the
    nearest byte, a step ~6% short clamped each token's largest values: twice float16 metadata's error, 8x its
    largest). Rounding up keeps a step already on the grid, and never lands below the step."""
    from wushkv.codecs import TokenCodec, e5m3_decode, e5m3_round
    from wushkv.quantizers.quest import UNCLIPPED_FROM

    assert UNCLIPPED_FROM <= 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, 32, generator=g) * torch.logspace(-2, 2, 64)[:, None]
    codec = TokenCodec(QuestQuantizer(8), 32, torch.float16, step_byte=True)
    s = codec.encode(x)
    step = e5m3_decode(s["scale"]).float()  # (2, 3, 64, 1)
    err = (codec.decode(s, 64) - x).abs()
    assert bool((err <= 0.5 * step * (1 + 1e-5)).all()), float((err / step).max())
    steps = torch.logspace(-3, 3, 999)
    up = e5m3_round(steps, up=True).float()
    assert bool((up >= steps.half().float()).all()) and torch.equal(e5m3_round(up, up=True), up.half())


@pytest.mark.parametrize("bits", [2, 4])
def test_e5m3_codec_codes_are_made_on_the_stored_step(bits):
    """With one-byte steps the codes are rounded on the rounded step, so decode(encode(x)) is QuEST on that step:
    codes = ⌊x/Δ'⌋ + 2^(b-1) clamped, x̂ = (code − 2^(b-1) + ½)·Δ'; its error stays within a few percent of float16
    metadata's (the step moves by ≤ 6%); affine sides are refused by QuantConfig."""
    from wushkv.codecs import e5m3_decode, make_codec
    from wushkv.config import QuantConfig

    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.01, 40, 50)[:, None]
    c = make_codec(QuantConfig(bits, bits, "quest", metadata_dtype="e5m3"), "key", 64)
    s = c.encode(x)
    assert s["scale"].dtype == torch.uint8 and s["scale"].shape == (2, 3, 50, 1)
    step = e5m3_decode(s["scale"]).float()
    half = 2 ** (bits - 1)
    ref = (torch.floor(x / step).clamp(-half, half - 1) + 0.5) * step
    assert torch.equal(c.decode(s, 50), ref) and torch.equal(c.fake(x), ref)
    fp16 = make_codec(QuantConfig(bits, bits, "quest"), "key", 64).fake(x)
    e1, e2 = float((ref - x).square().mean()), float((fp16 - x).square().mean())
    assert e1 > 0 and abs(e1 / e2 - 1) < 0.05
    with pytest.raises(ValueError, match="e5m3.*affine"):
        QuantConfig(2, 2, "affine", metadata_dtype="e5m3")
    with pytest.raises(ValueError, match="metadata_dtype 'float8'"):
        QuantConfig(2, 2, "quest", metadata_dtype="float8")
