"""Clipping by width (docs/lab/clip-by-width.md): QuEST and the affine quantizer clip below
``UNCLIPPED_FROM`` = 5 bits, exactly as before, and from there on span each group's own range."""

import pytest
import torch

from wushkv.quantizers import QUEST_ALPHA, AffineQuantizer, QuestQuantizer
from wushkv.quantizers.quest import UNCLIPPED_FROM


def outlier_rows(seed=0):
    """(64, 2, 40, 64): Gaussian rows whose channels 0, 1 are ×8 (keys and values with outlier channels)."""
    x = torch.randn(64, 2, 40, 64, generator=torch.Generator().manual_seed(seed))
    x[..., :2] *= 8.0
    return x


def quantizers(bits, clip):
    return [QuestQuantizer(bits, clip=clip), QuestQuantizer(bits, 32, alpha_scale=1.3, clip=clip),
            QuestQuantizer(bits, search=8, clip=clip), AffineQuantizer(bits, clip_ratio=0.96, clip=clip),
            AffineQuantizer(bits, 16, clip_ratio=0.92, search=8, clip=clip),
            AffineQuantizer(bits, 10, clip_ratio=0.96, axis=-2, clip=clip)]


def same(a, b):
    return torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.offset, b.offset)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_below_5_bits_the_default_is_the_clipped_grid_bit_for_bit(bits):
    """2/3/4 bits are unchanged: codes, scales and offsets equal those of ``clip=True`` (the only grid before).
    Checked once against the code before the change (6d601a1): the same SHA-256 over these outputs."""
    assert UNCLIPPED_FROM == 5
    x = outlier_rows()
    for default, clipped in zip(quantizers(bits, None), quantizers(bits, True), strict=True):
        assert same(default.quantize(x), clipped.quantize(x)), default


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_from_5_bits_the_grid_spans_each_group(bits):
    """Every value within half a step of its group's own grid: nothing clipped, the outliers included (clipped, as
    before, they were off by up to (8 − α_b)·RMS)."""
    x = outlier_rows(bits)
    for default, unclipped, clipped in zip(quantizers(bits, None), quantizers(bits, False), quantizers(bits, True), strict=True):
        q = default.quantize(x)
        assert same(q, unclipped.quantize(x)) and not same(q, clipped.quantize(x)), default
    for q in (QuestQuantizer(bits), AffineQuantizer(bits, clip_ratio=0.96)):
        t = q.quantize(x)
        err = (q.dequantize(t) - x).abs()
        assert bool((err <= t.scale * (0.5 + 1e-5)).all()), q  # one group per token: scale (..., 1)
        assert float(err.max()) <= float(x.abs().max()) / (2**bits - 1) * (1 + 1e-5)
    old = QuestQuantizer(bits, clip=True)
    assert float((old.fake(x) - x).abs().max()) > 1.0  # what the clipped grid did to the outliers


def test_unclipped_quest_levels_reach_the_group_max_times_alpha_scale():
    x = outlier_rows()
    for s in (1.0, 0.8):
        q = QuestQuantizer(8, alpha_scale=s)
        assert not q.clipped and QuestQuantizer(4).clipped
        t = q.quantize(x)
        torch.testing.assert_close(t.scale, 2 * s * x.abs().amax(-1, keepdim=True) / 255)
    assert QuestQuantizer(8, clip=True).alpha == QUEST_ALPHA[8]


def test_clip_must_be_none_or_a_bool():
    for bad in (1, "yes", 0.5):
        with pytest.raises(ValueError, match="clip must be None"):
            QuestQuantizer(8, clip=bad)
        with pytest.raises(ValueError, match="clip must be None"):
            AffineQuantizer(8, clip_ratio=0.96, clip=bad)
    assert AffineQuantizer(8, clip_ratio=0.96).kappa == 0.0 and AffineQuantizer(4, clip_ratio=0.96).kappa == 0.96
    assert AffineQuantizer(8, clip_ratio=0.96, clip=True).kappa == 0.96
