import pytest
import torch

from wushkv.attention import fused_selective_attention, reference_attention, selective_attention


def _inputs(seed=0, B=2, Hkv=2, G=3, T=7, S=11, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, T, d, generator=g)
    k, v, kh, vh = (torch.randn(B, Hkv, S, d, generator=g) for _ in range(4))
    allowed = torch.rand(B, 1, T, S, generator=g) > 0.3
    allowed[..., 0] = True
    quantized = torch.rand(T, S, generator=g) > 0.5
    return q, k, v, kh, vh, quantized, allowed


def test_selective_attention_slow_reference():
    q, k, v, kh, vh, quantized, allowed = _inputs()
    out = selective_attention(q, k, v, kh, vh, quantized, allowed, 0.25)
    B, Hq, T, d = q.shape
    G = Hq // k.shape[1]
    for b in range(B):
        for h in range(Hq):
            for i in range(T):
                kk = torch.where(quantized[i, :, None], kh[b, h // G], k[b, h // G])
                vv = torch.where(quantized[i, :, None], vh[b, h // G], v[b, h // G])
                s = (kk @ q[b, h, i]) * 0.25
                s = s.masked_fill(~allowed[b, 0, i], float("-inf"))
                torch.testing.assert_close(out[b, i, h], torch.softmax(s, 0) @ vv, rtol=1e-5, atol=1e-6)


def test_fused_equals_reference():
    q, k, v, kh, vh, quantized, allowed = _inputs(1)
    a = selective_attention(q, k, v, kh, vh, quantized, allowed, 0.3)
    b = fused_selective_attention(q, k, v, kh, vh, quantized, allowed, 0.3)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # with nothing quantized it is plain attention
    none = torch.zeros_like(quantized)
    torch.testing.assert_close(fused_selective_attention(q, k, v, kh, vh, none, allowed, 0.3), reference_attention(q, k, v, allowed, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_reference_matches_sdpa(softcap):
    q, k, v, *_ , allowed = _inputs(2)
    out = reference_attention(q, k, v, allowed, 0.25, softcap)
    if softcap is None:
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.25, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    else:
        assert torch.isfinite(out).all()
