"""Decode attention over packed codes equals dequantize-then-attend (docs/reference/math.md#32-full-precision-windows-and-the-batched-flush storage, issue: speed)."""

import hashlib
from pathlib import Path

import pytest
import torch

from wushkv import decode
from wushkv.codecs import make_codec
from wushkv.config import QuantConfig, WindowConfig
from wushkv.decode import codes_as_float, decode_attention, dequantize_then_attend
from wushkv.quantizers import pack, unpack

from conftest import centered_parts, require_kernels


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
    "quest-K3V4-groups8": QuantConfig(3, 4, "quest", group_size=8),
    "affine-K3V2-groups4": QuantConfig(3, 2, "affine", group_size=4),
    "kivi-2": QuantConfig(2, 2, "kivi", windows=WindowConfig(4, 8, 8)),
    "kvarn-K4V2": QuantConfig(4, 2, "kvarn", windows=WindowConfig(8, 0, 8)),
    "K2-only": QuantConfig(2, None, "quest"),
}


@pytest.fixture(params=["fused", "kernels", "pytorch"])
def path(request):
    """Every implementation of the CPU decode: a layer in one fused kernel call (``parts_decode``, where it applies),
    part by part with the code-domain products in the kernels (what the cases the fused call leaves out run), and pure
    PyTorch."""
    if request.param == "pytorch":
        with decode.kernels_enabled(False):
            yield request.param
        return
    require_kernels()
    with decode.fused_enabled(request.param == "fused"):
        yield request.param


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


