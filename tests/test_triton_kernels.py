"""The Triton kernels (wushkv.triton_kernels) against the PyTorch reference: store bit-exact with quantize + pack,
decode equal to dequantize-then-attend, a whole model's decode equal through both paths.

On a machine without CUDA they run on CPU tensors under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported); with CUDA the same tests run the compiled kernels on the GPU
(``benchmarks/gpu_check.sh``). Skipped only where triton cannot be imported. The interpreter is slow: shapes are tiny.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from wushkv import decode as decode_mod  # noqa: E402
from wushkv import triton_kernels as tk  # noqa: E402
from wushkv.cache import WushKVCache  # noqa: E402
from wushkv.codecs import KVarNCodec, TokenCodec  # noqa: E402
from wushkv.config import QuantConfig, WindowConfig  # noqa: E402
from wushkv.decode import decode_attention, dequantize_then_attend  # noqa: E402
from wushkv.layer import CacheInputs, WushKVLayer  # noqa: E402
from wushkv.quantizers import AffineQuantizer, QuestQuantizer, pack  # noqa: E402

from conftest import tiny_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not tk.interpreting() else "cpu"
# QuEST's step needs ‖x‖ of each group: a sum whose order differs between torch and the kernel (and on CUDA torch
# divides by a constant through its reciprocal), so on arbitrary data the step may differ in its last bit. On data
# whose arithmetic is exact (multiples of 1/8) every result is bit for bit.
EXACT_ON_ANY_DATA = DEVICE == "cpu"

QUANTIZERS = {
    "quest1": QuestQuantizer(1), "quest2": QuestQuantizer(2), "quest3": QuestQuantizer(3), "quest4-g16": QuestQuantizer(4, 16),
    "quest8": QuestQuantizer(8), "affine1-g16": AffineQuantizer(1, 16, clip_ratio=0.9), "affine2": AffineQuantizer(2, clip_ratio=0.92),
    "affine3": AffineQuantizer(3, clip_ratio=0.96), "affine4": AffineQuantizer(4), "affine8-g32": AffineQuantizer(8, 32, clip_ratio=0.9),
}


def _exact_data(shape, seed):
    """Multiples of 1/8 in [-8, 8]: sums of squares of up to 256 of them are exact in float32, in any order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 65, shape, generator=g).float() / 8


def _buffers(lead, fmt, meta, fill=0xAB):
    codes = torch.full((*lead, fmt.nbytes), fill, dtype=torch.uint8, device=DEVICE)
    scale = torch.full((*lead, fmt.ngroups), -7.0, dtype=meta, device=DEVICE)
    return codes, scale, (None if fmt.quest else torch.full_like(scale, -7.0))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_pack_bit_exact(bits):
    """The kernel's packing equals wushkv.quantizers.pack: codes set through QuEST at a step of 1 (x = code − 2^{b−1}
    quantizes to exactly ``code``, unclipped at 8 bits) land in the same bytes."""
    d = 64
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (6, 1, d), generator=g, dtype=torch.uint8)
    codes[..., 0] = 2**bits - 1  # max|x| fixes the unclipped step; the clipped one is computed below
    x = codes.float() - 2 ** (bits - 1) + 0.5  # the midrise level (q + ½)·Δ of each code at Δ = 1
    q = QuestQuantizer(bits, clip=False, alpha_scale=1.0)
    assert torch.equal(q.quantize(x).codes, codes)  # the reference maps x to these codes at Δ = 1
    fmt = tk.TokenFormat.of(q, d)
    out, scale, _ = _buffers((6, 1, 1), fmt, torch.float32)
    tk.store_paged(x.to(DEVICE), torch.arange(6), out, scale, None, fmt)
    assert torch.equal(out[:, 0].cpu(), pack(codes, bits))


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_store_equals_quantize_and_pack(name):
    """Store into paged blocks (slot < 0 skipped, other slots untouched) and into the contiguous layout equals
    ``quantize`` + ``pack`` with the metadata in float16, bit for bit."""
    q, d, H = QUANTIZERS[name], 64, 2
    fmt = tk.TokenFormat.of(q, d)
    x = _exact_data((5, H, d), seed=len(name))
    ref = q.quantize(x)
    # paged: 3 blocks of 4 slots; token 2 is padding (slot −1)
    slots = torch.tensor([9, 0, -1, 6, 3])
    codes, scale, offset = _buffers((3, 4, H), fmt, torch.float16)
    tk.store_paged(x.to(DEVICE), slots, codes, scale, offset, fmt)
    written = torch.zeros(12, dtype=torch.bool)
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written[s] = True
        blk, row = divmod(s, 4)
        assert torch.equal(codes[blk, row].cpu(), pack(ref.codes[r], q.bits)), (name, r)
        assert torch.equal(scale[blk, row].cpu(), ref.scale[r].half()), (name, r)
        if offset is not None:
            assert torch.equal(offset[blk, row].cpu(), ref.offset[r].half()), (name, r)
    untouched = ~written.view(3, 4)
    assert (codes[untouched.to(DEVICE)] == 0xAB).all() and (scale[untouched.to(DEVICE)] == -7).all()
    # contiguous (B=2, H, cap=6): tokens 1..3 of sequence 0, 2..4 of sequence 1
    xc = _exact_data((2, H, 3, d), seed=7)
    refc = q.quantize(xc)
    codes, scale, offset = _buffers((2, H, 6), fmt, torch.bfloat16)
    tk.store_contiguous(xc.to(DEVICE), codes, scale, offset, torch.tensor([1, 2]), fmt)
    for b, a in ((0, 1), (1, 2)):
        assert torch.equal(codes[b, :, a : a + 3].cpu(), pack(refc.codes[b], q.bits))
        assert torch.equal(scale[b, :, a : a + 3].cpu(), refc.scale[b].bfloat16())
        assert (codes[b, :, :a] == 0xAB).all() and (codes[b, :, a + 3 :] == 0xAB).all()


@pytest.mark.parametrize("name", ["quest2", "quest4-g16", "affine2", "affine8-g32"])
def test_store_on_gaussian_rows(name):
    """Arbitrary float rows: the affine grid (min, max, a percentile: no sums) is bit for bit; QuEST's step agrees
    to float32 rounding and its codes everywhere but where x/Δ sits on a level boundary to that rounding."""
    q, d = QUANTIZERS[name], 128
    fmt = tk.TokenFormat.of(q, d)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 2, d, generator=g) * torch.linspace(0.2, 3, d)
    ref = q.quantize(x)
    codes, scale, offset = _buffers((24, 1, 2), fmt, torch.float32)
    tk.store_paged(x.to(DEVICE), torch.arange(24), codes, scale, offset, fmt)
    packed, scale = codes[:, 0].cpu(), scale[:, 0].cpu()
    if fmt.quest or not EXACT_ON_ANY_DATA:
        assert torch.allclose(scale, ref.scale, rtol=3e-7, atol=0)
        assert (packed != pack(ref.codes, q.bits)).float().mean() < 2e-3
    else:
        assert torch.equal(packed, pack(ref.codes, q.bits)) and torch.equal(scale, ref.scale)
        assert torch.equal(offset[:, 0].cpu(), ref.offset)


@pytest.mark.parametrize("name", ["quest3", "affine2"])
def test_store_rows_per_program(name):
    """The stored bytes do not depend on how many tokens a program takes (1 and 8 are the GPU's choices, 64 the
    interpreter's): 7 tokens, one of them padding (slot −1), in programs of 1, 4 (the last one partly past the end)
    and 64 rows, each time as ``quantize`` + ``pack`` wrote them."""
    q, d, H = QUANTIZERS[name], 64, 2
    fmt = tk.TokenFormat.of(q, d)
    x = _exact_data((7, H, d), seed=9)
    ref = q.quantize(x)
    slots = torch.tensor([3, 0, 6, -1, 1, 5, 2])
    for br in (1, 4, 64):
        codes, scale, offset = _buffers((2, 4, H), fmt, torch.float16)
        tk.store_paged(x.to(DEVICE), slots, codes, scale, offset, fmt, rows_per_program=br)
        codes, scale = codes.view(8, H, -1).cpu(), scale.view(8, H, -1).cpu()
        for r, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(codes[slot], pack(ref.codes[r], q.bits)), (br, r)
                assert torch.equal(scale[slot], ref.scale[r].half()), (br, r)
        assert (codes[[4, 7]] == 0xAB).all() and (scale[[4, 7]] == -7).all(), br  # the free slots: untouched
    with pytest.raises(ValueError, match="power of two"):
        tk.store_paged(x.to(DEVICE), slots, codes.to(DEVICE).view(2, 4, H, -1), scale.to(DEVICE).view(2, 4, H, -1),
                       offset, fmt, rows_per_program=3)


def _unit_upper(H, d, seed):
    """(H, d, d) unit upper-triangular error feedback of the size ``+ldlq``'s matrices have (entries ~0.1-0.3)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, d, d, generator=g) * 0.2).triu(1) + torch.eye(d)


@pytest.mark.parametrize("name,meta", [("quest2", torch.float16), ("quest4-g16", torch.bfloat16), ("affine1-g16", torch.float32)])
def test_store_rounds_with_error_feedback(name, meta):
    """With error feedback F (``+ldlq``) the store writes what ``TokenCodec(feedback=F).encode`` writes: the
    quantizer's grid, stored, and codes rounded channel by channel on it, each error pushed onto the later channels,
    in programs of 1 and 8 rows (slot < 0 skipped; the cache's flush test has the interpreter's 64). Bit for bit where the arithmetic is exact (the interpreter:
    the float32 steps of feedback_round one by one); on a GPU QuEST's step may differ in its last bit, and a code
    with it, now and then. The feedback changes codes (a kernel that ignored it would fail), and a matrix of
    another shape is refused."""
    from wushkv.codecs import TokenCodec

    q, d, H = QUANTIZERS[name], 32, 2
    fmt = tk.TokenFormat.of(q, d)
    F = _unit_upper(H, d, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, H, d, generator=g) * torch.linspace(0.2, 3, d)
    ref = TokenCodec(q, d, meta, feedback=F).encode(x.transpose(0, 1)[None])  # (1, H, 7, ·)
    plain = TokenCodec(q, d, meta).encode(x.transpose(0, 1)[None])
    assert (ref["codes"] != plain["codes"]).float().mean() > 0.2
    slots = torch.tensor([3, 0, 6, -1, 1, 5, 2])
    for br in (1, 8):
        codes, scale, offset = _buffers((2, 4, H), fmt, meta)
        tk.store_paged(x.to(DEVICE), slots, codes, scale, offset, fmt, feedback=F.to(DEVICE), rows_per_program=br)
        codes, scale = codes.view(8, H, -1).cpu(), scale.view(8, H, -1).cpu()
        got = codes[slots.clamp(min=0)].transpose(0, 1)[:, slots >= 0]  # (H, 6, nb) of the rows written
        want = ref["codes"][0][:, slots >= 0]
        if EXACT_ON_ANY_DATA or not fmt.quest:
            assert torch.equal(got, want), (name, br, (got != want).float().mean())
            assert torch.equal(scale[slots.clamp(min=0)].transpose(0, 1)[:, slots >= 0], ref["scale"][0][:, slots >= 0])
        else:
            assert (got != want).float().mean() < 2e-2, (name, br)
        if offset is not None:
            assert torch.equal(offset.view(8, H, -1).cpu()[slots.clamp(min=0)].transpose(0, 1)[:, slots >= 0],
                               ref["offset"][0][:, slots >= 0])
        assert (codes[[4, 7]] == 0xAB).all(), br  # slots 4 and 7 are nobody's (row 3 is padding): untouched
    with pytest.raises(ValueError, match=r"feedback must be \(Hkv, d, d\) = \(2, 32, 32\)"):
        tk.store_paged(x.to(DEVICE), slots, *_buffers((2, 4, H), fmt, meta), fmt, feedback=F[0].to(DEVICE))


@pytest.mark.parametrize("name,feedback", [("quest2", False), ("quest4-g16", True), ("quest8", False), ("quest3", True)])
def test_store_writes_one_byte_steps(name, feedback):
    """QuEST steps in one E5M3 byte (metadata dtype ``e5m3``, the K4V2 recipe served in vLLM): the store writes what
    ``TokenCodec(step_byte=True).encode`` writes, the step rounded to its byte (half up; from 5 bits up, so that it
    spans each token's max |x|) and the codes rounded on the rounded step, with error feedback too (``+ldlq``), slot
    < 0 skipped. Bit for bit under the interpreter, with tokens at every scale: a zero token (its step rounds to
    byte 0, its codes on float32's tiny), a group of zeros before others (with feedback, its error goes on without
    NaN: feedback_round divides a 0 step by tiny too), one too large for float16 (the largest byte), one of tiny
    values (a subnormal step, bytes 1-7), rows whose steps fall near a byte's midpoint. A float16 steps tensor for such a format, and a
    byte tensor for another, are refused by name. (Before session 74 such a store took the PyTorch path.)"""
    from wushkv.codecs import TokenCodec

    q, d, H = QUANTIZERS[name], 64, 2
    fmt = dataclasses.replace(tk.TokenFormat.of(q, d), step_byte=True)
    F = _unit_upper(H, d, seed=5) if feedback else None
    g = torch.Generator().manual_seed(6)
    x = torch.randn(12, H, d, generator=g) * torch.logspace(-2, 1, 12)[:, None, None]
    x[2] = 0.0
    x[3, :, :16] = 0.0  # a group of zeros (groups of 16: its step is byte 0) before groups that are not
    x[5, 0] *= 1e8  # a step past float16's range
    x[7] = torch.randn(H, d, generator=g) * (1e-4 if q.bits >= 5 else 2e-5)  # a subnormal float16 step: bytes 1-7
    ref = TokenCodec(q, d, torch.float16, feedback=F, step_byte=True).encode(x.transpose(0, 1)[None])  # (1, H, 12, ·)
    s7 = ref["scale"][0, :, 7]
    assert ref["scale"].dtype == torch.uint8 and int(ref["scale"].max()) == 0xF7 and int(ref["scale"][0, :, 2].max()) == 0
    assert bool(((s7 >= 1) & (s7 <= 7)).all()), s7
    slots = torch.tensor([3, 0, 6, -1, 1, 5, 2, 9, 11, 8, 10, 15])
    codes, _, _ = _buffers((4, 4, H), fmt, torch.float16)
    scale = torch.full((4, 4, H, fmt.ngroups), 0xAB, dtype=torch.uint8, device=DEVICE)
    tk.store_paged(x.to(DEVICE), slots, codes, scale, None, fmt, feedback=None if F is None else F.to(DEVICE))
    codes, scale = codes.view(16, H, -1).cpu(), scale.view(16, H, -1).cpu()
    live = slots >= 0
    got_c, got_s = (t[slots.clamp(min=0)].transpose(0, 1)[:, live] for t in (codes, scale))
    want_c, want_s = ref["codes"][0][:, live], ref["scale"][0][:, live]
    if EXACT_ON_ANY_DATA:
        assert torch.equal(got_s, want_s) and torch.equal(got_c, want_c), (name, (got_c != want_c).float().mean())
    else:  # QuEST's ‖x‖ summed in another order: a step's byte, and codes with it, may differ now and then
        assert (got_s != want_s).float().mean() < 5e-2 and (got_c != want_c).float().mean() < 2e-2, name
    assert (codes[[4, 7, 12, 13, 14]] == 0xAB).all() and (scale[[4, 7, 12, 13, 14]] == 0xAB).all()  # nobody's slots
    with pytest.raises(ValueError, match=r"step_byte=True stores its steps as uint8"):
        tk.store_paged(x.to(DEVICE), slots, codes.view(4, 4, H, -1).to(DEVICE), torch.zeros(4, 4, H, fmt.ngroups,
                       dtype=torch.float16, device=DEVICE), None, fmt)
    with pytest.raises(ValueError, match=r"step_byte=False stores its steps as float16, bfloat16 or float32, got torch.uint8"):
        tk.store_paged(x.to(DEVICE), slots, codes.view(4, 4, H, -1).to(DEVICE), scale.view(4, 4, H, -1).to(DEVICE), None,
                       tk.TokenFormat.of(q, d))


def _assert_same_tiles(got: dict, ref) -> None:
    """The tile kernel's storage ``got`` is ``ref``'s (KVarNTiles): bit for bit under the interpreter; on a GPU (float32
    sums in another order) the same codes but where a value sits on a rounding boundary, and the same dequantized
    tiles to float16 rounding where the codes agree."""
    from wushkv.quantizers import unpack
    from wushkv.quantizers.kvarn import KVarNTiles, kvarn_dequantize

    got = {k: t.cpu() for k, t in got.items()}
    codes = unpack(got["codes"], ref.bits, ref.codes.shape[-1])
    if EXACT_ON_ANY_DATA:
        assert torch.equal(codes, ref.codes)
        assert all(torch.equal(got[k], getattr(ref, k)) for k in ("scale", "zero", "s_fold"))
        return
    same = codes == ref.codes
    assert same.float().mean() >= 0.99
    xg = kvarn_dequantize(KVarNTiles(codes, got["scale"], got["zero"], got["s_fold"], ref.bits, ref.kind, ref.tile))
    size = kvarn_dequantize(KVarNTiles(ref.codes, ref.scale.abs(), ref.zero.abs(), ref.s_fold.abs(), ref.bits, ref.kind, ref.tile))
    assert ((xg - kvarn_dequantize(ref)).abs()[same] <= (8 * 2**-10 * size + 1e-6)[same]).all()


@pytest.mark.parametrize("bits,clip,feedback,d,tile", [(2, 0.0, False, 16, 8), (3, 1.7, True, 16, 8),
                                                      (2, 1.3, True, 256, 128)])
def test_kvarn_key_tiles_equal_the_tile_quantizer(bits, clip, feedback, d, tile):
    """The KVarN key-tile kernel (one program a tile: 16 rounds of balance, the round of least imbalance, each
    channel row over its own grid, in order with ``+ldlq`` feedback, the codes packed per token) stores what
    ``kvarn_quantize`` (kind "key") makes: under the interpreter bit for bit (the same float32 steps: codes, scale,
    zero and s_fold); on a GPU, with float32 sums in another order, the same codes but where a value sits on a
    rounding boundary, and the same dequantized keys to float16 rounding where the codes agree. The feedback and
    the clip change the codes (a kernel that ignored either would fail). At head_dim 256 × 128 tokens (Gemma-3's
    ``auto``) the kernel reads the keys again at each round of the balance instead of holding them (RELOAD)."""
    from wushkv.quantizers.feedback import feedback_matrix
    from wushkv.quantizers.kvarn import kvarn_quantize

    H, n = (2, 2) if d < 256 else (1, 1)  # (tiles a head: the interpreter's row loop takes 6 s a tile at d 256)
    with tk.recorded_launches() as launches:
        tk.kvarn_key_tiles(torch.zeros(1, H, tile, d), bits, tile)
    assert launches[0][3]["RELOAD"] == (d == 256)
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(1, H, n * tile, d, generator=g) @ torch.randn(d, d, generator=g) * torch.rand(d, generator=g) * 3
         + torch.randn(d, generator=g))
    F = None
    if feedback:
        Q = torch.randn(H, d, d, generator=g)
        F = feedback_matrix(Q @ Q.mT + 0.1 * torch.eye(d))
    ref = kvarn_quantize(x, bits, "key", tile=tile, clip=clip, feedback=F, fused=False)
    plain = kvarn_quantize(x, bits, "key", tile=tile, fused=False)
    if feedback or clip:
        assert (plain.codes != ref.codes).float().mean() > 0.1
    _assert_same_tiles(tk.kvarn_key_tiles(x.to(DEVICE), bits, tile, clip, None if F is None else F.to(DEVICE)), ref)
    with pytest.raises(ValueError, match=f"are not whole tiles of {tile}"):
        tk.kvarn_key_tiles(x[:, :, :tile // 2].to(DEVICE), bits, tile)


@pytest.mark.parametrize("bits,clip,d,tile", [(2, 0.0, 16, 8), (3, 1.7, 32, 16), (4, 0.0, 64, 32)])
def test_kvarn_value_tiles_equal_the_tile_quantizer(bits, clip, d, tile):
    """KVarN's value tiles (the ``kvarn`` method's values, ``+tiles``) go through the same kernel on the transposed
    tile (rows are tokens: a scale and zero per token, s_fold per channel) and store what ``kvarn_quantize`` (kind
    "value") makes: bit for bit under the interpreter, on a GPU the same codes but where a value sits on a rounding
    boundary. The keys' layout on the same tokens is another storage (a kernel that ignored VALUES would fail)."""
    from wushkv.quantizers import unpack
    from wushkv.quantizers.kvarn import kvarn_quantize

    g = torch.Generator().manual_seed(bits + d)
    x = torch.randn(2, 2, 3 * tile, d, generator=g) * torch.rand(d, generator=g) * 3 + torch.randn(d, generator=g)
    ref = kvarn_quantize(x, bits, "value", tile=tile, clip=clip, fused=False)
    got = tk.kvarn_value_tiles(x.to(DEVICE), bits, tile, clip)
    assert {k: tuple(t.shape) for k, t in got.items() if k != "codes"} == {k: tuple(getattr(ref, k).shape) for k in ("scale", "zero", "s_fold")}
    _assert_same_tiles(got, ref)
    keys = unpack(tk.kvarn_key_tiles(x.to(DEVICE), bits, tile, clip)["codes"].cpu(), bits, d)
    assert (keys != ref.codes).float().mean() > 0.1


