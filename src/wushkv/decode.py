"""Decode attention that reads the packed cache directly (the performance path of one new token).

With per-token groups, a stored key is ``k̂_j = s_j·c_j + z_j`` per group (codes ``c_j`` in
``[0, 2^b)``, step/scale ``s_j``, offset ``z_j``), so for a query ``q`` (per group ``g``)::

    scores_j = Σ_g s_jg·(c_jg · q_g) + z_jg·Σ q_g                 (never forming k̂)
    out      = Σ_j p_j v̂_j = Σ_g [ C_gᵀ (p ⊙ s_g) + (Σ_j p_j z_jg)·1 ]

The quantized middle is read block by block (``block`` tokens at a time): each block's codes are
expanded to floats through a lookup table (one ``embedding`` gather turns a packed 16-bit word into
its ``16/b`` codes), used, and dropped, so no step holds a full-precision copy of the cache; the peak is
one block. Scores of the sink, every block and the recent buffer go through one softmax; the output
sums their parts. Codecs without per-token groups (KVarN tiles of values, KIVI's and KVarN's key tiles,
off the CPU kernels) are dequantized block by block instead — the same memory bound, a slower inner
loop. Keys quantized centered on their rotating mean (``+rmean``: k̂ = decoded codes + T c_t) are read
from their codes too: the centers' share of the scores, q·T c_t, is a function of the position evaluated
per block (:class:`wushkv.layer.KeyCenters`).

On CPU, the code-domain products ``C q`` and ``Cᵀ w`` run in fused C++ kernels (:mod:`wushkv._ext`,
built on first use) that read each packed byte once, unpack it in vector registers and never expand the
codes; KVarN's key tiles (``auto``'s keys) and KIVI's per-channel keys (s_t = 1) go through them too, with one set
of channel-scaled queries per tile (``k̂[t, c] = s_t·(scale_c·code + zero_c)``, so
``q·k̂_t = s_t·((q ⊙ scale)·code_t + q·zero)``), and in the fused call below KVarN's value tiles, per-token rows
times each tile's channel scales (``v̂[t, c] = s_chan,c·(scale_t·code + zero_t)``); elsewhere,
or where they cannot be built, the pure-PyTorch path above runs (same results). Where a layer's parts are
[sink, middle, recent] with such codes (or a full-precision middle), the whole decode is one kernel call instead
(``parts_decode``, :func:`_cpu_decode`): scores, softmax and values per work item, merged with an online softmax, as
the Triton decode does on a GPU; the per-part path stays for the rest (:func:`fused_enabled`).
On CUDA, where triton imports, a cache of per-token codecs (sink, packed middle, recent) is read by the split-KV
Triton kernel of :mod:`wushkv.triton_kernels` instead, and :func:`encode_block` writes the cache's flushed blocks
through its store kernel (:func:`triton_enabled` forces both on or off).
:func:`dequantize_then_attend` is the reference they are all tested against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import torch

from .attention import reference_attention
from .codecs import ChannelCodec, KVarNCodec, TokenCodec
from .quantizers import unpack

DEFAULT_BLOCK = 4096
_EXT = None  # the compiled kernels once looked up (False: unavailable)
USE_KERNELS = True  # the fused CPU kernels of wushkv._ext where available (kernels_enabled(False) switches them off)
USE_FUSED = True  # a layer's CPU decode in one parts_decode call where it applies (fused_enabled(False): part by part)
USE_TRITON: bool | None = None  # None: the Triton decode on CUDA tensors; True: on any device; False: never
# decode_attention's PyTorch path reads ragged rows one by one where that saves more than this many columns a row: a
# row's own call costs about as much as reading 2-3k more columns in the batch (SmolLM2's shape, 2 CPU threads: at
# 4096 tokens, rows padded over 3/4 of it read alone took 1.2x the batched time, at 16384 0.77x; performance.md)
ROW_COLUMNS = 2048
_TABLES: dict = {}


@contextlib.contextmanager
def rows_alone_over(columns: int):
    """Within the block, :func:`decode_attention`'s PyTorch path reads ragged rows one by one where that saves more
    than ``columns`` a row (and 20% of the batch's), instead of :data:`ROW_COLUMNS`: 0 reads them alone wherever 20%
    is saved (tests of that path on small shapes); the previous value comes back afterwards, also on error."""
    global ROW_COLUMNS
    if columns < 0:
        raise ValueError(f"columns must be >= 0, got {columns}")
    previous, ROW_COLUMNS = ROW_COLUMNS, int(columns)
    try:
        yield
    finally:
        ROW_COLUMNS = previous


@contextlib.contextmanager
def kernels_enabled(enabled: bool):
    """Within the block, use (True) or bypass (False) the fused CPU kernels, e.g. to compare both paths
    on the same inputs; the previous choice comes back afterwards, also on error."""
    global USE_KERNELS
    previous, USE_KERNELS = USE_KERNELS, bool(enabled)
    try:
        yield
    finally:
        USE_KERNELS = previous


@contextlib.contextmanager
def fused_enabled(enabled: bool):
    """Within the block, decode a layer on the CPU in one fused kernel call where it applies (True, the default:
    ``parts_decode``, :func:`decode_attention`) or part by part, the code-domain products in the kernels and the rest
    in PyTorch (False: the path before session 66, which the cases the fused call does not take still run), e.g. to
    time or test both on the same inputs; the previous choice comes back afterwards, also on error."""
    global USE_FUSED
    previous, USE_FUSED = USE_FUSED, bool(enabled)
    try:
        yield
    finally:
        USE_FUSED = previous


@contextlib.contextmanager
def triton_enabled(enabled: bool | None):
    """Within the block, decode and store (:func:`encode_block`) through the Triton kernels (True: on every device,
    CPU tensors under Triton's interpreter, which needs ``TRITON_INTERPRET=1`` before triton is imported; an error
    where triton is missing), never (False), or on CUDA tensors where triton imports (None, the default); the
    previous choice comes back afterwards, also on error. Caches the kernels do not cover (float64; for store KIVI's
    per-channel keys and the clip search) keep the PyTorch path."""
    global USE_TRITON
    previous, USE_TRITON = USE_TRITON, enabled
    try:
        yield
    finally:
        USE_TRITON = previous


def triton_for(device):
    """:mod:`wushkv.triton_kernels` where the switch sends tensors on ``device`` to it and triton imports, else None
    (an error under ``triton_enabled(True)`` where triton is missing)."""
    if USE_TRITON is False or (USE_TRITON is None and device.type != "cuda"):
        return None
    from . import triton_kernels as tk

    if not tk.available():
        if USE_TRITON:
            raise RuntimeError("triton_enabled(True) needs triton, which is not installed")
        return None
    return tk


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def encode_block(codec, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``codec.encode(x)`` of a block x (B, Hkv, N, d) entering the packed middle: through the Triton store kernel
    where the switch sends x's device there and the kernel covers the codec (a :class:`TokenCodec`, with or without
    error feedback, with one-byte (E5M3) steps or not, without clip search, a head_dim and group size the kernels take, x in
    float16/bfloat16/float32), else through the codec's PyTorch path. The same storage either way: codes uint8 (B, Hkv, N, ⌈d·b/8⌉), scale (and offset,
    affine) (B, Hkv, N, d/G) in the codec's metadata dtype. KVarN tiles (:class:`KVarNCodec`: keys with or without
    error feedback, values; a power-of-two head_dim and tile) go through the tile kernel
    (:func:`wushkv.triton_kernels.kvarn_key_tiles`, :func:`~wushkv.triton_kernels.kvarn_value_tiles`, one program a
    tile): codes, scale, zero and s_fold as the codec stores them."""
    if isinstance(codec, KVarNCodec):
        tk = triton_for(x.device) if x.dtype in _TRITON_DTYPES else None
        d, G, H = codec.d, codec.block, x.shape[1]
        if (tk is None or d < 8 or d & (d - 1) or G & (G - 1)
                or (codec.feedback is not None and tuple(codec.feedback.shape) != (H, d, d))):
            return codec.encode(x)
        if codec.kind == "value":
            return tk.kvarn_value_tiles(x, codec.bits, G, codec.clip)
        return tk.kvarn_key_tiles(x, codec.bits, G, codec.clip, codec.feedback)
    covered = isinstance(codec, TokenCodec) and x.dtype in _TRITON_DTYPES
    tk = triton_for(x.device) if covered else None
    if tk is None:
        return codec.encode(x)
    try:  # (one-byte steps: QuEST's, rounded to E5M3 in the kernel, the codes on the rounded step)
        fmt = dataclasses.replace(tk.TokenFormat.of(codec.quantizer, codec.d), step_byte=codec.step_byte)
    except ValueError:  # the clip search, a head_dim or group size the kernel does not take
        return codec.encode(x)
    B, H, N, _ = x.shape
    codes = torch.empty(B, H, N, fmt.nbytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(B, H, N, fmt.ngroups, dtype=torch.uint8 if fmt.step_byte else codec.meta_dtype, device=x.device)
    offset = None if fmt.quest else torch.empty_like(scale)
    tk.store_contiguous(x, codes, scale, offset, 0, fmt, feedback=codec.feedback)
    return {"codes": codes, "scale": scale} | ({} if offset is None else {"offset": offset})


def read_format(tk, codec: TokenCodec):
    """The :class:`wushkv.triton_kernels.TokenFormat` the decode kernel reads ``codec``'s storage in, or None where the
    kernels do not take its head_dim or group size."""
    G = codec.d if codec.quantizer.group_size is None else codec.quantizer.group_size
    return _token_format(tk, codec.bits, codec.d, G, codec.symmetric, codec.step_byte)


@functools.lru_cache(maxsize=64)
def _token_format(tk, bits: int, d: int, G: int, quest: bool, step_byte: bool):
    """:func:`read_format`'s format, made (and checked) once per kind of codec: it is asked at every layer's decode.
    TokenFormat is frozen, so every caller may share it."""
    try:
        return tk.TokenFormat(bits, d, G, quest, step_byte=step_byte)
    except ValueError:
        return None


def tile_format(tk, codec: KVarNCodec | ChannelCodec):
    """The :class:`wushkv.triton_kernels.TileFormat` the decode kernel reads tiles in (KVarN's key and value tiles;
    KIVI's per-channel keys, :func:`_key_tiles`), or None where the kernels do not take them (a head_dim or tile that
    is not a power of two)."""
    try:
        return tk.TileFormat(codec.bits, codec.d, codec.block)
    except ValueError:
        return None


def _triton_decode(query, parts_k, parts_v, allowed, scaling, softcap, sinks, held=None):
    """The Triton decode (B, 1, Hq, d) where it applies: [sink, packed middle, recent] with per-token codecs on
    both sides (or key tiles: ``auto``'s KVarN tiles, KIVI's per-channel keys; KVarN's value tiles; keys centered on
    their rotating mean, ``+rmean``, from head_dim 32), a float16/bfloat16/float32 query, a head_dim the kernels take;
    else None (the PyTorch path).
    ``held`` (:func:`decode_attention`): each row reads its own columns of each part (the kernel's ``starts``)."""
    if query.dtype not in _TRITON_DTYPES or len(parts_k) != 3 or len(parts_v) != 3:
        return None
    (sk, mk, rk), (sv, mv, rv) = parts_k, parts_v
    if not all(torch.is_tensor(t) for t in (sk, rk, sv, rv)) or torch.is_tensor(mk) or torch.is_tensor(mv):
        return None
    tk = triton_for(query.device)
    if tk is None:
        return None
    B, Hq, _, d = query.shape
    packed = []
    H = sk.shape[1]
    if len(mk) > 3 and d < 32:  # keys centered on their rotating mean: the kernel's two dots need d/2 >= 16
        return None
    for side, (codec, store, n, *_) in zip(("key", "value"), (mk, mv)):
        if isinstance(codec, KVarNCodec) or (side == "key" and isinstance(codec, ChannelCodec)):  # tiles
            fmt = tile_format(tk, codec)
            if fmt is None:
                return None
            if not n:  # nothing stored yet: empty tensors (never read); a key tile's scale and zero are per channel and
                # its s_fold per token, a value tile's the other way round
                rows, cols = (fmt.tile, d) if side == "value" else (d, fmt.tile)
                half = dict(dtype=torch.float16, device=sk.device)
                store = {"codes": sk.new_empty(B, H, 0, fmt.nbytes, dtype=torch.uint8), "s_fold": torch.empty(B, H, 0, cols, **half),
                         "scale": torch.empty(B, H, 0, rows, **half), "zero": torch.empty(B, H, 0, rows, **half)}
                store["offset"] = store["zero"]
            if side == "key":  # KVarN's, KIVI's: s_tok as a per-token scale
                s_tok, scale, zero = _key_tiles(codec, store, store["codes"].shape[2])
                packed.append(tk.Packed(fmt, store["codes"], s_tok[..., None], tile_scale=scale, tile_zero=zero))
            else:  # KVarN's value tiles: per-token scale and zero, each tile's channel scales
                scale, zero, s_chan = _value_tiles(codec, store)
                packed.append(tk.Packed(fmt, store["codes"], scale[..., None], zero[..., None], tile_scale=s_chan))
            continue
        if not isinstance(codec, TokenCodec):
            return None
        fmt = read_format(tk, codec)
        if fmt is None:
            return None
        if not n:  # nothing stored yet: empty tensors (never read)
            store = {"codes": sk.new_empty(B, sk.shape[1], 0, fmt.nbytes, dtype=torch.uint8),
                     "scale": sk.new_empty(B, sk.shape[1], 0, fmt.ngroups, dtype=torch.uint8 if fmt.step_byte else sk.dtype)}
        packed.append(tk.Packed(fmt, store["codes"], store["scale"], store.get("offset")))
    starts = None
    if held is None:
        lengths = _part_lengths(B, sk.shape[2], mk[2], rk.shape[2])
    else:  # ragged rows: row b's columns [held[b, i, 0], held[b, i, 1]) of part i, the mask over all the parts' columns
        starts, lengths = held[:, :, 0], held[:, :, 1] - held[:, :, 0]
        n_all = sk.shape[2] + mk[2] + rk.shape[2]
        if allowed is not None and allowed.shape[-1] < n_all:  # it masks the last S columns: the earlier are hidden
            allowed = torch.cat([allowed.new_zeros(*allowed.shape[:-1], n_all - allowed.shape[-1]), allowed], -1)
    key_bias = None
    if len(mk) > 3:  # keys centered on their rotating mean (+rmean): the centers' share of the scores in the kernel
        terms, first, theta = mk[3].kernel_inputs(query[:, :, 0].reshape(B, H, Hq // H, d))
        key_bias = tk.KeyBias(terms.reshape(B, Hq, d), first, theta)
    out = tk.decode(query.squeeze(2), lengths, sk, sv, packed[0], packed[1], rk, rv, scaling, softcap=softcap, sinks=sinks,
                    allowed=None if allowed is None else allowed.reshape(B, -1), key_bias=key_bias, starts=starts)
    return out.view(B, 1, Hq, d)


@functools.lru_cache(maxsize=64)
def _part_lengths(B: int, sink: int, mid: int, recent: int) -> torch.Tensor:
    """(B, 3) int32 on the host: every row's sink, middle and recent lengths, as the kernel reads them. Made once a
    step (every full-attention layer asks for the same), not once a layer; read only (the kernel's argument, or
    copied to the device)."""
    return torch.tensor([[sink, mid, recent]], dtype=torch.int32).expand(B, 3).contiguous()


def _code_table(bits: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(2^width, width/bits): the codes packed in each ``width``-bit word (low bits first, as
    :func:`wushkv.quantizers.pack` lays them out; little-endian, so a 16-bit word is two bytes in order)."""
    key = (bits, width, dtype, str(device))
    if key not in _TABLES:
        per, mask = width // bits, (1 << bits) - 1
        v = torch.arange(2**width).unsqueeze(1)
        _TABLES[key] = ((v >> (bits * torch.arange(per))) & mask).to(dtype=dtype, device=device)
    return _TABLES[key]


def codes_as_float(packed: torch.Tensor, bits: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed uint8 (..., ⌈d·b/8⌉) -> codes as ``dtype`` (..., d).

    For 1/2/4 bits one ``embedding`` gather of a word table expands every 16-bit word (or byte, for odd
    row lengths) into its codes; 3 bits go through :func:`wushkv.quantizers.unpack`.
    """
    if bits == 8:
        return packed.to(dtype)
    if 8 % bits:
        return unpack(packed, bits, d).to(dtype)
    even = packed.shape[-1] % 2 == 0 and packed.stride(-1) == 1 and packed.storage_offset() % 2 == 0
    if even and all(st % 2 == 0 for st in packed.stride()[:-1]) and sys.byteorder == "little":
        idx, table = packed.view(torch.int16).int() & 0xFFFF, _code_table(bits, 16, dtype, packed.device)
    else:
        idx, table = packed.int(), _code_table(bits, 8, dtype, packed.device)
    return torch.nn.functional.embedding(idx, table).flatten(-2)[..., :d]


def _slices(store: dict, n: int, a: int, b: int) -> dict:
    """Tokens [a, b) of a codec store holding n tokens (stores may index blocks of tokens along dim 2)."""
    return {k: t[:, :, t.shape[2] * a // n : t.shape[2] * b // n] for k, t in store.items()}


def _fast(codec, dtype) -> bool:
    """The code-domain path; float64 runs dequantize exactly as the codec does (in float32), so they
    reproduce the single-pass emulation bit for bit and the exactness tests stay exact."""
    return isinstance(codec, TokenCodec) and dtype != torch.float64


def _kernels(codec, store, ng: int = 1):
    """The fused CPU kernels where they apply (CPU, 1/2/3/4/8 bits; ``ng`` groups a token, each a whole number of the
    units the kernels read, :func:`_group_bytes`), else None."""
    if not USE_KERNELS or not _readable(codec.bits, store["codes"]) or store["codes"].device.type != "cpu":
        return None
    if ng != 1 and _group_bytes(codec.bits, codec.d, ng) is None:
        return None
    return _compiled()


def _group_bytes(bits: int, d: int, ng: int) -> int | None:
    """Bytes of one of a token's ``ng`` groups in its packed row, where each group is whole units of the kernels (a
    byte; 3 bytes at 3 bits), so that a group's codes are a slice of the row's last dim; else None."""
    gs = d // ng
    unit = 24 if bits == 3 else 8
    return gs * bits // 8 if (gs * bits) % unit == 0 else None


def _readable(bits: int, codes: torch.Tensor) -> bool:
    """Whether the C++ kernels read these packed rows: 1/2/4/8 bits, or 3 bits in whole 3-byte units of 8 codes
    (head_dim a multiple of 8), the last dim dense."""
    return (bits in (1, 2, 4, 8) or (bits == 3 and codes.shape[-1] % 3 == 0)) and codes.stride(-1) == 1


def _compiled():
    """The compiled kernels of :mod:`wushkv._ext` (built or loaded on first use), or None where they cannot be built."""
    global _EXT
    if _EXT is None:
        from ._ext import kernels

        _EXT = kernels() or False
    return _EXT or None


# parts_decode's "not given" (float32, bool, int64; never written): a layer's decode is ~0.1 ms of Python and ATen
# calls, of which making these at every call was a tenth
_NONE = (torch.empty(0), torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.int64))


def _cpu_mid(codec, store, n, side: str):
    """One side of the middle as ``parts_decode`` reads it: (tensors, bits, tile, half), tensors [codes, scale,
    offset or empty] (per-token codes; scale and offset (B, H, N, groups)), [codes, s_tok, tile scale, tile zero]
    (key tiles) or [codes, scale, zero, channel scale] (KVarN's value tiles, :func:`_value_tiles`); ([], 0, 0, 0) for
    an empty middle; None where the kernel does not read the codec (other quantizers, 3 bits of a head_dim not a
    multiple of 8, groups that are not whole units of the row)."""
    if not n:
        return [], 0, 0, 0.0
    if not _readable(codec.bits, store["codes"]):
        return None
    tiles = _key_tiles(codec, store, n) if side == "key" else _value_tiles(codec, store)
    if tiles is not None:  # KVarN's key or value tiles, KIVI's per-channel keys
        return [store["codes"], *tiles], codec.bits, codec.block, 0.0
    ng = store["scale"].shape[-1]
    if isinstance(codec, TokenCodec) and (ng == 1 or _group_bytes(codec.bits, codec.d, ng) is not None):
        return [store["codes"], store["scale"], store.get("offset", _NONE[0])], codec.bits, 0, codec._half
    return None


def _cpu_decode(query, parts_k, parts_v, allowed, scaling, softcap, sinks, held=None):
    """The fused CPU decode (B, 1, Hq, d) of [sink, middle, recent] in one kernel call (``parts_decode``: scores,
    softmax and the values' sum per work item, an online-softmax merge, the middle read from its codes), where it
    applies: the kernels built, a float16/bfloat16/float32 query on the CPU, each side's middle per-token codes
    (QuEST, affine; 1/2/3/4/8 bits; groups of whole units), KVarN's key tiles (``auto``'s keys, with or without
    ``+rmean``; KIVI's per-channel keys, tiles with s_tok 1), KVarN's value tiles, or full precision; else None (the
    path below: float64, which is bit-exact with the emulation; groups within a token that end mid-unit). ``held``:
    row b reads columns [held[b, i, 0], held[b, i, 1]) of part i."""
    if not (USE_KERNELS and USE_FUSED) or query.device.type != "cpu" or query.dtype not in _TRITON_DTYPES:
        return None
    if len(parts_k) != 3 or len(parts_v) != 3:
        return None
    (sk, mk, rk), (sv, mv, rv) = parts_k, parts_v
    if not all(torch.is_tensor(t) for t in (sk, rk, sv, rv)):
        return None
    B, Hq, _, d = query.shape
    H = sk.shape[1]
    keys, values, reads = [sk, None, rk], [sv, None, rv], []
    for side, mid, parts in (("key", mk, keys), ("value", mv, values)):
        if torch.is_tensor(mid):  # a full-precision middle (a side kept in full precision)
            parts[1], read, n = mid, ([], 0, 0, 0.0), mid.shape[2]
        else:
            read, n = _cpu_mid(*mid[:3], side), mid[2]
            if read is None:
                return None
            parts[1] = _NONE[0] if read[0] else parts[0][:, :, :0]  # (not read where codes are; else no columns)
        reads.append((read, n))
    (kt, kbits, tile, khalf), n = reads[0]
    (vt, vbits, vtile, vhalf), nv = reads[1]
    ext = _compiled() if n == nv else None
    if ext is None:
        return None
    widths = [sk.shape[2], n, rk.shape[2]]
    spans = _NONE[2] if held is None else held  # (none: every row reads all of each part)
    none = _NONE[0]
    visible = _NONE[1] if allowed is None else allowed.reshape(allowed.shape[0], -1).bool()
    terms = table = first = none
    if kt and len(mk) > 3:  # keys centered on their rotating mean (+rmean): the centers' share from the position
        terms, first, _ = mk[3].kernel_inputs(query.reshape(B, H, Hq // H, d))
        terms, first = terms.reshape(B, Hq, d), first.to(torch.int64)
        table = mk[3].mean.table(int(first.max()) + n, "cpu")
    q = query.squeeze(2)
    out = ext.parts_decode(q if q.dtype == torch.float32 else q.float(), spans, widths, keys, values, kt, kbits, tile,
                           khalf, vt, vbits, vtile, vhalf, visible, float(scaling), float(softcap or 0.0),
                           none if sinks is None else sinks.detach().float().cpu(), terms, table, first)
    return (out if query.dtype == torch.float32 else out.to(query.dtype)).view(B, 1, Hq, d)


def _steps(n: int, codec, block: int):
    step = max(codec.block, block // codec.block * codec.block)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


_DEQUANT_FLOATS = 1 << 20  # floats of one dequantized block of a batch (4 MB in float32)


def _dequant_steps(n: int, codec, block: int, rows: int):
    """:func:`_steps` for a run dequantized block by block across ``rows`` = B·Hkv rows: at most ``block`` tokens,
    fewer for a larger batch, so that one block stays about the same size (a cache's worth, not the batch's: on
    KVarN tiles of 16 rows × 3 heads at 4096 tokens, blocks of 256 tokens took a third of the time of blocks of 4096)."""
    per = max(1, _DEQUANT_FLOATS // max(1, rows * codec.d))
    return _steps(n, codec, min(block, 1 << (per.bit_length() - 1)))


def _keys(codec, store, n, a, b, dtype, center=None):
    """The dequantized keys of tokens [a, b) of a run, their centers added back (``+rmean``) before the rounding
    to ``dtype``, as the single-pass emulation reads them."""
    x = codec.decode(_slices(store, n, a, b), b - a)
    return (x if center is None else x + center.dense(a, b)).to(dtype)


def _key_tiles(codec, store, n: int):
    """Keys coded in tiles of ``codec.block`` tokens as the kernels read them, k̂[t, c] = s_tok[t]·(scale[t // block, c]·
    code[t, c] + zero[t // block, c]): (s_tok (B, H, ≥ n), scale, zero (B, H, tiles, d)) for KVarN's key tiles (s_tok:
    their s_fold) and KIVI's per-channel keys (:class:`ChannelCodec`: s_tok 1, a stride-0 view; zero: their offset);
    None for other codecs."""
    if isinstance(codec, KVarNCodec) and codec.kind == "key":
        return store["s_fold"].flatten(2, 3), store["scale"], store["zero"]
    if isinstance(codec, ChannelCodec):
        B, H = store["codes"].shape[:2]
        return unit_s_tok(store["codes"].device).expand(B, H, n), store["scale"], store["offset"]
    return None


def _value_tiles(codec, store):
    """Values coded in KVarN tiles of ``codec.block`` tokens as the kernels read them, v̂[t, c] = s_chan[t // block, c]·
    (scale[t]·code[t, c] + zero[t]): (scale, zero (B, H, N), s_chan (B, H, tiles, d)) (views of the store: each
    tile's per-token rows flattened, its channel scales are its s_fold); None for other codecs."""
    if isinstance(codec, KVarNCodec) and codec.kind == "value":
        return store["scale"].flatten(2, 3), store["zero"].flatten(2, 3), store["s_fold"]
    return None


_UNIT_S_TOK: dict = {}  # device -> a float16 1: KIVI keys' s_tok, expanded (stride 0), never written


def unit_s_tok(device) -> torch.Tensor:
    """A float16 1 (1, 1, 1) on ``device``, made once: the s_tok of KIVI's key tiles, which store none (expand it)."""
    one = _UNIT_S_TOK.get(device)
    if one is None:
        one = _UNIT_S_TOK[device] = torch.ones(1, 1, 1, dtype=torch.float16, device=device)
    return one


def _tile_kernels(codec, store, dtype):
    """The fused CPU kernels where key tiles (KVarN's, KIVI's per-channel keys: :func:`_key_tiles`) can be read from
    their codes (where :func:`_kernels` applies, not in float64, which dequantizes exactly as the emulation does), else
    None."""
    if not (isinstance(codec, ChannelCodec) or (isinstance(codec, KVarNCodec) and codec.kind == "key")):
        return None
    return None if dtype == torch.float64 else _kernels(codec, store)


def _tile_scores(ext, qg, codec, store, n):
    """Scores (B, H, G, n) float32 of a run of key tiles, from their codes: a tile's key is
    k̂[t, c] = s_tok[t]·(scale[c]·code[t, c] + zero[c]), so q·k̂_t = s_tok[t]·((q ⊙ scale)·code_t + q·zero): one
    set of channel-scaled queries per tile (``code_dot_tiles``, which also applies q·zero and s_tok) and no float keys."""
    s_tok, scale, zero = _key_tiles(codec, store, n)
    qf = qg.float()
    scale, zero = scale.float(), zero.float()  # (B, H, tiles, d)
    qt = qf.unsqueeze(2) * scale.unsqueeze(3)  # (B, H, tiles, G, d)
    z = torch.einsum("bhgd,bhnd->bhng", qf, zero)  # (B, H, tiles, G)
    s_tok = s_tok.float()[:, :, :n].contiguous()  # (B, H, n)
    return ext.code_dot_tiles(store["codes"], qt, codec.bits, codec.block, z, s_tok)  # (B, H, G, n)


def _run_scores(qg, codec, store, n, dtype, block, center=None):
    """Scores (B, H, G, n) of grouped queries (B, H, G, d) against a quantized run of n tokens; ``center``: the
    run's key centers (``+rmean``), whose share of the scores is added block by block."""
    ext = _tile_kernels(codec, store, dtype)
    if ext is not None:  # KVarN's key tiles from their codes; the centers' share added in float32, as below
        scores = _tile_scores(ext, qg, codec, store, n)
        if center is None:
            return scores.to(dtype)
        return scores + torch.cat([center.scores(qg, a, b) for a, b in _steps(n, codec, block)], dim=-1)
    if not _fast(codec, dtype):
        return torch.cat([torch.matmul(qg, _keys(codec, store, n, a, b, dtype, center).transpose(-1, -2))
                          for a, b in _dequant_steps(n, codec, block, qg.shape[0] * qg.shape[1])], dim=-1)
    scores = _code_scores(qg, codec, store, n, dtype, block)
    if center is None:
        return scores
    # added in float32 (the scores' accumulation dtype in a 16-bit model), not rounded to the query's dtype first
    return scores.float() + torch.cat([center.scores(qg, a, b) for a, b in _steps(n, codec, block)], dim=-1)


def _code_scores(qg, codec, store, n, dtype, block):
    """Scores (B, H, G, n) of a run of per-token codes, read in the code domain."""
    scale, offset = codec.scale_offset(store)  # (B, H, n, ng): 1/gs of the cache, read once
    scale, offset = scale.to(dtype), offset.to(dtype)
    B, H, G, d = qg.shape
    ng = scale.shape[-1]
    ext = _kernels(codec, store, ng)
    if ext is not None and ng == 1:  # fused: reads the packed bytes once, no float codes at all
        cq = ext.code_dot(store["codes"], qg.float(), codec.bits).to(dtype)
        return cq * scale[..., 0].unsqueeze(2) + qg.sum(-1, keepdim=True) * offset[..., 0].unsqueeze(2)
    if ext is not None:  # groups within a token: one call per group over its bytes (a slice of each row)
        gb, gs, qf = _group_bytes(codec.bits, d, ng), d // ng, qg.float()
        out = 0
        for j in range(ng):
            qj = qf[..., j * gs:(j + 1) * gs]
            cq = ext.code_dot(store["codes"][..., j * gb:(j + 1) * gb], qj, codec.bits)
            sj, oj = scale[..., j].float().unsqueeze(2), offset[..., j].float().unsqueeze(2)  # (B, H, 1, n)
            out = out + cq * sj + qj.sum(-1, keepdim=True) * oj
        return out.to(dtype)
    parts = []
    for a, b in _steps(n, codec, block):  # only one block of float codes exists at a time
        c = codes_as_float(store["codes"][:, :, a:b], codec.bits, d, dtype)
        if ng == 1:
            parts.append(torch.matmul(qg, c.transpose(-1, -2)))  # (B, H, G, N)
        else:
            cq = torch.einsum("bhngk,bhqgk->bhqng", c.unflatten(-1, (ng, d // ng)), qg.unflatten(-1, (ng, d // ng)))
            parts.append((cq * scale[:, :, None, a:b]).sum(-1))
    cq = torch.cat(parts, dim=-1)
    if ng == 1:
        return cq * scale[..., 0].unsqueeze(2) + qg.sum(-1, keepdim=True) * offset[..., 0].unsqueeze(2)
    return cq + torch.einsum("bhqg,bhng->bhqn", qg.unflatten(-1, (ng, d // ng)).sum(-1), offset)


def _run_output(p, codec, store, n, dtype, block):
    """Σ_j p_j v̂_j (B, H, G, d) over a quantized run of n tokens; p (B, H, G, n)."""
    if not _fast(codec, dtype):
        out = 0
        for a, b in _dequant_steps(n, codec, block, p.shape[0] * p.shape[1]):
            out = out + torch.matmul(p[..., a:b], codec.decode(_slices(store, n, a, b), b - a).to(dtype))
        return out
    scale, offset = codec.scale_offset(store)
    scale, offset = scale.to(dtype), offset.to(dtype)
    ng = scale.shape[-1]
    d = codec.d
    if ng == 1:
        w = p * scale[..., 0].unsqueeze(2)  # (B, H, G, n)
        out = torch.matmul(p, offset)  # (Σ_j p_j z_j)·1
        ext = _kernels(codec, store, ng)
        if ext is not None:
            return out + ext.code_weighted_sum(store["codes"], w.float(), codec.bits, d).to(dtype)
        for a, b in _steps(n, codec, block):
            out = out + torch.matmul(w[..., a:b], codes_as_float(store["codes"][:, :, a:b], codec.bits, d, dtype))
        return out
    out = torch.einsum("bhqn,bhng->bhqg", p, offset).repeat_interleave(d // ng, dim=-1)
    ext = _kernels(codec, store, ng)
    if ext is not None:  # groups within a token: one call per group over its bytes, weights p·scale of that group
        gb, gs, pf = _group_bytes(codec.bits, d, ng), d // ng, p.float()
        sums = [ext.code_weighted_sum(store["codes"][..., j * gb:(j + 1) * gb], pf * scale[..., j].float().unsqueeze(2),
                                      codec.bits, gs) for j in range(ng)]
        return out + torch.cat(sums, dim=-1).to(dtype)
    for a, b in _steps(n, codec, block):
        c = codes_as_float(store["codes"][:, :, a:b], codec.bits, d, dtype).unflatten(-1, (ng, d // ng))
        out = out + torch.einsum("bhqn,bhng,bhngk->bhqgk", p[..., a:b], scale[:, :, a:b], c).flatten(-2)
    return out


def _held_row(parts_k: list, parts_v: list, allowed: torch.Tensor, starts: list, spans: list, b: int) -> tuple[list, list, torch.Tensor]:
    """Row ``b`` of ragged parts: each part's columns [a, e) of ``spans``, and ``allowed``'s columns for them (part i's
    columns start at ``starts[i]`` of ``allowed``)."""
    def cut(part, a, e):
        if torch.is_tensor(part):
            return part[b : b + 1, :, a:e]
        codec, store, n, *center = part
        return (codec, _slices({k: t[b : b + 1] for k, t in store.items()}, n, a, e), e - a, *(c.row(b, a) for c in center))

    mask = torch.cat([allowed.reshape(allowed.shape[0], -1)[b : b + 1, s0 + a : s0 + e] for s0, (a, e) in zip(starts, spans)], 1)
    return ([cut(p, a, e) for p, (a, e) in zip(parts_k, spans)], [cut(p, a, e) for p, (a, e) in zip(parts_v, spans)],
            mask.view(1, 1, 1, -1))


def decode_attention(
    query: torch.Tensor,
    parts_k: list,
    parts_v: list,
    allowed: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    block: int = DEFAULT_BLOCK,
    sinks: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query per row over a cache given as parts, in position order.

    ``query`` (B, Hq, 1, d) (already in transformed space). ``parts_k``/``parts_v``: lists of either a
    full-precision tensor (B, Hkv, n, d) or a tuple ``(codec, store, n)`` (a quantized run of ``n``
    tokens; ``store`` as the codec encodes it), for keys also ``(codec, store, n, center)``: keys quantized
    centered (``+rmean``), ``center`` giving their centers back (``center.dense(a, b)``: (B', Hkv, b − a, d) of
    tokens [a, b)) and their share of the scores (``center.scores(qg, a, b)``: (B, Hkv, G, b − a) of grouped
    queries (B, Hkv, G, d)), so the run is still read in the code domain. Every part is read; ``allowed`` (B, 1, 1, S) masks the
    last ``S`` columns (earlier columns are not visible, e.g. outside a sliding window). ``sinks``: learned sink
    logits (Hq,) (gpt-oss), one more softmax column with a zero value.
    ``held``: ragged rows (B, parts, 2) int64 on the host, row b holding only columns [held[b, i, 0], held[b, i, 1]) of
    part i (``allowed``, over all the parts' columns, hides the rest, and may hide held ones): the Triton kernel
    reads the batch in one call, each row over its held columns; the PyTorch path reads each row alone over its held
    columns (a run's centers give a row's with ``center.row(b, a)``) where that leaves out over 20% of the batch's
    columns, and over :data:`ROW_COLUMNS` a row (:func:`rows_alone_over`), which it would otherwise all read.
    Returns (B, 1, Hq, d), transformers' layout.
    """
    B, Hq, T, d = query.shape
    if T != 1:
        raise ValueError(f"decode_attention takes one query position, got {T}")
    widths = [p.shape[2] if torch.is_tensor(p) else p[2] for p in parts_k]
    if held is not None and not (held[:, :, 1] > held[:, :, 0]).any(1).all():
        # a row holding nothing (padding alone: its output is never read) reads every column, as its mask lets it
        held = torch.where((held[:, :, 1] > held[:, :, 0]).any(1).view(-1, 1, 1), held,
                           torch.stack([torch.zeros(len(widths), dtype=held.dtype), torch.tensor(widths, dtype=held.dtype)], 1))
    out = _triton_decode(query, parts_k, parts_v, allowed, scaling, softcap, sinks, held)
    if out is None:
        out = _cpu_decode(query, parts_k, parts_v, allowed, scaling, softcap, sinks, held)
    if out is not None:
        return out
    saved = B * sum(widths) - int((held[:, :, 1] - held[:, :, 0]).sum()) if held is not None else 0
    if saved > max(0.2 * B * sum(widths), B * ROW_COLUMNS):  # rows far apart: each alone, over its own columns
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return torch.cat([decode_attention(query[b : b + 1], *_held_row(parts_k, parts_v, allowed, starts, held[b].tolist(), b),
                                           scaling, softcap, block, sinks) for b in range(B)], 0)
    first = parts_k[0]
    Hkv = first.shape[1] if torch.is_tensor(first) else first[1]["codes"].shape[1]
    G = Hq // Hkv
    dtype = query.dtype
    qg = query.view(B, Hkv, G, d)
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    # 1. scores of every part, in position order, block by block for quantized runs
    scores = []
    for pk in parts_k:
        if torch.is_tensor(pk):
            if pk.shape[2]:
                scores.append(torch.matmul(qg, pk.transpose(-1, -2)).to(acc_dtype))
        else:
            codec, store, n, *center = pk
            if n:
                scores.append(_run_scores(qg, codec, store, n, dtype, block, *center).to(acc_dtype))
    s = torch.cat(scores, dim=-1) * scaling  # (B, Hkv, G, N_all)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    n_all = s.shape[-1]
    if allowed is not None:
        S = allowed.shape[-1]
        allowed = allowed.reshape(B, 1, 1, S)
        if S < n_all:  # columns before the last S are not visible
            keep = torch.zeros(B, 1, 1, n_all, dtype=torch.bool, device=s.device)
            keep[..., n_all - S :] = allowed
            allowed = keep
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1).to(dtype)
    else:  # the sink column takes its share of the probability and is dropped (its value is zero)
        column = sinks.to(s.device, s.dtype).view(1, Hkv, G, 1).expand(B, Hkv, G, 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1].to(dtype)

    # 2. output: the same parts, in the same order, weighted by their slice of p
    out = None
    col = 0
    for pv in parts_v:
        if torch.is_tensor(pv):
            n = pv.shape[2]
            if n:
                o = torch.matmul(p[..., col : col + n], pv)
                out = o if out is None else out + o
            col += n
        else:
            codec, store, n = pv
            if n:
                o = _run_output(p[..., col : col + n], codec, store, n, dtype, block)
                out = o if out is None else out + o
            col += n
    if col != n_all:
        raise ValueError(f"keys cover {n_all} positions but values {col}")
    return out.reshape(B, Hq, 1, -1).transpose(1, 2)


def dequantize_then_attend(query, parts_k, parts_v, allowed, scaling, softcap=None, sinks=None) -> torch.Tensor:
    """Reference: dequantize every part, concatenate, plain attention. Returns (B, 1, Hq, d)."""
    def full(parts):
        xs = [p if torch.is_tensor(p) else _keys(p[0], p[1], p[2], 0, p[2], query.dtype, *p[3:])
              for p in parts if torch.is_tensor(p) or p[2]]
        return torch.cat(xs, dim=2)

    K, V = full(parts_k), full(parts_v)
    if allowed is not None:
        S = allowed.shape[-1]
        K, V = K[:, :, -S:], V[:, :, -S:]
    return reference_attention(query, K, V, allowed, scaling, softcap, sinks)


__all__ = ["decode_attention", "dequantize_then_attend", "codes_as_float", "encode_block", "fused_enabled", "kernels_enabled", "rows_alone_over",
           "triton_enabled", "triton_for", "read_format", "DEFAULT_BLOCK", "ROW_COLUMNS"]