@pytest.mark.parametrize("name", ["quest-K2V2", "kvarn-K4V2"])
def test_packed_decode_with_sink_logits(name, path):
    """Learned sink logits (gpt-oss) join the softmax of the code-domain decode as one zero-valued column per query
    head: equal to plain attention over the dequantized cache with the same sinks, and different from none (the sinks
    take a visible share of the probability)."""
    pk, pv = _parts(CASES[name])
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(1)) * 2
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    ref = dequantize_then_attend(q, pk, pv, None, 32**-0.5, sinks=sinks)
    out = decode_attention(q, pk, pv, None, 32**-0.5, block=8, sinks=sinks)
    assert ((out - ref).norm() / ref.norm()) < 1e-5
    plain = decode_attention(q, pk, pv, None, 32**-0.5, block=8)
    assert ((out - plain).norm() / plain.norm()) > 1e-2
    # the reference itself: softmax over [scores, sink] with the sink's share dropped
    K = torch.cat([p if torch.is_tensor(p) else p[0].decode(p[1], p[2]) for p in pk if torch.is_tensor(p) or p[2]], 2)
    V = torch.cat([p if torch.is_tensor(p) else p[0].decode(p[1], p[2]) for p in pv if torch.is_tensor(p) or p[2]], 2)
    s = torch.einsum("bhgd,bhsd->bhgs", q.view(2, 2, 2, 32), K) * 32**-0.5
    p = torch.softmax(torch.cat([s, sinks.view(1, 2, 2, 1).expand(2, 2, 2, 1)], -1), -1)[..., :-1]
    manual = torch.einsum("bhgs,bhsd->bhgd", p, V).reshape(2, 1, 4, 32)
    torch.testing.assert_close(ref, manual, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cfg, calls", [
    (QuantConfig(2, 2, "affine", group_size=16), {"code_dot": 2, "code_weighted_sum": 2}),
    (QuantConfig(3, 4, "quest", group_size=8), {"code_dot": 4, "code_weighted_sum": 4}),
    (QuantConfig(4, 3, "quest", group_size=16), {"code_dot": 2, "code_weighted_sum": 2}),
    (QuantConfig(3, 2, "quest", group_size=4), {"code_weighted_sum": 8}),  # 12-bit key groups: not whole bytes
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
def test_groups_within_a_token_decode_from_their_codes(cfg, calls, dtype, fused):
    """Groups smaller than head_dim (``group_size``) are read from their codes group by group, each group's codes a
    run of the packed row's units (bytes; 3 bytes at 3 bits) with its own scale and offset: in the fused call
    (``parts_decode``), or part by part (one kernel call per group and side); equal to dequantize-then-attend. A group
    that ends mid-byte takes the PyTorch path (float codes per block)."""
    from wushkv import _ext

    require_kernels()
    pk, pv = _parts(cfg, n_mid=300, dtype=dtype)
    q = (torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    ref = dequantize_then_attend(q.double(), [p.double() if torch.is_tensor(p) else p for p in pk],
                                 [p.double() if torch.is_tensor(p) else p for p in pv], None, 32**-0.5)
    if fused and "code_dot" in calls:  # both sides' groups are whole units
        calls = {"parts_decode": 1}
    _ext.reset_calls()
    with decode.fused_enabled(fused):
        out = decode_attention(q, pk, pv, None, 32**-0.5, block=128)
    assert _ext.calls() == calls, _ext.calls()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    # bfloat16: the per-part path's scores and probabilities in bfloat16 (pure PyTorch: 1.7-2.7e-2 on these cases,
    # the kernels 1.6-1.7e-2), the fused call's output rounded to bfloat16; float32 checks the groups' arithmetic
    assert err < {torch.float32: 1e-5, torch.bfloat16: 4e-3 if calls == {"parts_decode": 1} else 3e-2}[dtype], err


def test_kernels_take_the_vector_path_this_cpu_has():
    """The fused kernels are built for this CPU (-march=native) and take the widest vector path it offers: AVX-512
    where /proc/cpuinfo lists avx512f, bw and vl, else AVX2 where it lists avx2 and fma, else scalar loops (20-30x
    slower per token on the paged decode: a build that lost its flags would pass every equality test and still be
    that slow)."""
    from pathlib import Path

    ext = require_kernels()
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo to read this CPU's flags from")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.read_text().splitlines() if ln.startswith("flags")), []))
    want = ("avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "scalar")
    assert ext.simd_path() == want, (ext.simd_path(), want)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 40])
def test_fused_kernels_equal_float_codes(bits, d):
    """code_dot / code_weighted_sum on a strided view of a larger buffer (as the cache stores codes); 1501 tokens: the
    last work item's rows are not a multiple of the rows the kernels read at once; 3 bits read 8 codes from 3 bytes,
    head_dim 40 ends a row on 5 such units (a partial load)."""
    ext = require_kernels()
    g = torch.Generator().manual_seed(bits * d)
    c = torch.randint(0, 2**bits, (2, 3, 1501, d), generator=g, dtype=torch.uint8)
    packed = pack(c, bits)
    big = torch.zeros(2, 3, 1600, packed.shape[-1], dtype=torch.uint8)
    big[:, :, 30:1531] = packed
    view = big[:, :, 30:1531]
    q, w = torch.randn(2, 3, 4, d, generator=g), torch.randn(2, 3, 4, 1501, generator=g)
    ref_q, ref_w = q.double() @ c.double().transpose(-1, -2), w.double() @ c.double()
    assert ((ext.code_dot(view, q, bits).double() - ref_q).norm() / ref_q.norm()) < 1e-6
    assert ((ext.code_weighted_sum(view, w, bits, d).double() - ref_w).norm() / ref_w.norm()) < 1e-6


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d, G, tile", [(64, 3, 128), (40, 4, 21), (32, 1, 300), (64, 5, 7)])
def test_code_dot_tiles_reads_each_token_with_its_tiles_queries(bits, d, G, tile):
    """code_dot_tiles: token j against query set j // tile (KVarN's key tiles: each tile's channel-scaled queries),
    plus the set's bias, times the token's scale (the tile's q·zero and s_tok), on a strided view of a larger buffer;
    1501 tokens end on a partial tile, tiles of 300 and 21 straddle the kernel's 1024-token work items, and runs of
    a tile's tokens in a work item that are not a multiple of the rows the kernel reads at once (4, or 2 for 4
    queries) end one row at a time; head_dim 40 ends rows on a partial group of vector lanes; 5 queries are read as
    4 + 1."""
    ext = require_kernels()
    g = torch.Generator().manual_seed(bits * d + tile)
    N = 1501
    c = torch.randint(0, 2**bits, (2, 3, N, d), generator=g, dtype=torch.uint8)
    packed = pack(c, bits)
    big = torch.zeros(2, 3, N + 70, packed.shape[-1], dtype=torch.uint8)
    big[:, :, 50 : 50 + N] = packed
    tiles = -(-N // tile)
    q, bias = torch.randn(2, 3, tiles, G, d, generator=g), torch.randn(2, 3, tiles, G, generator=g) * 10
    s_tok = torch.rand(2, 3, N, generator=g) + 0.5
    per_token = lambda t: t.repeat_interleave(tile, 2)[:, :, :N].double()  # noqa: E731
    ref = torch.einsum("bhngd,bhnd->bhgn", per_token(q), c.double())
    ref = (ref + per_token(bias).transpose(-1, -2)) * s_tok.double()[:, :, None]
    out = ext.code_dot_tiles(big[:, :, 50 : 50 + N], q, bits, tile, bias, s_tok)
    assert out.shape == (2, 3, G, N)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-6
    with pytest.raises(RuntimeError, match="do not cover"):
        ext.code_dot_tiles(packed, q[:, :, :-1], bits, tile, bias[:, :, :-1], s_tok)
    with pytest.raises(RuntimeError, match="bias: float32"):
        ext.code_dot_tiles(packed, q, bits, tile, bias[..., :-1], s_tok)


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tiles", ["kvarn", "kivi"])
def test_key_tiles_decode_from_their_codes_without_a_float_copy(centered, fused, tiles):
    """KVarN's key tiles (``auto``'s keys) and KIVI's per-channel keys (tiles whose s_tok is 1) are read by the
    kernels from their codes, one set of channel-scaled queries per tile, with the centers' share of the scores
    (``+rmean``) from the position: in one ``parts_decode`` call, or part by part (``code_dot_tiles``); equal to
    attention over the dequantized keys, and holding nothing the size of the middle's keys in float32 (the
    dequantizing path held blocks of up to a million floats)."""
    from torch.profiler import ProfilerActivity, profile

    from wushkv import _ext

    require_kernels()
    cfg = QuantConfig(2, 2, "quest", key_quantizer=tiles, windows=WindowConfig(8, 0, 128))
    if centered:
        pk, pv, _, _ = centered_parts(cfg, None, n_mid=4096, d=64, H=2, B=2)
    else:
        pk, pv = _parts(cfg, B=2, H=2, d=64, n_mid=4096)
    q = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(1)) * 2
    ref = dequantize_then_attend(q, pk, pv, None, 64**-0.5)
    with decode.fused_enabled(fused):
        _ext.reset_calls()
        out = decode_attention(q, pk, pv, None, 64**-0.5, block=512)
        assert _ext.calls() == ({"parts_decode": 1} if fused else {"code_dot_tiles": 1, "code_weighted_sum": 1}), _ext.calls()
        # float32 over 4096 scores up to ±19: these paths and the dequantizing one are all ~1.6e-5 from float64
        assert ((out - ref).norm() / ref.norm()) < 5e-5
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            decode_attention(q, pk, pv, None, 64**-0.5, block=512)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    middle = 2 * 2 * 4096 * 64 * 4
    assert 0 < largest < middle / 16, (largest, middle)


def _mixed_parts(cfg, B, H, d, n_mid, dtype, centered, pads, seed):
    """[sink, middle, recent] parts as the cache hands them to decode in ``dtype`` (the middle coded by ``cfg``'s
    codecs, keys centered on a rotating mean where ``centered``); a sink of 5 and a recent buffer of 37 tokens."""
    if centered:
        pk, pv, _, _ = centered_parts(cfg, pads, B=B, H=H, d=d, n_mid=n_mid, seed=seed)
        pk[0], pk[2] = torch.randn(B, H, 5, d) * 2, torch.randn(B, H, 37, d) * 2
        pv[0], pv[2] = torch.randn(B, H, 5, d), torch.randn(B, H, 37, d)
    else:
        pk, pv = _parts(cfg, B=B, H=H, d=d, n_sink=5, n_mid=max(n_mid, 1), n_recent=37, seed=seed)
        if not n_mid:  # nothing coded yet (the first steps of a cache): an empty store
            pk[1], pv[1] = (pk[1][0], {}, 0), (pv[1][0], {}, 0)
    cast = lambda ps: [p.to(dtype) if torch.is_tensor(p) else p for p in ps]  # noqa: E731
    return cast(pk), cast(pv)


FUSED = {  # name: (config, GQA group, head_dim, dtype, middle tokens, ragged rows, centered keys)
    "quest-K2V8-f32-chunks": (QuantConfig(2, 8, "quest"), 1, 64, torch.float32, 1100, False, False),
    "quest-K2V2-e5m3-bf16-ragged": (QuantConfig(2, 2, "quest", metadata_dtype="e5m3"), 3, 64, torch.bfloat16, 300, True, False),
    "affine-K4V2-bf16meta-d128": (QuantConfig(4, 2, "affine", metadata_dtype="bfloat16"), 4, 128, torch.float32, 260, False, False),
    "quest-K8V4-f32meta-G7-d40-f16": (QuantConfig(8, 4, "quest", metadata_dtype="float32"), 7, 40, torch.float16, 90, True, False),
    "ktiles-K2V4-rmean-ragged": (QuantConfig(2, 4, "quest", key_quantizer="kvarn", windows=WindowConfig(8, 0, 20)), 3, 64,
                                 torch.float32, 200, True, True),
    "ktiles-K4V2-G8-d128-bf16-chunks": (QuantConfig(4, 2, "quest", key_quantizer="kvarn", windows=WindowConfig(8, 0, 128)), 8,
                                        128, torch.bfloat16, 1152, False, False),
    "quest-K2-rmean": (QuantConfig(2, 2, "quest"), 2, 32, torch.float32, 150, False, True),
    "quest-K3V3-G3-chunks": (QuantConfig(3, 3, "quest"), 3, 64, torch.float32, 1100, False, False),
    "affine-K3V2-groups16-ragged-chunks": (QuantConfig(3, 2, "affine", group_size=16), 3, 64, torch.float32, 1100, True,
                                           False),
    "quest-K4V3-groups32-e5m3-bf16": (QuantConfig(4, 3, "quest", group_size=32, metadata_dtype="e5m3"), 2, 128,
                                      torch.bfloat16, 200, False, False),
    "kivi-K2V2-ragged": (QuantConfig(2, 2, "kivi", windows=WindowConfig(8, 0, 16)), 3, 64, torch.float32, 160, True, False),
    "kivi-K3-quest-V4-rmean-bf16": (QuantConfig(3, 4, "quest", key_quantizer="kivi", metadata_dtype="bfloat16",
                                                windows=WindowConfig(8, 0, 32)), 2, 64, torch.bfloat16, 1088, False, True),
    "affine-K3V3-d40-bf16-ragged": (QuantConfig(3, 3, "affine"), 2, 40, torch.bfloat16, 120, True, False),
    "ktiles-K3V3-rmean-d128": (QuantConfig(3, 3, "quest", key_quantizer="kvarn", windows=WindowConfig(8, 0, 64)), 4, 128,
                               torch.float32, 320, False, True),
    "K2-only": (QuantConfig(2, None, "quest"), 2, 64, torch.float32, 70, True, False),
    "V2-only": (QuantConfig(None, 2, "quest"), 2, 64, torch.float32, 70, False, False),
    "empty-middle": (QuantConfig(2, 2, "quest"), 3, 64, torch.float32, 0, False, False),
    # KVarN's value tiles (the kvarn method; +tiles): each tile's channel scales over its tokens' affine rows
    "kvarn-K2V2-ragged": (QuantConfig(2, 2, "kvarn", windows=WindowConfig(8, 0, 16)), 3, 64, torch.float32, 160, True, False),
    "vtiles-K3V4-quest-keys-bf16-chunks": (QuantConfig(3, 4, "kvarn", key_quantizer="quest", windows=WindowConfig(8, 0, 64)), 4,
                                           128, torch.bfloat16, 1088, False, False),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_parts_decode_equals_dequantize_then_attend(name):
    """The fused CPU decode (one ``parts_decode`` call a layer) against dequantize-then-attend in float32 on the same
    values: 2/3/4/8-bit QuEST and affine codes (3 bits: 8 codes in 3 bytes; groups within a token) with
    float16/bfloat16/float32/E5M3 metadata, KVarN's key tiles, KIVI's per-channel keys (tiles whose s_tok is 1), keys
    centered on their rotating mean, full-precision middles, an empty one; GQA groups 1-8 (two calls of the 4-query
    row kernels from 5 on), head_dim 32-128, middles over a work item (1,024 tokens), float32/bfloat16/float16 parts;
    a mask over the last columns with softcapping and sink logits, or ragged rows (``held``: each row its own
    columns of each part, the tiles' on their blocks) under a mask over all the columns. float32 agrees to float32
    rounding; 16-bit outputs to their own rounding (the kernel computes in float32 from the same values)."""
    from wushkv import _ext

    require_kernels()
    cfg, G, d, dtype, n_mid, ragged, centered = FUSED[name]
    B, H = 3, 2
    g = torch.Generator().manual_seed(len(name))
    pads = torch.tensor([0, 3, 1]) if centered and ragged else None
    pk, pv = _mixed_parts(cfg, B, H, d, n_mid, dtype, centered, pads, seed=len(name))
    q = (torch.randn(B, H * G, 1, d, generator=g) * 2).to(dtype)
    widths = [5, n_mid, 37]
    n_all = sum(widths)
    to64 = lambda ps: [p.double() if torch.is_tensor(p) else p for p in ps]  # noqa: E731
    softcap, sinks, held = None, None, None
    if ragged:  # each row its own columns of each part; the mask over all the parts' columns
        tiles = cfg.side_quantizer("key") in ("kvarn", "kivi") or cfg.side_quantizer("value") == "kvarn"
        tile = cfg.windows.S_flush if tiles else 1
        held = torch.zeros(B, 3, 2, dtype=torch.int64)
        for b in range(B):
            for i, w in enumerate(widths):
                step = tile if i == 1 else 1
                a = int(torch.randint(0, w // step // 2 + 1, (1,), generator=g)) * step
                e = a + int(torch.randint(1, (w - a) // step + 1, (1,), generator=g)) * step if w else 0
                held[b, i] = torch.tensor([a, min(e, w)])
        allowed = (torch.rand(B, n_all, generator=g) > 0.2).view(B, 1, 1, n_all)
        allowed[..., -1] = True
    else:
        S = n_all - 4  # the first 4 columns outside the window
        allowed = (torch.rand(B, 1, 1, S, generator=g) > 0.3)
        allowed[..., -1] = True
        softcap, sinks = 15.0, torch.linspace(-1, 3, H * G)
    scaling = d**-0.5
    _ext.reset_calls()
    out = decode_attention(q, pk, pv, allowed, scaling, softcap, sinks=sinks, held=held)
    assert _ext.calls() == {"parts_decode": 1}, _ext.calls()
    assert out.shape == (B, 1, H * G, d) and out.dtype == dtype
    # the reference in float64 over the same values (the codes dequantized in float32, as the codecs do)
    if held is None:
        ref = dequantize_then_attend(q.double(), to64(pk), to64(pv), allowed, scaling, softcap, sinks)
    else:
        starts = [0, widths[0], widths[0] + widths[1]]
        ref = torch.cat([dequantize_then_attend(q[b : b + 1].double(), *decode._held_row(to64(pk), to64(pv), allowed, starts,
                                                                                       held[b].tolist(), b), scaling)
                         for b in range(B)])
    err = ((out.double() - ref).norm() / ref.norm()).item()
    # float32: scale·(q·codes) + offset·Σq cancels more than a dot with dequantized keys (5.5e-6 at worst here, the
    # part-by-part paths 7.5e-6 on that case); 16-bit: the output's own rounding
    assert err < {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}[dtype], err


def test_parts_decode_refuses_what_it_cannot_read():
    """Spans outside a part, a mask wider than the columns, a query not in float32: errors that name them."""
    ext = require_kernels()
    q, kv = torch.randn(1, 2, 32), torch.randn(1, 1, 4, 32)
    none, z = torch.empty(0), kv[:, :, :0]
    call = lambda q=q, spans=torch.empty(0, dtype=torch.int64), vis=torch.empty(0, dtype=torch.bool): ext.parts_decode(  # noqa: E731
        q, spans, [4, 0, 4], [kv, z, kv], [kv, z, kv], [], 0, 0, 0.0, [], 0, 0, 0.0, vis, 1.0, 0.0, none, none, none, none)
    assert call().shape == (1, 2, 32)
    with pytest.raises(RuntimeError, match=r"spans\[0, 2\] = \[0, 5\) is not within the part's 4 columns"):
        call(spans=torch.tensor([[[0, 4], [0, 0], [0, 5]]]))
    with pytest.raises(RuntimeError, match="visible: bool"):
        call(vis=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="q: float32"):
        call(q=q.double())


def test_mask_and_visible_columns(path):
    """``allowed`` covers the last S columns; earlier ones (outside a sliding window) are invisible."""
    pk, pv = _parts(CASES["quest-K2V2"])
    q = torch.randn(2, 4, 1, 32)
    allowed = torch.rand(2, 1, 1, 30) > 0.3
    allowed[..., -1] = True
    ref = dequantize_then_attend(q, pk, pv, allowed, 0.2)
    out = decode_attention(q, pk, pv, allowed, 0.2, block=16)
    assert ((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("name", ["quest-K2V2", "affine-K4V2", "affine-groups16", "kvarn-K4V2"])
@pytest.mark.parametrize("pads", [None, torch.tensor([0, 4])])
def test_centered_keys_decode_in_the_code_domain(name, pads, path):
    """Keys centered on their rotating mean (+rmean) are read from their codes with the centers' share of the scores
    computed from the position (never forming T c_t): equal to attention over the keys they stand for (codes
    dequantized, centers at each row's position added), for every block size."""
    from wushkv.attention import reference_attention

    cfg = CASES[name]
    if cfg.quantizer == "kvarn":
        cfg = QuantConfig(4, 2, "kvarn", windows=WindowConfig(8, 0, 20))  # tiles of 20 tokens
    pk, pv, keys, values = centered_parts(cfg, pads)
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(1)) * 2
    ref = reference_attention(q, keys, values, None, 32**-0.5)
    assert ((dequantize_then_attend(q, pk, pv, None, 32**-0.5) - ref).norm() / ref.norm()) < 1e-6
    for block in (20, 60, 4096):
        out = decode_attention(q, pk, pv, None, 32**-0.5, block=block)
        assert ((out - ref).norm() / ref.norm()) < 1e-5, block
    plain = decode_attention(q, [pk[0], pk[1][:3], pk[2]], pv, None, 32**-0.5)  # the centers matter
    assert ((plain - ref).norm() / ref.norm()) > 1e-2


def test_centered_keys_make_no_full_precision_copy_of_the_middle():
    """Reading centered keys from their codes holds one block at a time: no allocation the size of the middle's
    keys in float32 (the dequantize-and-add path made one at every step)."""
    from torch.profiler import ProfilerActivity, profile

    pk, pv, keys, _ = centered_parts(QuantConfig(2, 2, "quest"), n_mid=4096, d=64, H=2, B=2)
    q = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(1))
    middle = 2 * 2 * 4096 * 64 * 4
    with decode.kernels_enabled(False):
        decode_attention(q, pk, pv, None, 64**-0.5, block=512)  # the first call builds the code and offset tables
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            decode_attention(q, pk, pv, None, 64**-0.5, block=512)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert 0 < largest < middle / 4, (largest, middle)


def test_bfloat16_close_to_float32():
    cfg = CASES["quest-K2V2"]
    pk, pv = _parts(cfg)
    q = torch.randn(2, 4, 1, 32)
    ref = decode_attention(q, pk, pv, None, 0.2)
    cast = lambda ps: [p.bfloat16() if torch.is_tensor(p) else p for p in ps]
    out = decode_attention(q.bfloat16(), cast(pk), cast(pv), None, 0.2)
    assert out.dtype == torch.bfloat16 and ((out.float() - ref).norm() / ref.norm()) < 3e-2


def test_build_lock_clears_a_killed_builds_baton_and_excludes_other_builds(tmp_path):
    """A build killed mid-compile leaves torch's baton file; the next build must not wait on it forever,
    and while one process builds, no other wushkv process may (it waits on the OS lock)."""
    import fcntl

    from wushkv._ext import build_lock

    (tmp_path / "lock").touch()  # what a SIGKILLed torch build leaves
    with pytest.warns(UserWarning, match="stale build lock"), build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "wushkv.flock", "a") as other:  # another process's attempt
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / "wushkv.flock", "a") as other:  # released on exit
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_build_runs_under_the_lock_in_the_folder_torch_builds_in(tmp_path, monkeypatch):
    """The folder whose baton is cleared is the one handed to torch's ``load``."""
    import torch.utils.cpp_extension as cpp

    import wushkv._ext as ext

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("WUSHKV_NO_EXT", raising=False)
    seen = {}

    def fake_load(**kw):
        bd = Path(kw["build_directory"])
        seen["dir"], seen["baton_left"] = bd, (bd / "lock").exists()
        return "module"

    monkeypatch.setattr(cpp, "load", fake_load)
    bd = ext.kernel_directory()
    bd.mkdir(parents=True)
    (bd / "lock").touch()
    with pytest.warns(UserWarning, match="stale build lock"):
        assert ext._build() == "module"
    assert seen == {"dir": bd, "baton_left": False} and bd.is_relative_to(tmp_path)


def test_a_failed_build_is_a_failure_where_a_toolchain_is_present(monkeypatch):
    """The kernel tests skip only where no build is possible; the toolchain probe sees this machine's compiler
    and ninja, and WUSHKV_NO_EXT turns the build off."""
    import os

    from wushkv import _ext

    tools = _ext.toolchain()
    assert set(tools) == {"compiler", "ninja"}
    if os.environ.get("WUSHKV_NO_EXT", "") in ("", "0") and all(tools.values()):
        assert _ext.can_build() and require_kernels() is not None
    monkeypatch.setenv("WUSHKV_NO_EXT", "1")
    assert not _ext.can_build()


def test_each_environment_builds_in_its_own_folder(monkeypatch):
    """Two environments with the same Python and torch (wushkv's and the vLLM plugin's) must not share a build folder:
    torch's build file names its environment's headers, so each would find the other's build stale and rebuild it."""
    import torch

    import wushkv._ext as ext

    here = ext.build_directory("k")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    there = ext.build_directory("k")
    assert here != there and here.parent.parent == there.parent.parent and here.name == there.name == "k"
    # and one per source: another checkout of wushkv in the same environment builds beside, not over, this one
    assert ext.kernel_directory().parent == ext.build_directory(f"wushkv_codes_{ext._cpu_tag()}")
    assert ext.kernel_directory().name == hashlib.sha256(ext.SOURCE.read_bytes()).hexdigest()[:10]


def test_dequantized_blocks_shrink_with_the_batch():
    """A run dequantized block by block (KVarN tiles, KIVI) is read in blocks of at most ``block`` tokens, fewer for a
    large batch, so one block's floats stay near _DEQUANT_FLOATS whatever B·Hkv (blocks of 4096 tokens over 16 rows of
    3 heads ran at a third of the speed); the blocks tile the run in whole codec blocks."""
    from wushkv.decode import _DEQUANT_FLOATS, _dequant_steps

    codec = make_codec(QuantConfig(2, 2, "kvarn", windows=WindowConfig(8, 0, 16)), "key", 64)
    for rows, want in ((1, 1000), (12, 1000), (48, 256), (10**6, codec.block)):
        steps = _dequant_steps(1000, codec, 4096, rows)
        assert steps[0][0] == 0 and steps[-1][1] == 1000 and all(b == c for (_, b), (c, _) in zip(steps, steps[1:]))
        size = steps[0][1] - steps[0][0]
        assert size == want and size % codec.block == 0 or size == 1000
        assert size * rows * 64 <= max(_DEQUANT_FLOATS, codec.block * rows * 64)