def test_store_applies_the_head_transform():
    """With a per-head transform T the stored rows are those of T k: exactly so for signed permutations scaled by
    ½ (exact arithmetic; QuEST, and affine with its percentile clip counted over the transformed row), and to float32
    rounding for a random rotation."""
    d, H = 64, 2
    x = _exact_data((4, H, d), seed=5)
    g = torch.Generator().manual_seed(0)
    perm = torch.stack([torch.eye(d)[torch.randperm(d, generator=g)] * (torch.randint(0, 2, (d, 1), generator=g) * 2 - 1) * 0.5
                        for _ in range(H)])  # (H, d, d)
    for q in (AffineQuantizer(2, clip_ratio=0.92), QuestQuantizer(2)):
        fmt = tk.TokenFormat.of(q, d)
        ref = q.quantize(torch.einsum("hij,rhj->rhi", perm, x))
        codes, scale, offset = _buffers((4, 1, H), fmt, torch.float32)
        tk.store_paged(x.to(DEVICE), torch.arange(4), codes, scale, offset, fmt, transform=perm.to(DEVICE))
        assert torch.equal(codes[:, 0].cpu(), pack(ref.codes, 2)) and torch.equal(scale[:, 0].cpu(), ref.scale), q
        assert offset is None or torch.equal(offset[:, 0].cpu(), ref.offset)
    rot = torch.linalg.qr(torch.randn(H, d, d, generator=g))[0]
    ref = q.quantize(torch.einsum("hij,rhj->rhi", rot, x))
    tk.store_paged(x.to(DEVICE), torch.arange(4), codes, scale, None, fmt, transform=rot.to(DEVICE))
    assert torch.allclose(scale[:, 0].cpu(), ref.scale, rtol=1e-5)
    assert (codes[:, 0].cpu() != pack(ref.codes, 2)).float().mean() < 0.02


# -- decode ----------------------------------------------------------------------------------------------------------
def _codec(quantizer, d, meta=torch.float16):
    if meta == "e5m3":  # one-byte QuEST steps
        return TokenCodec(quantizer, d, torch.float16, step_byte=True)
    return TokenCodec(quantizer, d, meta)


def _packed(codec, store):
    G = codec.d if codec.quantizer.group_size is None else codec.quantizer.group_size
    fmt = tk.TokenFormat(codec.bits, codec.d, G, codec.symmetric, step_byte=codec.step_byte)
    return tk.Packed(fmt, store["codes"], store["scale"], store.get("offset"))


def _case(kq, vq, B, Hkv, G, d, n_s, n_m, n_r, seed=0, dtype=torch.float32, meta=torch.float16):
    """Query (B, Hq, 1, d), decode parts (sink, packed middle, recent) for keys and values, on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    x = lambda n: (torch.randn(B, Hkv, n, d, generator=g) * torch.linspace(0.3, 2.5, d)).to(DEVICE, dtype)
    parts = []
    for quant in (kq, vq):
        codec = _codec(quant, d, meta)
        parts.append([x(n_s), (codec, codec.encode(x(n_m).float()), n_m), x(n_r)])
    q = (torch.randn(B, Hkv * G, 1, d, generator=g) * 1.5).to(DEVICE, dtype)
    return q, parts[0], parts[1]


def _triton(q, pk, pv, **kw):
    (sk, (kc, ks, n), rk), (sv, (vc, vs, _), rv) = pk, pv
    B = q.shape[0]
    lengths = torch.tensor([[sk.shape[2], n, rk.shape[2]]] * B)
    return tk.decode(q[:, :, 0], lengths, sk, sv, _packed(kc, ks), _packed(vc, vs), rk, rv, q.shape[-1] ** -0.5, **kw)


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


DECODE_CASES = {  # (key quantizer, value quantizer, GQA group, head_dim)
    "K1V8-gqa1-d64": (QuestQuantizer(1), AffineQuantizer(8), 1, 64),
    "K2V2-gqa3-d128": (QuestQuantizer(2), QuestQuantizer(2), 3, 128),
    "K3V4-gqa8-d64": (AffineQuantizer(3, clip_ratio=0.96), QuestQuantizer(4), 8, 64),
    "K4V3-groups16-gqa3-d64": (QuestQuantizer(4, 16), AffineQuantizer(3, 16), 3, 64),
    "K8V1-gqa1-d256": (AffineQuantizer(8), QuestQuantizer(1), 1, 256),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_equals_dequantize_then_attend(name):
    """Every width 1/2/3/4/8 on each side, QuEST and affine, one group per token and groups of 16, GQA 1/3/8,
    head_dim 64/128/256: within 1e-3 (relative, float32) of plain attention over the dequantized cache."""
    kq, vq, G, d = DECODE_CASES[name]
    q, pk, pv = _case(kq, vq, B=2, Hkv=2, G=G, d=d, n_s=3, n_m=37, n_r=5)
    ref = dequantize_then_attend(q, pk, pv, None, d**-0.5)[:, 0]
    out = _triton(q, pk, pv, splits=2, block_n=16)
    assert out.shape == ref.shape and _rel(out, ref) < 1e-3, _rel(out, ref)


def test_decode_reads_one_byte_steps():
    """QuEST steps stored as one E5M3 byte (metadata dtype ``e5m3``), one group per token and groups of 16: the
    kernel decodes the byte as the codec does, within 1e-3 of dequantize-then-attend; decode_attention sends such a
    cache to the kernel (the store kernel writes them too since session 74: test_store_writes_one_byte_steps)."""
    d = 64
    q, pk, pv = _case(QuestQuantizer(4, 16), QuestQuantizer(2), B=2, Hkv=2, G=3, d=d, n_s=3, n_m=37, n_r=5, meta="e5m3")
    assert pk[1][1]["scale"].dtype == pv[1][1]["scale"].dtype == torch.uint8
    ref = dequantize_then_attend(q, pk, pv, None, d**-0.5)[:, 0]
    out = _triton(q, pk, pv, splits=2, block_n=16)
    assert _rel(out, ref) < 1e-3, _rel(out, ref)
    tk.reset_calls()
    with decode_mod.triton_enabled(True):
        out = decode_attention(q, pk, pv, None, d**-0.5)[:, 0]
    assert tk.calls() == {"decode": 1} and _rel(out, ref) < 1e-3  # one split on CPU: no merge
    with pytest.raises(ValueError, match="step_byte=True needs uint8"):
        wrong = tk.Packed(tk.TokenFormat(2, d, d, True, step_byte=True), pv[1][1]["codes"], pv[1][1]["scale"].half())
        tk.decode(q[:, :, 0], torch.tensor([[3, 37, 5]] * 2), pk[0], pv[0], wrong, wrong, pk[2], pv[2], 1.0)


@pytest.mark.parametrize("feature", ["softcap", "sinks", "window", "mask", "splits>tokens"])
def test_decode_options(feature):
    """Softcap, learned sink logits, a sliding window, a mask of the last S columns, more splits than tokens (empty
    splits merge as nothing): each as dequantize-then-attend computes it."""
    d, B, Hkv, G = 64, 2, 2, 2
    q, pk, pv = _case(QuestQuantizer(2), AffineQuantizer(2, clip_ratio=0.92), B, Hkv, G, d, n_s=4, n_m=20, n_r=6, seed=1)
    N = 30
    ref_kw, kw, allowed = {}, {}, None
    if feature == "softcap":
        ref_kw = kw = {"softcap": 2.0}
    elif feature == "sinks":
        sinks = torch.linspace(-1.0, 3.0, Hkv * G, device=DEVICE)
        ref_kw = kw = {"sinks": sinks}
    elif feature == "window":  # the last 11 columns: part of the middle and the recent buffer
        allowed = torch.ones(B, 1, 1, 11, dtype=torch.bool, device=DEVICE)
        kw = {"window": 11}
    elif feature == "mask":
        allowed = torch.rand(B, 1, 1, 25, generator=torch.Generator().manual_seed(2)) > 0.4
        allowed = allowed.to(DEVICE)
        kw = {"allowed": allowed.view(B, -1)}
    ref = dequantize_then_attend(q, pk, pv, allowed, d**-0.5, **ref_kw)[:, 0]
    out = _triton(q, pk, pv, splits=40 if feature == "splits>tokens" else 3, block_n=16, **kw)
    assert _rel(out, ref) < 1e-3, _rel(out, ref)
    plain = dequantize_then_attend(q, pk, pv, None, d**-0.5)[:, 0]
    if feature != "splits>tokens":  # the option changed the result, so it was not silently ignored
        assert _rel(plain, ref) > 1e-2
    assert N == 4 + 20 + 6


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the row that sees nothing: 0/0 (numpy)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_split_writes_its_output_itself(dtype):
    """With one split a sequence, the decode kernel's program writes the output (merge_kernel's arithmetic, in its
    order) and no merge is launched: bit for bit what the merge of that one split gives (DecodeTuning.merge_always),
    with learned sink logits, a softcap, a mask that hides a whole row; with more splits the merge runs as before."""
    d, B, Hkv, G = 64, 3, 2, 3
    q, pk, pv = _case(QuestQuantizer(2), AffineQuantizer(3), B, Hkv, G, d, n_s=4, n_m=40, n_r=6, seed=5, dtype=dtype)
    sinks = torch.linspace(-1.0, 3.0, Hkv * G, device=DEVICE)
    allowed = (torch.rand(B, 30, generator=torch.Generator().manual_seed(6)) > 0.3).to(DEVICE)
    allowed[2] = False  # a row that sees nothing: whatever the merge gives (0/0), the same
    def launched(**kw):  # (output, [(kernel, its constexprs)]) of a decode that runs
        rec = []
        with tk.launches_through(lambda name, grid, args, meta, run: (rec.append((name, meta)), run(name, grid, args, meta))):
            return _triton(q, pk, pv, **kw), rec

    # bfloat16 (the interpreter's bfloat16 dots are slow) the two cases that take every option between them
    cases = ({}, {"sinks": sinks}) if dtype == torch.float32 else ()
    for kw in (*cases, {"softcap": 2.0, "sinks": sinks}, {"allowed": allowed}):
        out, rec = launched(splits=1, **kw)
        assert [name for name, _ in rec] == ["decode"] and rec[0][1]["FINAL"]
        assert rec[0][1]["HAS_SINKS"] == ("sinks" in kw)
        with tk.decode_tuning(merge_always=True):
            merged, rec = launched(splits=1, **kw)
        assert [name for name, _ in rec] == ["decode", "merge"] and not rec[0][1]["FINAL"]
        assert out.dtype == dtype and torch.equal(out.isnan(), merged.isnan()), kw
        assert torch.equal(out.nan_to_num(), merged.nan_to_num()), (kw, (out - merged).abs().max())
        if "allowed" not in kw:
            ref = dequantize_then_attend(q, pk, pv, None, d**-0.5, **kw)[:, 0]
            assert _rel(out, ref) < (1e-3 if dtype == torch.float32 else 1e-2), (kw, _rel(out, ref))
    _, rec = launched(splits=2, sinks=sinks)
    assert [name for name, _ in rec] == ["decode", "merge"] and not rec[0][1]["FINAL"] and not rec[0][1]["HAS_SINKS"]
    with pytest.raises(ValueError, match="merge_always must be True or False, got 1"):
        tk.DecodeTuning(merge_always=1)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the row that sees nothing: 0/0 (numpy)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_last_split_merges_its_pairs_splits(dtype):
    """DecodeTuning(last_split_merges=True): with several splits, the last program of each (sequence, KV head) pair
    to finish merges the pair's splits and writes the output, and no merge is launched. Its arithmetic is the merge
    kernel's but for the order of the sums over the splits (in turn, where merge_kernel's tl.sum runs a tree), so it
    equals the two launches to within that reordering's float32 error, 4·splits·2^-24·max|v| (first order, for any
    two orders; bfloat16 also one rounding of the output apart), over ragged lengths, with learned sink logits, a
    softcap, a mask that hides a whole row, 3, 7 (bfloat16) and 12 splits (more than the 4 tiles: empty splits). The
    counters are 0 again after every call, so the next call merges too."""
    d, B, Hkv, G = 64, 3, 2, 3
    q, pk, pv = _case(QuestQuantizer(2), AffineQuantizer(3), B, Hkv, G, d, n_s=4, n_m=40, n_r=6, seed=8, dtype=dtype)
    (sk, (kc, ks, _), rk), (sv, (vc, vs, _), rv) = pk, pv
    lengths = torch.tensor([[4, 40, 6], [2, 17, 3], [4, 33, 1]])  # ragged: 50, 22 and 38 columns
    vmax = max(sv.float().abs().max(), rv.float().abs().max(), vc.decode(vs, 40).float().abs().max()).item()
    sinks = torch.linspace(-1.0, 3.0, Hkv * G, device=DEVICE)
    allowed = (torch.rand(B, 20, generator=torch.Generator().manual_seed(9)) > 0.3).to(DEVICE)
    allowed[2] = False  # a row that sees nothing: whatever the merge gives (0/0), the same
    kept = []  # every output stays alive: a merge that wrote nothing must not find an equal output's freed memory

    def launched(splits, **kw):  # (output, [(kernel, its constexprs)]) of a decode that runs
        rec = []
        with tk.launches_through(lambda name, grid, args, meta, run: (rec.append((name, meta)), run(name, grid, args, meta))):
            out = tk.decode(q[:, :, 0], lengths, sk, sv, _packed(kc, ks), _packed(vc, vs), rk, rv, d**-0.5,
                            splits=splits, block_n=16, **kw)
        kept.append(out)
        return out, rec

    # the cases split between the dtypes (the interpreter's bfloat16 dots are slow): float32 the fewest and the most
    # splits, a second call of the first finding the counters as the first left them; bfloat16 everything at once
    cases = ((3, {"sinks": sinks}), (12, {"allowed": allowed})) if dtype == torch.float32 else (
        (7, {"softcap": 2.0, "sinks": sinks, "allowed": allowed}),)
    for splits, kw in cases:
        merged, rec = launched(splits, **kw)
        assert [name for name, _ in rec] == ["decode", "merge"] and not rec[0][1]["LAST_MERGES"]
        with tk.decode_tuning(last_split_merges=True):
            for call in range(2 if splits == 3 else 1):
                out, rec = launched(splits, **kw)
                assert [name for name, _ in rec] == ["decode"] and rec[0][1]["LAST_MERGES"] and not rec[0][1]["FINAL"]
                assert rec[0][1]["HAS_SINKS"] == ("sinks" in kw)
                assert not tk._COUNTERS[torch.device(DEVICE)].any(), (splits, kw, call)
                assert out.dtype == dtype and torch.equal(out.isnan(), merged.isnan()), (splits, kw)
                assert out.isnan().any() == ("allowed" in kw and "sinks" not in kw)  # the hidden row, without a sink
                gap = (out.float() - merged.float()).nan_to_num().abs()
                bound = 4 * splits * 2**-24 * vmax
                if dtype == torch.bfloat16:  # float32 results that close may round to neighbouring bfloat16 values
                    bound = bound + torch.finfo(dtype).eps * merged.float().nan_to_num().abs()
                assert (gap <= bound).all(), (splits, kw, gap.max())
    with tk.decode_tuning(last_split_merges=True):  # one split: its program writes the output (FINAL), no counting
        _, rec = launched(1, sinks=sinks)
    assert [name for name, _ in rec] == ["decode"] and rec[0][1]["FINAL"] and not rec[0][1]["LAST_MERGES"]
    with pytest.raises(ValueError, match="last_split_merges must be True or False, got 1"):
        tk.DecodeTuning(last_split_merges=1)
    with pytest.raises(ValueError, match="merge_always=True .* and last_split_merges=True .* set at most one"):
        tk.DecodeTuning(merge_always=True, last_split_merges=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_never_reads_what_the_window_hides(dtype):
    """A sliding window's earlier columns (and a mask's) are not read at all: the splits share the visible columns
    only (O(window) work), so rows there may hold anything, as vLLM's freed blocks do. NaN in the sink, in the
    middle's codes and steps before the window change nothing, with more splits than visible tiles."""
    d = 128 if dtype == torch.bfloat16 else 64
    q, pk, pv = _case(QuestQuantizer(2), AffineQuantizer(4), 2, 2, 3, d, n_s=5, n_m=70, n_r=6, seed=7, dtype=dtype)
    clean = _triton(q, pk, pv, window=40, splits=6, block_n=16)
    for part in (pk, pv):
        part[0].fill_(float("nan"))  # the whole sink: before the window
        store = part[1][1]
        store["scale"][:, :, :30] = float("nan")  # middle tokens 0..29 (columns 5..34 of 81: the window starts at 41)
        store["codes"][:, :, :30] = 0xFF
    out = _triton(q, pk, pv, window=40, splits=6, block_n=16)
    assert torch.isfinite(out).all() and torch.equal(out, clean)
    mask = torch.ones(2, 25, dtype=torch.bool, device=DEVICE)
    assert torch.isfinite(_triton(q, pk, pv, allowed=mask, splits=6, block_n=16)).all()


