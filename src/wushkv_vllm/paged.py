"""WUSH-KV in a paged KV cache, in plain torch (no vLLM import): the byte layout of one cache cell, the store, the
gather of a request's context through its block table, the full-precision windows, and the attention over them.

vLLM hands a layer its KV cache as a logical ``(num_blocks, H, block_size, C)`` view (any strides) of ``C`` bytes per
(KV head, token) cell, ``C`` being what :meth:`SlotCodec.slot_bytes` published through the backend's ``customize_spec``.
One cell holds a token's keys and values after the transforms, quantized per token by the codecs of
:mod:`wushkv.codecs` (the same codes and metadata :class:`wushkv.cache.WushKVCache` stores)::

    [ key codes | key scale (| key offset) | value codes | value scale (| value offset) | padding to 2 bytes ]

(a scale is float16, or one E5M3 byte with metadata dtype ``e5m3``: :func:`wushkv.codecs.e5m3_round`).

A token's cell is written once, when vLLM stores the token, and depends on that token only: a complete block's bytes
are final, which is all vLLM's prefix caching shares, and preemption by recompute writes the same bytes again.

Keys in KVarN tiles (``+ktiles``: one tile of ``tile`` = ``S_flush`` consecutive tokens, quantized together,
:mod:`wushkv.quantizers.kvarn`) have a cell of their own shape::

    [ key codes | key s_tok (fp16) | key tile slice | value codes | value scale (| value offset) | padding ]

A tile's per-channel scale and zero (2·d float16, 4·d bytes) are spread over its cells, ``⌈4d/tile⌉`` bytes each
(2 at d = 64). KIVI's keys (per channel over tiles, :class:`wushkv.codecs.ChannelCodec`) are tiles with ``s_tok`` = 1,
which their cells do not hold. Tiles start at positions ``tile·j``, which the served sink (a whole number of tiles) puts on vLLM's
blocks (a block holds whole tiles): a tile's key fields are written once, when its last token is stored, from the
full-precision copies of its tokens (:func:`store_tiles`); until then its tokens are read from those copies, which
:class:`Windows` never drops while the tile is open. The values are per token, written when stored, as above, or,
with both sides in KVarN's tiles (``+tiles``, ``kvarn``), in tiles too, written with the keys::

    [ key codes | key s_tok | key tile slice | value codes | value scale | value zero | value tile slice | padding ]

a value tile's d float16 channel scales spread over its cells, ``2·⌈d/tile⌉`` bytes each (whole halves).

The full-precision windows (the first ``sink`` tokens of a sequence and its unflushed tail: wushkv's windows
``(S_sink, S_keep, S_flush)``, with ``S_flush`` 1 for per-token keys, whose codes are written when a token is stored,
and the tile for key tiles) cannot live in fixed-size cells. :class:`Windows` keeps a full-precision copy of the cells
written, keyed by physical block, and attention reads the copy where a position is in a window and the copy is there,
the codes otherwise; the copy is written with the codes, so it always says what the codes stand for (a block that
changes owner is written again before it is read). The copies live outside vLLM's KV budget, bounded by
:attr:`Windows.capacity` pages per layer: past it the oldest copy not in a window of this step is dropped (those a
later prefix-cache hit would read last), and those tokens are read from their codes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict

import torch

from wushkv.codecs import ChannelCodec, KVarNCodec, TokenCodec, make_codec
from wushkv.config import QuantConfig, WindowConfig
from wushkv.transforms.rope import rope_bias_terms, rope_rotate
from wushkv.quantizers import unpack
from wushkv.quantizers.kvarn import KVarNTiles, kvarn_dequantize
from wushkv.quantizers.quest import UNCLIPPED_FROM, QuestQuantizer
from wushkv.triton_kernels import rope_table, to_device

SLOT_ALIGN = 2  # bytes: vLLM allocates the cache in the model's dtype and views it as cells (even sizes, as its TurboQuant's)


def quest_grid(quantizer, d: int) -> tuple[int, float] | None:
    """How the fused store computes a per-token QuEST step of ``quantizer`` over ``d`` channels itself: (mode,
    coefficient) of ``quest_steps`` in :mod:`wushkv._ext` (mode 1, clipped: coef·RMS; mode 2, unclipped: coef·max|x|),
    as :meth:`QuestQuantizer._step` computes it; None where it does not (another quantizer, groups within a token, a
    clip search: their steps are computed in torch and handed over)."""
    if not isinstance(quantizer, QuestQuantizer) or quantizer.search or quantizer.group_size not in (None, d):
        return None
    if quantizer.clipped:
        return 1, 2.0 * quantizer.alpha / (2**quantizer.bits - 1)
    return 2, 2.0 * quantizer.alpha_scale / (2**quantizer.bits - 1)


_GRID_LANES: dict[int, int] = {}  # head_dim -> lanes or 0, once a process


def kernel_grid_lanes(d: int) -> int:
    """The partial sums with which the fused store's QuEST step (``quest_steps`` of :mod:`wushkv._ext`) equals
    PyTorch's own (:meth:`QuestQuantizer.grid`) bit for bit over ``d`` channels, or 0 where none does (then the store
    is handed torch's steps, as before session 78). A norm over the last dim adds ``lanes`` partial sums of x·x, then
    the lanes in order, then a scalar tail whose order is its compiler's (so the kernel takes a head dim that is a
    multiple of ``lanes`` only: every common one); how many lanes is PyTorch's build's choice (found 8 here): it is
    found, not assumed, by comparing the kernel with torch on a probe of tokens of that width, of many scales, a zero
    one, contiguous rows and rows apart in memory, once a process and head dim. Torch's grid costs 6 tensor operations
    a side and layer (about 40 µs of a served decode step's layer)."""
    found = _GRID_LANES.get(d)
    if found is None:
        from wushkv._ext import kernels

        ext, found = kernels(), 0
        if ext is not None and hasattr(ext, "quest_steps"):
            g = torch.Generator().manual_seed(78)
            wide = torch.randn(512, 2 * d, generator=g) * torch.logspace(-6, 4, 512)[:, None]
            wide[0] = 0.0
            probes = [wide[:, :d].contiguous(), wide[:, d:]]  # contiguous rows, and rows apart in memory
            for lanes in (8, 16, 4, 32, 1):
                if d % lanes == 0 and all(
                        torch.equal(ext.quest_steps(x, mode, coef, lanes), q.grid(x)[0].squeeze(-1))
                        for x in probes for q in (QuestQuantizer(2, alpha_scale=1.15), QuestQuantizer(6))
                        for mode, coef in [quest_grid(q, d)]):
                    found = lanes
                    break
        _GRID_LANES[d] = found
    return found


class SlotCodec:
    """The bytes of one (token, KV head) cell for quantization ``cfg`` at head_dim ``d``.

    ``key_feedback`` / ``value_feedback`` (H, d, d): the ``+ldlq`` error feedback of this rank's KV heads.
    ``tile``: tokens per key tile (``cfg``'s ``S_flush`` when its keys are KVarN's or KIVI's tiles), 0 for per-token keys.
    ``align``: the cell size is a multiple of it (the model dtype's size: vLLM views the cells in that dtype)."""

    def __init__(self, cfg: QuantConfig, head_dim: int, key_feedback: torch.Tensor | None = None,
                 value_feedback: torch.Tensor | None = None, align: int = SLOT_ALIGN):
        self.cfg, self.d = cfg, head_dim
        self.codecs = {"key": make_codec(cfg, "key", head_dim, key_feedback), "value": make_codec(cfg, "value", head_dim, value_feedback)}
        self.tile = cfg.windows.S_flush if isinstance(self.codecs["key"], (KVarNCodec, ChannelCodec)) else 0
        # KVarN's value tiles (+tiles, kvarn): in the key tiles' grid, written with them
        self.vtile = self.tile if isinstance(self.codecs["value"], KVarNCodec) else 0
        for side, c in self.codecs.items():
            if not isinstance(c, TokenCodec) and not (self.tile and (side == "key" or self.vtile)):
                q = "full precision" if c is None else cfg.side_quantizer(side)
                raise ValueError(f"the paged cache stores per-token codes (quantizers quest, affine, kivi's values; KVarN's or "
                                 f"KIVI's tiles for the keys); the {side}s are {q}")
        if isinstance(self.codecs["key"], ChannelCodec) and self.codecs["key"].meta_dtype != torch.float16:
            raise ValueError(f"a key tile's scale and zero are float16 in its cells; KIVI's keys with metadata dtype "
                             f"{cfg.metadata_dtype!r} are not served (export with --metadata-dtype float16)")
        # fields: (side, name, dtype, per-token width, byte offset, byte width), from one probe token
        self.fields, off = [], 0
        for side, c in self.codecs.items():
            if side == "key" and self.tile:  # codes, the token's fold s_tok (KVarN's), its slice of the tile's scale and zero
                nb = -(-head_dim * c.bits // 8)
                self.meta_width = -(-4 * head_dim // self.tile)
                s_tok = (("s_fold", torch.float16, 1, 2),) if isinstance(c, KVarNCodec) else ()  # KIVI's: 1, not stored
                for name, dtype, n, width in (("codes", torch.uint8, nb, nb), *s_tok,
                                              ("tile_meta", torch.uint8, self.meta_width, self.meta_width)):
                    self.fields.append((side, name, dtype, n, off, width))
                    off += width
                continue
            if side == "value" and self.vtile:  # codes, the token's scale and zero, its slice of the tile's channel scales
                nb = -(-head_dim * c.bits // 8)
                self.vmeta_width = 2 * -(-head_dim // self.tile)  # whole float16s a cell (the Triton decode reads halves)
                for name, dtype, n, width in (("codes", torch.uint8, nb, nb), ("scale", torch.float16, 1, 2),
                                              ("zero", torch.float16, 1, 2),
                                              ("tile_meta", torch.uint8, self.vmeta_width, self.vmeta_width)):
                    self.fields.append((side, name, dtype, n, off, width))
                    off += width
                continue
            heads, dev = (1, None) if c.feedback is None else (c.feedback.shape[0], c.feedback.device)
            probe = c.encode(torch.zeros(1, heads, 1, head_dim, device=dev))
            for name, t in probe.items():
                width = t.shape[-1] * t.element_size()
                self.fields.append((side, name, t.dtype, t.shape[-1], off, width))
                off += width
        self.payload_bytes = off
        self.slot_bytes = -(-off // align) * align
        # the value fields start here: what a store at a token's arrival writes when the keys wait for their tile
        self.value_offset = min(f[4] for f in self.fields if f[0] == "value")
        self._sides = self._kernel_sides()
        # the fused store writes a side's codes on its quantizer's grid: with error feedback on any per-token grid,
        # without it on QuEST's (floor(x/Δ)); an affine side without feedback is encoded in torch
        self._packed_cells = None  # (key, views): the Triton decode's views of the last cache it read (_packed_cells)
        self._store_views = None  # (key, field views) of the last cache the Triton store wrote (_store_triton)
        self._kernel_grids = None  # (modes, coefs, lanes) of paged_store, worked out at the first fused store
        self._fused_store = self._sides is not None and all(
            c.feedback is not None or c.symmetric for c in self.codecs.values() if isinstance(c, TokenCodec))

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """uint8 (T, H, slot_bytes) cells of keys and values (T, H, d) (already transformed). Key tiles are not
        encoded here (their key fields stay zero: :meth:`store_tiles` writes them when a tile is complete)."""
        T, H, _ = k.shape
        out = torch.zeros(T, H, self.slot_bytes, dtype=torch.uint8, device=k.device)
        stored = {side: c.encode(x.float().transpose(0, 1).unsqueeze(0))  # (1, H, T, ·)
                  for (side, c), x in zip(self.codecs.items(), (k, v)) if isinstance(c, TokenCodec)}
        for side, name, _dtype, _n, off, width in self.fields:
            if side in stored:
                t = stored[side][name][0].transpose(0, 1).contiguous()  # (T, H, n)
                out[..., off:off + width] = t.view(torch.uint8)
        return out

    def store(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              host_slots: torch.Tensor | None = None) -> None:
        """Write the cells of keys and values (T, H, d) (already transformed) into ``cache`` (num_blocks, H, block_size,
        ≥ slot_bytes) uint8 at vLLM's slots (T,) (< 0: padding, skipped): :meth:`encode` then :func:`store`, in one
        call of the fused ``paged_store`` of :mod:`wushkv._ext` where it covers the cells (the same bytes: QuEST's step
        computed in the kernel with torch's operations in torch's order, :func:`kernel_grid_lanes`, any other grid
        computed here by the quantizer; the kernel stores it, rounds and packs the codes). ``host_slots``: the
        slots' copy on the host, which tells the padding without a wait for the device."""
        from wushkv._ext import kernels

        if self.vtile:  # value tiles too: nothing is written before a tile is complete (store_tiles)
            return
        if self._store_triton(cache, k, v, slot_mapping):
            return
        ext = kernels() if self._fused_store and cache.device.type == "cpu" else None
        lo = self.value_offset if self.tile else 0  # key tiles: their fields wait for the tile (store_tiles)
        if ext is None or not hasattr(ext, "paged_store"):
            return store(cache, self.encode(k, v), slot_mapping, lo, host_slots)
        if self._kernel_grids is None:  # which sides' QuEST steps the kernel computes: fixed for the codec
            modes, coefs, lanes = [0, 0], [0.0, 0.0], 1
            for i, c in enumerate(self.codecs.values()):
                grid = quest_grid(c.quantizer, c.d) if isinstance(c, TokenCodec) else None
                if grid is not None and kernel_grid_lanes(c.d):  # PyTorch's bits (kernel_grid_lanes)
                    lanes = kernel_grid_lanes(c.d)
                    modes[i], coefs[i] = grid[0] | (4 if c.step_byte and c.bits >= UNCLIPPED_FROM else 0), grid[1]
            self._kernel_grids = (modes, coefs, lanes)
        modes, coefs, lanes = self._kernel_grids
        xs, steps, offsets, fbs = [], [], [], []
        empty = torch.empty(0)
        for i, (c, x) in enumerate(zip(self.codecs.values(), (k, v))):
            if not isinstance(c, TokenCodec):  # key tiles: skipped by the kernel
                xs.append(empty), steps.append(empty), offsets.append(empty), fbs.append(empty)
                continue
            offset = None
            if not modes[i] or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                x = x.float()  # the kernel reads float32 or 16-bit rows (widened exactly); a grid computed here reads float32
            if x.stride(-1) != 1:  # the kernel reads rows in place through their strides: they must be dense
                x = x.contiguous()
            if modes[i]:  # QuEST's step computed by the kernel
                scale = empty
            elif c.step_byte:  # the step rounded to its byte, on which TokenCodec._quant rounds the codes too
                scale = c.grid(x)[0].float().clamp_min(torch.finfo(torch.float32).tiny)
            else:
                scale, offset, _ = c.quantizer.grid(x)  # (T, H, 1) float32, as TokenCodec._quant computes it
            xs.append(x)
            steps.append(scale)
            offsets.append(empty if c.symmetric else offset)
            fbs.append(empty if c.feedback is None else c.feedback)
        ext.paged_store(cache, slot_mapping.to(torch.int64), xs, steps, offsets, fbs, *self._sides, self.payload_bytes,
                        self.slot_bytes, modes, coefs, lanes)

    def field_views(self, cache: torch.Tensor) -> dict[tuple[str, str], torch.Tensor] | None:
        """Each field of the cells of ``cache`` (num_blocks, H, block_size, ≥ slot_bytes) uint8, viewed in place in its
        dtype as (num_blocks, block_size, H, n): the (block, token, head) layout of the Triton kernels' paged cache.
        {(side, name): view}, or None where a field cannot be viewed in place (a float16 at an odd byte offset)."""
        cells = cache.permute(0, 2, 1, 3)
        views = {}
        for side, name, dtype, _n, off, width in self.fields:
            f = cells[..., off:off + width]
            try:
                views[side, name] = f if dtype == torch.uint8 else f.view(dtype)
            except RuntimeError:
                return None
        return views

    def _store_triton(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """:meth:`store` through wushkv's Triton store kernel (:func:`wushkv.triton_kernels.store_paged`, one launch
        per side) into strided views of the cells, where :func:`wushkv.decode.triton_for` sends the cache's device
        (a GPU; any device under ``triton_enabled(True)``) and the kernel covers its sides: per-token QuEST or affine
        codes, with or without error feedback (``+ldlq``), QuEST's steps in one E5M3 byte too (since session 74),
        without clip search (its codes are rounded on what the kernel does not compute). The bytes of :meth:`encode`:
        the affine grid bit for bit, QuEST's step to its dtype's rounding (the kernel sums ‖x‖ in another order: a
        last bit apart now and then, a code with it rarely); the padding is
        left as it was. With key tiles, the values alone (one launch; the key fields wait for their tile:
        :meth:`store_tiles`). False where it does not apply: the caller stores as before."""
        from wushkv.decode import triton_for

        tk = triton_for(cache.device)
        if tk is None:
            return False
        # the per-token sides this store writes: with key tiles (every `auto` recipe) the values only, whose +ldlq
        # feedback would otherwise run PyTorch's loop over the channels, some 13 launches a channel, at every step
        sides = [(side, c, x) for (side, c), x in zip(self.codecs.items(), (k, v)) if not (side == "key" and self.tile)]
        fmts = []
        for _side, c, _x in sides:
            if not isinstance(c, TokenCodec):
                return False
            try:  # (one-byte steps: QuEST's, rounded to E5M3 in the kernel, the codes on the rounded step)
                fmts.append(dataclasses.replace(tk.TokenFormat.of(c.quantizer, c.d), step_byte=c.step_byte))
            except ValueError:  # the clip search, a head_dim or group size the kernel does not take
                return False
        # the views kept for the cache they were made for (its address, shape, strides): a layer stores into the same
        # cache tensor at every step, and making them is a dozen operations
        key = _cache_key(cache)
        if self._store_views is None or self._store_views[0] != key:
            self._store_views = (key, self.field_views(cache))
        views = self._store_views[1]
        if views is None:
            return False
        for (side, c, x), fmt in zip(sides, fmts):
            tk.store_paged(x.to(cache.device), slot_mapping, views[side, "codes"], views[side, "scale"],
                           views.get((side, "offset")), fmt, feedback=c.feedback)
        return True

    def store_tiles(self, cache: torch.Tensor, keys: torch.Tensor, first_slots: torch.Tensor,
                    values: torch.Tensor | None = None) -> None:
        """Write the key fields of whole tiles: keys (n, H, tile, d) (already transformed; the tokens of each tile in
        order) quantized as wushkv's cache quantizes a flushed tile (:class:`wushkv.codecs.KVarNCodec`, with the
        ``+ldlq`` feedback along channels where the method has it), into the cells of ``cache`` (num_blocks, H,
        block_size, ≥ slot_bytes) uint8 from slots ``first_slots`` (n,) on (a tile lies within one block). With value
        tiles (:attr:`vtile`), the value fields too, of ``values`` (n, H, tile, d)."""
        n, H, G, d = keys.shape
        if G != self.tile:
            raise ValueError(f"tiles of {self.tile} tokens, got {G}")
        if bool(self.vtile) != (values is not None) or (values is not None and values.shape != keys.shape):
            raise ValueError(f"value tiles need their values (n, H, tile, d) = {tuple(keys.shape)}, per-token values none; "
                             f"got {None if values is None else tuple(values.shape)}")
        from wushkv.decode import encode_block

        # codes (n, H, G, nb), scale/zero (n, H, 1, d), s_fold (n, H, 1, G); on a GPU KVarN's through the tile kernel.
        # KIVI's (ChannelCodec): scale·code + offset per channel, the offset as the zero, no s_fold (1)
        s = encode_block(self.codecs["key"], keys.float())
        meta = torch.cat([s["scale"], s.get("zero", s.get("offset"))], -1).reshape(n, H, 2 * d).view(torch.uint8)  # (n, H, 4d)
        meta = torch.nn.functional.pad(meta, (0, G * self.meta_width - 4 * d)).reshape(n, H, G, self.meta_width)
        fields = {"key": {"codes": s["codes"], "tile_meta": meta}}
        if "s_fold" in s:
            fields["key"]["s_fold"] = s["s_fold"].reshape(n, H, G, 1).view(torch.uint8)
        if values is not None:  # codes (n, H, G, nb), scale/zero per token (n, H, 1, G), s_fold the channels' (n, H, 1, d)
            v = encode_block(self.codecs["value"], values.float())
            vmeta = v["s_fold"].reshape(n, H, d).view(torch.uint8)  # (n, H, 2d)
            vmeta = torch.nn.functional.pad(vmeta, (0, G * self.vmeta_width - 2 * d)).reshape(n, H, G, self.vmeta_width)
            fields["value"] = {"codes": v["codes"], "scale": v["scale"].reshape(n, H, G, 1).view(torch.uint8),
                               "zero": v["zero"].reshape(n, H, G, 1).view(torch.uint8), "tile_meta": vmeta}
        width = self.payload_bytes if values is not None else self.value_offset
        cells = torch.empty(n, H, G, width, dtype=torch.uint8, device=keys.device)
        for side, name, _dtype, _n, off, w in self.fields:
            if side in fields:
                cells[..., off:off + w] = fields[side][name]
        slots = (first_slots.long()[:, None] + torch.arange(G, device=first_slots.device)).reshape(-1)  # (n·G,)
        store(cache, cells.permute(0, 2, 1, 3).reshape(n * G, H, width), slots, valid=True)

    def decode(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) float32 (H, N, d) of uint8 cells (H, N, ≥ payload_bytes); with key tiles, N whole tiles starting on
        one (every tile's key fields written)."""
        parts = self.stores(cells)
        N = cells.shape[1]
        if self.vtile:
            v = self._value_tiles(parts["value"], cells.shape[0], N)
        else:
            v = self.codecs["value"].decode(parts["value"], N)[0]
        if not self.tile:
            return self.codecs["key"].decode(parts["key"], N)[0], v
        H, G, d = cells.shape[0], self.tile, self.d
        if N % G:
            raise ValueError(f"key tiles decode whole tiles of {G} tokens, got {N} tokens")
        kp = parts["key"]
        meta = kp["tile_meta"][0].reshape(H, N // G, G * self.meta_width)[..., :4 * d].contiguous().view(torch.float16)
        s_fold = kp["s_fold"] if "s_fold" in kp else meta.new_ones(1, H, N)  # KIVI's: 1
        t = KVarNTiles(unpack(kp["codes"], self.codecs["key"].bits, d), meta[None, ..., :d], meta[None, ..., d:],
                       s_fold.reshape(1, H, N // G, G), self.codecs["key"].bits, "key", G)
        return kvarn_dequantize(t)[0], v

    def _value_tiles(self, vp: dict, H: int, N: int) -> torch.Tensor:
        """float32 (H, N, d) of the value fields ``vp`` (:meth:`stores`) of N whole tiles."""
        G, d = self.vtile, self.d
        if N % G:
            raise ValueError(f"value tiles decode whole tiles of {G} tokens, got {N} tokens")
        s_chan = vp["tile_meta"][0].reshape(H, N // G, G * self.vmeta_width)[..., :2 * d].contiguous().view(torch.float16)
        t = KVarNTiles(unpack(vp["codes"], self.codecs["value"].bits, d), vp["scale"].reshape(1, H, N // G, G),
                       vp["zero"].reshape(1, H, N // G, G), s_chan[None], self.codecs["value"].bits, "value", G)
        return kvarn_dequantize(t)[0]

    def stores(self, cells: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """The codec stores {"key": {...}, "value": {...}} (each tensor (1, H, N, ·)) of uint8 cells (H, N, ≥ payload):
        what :func:`wushkv.decode.decode_attention` reads straight from the codes."""
        parts = {"key": {}, "value": {}}
        for side, name, dtype, n, off, width in self.fields:
            parts[side][name] = cells[..., off:off + width].contiguous().view(dtype).unsqueeze(0)
        return parts

    def sides(self) -> tuple[list[int], list[int], float, float] | None:
        """The cell layout as :func:`decode_batch`'s kernel reads it: per side [codes, scale, offset (−1: symmetric),
        bits, metadata dtype (0 float16, 1 bfloat16, 2 float32, 3 E5M3), tile (0: per token), tile slice, its width] and the
        symmetric offset's factor (QuEST: offset = scale·(½ − 2^(b−1))); for key tiles the scale is the token's
        float16 s_tok (−1: KIVI's, 1) and the tile slice holds its share of the tile's channel scale and zero; for value
        tiles scale and offset are the token's float16 scale and zero and the slice its share of the tile's channel
        scales. None where the kernel
        does not apply (groups within a token; 3 bits of a head_dim not a multiple of 8, whose rows end mid-unit)."""
        return self._sides

    def _kernel_sides(self):
        kinds = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.uint8: 3}  # uint8: an E5M3 step
        out, halves = [], []
        for side, c in self.codecs.items():
            f = {name: (dtype, n, off) for s, name, dtype, n, off, _w in self.fields if s == side}
            if c.bits not in (1, 2, 4, 8) and not (c.bits == 3 and c.d % 8 == 0):  # 3 bits: 8 codes in 3 bytes
                return None
            if side == "key" and self.tile:
                s_tok = f["s_fold"][2] if "s_fold" in f else -1  # -1: KIVI's, 1
                out.append([f["codes"][2], s_tok, -1, c.bits, 0, self.tile, f["tile_meta"][2], self.meta_width])
                halves.append(0.0)
                continue
            if side == "value" and self.vtile:  # the token's float16 scale and zero, the tile's channel scales spread
                out.append([f["codes"][2], f["scale"][2], f["zero"][2], c.bits, 0, self.vtile, f["tile_meta"][2],
                            self.vmeta_width])
                halves.append(0.0)
                continue
            scale_dtype, n_groups, scale_off = f["scale"]
            if n_groups != 1 or scale_dtype not in kinds:
                return None
            out.append([f["codes"][2], scale_off, f["offset"][2] if "offset" in f else -1, c.bits, kinds[scale_dtype], 0, 0, 0])
            halves.append(float(c._half))
        return out[0], out[1], halves[0], halves[1]

    def fake(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What decoding the cells of (T, H, d) keys and values gives, as (H, T, d) float32 (the slow reference; key
        tiles: T whole tiles, as wushkv's cache flushes them)."""
        return tuple(c.fake(x.float().transpose(0, 1).unsqueeze(0))[0] for c, x in zip(self.codecs.values(), (k, v)))


class RopeMean:
    """Keys centered on their rotating pre-RoPE mean (``+rmean``), as wushkv's cache centers them
    (:class:`wushkv.layer.RotatingKeyMean`): the codes hold ``K' − c'_t``, ``c'_t = (R_t μ)·key`` per KV head, R_t the
    layer's RoPE at position t; the full-precision copies hold K'. Read from codes, a key is ``k̂ + c'_t``, so a score
    gains ``q'·c'_t = Q·R_t μ`` (``query·keyᵀ = I``): a function of the position that the fused decode evaluates from a
    table of ``cos tθ``, ``sin tθ`` (:meth:`bias_terms`, :meth:`table`).

    mu (H, d) the pre-RoPE key mean, key (H, d, d), inv_freq (d/2,) and scaling of the layer's RoPE (rotate-half)."""

    def __init__(self, mu: torch.Tensor, key: torch.Tensor, inv_freq: torch.Tensor, scaling: float):
        H, d = mu.shape
        if tuple(key.shape) != (H, d, d) or tuple(inv_freq.shape) != (d // 2,):
            raise ValueError(f"the rotating key mean needs mu (H, d), key (H, d, d), inv_freq (d/2,); got {tuple(mu.shape)}, "
                             f"{tuple(key.shape)}, {tuple(inv_freq.shape)}")
        self.mu, self.key = mu.double(), key.double()
        self.inv_freq = inv_freq.float()  # as wushkv's cache: float32 frequencies, float64 angles
        self.scaling = float(scaling)
        self._mu: dict = {}  # query heads -> μ per query head on the queries' device
        self._on: dict = {}  # device -> (μ, key, inv_freq) there, for the centers

    def _at(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if str(device) not in self._on:  # once per device, not a copy (a wait) a step
            self._on[str(device)] = tuple(to_device(t, device) for t in (self.mu, self.key, self.inv_freq))
        return self._on[str(device)]

    def rotated(self, positions: torch.Tensor) -> torch.Tensor:
        """R_t μ (N, H, d) float64 at positions (N,) on their device (:func:`wushkv.transforms.rope.rope_rotate`, as
        wushkv's cache rotates it)."""
        mu, _, inv_freq = self._at(positions.device)
        return rope_rotate(mu[None], positions[:, None], inv_freq, self.scaling)

    def center(self, positions: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """c'_t = (R_t μ)·key (N, H, d) float32 at positions (N,): float64, then rounded, as wushkv's cache computes it,
        on the positions' device (a GPU's float64 for a prefill's thousands of positions, where the host's would take
        a good part of a second a layer; rounded to float32, the sums' order does not show), ``chunk`` positions at a
        time (the float64 temporaries of a whole long context would be gigabytes)."""
        key = self._at(positions.device)[1]
        out = torch.empty(len(positions), *self.mu.shape, dtype=torch.float32, device=positions.device)
        for a in range(0, len(positions), chunk):
            out[a:a + chunk] = torch.einsum("nhd,hde->nhe", self.rotated(positions[a:a + chunk]), key)
        return out

    def bias_terms(self, Q: torch.Tensor) -> torch.Tensor:
        """(R, Hq, d) float32 [A | B] of untransformed queries Q (R, Hq, d) (query head j on KV head j // G):
        Q·R_t μ = Σ_i A_i cos tθ_i + B_i sin tθ_i (:func:`wushkv.transforms.rope.rope_bias_terms`)."""
        Hq = Q.shape[1]
        if self._mu.get(Hq) is None or self._mu[Hq].device != Q.device:  # once per device, not a copy (a wait) a step
            self._mu[Hq] = to_device(self.mu.float().repeat_interleave(Hq // self.mu.shape[0], 0), Q.device)
        return rope_bias_terms(Q.float(), self._mu[Hq], self.scaling)

    def table(self, n: int) -> torch.Tensor:
        """(≥ n, d) float32 [cos tθ | sin tθ] for positions t < n on the host (:func:`wushkv.triton_kernels.rope_table`,
        grown by doubling, kept)."""
        return rope_table(self.inv_freq, n, "cpu")


def step_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The position (T,) of each of a step's tokens, request r's ``query_start_loc[r]..[r+1]`` being the last of its
    ``seq_lens[r]`` positions."""
    qsl, lens = query_start_loc.long(), seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    first = torch.repeat_interleave(lens - q_lens, q_lens)
    return first + torch.arange(int(qsl[-1])) - torch.repeat_interleave(qsl[:-1], q_lens)


def store(cache: torch.Tensor, cells: torch.Tensor, slot_mapping: torch.Tensor, lo: int = 0,
          host_slots: torch.Tensor | None = None, valid: bool = False) -> None:
    """Write bytes lo.. of cells (T, H, C) into ``cache`` (num_blocks, H, block_size, ≥ C) uint8 at vLLM's slots (T,) =
    block·block_size + offset; slots < 0 (padding) are skipped (told by ``host_slots``, their copy on the host, where
    given: the device's would make the host wait; ``valid``: none is)."""
    bs = cache.shape[2]
    if not valid and host_slots is not None:
        keep = host_slots >= 0
        if not bool(keep.all()):
            sel = keep.nonzero().flatten()
            cells, slot_mapping = cells[to_device(sel, cells.device)], slot_mapping[to_device(sel, slot_mapping.device)]
    elif not valid:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            cells, slot_mapping = cells[keep], slot_mapping[keep]
    slot_mapping = slot_mapping.long()
    cache[slot_mapping // bs, :, slot_mapping % bs, lo:cells.shape[-1]] = cells[..., lo:]


def store_tiles(sc: SlotCodec, cache: torch.Tensor, windows: "Windows", slot_mapping: torch.Tensor,
                rope_mean: RopeMean | None = None, positions: torch.Tensor | None = None) -> int:
    """Write the key fields of the tiles whose last token is among this step's slots (T,) (< 0: padding), from the
    full-precision copies of their tokens in ``windows`` (written this step or kept, open, since); returns how many
    tiles had a copy missing and were left as they are (a block prefix caching shares, whose codes are final: vLLM
    recomputes its last token; nothing else, the open tiles' copies are never dropped). Every tile is closed.
    ``rope_mean`` with the step's ``positions`` (T,): the tiles' keys are centered on it first."""
    G = sc.tile
    host = slot_mapping.cpu()
    if all(x < 0 or x % G != G - 1 for x in host.tolist()):  # no tile ends here (a decode step, mostly): no tensor op
        return 0
    keep = host >= 0
    slots = host[keep].long()
    last = slots % G == G - 1
    first = slots[last] - (G - 1)
    u = windows.unit
    idx = first[:, None] + torch.arange(G)  # (n, G) the tiles' slots
    rows = windows.index[(idx // u).clamp(max=len(windows.index) - 1)].long()
    rows[idx // u >= len(windows.index)] = -1
    held = (rows >= 0).all(1)
    held[held.clone()] = windows.written[rows[held], idx[held] % u].all(1)
    windows.close((first // G).tolist())
    if bool(held.any()):
        dev = windows.pool.device
        kv = windows.pool[to_device(rows[held], dev), to_device(idx[held] % u, dev)]  # (n, G, H, 2, d), the pool's dtype
        k = kv[..., 0, :].float()  # (the values converted only where they are tiles too)
        if rope_mean is not None:
            p0 = positions.cpu()[keep][last][held].long() - (G - 1)
            k = k - rope_mean.center(to_device((p0[:, None] + torch.arange(G)).reshape(-1), dev)).reshape(k.shape)
        v = kv[..., 1, :].float().to(cache.device).transpose(1, 2) if sc.vtile else None
        sc.store_tiles(cache, k.to(cache.device).transpose(1, 2), to_device(first[held], cache.device), v)
    return int((~held).sum())


def gather(cache: torch.Tensor, block_ids: torch.Tensor, stop: int, start: int = 0) -> torch.Tensor:
    """The cells (H, stop − start, C) of a request's positions start..stop−1 through its block table row ``block_ids``
    (blocks before ``start``'s are not read: a sliding-window layer's may have been freed)."""
    bs = cache.shape[2]
    b0, b1 = start // bs, -(-stop // bs)
    blocks = cache[block_ids[b0:b1].long()]  # (nb, H, bs, C)
    cells = blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], (b1 - b0) * bs, blocks.shape[-1])
    return cells[:, start - b0 * bs:stop - b0 * bs]


class Windows:
    """Full-precision copies of stored cells in pages of :attr:`unit` tokens (module docstring).

    The windows are wushkv's ``(sink, recent, flush)``: a sequence of n tokens reads in full precision its first
    ``sink`` and its tail from :meth:`tail` (n) on, at least ``recent`` tokens, flushed ``flush`` at a time (1:
    exactly the last ``recent``). With ``flush`` > 1 (key tiles of ``flush`` tokens) the copies of a tile are kept
    while it is open (stored in part, :func:`store_tiles` not yet run on it): its keys exist nowhere else. A request
    that ends (or is preempted) in the middle of a tile leaves it open until its block is filled again; past
    ``max_open`` open tiles the oldest of them not in a window of the step are let go (counted in :attr:`abandoned`: a
    running request's tile is written again and again, so it is never the oldest). Likewise the pages of sink
    positions (told by :meth:`write`'s ``positions``) are kept past the capacity, up to ``max_sink_pages``: a request
    that waits a step (a long prompt prefilled in chunks beside others) has no window in that step, and its sink,
    written first, would otherwise be the first copy dropped.

    A request that hits vLLM's prefix cache computes its first new tokens with the hit's last tokens in their recent
    window, so it reads the copies of the request that computed those blocks, which may have moved on or ended. The
    copies such a hit would read are remembered (:meth:`hit_marks`, :meth:`remember`) at the places hits come
    from: a prompt's last full block before its last token (the same prompt again: vLLM computes at least one token),
    a sequence's full blocks so far (a conversation's next turn, a prompt extended) and where a prompt hit before (a
    system prompt). A trim drops them after every other copy it may drop: those of a prompt's full blocks first, then
    a decode's, the same prompt again's, a hit's, each the least recently marked first (up to 2 × ``max_hits`` marks
    held, the latest), so that while they fit the capacity a hit reads what the request would read alone (the first
    hit of a shared prefix that ends elsewhere is not covered).

    A page is ``unit`` consecutive slots of one physical block (page id ``block·(block_size/unit) + slot/unit``); the
    unit is the largest that divides the block size, both windows and the flush (16 for sink 16, recent 128, block
    128), so a sequence holds about its windows' own tokens, not whole blocks. Copies live in one pool, ``pool`` (P, unit, H, 2, d)
    in ``dtype`` (keys at [..., 0, :], values at [..., 1, :]) with ``written`` (P, unit) bool; ``index`` (pages,) int32
    maps a page to its pool row (−1: none). Reads return float32; the fused decode
    (:func:`decode_batch`) reads the pool through ``index`` itself. ``head_major``: the pool stored (P, H, unit, 2, d)
    and seen as (P, unit, H, 2, d), so that a head's copies of a page lie together (the CPU backend's choice: its
    decode reads one head at a time, and scattered 256-byte rows 2·H·d apart were most of its reads from memory).

    The pool lives on ``device`` (the cache's); ``written``, ``index`` and the rest of the bookkeeping on the host, in
    Python ints where a step touches a few pages: slot mappings and positions given to :meth:`write`, :meth:`copies`
    and :meth:`read` are the host's."""

    def __init__(self, block_size: int, heads: int, head_dim: int, sink: int, recent: int, capacity: int,
                 dtype: torch.dtype = torch.float32, flush: int = 1, max_open: int | None = None,
                 max_sink_pages: int | None = None, device: torch.device | str | None = None, max_hits: int | None = None,
                 head_major: bool = False):
        if sink < 0 or recent < 0 or flush < 1:
            raise ValueError(f"windows must be >= 0 and the flush >= 1, got sink {sink}, recent {recent}, flush {flush}")
        if flush > 1 and (block_size % flush or sink % flush):
            raise ValueError(f"tiles of {flush} tokens need blocks and a sink of whole tiles, got block {block_size}, "
                             f"sink {sink}")
        self.bs, self.H, self.d, self.sink, self.recent, self.dtype = block_size, heads, head_dim, sink, recent, dtype
        self.flush = flush
        self._windows = WindowConfig(sink, recent, flush)
        self.unit = math.gcd(block_size, *(x for x in (sink, recent, flush if flush > 1 else 0) if x))
        # tiles (slot // flush) with copies written and key fields not yet, least recently written first
        self.open: OrderedDict[int, None] = OrderedDict()
        self.max_open, self.abandoned = max_open, 0
        self.sinks: OrderedDict[int, None] = OrderedDict()  # pages holding sink positions, least recently written first
        self.max_sink_pages = max_sink_pages
        # the copies a prefix-cache hit would read (class docstring): (block of the hit's last position, kind) ->
        # (step marked, hit length h, the blocks of positions tail(h + 1)..h − 1); up to 2 × max_hits held
        self.hits: dict[tuple[int, int], tuple[int, int, tuple[int, ...]]] = {}
        self.max_hits, self._step = max_hits, 0
        self.capacity = capacity  # pages
        self.head_major, self._device = head_major, device
        self.pool = self._new_pool(0)
        self.written = torch.zeros(0, self.unit, dtype=torch.bool)
        self.index = torch.full((0,), -1, dtype=torch.int32)
        self.pages: OrderedDict[int, int] = OrderedDict()  # page -> pool row, oldest written first
        self.free: list[int] = []
        # counts the changes to what a read finds (index, written): equal counts, equal state, for the layers of a
        # step, which write the same slots (a decode's plan is shared on it: decode_batch_triton)
        self.version = 0

    def tail(self, n: int) -> int:
        """The first position of the full-precision tail of a sequence of ``n`` tokens: S_sink + Qc(n), Qc(n) =
        flush·⌊max(0, n − sink − recent)/flush⌋ (wushkv's :meth:`~wushkv.config.WindowConfig.quantized_count`)."""
        return self.sink + self._windows.quantized_count(n)

    def pages_per_sequence(self) -> int:
        """Pages one sequence's windows can touch: its sink's and those of its tail (up to recent + flush − 1 tokens)."""
        u = self.unit
        span = self.recent + self.flush - 1
        return -(-self.sink // u) + (-(-span // u) + 1 if span else 0)

    def nbytes(self) -> int:
        """Bytes of the copies held (pages in use)."""
        row = self.pool[0].numel() * self.pool.element_size() + self.unit if len(self.pool) else 0
        return len(self.pages) * row

    def _grow(self, need: int) -> None:
        """At least ``need`` free pool rows (the pool doubles: copies are rare)."""
        if len(self.free) >= need:
            return
        old = len(self.pool)
        new = max(old * 2, old + need, 16)
        pool = self._new_pool(new)
        pool[:old] = self.pool
        self.pool = pool
        self.written = torch.cat([self.written, self.written.new_zeros(new - old, self.unit)])
        self.free.extend(range(new - 1, old - 1, -1))

    def _new_pool(self, rows: int) -> torch.Tensor:
        """A zeroed pool (rows, unit, H, 2, d), stored head-major where :attr:`head_major` (a (rows, H, unit, 2, d)
        tensor seen through a permutation: a head's copies of a page are contiguous, which the CPU decode reads as one
        stream; the fused kernels read either layout through its strides)."""
        u, H, d = self.unit, self.H, self.d
        if self.head_major:
            return torch.zeros(rows, H, u, 2, d, dtype=self.dtype, device=self._device).permute(0, 2, 1, 3, 4)
        return torch.zeros(rows, u, H, 2, d, dtype=self.dtype, device=self._device)

    def _page_slots(self, top: int) -> None:
        """``index`` covers pages below ``top``."""
        if top > len(self.index):
            self.index = torch.cat([self.index, self.index.new_full((top - len(self.index),), -1)])

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Keep full-precision keys and values (T, H, d) (any float dtypes; on CPU the keys float32 and the values as the
        model gave them take the fused ``windows_write``) of the tokens stored at ``slot_mapping`` (T,): the pages they
        fall in get pool rows (a new page starts unwritten), then one indexed copy for all tokens. ``positions`` (T,):
        the tokens' positions, which mark the sink's pages (kept past the capacity)."""
        if not (self.sink or self.recent or self.flush > 1):
            return
        # the bookkeeping in Python ints: a decode step stores a few tokens, and tensor ops cost more than their work
        # (about 10 µs each: a layer's write took 100 µs as a dozen of them, a decode step's layers 3-4 ms)
        host = slot_mapping.cpu().tolist()
        keep = [i for i, x in enumerate(host) if x >= 0]
        if not keep:
            return
        self.version += 1
        u = self.unit
        slots = [host[i] for i in keep] if len(keep) < len(host) else host
        pages = [x // u for x in slots]
        uniq = list(dict.fromkeys(pages))
        self._page_slots(max(uniq) + 1)
        new = [p for p in uniq if p not in self.pages]
        self._grow(len(new))
        if new:  # their pool rows, unwritten: two indexed writes for all of them, not two a page
            rows_new = [self.free.pop() for _ in new]
            self.pages.update(zip(new, rows_new))
            at = torch.tensor(rows_new, dtype=torch.long)
            self.written[at] = False
            self.index[torch.tensor(new, dtype=torch.long)] = at.to(torch.int32)
        for p in uniq:
            self.pages.move_to_end(p)
        if positions is not None and self.sink:
            pos = positions.cpu().tolist()
            for p in dict.fromkeys(p for p, i in zip(pages, keep) if pos[i] < self.sink):
                self.sinks[p] = None
                self.sinks.move_to_end(p)
        if self.flush > 1:
            for t in dict.fromkeys(p * u // self.flush for p in uniq):
                self.open[t] = None
                self.open.move_to_end(t)
        cells = torch.tensor([self.pages[p] * u + x % u for p, x in zip(pages, slots)], dtype=torch.long)  # row·unit + slot
        dev = self.pool.device
        from wushkv._ext import kernels

        ext = (kernels() if dev.type == k.device.type == v.device.type == "cpu" and k.dtype == torch.float32
               and v.dtype in (torch.float32, torch.float16, torch.bfloat16) else None)
        if ext is not None and hasattr(ext, "windows_write"):  # one call for the five operations below (their bytes)
            sel = torch.tensor(keep, dtype=torch.long) if len(keep) < len(host) else torch.empty(0, dtype=torch.long)
            ext.windows_write(self.pool, self.written, cells, sel, k, v)
            return
        kv = torch.stack([k, v], dim=2)  # (T, H, 2, d)
        if len(keep) < len(host):  # padding (slot < 0): its tokens' rows left out, by a host index (a mask would wait)
            kv = kv.index_select(0, to_device(torch.tensor(keep, dtype=torch.long), kv.device))
        if self.head_major:  # no flat view of a permuted pool: its (row, slot) pairs
            self.pool[to_device(cells // self.unit, dev), to_device(cells % self.unit, dev)] = kv.to(dev, self.dtype)
        else:  # one index into the pool's (row, slot) pairs: one copy to the device and one indexed write a layer
            flat = self.pool.view(-1, *self.pool.shape[2:])  # (P·unit, H, 2, d), the pool's storage
            flat[to_device(cells, dev)] = kv.to(dev, self.dtype)
        self.written.view(-1)[cells] = True

    def hit_marks(self, rows: list[tuple[torch.Tensor, int, int]]) -> tuple[list, list]:
        """What :meth:`remember` keeps of a step's ``rows`` [(block ids, n, new tokens)], a function of the batch and
        the windows' geometry alone (the layers of a step share it): ([(key, h, blocks)] to keep, [(key, only if
        marked the step before)] to forget). A hit of h tokens (whole blocks) reads the copies of positions
        tail(h + 1)..h − 1 (and the sink, kept apart), in ``blocks``. Keys are the block holding position h − 1 (a
        full block identifies its prefix) and the kind:

        * a prefill chunk (new tokens > 1) marks its full blocks (kind 0: a longer prompt, a conversation's next
          turn) and its full blocks before its last token (kind 1: the same prompt again, which vLLM hits there to
          compute one token); a chunk that continues the previous step's forgets that one's marks (a prompt's middle
          is where a hit comes least: left, they would outrank the marks of requests that ended);
        * a decode step that fills a block marks its full blocks (kind 2) and forgets its kind-2 mark a block back;
        * a first chunk after a hit (its context whole blocks, the last of them not where a chunk of the step before
          ended) marks the hit (kind 3: a prefix two requests have shared, a system prompt, is the likeliest to be
          shared again; the first such hit itself may find copies dropped). It is put as ``(key, h, blocks, kind-0
          key of the context)``: :meth:`remember` drops it where that kind-0 mark is the step before's (a prompt's
          next chunk). Kind-3 marks are not forgotten (the oldest go past ``max_hits``).

        A prompt's last chunk of one token looks like a decode step: its kind-1 point is then the previous chunk's
        kind-0 mark, which decode steps do not forget. Where two rows of the step start at the same whole blocks (a
        request and another hitting what it computed the step before), one of them is a hit: neither forgets, and
        the hit is marked whatever the step before marked."""
        bs = self.bs
        put, forget = [], []
        # rows that start on a block boundary, by the block before it: two at one place make a hit there
        starts: dict[tuple[int, int], int] = {}
        for table, n, new in rows:
            ctx = n - new
            if ctx > 0 and ctx % bs == 0:
                at = (int(table[ctx // bs - 1]), ctx)
                starts[at] = starts.get(at, 0) + 1
        for table, n, new in rows:
            if new > 1:
                marks = [(0, n // bs * bs), (1, (n - 1) // bs * bs)]
                ctx = n - new
                shared = ctx > 0 and ctx % bs == 0 and starts[(int(table[ctx // bs - 1]), ctx)] > 1
                for kind, h in ((0, ctx // bs * bs), (1, (ctx - 1) // bs * bs)):
                    if h > 0 and h != marks[kind][1] and not shared:
                        forget.append(((int(table[h // bs - 1]), kind), True))
                if ctx > 0 and ctx % bs == 0:
                    lo = self.tail(ctx + 1)
                    if lo < ctx:
                        at = int(table[ctx // bs - 1])
                        hit = ((at, 3), ctx, tuple(table[lo // bs:ctx // bs].tolist()))
                        put.append(hit if shared else (*hit, (at, 0)))
            elif n % bs == 0:
                marks = [(2, n)]
                if n > bs:
                    forget.append(((int(table[n // bs - 2]), 2), False))
            else:
                continue
            for kind, h in marks:
                lo = self.tail(h + 1)
                if 0 < h and lo < h:
                    put.append(((int(table[h // bs - 1]), kind), h, tuple(table[lo // bs:h // bs].tolist())))
        return put, forget

    def remember(self, marks: tuple[list, list]) -> None:
        """Keep :meth:`hit_marks`' marks of this step (the layer's steps are counted here: call it once a step);
        past 2 × ``max_hits`` marks, the latest ``max_hits`` are kept."""
        put, forget = marks
        self._step += 1
        if put:  # a kind-3 mark whose context the step before's chunk ended at: a prompt's next chunk, not a hit
            put = [m for m in put if len(m) == 3 or self.hits.get(m[3], (None,))[0] != self._step - 1]
        for key, recent in forget:
            hit = self.hits.get(key)
            if hit is not None and (not recent or hit[0] == self._step - 1):
                del self.hits[key]
        if put:
            self.hits.update((m[0], (self._step, m[1], m[2])) for m in put)
        if self.max_hits is not None and len(self.hits) > 2 * self.max_hits:
            latest = sorted(self.hits.items(), key=lambda kv: kv[1][0])[-self.max_hits:]
            self.hits = dict(latest)

    def _hit_pages(self, h: int, blocks: tuple[int, ...]) -> list[int]:
        """The pages of positions tail(h + 1)..h − 1, in ``blocks`` (from the block of tail(h + 1))."""
        u, bs = self.unit, self.bs
        lo = self.tail(h + 1)
        b0 = lo // bs
        return [blocks[p // bs - b0] * (bs // u) + (p % bs) // u for p in range(lo // u * u, h, u)]

    def close(self, tiles: list[int]) -> None:
        """Tiles (slot // flush) whose key fields are written: their copies may be dropped past the capacity."""
        for t in tiles:
            self.open.pop(t, None)

    def positions(self, n: int) -> list[int]:
        """The positions of a sequence of ``n`` tokens that are in a window."""
        head = range(min(self.sink, n))
        tail = range(max(min(self.sink, n), self.tail(n)), n)
        return [*head, *tail]

    def copies(self, blocks: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the copies of positions ``pos`` in physical blocks ``blocks`` (same shape, integer) are: their pool
        rows (−1: no page) and whether each is held (its page has a row and the slot is written)."""
        pages = blocks.long() * (self.bs // self.unit) + (pos % self.bs) // self.unit
        if not len(self.index):
            return torch.full_like(pages, -1), torch.zeros(pages.shape, dtype=torch.bool)
        # gathers and a where, no boolean indexing (a step reads ~300 window positions a request)
        inside = (pages >= 0) & (pages < len(self.index))
        rows = torch.where(inside, self.index[pages.clamp(0, len(self.index) - 1)].long(), -1)
        held = (rows >= 0) & self.written[rows.clamp_min(0), pos % self.unit]
        return rows, held

    def read(self, kf: torch.Tensor, vf: torch.Tensor, known: torch.Tensor, block_ids: torch.Tensor, start: int, stop: int,
             first_query: int) -> int:
        """Copy into full-precision keys and values (H, m, d) of positions start..start+m−1 the copies held of the
        positions below ``stop`` that a query at ``first_query`` or later reads in full precision (the sink, and the
        recent window of ``first_query``, which reaches furthest back), setting ``known`` (m,); returns how many of them
        had no copy (dropped past :attr:`capacity`: read from their codes)."""
        tail = self.tail(first_query + 1)
        p = torch.tensor([*range(min(self.sink, stop)), *range(tail, stop)], dtype=torch.long)
        p = p[(p >= start) & (p < stop)]
        if not len(p):
            return 0
        rows, held = self.copies(block_ids[p // self.bs], p)
        h = p[held]
        dev = self.pool.device
        kv = self.pool[to_device(rows[held], dev), to_device(h % self.unit, dev)].float().to(kf.device)  # (m, H, 2, d)
        at = to_device(h - start, kf.device)
        kf[:, at] = kv[:, :, 0].transpose(0, 1)
        vf[:, at] = kv[:, :, 1].transpose(0, 1)
        known[at.to(known.device)] = True
        return int(len(p) - len(h))

    def protect_and_trim(self, sequences: list[tuple[torch.Tensor, int]]) -> None:
        """After a step, past :attr:`capacity` pages: drop the oldest copies down to three quarters of it (so trims
        are rare), those a prefix-cache hit would read (:meth:`hit_marks`) last, by kind, then the latest last; never
        those holding a window position of the step's ``sequences`` [(block ids, n)], nor those of an open tile (past
        ``max_open`` open tiles, the oldest not in the step's windows are let go first)."""
        over_open = self.max_open is not None and len(self.open) > self.max_open
        over_sink = self.max_sink_pages is not None and len(self.sinks) > self.max_sink_pages
        if len(self.pages) <= self.capacity and not over_open and not over_sink:
            return
        u, ppb = self.unit, self.bs // self.unit
        keep = set()
        for block_ids, n in sequences:  # the pages of the windows, a page at a time (u divides the block and the sink)
            row = block_ids.tolist()
            starts = [*range(0, min(self.sink, n), u), *range(max(min(self.sink, n), self.tail(n)) // u * u, n, u)]
            keep.update(row[p // self.bs] * ppb + (p % self.bs) // u for p in starts)
        if over_open:  # tiles of requests that ended mid-tile: the oldest first
            live = {p * u // self.flush for p in keep}
            for t in list(self.open):
                if len(self.open) <= self.max_open:
                    break
                if t not in live:
                    del self.open[t]
                    self.abandoned += 1
        if over_sink:  # sinks of requests that ended: the oldest first
            for p in list(self.sinks):
                if len(self.sinks) <= self.max_sink_pages:
                    break
                if p not in keep:
                    del self.sinks[p]
        if len(self.pages) <= self.capacity:
            return
        target = self.capacity * 3 // 4

        def droppable(p):
            return p not in keep and p not in self.sinks and not (self.open and p * u // self.flush in self.open)

        # the pages a prefix-cache hit would read, by their mark's rank (0: kept longest), the first marks only while
        # the pages kept anyway and theirs fit the target: the others' pages go with the rest (a trim's work stays
        # about the target's size, whatever the number of marks)
        hit_rank: dict[int, int] = {}
        held = sum(1 for p in self.pages if not droppable(p))
        # by kind, then the latest first: a prefix hit before (a system prompt), the same prompt again (one window a
        # request, the hit that comes most: retries, the same prompts sent again), a decode's full blocks (a
        # conversation's next turn), a prompt's (a longer prompt)
        ranked = sorted(self.hits.items(), key=lambda kv: ((0, 2, 1, 3)[kv[0][1]], kv[1][0]), reverse=True)
        for rank, (_, (_, h, blocks)) in enumerate(ranked):
            if held >= target:
                break
            for p in self._hit_pages(h, blocks):
                if p in self.pages and p not in hit_rank and droppable(p):
                    hit_rank[p] = rank
                    held += 1

        # the oldest copies first, those a hit would read after every other, the lowest-ranked mark's first
        order = [p for p in self.pages if p not in hit_rank]
        order += sorted((p for p in self.pages if p in hit_rank), key=lambda p: -hit_rank[p])
        for p in order:
            if len(self.pages) <= target:
                break
            if droppable(p):
                e = self.pages.pop(p)
                self.index[p] = -1
                self.version += 1
                self.free.append(e)


def attend(q: torch.Tensor, q_pos: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
           known: torch.Tensor, k_pos: torch.Tensor, sink: int, recent: int, scale: float, sliding_window: int = -1,
           softcap: float = 0.0, block: int = 256, flush: int = 1) -> torch.Tensor:
    """Causal attention as WUSH-KV's cache gives it: a query at position p reads the key and value at position t in
    full precision when t is in the windows of a sequence of p + 1 tokens (t < ``sink`` or t ≥ sink + Qc(p + 1),
    Qc(n) = flush·⌊max(0, n − sink − recent)/flush⌋; with flush 1, t > p − ``recent``) and its full-precision copy is
    ``known``, from its codes otherwise — what p would read had the sequence been decoded token by token (wushkv's
    windows (sink, recent, flush); the same rule as :mod:`wushkv.layer`'s prefill emulation).

    q (T, Hq, d) at positions ``q_pos`` (T,); decoded keys and values ``kq``/``vq`` (H, n, d) and full-precision ones
    ``kf``/``vf`` (H, n, d, zeros where not ``known`` (n,): finite, since a masked column still enters the
    products) at positions ``k_pos`` (n,), ascending. Grouped: query head j reads KV
    head j // (Hq / H). ``sliding_window`` > 0: keys at p − window < t ≤ p only; ``softcap`` > 0: s ↦ c·tanh(s/c).

    One masked attention (torch's fused ``scaled_dot_product_attention``) a block of ``block`` queries, over the span
    of columns its queries may read (causal; the sliding window): the codes' keys, where every query of the block
    reads a column's copy (the sink, and from the block's last query's tail on) the copy in their place, and, appended,
    the copies of the columns J between its first and its last query's tail, which some of its queries read from
    the codes and some from the copy: a query is allowed a code column or its copy, never both. Memory, the mask of
    block × (span + |J|); time, about half of every query over all n for a prompt (J adds about a block's width a
    block; until session 76 J held the sink and every tail too: 1.3-1.7× the time at SmolLM2's 2k prompts).
    Returns float32 (T, Hq, d).

    The columns each block reads are worked out on the host, from the positions' host copies (``q_pos`` and
    ``k_pos`` may be given on the host: no copy back then), and J is every window column of the block's span whether
    its copy is known or not (``known`` enters the mask on the device), so that a block makes the host wait for the
    device nowhere (a GPU's prefill: four waits a block of queries and layer before)."""
    T, Hq, d = q.shape
    H = kq.shape[0]
    G = Hq // H
    dev = kq.device
    kq, vq, kf, vf = kq.float(), vq.float(), kf.float(), vf.float()
    qh, kh = q_pos.cpu(), k_pos.cpu()
    q_pos, k_pos = to_device(q_pos, dev), to_device(k_pos, dev)
    known = to_device(known, dev)
    out = torch.empty(T, Hq, d, device=dev)
    for a in range(0, T, block):
        qp = q_pos[a:a + block, None]
        qmin, qmax = int(qh[a:a + block].min()), int(qh[a:a + block].max())
        # the span of columns some query of the block may read (causal, and the sliding window): the others are
        # left out of the products rather than masked, so a prompt's early blocks cost their own length, not n
        live = kh <= qmax
        if sliding_window > 0:
            live &= kh > qmin - sliding_window
        idx = live.nonzero()
        c0, c1 = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
        kp, kph = k_pos[c0:c1], kh[c0:c1]
        tail = sink + flush * torch.div((qp + 1 - sink - recent).clamp(min=0), flush, rounding_mode="floor")  # (t, 1)
        # the tail moves forward with the query, from the block's first query's to its last's: below the sink and
        # from the last tail on, every query of the block that reads a column reads its copy where known, which
        # then takes the codes' place; between the two tails (J) some queries read the copy and some the codes,
        # so J's copies are appended as columns of their own
        first_tail, last_tail = (sink + flush * (max(0, p + 1 - sink - recent) // flush) for p in (qmin, qmax))
        J = ((kph >= first_tail) & (kph < last_tail)).nonzero().flatten()
        Jd = to_device(J, dev)
        allowed = kp[None, :] <= qp
        if sliding_window > 0:
            allowed &= kp[None, :] > qp - sliding_window
        copy = ((kp < sink) | (kp >= last_tail)) & known[c0:c1]  # (c1 − c0,): the copy in the codes' place
        full = (kp[Jd][None, :] >= tail) & known[c0:c1][Jd][None, :] & allowed[:, Jd]  # (t, |J|): reads J's copy
        codes = allowed.clone()
        codes[:, Jd] &= ~full
        c = copy[None, :, None]
        K = torch.cat([torch.where(c, kf[:, c0:c1], kq[:, c0:c1]), kf[:, c0:c1][:, Jd]], 1)  # (H, c1 − c0 + |J|, d)
        V = torch.cat([torch.where(c, vf[:, c0:c1], vq[:, c0:c1]), vf[:, c0:c1][:, Jd]], 1)
        mask = torch.cat([codes, full], 1)  # (t, c1 − c0 + |J|)
        qg = q[a:a + block].float().transpose(0, 1)  # (Hq, t, d)
        if softcap > 0:  # the fused kernel has no softcap: scores, capped, by hand
            s = torch.einsum("hgtd,hnd->hgtn", qg.reshape(H, G, -1, d), K) * scale
            s = (softcap * torch.tanh(s / softcap)).masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("hgtn,hnd->hgtd", s, V).reshape(Hq, -1, d)
        else:  # 4-d inputs and an additive mask take torch's fused CPU kernel (3-d or a bool mask: its slow path)
            bias = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
            o = torch.nn.functional.scaled_dot_product_attention(qg[None], K[None], V[None], attn_mask=bias[None, None],
                                                                 scale=scale, enable_gqa=G > 1)[0]
        out[a:a + block] = o.transpose(0, 1)
    return out


def decode_context(sc: SlotCodec, cache: torch.Tensor, block_ids: torch.Tensor, stop: int,
                   start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (H, stop − start, d) float32 of a request's positions start..stop−1 decoded from its cells
    through its block table row: the fused ``paged_dequantize`` of :mod:`wushkv._ext` where it covers the cells, else
    :meth:`SlotCodec.decode` of :func:`gather` (the same values)."""
    from wushkv._ext import kernels

    if sc.tile:  # whole tiles; the open one's keys zero (their key fields are not written: read from their copies)
        G = sc.tile
        a, b = start // G * G, -(-stop // G) * G
        k, v = sc.decode(gather(cache, block_ids, b, a))
        k[:, stop // G * G - a:] = 0
        return k[:, start - a:stop - a], v[:, start - a:stop - a]
    ext, sides = kernels() if cache.device.type == "cpu" else None, sc.sides()
    if ext is None or sides is None:
        return sc.decode(gather(cache, block_ids, stop, start))
    k, v = ext.paged_dequantize(cache, block_ids.to(torch.int32), start, stop, *sides, sc.d)
    return k, v


def decode_batch(sc: SlotCodec, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, q: torch.Tensor,
                 windows: Windows, scale: float, sliding_window: int = -1, softcap: float = 0.0,
                 rope_mean: RopeMean | None = None, q_raw: torch.Tensor | None = None,
                 host_table: torch.Tensor | None = None, plan: dict | None = None) -> torch.Tensor | None:
    """One decode query per request, all requests in one call of the fused kernel (``paged_decode`` of
    :mod:`wushkv._ext`): request r's query q[r] (Hq, d) at position seq_lens[r] − 1 reads its context through its block
    table row, each token from its full-precision copy in ``windows`` where it is in the windows of a sequence of
    seq_lens[r] tokens and its copy is held, from its cell's codes otherwise; the same attention as :func:`attend`.
    cache (num_blocks, H, block_size, C) uint8, block_table (R, ≥ blocks) int, seq_lens (R,), q (R, Hq, d).
    ``rope_mean`` (+rmean) with the untransformed queries ``q_raw`` (R, Hq, d): a token read from its codes gains
    Q·R_t μ (:class:`RopeMean`).
    Where :func:`wushkv.decode.triton_for` sends the cache's device (a GPU; any device under
    ``triton_enabled(True)``), wushkv's Triton decode kernel reads the cells instead (:func:`decode_batch_triton`;
    ``seq_lens`` and ``host_table``, the block table's copy on the host, are read there for the windows' bookkeeping;
    ``plan``: a dict the layers of one step share, :func:`decode_batch_triton`'s).
    Returns float32 (R, Hq, d), or None where the kernel is not available (no compiler) or does not cover the cells."""
    from wushkv._ext import kernels
    from wushkv.decode import triton_for

    if rope_mean is not None and q_raw is None:
        raise ValueError("decode_batch with rope_mean (+rmean) needs q_raw, the untransformed queries (R, Hq, d)")
    tk = triton_for(cache.device)
    if tk is not None:
        out = decode_batch_triton(tk, sc, cache, block_table, seq_lens, q, windows, scale, sliding_window, softcap,
                                  host_table, rope_mean, q_raw, plan)
        if out is not None:
            return out
    ext, sides = kernels() if cache.device.type == "cpu" else None, sc.sides()
    if ext is None or sides is None:
        return None
    empty = torch.empty(0)
    ab, table = ((rope_mean.bias_terms(q_raw), rope_mean.table(int(seq_lens.max()))) if rope_mean is not None
                 else (empty, empty))
    return ext.paged_decode(cache, block_table.to(torch.int32), seq_lens.to(torch.int64), q.float(), windows.pool,
                            windows.written, windows.index, *sides, windows.sink, windows.recent, windows.flush,
                            sliding_window if sliding_window > 0 else -1, float(scale), float(softcap or 0.0), ab, table)


def decode_batch_triton(tk, sc: SlotCodec, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        q: torch.Tensor, windows: Windows, scale: float, sliding_window: int = -1,
                        softcap: float = 0.0, host_table: torch.Tensor | None = None, rope_mean: RopeMean | None = None,
                        q_raw: torch.Tensor | None = None, plan: dict | None = None) -> torch.Tensor | None:
    """:func:`decode_batch` through wushkv's Triton decode kernel (``tk``: :mod:`wushkv.triton_kernels`), the GPU
    path. Request r's context is three parts, as the kernel reads them: its sink (positions below
    min(sink, n)) and its tail (:meth:`Windows.tail` on), read by the kernel in place from the pool of copies
    through a table of the pages' pool rows (:func:`_pool_windows`), and between them the codes, read in place
    through strided views of the cells (a paged middle whose block table maps every position: ``absolute_pages``).
    Where a window position a query reads has lost its copy (dropped past the pool's capacity), the batch's windows
    are gathered into (R, H, ·, d) tensors instead, that position dequantized from its cell in torch (what the rule
    reads). The dots run in the copies' dtype (float16/bfloat16 models; float32 copies: IEEE float32).

    ``seq_lens`` (R,) and ``host_table`` (the block table's copy on the host; None: copied here, a wait for the
    device) are read on the host, where the windows' bookkeeping is. Not yet run on a GPU.

    ``plan``: a dict shared by the layers of one step (the same batch: :func:`wushkv_vllm.backend.step_plan`), where
    what the windows' bookkeeping gives (the requests' parts, the pool's rows table) is kept for the next layer whose
    windows are in the same state (:attr:`Windows.version`: each layer writes the step's slots before it reads): the
    host's work of a step of R requests, once a step instead of once a layer. (The windows' ``index`` and
    ``written`` must change through :class:`Windows`' methods only, which count the changes.)

    Key tiles (``+ktiles``) are read as :class:`wushkv.triton_kernels.TileFormat` with their scale and zero where the
    cells spread them. ``rope_mean`` (+rmean) with the untransformed queries ``q_raw``: the codes' keys gain their
    centers in the kernel (:class:`wushkv.triton_kernels.KeyBias`, from head_dim 32), a dropped copy decoded here
    gains its own. Returns float32 (R, Hq, d), or None where the kernel does not apply: a codec the kernels do not
    take, a metadata field at an odd byte offset (it cannot be viewed as float16 in place)."""
    if rope_mean is not None and sc.d < 32:
        return None

    packed = _packed_cells(tk, sc, cache)
    if packed is None:
        return None
    dt = windows.dtype if windows.dtype in (torch.float16, torch.bfloat16) else torch.float32
    dev = cache.device
    key = ("windows", windows.version, len(windows.pool), int(sliding_window))
    lens = seq_lens.tolist()  # the host's: the windows' bookkeeping is there too
    hit = plan.get(key) if plan is not None else None
    if hit is not None and hit[-1] != lens:  # (a plan is a step's: another batch is a caller's error)
        raise ValueError("a decode plan is one step's: it was made for other sequence lengths")
    if hit is None:
        R = len(seq_lens)
        sink = [min(windows.sink, n) for n in lens]
        tail = [min(max(s, windows.tail(n)), n) for s, n in zip(sink, lens)]
        # each request's window positions, sink then tail, padded with a position it has (the kernel reads lengths)
        S, W = max(sink, default=0), max((n - t for n, t in zip(lens, tail)), default=0)
        s_, t_, n_ = (torch.tensor(x, dtype=torch.long).reshape(R, 1) for x in (sink, tail, lens))
        j, k = torch.arange(S), torch.arange(W)  # (tensor ops: a batch of 64 holds ~20k window positions)
        pos = torch.cat([torch.where(j < s_, j, 0), torch.where(k < n_ - t_, t_ + k, (n_ - 1).clamp_min(0))], 1)
        first = torch.tensor([max(0, n - sliding_window) if sliding_window > 0 else 0 for n in lens]).reshape(R, 1)
        host_table = block_table.cpu() if host_table is None else host_table
        # in place where the pool is what the kernel reads (the model's dtype, the cells' device)
        in_place = windows.pool.dtype == dt and windows.pool.device == dev
        pool = _pool_windows(tk, windows, host_table, pos, pos >= first, sink, tail, lens) if in_place else None
        lengths = torch.tensor([[s, t - s, n - t] for s, t, n in zip(sink, tail, lens)], dtype=torch.int32).reshape(R, 3)
        hit = (S, pos, first, host_table, pool, lengths, sink, lens)
        if plan is not None:
            plan[key] = hit
    S, pos, first, host_table, pool, lengths, sink, _ = hit
    if pool is not None:  # the windows read in place from the pool of copies: nothing gathered
        pk, pv = windows.pool[..., 0, :], windows.pool[..., 1, :]  # (rows, unit, H, d)
        parts = (pk, pv, pk, pv)
    else:  # a copy was dropped (read from its cell): the windows gathered, every position from its copy or its cell
        kf, vf = _window_copies(sc, cache, host_table, pos, pos >= first, windows, rope_mean)  # (R, H, S + W, d) each
        kf, vf = kf.to(dev, dt), vf.to(dev, dt)
        parts = (kf[:, :, :S], vf[:, :, :S], kf[:, :, S:], vf[:, :, S:])
    # +rmean: the middle's token i sits at position sink + i
    bias = None if rope_mean is None else tk.KeyBias(rope_mean.bias_terms(q_raw.to(dev)), torch.tensor(sink), rope_mean.inv_freq)
    out = tk.decode(q.to(dev, dt), lengths, parts[0], parts[1], packed[0], packed[1], parts[2], parts[3],
                    float(scale), softcap=float(softcap) if softcap else None,
                    window=sliding_window if sliding_window > 0 else None, block_table=block_table.to(dev, torch.int32),
                    absolute_pages=True, key_bias=bias, pool_windows=pool)
    return out.float()


def _cache_key(cache: torch.Tensor) -> tuple:
    """What views of ``cache`` are kept under (:func:`_packed_cells`, ``SlotCodec._store_triton``): its address,
    shape, strides, dtype and device. The views hold its storage, so another tensor never takes that key meanwhile."""
    return (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype, cache.device)


def _packed_cells(tk, sc: SlotCodec, cache: torch.Tensor):
    """The middle's keys and values as :func:`decode_batch_triton` hands them to the kernel: (keys, values)
    :class:`wushkv.triton_kernels.Packed` views of the cells of ``cache``, or None where the kernel does not take
    them. Kept on ``sc`` (a layer's) for the cache it was made for (its address, shape, strides, dtype): a layer
    decodes the same cache tensor at every step, and the views and formats cost the host ~20 µs a layer to make."""
    key = (id(tk), *_cache_key(cache))
    memo = sc._packed_cells
    if memo is not None and memo[0] == key:
        return memo[1]
    packed = _make_packed_cells(tk, sc, cache)
    sc._packed_cells = (key, packed)  # one entry (views of the cache: another cache replaces them)
    return packed


def _make_packed_cells(tk, sc: SlotCodec, cache: torch.Tensor):
    """:func:`_packed_cells`, made."""
    from wushkv.decode import read_format, unit_s_tok

    views = sc.field_views(cache)
    if views is None:
        return None
    if sc.vtile:  # KVarN's value tiles: each token's codes, scale and zero, the tile's channel scales spread over its cells
        try:
            vfmt = tk.TileFormat(sc.codecs["value"].bits, sc.d, sc.vtile, spread=sc.vmeta_width // 2, values=True)
        except ValueError:  # a head_dim or tile that is not a power of two
            return None
        packed = [None, tk.Packed(vfmt, views["value", "codes"], views["value", "scale"], views["value", "zero"],
                                  tile_scale=views["value", "tile_meta"].view(torch.float16))]
    else:
        vfmt = read_format(tk, sc.codecs["value"])
        if vfmt is None:
            return None
        packed = [None, tk.Packed(vfmt, views["value", "codes"], views["value", "scale"], views.get(("value", "offset")))]
    if sc.tile:  # key tiles: each token's codes and s_tok (KVarN's), the tile's scale and zero spread over its cells
        try:
            kfmt = tk.TileFormat(sc.codecs["key"].bits, sc.d, sc.tile, spread=sc.meta_width // 2)
            meta = views["key", "tile_meta"].view(torch.float16)  # (num_blocks, block_size, H, spread)
        except (ValueError, RuntimeError):  # an odd width or offset, a tile that is not a power of two
            return None
        codes = views["key", "codes"]
        s_tok = views.get(("key", "s_fold"))
        if s_tok is None:  # KIVI's keys: s_tok 1, a stride-0 view, never written
            s_tok = unit_s_tok(codes.device).expand(*codes.shape[:-1], 1)
        packed[0] = tk.Packed(kfmt, codes, s_tok, tile_scale=meta)
    else:
        kfmt = read_format(tk, sc.codecs["key"])
        if kfmt is None:
            return None
        packed[0] = tk.Packed(kfmt, views["key", "codes"], views["key", "scale"], views.get(("key", "offset")))
    return tuple(packed)


def _pool_windows(tk, windows: Windows, host_table: torch.Tensor, pos: torch.Tensor, need: torch.Tensor,
                  sink: list[int], tail: list[int], lens: list[int]):
    """:class:`wushkv.triton_kernels.PoolWindows` of the requests' windows where every window position a query reads
    (``need``-ed, at ``pos`` (R, P): the sink's, then the tail's) has its copy, so that the kernel reads the copies in
    place from ``windows.pool``; None where one was dropped (its cell is read instead: the gathered path). The rows
    table (R, sink pages + tail pages) holds each page's pool row: request r's sink pages from position 0, its tail's
    from the page of its first tail position, ``tail[r]`` (−1 past a part; a page before a sliding window, never
    read, may hold anything). All on the host: ``host_table``, ``pos``, ``need`` are the host's."""
    if not pos.shape[1]:
        return None
    _, held = windows.copies(host_table.long().gather(1, pos // windows.bs), pos)
    if not bool((held | ~need).all()):
        return None
    u, bs = windows.unit, windows.bs
    s, t, n = (torch.tensor(x).reshape(-1, 1) for x in (sink, tail, lens))
    nt = torch.where(n > t, -(-n // u) - t // u, 0)  # the tail's pages
    j, k = torch.arange(-(-int(s.max()) // u)), torch.arange(int(nt.max()))
    # each page's first position (−1: none)
    start = torch.cat([torch.where(j * u < s, j * u, -1), torch.where(k < nt, (t // u + k) * u, -1)], 1)
    first = start.clamp_min(0)
    rows, _ = windows.copies(host_table.long().gather(1, first // bs), first)  # the pool row of each page
    return tk.PoolWindows(torch.where(start >= 0, rows, -1).to(torch.int32), len(j), u)


def _window_copies(sc: SlotCodec, cache: torch.Tensor, host_table: torch.Tensor, pos: torch.Tensor,
                   need: torch.Tensor, windows: Windows, rope_mean: RopeMean | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (R, H, P, d) float32 at positions ``pos`` (R, P) of each request, on the pool's device: the
    copies the windows hold, and for a position without one, its cell decoded (its key given back its center with
    ``rope_mean``). Positions not ``need``-ed (before a sliding window: never read, their blocks perhaps freed) are
    zeros. ``host_table``, ``pos``, ``need``: the host's."""
    bs = cache.shape[2]
    blocks = host_table.long().gather(1, pos // bs)  # (R, P)
    rows, held = windows.copies(blocks, pos)
    held &= need
    dev = windows.pool.device
    kv = windows.pool[to_device(rows.clamp_min(0), dev), to_device(pos % windows.unit, dev)].float()  # (R, P, H, 2, d)
    kv.masked_fill_(to_device(~held, dev)[..., None, None, None], 0)
    dropped = ~held & need
    if bool(dropped.any()):  # copies dropped past the capacity: those positions from their codes
        blk, at = blocks[dropped], pos[dropped]
        if sc.tile:  # key tiles decode whole tiles: each position's own (a tile lies in one block), then the position
            G, m = sc.tile, len(at)
            offs = (at % bs - at % G)[:, None] + torch.arange(G)  # (m, G)
            cells = cache[blk[:, None].to(cache.device), :, offs.to(cache.device)]  # (m, G, H, C)
            k, v = sc.decode(cells.permute(2, 0, 1, 3).reshape(cells.shape[2], m * G, -1))  # (H, m·G, d)
            pick = (torch.arange(m) * G + at % G).to(k.device)
            k, v = k[:, pick], v[:, pick]
        else:
            k, v = sc.decode(cache[blk.to(cache.device), :, (at % bs).to(cache.device)].transpose(0, 1))  # (H, m, d)
        if rope_mean is not None:
            k = k + to_device(rope_mean.center(at), k.device).transpose(0, 1)
        kv[dropped.to(dev)] = torch.stack([k, v], 2).transpose(0, 1).to(dev)  # (m, H, 2, d)
    return kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)
