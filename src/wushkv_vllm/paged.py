"""WUSH-KV in a paged KV cache, in plain torch (no vLLM import): the byte layout of one cache cell, the store, the
gather of a request's context through its block table, the full-precision windows, and the attention over them.

vLLM hands a layer its KV cache as a logical ``(num_blocks, H, block_size, C)`` view (any strides) of ``C`` bytes per
(KV head, token) cell, ``C`` being what :meth:`SlotCodec.slot_bytes` published through the backend's ``customize_spec``.
One cell holds a token's keys and values after the transforms, quantized per token by the codecs of
:mod:`wushkv.codecs` (the same codes and metadata :class:`wushkv.cache.WushKVCache` stores)::

    [ key codes | key scale (| key offset) | value codes | value scale (| value offset) | padding to 4 bytes ]

A token's cell is written once, when vLLM stores the token, and depends on that token only: a complete block's bytes
are final, which is all vLLM's prefix caching shares, and preemption by recompute writes the same bytes again.

The full-precision windows (the first ``sink`` tokens of a sequence and its last ``recent`` ones, wushkv's windows
``(S_sink, S_keep, 1)``) cannot live in fixed-size cells. :class:`Windows` keeps a full-precision copy of the cells
written, keyed by physical block, and attention reads the copy where a position is in a window and the copy is there,
the codes otherwise; the copy is written with the codes, so it always says what the codes stand for (a block that
changes owner is written again before it is read). The copies live outside vLLM's KV budget, bounded by
:attr:`Windows.capacity` blocks per layer: past it the oldest copy not in a window of this step is dropped, and those
tokens are read from their codes.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from wushkv.codecs import TokenCodec, make_codec
from wushkv.config import QuantConfig

SLOT_ALIGN = 4  # bytes: a cell is viewed as the model dtype by vLLM (2 bytes) and sliced per field here


class SlotCodec:
    """The bytes of one (token, KV head) cell for quantization ``cfg`` at head_dim ``d``.

    ``key_feedback`` / ``value_feedback`` (H, d, d): the ``+ldlq`` error feedback of this rank's KV heads."""

    def __init__(self, cfg: QuantConfig, head_dim: int, key_feedback: torch.Tensor | None = None,
                 value_feedback: torch.Tensor | None = None):
        self.cfg, self.d = cfg, head_dim
        self.codecs = {"key": make_codec(cfg, "key", head_dim, key_feedback), "value": make_codec(cfg, "value", head_dim, value_feedback)}
        for side, c in self.codecs.items():
            if not isinstance(c, TokenCodec):
                q = "full precision" if c is None else cfg.side_quantizer(side)
                raise ValueError(f"the paged cache stores per-token codes (quantizers quest, affine); the {side}s are {q}")
        # fields: (side, name, dtype, per-token width, byte offset, byte width), from one probe token
        self.fields, off = [], 0
        for side, c in self.codecs.items():
            heads = 1 if c.feedback is None else c.feedback.shape[0]
            probe = c.encode(torch.zeros(1, heads, 1, head_dim))
            for name, t in probe.items():
                width = t.shape[-1] * t.element_size()
                self.fields.append((side, name, t.dtype, t.shape[-1], off, width))
                off += width
        self.payload_bytes = off
        self.slot_bytes = -(-off // SLOT_ALIGN) * SLOT_ALIGN
        self._sides = self._kernel_sides()
        # the fused store writes a side's codes on its quantizer's grid: with error feedback on any per-token grid,
        # without it on QuEST's (floor(x/Δ)); an affine side without feedback is encoded in torch
        self._fused_store = self._sides is not None and all(
            c.feedback is not None or c.symmetric for c in self.codecs.values())

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """uint8 (T, H, slot_bytes) cells of keys and values (T, H, d) (already transformed)."""
        T, H, _ = k.shape
        out = torch.zeros(T, H, self.slot_bytes, dtype=torch.uint8)
        stored = {side: c.encode(x.float().transpose(0, 1).unsqueeze(0))  # (1, H, T, ·)
                  for (side, c), x in zip(self.codecs.items(), (k, v))}
        for side, name, _dtype, _n, off, width in self.fields:
            t = stored[side][name][0].transpose(0, 1).contiguous()  # (T, H, n)
            out[..., off:off + width] = t.view(torch.uint8)
        return out

    def store(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the cells of keys and values (T, H, d) (already transformed) into ``cache`` (num_blocks, H, block_size,
        ≥ slot_bytes) uint8 at vLLM's slots (T,) (< 0: padding, skipped): :meth:`encode` then :func:`store`, in one
        call of the fused ``paged_store`` of :mod:`wushkv._ext` where it covers the cells (the same bytes: the grid is
        the quantizer's own, computed here; the kernel stores it, rounds and packs the codes)."""
        from wushkv._ext import kernels

        ext = kernels() if self._fused_store else None
        if ext is None or not hasattr(ext, "paged_store"):
            return store(cache, self.encode(k, v), slot_mapping)
        xs, steps, offsets, fbs = [], [], [], []
        empty = torch.empty(0)
        for c, x in zip(self.codecs.values(), (k, v)):
            x = x.float()
            scale, offset, _ = c.quantizer.grid(x)  # (T, H, 1) float32, as TokenCodec._quant computes it
            xs.append(x)
            steps.append(scale)
            offsets.append(empty if c.symmetric else offset)
            fbs.append(empty if c.feedback is None else c.feedback)
        ext.paged_store(cache, slot_mapping.to(torch.int64), xs, steps, offsets, fbs, *self._sides, self.payload_bytes,
                        self.slot_bytes)

    def decode(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) float32 (H, N, d) of uint8 cells (H, N, ≥ payload_bytes)."""
        parts = self.stores(cells)
        N = cells.shape[1]
        k, v = (self.codecs[s].decode(parts[s], N)[0] for s in ("key", "value"))
        return k, v

    def stores(self, cells: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """The codec stores {"key": {...}, "value": {...}} (each tensor (1, H, N, ·)) of uint8 cells (H, N, ≥ payload):
        what :func:`wushkv.decode.decode_attention` reads straight from the codes."""
        parts = {"key": {}, "value": {}}
        for side, name, dtype, n, off, width in self.fields:
            parts[side][name] = cells[..., off:off + width].contiguous().view(dtype).unsqueeze(0)
        return parts

    def sides(self) -> tuple[list[int], list[int], float, float] | None:
        """The cell layout as :func:`decode_batch`'s kernel reads it: per side [codes, scale, offset (−1: symmetric),
        bits, metadata dtype (0 float16, 1 bfloat16, 2 float32)] and the symmetric offset's factor (QuEST:
        offset = scale·(½ − 2^(b−1))); None where the kernel does not apply (groups within a token, 3 bits)."""
        return self._sides

    def _kernel_sides(self):
        kinds = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
        out, halves = [], []
        for side, c in self.codecs.items():
            f = {name: (dtype, n, off) for s, name, dtype, n, off, _w in self.fields if s == side}
            scale_dtype, n_groups, scale_off = f["scale"]
            if n_groups != 1 or c.bits not in (1, 2, 4, 8) or scale_dtype not in kinds:
                return None
            out.append([f["codes"][2], scale_off, f["offset"][2] if "offset" in f else -1, c.bits, kinds[scale_dtype]])
            halves.append(float(c._half))
        return out[0], out[1], halves[0], halves[1]

    def fake(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What decoding the cells of (T, H, d) keys and values gives, as (H, T, d) float32 (the slow reference)."""
        return tuple(c.fake(x.float().transpose(0, 1).unsqueeze(0))[0] for c, x in zip(self.codecs.values(), (k, v)))


def store(cache: torch.Tensor, cells: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write cells (T, H, C) into ``cache`` (num_blocks, H, block_size, ≥ C) uint8 at vLLM's slots (T,) =
    block·block_size + offset; slots < 0 (padding) are skipped."""
    bs = cache.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        cells, slot_mapping = cells[keep], slot_mapping[keep]
    slot_mapping = slot_mapping.long()
    cache[slot_mapping // bs, :, slot_mapping % bs, :cells.shape[-1]] = cells


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

    A page is ``unit`` consecutive slots of one physical block (page id ``block·(block_size/unit) + slot/unit``); the
    unit is the largest that divides the block size and both windows (16 for sink 16, recent 128, block 128), so a
    sequence holds about its windows' own tokens, not whole blocks. Copies live in one pool, ``pool`` (P, unit, H, 2, d)
    in ``dtype`` (keys at [..., 0, :], values at [..., 1, :]) with ``written`` (P, unit) bool; ``index`` (pages,) int32
    maps a page to its pool row (−1: none). Reads return float32; the fused decode
    (:func:`decode_batch`) reads the pool through ``index`` itself."""

    def __init__(self, block_size: int, heads: int, head_dim: int, sink: int, recent: int, capacity: int,
                 dtype: torch.dtype = torch.float32):
        if sink < 0 or recent < 0:
            raise ValueError(f"windows must be >= 0, got sink {sink}, recent {recent}")
        self.bs, self.H, self.d, self.sink, self.recent, self.dtype = block_size, heads, head_dim, sink, recent, dtype
        self.unit = math.gcd(block_size, *(x for x in (sink, recent) if x))
        self.capacity = capacity  # pages
        self.pool = torch.zeros(0, self.unit, heads, 2, head_dim, dtype=dtype)
        self.written = torch.zeros(0, self.unit, dtype=torch.bool)
        self.index = torch.full((0,), -1, dtype=torch.int32)
        self.pages: OrderedDict[int, int] = OrderedDict()  # page -> pool row, oldest written first
        self.free: list[int] = []

    def pages_per_sequence(self) -> int:
        """Pages one sequence's windows can touch: its sink's and those of its last ``recent`` tokens."""
        u = self.unit
        return -(-self.sink // u) + (-(-self.recent // u) + 1 if self.recent else 0)

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
        self.pool = torch.cat([self.pool, self.pool.new_zeros(new - old, *self.pool.shape[1:])])
        self.written = torch.cat([self.written, self.written.new_zeros(new - old, self.unit)])
        self.free.extend(range(new - 1, old - 1, -1))

    def _page_slots(self, top: int) -> None:
        """``index`` covers pages below ``top``."""
        if top > len(self.index):
            self.index = torch.cat([self.index, self.index.new_full((top - len(self.index),), -1)])

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Keep full-precision keys and values (T, H, d) of the tokens stored at ``slot_mapping`` (T,): the pages they
        fall in get pool rows (a new page starts unwritten), then one indexed copy for all tokens."""
        if not (self.sink or self.recent):
            return
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        if not len(slots):
            return
        pages = slots // self.unit
        # the bookkeeping in Python ints: a decode step stores a few tokens, and tensor ops cost more than their work
        uniq = list(dict.fromkeys(pages.tolist()))
        self._page_slots(max(uniq) + 1)
        new = [p for p in uniq if p not in self.pages]
        self._grow(len(new))
        for p in new:
            e = self.free.pop()
            self.written[e] = False
            self.index[p] = e
            self.pages[p] = e
        for p in uniq:
            self.pages.move_to_end(p)
        rows, offs = self.index[pages].long(), slots % self.unit
        kv = torch.stack([k[keep], v[keep]], dim=2).to(self.dtype)  # (T, H, 2, d)
        self.pool[rows, offs] = kv
        self.written[rows, offs] = True

    def positions(self, n: int) -> list[int]:
        """The positions of a sequence of ``n`` tokens that are in a window."""
        head = range(min(self.sink, n))
        tail = range(max(min(self.sink, n), n - self.recent), n)
        return [*head, *tail]

    def read(self, kf: torch.Tensor, vf: torch.Tensor, known: torch.Tensor, block_ids: torch.Tensor, start: int, stop: int,
             first_query: int) -> int:
        """Copy into full-precision keys and values (H, m, d) of positions start..start+m−1 the copies held of the
        positions below ``stop`` that a query at ``first_query`` or later reads in full precision (the sink, and the
        recent window of ``first_query``, which reaches furthest back), setting ``known`` (m,); returns how many of them
        had no copy (dropped past :attr:`capacity`: read from their codes)."""
        tail = max(self.sink, first_query - self.recent + 1) if self.recent else stop
        p = torch.tensor([*range(min(self.sink, stop)), *range(tail, stop)], dtype=torch.long)
        p = p[(p >= start) & (p < stop)]
        if not len(p):
            return 0
        pages = block_ids[p // self.bs].long() * (self.bs // self.unit) + (p % self.bs) // self.unit
        inside = pages < len(self.index)
        rows = torch.full_like(pages, -1)
        rows[inside] = self.index[pages[inside]].long()
        held = rows >= 0
        held[held.clone()] = self.written[rows[held], p[held] % self.unit]
        h = p[held]
        kv = self.pool[rows[held], h % self.unit].float()  # (m, H, 2, d)
        kf[:, h - start] = kv[:, :, 0].transpose(0, 1)
        vf[:, h - start] = kv[:, :, 1].transpose(0, 1)
        known[h - start] = True
        return int(len(p) - len(h))

    def protect_and_trim(self, sequences: list[tuple[torch.Tensor, int]]) -> None:
        """After a step, past :attr:`capacity` pages: drop the oldest copies down to three quarters of it (so trims
        are rare), never those holding a window position of the step's ``sequences`` [(block ids, n)]."""
        if len(self.pages) <= self.capacity:
            return
        u, ppb = self.unit, self.bs // self.unit
        keep = set()
        for block_ids, n in sequences:
            keep.update(int(block_ids[p // self.bs]) * ppb + (p % self.bs) // u for p in self.positions(n))
        target = self.capacity * 3 // 4
        for p in list(self.pages):
            if len(self.pages) <= target:
                break
            if p not in keep:
                e = self.pages.pop(p)
                self.index[p] = -1
                self.free.append(e)


def attend(q: torch.Tensor, q_pos: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
           known: torch.Tensor, k_pos: torch.Tensor, sink: int, recent: int, scale: float, sliding_window: int = -1,
           softcap: float = 0.0, block: int = 1024) -> torch.Tensor:
    """Causal attention as WUSH-KV's cache gives it: a query at position p reads the key and value at position t in
    full precision when t is in the windows of a sequence of p + 1 tokens (t < ``sink`` or t > p − ``recent``) and
    its full-precision copy is ``known``, from its codes otherwise — what p would read had the sequence been decoded
    token by token (wushkv's windows (sink, recent, 1); the same rule as :mod:`wushkv.layer`'s prefill emulation).

    q (T, Hq, d) at positions ``q_pos`` (T,); decoded keys and values ``kq``/``vq`` (H, n, d) and full-precision ones
    ``kf``/``vf`` (H, n, d, zeros where not ``known`` (n,)) at positions ``k_pos`` (n,). Grouped: query head j reads KV
    head j // (Hq / H). ``sliding_window`` > 0: keys at p − window < t ≤ p only; ``softcap`` > 0: s ↦ c·tanh(s/c).

    One masked attention (torch's fused ``scaled_dot_product_attention``) over the codes' keys and, appended, the
    full-precision copies of the columns J some query reads in full precision (the sink, and from the first query's
    recent window on): a query is allowed a code column or its copy, never both. Queries go ``block`` at a time
    (memory: the mask is block × (n + |J|)). Returns float32 (T, Hq, d)."""
    T, Hq, d = q.shape
    H = kq.shape[0]
    G = Hq // H
    kq, vq, kf, vf = kq.float(), vq.float(), kf.float(), vf.float()
    out = torch.empty(T, Hq, d)
    for a in range(0, T, block):
        qp = q_pos[a:a + block, None]
        J = (known & ((k_pos < sink) | (k_pos > int(qp.min()) - recent))).nonzero().flatten()
        full = (k_pos[J][None, :] < sink) | (k_pos[J][None, :] > qp - recent)  # (t, |J|): reads the copy
        allowed = k_pos[None, :] <= qp
        if sliding_window > 0:
            allowed &= k_pos[None, :] > qp - sliding_window
        full &= allowed[:, J]
        codes = allowed.clone()
        codes[:, J] &= ~full
        K, V = torch.cat([kq, kf[:, J]], 1), torch.cat([vq, vf[:, J]], 1)  # (H, n + |J|, d)
        mask = torch.cat([codes, full], 1)  # (t, n + |J|)
        qg = q[a:a + block].float().transpose(0, 1)  # (Hq, t, d)
        if softcap > 0:  # the fused kernel has no softcap: scores, capped, by hand
            s = torch.einsum("hgtd,hnd->hgtn", qg.reshape(H, G, -1, d), K) * scale
            s = (softcap * torch.tanh(s / softcap)).masked_fill(~mask, float("-inf")).softmax(-1)
            o = torch.einsum("hgtn,hnd->hgtd", s, V).reshape(Hq, -1, d)
        else:  # 4-d inputs and an additive mask take torch's fused CPU kernel (3-d or a bool mask: its slow path)
            bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
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

    ext, sides = kernels(), sc.sides()
    if ext is None or sides is None:
        return sc.decode(gather(cache, block_ids, stop, start))
    k, v = ext.paged_dequantize(cache, block_ids.to(torch.int32), start, stop, *sides, sc.d)
    return k, v


def decode_batch(sc: SlotCodec, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, q: torch.Tensor,
                 windows: Windows, scale: float, sliding_window: int = -1, softcap: float = 0.0) -> torch.Tensor | None:
    """One decode query per request, all requests in one call of the fused kernel (``paged_decode`` of
    :mod:`wushkv._ext`): request r's query q[r] (Hq, d) at position seq_lens[r] − 1 reads its context through its block
    table row, each token from its full-precision copy in ``windows`` where it is in the windows of a sequence of
    seq_lens[r] tokens and its copy is held, from its cell's codes otherwise; the same attention as :func:`attend`.
    cache (num_blocks, H, block_size, C) uint8, block_table (R, ≥ blocks) int, seq_lens (R,), q (R, Hq, d).
    Returns float32 (R, Hq, d), or None where the kernel is not available (no compiler) or does not cover the cells."""
    from wushkv._ext import kernels

    ext, sides = kernels(), sc.sides()
    if ext is None or sides is None:
        return None
    return ext.paged_decode(cache, block_table.to(torch.int32), seq_lens.to(torch.int64), q.float(), windows.pool,
                            windows.written, windows.index, *sides, windows.sink, windows.recent,
                            sliding_window if sliding_window > 0 else -1, float(scale), float(softcap or 0.0))