@pytest.mark.parametrize("dtype,d,masked", [(torch.float32, 64, False), (torch.float32, 64, True), (torch.bfloat16, 128, True)])
def test_decode_reads_each_row_from_its_own_columns(dtype, d, masked):
    """``starts``: ragged rows in batched parts (the transformers cache's left-padded batches), row b reading part
    i's columns [starts[b, i], starts[b, i] + lengths[b, i]) alone: NaN in every other column (full precision; the
    middle's steps, and codes of all ones) changes nothing, and each row equals its columns attended alone, with and
    without a mask over the parts' columns side by side (hiding some of a row's own; bfloat16: codes in classes)."""
    B, Hkv, G = 3, 2, 3
    widths = (5, 50, 8)
    spans = [[(1, 4), (7, 50), (0, 6)], [(0, 0), (20, 37), (2, 8)], [(0, 5), (0, 0), (5, 8)]]  # [a, e) per part
    q, pk, pv = _case(QuestQuantizer(2), AffineQuantizer(4), B, Hkv, G, d, *widths, seed=11, dtype=dtype)
    allowed = torch.rand(B, sum(widths), generator=torch.Generator().manual_seed(3)) > 0.3 if masked else None
    refs = []
    for b, row in enumerate(spans):
        cut = lambda parts: [parts[0][b : b + 1, :, row[0][0] : row[0][1]],
                             (parts[1][0], {k: t[b : b + 1, :, row[1][0] : row[1][1]] for k, t in parts[1][1].items()},
                              row[1][1] - row[1][0]), parts[2][b : b + 1, :, row[2][0] : row[2][1]]]
        keep = None
        if masked:  # the row's own columns of the side-by-side mask, in order
            cols = [c + sum(widths[:i]) for i, (a, e) in enumerate(row) for c in range(a, e)]
            keep = allowed[b, cols].view(1, 1, 1, -1).to(DEVICE)
        refs.append(dequantize_then_attend(q[b : b + 1], cut(pk), cut(pv), keep, d**-0.5)[0, 0])
    ref = torch.stack(refs).cpu()
    for parts in (pk, pv):
        for b, row in enumerate(spans):
            for i in (0, 2):
                (a, e), t = row[i], parts[i]
                t[b, :, :a], t[b, :, e:] = float("nan"), float("nan")
            (a, e), store = row[1], parts[1][1]
            for key, t in store.items():
                t[b, :, :a], t[b, :, e:] = (0xFF, 0xFF) if key == "codes" else (float("nan"), float("nan"))
    for parts in (pk, pv):  # room past the middle's columns (a store's capacity), which neither it nor the mask reads
        store = parts[1][1]
        for key, t in store.items():
            store[key] = torch.cat([t, torch.full_like(t[:, :, :6], 0xFF if key == "codes" else float("nan"))], 2)
    held = torch.tensor(spans)
    starts, lengths = held[:, :, 0], held[:, :, 1] - held[:, :, 0]
    (sk, (kc, ks, _), rk), (sv, (vc, vs, _), rv) = pk, pv
    mk, mv = _packed(kc, ks), _packed(vc, vs)
    kw = dict(allowed=None if allowed is None else allowed.to(DEVICE), splits=4, block_n=16, starts=starts)
    out = tk.decode(q[:, :, 0], lengths, sk, sv, mk, mv, rk, rv, d**-0.5, **kw).cpu()
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < (1e-3 if dtype == torch.float32 else 2e-2), _rel(out, ref)
    if dtype == torch.bfloat16:
        assert tk.code_classes(mk.fmt, dtype, mk.codes) > 0
    with pytest.raises(ValueError, match="row 1 reads columns"):
        wrong = lengths.clone()
        wrong[1, 1] = 37  # columns 20..57 of a middle 56 wide
        tk.decode(q[:, :, 0], wrong, sk, sv, mk, mv, rk, rv, 1.0, **kw)
    with pytest.raises(ValueError, match="block_table"):
        tk.decode(q[:, :, 0], lengths, sk, sv, mk, mv, rk, rv, 1.0, **kw, block_table=torch.zeros(B, 1, dtype=torch.int32))
    if masked:  # the mask covers the middle's columns the rows read (its sink part first, recent part last)
        with pytest.raises(ValueError, match="allowed covers the parts side by side"):
            tk.decode(q[:, :, 0], lengths, sk, sv, mk, mv, rk, rv, 1.0, **{**kw, "allowed": kw["allowed"][:, :-14]})
    with pytest.raises(ValueError, match=r"starts must be \(B, 3\)"):
        tk.decode(q[:, :, 0], lengths, sk, sv, mk, mv, rk, rv, 1.0, **{**kw, "starts": starts[:, :2]})


@pytest.mark.parametrize("dtype,kbits,vbits,d,absolute,page", [(torch.float32, 3, 2, 64, False, 16),
                                                                 (torch.bfloat16, 2, 4, 128, False, 8),
                                                                 (torch.float32, 2, 3, 64, True, 16),
                                                                 (torch.bfloat16, 3, 2, 128, True, 8)])
