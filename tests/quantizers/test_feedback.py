"""Rounding with error feedback (LDLQ): agrees with a slow GPTQ reference, reduces the weighted error by
the predicted factor, and is plain rounding when the weight is diagonal."""

import pytest
import torch

from wushkv.codecs import TokenCodec, storage_nbytes
from wushkv.quantizers import AffineQuantizer, QuestQuantizer
from wushkv.quantizers.feedback import feedback_gain, feedback_matrix, feedback_round

from conftest import require_kernels


def spd(d, seed=0, cond=50.0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    ev = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), d, dtype=torch.float64)
    return Q @ torch.diag(ev) @ Q.T


def weighted(x, xh, H):
    e = (xh - x).double().reshape(-1, x.shape[-1])
    return ((e @ H) * e).sum(1).mean().item()


def slow_gptq(x, levels_of, H):
    """GPTQ on one vector with the exact conditional update: after rounding coordinate j, the remaining
    coordinates F = {j+1..} move by −(H_FF)⁻¹ H_Fj e_j, the minimizer of the weighted error given e_j."""
    w = x.clone().double()
    out = torch.empty_like(w)
    d = w.shape[0]
    for j in range(d):
        lv = levels_of(j)
        out[j] = lv[(lv - w[j]).abs().argmin()]
        e = out[j] - w[j]
        if j + 1 < d:
            F = slice(j + 1, d)
            w[F] += -torch.linalg.solve(H[F, F], H[F, j]) * e
    return out


@pytest.mark.parametrize("bits", [2, 3])
def test_agrees_with_slow_gptq_reference(bits):
    d = 12
    H = spd(d, seed=1)
    F = feedback_matrix(H, damping=0.0, dtype=torch.float64)
    x = torch.randn(1, 1, 40, d, generator=torch.Generator().manual_seed(2))
    q = QuestQuantizer(bits).quantize(x)
    codes = feedback_round(x, q.scale, q.offset, bits, d, F)
    xh = codes.double() * q.scale.double() + q.offset.double()
    for t in range(x.shape[2]):
        s, o = q.scale[0, 0, t, 0].double(), q.offset[0, 0, t, 0].double()
        levels = torch.arange(2**bits, dtype=torch.float64) * s + o
        ref = slow_gptq(x[0, 0, t], lambda j, lv=levels: lv, H)
        assert torch.allclose(xh[0, 0, t], ref, atol=1e-5), t


def test_feedback_matrix_is_unit_upper_triangular_and_identity_for_diagonal_H():
    H = spd(8, seed=3)
    F = feedback_matrix(H, damping=0.0, dtype=torch.float64)
    assert torch.allclose(torch.diagonal(F), torch.ones(8, dtype=torch.float64))
    assert torch.equal(F, torch.triu(F))
    D = torch.diag(torch.rand(8, dtype=torch.float64) + 0.5)
    assert torch.allclose(feedback_matrix(D, 0.0, torch.float64), torch.eye(8, dtype=torch.float64))
    assert feedback_gain(D, 0.0).item() == pytest.approx(1.0)
    assert 0 < feedback_gain(H, 0.0).item() < 1.0  # Hadamard's inequality, strict for a non-diagonal H


@pytest.mark.parametrize("make", [lambda b: QuestQuantizer(b), lambda b: AffineQuantizer(b, clip_ratio=0.96), lambda b: QuestQuantizer(b, 8)])
@pytest.mark.parametrize("bits", [2, 4])
def test_identity_feedback_is_plain_rounding(make, bits):
    x = torch.randn(2, 3, 50, 16, generator=torch.Generator().manual_seed(4)) * 3
    quant = make(bits)
    q = quant.quantize(x)
    codes = feedback_round(x, q.scale, q.offset, bits, q.group_size, torch.eye(16).expand(3, 16, 16))
    assert (codes == q.codes).float().mean().item() > 0.9999  # identical up to ties in the last ulp


def test_weighted_error_falls_by_the_predicted_gain():
    """Fine grid (8 bits, no saturation): errors are uniform and independent, so the weighted error of
    feedback rounding is ``feedback_gain`` times that of plain rounding. At 2 bits it still falls. The 8-bit grid is
    the clipped one (±3.88 RMS, headroom above these Gaussians): the default unclipped grid ends at each token's max,
    where pushed errors saturate (measured 0.503 against the predicted 0.475)."""
    d = 16
    H = spd(d, seed=5, cond=200.0)
    F = feedback_matrix(H, 0.0)
    x = torch.randn(1, 1, 20000, d, generator=torch.Generator().manual_seed(6))
    gain = feedback_gain(H, 0.0).item()
    for bits, lo, hi in ((8, 0.95 * gain, 1.05 * gain), (2, 0.0, 0.9)):
        q = QuestQuantizer(bits, clip=True).quantize(x)
        fb = feedback_round(x, q.scale, q.offset, bits, d, F).float() * q.scale + q.offset
        plain = q.codes.float() * q.scale + q.offset
        ratio = weighted(x, fb, H) / weighted(x, plain, H)
        assert lo < ratio < hi, (bits, ratio, gain)


