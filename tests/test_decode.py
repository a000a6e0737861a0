"""Decode attention over packed codes equals dequantize-then-attend (METHOD §3.2 storage, issue: speed)."""

import pytest
import torch

from wushkv import decode
from wushkv.codecs import make_codec
from wushkv.config import QuantConfig, WindowConfig
from wushkv.decode import codes_as_float, decode_attention, dequantize_then_attend
from wushkv.quantizers import pack, unpack


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_codes_as_float_equals_unpack(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (2, 3, 17, 40), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert torch.equal(codes_as_float(packed, bits, 40, torch.float32), unpack(packed, bits, 40).float())


def _parts(cfg, B=2, H=2, d=32, n_sink=3, n_mid=40, n_recent=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = lambda n: (torch.randn(B, H, n, d, generator=g) * torch.linspace(0.2, 3, d)).to(dtype)
    out = []
    for side in ("key", "value"):
        codec = make_codec(cfg, side, d)
        mid = x(n_mid)
        mid_part = (codec, codec.encode(mid), n_mid) if codec is not None else mid
        out.append([x(n_sink), mid_part, x(n_recent)])
    return out


CASES = {
    "quest-K2V2": QuantConfig(2, 2, "quest"),
    "quest-K3V4": QuantConfig(3, 4, "quest"),
    "quest-8": QuantConfig(8, 8, "quest"),
    "affine-K4V2": QuantConfig(4, 2, "affine"),
    "affine-groups16": QuantConfig(2, 2, "affine", group_size=16),
    "kivi-2": QuantConfig(2, 2, "kivi", windows=WindowConfig(4, 8, 8)),
    "kvarn-K4V2": QuantConfig(4, 2, "kvarn", windows=WindowConfig(8, 0, 8)),
    "K2-only": QuantConfig(2, None, "quest"),
}


@pytest.fixture(params=["kernels", "pytorch"])
def path(request, monkeypatch):
    """Both implementations of the code-domain products: the fused CPU kernels and pure PyTorch."""
    if request.param == "kernels":
        from wushkv._ext import kernels

        if kernels() is None:
            pytest.skip("the fused CPU kernels could not be built here (no compiler or ninja)")
    else:
        monkeypatch.setattr(decode, "USE_KERNELS", False)
    return request.param


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_packed_decode_equals_dequantize_then_sdpa(name, softcap, path):
    pk, pv = _parts(CASES[name])
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(1)) * 2  # float32: the code-domain path
    ref = dequantize_then_attend(q, pk, pv, None, 32**-0.5, softcap)
    for block in (8, 16, 4096):  # blocks smaller than the middle give the same result
        out = decode_attention(q, pk, pv, None, 32**-0.5, softcap, block=block)
        assert out.shape == (2, 1, 4, 32)
        assert ((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 40])
def test_fused_kernels_equal_float_codes(bits, d):
    """code_dot / code_weighted_sum on a strided view of a larger buffer (as the cache stores codes)."""
    from wushkv._ext import kernels

    ext = kernels()
    if ext is None:
        pytest.skip("the fused CPU kernels could not be built here (no compiler or ninja)")
    g = torch.Generator().manual_seed(bits * d)
    c = torch.randint(0, 2**bits, (2, 3, 1500, d), generator=g, dtype=torch.uint8)
    packed = pack(c, bits)
    big = torch.zeros(2, 3, 1600, packed.shape[-1], dtype=torch.uint8)
    big[:, :, 30:1530] = packed
    view = big[:, :, 30:1530]
    q, w = torch.randn(2, 3, 4, d, generator=g), torch.randn(2, 3, 4, 1500, generator=g)
    ref_q, ref_w = q.double() @ c.double().transpose(-1, -2), w.double() @ c.double()
    assert ((ext.code_dot(view, q, bits).double() - ref_q).norm() / ref_q.norm()) < 1e-6
    assert ((ext.code_weighted_sum(view, w, bits, d).double() - ref_w).norm() / ref_w.norm()) < 1e-6


def test_mask_and_visible_columns(path):
    """``allowed`` covers the last S columns; earlier ones (outside a sliding window) are invisible."""
    pk, pv = _parts(CASES["quest-K2V2"])
    q = torch.randn(2, 4, 1, 32)
    allowed = torch.rand(2, 1, 1, 30) > 0.3
    allowed[..., -1] = True
    ref = dequantize_then_attend(q, pk, pv, allowed, 0.2)
    out = decode_attention(q, pk, pv, allowed, 0.2, block=16)
    assert ((out - ref).norm() / ref.norm()) < 1e-5


def test_bfloat16_close_to_float32():
    cfg = CASES["quest-K2V2"]
    pk, pv = _parts(cfg)
    q = torch.randn(2, 4, 1, 32)
    ref = decode_attention(q, pk, pv, None, 0.2)
    cast = lambda ps: [p.bfloat16() if torch.is_tensor(p) else p for p in ps]
    out = decode_attention(q.bfloat16(), cast(pk), cast(pv), None, 0.2)
    assert out.dtype == torch.bfloat16 and ((out.float() - ref).norm() / ref.norm()) < 3e-2


def test_clear_stale_lock_removes_only_old_locks(tmp_path):
    """A build killed mid-compile leaves torch's baton file; a later run must not wait on it forever."""
    import os
    import time

    from wushkv._ext import clear_stale_lock

    assert clear_stale_lock(tmp_path) is False  # no lock at all
    lock = tmp_path / "lock"
    lock.touch()
    assert clear_stale_lock(tmp_path, max_age=600) is False  # a live build's fresh lock is kept
    assert lock.exists()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="stale build lock"):
        assert clear_stale_lock(tmp_path, max_age=600) is True
    assert not lock.exists()