def test_decode_paged_ragged(dtype, kbits, vbits, d, absolute, page):
    """vLLM's layout: each sequence's middle in shuffled blocks of 8 or 16 tokens (tiles of 16 cross block
    boundaries), ragged sink, middle and recent lengths per sequence; equal to each sequence attended alone (in
    bfloat16: within its bound of the float32 result, codes read in classes as near as unpacked to tiles).
    ``absolute_pages``: the block table maps every position, the sink's too (vLLM's cells), whose rows hold codes
    that must not be read. Blocks of 16: each tile of tokens' block also read once (``page_tiles``, the tiles aligned
    to the table's positions, which the sinks shift), to the same bound, as near the per-token lookups."""
    Hkv, G = 2, 3
    lens = [(2, 21, 3), (0, 8, 0), (4, 0, 5), (1, 33, 2)]  # (sink, middle, recent)
    B = len(lens)
    kc, vc = _codec(QuestQuantizer(kbits), d), _codec(AffineQuantizer(vbits, clip_ratio=0.92), d)
    g = torch.Generator().manual_seed(4)
    x = lambda n: torch.randn(1, Hkv, n, d, generator=g) * torch.linspace(0.3, 2.5, d)
    first = [n_s if absolute else 0 for n_s, _, _ in lens]  # the middle's first position in the block table
    spans = [-(-(f + m) // page) for f, (_, m, _) in zip(first, lens)]
    nblocks = sum(spans) + 2
    order = torch.randperm(nblocks, generator=g).tolist()
    table = torch.zeros(B, 8, dtype=torch.int32)
    fmt_k, fmt_v = _packed(kc, kc.encode(x(1))).fmt, _packed(vc, vc.encode(x(1))).fmt
    kbuf = [t.fill_(5) for t in _buffers((nblocks, page, Hkv), fmt_k, torch.float16) if t is not None]  # rows never read
    vbuf = [t.fill_(5) for t in _buffers((nblocks, page, Hkv), fmt_v, torch.float16) if t is not None]
    sk, sv, rk, rv = (torch.zeros(B, Hkv, 6, d) for _ in range(4))
    q = torch.randn(B, Hkv * G, 1, d, generator=g)
    refs = []
    for b, (n_s, n_m, n_r) in enumerate(lens):
        parts = {}
        for side, codec, buf in (("k", kc, kbuf), ("v", vc, vbuf)):
            mid = x(n_m)
            store = codec.encode(mid) if n_m else codec.encode(x(1))
            for t in range(n_m):  # middle token t at position first + t: row p % page of the sequence's block p // page
                p = first[b] + t
                blk = order[sum(spans[:b]) + p // page]
                table[b, p // page] = blk
                for dst, key in zip(buf, ("codes", "scale", "offset")):
                    dst[blk, p % page] = store[key][0, :, t].to(DEVICE)
            parts[side] = (x(n_s), (codec, store, n_m), x(n_r))
        sk[b, :, :n_s], sv[b, :, :n_s] = parts["k"][0][0], parts["v"][0][0]
        rk[b, :, :n_r], rv[b, :, :n_r] = parts["k"][2][0], parts["v"][2][0]
        refs.append(dequantize_then_attend(q[b : b + 1], list(parts["k"]), list(parts["v"]), None, d**-0.5)[0, 0])
    ref = torch.stack(refs)
    mk = tk.Packed(fmt_k, kbuf[0], kbuf[1])
    mv = tk.Packed(fmt_v, vbuf[0], vbuf[1], vbuf[2])
    dev = lambda t: t.to(DEVICE, dtype)
    run = lambda: tk.decode(dev(q[:, :, 0]), torch.tensor(lens), dev(sk), dev(sv), mk, mv, dev(rk), dev(rv), d**-0.5,
                            block_table=table, absolute_pages=absolute, splits=3, block_n=16).cpu()
    out = run()
    if page % 16 == 0:
        one_page = []

        def hook(name, grid, args, meta, launch):
            one_page.extend([meta["ONE_PAGE"]] if name == "decode" else [])
            return launch(name, grid, args, meta)

        with tk.launches_through(hook), tk.decode_tuning(page_tiles=True):
            tiles_of_pages = run()
        with tk.launches_through(hook), tk.decode_tuning(page_tiles=False):
            assert torch.equal(run(), out)  # QuEST and affine codes: the per-token lookups by default
        assert one_page == [True, False], one_page
        errs = (_rel(tiles_of_pages, ref), _rel(tiles_of_pages, out))
        assert errs[0] < 1e-3 and errs[1] < 1e-5, errs
    # the windows read in place from a pool of pages (the vLLM plugin's copies) give the same bits as the parts
    u = 3 if d == 64 else 4
    tails = [range((n_s + n_m) // u, -(-(n_s + n_m + n_r) // u)) for n_s, n_m, n_r in lens]
    S_pages = max(-(-n_s // u) for n_s, _, _ in lens)
    npages = sum(-(-n_s // u) + len(t) for (n_s, _, _), t in zip(lens, tails))
    pool = torch.full((npages + 3, u, Hkv, 2, d), float("nan"))  # a slot no part reads is NaN
    rows, free = torch.full((B, S_pages + max(map(len, tails))), -1, dtype=torch.int32), torch.randperm(npages + 3, generator=g).tolist()
    for b, (n_s, n_m, n_r) in enumerate(lens):
        for j, pg in enumerate([*range(-(-n_s // u))] + [S_pages + i for i in range(len(tails[b]))]):
            rows[b, pg] = free.pop()
        for t in range(n_s):
            pool[rows[b, t // u], t % u, :, 0], pool[rows[b, t // u], t % u, :, 1] = sk[b, :, t], sv[b, :, t]
        for t in range(n_r):
            p = n_s + n_m + t
            r = rows[b, S_pages + p // u - (n_s + n_m) // u]
            pool[r, p % u, :, 0], pool[r, p % u, :, 1] = rk[b, :, t], rv[b, :, t]
    pool = dev(pool)
    pk, pv = pool[..., 0, :], pool[..., 1, :]
    pooled = tk.decode(dev(q[:, :, 0]), torch.tensor(lens), pk, pv, mk, mv, pk, pv, d**-0.5, block_table=table,
                       absolute_pages=absolute, splits=3, block_n=16, pool_windows=tk.PoolWindows(rows.to(DEVICE), S_pages, u)).cpu()
    assert torch.equal(pooled, out)
    with pytest.raises(ValueError, match="pool_windows need pools"):
        tk.decode(dev(q[:, :, 0]), torch.tensor(lens), dev(sk), dev(sv), mk, mv, dev(rk), dev(rv), d**-0.5,
                  block_table=table, pool_windows=tk.PoolWindows(rows, S_pages, u))
    meta = pool.to("meta")
    with pytest.raises(ValueError, match="on the query's device"):
        tk.decode(dev(q[:, :, 0]), torch.tensor(lens), meta[..., 0, :], meta[..., 1, :], mk, mv, meta[..., 0, :],
                  meta[..., 1, :], d**-0.5, block_table=table, pool_windows=tk.PoolWindows(rows, S_pages, u))
    with pytest.raises(ValueError, match="do not cover sequence 0's sink"):  # a table one tail page short
        tk.decode(dev(q[:, :, 0]), torch.tensor(lens), pk, pv, mk, mv, pk, pv, d**-0.5, block_table=table,
                  absolute_pages=absolute, pool_windows=tk.PoolWindows(rows[:, :-1], S_pages, u))
    if absolute:  # the flag is read: the same table taken as the middle's alone reads the sink's rows
        wrong = tk.decode(dev(q[:, :, 0]), torch.tensor(lens), dev(sk), dev(sv), mk, mv, dev(rk), dev(rv), d**-0.5,
                          block_table=table, splits=3, block_n=16).cpu()
        assert _rel(wrong, ref) > 0.1
    if dtype == torch.float32:
        assert _rel(out, ref) < 1e-3, _rel(out, ref)
        return
    assert tk.code_classes(fmt_k, dtype, kbuf[0]) == 8 and tk.code_classes(fmt_v, dtype, vbuf[0]) == 16 // vbits
    with tk.decode_tuning(class_split=False):
        tiles = run()
    assert _rel(out, tiles) < 2e-3 and _rel(out, ref) < 2e-2, (_rel(out, tiles), _rel(out, ref))


def _tile_packed(codec, store):
    """A KVarN key store (wushkv's cache: codes (B, H, T, ·), scale/zero (B, H, tiles, d), s_fold (B, H, tiles, tile))
    as the kernel reads it."""
    return tk.Packed(tk.TileFormat(codec.bits, codec.d, codec.block), store["codes"], store["s_fold"].flatten(2, 3)[..., None],
                     tile_scale=store["scale"], tile_zero=store["zero"])


@pytest.mark.parametrize("dtype,bits,d,G,block_n,splits,tile", [
    (torch.float32, 2, 64, 3, 16, 3, 16), (torch.float32, 3, 128, 1, 32, 2, 16), (torch.bfloat16, 2, 64, 8, 64, 1, 16),
    (torch.float16, 4, 64, 3, 32, 5, 16), (torch.bfloat16, 2, 128, 3, None, 3, 32), (torch.float16, 4, 64, 8, None, 2, 16),
    (torch.bfloat16, 3, 128, 3, None, 3, 32), (torch.bfloat16, 1, 128, 1, None, 2, 64),
    (torch.bfloat16, 2, 128, 3, None, 2, 64)])  # 16-bit words, the scaled query held across two tiles of tokens
def test_decode_reads_key_tiles(dtype, bits, d, G, block_n, splits, tile):
    """KVarN key tiles (``auto``'s key tiles, :class:`wushkv.codecs.KVarNCodec`), their scale folded into the query:
    tiles of tokens of one key tile (the default, codes in classes in a 16-bit dtype) or of several (16-64 tokens over
    key tiles of 16, codes unpacked), splits that start inside a key tile, beside per-token values; equal to
    dequantize-then-attend (1e-3 in float32, 2e-2 in a 16-bit dtype), and the classes to the codes unpacked in
    the same tiles of tokens within 2e-3."""
    from wushkv.codecs import KVarNCodec

    B, Hkv = 2, 2
    g = torch.Generator().manual_seed(7)
    x = lambda n: (torch.randn(B, Hkv, n, d, generator=g) * torch.linspace(0.3, 2.5, d)).to(DEVICE)
    kc, vc = KVarNCodec(bits, d, tile, "key"), _codec(QuestQuantizer(2), d)
    n_s, n_m, n_r = 3, 3 * tile, 5
    pk = [x(n_s), (kc, kc.encode(x(n_m)), n_m), x(n_r)]
    pv = [x(n_s), (vc, vc.encode(x(n_m)), n_m), x(n_r)]
    q = (torch.randn(B, Hkv * G, 1, d, generator=g) * 1.5).to(DEVICE)
    ref = dequantize_then_attend(q, pk, pv, None, d**-0.5)[:, 0]
    keys = _tile_packed(kc, pk[1][1])
    if block_n is None:  # the default: tiles of tokens of one key tile, the codes in classes
        assert tk.code_classes(keys.fmt, dtype, keys.codes) > 0
    out = tk.decode(q[:, :, 0].to(dtype), torch.tensor([[n_s, n_m, n_r]] * B), *(t.to(dtype) for t in (pk[0], pv[0])),
                    keys, _packed(vc, pv[1][1]), pk[2].to(dtype), pv[2].to(dtype), d**-0.5,
                    splits=splits, block_n=block_n)
    assert _rel(out, ref) < (1e-3 if dtype == torch.float32 else 2e-2), _rel(out, ref)
    if block_n is None:  # the classes against the codes unpacked, which round the same operands: much nearer
        with tk.decode_tuning(class_split=False):
            tiles = tk.decode(q[:, :, 0].to(dtype), torch.tensor([[n_s, n_m, n_r]] * B), *(t.to(dtype) for t in (pk[0], pv[0])),
                              keys, _packed(vc, pv[1][1]), pk[2].to(dtype), pv[2].to(dtype), d**-0.5,
                              splits=splits, block_n=32)
        assert _rel(out, tiles) < 2e-3, _rel(out, tiles)
    with pytest.raises(ValueError, match="value tiles .KVarN's. need each token's scale and zero"):  # key tiles
        tk.decode(q[:, :, 0], torch.tensor([[n_s, n_m, n_r]] * B), pk[0], pv[0], _packed(vc, pv[1][1]), _tile_packed(kc, pk[1][1]),
                  pk[2], pv[2], d**-0.5)


def _value_tile_packed(codec, store):
    """A KVarN value store (codes (B, H, T, ·), scale/zero (B, H, tiles, tile), s_fold (B, H, tiles, d)) as the kernel
    reads it: each token's scale and zero, each tile's channel scales."""
    return tk.Packed(tk.TileFormat(codec.bits, codec.d, codec.block), store["codes"], store["scale"].flatten(2, 3)[..., None],
                     store["zero"].flatten(2, 3)[..., None], tile_scale=store["s_fold"])


@pytest.mark.parametrize("dtype,bits,d,G,block_n,splits,tile,keys", [
    (torch.float32, 2, 64, 3, 16, 3, 16, "quest"),  # tiles of tokens inside a value tile, splits starting inside one
    (torch.float32, 3, 128, 1, 32, 2, 8, "quest"),  # value tiles shorter than the tiles of tokens: each token's row
    (torch.bfloat16, 4, 64, 8, None, 2, 32, "tiles"),  # KVarN on both sides (the kvarn method), the default tiling
    (torch.float16, 1, 128, 3, None, 1, 16, "tiles"),
    (torch.bfloat16, 8, 64, 3, 64, 3, 16, "quest")])  # tiles of tokens over four value tiles
def test_decode_reads_value_tiles(dtype, bits, d, G, block_n, splits, tile, keys):
    """KVarN's value tiles (the ``kvarn`` method's values, ``+tiles``), v̂[t, c] = s_chan[c]·(s_t·code + z_t), are
    read from their codes: beside per-token or tile keys, tiles of tokens inside one value tile (one row of channel
    scales) or over several (each token's), splits that start inside a tile, 1-8 bits; equal to
    dequantize-then-attend (1e-3 in float32, 2e-2 in a 16-bit dtype). A wrong channel scale (the next tile's) is far."""
    from wushkv.codecs import KVarNCodec

    B, Hkv = 2, 2
    g = torch.Generator().manual_seed(11)
    x = lambda n: (torch.randn(B, Hkv, n, d, generator=g) * torch.linspace(0.3, 2.5, d)).to(DEVICE)
    n_s, n_m, n_r = 3, 4 * max(tile, 16), 5
    kc = KVarNCodec(2, d, max(tile, 16), "key") if keys == "tiles" else _codec(QuestQuantizer(2), d)
    vc = KVarNCodec(bits, d, tile, "value")
    pk = [x(n_s), (kc, kc.encode(x(n_m)), n_m), x(n_r)]
    pv = [x(n_s), (vc, vc.encode(x(n_m)), n_m), x(n_r)]
    q = (torch.randn(B, Hkv * G, 1, d, generator=g) * 1.5).to(DEVICE)
    ref = dequantize_then_attend(q, pk, pv, None, d**-0.5)[:, 0]
    kpk = _tile_packed(kc, pk[1][1]) if keys == "tiles" else _packed(kc, pk[1][1])
    run = lambda values: tk.decode(q[:, :, 0].to(dtype), torch.tensor([[n_s, n_m, n_r]] * B),  # noqa: E731
                                   *(t.to(dtype) for t in (pk[0], pv[0])), kpk, values, pk[2].to(dtype), pv[2].to(dtype),
                                   d**-0.5, splits=splits, block_n=block_n)
    out = run(_value_tile_packed(vc, pv[1][1]))
    assert _rel(out, ref) < (1e-3 if dtype == torch.float32 else 2e-2), _rel(out, ref)
    shifted = dict(pv[1][1], s_fold=pv[1][1]["s_fold"].roll(1, dims=2))  # each tile read with another's channel scales
    assert _rel(run(_value_tile_packed(vc, shifted)), ref) > 0.05
    if dtype == torch.float32:  # the cache's parts through decode_attention: one launch, with a middle and without
        for parts_k, parts_v in ((pk, pv), ([pk[0], (kc, {}, 0), pk[2]], [pv[0], (vc, {}, 0), pv[2]])):
            tk.reset_calls()
            with decode_mod.triton_enabled(True):
                through = decode_attention(q, parts_k, parts_v, None, d**-0.5)[:, 0]
            want = dequantize_then_attend(q, parts_k, parts_v, None, d**-0.5)[:, 0]
            assert tk.calls()["decode"] == 1 and _rel(through, want) < 1e-3, (tk.calls(), _rel(through, want))


@pytest.mark.parametrize("dtype,meta,bits,d,G,block,block_n,splits", [
    (torch.float32, torch.float16, 2, 64, 3, 32, 16, 3),  # tiles of tokens inside a key tile, splits across them
    (torch.bfloat16, torch.bfloat16, 3, 128, 8, 16, None, 2),  # the default tiling, bfloat16 metadata
    (torch.float16, torch.float32, 4, 64, 1, 16, 32, 5)])  # tiles of tokens over two key tiles, float32 metadata
def test_decode_reads_kivi_keys_as_key_tiles(dtype, meta, bits, d, G, block, block_n, splits):
    """KIVI's per-channel keys (:class:`wushkv.codecs.ChannelCodec`: a scale and offset per channel over ``block``
    tokens) are key tiles whose s_tok is 1: the decode kernel reads them from their codes (a stride-0 s_tok, the
    scale and offset in the cache's metadata dtype), beside KIVI's per-token values; equal to dequantize-then-attend
    (1e-3 in float32, 2e-2 in a 16-bit dtype), and ``decode_attention`` on the cache's parts launches the kernel once
    (before, it took the PyTorch path: the keys dequantized block by block)."""
    from wushkv.codecs import ChannelCodec

    B, Hkv = 2, 2
    g = torch.Generator().manual_seed(11)
    x = lambda n: (torch.randn(B, Hkv, n, d, generator=g) * torch.linspace(0.3, 2.5, d) + 0.7).to(DEVICE)
    kc, vc = ChannelCodec(bits, d, block, meta), _codec(AffineQuantizer(2, group_size=32), d, meta)
    n_s, n_m, n_r = 3, 3 * block, 5
    pk = [x(n_s), (kc, kc.encode(x(n_m)), n_m), x(n_r)]
    pv = [x(n_s), (vc, vc.encode(x(n_m)), n_m), x(n_r)]
    q = (torch.randn(B, Hkv * G, 1, d, generator=g) * 1.5).to(DEVICE)
    ref = dequantize_then_attend(q, pk, pv, None, d**-0.5)[:, 0]
    ks = pk[1][1]
    keys = tk.Packed(tk.TileFormat(bits, d, block), ks["codes"], torch.ones(1, 1, 1, 1, dtype=torch.float16,
                     device=DEVICE).expand(B, Hkv, n_m, 1), tile_scale=ks["scale"], tile_zero=ks["offset"])
    cast = lambda t: t.to(dtype)
    out = tk.decode(cast(q[:, :, 0]), torch.tensor([[n_s, n_m, n_r]] * B), cast(pk[0]), cast(pv[0]), keys,
                    _packed(vc, pv[1][1]), cast(pk[2]), cast(pv[2]), d**-0.5, splits=splits, block_n=block_n)
    bound = 1e-3 if dtype == torch.float32 else 2e-2
    assert _rel(out, ref) < bound, _rel(out, ref)
    tk.reset_calls()
    with decode_mod.triton_enabled(True):
        through = decode_attention(cast(q), [cast(pk[0]), pk[1], cast(pk[2])], [cast(pv[0]), pv[1], cast(pv[2])],
                                   None, d**-0.5)[:, 0]
    assert tk.calls().get("decode") == 1 and _rel(through, ref) < bound, (tk.calls(), _rel(through, ref))


@pytest.mark.parametrize("dtype,key,d,start,pads,splits,block_n", [
    (torch.float32, "quest", 64, 7, None, 3, 16), (torch.bfloat16, "affine", 64, 7, (0, 5), None, None),
    (torch.float16, "quest", 128, 2000, None, 2, 32), (torch.float32, "kvarn", 64, 7, None, 2, 16),
    (torch.bfloat16, "kvarn", 128, 5, (0, 9), None, None)])
def test_decode_reads_keys_centered_on_their_rotating_mean(dtype, key, d, start, pads, splits, block_n):
    """Keys stored centered on their rotating pre-RoPE mean (``+rmean``, what ``auto`` picks with the affine quantizer):
    each tile's scores gain Σ A cos pθ + B sin pθ (:class:`wushkv.triton_kernels.KeyBias`), over per-token codes
    (unpacked, or in classes in a 16-bit dtype) and KVarN key tiles, splits that start inside a tile of tokens, rows
    at their own positions (left padding), a middle far from position 0; equal to attention over the keys the codes
    stand for (1e-3 in float32, 2e-2 in a 16-bit dtype), and through ``decode_attention`` on the cache's parts."""
    from wushkv.attention import reference_attention

    from conftest import centered_parts

    cfg = QuantConfig(2, 2, "affine", key_quantizer=None if key != "kvarn" else "kvarn", windows=WindowConfig(8, 0, 32))
    if key == "quest":
        cfg = QuantConfig(2, 2, "quest")
    B, H, G = 2, 2, 3
    pk, pv, keys, values = centered_parts(cfg, None if pads is None else torch.tensor(pads), B=B, H=H, d=d, n_mid=96,
                                          start=start, device=DEVICE)
    q = (torch.randn(B, H * G, 1, d, generator=torch.Generator().manual_seed(2)) * 1.5).to(DEVICE)
    ref = reference_attention(q, keys, values, None, d**-0.5)[:, 0]
    (kc, ks, n, center), (vc, vs, _) = pk[1], pv[1]
    mk = _tile_packed(kc, ks) if key == "kvarn" else _packed(kc, ks)
    terms, first, theta = center.kernel_inputs(q[:, :, 0].reshape(B, H, G, d))
    bias = tk.KeyBias(terms.reshape(B, H * G, d), first, theta)
    cast = lambda t: t.to(dtype)
    out = tk.decode(cast(q[:, :, 0]), torch.tensor([[3, n, 5]] * B), cast(pk[0]), cast(pv[0]), mk, _packed(vc, vs),
                    cast(pk[2]), cast(pv[2]), d**-0.5, splits=splits, block_n=block_n, key_bias=bias)
    bound = 1e-3 if dtype == torch.float32 else 2e-2
    assert _rel(out, ref) < bound, _rel(out, ref)
    plain = tk.decode(cast(q[:, :, 0]), torch.tensor([[3, n, 5]] * B), cast(pk[0]), cast(pv[0]), mk, _packed(vc, vs),
                      cast(pk[2]), cast(pv[2]), d**-0.5, splits=splits, block_n=block_n)
    assert _rel(plain, ref) > 5 * bound  # the centers matter
    if dtype == torch.float32:
        tk.reset_calls()
        with decode_mod.triton_enabled(True):
            through = decode_attention(q, pk, pv, None, d**-0.5)[:, 0]
        assert tk.calls()["decode"] == 1 and _rel(through, ref) < bound
    if key == "quest" and d == 64:  # what a KeyBias must be, said before anything launches
        call = lambda kb: tk.decode(q[:, :, 0], torch.tensor([[3, n, 5]] * B), pk[0], pv[0], mk, _packed(vc, vs),  # noqa: E731
                                    pk[2], pv[2], d**-0.5, key_bias=kb)
        for bad, match in ((tk.KeyBias(bias.terms[:, :3], first, theta), r"terms \(B, Hq, d\) = \(2, 6, 64\)"),
                           (tk.KeyBias(bias.terms, first, theta[:5]), r"theta \(32,\)"),
                           (tk.KeyBias(bias.terms, first.to("meta"), theta), "on the host")):
            with pytest.raises(ValueError, match=match):
                call(bad)


@pytest.mark.parametrize("dtype,d,absolute", [(torch.float32, 64, True), (torch.bfloat16, 128, False)])
def test_decode_reads_key_tiles_spread_over_paged_cells(dtype, d, absolute):
    """The vLLM plugin's cells: each token's row holds its key codes and s_tok, and a tile's 2d halves of [scale | zero]
    are spread over its tokens' rows (``TileFormat.spread``), blocks of 32 tokens in shuffled order, ragged lengths
    with sinks of whole tiles (absolute pages: another sink is refused); equal to each sequence attended alone over
    its dequantized tiles."""
    from wushkv.codecs import KVarNCodec

    Hkv, G, page, tile, bits = 2, 3, 32, 16, 2
    spread = 2 * d // tile  # halves per token row: a tile's 2d halves over its 16 tokens
    lens = [(16, 48, 3), (0, 16, 0), (16, 0, 5), (0, 80, 2)]  # (sink, middle, recent); middles of whole tiles
    B = len(lens)
    kc, vc = KVarNCodec(bits, d, tile, "key"), _codec(AffineQuantizer(2, clip_ratio=0.92), d)
    g = torch.Generator().manual_seed(5)
    x = lambda n: torch.randn(1, Hkv, n, d, generator=g) * torch.linspace(0.3, 2.5, d)
    first = [n_s if absolute else 0 for n_s, _, _ in lens]
    spans = [-(-(f + m) // page) for f, (_, m, _) in zip(first, lens)]
    nblocks = sum(spans) + 2
    order = torch.randperm(nblocks, generator=g).tolist()
    table = torch.zeros(B, 8, dtype=torch.int32)
    codes = torch.full((nblocks, page, Hkv, d * bits // 8), 5, dtype=torch.uint8)
    s_tok = torch.full((nblocks, page, Hkv, 1), 7.0, dtype=torch.float16)
    meta = torch.full((nblocks, page, Hkv, spread), 7.0, dtype=torch.float16)
    fmt_v = _packed(vc, vc.encode(x(1))).fmt
    vbuf = [t.fill_(5) for t in _buffers((nblocks, page, Hkv), fmt_v, torch.float16) if t is not None]
    sk, sv, rk, rv = (torch.zeros(B, Hkv, 16, d) for _ in range(4))
    q = torch.randn(B, Hkv * G, 1, d, generator=g)
    refs = []
    for b, (n_s, n_m, n_r) in enumerate(lens):
        ks, vs = kc.encode(x(n_m or tile)), vc.encode(x(n_m or 1))  # (an empty middle: a store never read)
        halves = torch.cat([ks["scale"], ks["zero"]], -1)  # (1, H, tiles, 2d)
        for t in range(n_m):
            p = first[b] + t
            blk = order[sum(spans[:b]) + p // page]
            table[b, p // page] = blk
            codes[blk, p % page], s_tok[blk, p % page] = ks["codes"][0, :, t], ks["s_fold"][0, :, t // tile, t % tile, None]
            r = t % tile
            meta[blk, p % page] = halves[0, :, t // tile, r * spread:(r + 1) * spread]
            for dst, key in zip(vbuf, ("codes", "scale", "offset")):
                dst[blk, p % page] = vs[key][0, :, t]
        pk, pv = [x(n_s), (kc, ks, n_m), x(n_r)], [x(n_s), (vc, vs, n_m), x(n_r)]
        sk[b, :, :n_s], sv[b, :, :n_s], rk[b, :, :n_r], rv[b, :, :n_r] = pk[0][0], pv[0][0], pk[2][0], pv[2][0]
        refs.append(dequantize_then_attend(q[b:b + 1], pk, pv, None, d**-0.5)[0, 0])
    ref = torch.stack(refs)
    mk = tk.Packed(tk.TileFormat(bits, d, tile, spread=spread), codes.to(DEVICE), s_tok.to(DEVICE), tile_scale=meta.to(DEVICE))
    mv = tk.Packed(fmt_v, *(t.to(DEVICE) for t in vbuf))
    dev = lambda t: t.to(DEVICE, dtype)
    out = tk.decode(dev(q[:, :, 0]), torch.tensor(lens), dev(sk), dev(sv), mk, mv, dev(rk), dev(rv), d**-0.5,
                    block_table=table, absolute_pages=absolute, splits=3, block_n=32).cpu()
    assert _rel(out, ref) < (1e-3 if dtype == torch.float32 else 2e-2), _rel(out, ref)
    if absolute:  # a sink of part of a tile before a middle: its tiles would straddle blocks (checked once a lengths
        # tensor, as a step's layers pass the same one, and again once it is written)
        lengths = torch.tensor(lens)
        call = lambda: tk.decode(dev(q[:, :, 0]), lengths, dev(sk), dev(sv), mk, mv, dev(rk), dev(rv), d**-0.5,  # noqa: E731
                                 block_table=table, absolute_pages=True)
        call()
        lengths[1] = torch.tensor([8, 8, 0])
        with pytest.raises(ValueError, match="sequence 1's sink of 8 tokens is not a multiple of it"):
            call()


@pytest.mark.parametrize("dtype,kbits,vbits,d", [(torch.bfloat16, 2, 2, 64), (torch.float16, 3, 1, 64),
                                                  (torch.bfloat16, 8, 4, 64), (torch.bfloat16, 2, 2, 128),
                                                  (torch.float16, 4, 2, 128)])
def test_decode_bfloat16(dtype, kbits, vbits, d):
    """bfloat16 (and float16) queries and windows: the dots run in that dtype with float32 accumulation, as such a
    model's attention does, the codes entering them as ``c + 128`` (bfloat16, up to 7 bits; 8-bit codes convert) or
    ``c + 1024`` (float16), the offset taken back out: unpacked to (tokens, d) tiles, or at 2 and 4 bits from head_dim
    128 and 64 read as 16-bit words in classes (``code_classes``). Bound: within 2e-2 (relative) of the float32
    result over the same inputs, and no further from it than the PyTorch path in that dtype."""
    q, pk, pv = _case(QuestQuantizer(kbits), QuestQuantizer(vbits), B=1, Hkv=2, G=3, d=d, n_s=3, n_m=20, n_r=5, dtype=dtype)
    to32 = lambda parts: [p.float() if torch.is_tensor(p) else p for p in parts]
    ref = dequantize_then_attend(q.float(), to32(pk), to32(pv), None, d**-0.5)[:, 0]
    out = _triton(q, pk, pv, splits=2, block_n=16)
    assert out.dtype == dtype
    with decode_mod.triton_enabled(False):
        torch_path = decode_attention(q, pk, pv, None, d**-0.5)[:, 0]
    assert _rel(out, ref) < 2e-2 and _rel(out, ref) <= 1.5 * _rel(torch_path, ref) + 1e-3, (_rel(out, ref), _rel(torch_path, ref))


def _classes(parts, dtype):
    codec, store, _ = parts[1]
    return tk.code_classes(_packed(codec, store).fmt, dtype, store["codes"])


@pytest.mark.parametrize("dtype,kq,vq,d,kw,classes", [
    (torch.bfloat16, QuestQuantizer(2), QuestQuantizer(2), 128, {}, (8, 8)),
    (torch.float16, AffineQuantizer(4, clip_ratio=0.96), QuestQuantizer(2), 128, {"softcap": 3.0}, (4, 8)),
    (torch.bfloat16, QuestQuantizer(2), AffineQuantizer(4), 256, {"window": 30}, (8, 4)),
    # words of bytes: three at 3 bits, one at 1 bit and at 2 bits below head_dim 128; below 128 at 1 and 3 bits, two
    # codes a word in each of 4 classes
    (torch.bfloat16, QuestQuantizer(4), QuestQuantizer(3), 64, {"mask": 25}, (4, 4)),
    (torch.float16, AffineQuantizer(3, clip_ratio=0.96), QuestQuantizer(1), 64, {}, (4, 4)),
    (torch.bfloat16, QuestQuantizer(1), AffineQuantizer(3), 64, {"softcap": 3.0}, (4, 4)),
    (torch.bfloat16, QuestQuantizer(3), QuestQuantizer(3), 128, {"odd": True}, (8, 8)),  # keys' words from bytes
    (torch.bfloat16, QuestQuantizer(3), QuestQuantizer(3), 128, {}, (8, 8)),
    (torch.float16, QuestQuantizer(1), AffineQuantizer(3), 128, {"softcap": 3.0}, (8, 8)),
    (torch.bfloat16, QuestQuantizer(2), QuestQuantizer(2), 64, {"mask": 25}, (4, 4)),  # 16-bit words, two codes a class
    (torch.float16, AffineQuantizer(2), QuestQuantizer(2), 64, {"odd": True}, (4, 4)),  # keys in bytes of 4 codes
    (torch.bfloat16, QuestQuantizer(1), AffineQuantizer(1), 128, {"odd": True}, (8, 8)),  # keys in bytes, values 16 bits
    (torch.bfloat16, AffineQuantizer(3), QuestQuantizer(3), 64, {"odd": 2}, (4, 4)),  # keys' rows at 2 mod 4: bytes
    (torch.bfloat16, AffineQuantizer(2), QuestQuantizer(1), 256, {"window": 30}, (8, 8)),
    (torch.bfloat16, QuestQuantizer(2), QuestQuantizer(2), 128, {"odd": True}, (4, 8)),  # keys' rows at odd offsets
    (torch.float16, QuestQuantizer(2), AffineQuantizer(4), 128, {}, (8, 4)),  # 4-bit values' offsets differ by class
])
def test_decode_code_classes_equal_unpacked_tiles(dtype, kq, vq, d, kw, classes):
    """Codes read as words split into classes (one dot per class, the query's channels P·k + S against class S, the
    value dots' results interleaved back) give what unpacking them to (tokens, d) tiles gives, over ragged tiles
    (47 middle tokens in tiles of 16), GQA 3, each option, words of 16 bits and of one or three bytes; both as near
    the float32 result as the bound of ``test_decode_bfloat16``. ``code_classes`` says which side took which path."""
    B, Hkv, G, kw = 2, 2, 3, dict(kw)
    q, pk, pv = _case(kq, vq, B, Hkv, G, d, n_s=3, n_m=47, n_r=5, seed=3, dtype=dtype)
    odd = kw.pop("odd", 0)
    if odd:  # the keys' code rows at odd (or 2 mod 4) byte offsets: no 16-bit words (int32 words) there, but bytes
        codes = pk[1][1]["codes"]
        wide = torch.zeros(*codes.shape[:-1], codes.shape[-1] + odd, dtype=codes.dtype, device=codes.device)
        wide[..., odd:] = codes
        pk[1][1]["codes"] = wide[..., odd:]
    assert (_classes(pk, dtype), _classes(pv, dtype)) == classes
    int32_words = [tk._int32_words(_packed(*p[1][:2]), c) for p, c in zip((pk, pv), classes)]  # 3 bits: four words
    assert int32_words == [p[1][0].bits == 3 and not (odd and p is pk) for p in (pk, pv)]  # from three int32
    words = [tk.code_words(_packed(*p[1][:2]).fmt, c, p[1][1]["codes"]) for p, c in zip((pk, pv), classes)]
    bits = [p[1][0].bits for p in (pk, pv)]  # 16-bit words at 1 bit from head_dim 128 (two codes a class), 2 and 4 bits
    assert words == [4 if b == 4 or (b == 2 and odd % 2 and i == 0) else 8 if b != 1 or c < 8 or (odd and i == 0) else 16
                     for i, (b, c) in enumerate(zip(bits, classes))]
    allowed = None
    if "mask" in kw:
        allowed = (torch.rand(B, 1, 1, kw.pop("mask"), generator=torch.Generator().manual_seed(5)) > 0.4).to(DEVICE)
        kw["allowed"] = allowed.view(B, -1)
    elif "window" in kw:
        allowed = torch.ones(B, 1, 1, kw["window"], dtype=torch.bool, device=DEVICE)
    to32 = lambda parts: [p.float() if torch.is_tensor(p) else p for p in parts]
    ref = dequantize_then_attend(q.float(), to32(pk), to32(pv), allowed, d**-0.5,
                                 **({"softcap": kw["softcap"]} if "softcap" in kw else {}))[:, 0]
    out = _triton(q, pk, pv, splits=2, block_n=16, **kw)
    with tk.decode_tuning(class_split=False):
        tiles = _triton(q, pk, pv, splits=2, block_n=16, **kw)
    assert _rel(out, tiles) < 2e-3, _rel(out, tiles)
    assert _rel(out, ref) < 2e-2 and _rel(out, ref) <= 1.5 * _rel(tiles, ref) + 1e-3, (_rel(out, ref), _rel(tiles, ref))


def test_code_classes_cover_what_they_can():
    """Which sides decode reads in classes: one group per token, 1 to 4 bits, float16/bfloat16 dots, d/P ≥ 16 (16-bit
    words at 2 and 4 bits, bytes at 1 bit and at 2 bits below head_dim 128, three bytes at 3 bits; at 1 and 3 bits
    below head_dim 128 two codes a word in each of 4 classes), 16-bit words at even offsets; everything else unpacks
    to tiles. And which paged decodes read a tile of tokens' block once (``DecodeTuning.one_page``)."""
    fmt = lambda bits, d, G=None: tk.TokenFormat(bits, d, G or d, True)
    bf = torch.bfloat16
    assert [tk.code_classes(fmt(b, 128), bf) for b in (1, 2, 3, 4, 8)] == [8, 8, 8, 4, 0]
    assert [tk.code_classes(fmt(b, 64), bf) for b in (1, 2, 3, 4, 8)] == [4, 4, 4, 4, 0]
    assert [tk.code_classes(fmt(b, 256), torch.float16) for b in (1, 2, 3, 4)] == [8, 8, 8, 4]
    assert [tk.code_classes(fmt(b, 32), bf) for b in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert tk.code_classes(fmt(2, 128), torch.float32) == 0 and tk.code_classes(fmt(2, 128, 32), bf) == 0
    codes = torch.zeros(4, 49, dtype=torch.uint8)  # rows at odd offsets: 2-bit rows of 32 bytes, 3-bit of 48
    assert tk.code_classes(fmt(2, 128), bf, codes[:, 1:33]) == 4  # odd rows: bytes of 4 codes instead of words
    assert tk.code_classes(fmt(2, 128), bf, codes[:, :32]) == 4  # rows 49 bytes apart: every other one odd
    assert tk.code_classes(fmt(4, 128), bf, codes[:, 1:]) == 0  # 4-bit codes have no byte words: tiles
    assert tk.code_classes(fmt(3, 128), bf, codes[:, 1:]) == 8  # bytes need no alignment
    assert tk.code_classes(fmt(2, 64), bf, codes[:, 1:17]) == 4
    assert tk.code_classes(fmt(2, 128), bf, torch.zeros(4, 32, dtype=torch.uint8)) == 8
    assert tk.code_classes(fmt(3, 128), bf, torch.zeros(4, 0, 48, dtype=torch.uint8)) == 0  # no middle
    # codes a word: two in each class below head_dim 128; 2-bit rows at odd offsets in bytes of 4
    assert [tk.code_words(fmt(b, 64), 4) for b in (1, 2, 3, 4)] == [8, 8, 8, 4]
    assert [tk.code_words(fmt(b, 128), 8) for b in (1, 2, 3)] == [16, 8, 8] and tk.code_words(fmt(2, 64), 0) == 0
    assert tk.code_words(fmt(1, 128), 8, codes[:, 1:17]) == 8  # 1-bit rows at odd offsets: bytes
    assert tk.code_words(fmt(2, 64), 4, codes[:, 1:17]) == 4 and tk.code_words(fmt(2, 64), 4, codes[:, :16]) == 4
    assert tk.code_words(fmt(2, 64), 4, torch.zeros(4, 16, dtype=torch.uint8)) == 8
    with pytest.raises(ValueError, match="class_split must be True or False"):
        tk.DecodeTuning(class_split=1)
    # a tile of tokens' block read once only where it fits in one (and by default only for value tiles at d >= 128)
    tiles = lambda d: tk.Packed(tk.TileFormat(2, d, 128), codes, codes)
    per_token = tk.Packed(fmt(2, 128), codes, codes)
    assert [tk.DecodeTuning().one_page(128, 32, v) for v in (tiles(128), tiles(64), per_token)] == [True, False, False]
    on = tk.DecodeTuning(page_tiles=True)
    assert on.one_page(64, 32, per_token) and not on.one_page(16, 32, per_token)
    assert not tk.DecodeTuning(page_tiles=False).one_page(128, 32, tiles(128))
    with pytest.raises(ValueError, match="page_tiles must be True, False or None"):
        tk.DecodeTuning(page_tiles=1)


def test_splits_never_read_lengths_on_the_device():
    """Choosing the splits reads ``lengths`` only where it is on the host: on a GPU that read would synchronize at
    every layer and step. A device-resident ``lengths`` (here on the meta device, whose values cannot be read at
    all) gives the parts' capacity instead, contiguous and paged; a host one the exact longest sequence."""
    fmt = tk.TokenFormat(2, 64, 64, True)
    part = lambda n: torch.zeros(2, 2, n, 64)
    mid = tk.Packed(fmt, torch.zeros(2, 2, 40, fmt.nbytes, dtype=torch.uint8), torch.zeros(2, 2, 40, 1))
    on_device = torch.empty(2, 3, dtype=torch.int32, device="meta")
    assert tk._longest(on_device, part(4), mid, part(16), None) == 4 + 40 + 16
    paged = tk.Packed(fmt, torch.zeros(9, 8, 2, fmt.nbytes, dtype=torch.uint8), torch.zeros(9, 8, 2, 1))
    assert tk._longest(on_device, part(4), paged, part(16), torch.zeros(2, 5, dtype=torch.int32)) == 4 + 5 * 8 + 16
    assert tk._longest(torch.tensor([[4, 33, 16], [1, 7, 2]]), part(4), mid, part(16), None) == 53
    with pytest.raises(ValueError, match="absolute_pages=True describes a block table"):
        tk.decode(torch.zeros(2, 2, 64), torch.tensor([[4, 40, 16]] * 2), part(4), part(4), mid, mid, part(16),
                  part(16), 0.1, absolute_pages=True)


def test_store_contiguous_checks_the_capacity_on_the_host():
    """Writing past a sequence's capacity, or from a negative start, is refused, naming the start and the capacity,
    from an int start (numpy's too) or a host tensor of any integer dtype (the check reads no device tensor), and
    nothing is written; a bool is not a start."""
    fmt = tk.TokenFormat.of(QuestQuantizer(2), 64)
    codes = torch.zeros(2, 2, 8, fmt.nbytes, dtype=torch.uint8, device=DEVICE)
    scale = torch.zeros(2, 2, 8, 1, dtype=torch.float16, device=DEVICE)
    x = torch.randn(2, 2, 3, 64, device=DEVICE)
    for start in (6, np.int64(6), torch.tensor([0, 6]), torch.tensor([0, 254], dtype=torch.uint8)):  # 254 + 3 wraps in uint8
        with pytest.raises(ValueError, match=r"3 tokens from (6|\[0, 6\]|\[0, 254\]) overflow the capacity 8"):
            tk.store_contiguous(x, codes, scale, None, start, fmt)
    for start, match in ((-1, r"start must be >= 0, got -1"), (torch.tensor([2, -1]), r"start must be >= 0, got \[2, -1\]"),
                         (True, "start must be an integer"), (2.5, "start must be an integer"),
                         (torch.tensor([1.5, 0.0]), "start must be an integer")):
        with pytest.raises(ValueError, match=match):
            tk.store_contiguous(x, codes, scale, None, start, fmt)
    assert not codes.any()
    tk.store_contiguous(x, codes, scale, None, torch.tensor([5, 0]), fmt)
    assert codes[0, :, 5:].any() and codes[1, :, :3].any() and not codes[0, :, :5].any()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device: torch's sync debug mode watches CUDA streams")
def test_kernels_never_make_the_host_wait_for_the_device():
    """On a GPU, store and decode queue their work and return: torch's sync debug mode turns any wait of the host
    for the device into an error. Host-side lengths, block tables, slot mappings and starts (what the transformers
    cache and vLLM pass) reach the device through pinned memory; a plain copy from pageable memory would wait for
    every kernel queued before it, at every layer and step. Keys centered on their rotating mean too: their positions
    on the host, the tables of angles sent once."""
    fmt = tk.TokenFormat.of(QuestQuantizer(2), 128)
    B, H, d, cap = 2, 2, 128, 64
    codes = torch.zeros(B, H, cap, fmt.nbytes, dtype=torch.uint8, device=DEVICE)
    scale = torch.zeros(B, H, cap, 1, dtype=torch.float16, device=DEVICE)
    paged_codes = torch.zeros(8, 16, H, fmt.nbytes, dtype=torch.uint8, device=DEVICE)
    paged_scale = torch.zeros(8, 16, H, 1, dtype=torch.float16, device=DEVICE)
    x = torch.randn(B, H, 40, d, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(B, 4 * H, d, device=DEVICE, dtype=torch.bfloat16)
    part = torch.randn(B, H, 8, d, device=DEVICE, dtype=torch.bfloat16)
    mid = tk.Packed(fmt, codes, scale)
    paged = tk.Packed(fmt, paged_codes, paged_scale)
    lengths = torch.tensor([[8, 40, 8]], dtype=torch.int32).expand(B, 3)  # on the host, expanded: as the cache builds it
    bias = tk.KeyBias(torch.randn(B, 4 * H, d, device=DEVICE), torch.tensor([8, 8]), torch.ones(d // 2))

    def step():
        tk.store_contiguous(x, codes, scale, None, 0, fmt)
        tk.store_contiguous(x[:, :, :4], codes, scale, None, torch.tensor([40, 44]), fmt)
        tk.store_paged(x[0].transpose(0, 1), torch.arange(40), paged_codes, paged_scale, None, fmt)
        a = tk.decode(q, lengths, part, part, mid, mid, part, part, d**-0.5)
        b = tk.decode(q, lengths, part, part, paged, paged, part, part, d**-0.5,
                      block_table=torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32))
        tk.decode(q, lengths, part, part, mid, mid, part, part, d**-0.5, key_bias=bias)  # +rmean: host positions
        return a, b

    step()  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a, b = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert _rel(a[:1].float(), b[:1].float()) < 1e-2  # sequence 0: the same middle in either layout


def test_decode_tuning_changes_launches_not_results():
    """Launch parameters (DecodeTuning) change how the work is cut, not what is computed: other tiles, splits per
    multiprocessor and warps give the same output to float32 summation order; decode_tuning() restores the previous
    tuning on exit, also on error; bad values are refused by name."""
    d = 64
    q, pk, pv = _case(QuestQuantizer(2), QuestQuantizer(3), B=2, Hkv=2, G=3, d=d, n_s=3, n_m=70, n_r=5)
    ref = _triton(q, pk, pv)
    before = tk.current_tuning()
    with tk.decode_tuning(block_n=16, num_warps=8, num_stages=1, programs_per_sm=2) as t:
        assert tk.current_tuning() == t and t.block_n == 16 and t.programs_per_sm == 2
        assert _rel(_triton(q, pk, pv), ref) < 1e-5
    with tk.decode_tuning(max_registers=128, fp_stages=1, num_stages=3), tk.recorded_launches() as rec:
        _triton(q, pk, pv)
    meta = next(m for name, _, _, m in rec if name == "decode")
    assert meta["maxnreg"] == 128 and meta["FP_STAGES"] == 1 and meta["num_stages"] == 3
    with tk.recorded_launches() as rec:
        _triton(q, pk, pv)
    meta = next(m for name, _, _, m in rec if name == "decode")
    # by default the compiler's registers, and the windows' loop pipelined as the middle's
    assert "maxnreg" not in meta and meta["FP_STAGES"] == meta["num_stages"] == before.num_stages
    with pytest.raises(RuntimeError), tk.decode_tuning(block_n=128):
        raise RuntimeError("inside")
    assert tk.current_tuning() == before
    for bad, match in ((dict(block_n=48), "block_n"), (dict(num_warps=0), "num_warps"), (dict(programs_per_sm=1.5), "programs_per_sm"),
                       (dict(max_registers=16), r"max_registers must be an int in \[24, 255\].*got 16"),
                       (dict(max_registers=256), "max_registers"), (dict(max_registers=True), "max_registers"),
                       (dict(max_registers=128.0), "max_registers"), (dict(fp_stages=0), "fp_stages"),
                       (dict(fp_stages=True), r"fp_stages must be a positive int \(or None\), got True")):
        with pytest.raises(ValueError, match=match):
            tk.DecodeTuning(**bad)


def test_splits_fill_whole_waves():
    """wave_splits: the fewest splits whose cost, waves x (tiles a program + 1), is within 2% of the least over the
    allowed counts (at most the tiles, 256, and two waves or twice the pairs' programs), by brute force over a grid of
    shapes; and the split counts of the issue's shapes (docs/reference/performance.md, session 59), whole waves where
    the share of the slots rounded up (the rule before) made a second wave of a few programs."""
    def cost(pairs, slots, tiles, s):
        return math.ceil(pairs * s / slots) * (math.ceil(tiles / s) + 1)

    for pairs in (1, 3, 8, 24, 100, 128, 192, 512, 700, 1024, 1100, 2048, 5000):
        for slots in (1, 16, 264, 1056, 2112):
            for tiles in (1, 2, 7, 32, 1024, 4096):
                s = tk.wave_splits(pairs, slots, tiles)
                allowed = [t for t in range(1, min(tiles, 256) + 1) if t == 1 or pairs * t <= max(2 * slots, 2 * pairs)]
                least = min(cost(pairs, slots, tiles, t) for t in allowed)
                assert s in allowed and cost(pairs, slots, tiles, s) <= 1.02 * least
                assert all(cost(pairs, slots, tiles, t) > 1.02 * least for t in range(1, s)), (pairs, slots, tiles, s)
    # 132 multiprocessors of 8 programs; (pairs, tiles of 32 tokens): 16 sequences x 8 KV heads at 32k and 1k tokens,
    # 64 and 128 sequences at 32k, 8 sequences at 128k, SmolLM2's 3 KV heads x 64 sequences, one sequence at 32k, 1k
    slots = 132 * 8
    for pairs, tiles, want, before in ((128, 1024, 8, 9), (128, 32, 8, 9), (512, 1024, 2, 3), (1024, 1024, 1, 2),
                                       (64, 4096, 16, 17), (192, 1024, 11, 6), (8, 1024, 128, 132), (8, 32, 32, 32)):
        assert tk.wave_splits(pairs, slots, tiles) == want, (pairs, tiles)
        assert min(-(-slots // pairs), tiles) == before  # what the share rounded up gave
    assert tk.wave_splits(2048, slots, 4096) == 1  # the pairs alone make two waves: no splits (uncapped, 17: 33 waves)
    assert tk.wave_splits(1, 2 * slots, 8192) == 256  # at most 256
    assert tk.default_splits(16, 8, 32768, 32, torch.device("cpu")) == 1  # the interpreter: one program a pair


def test_resident_warps_as_cudas_occupancy_calculator_counts_them():
    """sm_90's resident warps of a kernel (what programs_per_sm stands for, and what kernel_sass.py and gpu_decode.py
    report): registers in four sub-partitions of 16,384 (a warp's in one, 256 at a time), shared memory in 128-byte
    units plus 1 KB a block, at most 64 warps and 32 blocks. The default one-warp decode program (255 registers, 20
    KB) holds 8; 180 registers too; a cap of 168 holds 12, 128 holds 16."""
    cases = [(255, 20480, 1), (180, 10240, 1), (144, 10240, 1), (168, 12288, 1), (128, 12288, 1), (128, 20480, 1),
             (167, 0, 4), (64, 0, 8), (32, 0, 8), (32, 60000, 4)]
    assert [tk.resident_warps(*c) for c in cases] == [8, 8, 12, 12, 16, 10, 12, 32, 64, 12]


def test_launches_go_through_a_hook():
    """launches_through(hook): every launch of the block reaches the hook with its name, grid, arguments and
    constexprs, and runs when the hook runs it (a test's stand-in tensors are checked there); outside it, as before;
    nested, through each hook from the innermost out."""
    d = 64
    q, pk, pv = _case(QuestQuantizer(2), QuestQuantizer(2), B=1, Hkv=2, G=2, d=d, n_s=2, n_m=20, n_r=3)
    ref = _triton(q, pk, pv)
    seen = []

    def hook(name, grid, args, meta, run):
        seen.append((name, grid[0], meta["D"] if name == "decode" else None))
        run(name, grid, args, meta)

    with tk.launches_through(hook):
        out = _triton(q, pk, pv)
    assert [s[0] for s in seen] == ["decode"] and seen[0][1:] == (1, d) and torch.equal(out, ref)
    with tk.launches_through(hook):
        _triton(q, pk, pv, splits=2)
    assert [s[0] for s in seen] == ["decode", "decode", "merge"]
    _triton(q, pk, pv)
    assert len(seen) == 3
    # nested blocks: the inner hook first, its run the outer hook's (a recorder sees what a test's own hook runs)
    order = []
    with tk.launches_through(lambda name, grid, args, meta, run: (order.append("outer"), run(name, grid, args, meta))[1]):
        with tk.launches_through(lambda name, grid, args, meta, run: (order.append("inner"), run(name, grid, args, meta))[1]):
            out = _triton(q, pk, pv)
    assert order == ["inner", "outer"] and torch.equal(out, ref)


def test_decode_attention_dispatches_to_triton():
    """decode_attention runs the Triton kernel under triton_enabled(True) (the launches are counted) and gives what
    the PyTorch path gives, for per-token codes and for KVarN key tiles; a full-precision middle stays on the PyTorch
    path."""
    d = 64
    q, pk, pv = _case(QuestQuantizer(2), AffineQuantizer(3, clip_ratio=0.92), B=1, Hkv=2, G=2, d=d, n_s=2, n_m=12, n_r=3)
    with decode_mod.triton_enabled(False):
        ref = decode_attention(q, pk, pv, None, d**-0.5)
    tk.reset_calls()
    with decode_mod.triton_enabled(True):
        out = decode_attention(q, pk, pv, None, d**-0.5)
    assert tk.calls() == {"decode": 1}  # one split on CPU: its program writes the output, no merge
    assert _rel(out, ref) < 1e-4
    with decode_mod.triton_enabled(True):  # a full-precision middle (K-only caches): not the kernel's
        decode_attention(q, [pk[0], pk[1][0].decode(pk[1][1], 12).to(q.dtype), pk[2]], pv, None, d**-0.5)
    assert tk.calls() == {"decode": 1}
    from wushkv.codecs import KVarNCodec

    kc = KVarNCodec(2, d, 4, "key")  # tiles of 4 tokens: the 12 of the middle
    keys = torch.randn(1, 2, 12, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    tiles = [pk[0], (kc, kc.encode(keys), 12), pk[2]]
    with decode_mod.triton_enabled(False):
        ref = decode_attention(q, tiles, pv, None, d**-0.5)
    with decode_mod.triton_enabled(True):
        out = decode_attention(q, tiles, pv, None, d**-0.5)
    assert tk.calls() == {"decode": 2} and _rel(out, ref) < 1e-4


# -- the cache's flush through the store kernel ------------------------------------------------------------------------
def _stream(cfg, enabled, dtype=torch.float32, inputs=CacheInputs(), device=DEVICE):
    """A layer (2 KV heads of 32) fed 14 tokens then 4 single tokens of exact data under ``triton_enabled(enabled)``:
    (the layer, the store kernel's launches, how many updates flushed tokens into the middle)."""
    layer = WushKVLayer(cfg, 32, inputs=inputs)
    x = _exact_data((2, 2, 18, 32), seed=11).to(device, dtype)
    y = _exact_data((2, 2, 18, 32), seed=12).to(device, dtype)
    tk.reset_calls()
    flushes = 0
    with decode_mod.triton_enabled(enabled):
        for a, b in ((0, 14), (14, 15), (15, 16), (16, 17), (17, 18)):
            before = layer._mid_len if layer.is_initialized else 0
            layer.update(x[:, :, a:b], y[:, :, a:b])
            flushes += layer._mid_len > before
    return layer, tk.calls().get("store", 0), flushes


def _middle(layer):
    return {side: {k: t.cpu() for k, t in getattr(layer, side).store.view().items()} for side in ("k_side", "v_side")}


@pytest.mark.parametrize("quantizer,dtype,meta", [("quest", torch.float32, "float16"), ("affine", torch.bfloat16, "bfloat16")])
def test_cache_flush_goes_through_the_store_kernel(quantizer, dtype, meta):
    """Under triton_enabled(True) the layer's flush (decode.encode_block) writes the packed middle with the Triton
    store kernel, one launch per side and flush, and stores what the PyTorch codec stores on CPU, bit for bit (codes,
    scale, offset; exact data; on CUDA torch divides by a constant through its reciprocal, the kernel as the CPU does).
    So does a side with error feedback (``+ldlq``, since session 62; before, that side stayed on the PyTorch path).
    So do one-byte (E5M3) steps (since session 74). Codecs the kernel does not cover stay on the PyTorch path: the clip
    search; KVarN tiles go through their own kernel."""
    cfg = QuantConfig(2, 3, quantizer, group_size=16, metadata_dtype=meta, windows=WindowConfig(2, 4, 4))
    ref, launches, flushes = _stream(cfg, False, dtype, device="cpu")
    assert launches == 0 and flushes >= 2  # the prefill's flush and at least one during decode
    out, launches, _ = _stream(cfg, True, dtype)
    assert launches == 2 * flushes
    for side, store in _middle(ref).items():
        got = _middle(out)[side]
        assert set(got) == set(store) == ({"codes", "scale"} | ({"offset"} if quantizer == "affine" else set()))
        for k in store:
            assert got[k].dtype == store[k].dtype and torch.equal(got[k], store[k]), (side, k)
    F = _unit_upper(2, 32, seed=5)
    ref, _, flushes = _stream(cfg, False, dtype, CacheInputs(feedback_K=F, feedback_V=F.flip(0)), device="cpu")
    out, launches, _ = _stream(cfg, True, dtype, CacheInputs(feedback_K=F.to(DEVICE), feedback_V=F.flip(0).to(DEVICE)))
    assert launches == 2 * flushes
    for side, store in _middle(ref).items():
        for k, t in store.items():
            assert torch.equal(_middle(out)[side][k], t), ("feedback", side, k)
    # one-byte (E5M3) steps, with feedback on the keys: through the kernel too since session 74, the same bytes
    e5 = QuantConfig(2, 3, "quest", group_size=16, metadata_dtype="e5m3", windows=WindowConfig(2, 4, 4))
    ref, _, flushes = _stream(e5, False, dtype, CacheInputs(feedback_K=F), device="cpu")
    out, launches, _ = _stream(e5, True, dtype, CacheInputs(feedback_K=F.to(DEVICE)))
    assert launches == 2 * flushes
    for side, store in _middle(ref).items():
        assert store["scale"].dtype == torch.uint8
        for k, t in store.items():
            assert torch.equal(_middle(out)[side][k], t), ("e5m3", side, k)
    for other in (QuantConfig(2, 3, quantizer, clip_search=2, windows=WindowConfig(2, 4, 4)),
                  QuantConfig(2, 2, "kvarn", windows=WindowConfig(2, 4, 4))):
        assert _stream(other, True, dtype)[1] == 0, other


@pytest.mark.parametrize("feedback", [True])  # (without: test_kvarn_key_tiles_equal_the_tile_quantizer)
def test_key_tile_flush_goes_through_the_tile_kernel(feedback):
    """``+ktiles``' keys (KVarN tiles of S_flush tokens, in every recipe ``auto`` records) flush through the tile
    kernel, one launch a flush, and their values through the store kernel (with ``+ldlq`` feedback on both sides,
    as auto's recipes have it): the packed middle is the PyTorch path's. Before, a GPU ran KVarN's balance and
    rows in PyTorch, about 400 small operations a flush and 13 more a channel with feedback."""
    cfg = QuantConfig(2, 2, "quest", key_quantizer="kvarn", windows=WindowConfig(2, 0, 8))
    F = _unit_upper(2, 32, seed=6) if feedback else None
    ref, _, flushes = _stream(cfg, False, torch.float32, CacheInputs(feedback_K=F, feedback_V=F), device="cpu")
    on = None if F is None else F.to(DEVICE)
    out, launches, _ = _stream(cfg, True, torch.float32, CacheInputs(feedback_K=on, feedback_V=on))
    assert flushes >= 2 and launches == flushes and tk.calls().get("kvarn_keys") == flushes
    for side, store in _middle(ref).items():
        got = _middle(out)[side]
        assert set(got) == set(store)
        for k, t in store.items():
            if EXACT_ON_ANY_DATA:
                assert torch.equal(got[k], t), (side, k)
            else:  # (float32 sums in another order: a code may flip where a value sits on a boundary)
                assert (got[k] != t).float().mean() < 0.02, (side, k)


def test_kvarn_flush_goes_through_the_tile_kernel_on_both_sides():
    """The ``kvarn`` method's flush (KVarN tiles of keys and of values): each side one tile-kernel launch a flush, and
    the packed middle is the PyTorch path's (before session 70 a GPU quantized the value tiles in PyTorch)."""
    from wushkv.codecs import KVarNCodec

    cfg = QuantConfig(3, 2, "kvarn", windows=WindowConfig(2, 0, 8))
    ref, _, flushes = _stream(cfg, False, torch.float32, device="cpu")
    out, stores, _ = _stream(cfg, True, torch.float32)
    assert flushes >= 2 and stores == 0 and tk.calls().get("kvarn_keys") == tk.calls().get("kvarn_values") == flushes
    for side, store in _middle(ref).items():
        got = _middle(out)[side]
        assert set(got) == set(store) == {"codes", "scale", "zero", "s_fold"}
        assert (got["codes"] != store["codes"]).float().mean() < 0.02, side
        # the tile kernel follows kvarn_quantize's PyTorch loop, the CPU path its C++ kernel, whose balance may keep the
        # other of two rounds that tie to float32 rounding (the scales then split e^±s between rows and columns, with
        # the same product): the tiles decode to the same keys and values
        key = side == "k_side"
        codec = KVarNCodec(cfg.k_bits if key else cfg.v_bits, 32, 8, "key" if key else "value")
        a, b = codec.decode(store, 0), codec.decode(got, 0)
        assert torch.allclose(a, b, rtol=4e-3, atol=4e-3 * float(a.abs().max())), (side, float((a - b).abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("family,cfg", [
    ("llama", QuantConfig(2, 2, "quest", windows=WindowConfig(4, 8, 4))),
    ("gemma3", QuantConfig(4, 2, "affine", windows=WindowConfig(2, 4, 4))),
    ("llama", QuantConfig(4, 2, "quest", metadata_dtype="e5m3", windows=WindowConfig(4, 8, 4))),
    ("llama+rmean", QuantConfig(2, 2, "affine", key_quantizer="kvarn", windows=WindowConfig(4, 4, 8))),
    ("llama", QuantConfig(3, 2, "kvarn", windows=WindowConfig(4, 4, 16))),
])
def test_model_decode_through_triton_equals_pytorch(family, cfg):
    """A tiny model (gemma3: sliding-window layers and a GQA group of 2; llama also with one-byte steps, which the
    store kernel leaves to the PyTorch path, and with KVarN key tiles of 8 tokens centered on a rotating mean, what
    ``auto`` picks for SmolLM2, ``+rmean+ktiles``, stored by the tile kernel and read by the decode kernel; and the
    ``kvarn`` method, tiles of keys and of values) prefilled
    with 30 tokens, then decoded 3 tokens, every flush through the store kernel and every decode step through the
    decode kernel: the packed middle
    is the PyTorch path's (QuEST's step may differ in its last float32 bit where torch sums ‖x‖ in another order, so
    a few codes and steps may flip: at most 0.2% of them, 0 measured on CPU; affine bit for bit), and the logits of
    every decode step equal the PyTorch path's within 1e-4 of their scale (4e-7 measured on CPU)."""
    family, rmean = family.removesuffix("+rmean"), family.endswith("+rmean")
    model = tiny_model(family).to(DEVICE)
    ids = torch.randint(3, 96, (2, 33), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    inputs = None
    if rmean or cfg.quantizer == "kvarn":  # one sequence: the tile kernel's 16-round balance, a program a tile, is
        ids = ids[:1]  # slow in the interpreter
    if rmean:  # a mean far from 0 under the model's own RoPE; no key transform (T = I)
        from wushkv.layer import RotatingKeyMean

        H, d = model.config.num_key_value_heads, model.config.head_dim
        g = torch.Generator().manual_seed(3)
        rope = (model.model.rotary_emb.inv_freq.cpu(), float(model.model.rotary_emb.attention_scaling))
        inputs = [CacheInputs(key_mean=RotatingKeyMean(torch.randn(H, d, generator=g) * 3, torch.eye(d).expand(H, d, d).to(DEVICE), rope))
                  for _ in range(model.config.num_hidden_layers)]

    def run(enabled):
        cache = WushKVCache(model, cfg, inputs=inputs)
        with torch.no_grad(), decode_mod.triton_enabled(enabled):
            model(ids[:, :30], cache=cache, use_cache=True)
            logits = torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(30, 33)], 1)
        return logits, [_middle(layer) for layer in cache.layers]

    ref, ref_mid = run(False)
    tk.reset_calls()
    out, out_mid = run(True)
    L = model.config.num_hidden_layers
    stores = tk.calls().get("store", 0)  # every layer flushed at least once, one-byte steps too (since session 74)
    # (tiles: through the tile kernel, the other side through the store kernel)
    tiles = [name for name in ("key", "value") if cfg.side_quantizer(name) == "kvarn"]
    assert tk.calls()["decode"] == 3 * L and stores >= (2 - len(tiles)) * L
    assert all(tk.calls().get(f"kvarn_{name}s", 0) >= (L if name in tiles else 0) for name in ("key", "value")), tk.calls()
    flips = total = 0
    for a, b in zip(ref_mid, out_mid):
        for side in a:
            if side[0] == "k" and "key" in tiles or side[0] == "v" and "value" in tiles:
                # tiles: the tile kernel follows kvarn_quantize's PyTorch loop, the CPU path its C++ kernel, whose
                # balance may keep the other of two rounds that tie to float32 rounding: scale and s_fold then split
                # e^±s between rows and columns with the same product. The keys (values) they decode to agree.
                kind = "key" if side == "k_side" else "value"
                codec = KVarNCodec(cfg.k_bits if kind == "key" else cfg.v_bits, model.config.head_dim, cfg.windows.S_flush, kind)
                ka, kb = (codec.decode(m[side], 0) for m in (a, b))
                assert torch.allclose(ka, kb, rtol=4e-3, atol=4e-3 * float(ka.abs().max())), float((ka - kb).abs().max())
                continue
            for k in a[side]:
                assert a[side][k].shape == b[side][k].shape and a[side][k].dtype == b[side][k].dtype
                if cfg.quantizer == "affine" and EXACT_ON_ANY_DATA:
                    assert torch.equal(a[side][k], b[side][k]), (side, k)
                flips += int((a[side][k] != b[side][k]).sum())
                total += a[side][k].numel()
    assert flips <= 2e-3 * total, (flips, total)
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max(), (out - ref).abs().max()


COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from wushkv import triton_kernels as tk
K = tk._kernels()
def sig(name, ptrs, floats, consts):
    s = {n: ptrs.get(n, "*fp32") if n.endswith("_ptr") else ("fp32" if n in floats else "i64") for n in K[name].arg_names}
    return s | {c: "constexpr" for c in consts}
ptrs = {"x_ptr": "*bf16", "c_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "slot_ptr": "*i64"}
for quest, clipped, has_t, br, fb, G in ((True, True, False, 8, False, 32), (True, False, True, 1, False, 32),
                                        (False, True, False, 1, False, 32), (False, False, False, 8, False, 32),
                                        (True, True, False, 1, True, 128), (False, True, False, 1, True, 32),
                                        (False, True, True, 8, False, 128)):  # affine's clip counted over T k
    consts = dict(D=128, G=G, BITS=3, QUEST=quest, CLIPPED=clipped, HAS_T=has_t, HAS_Z=not quest, TC=32, META_BF16=True,
                  FEEDBACK=fb, BR=br, STEP_BYTE=False, STEP_ROUND=64)
    triton.compile(ASTSource(K["store"], sig("store", ptrs, ("coef", "sqrt_g"), consts), consts), target=GPUTarget("cuda", 90, 32),
                   options={"enable_fp_fusion": False} if fb else None)
# QuEST's steps in one E5M3 byte (K4V2's served recipe), rounded half up and up, with error feedback and without
for fb, rnd in ((True, 64), (False, 127)):
    consts = dict(D=128, G=128, BITS=2, QUEST=True, CLIPPED=True, HAS_T=False, HAS_Z=False, TC=32, META_BF16=False,
                  FEEDBACK=fb, BR=1 if fb else 8, STEP_BYTE=True, STEP_ROUND=rnd)
    triton.compile(ASTSource(K["store"], sig("store", ptrs | {"s_ptr": "*u8", "z_ptr": "*u8"}, ("coef", "sqrt_g"), consts), consts),
                   target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False} if fb else None)
# KVarN key tiles of 128 tokens at head_dim 64 (SmolLM2's auto), clipped, with error feedback along the channels
# (and, the same kernel on the transposed tile, KVarN value tiles of 128 tokens at head_dim 128: the kvarn method's)
for consts in (dict(D=64, G=128, BITS=2, ITERS=16, CLIPPED=True, FEEDBACK=True, VALUES=False),
               dict(D=128, G=128, BITS=2, ITERS=16, CLIPPED=False, FEEDBACK=False, VALUES=True)):
    triton.compile(ASTSource(K["kvarn_keys"], sig("kvarn_keys", {"x_ptr": "*bf16", "c_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16",
                                                                 "o_ptr": "*fp16"}, ("clip_half",), consts), consts),
                   target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False, "num_warps": consts["D"] * consts["G"] // 2048})
consts = dict(D=128, GQA=4, GP=16, BN=32, K_BITS=2, V_BITS=4, K_G=128, V_G=32, K_Z=False, V_Z=True, K_E5M3=True, K_OFF=128, V_OFF=0,
              V_E5M3=False, K_P=0, V_P=0, K_WC=0, V_WC=0, K_W4=False, V_W4=False, K_TILE=0, KT_MW=128, V_TILE=0, VT_MW=128, RMEAN=False, PAGED=True, PAGE_ABS=False, STARTS=False, HAS_MASK=True, SOFTCAP=True,
              PREC="tf32", DT=tl.bfloat16, EMU=False, FP_STAGES=1, FINAL=False, HAS_SINKS=False, OUT_BF16=True,
              LAST_MERGES=False, FP_UNIT=0, PAGE=16, ONE_PAGE=False)
ptrs = {"wt_ptr": "*i32", "cnt_ptr": "*i32", "out_ptr": "*bf16", "q_ptr": "*bf16", "sk_ptr": "*bf16", "sv_ptr": "*bf16", "rk_ptr": "*bf16", "rv_ptr": "*bf16", "kc_ptr": "*u8",
        "vc_ptr": "*u8", "mask_ptr": "*u8", "lens_ptr": "*i32", "bt_ptr": "*i32", "ks_ptr": "*u8", "vs_ptr": "*fp16",
        "kz_ptr": "*u8", "vz_ptr": "*fp16", "kts_ptr": "*fp16", "ktz_ptr": "*fp16", "vts_ptr": "*fp16", "rp_ptr": "*i32",
        "st_ptr": "*i32"}
for bn, warps, stages, v in ((32, 4, 3, (4, 32, True, 0)), (128, 8, 2, (2, 128, False, 128))):  # two tunings, two value codecs
    consts.update(BN=bn, V_BITS=v[0], V_G=v[1], V_Z=v[2], V_OFF=v[3], FP_STAGES=stages)  # the windows' loop pipelined
    k = triton.compile(ASTSource(K["decode"], sig("decode", ptrs, ("sm_scale", "softcap", "K_HALF", "V_HALF"), consts), consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
consts["FP_STAGES"] = 1
# codes in classes, inline PTX: 16-bit words (2 and 4 bits), then words of three bytes and of one (3, 1 and 2 bits)
for dt, off, kv, warps in ((tl.bfloat16, 128, (2, 8, 4, 4), 1), (tl.float16, 1024, (4, 4, 2, 8), 4),
                           (tl.bfloat16, 128, (3, 8, 1, 8), 1), (tl.float16, 1024, (2, 4, 3, 8), 1)):
    consts.update(BN=64, DT=dt, K_OFF=off, V_OFF=off, K_BITS=kv[0], K_P=kv[1], V_BITS=kv[2], V_P=kv[3], V_G=128, V_Z=False, K_E5M3=False,
                  PAGE_ABS=warps == 1, K_WC=kv[1], V_WC=kv[3])
    p = dict(ptrs, q_ptr="*bf16" if dt == tl.bfloat16 else "*fp16", sk_ptr="*fp16", sv_ptr="*fp16", rk_ptr="*fp16", rv_ptr="*fp16",
             ks_ptr="*fp16", kz_ptr="*fp16", vz_ptr="*fp16")
    k = triton.compile(ASTSource(K["decode"], sig("decode", p, ("sm_scale", "softcap", "K_HALF", "V_HALF"), consts), consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})
    assert "lop3.b32" in k.asm["ptx"] and "cubin" in k.asm
    assert ("prmt.b32" in k.asm["ptx"]) == (kv[0] * kv[1] != 16 or kv[2] * kv[3] != 16)
# one split: the program writes the output itself (learned sink logits, float16 out)
one = dict(consts, FINAL=True, HAS_SINKS=True, OUT_BF16=False)
triton.compile(ASTSource(K["decode"], sig("decode", dict(p, out_ptr="*fp16"), ("sm_scale", "softcap", "K_HALF", "V_HALF"), one), one),
               target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 2})
# several splits, the last program of a pair merging them (sink logits): one warp in classes (the count broadcast by a
# shuffle), 4 warps over unpacked tiles (through shared memory). Every thread's stores of the split's state, a barrier,
# then one thread's atomic add that releases them and acquires the others' (gpu scope), the splits' state read past L1
for warps, kp, vp in ((1, 8, 4), (4, 0, 0)):  # K2V4, bfloat16
    last = dict(consts, LAST_MERGES=True, HAS_SINKS=True, DT=tl.bfloat16, K_OFF=128, V_OFF=128, K_BITS=2, V_BITS=4,
                K_P=kp, K_WC=kp, V_P=vp, V_WC=vp, K_W4=False, V_W4=False, PAGE_ABS=False)
    k = triton.compile(ASTSource(K["decode"], sig("decode", dict(p, q_ptr="*bf16"), ("sm_scale", "softcap", "K_HALF", "V_HALF"),
                                                  last), last),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})
    ptx = k.asm["ptx"]
    atom = ptx.index("atom.global.gpu.acq_rel.add.u32")
    assert ptx.count("atom.global") == 1 and "bar.sync" in ptx[ptx.rindex("st.global", 0, atom):atom]
    assert "ld.global.cg" in ptx[atom:] and "cubin" in k.asm
# two codes a word in each class: at head_dim 64 words of 8 codes in 4 classes (3 bits from int32 loads, 1 bit, 2 bits
# in 16-bit words; 2-bit bytes of 4 codes where rows sit at odd offsets), at 128 1-bit 16-bit words of 16 in 8
for dd, kb, kp, kwc, vb, vp, vwc in ((64, 3, 4, 8, 1, 4, 8), (64, 2, 4, 8, 2, 4, 4), (128, 1, 8, 16, 2, 8, 8)):
    two = dict(consts, D=dd, K_BITS=kb, K_P=kp, K_WC=kwc, K_W4=kb == 3, V_BITS=vb, V_P=vp, V_WC=vwc, V_W4=False, V_G=dd,
               K_G=dd, PAGE_ABS=False)
    k = triton.compile(ASTSource(K["decode"], sig("decode", p, ("sm_scale", "softcap", "K_HALF", "V_HALF"), two), two),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 2, "maxnreg": 128})
    assert ".maxnreg 128" in k.asm["ptx"]  # DecodeTuning.max_registers reaches ptxas
# no mask, no softcap (a split's partial tiles masked behind a branch); zeros on both sides in classes: keys' Σq·z,
# values' per-class offsets (float16 4 bits) against Σ w from the dot with ones
z = dict(consts, HAS_MASK=False, SOFTCAP=False, K_Z=True, V_Z=True, DT=tl.float16, K_OFF=1024, V_OFF=1024, K_BITS=2, K_P=8,
         V_BITS=4, V_P=4, K_WC=8, V_WC=4, PAGE_ABS=False)
triton.compile(ASTSource(K["decode"], sig("decode", dict(p, q_ptr="*fp16"), ("sm_scale", "softcap", "K_HALF", "V_HALF"), z), z),
               target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 2})
# KVarN key tiles of 16 tokens: spread over paged cells (16 halves a token), then rows of their own; unpacked (BN 32
# over two key tiles), then in classes (the scale folded into the query's classes)
for paged, mw, kp, bn, tile in ((True, 16, 0, 32, 16), (False, 128, 0, 32, 16), (True, 16, 8, 16, 16), (False, 128, 8, 16, 16),
                                 (False, 128, 8, 32, 128)):  # the last: the scaled query held across 4 tiles of tokens
    consts.update(K_TILE=tile, KT_MW=mw, K_P=kp, K_WC=kp, K_BITS=2, PAGED=paged, PAGE_ABS=paged, BN=bn)
    triton.compile(ASTSource(K["decode"], sig("decode", p, ("sm_scale", "softcap", "K_HALF", "V_HALF"), consts), consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
# KVarN value tiles (the kvarn method) beside key tiles in classes, as the kvarn method launches at d 128 (two warps):
# the codes' dot, then one row of channel scales a tile of tokens
vtc = dict(consts, V_TILE=16, V_BITS=2, V_G=128, V_Z=True, V_P=0, V_WC=0, V_OFF=128, BN=16, K_TILE=16, KT_MW=128, K_P=8, K_WC=8,
           PAGED=False, PAGE_ABS=False, DT=tl.bfloat16, K_OFF=128)
triton.compile(ASTSource(K["decode"], sig("decode", dict(p, q_ptr="*bf16"), ("sm_scale", "softcap", "K_HALF", "V_HALF"), vtc), vtc),
               target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 2})
# the same in the vLLM plugin's cells: both tiles' halves spread over the cells (key scale and zero 16 halves a cell,
# value channel scales 8), through the block table
vtp = dict(vtc, PAGED=True, PAGE_ABS=True, KT_MW=16, VT_MW=8)
triton.compile(ASTSource(K["decode"], sig("decode", dict(p, q_ptr="*bf16"), ("sm_scale", "softcap", "K_HALF", "V_HALF"), vtp), vtp),
               target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 2})
# the plugin's windows read in place from its pool of copies (pages of 8 tokens), beside key tiles and per-token codes;
# each tile of tokens' block read once (DecodeTuning.page_tiles: blocks of 16 and 64 tokens), and each token's
for fpu in (dict(vtp, FP_UNIT=8, ONE_PAGE=True), dict(consts, FP_UNIT=8, PAGED=True, PAGE_ABS=True, K_TILE=0, KT_MW=128, BN=32),
            dict(consts, FP_UNIT=8, PAGED=True, PAGE_ABS=True, K_TILE=0, KT_MW=128, BN=32, PAGE=64, ONE_PAGE=True)):
    triton.compile(ASTSource(K["decode"], sig("decode", dict(p, q_ptr="*bf16"), ("sm_scale", "softcap", "K_HALF", "V_HALF"), fpu), fpu),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "num_stages": 2})
# keys centered on their rotating mean (+rmean): over key tiles in classes, then per-token codes in classes; each row
# from its own columns (a left-padded batch's ragged rows), under a mask over the parts side by side
for kt, bn in ((16, 16), (0, 32)):
    consts.update(K_TILE=kt, KT_MW=128, K_P=8, K_WC=8, K_BITS=2, PAGED=False, PAGE_ABS=False, BN=bn, RMEAN=True, STARTS=True)
    triton.compile(ASTSource(K["decode"], sig("decode", p, ("sm_scale", "softcap", "K_HALF", "V_HALF"), consts), consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 2})
consts = dict(D=128, SP=16, HAS_SINKS=True, OUT_BF16=True)
triton.compile(ASTSource(K["merge"], sig("merge", {"out_ptr": "*bf16"}, (), consts), consts), target=GPUTarget("cuda", 90, 32))
print("compiled", "ptx" in k.asm)
"""


def test_launcher_sees_the_constexpr_parameters():
    """The compiled launcher specializes exactly the parameters annotated ``tl.constexpr`` (the interpreter and an
    explicit compile do not ask it, so a kernel whose annotations were lost runs here and fails only on a GPU)."""
    import inspect
    import re

    from triton.runtime.jit import JITFunction

    for name, kernel in tk._kernels().items():
        launcher = JITFunction(kernel.fn)  # what triton.jit builds on a GPU (the interpreter's wraps the same fn)
        annotated = [p for p, a in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(a.annotation)]
        assert annotated and [launcher.arg_names[i] for i in launcher.constexprs] == annotated, name
        source = inspect.getsource(kernel.fn)
        assert all(f"{p}: tl.constexpr" in source for p in annotated), name
        params = re.search(r"def \w+\((.*?)\):[ \t]*\n", source, re.S).group(1)
        assert len(annotated) == params.count("tl.constexpr"), name  # none of the source's lost


@pytest.mark.slow
def test_kernels_compile_for_cuda():
    """The compiled path, which the interpreter does not exercise (Triton's front end, shapes the tensor-core dot
    accepts, name resolution), without a GPU: the store (with error feedback too, fused multiply-adds off; one-byte
    steps), the KVarN
    key tiles', decode (two tunings, one-byte key steps; codes in classes,
    in words of 16 bits, three bytes and one, whose inline PTX ptxas assembles, two codes a word a class at head_dim
    64; rows from their own columns; the last split merging its pair's, its atomic after a barrier that follows the
    state's stores; KVarN's value tiles; the windows read from a pool of pages; a tile of tokens' block read once) and
    merge kernels compile for sm_90."""
    res = _compiling(COMPILE)
    assert res.returncode == 0 and "compiled True" in res.stdout, res.stderr[-3000:]


def _compiling(script: str, *args: str):
    """``script`` run in its own process with ``args``, where triton compiles instead of interpreting (this one
    imported it under the interpreter: tests/conftest.py); skips where triton ships no CUDA toolchain."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(tk.__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300)
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("this triton install has no CUDA toolchain (ptxas) to compile with")
    return res


def test_equal_lengths_are_uploaded_once():
    """A decode call's host ``lengths`` are the same at every layer of a step: on a GPU they are uploaded once and
    the upload kept (``kept_on``, by device, stream, dtype, shape and values), not staged and copied at every layer;
    other values, dtypes and streams get their own, and nothing waits for the device (fake CUDA tensors:
    tests/fake_cuda.py)."""
    from types import SimpleNamespace

    import fake_cuda

    try:
        with fake_cuda.active():
            a = tk.kept_on(torch.tensor([[3, 40, 5]]).expand(4, 3), "cuda", torch.int32)
            b = tk.kept_on(torch.tensor([[3, 40, 5]] * 4), torch.device("cuda"), torch.int32)
            c = tk.kept_on(torch.tensor([[3, 41, 5]] * 4), "cuda", torch.int32)
            assert a is b and c is not a and fake_cuda.is_fake(a) and a.dtype == torch.int32 and a.is_contiguous()
            assert fake_cuda.host(c).tolist() == [[3, 41, 5]] * 4 and fake_cuda.host(a).tolist() == [[3, 40, 5]] * 4
            assert tk.kept_on(torch.tensor([[3, 40, 5]] * 4), "cuda", torch.int64) is not a  # another dtype
            torch.cuda.current_stream = lambda device=None: SimpleNamespace(cuda_stream=7)  # (fake_cuda restores it)
            assert tk.kept_on(torch.tensor([[3, 40, 5]] * 4), "cuda", torch.int32) is not a  # another stream's own
            assert not fake_cuda.errors() and not fake_cuda.syncs(), (fake_cuda.errors(), fake_cuda.syncs())
        assert not tk._KEPT  # the fake uploads are forgotten with the fake device
    finally:
        fake_cuda.reset()
    cpu = torch.tensor([[3, 40, 5]])
    assert tk.kept_on(cpu, "cpu", torch.int32).tolist() == [[3, 40, 5]] and not tk._KEPT  # off a GPU: a plain copy


@pytest.mark.parametrize("rmean", [False, True])
def test_left_padded_decode_through_the_kernel(rmean):
    """A left-padded batch's decode step through the decode kernel: one mask per row over [sink, packed middle,
    recent], whose columns some rows read in full precision and others quantized (so some sit in two parts), gives the
    emulation's attention, which builds both versions of every column in full precision."""
    from conftest import padded_decode_view

    model = tiny_model("llama").to(DEVICE)
    cfg = QuantConfig(2, 2, "affine", windows=WindowConfig(4, 8, 4))
    d = model.config.head_dim
    with padded_decode_view(model, cfg, (120, 60, 100), rmean) as (view, q, allowed):
        assert view.mid_len > 80 and view.sink_k.shape[2] == 4 and view.mid_start == 4  # the rows' own sinks
        ref = view._attend_padded(q, allowed, d**-0.5, None)
        tk.reset_calls()
        with decode_mod.triton_enabled(True):
            out = view._decode_padded(q, allowed, d**-0.5, None)
        assert tk.calls().get("decode") == 1
        assert ((out - ref).norm() / ref.norm()) < 1e-4
        held = view._held()
        assert view.mid_start == 4 and held[:, 1, 0].tolist() == [0, 60, 20]  # each row's middle from its own p + S_sink
        _poison_unheld(view, [(view.sink_k, view.sink_v), (view.mid["k"], view.mid["v"]), (view.win_k, view.win_v)], held)
        with decode_mod.triton_enabled(True):
            assert torch.equal(view._decode_padded(q, allowed, d**-0.5, None), out)


def _poison_unheld(view, parts, held):
    """NaN in every column of ``parts`` (pairs of keys and values: full precision, or a middle's storage) that a row
    does not hold: a step that reads only what its rows hold gives the same output. A middle's float tensors per
    token (per-token codes' scale and offset; KVarN key tiles' s_fold, value tiles' scale and zero) by its columns,
    its tensors per tile (key tiles' scale and zero, value tiles' s_fold) by the tiles outside the row's."""
    for b in range(held.shape[0]):
        for (a, e), pair in zip(held[b].tolist(), parts):
            for side, part in zip(("key", "value"), pair):
                tiles = []
                if not isinstance(part, dict):
                    tokens = [part]
                elif "s_fold" in part:  # KVarN tiles of T tokens
                    per_token = ("s_fold",) if side == "key" else ("scale", "zero")
                    tokens = [part[k].flatten(2, 3) for k in per_token]
                    T = part[per_token[0]].shape[-1]
                    tiles = [t for k, t in part.items() if k not in per_token and t.is_floating_point()]
                else:
                    tokens = [t for k, t in part.items() if k in ("scale", "offset") and t.is_floating_point()]
                for t in tokens:
                    t[b, :, :a], t[b, :, e:] = float("nan"), float("nan")
                for t in tiles:
                    t[b, :, : a // T], t[b, :, -(-e // T):] = float("nan"), float("nan")


@pytest.mark.parametrize("rmean,values", [(False, "quest"), (True, "quest"), (False, "kvarn")])
def test_ragged_rows_of_key_tiles_decode_in_one_kernel_call(rmean, values):
    """A left-padded batch under key tiles (``auto``'s cells: KVarN tiles for the keys, QuEST values; ``+rmean``; the
    ``kvarn`` method's tiles on both sides) keeps each row's tokens from column 0 (ragged rows, middles of different
    lengths): its decode step is one kernel call over the whole batch (row by row it was one per row), equal to the
    PyTorch path of the same step (itself checked against the rows alone:
    tests/test_cache.py::test_left_padded_layer_equals_its_rows_alone)."""
    from conftest import padded_decode_view

    from wushkv.views import RaggedView

    model = tiny_model("llama").to(DEVICE)
    cfg = QuantConfig(2, 2, values, key_quantizer="kvarn", windows=WindowConfig(4, 8, 16))
    d = model.config.head_dim
    attn = model.model.layers[0].self_attn
    with padded_decode_view(model, cfg, (120, 60, 100), rmean) as (view, q, allowed):
        assert isinstance(view, RaggedView) and view.rs[:, 4].tolist() == [96, 48, 80]  # each row's own middle
        with decode_mod.triton_enabled(False):
            ref = view.attend(attn, q, allowed, d**-0.5, None)
        tk.reset_calls()
        with decode_mod.triton_enabled(True):
            out = view.attend(attn, q, allowed, d**-0.5, None)
        assert tk.calls().get("decode") == 1
        assert ((out - ref).norm() / ref.norm()) < 1e-4
        _poison_unheld(view, [(view.sink_k, view.sink_v), (view.mid["k"], view.mid["v"]), (view.rec_k, view.rec_v)],
                       view._held())
        with decode_mod.triton_enabled(True):
            assert torch.equal(view.attend(attn, q, allowed, d**-0.5, None), out)


# Every (bits, codes a word) the decode kernel reads in classes (16-bit words: 1/16, 2/8, 4/4; three-byte words: 3/8;
# bytes: 1/8, 2/4), each code S of the word, as bfloat16 (OFF 128) and float16 (OFF 1024) operands: 96 cases
WORD_CASES = [(bits, wc, s, off) for bits, wc in ((1, 16), (2, 8), (4, 4), (3, 8), (1, 8), (2, 4))
              for s in range(wc) for off in (128, 1024)]
WORD_TYPES = {8: ("*u8", torch.uint8, np.uint8), 16: ("*i16", torch.int16, np.int16), 24: ("*i32", torch.int32, np.int32)}
WORD_PTX = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from wushkv import triton_kernels as tk
kernel, out = tk._kernels()["word_codes"], {}
for bits, wc, s, off in json.loads(sys.argv[1]):
    consts = dict(S=s, P=wc, BITS=bits, OFF=off, EMU=False, BN=32, K=16)
    sig = {"w_ptr": {8: "*u8", 16: "*i16", 24: "*i32"}[wc * bits], "o_ptr": "*i16"} | dict.fromkeys(consts, "constexpr")
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    k = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    out[f"{bits} {wc} {s} {off}"] = k.asm["ptx"]
json.dump(out, open(sys.argv[2], "w"))
"""


def _code_words(bits: int, wc: int) -> np.ndarray:
    """(T, 512) words: every 16-bit value; every byte twice, then random bytes; random 32-bit values for three-byte
    words (their top byte, which holds no code, random too) after edge patterns."""
    rng = np.random.default_rng(bits * 100 + wc)
    if wc * bits == 16:
        return rng.permutation(np.arange(65536, dtype=np.uint32)).astype(np.uint16).view(np.int16).reshape(128, 512)
    if wc * bits == 8:
        return np.concatenate([rng.permutation(np.tile(np.arange(256), 2))[None], rng.integers(0, 256, (31, 512))]).astype(np.uint8)
    w = rng.integers(0, 1 << 32, (128, 512), dtype=np.uint64)
    w[0, :8] = [0, 0xFFFFFF, 0x555555, 0xAAAAAA, 0xFFFFFFFF, 0xFF000000, 0x00FFFF00, 0x0000FF]
    return w.astype(np.uint32).view(np.int32)


def _operand_bits(w: np.ndarray, bits: int, wc: int, s: int, off: int) -> np.ndarray:
    """What _word_codes documents, per word: code s (bits [s·bits, (s+1)·bits)) left at bit SHL of a 16-bit float
    whose exponent makes it c + OFF/2^SHL, SHL > 0 only in 16-bit words where the code would leave the mantissa."""
    sh, mant = s * bits, 7 if off == 128 else 10
    shl = sh % ((mant // bits) * bits) if wc * bits == 16 else 0
    base = (0x4300 if off == 128 else 0x6400) - shl * (0x80 if off == 128 else 0x400)
    return ((((w.astype(np.int64) & 0xFFFFFFFF) >> (sh - shl)) & (((1 << bits) - 1) << shl)) | base).astype(np.uint16)


def test_inline_ptx_builds_the_operands_the_interpreter_does(tmp_path):
    """The decode kernel builds its tensor-core operands from code words with inline PTX (``_word_codes``), which the
    interpreter never runs (it builds the same bits in plain Triton). Each of the 96 cases the kernel reads in classes,
    compiled for sm_90 (``word_codes``, EMU off) and run lane by lane through tests/ptx_emu.py over every 16-bit word,
    every byte and 65k random three-byte words, gives bit for bit the documented operand (code + OFF/2^SHL) and what
    the interpreter's branch gives on the same words (on a GPU: the compiled kernel on the device). Triton's order
    of a thread's values in a packed register (the first in the low bits) is part of what this checks; a wrong byte
    selector in the PTX fails it (checked below: the emulator catches one)."""
    import json

    import ptx_emu

    res = _compiling(WORD_PTX, json.dumps(WORD_CASES), str(tmp_path / "ptx.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    ptx = json.loads((tmp_path / "ptx.json").read_text())
    kernel = tk._kernels()["word_codes"]

    def emulate(text: str, w: np.ndarray) -> np.ndarray:
        T, n = w.shape  # each row one program of 32 × 16 words
        mem = {0x10000: np.ascontiguousarray(w).view(np.uint8).reshape(T, -1).copy(), 0x100000: np.zeros((T, 2 * n), np.uint8)}
        ops = ptx_emu.Warp(text, [0x10000, 0x100000], mem).run()
        assert "lop3.b32" in ops  # the inline assembly ran, not something else
        return mem[0x100000].view(np.uint16).reshape(T, n)

    for bits, wc, s, off in WORD_CASES:
        w = _code_words(bits, wc)
        want = _operand_bits(w, bits, wc, s, off)
        got = emulate(ptx[f"{bits} {wc} {s} {off}"], w)
        x = torch.from_numpy(w.reshape(-1).copy()).to(DEVICE)
        o = torch.empty(x.numel(), dtype=torch.int16, device=DEVICE)
        BN = x.numel() // 16 if DEVICE == "cpu" else 32  # the interpreter: one program (each costs ~ms); a GPU: many
        kernel[(x.numel() // (16 * BN),)](x, o, S=s, P=wc, BITS=bits, OFF=off, EMU=DEVICE == "cpu", BN=BN, K=16)
        ran = o.cpu().numpy().view(np.uint16).reshape(w.shape)
        case = f"{bits} bits, {wc} codes a word, code {s}, OFF {off}"
        assert (ran == want).all(), f"{'the interpreter' if DEVICE == 'cpu' else 'the GPU'}: {case}"
        bad = np.argwhere(got != want)
        assert not len(bad), f"inline PTX: {case}, word {w[tuple(bad[0])]:#x}: {got[tuple(bad[0])]:#06x} != {want[tuple(bad[0])]:#06x}"
    # the check has teeth: the first code of a three-byte word from the wrong half of the pair fails it
    text = ptx["3 8 0 128"]
    assert "0x5410" in text or "21520" in text
    swapped = text.replace("0x5410", "0x1054").replace(", 21520;", ", 4180;")
    w = _code_words(3, 8)
    assert (emulate(swapped, w) != _operand_bits(w, 3, 8, 0, 128)).mean() > 0.5