def test_codec_with_feedback_keeps_format_and_bytes():
    H = torch.stack([spd(16, seed=s) for s in range(3)])
    F = feedback_matrix(H)
    x = torch.randn(2, 3, 24, 16, generator=torch.Generator().manual_seed(7))
    plain = TokenCodec(QuestQuantizer(2), 16, torch.float16)
    fb = TokenCodec(QuestQuantizer(2), 16, torch.float16, feedback=F)
    sp, sf = plain.encode(x), fb.encode(x)
    assert storage_nbytes(sp) == storage_nbytes(sf)
    assert torch.equal(sp["scale"], sf["scale"])  # same grid, other codes
    assert not torch.equal(sp["codes"], sf["codes"])
    assert torch.equal(fb.decode(sf, 24), fb.fake(x))
    with pytest.raises(ValueError, match="feedback must be"):
        TokenCodec(QuestQuantizer(2), 16, torch.float16, feedback=torch.eye(8))


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN"):
        feedback_matrix(torch.full((4, 4), float("nan")))
    with pytest.raises(ValueError, match="not positive definite"):
        feedback_matrix(-torch.eye(4), damping=0.0)
    with pytest.raises(ValueError, match="square"):
        feedback_matrix(torch.ones(3, 4))
    x = torch.randn(1, 2, 5, 8)
    q = QuestQuantizer(2).quantize(x)
    with pytest.raises(ValueError, match="feedback F"):
        feedback_round(x, q.scale, q.offset, 2, 8, torch.eye(8).expand(3, 8, 8))


@pytest.mark.parametrize("group_size", [None, 8])
def test_fused_kernel_matches_the_reference_loop(group_size):
    require_kernels()
    d = 32
    H = torch.stack([spd(d, seed=s) for s in range(3)])
    F = feedback_matrix(H)
    x = torch.randn(2, 3, 70, d, generator=torch.Generator().manual_seed(8))
    for bits in (2, 3, 4):
        q = QuestQuantizer(bits, group_size).quantize(x)
        fused = feedback_round(x, q.scale, q.offset, bits, q.group_size, F)
        ref = feedback_round(x, q.scale, q.offset, bits, q.group_size, F, fused=False)
        assert (fused == ref).float().mean().item() > 0.999  # equal but for last-ulp ties


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_stored_as_zero_feeds_no_nan_forward(fused):
    """A group of zeros whose step is stored as 0 (its tiny QuEST step rounded to the metadata dtype) before a group
    that is not: the zero group's codes decode to its offset whatever they are, and its error (the values themselves)
    goes on to the later channels; a 0/0 there once put NaN into every later channel, whose codes came out 0 (a token
    decoded 17 apart where it should be 0.7). The loop and the C++ kernel alike (session 74)."""
    if fused:
        require_kernels()
    d, G = 32, 8
    F = feedback_matrix(torch.stack([spd(d, seed=s) for s in range(2)]))
    x = torch.randn(1, 2, 5, d, generator=torch.Generator().manual_seed(3))
    x[..., :G] = 0.0
    q = QuestQuantizer(4, G).quantize(x)
    scale = q.scale.half().float()  # as stored: the zero group's step (float32's tiny) rounds to 0
    assert (scale[..., 0] == 0).all() and (scale[..., 1:] > 0).all()
    codes = feedback_round(x, scale, scale * -7.5, 4, G, F, fused=fused)
    xhat = (codes.float() - 7.5).reshape(1, 2, 5, d // G, G) * scale[..., None]
    err = (xhat.reshape(x.shape) - x).norm(dim=-1) / x.norm(dim=-1)
    assert bool(torch.isfinite(err).all()) and float(err.max()) < 0.4, err
    plain = feedback_round(x[..., G:], scale[..., 1:], scale[..., 1:] * -7.5, 4, G, F[:, G:, G:], fused=fused)
    assert torch.equal(codes[..., G:], plain)  # the zero group's errors are 0: the rest rounds as it would alone


@pytest.mark.parametrize("quant", [QuestQuantizer(2), QuestQuantizer(3, 8), AffineQuantizer(2, clip_ratio=0.92), AffineQuantizer(4, 8)])
def test_grid_is_the_grid_quantize_uses(quant):
    """The feedback codec asks for the grid alone; it must be the one plain rounding uses."""
    x = torch.randn(2, 3, 9, 16, generator=torch.Generator().manual_seed(9)) * 2
    q = quant.quantize(x)
    scale, offset, G = quant.grid(x)
    assert G == q.group_size and torch.equal(scale, q.scale) and torch.equal(offset, q.offset)
