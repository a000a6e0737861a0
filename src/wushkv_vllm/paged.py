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

from collections import OrderedDict

import torch

from wushkv.codecs import TokenCodec, make_codec
from wushkv.config import QuantConfig
from wushkv.decode import decode_attention

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
    """Full-precision copies of stored cells, per physical block (module docstring).

    Each entry: block id -> (keys and values (bs, H, 2, d) in ``dtype``, written (bs,) bool). Reads return them as
    float32."""

    def __init__(self, block_size: int, heads: int, head_dim: int, sink: int, recent: int, capacity: int,
                 dtype: torch.dtype = torch.float32):
        if sink < 0 or recent < 0:
            raise ValueError(f"windows must be >= 0, got sink {sink}, recent {recent}")
        self.bs, self.H, self.d, self.sink, self.recent, self.dtype = block_size, heads, head_dim, sink, recent, dtype
        self.capacity = capacity
        self.blocks: OrderedDict[int, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def blocks_per_sequence(self) -> int:
        """Blocks one sequence's windows can touch: its first (sink) and those of its last ``recent`` tokens."""
        return (1 if self.sink else 0) + (-(-self.recent // self.bs) + 1 if self.recent else 0)

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() + w.numel() for x, w in self.blocks.values())

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Keep full-precision keys and values (T, H, d) of the tokens stored at ``slot_mapping`` (T,); one indexed
        copy per block touched, not per token (a prefill chunk writes thousands)."""
        if not (self.sink or self.recent):
            return
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k, v = k[keep], v[keep]
        blocks, offs = slots // self.bs, slots % self.bs
        for b in dict.fromkeys(blocks.tolist()):  # in the order written: the last block is the newest
            entry = self.blocks.get(b)
            if entry is None:
                entry = (torch.zeros(self.bs, self.H, 2, self.d, dtype=self.dtype), torch.zeros(self.bs, dtype=torch.bool))
                self.blocks[b] = entry
            m = blocks == b
            entry[0][offs[m], :, 0] = k[m].to(self.dtype)
            entry[0][offs[m], :, 1] = v[m].to(self.dtype)
            entry[1][offs[m]] = True
            self.blocks.move_to_end(b)

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
        missing = 0
        blocks = block_ids[p // self.bs].long()
        for b in dict.fromkeys(blocks.tolist()):  # one indexed copy per block, not per position
            pb = p[blocks == b]
            entry = self.blocks.get(b)
            held = pb[entry[1][pb % self.bs]] if entry is not None else pb[:0]  # the positions its copy holds
            missing += len(pb) - len(held)
            if len(held):
                kf[:, held - start] = entry[0][held % self.bs, :, 0].transpose(0, 1).float()
                vf[:, held - start] = entry[0][held % self.bs, :, 1].transpose(0, 1).float()
                known[held - start] = True
        return missing

    def protect_and_trim(self, sequences: list[tuple[torch.Tensor, int]]) -> None:
        """After a step: drop the oldest copies past :attr:`capacity`, never those holding a window position of the
        step's ``sequences`` [(block ids, n)]."""
        if len(self.blocks) <= self.capacity:
            return
        keep = set()
        for block_ids, n in sequences:
            keep.update(int(block_ids[p // self.bs]) for p in self.positions(n))
        for b in list(self.blocks):
            if len(self.blocks) <= self.capacity:
                break
            if b not in keep:
                del self.blocks[b]


def attend(q: torch.Tensor, q_pos: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor,
           known: torch.Tensor, k_pos: torch.Tensor, sink: int, recent: int, scale: float, sliding_window: int = -1,
           softcap: float = 0.0, block: int = 256) -> torch.Tensor:
    """Causal attention as WUSH-KV's cache gives it: a query at position p reads the key and value at position t in
    full precision when t is in the windows of a sequence of p + 1 tokens (t < ``sink`` or t > p − ``recent``) and
    its full-precision copy is ``known``, from its codes otherwise — what p would read had the sequence been decoded
    token by token (wushkv's windows (sink, recent, 1); the same rule as :mod:`wushkv.layer`'s prefill emulation).

    q (T, Hq, d) at positions ``q_pos`` (T,); decoded keys and values ``kq``/``vq`` (H, n, d) and full-precision ones
    ``kf``/``vf`` (H, n, d, zeros where not ``known`` (n,)) at positions ``k_pos`` (n,). Grouped: query head j reads KV
    head j // (Hq / H). ``sliding_window`` > 0: keys at p − window < t ≤ p only; ``softcap`` > 0: s ↦ c·tanh(s/c).
    Queries go ``block`` at a time (memory). Returns float32 (T, Hq, d)."""
    T, Hq, d = q.shape
    H = kq.shape[0]
    G = Hq // H
    kq, vq, kf, vf = kq.float(), vq.float(), kf.float(), vf.float()
    out = torch.empty(T, Hq, d)
    for a in range(0, T, block):
        qp = q_pos[a:a + block, None]
        qg = q[a:a + block].float().reshape(-1, H, G, d).permute(1, 2, 0, 3)  # (H, G, t, d)
        full = known[None, :] & ((k_pos[None, :] < sink) | (k_pos[None, :] > qp - recent))  # (t, n)
        s = torch.where(full, torch.einsum("hgtd,hnd->hgtn", qg, kf), torch.einsum("hgtd,hnd->hgtn", qg, kq)) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        allowed = k_pos[None, :] <= qp
        if sliding_window > 0:
            allowed &= k_pos[None, :] > qp - sliding_window
        p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        o = torch.einsum("hgtn,hnd->hgtd", p * full, vf) + torch.einsum("hgtn,hnd->hgtd", p * ~full, vq)
        out[a:a + block] = o.permute(2, 0, 1, 3).reshape(-1, Hq, d)
    return out


def decode_step(sc: SlotCodec, q: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor], middle: torch.Tensor,
                tail: tuple[torch.Tensor, torch.Tensor], scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One decode query's attention straight from the codes (:func:`wushkv.decode.decode_attention`: the fused CPU
    kernels): q (Hq, d) over the full-precision ``head`` (keys, values (H, S, d): the sink), the ``middle`` cells
    (H, m, C) and the full-precision ``tail`` (H, R, d: the recent window, the new token last). The same attention as
    :func:`attend` for a query at the last position whose window copies are all known. Returns float32 (Hq, d)."""
    st = sc.stores(middle)
    m = middle.shape[1]
    parts_k = [head[0][None].float(), (sc.codecs["key"], st["key"], m), tail[0][None].float()]
    parts_v = [head[1][None].float(), (sc.codecs["value"], st["value"], m), tail[1][None].float()]
    out = decode_attention(q[None, :, None].float(), parts_k, parts_v, None, scale, softcap if softcap > 0 else None)
    return out[0, 0]
