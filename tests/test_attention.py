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


@pytest.mark.parametrize("window", [None, 9])
def test_blocked_emulation_equals_one_call(window):
    """Query blocks that read only the columns they need give the one-call result: a causal prefill
    with sink, quantized middle and recent window (the layout of docs/reference/math.md#32-full-precision-windows-and-the-batched-flush), left padding in row 1,
    and a sliding window."""
    B, Hkv, G, T, d, sink, keep = 2, 2, 2, 40, 8, 3, 6
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hkv * G, T, d, generator=g)
    k, v, kh, vh = (torch.randn(B, Hkv, T, d, generator=g) for _ in range(4))
    i, t = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (t <= i).expand(B, 1, T, T).clone()
    allowed[1, :, :, :5] = False  # five pad tokens in row 1
    allowed[1, :, :5, 0] = True  # pad rows attend somewhere (their output is unused)
    if window is not None:
        allowed &= t > i - window
    quantized = (t >= sink) & (t < (i + 1 - keep).clamp(min=sink))
    one = fused_selective_attention(q, k, v, kh, vh, quantized, allowed, 0.3, block=None)
    ref = selective_attention(q, k, v, kh, vh, quantized, allowed, 0.3)
    for block in (1, 7, 16, T):
        out = fused_selective_attention(q, k, v, kh, vh, quantized, allowed, 0.3, block=block)
        torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_blocked_emulation_chunked_prefill_and_padded_masks():
    """Queries that are the last T of S positions (a prefill after earlier tokens), a per-row
    (B, 1, T, S) quantized mask (left padding), and no mask at all."""
    B, Hkv, G, T, S, d = 2, 1, 4, 21, 50, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, Hkv * G, T, d, generator=g)
    k, v, kh, vh = (torch.randn(B, Hkv, S, d, generator=g) for _ in range(4))
    i, t = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
    allowed = (t <= i).expand(B, 1, T, S).clone()
    pads = torch.tensor([0, 3]).view(B, 1, 1, 1)
    quantized = (t >= pads + 2) & (t < (i + 1 - 6).clamp(min=0) + pads)  # (B, 1, T, S)
    for mask in (allowed, None):
        one = fused_selective_attention(q, k, v, kh, vh, quantized, mask, 0.4, block=None)
        torch.testing.assert_close(one, selective_attention(q, k, v, kh, vh, quantized, mask, 0.4), rtol=1e-4, atol=1e-5)
        for block in (4, 8, 64):
            torch.testing.assert_close(fused_selective_attention(q, k, v, kh, vh, quantized, mask, 0.4, block=block), one,
                                       rtol=1e-5, atol=1e-6)


def test_block_must_be_positive():
    q, k, v, kh, vh, quantized, allowed = _inputs(3)
    with pytest.raises(ValueError, match="block must be a positive number"):
        fused_selective_attention(q, k, v, kh, vh, quantized, allowed, 0.3, block=0)


def test_mask_skipped_only_for_one_query_over_full_attention_without_padding():
    """The registered mask function (wushkv.hf) gives a decode step over full attention without padding no mask (every
    column visible: the decode then reads none, a host cost per layer); a chunk of several queries always gets its
    causal mask, which the single-pass emulation reads, and so do a padded decode step and a sliding window."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from wushkv.hf import _bool_mask

    kw = dict(batch_size=2, kv_offset=0, mask_function=causal_mask_function, allow_is_causal_skip=True, device="cpu")
    ones = torch.ones(2, 9, dtype=torch.bool)
    assert _bool_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=None, **kw) is None
    assert _bool_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=ones, **kw) is None
    chunk = _bool_mask(q_length=4, kv_length=4, q_offset=0, attention_mask=None, **kw)
    assert chunk.shape == (2, 1, 4, 4) and torch.equal(chunk[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    pad = ones.clone()
    pad[1, :3] = False
    assert torch.equal(_bool_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=pad, **kw)[:, 0, 0], pad)
    # transformers' own refusal to skip stands
    assert _bool_mask(q_length=1, kv_length=9, q_offset=8, attention_mask=None, **(kw | {"allow_is_causal_skip": False})) is not None
    sliding = _bool_mask(q_length=1, kv_length=20, q_offset=19, attention_mask=None, local_size=16,
                         **(kw | {"mask_function": sliding_window_causal_mask_function(16)}))
    assert sliding[0, 0, 0].sum() == 16
